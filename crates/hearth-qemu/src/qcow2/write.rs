//! A new qcow2 image over a backing file that holds exactly a given set of
//! clusters, written front to back: header, refcount table and blocks, L1,
//! L2 tables, then the data in guest order. Every offset is known before
//! the first byte, so the image goes out in one sequential pass (and can
//! be hashed as it goes), every cluster of the file is counted once and
//! nothing leaks.

use std::collections::BTreeMap;
use std::io::Write;

use super::{COPIED, EXT_BACKING_FORMAT, MAGIC, ZERO};

/// What the new image holds for a guest cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cluster {
    /// Reads as zeroes over whatever the backing file has.
    Zero,
    /// Data, read by the caller's `read` from source `source` at `at`.
    Data { source: usize, at: u64 },
}

/// The image to write.
#[derive(Clone, Debug)]
pub struct NewImage<'a> {
    pub virtual_size: u64,
    pub cluster_bits: u32,
    /// Recorded as given (a relative name resolves from the image's folder).
    pub backing_file: &'a str,
    pub backing_format: &'a str,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Written {
    /// The file's length.
    pub size: u64,
    /// Data bytes copied (whole clusters).
    pub data: u64,
}

const HEADER_LENGTH: u64 = 104;
/// 16-bit refcounts, QEMU's default.
const REFCOUNT_ORDER: u32 = 4;

/// Where everything goes, in clusters from the start of the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub reftable: u64,
    pub refblocks: u64,
    pub l1_entries: u64,
    pub l1_clusters: u64,
    /// The L1 indexes that get an L2 table, ascending.
    pub l2_tables: Vec<u64>,
    pub data: u64,
    pub total: u64,
}

impl Layout {
    pub(crate) fn of(image: &NewImage, clusters: &BTreeMap<u64, Cluster>) -> Self {
        let cs = 1u64 << image.cluster_bits;
        let l2_entries = cs / 8;
        let l1_entries = image.virtual_size.div_ceil(cs).div_ceil(l2_entries).max(1);
        let l1_clusters = (l1_entries * 8).div_ceil(cs);
        let mut l2_tables: Vec<u64> = clusters.keys().map(|g| g / l2_entries).collect();
        l2_tables.dedup();
        let data = clusters
            .values()
            .filter(|c| matches!(c, Cluster::Data { .. }))
            .count() as u64;
        let per_refblock = cs * 8 / (1 << REFCOUNT_ORDER);
        // The refcount structures count themselves: grow until they fit.
        let fixed = 1 + l1_clusters + l2_tables.len() as u64 + data;
        let (mut refblocks, mut reftable) = (1u64, 1u64);
        loop {
            let total = fixed + refblocks + reftable;
            let need_blocks = total.div_ceil(per_refblock);
            let need_table = (need_blocks * 8).div_ceil(cs);
            if need_blocks <= refblocks && need_table <= reftable {
                break;
            }
            refblocks = refblocks.max(need_blocks);
            reftable = reftable.max(need_table);
        }
        Self {
            reftable,
            refblocks,
            l1_entries,
            l1_clusters,
            total: fixed + refblocks + reftable,
            l2_tables,
            data,
        }
    }

    fn l1_at(&self) -> u64 {
        1 + self.reftable + self.refblocks
    }

    fn l2_at(&self) -> u64 {
        self.l1_at() + self.l1_clusters
    }

    fn data_at(&self) -> u64 {
        self.l2_at() + self.l2_tables.len() as u64
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("cannot write this image: {0}")]
    Invalid(String),
}

impl NewImage<'_> {
    /// Writes the image into `out`: `clusters` (guest cluster index →
    /// what it holds), each data cluster read through `read(source, at,
    /// buf)`; `progress(bytes)` after each data cluster.
    pub fn write(
        &self,
        clusters: &BTreeMap<u64, Cluster>,
        mut read: impl FnMut(usize, u64, &mut [u8]) -> std::io::Result<()>,
        out: &mut impl Write,
        mut progress: impl FnMut(u64),
    ) -> Result<Written, WriteError> {
        let invalid = |s: String| Err(WriteError::Invalid(s));
        if !(12..=21).contains(&self.cluster_bits) {
            return invalid(format!("cluster_bits {}", self.cluster_bits));
        }
        let cs = 1u64 << self.cluster_bits;
        let guest = self.virtual_size.div_ceil(cs);
        if let Some((&last, _)) = clusters.last_key_value()
            && last >= guest
        {
            return invalid(format!("guest cluster {last} of {guest}"));
        }
        let name = self.backing_file.as_bytes();
        let format = self.backing_format.as_bytes();
        let format_padded = (format.len() as u64).div_ceil(8) * 8;
        let name_at = HEADER_LENGTH + 8 + format_padded + 8;
        if name.is_empty() || name.len() > 1023 || name_at + name.len() as u64 > cs {
            return invalid(format!("a backing file name of {} bytes", name.len()));
        }
        let layout = Layout::of(self, clusters);
        let mut cluster = vec![0u8; cs as usize];

        // Cluster 0: the header, its extensions, the backing file's name.
        let h = &mut cluster;
        let put32 = |h: &mut [u8], at: u64, v: u32| {
            h[at as usize..at as usize + 4].copy_from_slice(&v.to_be_bytes())
        };
        let put64 = |h: &mut [u8], at: u64, v: u64| {
            h[at as usize..at as usize + 8].copy_from_slice(&v.to_be_bytes())
        };
        put32(h, 0, MAGIC);
        put32(h, 4, 3);
        put64(h, 8, name_at);
        put32(h, 16, name.len() as u32);
        put32(h, 20, self.cluster_bits);
        put64(h, 24, self.virtual_size);
        put32(h, 36, layout.l1_entries as u32);
        put64(h, 40, layout.l1_at() * cs);
        put64(h, 48, cs);
        put32(h, 56, layout.reftable as u32);
        // No snapshots, no features.
        put32(h, 96, REFCOUNT_ORDER);
        put32(h, 100, HEADER_LENGTH as u32);
        put32(h, HEADER_LENGTH, EXT_BACKING_FORMAT);
        put32(h, HEADER_LENGTH + 4, format.len() as u32);
        let f = (HEADER_LENGTH + 8) as usize;
        h[f..f + format.len()].copy_from_slice(format);
        // The end of the extensions: eight zero bytes, already there.
        h[name_at as usize..name_at as usize + name.len()].copy_from_slice(name);
        out.write_all(&cluster)?;

        // The refcount table, then its blocks: every cluster of the file once.
        let mut table = vec![0u8; (layout.reftable * cs) as usize];
        for i in 0..layout.refblocks {
            put64(&mut table, i * 8, (1 + layout.reftable + i) * cs);
        }
        out.write_all(&table)?;
        let per_refblock = cs / 2;
        for i in 0..layout.refblocks {
            cluster.fill(0);
            let first = i * per_refblock;
            for c in first..(first + per_refblock).min(layout.total) {
                let at = ((c - first) * 2) as usize;
                cluster[at..at + 2].copy_from_slice(&1u16.to_be_bytes());
            }
            out.write_all(&cluster)?;
        }

        // L1: the L2 tables in order after it.
        let mut l1 = vec![0u8; (layout.l1_clusters * cs) as usize];
        for (k, &i) in layout.l2_tables.iter().enumerate() {
            put64(&mut l1, i * 8, ((layout.l2_at() + k as u64) * cs) | COPIED);
        }
        out.write_all(&l1)?;

        // L2: data clusters take the data area in guest order.
        let l2_entries = cs / 8;
        let mut next_data = layout.data_at();
        let mut data_order = Vec::with_capacity(layout.data as usize);
        let mut entries = clusters.iter().peekable();
        for &i in &layout.l2_tables {
            cluster.fill(0);
            while let Some((&g, &c)) = entries.next_if(|(g, _)| **g / l2_entries == i) {
                let e = match c {
                    Cluster::Zero => ZERO,
                    Cluster::Data { source, at } => {
                        data_order.push((source, at));
                        next_data += 1;
                        ((next_data - 1) * cs) | COPIED
                    }
                };
                put64(&mut cluster, (g % l2_entries) * 8, e);
            }
            out.write_all(&cluster)?;
        }

        for (source, at) in data_order {
            read(source, at, &mut cluster)?;
            out.write_all(&cluster)?;
            progress(cs);
        }
        out.flush()?;
        Ok(Written {
            size: layout.total * cs,
            data: layout.data * cs,
        })
    }
}
