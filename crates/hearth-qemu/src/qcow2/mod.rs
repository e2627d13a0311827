//! The small part of the qcow2 format hearth reads and writes itself: a
//! layer's header and cluster map, and a new image that holds a known set
//! of clusters over a backing file, written front to back in one pass.
//!
//! Why by hand (docs/backup.md, "The incremental's copy"): an incremental
//! backup point is a few clusters of one or two layers; through `qemu-img`
//! it took four processes (`info`, `map`, `convert`, `check`), whose start
//! and setup were most of its time. The crates that read qcow2 serve guest
//! reads (no per-layer map with zero clusters and backing names), and none
//! writes a new image. Everything outside the subset below is refused with
//! [`Qcow2Error::Unsupported`], and the caller falls back to `qemu-img`.
//!
//! Read: versions 2 and 3, no encryption, no external data file, no
//! extended L2 entries, not marked dirty or corrupt; a compressed cluster
//! is refused when met. Written: version 3, 16-bit refcounts, every cluster
//! counted once, a backing file by name with its format.

mod read;
#[cfg(test)]
mod tests;
mod write;

pub use read::{Chain, ChainLayer, Entry, Header, Layer};
pub use write::{Cluster, NewImage, WriteError, Written};

use std::path::PathBuf;

pub(crate) const MAGIC: u32 = 0x5146_49fb;
/// Header extension: the backing file's format.
pub(crate) const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
/// L1 and L2 entries: bits 9-55 are a host offset.
pub(crate) const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// L1 and L2 entries: the cluster's refcount is exactly one.
pub(crate) const COPIED: u64 = 1 << 63;
/// L2 entries: a compressed cluster.
pub(crate) const COMPRESSED: u64 = 1 << 62;
/// L2 entries (version 3): the cluster reads as zeroes.
pub(crate) const ZERO: u64 = 1;

#[derive(Debug, thiserror::Error)]
pub enum Qcow2Error {
    #[error("{}: {action}: {source}", path.display())]
    Io {
        path: PathBuf,
        action: &'static str,
        source: std::io::Error,
    },
    #[error("{} is not a qcow2 image", path.display())]
    NotQcow2 { path: PathBuf },
    #[error("{}: {what} (not read by hearth itself)", path.display())]
    Unsupported { path: PathBuf, what: String },
    #[error("{} is damaged: {what}", path.display())]
    Corrupt { path: PathBuf, what: String },
}

impl Qcow2Error {
    /// True when `qemu-img` may still read what hearth would not.
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Self::Unsupported { .. } | Self::NotQcow2 { .. })
    }
}
