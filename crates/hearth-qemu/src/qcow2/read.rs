//! A qcow2 layer's header, its backing chain by name, and its own cluster
//! map (what the layer holds, not what shows through from below).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::{COMPRESSED, EXT_BACKING_FORMAT, MAGIC, OFFSET_MASK, Qcow2Error, ZERO};

/// Incompatible feature bits (version 3).
const DIRTY: u64 = 1 << 0;
const CORRUPT: u64 = 1 << 1;
/// Only the compression type: it matters for compressed clusters alone,
/// which are refused when met.
const COMPRESSION_TYPE: u64 = 1 << 3;
/// A chain deeper than this is taken for a loop.
const MAX_CHAIN: usize = 4096;
/// QEMU's own bound on an L1 table (32 MiB of entries).
const MAX_L1_ENTRIES: u64 = 32 << 20 >> 3;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub cluster_bits: u32,
    /// The guest-visible size in bytes.
    pub size: u64,
    pub backing_file: Option<String>,
    pub backing_format: Option<String>,
    l1_size: u64,
    l1_table_offset: u64,
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn io<'a>(path: &'a Path, action: &'static str) -> impl FnOnce(std::io::Error) -> Qcow2Error + 'a {
    move |source| Qcow2Error::Io {
        path: path.to_path_buf(),
        action,
        source,
    }
}

/// Reads `buf.len()` bytes at `at`, or fewer at the end of the file; how
/// many.
fn read_upto(file: &File, buf: &mut [u8], at: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], at + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

impl Header {
    /// The header of `file` (at `path`, for errors): `NotQcow2` when the
    /// magic is not there.
    pub fn read(file: &File, path: &Path) -> Result<Self, Qcow2Error> {
        let corrupt = |what: String| Qcow2Error::Corrupt {
            path: path.to_path_buf(),
            what,
        };
        let unsupported = |what: String| Qcow2Error::Unsupported {
            path: path.to_path_buf(),
            what,
        };
        let mut b = [0u8; 104];
        let got = read_upto(file, &mut b, 0).map_err(io(path, "reading the header"))?;
        if got < 72 || be32(&b, 0) != MAGIC {
            return Err(Qcow2Error::NotQcow2 {
                path: path.to_path_buf(),
            });
        }
        let version = be32(&b, 4);
        if version != 2 && version != 3 {
            return Err(unsupported(format!("version {version}")));
        }
        let cluster_bits = be32(&b, 20);
        if !(9..=21).contains(&cluster_bits) {
            return Err(corrupt(format!("cluster_bits {cluster_bits}")));
        }
        let cluster_size = 1u64 << cluster_bits;
        if be32(&b, 32) != 0 {
            return Err(unsupported("encrypted".into()));
        }
        let header_length = if version == 3 {
            if got < 104 {
                return Err(corrupt("a version 3 header shorter than 104 bytes".into()));
            }
            let incompatible = be64(&b, 72);
            if incompatible & CORRUPT != 0 {
                return Err(corrupt("marked corrupt by QEMU".into()));
            }
            if incompatible & DIRTY != 0 {
                return Err(unsupported(
                    "marked dirty (lazy refcounts, not closed cleanly)".into(),
                ));
            }
            if incompatible & !COMPRESSION_TYPE != 0 {
                return Err(unsupported(format!(
                    "incompatible features {:#x}",
                    incompatible & !COMPRESSION_TYPE
                )));
            }
            if be32(&b, 96) > 6 {
                return Err(corrupt(format!("refcount_order {}", be32(&b, 96))));
            }
            u64::from(be32(&b, 100))
        } else {
            72
        };
        if header_length < 72 || !header_length.is_multiple_of(8) || header_length >= cluster_size {
            return Err(corrupt(format!("header_length {header_length}")));
        }
        let backing_file_offset = be64(&b, 8);
        let backing_file_size = u64::from(be32(&b, 16));
        let backing_file = if backing_file_offset == 0 {
            None
        } else {
            if backing_file_size == 0 || backing_file_size > 1023 {
                return Err(corrupt(format!(
                    "backing file name of {backing_file_size} bytes"
                )));
            }
            let mut name = vec![0u8; backing_file_size as usize];
            let n = read_upto(file, &mut name, backing_file_offset)
                .map_err(io(path, "reading the backing file name"))?;
            if n != name.len() {
                return Err(corrupt("the backing file name is past the end".into()));
            }
            Some(
                String::from_utf8(name)
                    .map_err(|_| unsupported("a backing file name not in UTF-8".into()))?,
            )
        };
        // Header extensions: from the header's end to the backing file name
        // (or the end of the first cluster). As in QEMU, an area that ends
        // without the end marker ends the list (a backing name right after
        // the header leaves no room for one).
        let end = match backing_file_offset {
            0 => cluster_size,
            o => o.min(cluster_size),
        };
        let mut backing_format = None;
        let mut at = header_length;
        while at < end {
            if at + 8 > end {
                return Err(corrupt("header extensions run past their space".into()));
            }
            let mut h = [0u8; 8];
            read_upto(file, &mut h, at).map_err(io(path, "reading a header extension"))?;
            let (kind, len) = (be32(&h, 0), u64::from(be32(&h, 4)));
            if kind == 0 {
                break;
            }
            let data_at = at + 8;
            if data_at + len > end {
                return Err(corrupt(format!("header extension {kind:#x} too long")));
            }
            if kind == EXT_BACKING_FORMAT {
                let mut f = vec![0u8; len as usize];
                read_upto(file, &mut f, data_at).map_err(io(path, "reading the backing format"))?;
                backing_format = Some(
                    String::from_utf8(f)
                        .map_err(|_| corrupt("a backing format not in UTF-8".into()))?,
                );
            }
            at = data_at + len.div_ceil(8) * 8;
        }
        let l1_size = u64::from(be32(&b, 36));
        let size = be64(&b, 24);
        let l2_entries = cluster_size / 8;
        let needed = size.div_ceil(cluster_size).div_ceil(l2_entries);
        if l1_size < needed || l1_size > MAX_L1_ENTRIES {
            return Err(corrupt(format!(
                "an L1 table of {l1_size} entries for {size} bytes"
            )));
        }
        let l1_table_offset = be64(&b, 40);
        if !l1_table_offset.is_multiple_of(cluster_size) {
            return Err(corrupt(format!("L1 table at {l1_table_offset:#x}")));
        }
        Ok(Self {
            version,
            cluster_bits,
            size,
            backing_file,
            backing_format,
            l1_size,
            l1_table_offset,
        })
    }

    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// How many clusters the guest sees (the last may be partly past the
    /// size).
    pub fn guest_clusters(&self) -> u64 {
        self.size.div_ceil(self.cluster_size())
    }
}

/// What one layer holds for a guest cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// Data, at this offset of the layer's file.
    Data(u64),
    /// Reads as zeroes (whatever is below).
    Zero,
}

/// One qcow2 layer, open, with what it holds itself.
#[derive(Debug)]
pub struct Layer {
    pub path: PathBuf,
    pub header: Header,
    file: File,
    /// Guest cluster index → what this layer holds there, ascending; a
    /// cluster that is not here reads from the backing file.
    pub clusters: Vec<(u64, Entry)>,
}

impl Layer {
    /// Opens `path` and reads its L1 and L2 tables: `Unsupported` past
    /// `max_clusters` held clusters (what the map would take in memory).
    pub fn open(path: &Path, max_clusters: usize) -> Result<Self, Qcow2Error> {
        let file = File::open(path).map_err(io(path, "opening"))?;
        let header = Header::read(&file, path)?;
        let corrupt = |what: String| Qcow2Error::Corrupt {
            path: path.to_path_buf(),
            what,
        };
        let cs = header.cluster_size();
        let l2_entries = cs / 8;
        let guest = header.guest_clusters();
        let used_l1 = guest.div_ceil(l2_entries);
        let mut l1 = vec![0u8; (used_l1 * 8) as usize];
        let n = read_upto(&file, &mut l1, header.l1_table_offset)
            .map_err(io(path, "reading the L1 table"))?;
        if n != l1.len() {
            return Err(corrupt("the L1 table is past the end".into()));
        }
        let len = file
            .metadata()
            .map_err(io(path, "reading"))
            .map(|m| m.len())?;
        let mut clusters = Vec::new();
        let mut l2 = vec![0u8; cs as usize];
        for i in 0..used_l1 {
            let entry = be64(&l1, (i * 8) as usize);
            let at = entry & OFFSET_MASK;
            if at == 0 {
                continue;
            }
            if !at.is_multiple_of(cs) || at + cs > len.next_multiple_of(cs) {
                return Err(corrupt(format!("L1 entry {i} points at {at:#x}")));
            }
            let n = read_upto(&file, &mut l2, at).map_err(io(path, "reading an L2 table"))?;
            l2[n..].fill(0);
            for j in 0..l2_entries {
                let guest_cluster = i * l2_entries + j;
                if guest_cluster >= guest {
                    break;
                }
                let e = be64(&l2, (j * 8) as usize);
                if e & COMPRESSED != 0 {
                    return Err(Qcow2Error::Unsupported {
                        path: path.to_path_buf(),
                        what: format!(
                            "a compressed cluster at guest offset {:#x}",
                            guest_cluster * cs
                        ),
                    });
                }
                let host = e & OFFSET_MASK;
                if !host.is_multiple_of(cs) {
                    return Err(corrupt(format!(
                        "guest cluster {guest_cluster} at an unaligned {host:#x}"
                    )));
                }
                if clusters.len() >= max_clusters && (e & (ZERO | OFFSET_MASK)) != 0 {
                    return Err(Qcow2Error::Unsupported {
                        path: path.to_path_buf(),
                        what: format!("more than {max_clusters} clusters held"),
                    });
                }
                if header.version == 3 && e & ZERO != 0 {
                    clusters.push((guest_cluster, Entry::Zero));
                } else if host != 0 {
                    clusters.push((guest_cluster, Entry::Data(host)));
                }
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            header,
            file,
            clusters,
        })
    }

    /// One cluster of data at `host` in this layer's file into `buf` (a
    /// cluster long); past the file's end it reads as zeroes, as in QEMU.
    pub fn read_cluster(&self, host: u64, buf: &mut [u8]) -> Result<(), Qcow2Error> {
        let n = read_upto(&self.file, buf, host).map_err(io(&self.path, "reading a cluster"))?;
        buf[n..].fill(0);
        Ok(())
    }
}

/// A layer of a chain, as `qemu-img info --backing-chain` names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainLayer {
    /// Canonical.
    pub path: PathBuf,
    pub format: &'static str,
    pub virtual_size: u64,
}

/// A chain, top first, read from the headers alone.
pub struct Chain;

impl Chain {
    /// `top` and every image below it, by the backing names in the
    /// headers (relative ones from the image's own folder, as QEMU reads
    /// them). A raw image (named so, or without the qcow2 magic when no
    /// format is named) ends it; any other format is unsupported.
    pub fn read(top: &Path) -> Result<Vec<ChainLayer>, Qcow2Error> {
        let mut out = Vec::new();
        let mut path = std::fs::canonicalize(top).map_err(io(top, "resolving"))?;
        let mut format: Option<String> = Some("qcow2".into());
        loop {
            if out.len() >= MAX_CHAIN {
                return Err(Qcow2Error::Corrupt {
                    path: top.to_path_buf(),
                    what: format!("a backing chain deeper than {MAX_CHAIN} (a loop?)"),
                });
            }
            let file = File::open(&path).map_err(io(&path, "opening"))?;
            let raw = |file: &File, path: PathBuf| -> Result<ChainLayer, Qcow2Error> {
                let virtual_size = file.metadata().map_err(io(&path, "reading"))?.len();
                Ok(ChainLayer {
                    path,
                    format: "raw",
                    virtual_size,
                })
            };
            let header = match format.as_deref() {
                Some("raw") => {
                    out.push(raw(&file, path)?);
                    return Ok(out);
                }
                Some("qcow2") => Header::read(&file, &path)?,
                None => match Header::read(&file, &path) {
                    Err(Qcow2Error::NotQcow2 { .. }) => {
                        out.push(raw(&file, path)?);
                        return Ok(out);
                    }
                    other => other?,
                },
                Some(other) => {
                    return Err(Qcow2Error::Unsupported {
                        path,
                        what: format!("a layer in format {other:?}"),
                    });
                }
            };
            out.push(ChainLayer {
                path: path.clone(),
                format: "qcow2",
                virtual_size: header.size,
            });
            let Some(name) = header.backing_file else {
                return Ok(out);
            };
            if name.starts_with("json:") || name.contains("://") {
                return Err(Qcow2Error::Unsupported {
                    path,
                    what: format!("a backing file given as {name:?}"),
                });
            }
            let next = match Path::new(&name).is_absolute() {
                true => PathBuf::from(&name),
                false => path.parent().unwrap_or(Path::new("/")).join(&name),
            };
            path = std::fs::canonicalize(&next).map_err(io(&next, "resolving the backing file"))?;
            format = header.backing_format;
        }
    }
}
