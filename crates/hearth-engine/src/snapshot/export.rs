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

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hearth_api::{Kind, Object, SnapshotPhase, SnapshotStatus};

use super::storage;
use crate::engine::{Engine, RequestError};

/// A conversion may take long (it copies every allocated byte of the chain).
const CONVERT_TIMEOUT: Duration = Duration::from_secs(6 * 3600);

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

/// Per snapshot: read-held by each export while it converts, write-held by
/// the snapshot's delete.
#[derive(Default)]
pub struct Pins(Mutex<HashMap<String, Arc<tokio::sync::RwLock<()>>>>);

impl Pins {
    pub fn of(&self, snapshot: &str) -> Arc<tokio::sync::RwLock<()>> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(snapshot.to_string())
            .or_default()
            .clone()
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
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Engine {
    /// Converts a Ready disk snapshot into a standalone image and returns
    /// it open (see the module's comment).
    pub async fn export_snapshot(
        &self,
        name: &str,
        format: ExportFormat,
    ) -> Result<Export, RequestError> {
        // A name from a URL: only a valid object name ever becomes part of
        // a file name under the state directory.
        if hearth_api::check_dns_label(name).is_err() {
            return Err(RequestError::NotFound(format!(
                "VirtualDiskSnapshot {name:?} not found"
            )));
        }
        let pin = self.exports.of(name);
        let _pinned = pin.read().await;
        let stored = self
            .store
            .get(Kind::VirtualDiskSnapshot, name)?
            .ok_or_else(|| {
                RequestError::NotFound(format!("VirtualDiskSnapshot {name:?} not found"))
            })?;
        let Object::VirtualDiskSnapshot(_) = &stored.object else {
            return Err(RequestError::NotFound(format!(
                "VirtualDiskSnapshot {name:?} not found"
            )));
        };
        if stored.deleting {
            return Err(RequestError::Conflict(format!(
                "VirtualDiskSnapshot {name:?} is being deleted; nothing was exported"
            )));
        }
        let status: SnapshotStatus =
            serde_json::from_value(stored.status.clone()).unwrap_or_default();
        if status.phase != SnapshotPhase::Ready {
            let why = match (&status.reason, &status.message) {
                (Some(r), Some(m)) => format!(" ({r}: {m})"),
                (Some(r), None) => format!(" ({r})"),
                (None, Some(m)) => format!(" ({m})"),
                (None, None) => String::new(),
            };
            return Err(RequestError::Conflict(format!(
                "VirtualDiskSnapshot {name:?} is {}{why}, not Ready: only a Ready snapshot can be exported",
                status.phase
            )));
        }
        let layer = storage::snapshot_layer(&self.store, name)?.ok_or_else(|| {
            RequestError::Conflict(format!(
                "VirtualDiskSnapshot {name:?} is Ready but has no stored layer"
            ))
        })?;
        let dir = exports_dir(&self.config.state_dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| RequestError::Conflict(format!("cannot create {}: {e}", dir.display())))?;
        let _ = std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700));
        let n = self.store.next_counter("export")?;
        let temp = TempFile(dir.join(format!("{n:08}-{name}.{}", format.as_str())));
        hearth_qemu::img::convert_standalone(
            &layer.path,
            "qcow2",
            &temp.0,
            format.as_str(),
            CONVERT_TIMEOUT,
        )
        .await
        .map_err(|e| {
            RequestError::Conflict(format!(
                "VirtualDiskSnapshot {name:?}: the conversion to {} failed: {e}",
                format.as_str()
            ))
        })?;
        let info = hearth_qemu::img::info(&temp.0)
            .await
            .map_err(|e| RequestError::Conflict(format!("VirtualDiskSnapshot {name:?}: {e}")))?;
        let file = std::fs::File::open(&temp.0).map_err(|e| {
            RequestError::Conflict(format!("cannot open {}: {e}", temp.0.display()))
        })?;
        let size = file
            .metadata()
            .map_err(|e| RequestError::Conflict(format!("cannot stat the export: {e}")))?
            .len();
        // Unlinked now (the guard's drop); the open file is the only way left to it.
        drop(temp);
        Ok(Export {
            file,
            size,
            format,
            virtual_size: info.virtual_size,
        })
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

    #[tokio::test]
    async fn a_delete_waits_for_the_exports_that_hold_the_pin() {
        let pins = Pins::default();
        let read = pins.of("s").read_owned().await;
        assert!(pins.of("s").try_write_owned().is_err(), "pinned");
        assert!(pins.of("other").try_write_owned().is_ok());
        drop(read);
        assert!(pins.of("s").try_write_owned().is_ok());
    }
}
