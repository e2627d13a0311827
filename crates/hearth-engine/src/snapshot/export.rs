//! Export of a disk snapshot as one standalone image file (no backing file),
//! for `GET /v1/virtualdisksnapshots/{name}/export` (docs/snapshots.md
//! "Export").
//!
//! hearthd never writes to a path a client names: it converts the
//! snapshot's layer chain into a private file under `STATE/exports/`, opens
//! it, unlinks it at once and hands the open file to the API, which streams
//! it. So the copy takes space only while someone reads it: a finished
//! stream, a client that went away and even a crashed daemon (whose open
//! files the kernel closes) all leave nothing behind. Only a crash in the
//! middle of a conversion leaves a named file, which the next start removes
//! (`sweep`).
//!
//! While the conversion reads the layers, the snapshot is *pinned*: its
//! delete waits for the pin (and says so in an event), so the layers it
//! reads are never collected under it. Nothing else can change them: a
//! layer below a head is never written, and a restore only puts a new
//! overlay over it.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// A conversion may take long (it copies every allocated byte of the chain).
pub(crate) const CONVERT_TIMEOUT: Duration = Duration::from_secs(6 * 3600);

/// The formats an export can be written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportFormat {
    Qcow2,
    Raw,
}

/// A format name an export cannot be written in.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("format {0:?} is not one an export can be written in (use qcow2 or raw)")]
pub struct UnknownFormat(pub String);

impl ExportFormat {
    pub fn parse(s: &str) -> Result<ExportFormat, UnknownFormat> {
        match s {
            "qcow2" => Ok(ExportFormat::Qcow2),
            "raw" => Ok(ExportFormat::Raw),
            other => Err(UnknownFormat(other.to_string())),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ExportFormat::Qcow2 => "qcow2",
            ExportFormat::Raw => "raw",
        }
    }
}

/// A finished export: the open image file, already unlinked.
pub struct Export {
    pub file: std::fs::File,
    /// Bytes the stream will carry (the file's length).
    pub size: u64,
    pub format: ExportFormat,
    /// The disk's size, as the guest sees it.
    pub virtual_size: u64,
}

/// `STATE/exports`: conversions in progress, nothing else.
pub fn exports_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("exports")
}

/// Removes what a crash in the middle of a conversion left. Run at start-up,
/// before the API serves.
pub fn sweep(state_dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(exports_dir(state_dir)) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| std::fs::remove_file(e.path()).is_ok())
        .count()
}

/// The conversion's file while it is being written: removed when dropped,
/// whether the conversion finished, failed or was cancelled (the client went
/// away and the request's future was dropped, which also kills qemu-img).
pub(crate) struct TempFile(pub(crate) PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_qcow2_and_raw_only() {
        assert_eq!(ExportFormat::parse("qcow2"), Ok(ExportFormat::Qcow2));
        assert_eq!(ExportFormat::parse("raw"), Ok(ExportFormat::Raw));
        let err = ExportFormat::parse("vmdk").expect_err("vmdk").to_string();
        assert!(
            err.contains("\"vmdk\"") && err.contains("qcow2 or raw"),
            "{err}"
        );
    }

    #[test]
    fn a_conversion_file_goes_with_its_guard_and_the_sweep_takes_leftovers() {
        let dir = tempfile::tempdir().unwrap();
        let exports = exports_dir(dir.path());
        std::fs::create_dir_all(&exports).unwrap();
        let p = exports.join("00000001-s.qcow2");
        std::fs::write(&p, b"x").unwrap();
        drop(TempFile(p.clone()));
        assert!(!p.exists());
        std::fs::write(exports.join("00000002-s.raw"), b"x").unwrap();
        assert_eq!(sweep(dir.path()), 1);
        assert_eq!(std::fs::read_dir(&exports).unwrap().count(), 0);
    }
}
