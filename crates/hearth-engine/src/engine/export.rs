//! Export of a disk snapshot as one standalone image (docs/snapshots.md
//! "Export"); the pins and the sweep live in `snapshot::export`.

use hearth_api::{Kind, Object, SnapshotPhase, SnapshotStatus};

use super::errors::ExportError;
use super::{Engine, RequestError};
use crate::snapshot::export::{CONVERT_TIMEOUT, Export, ExportFormat, TempFile, exports_dir};
use crate::snapshot::storage;

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
            return Err(RequestError::not_found(Kind::VirtualDiskSnapshot, name));
        }
        let pin = self.ctx.exports.of(name);
        let _pinned = pin.read().await;
        let stored = self
            .ctx
            .store
            .get(Kind::VirtualDiskSnapshot, name)?
            .ok_or_else(|| RequestError::not_found(Kind::VirtualDiskSnapshot, name))?;
        let Object::VirtualDiskSnapshot(_) = &stored.object else {
            return Err(RequestError::not_found(Kind::VirtualDiskSnapshot, name));
        };
        if stored.deleting {
            return Err(RequestError::deleting(
                Kind::VirtualDiskSnapshot,
                name,
                "; nothing was exported",
            ));
        }
        let status: SnapshotStatus =
            serde_json::from_value(stored.status.clone()).unwrap_or_default();
        if status.phase != SnapshotPhase::Ready {
            return Err(ExportError::NotReady {
                snapshot: name.to_string(),
                phase: status.phase,
                reason: status.reason,
                message: status.message,
            }
            .into());
        }
        let layer = storage::snapshot_layer(&self.ctx.store, name)?.ok_or_else(|| {
            ExportError::NoLayer {
                snapshot: name.to_string(),
            }
        })?;
        let dir = exports_dir(&self.ctx.config.state_dir);
        std::fs::create_dir_all(&dir).map_err(|error| ExportError::CreateDir {
            dir: dir.clone(),
            error,
        })?;
        let _ = std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700));
        let n = self.ctx.store.next_counter("export")?;
        let temp = TempFile(dir.join(format!("{n:08}-{name}.{}", format.as_str())));
        hearth_qemu::img::convert_standalone(
            &layer.path,
            "qcow2",
            &temp.0,
            format.as_str(),
            CONVERT_TIMEOUT,
        )
        .await
        .map_err(|reason| ExportError::Convert {
            snapshot: name.to_string(),
            format,
            reason,
        })?;
        let info =
            hearth_qemu::img::info(&temp.0)
                .await
                .map_err(|reason| ExportError::Inspect {
                    snapshot: name.to_string(),
                    reason,
                })?;
        let file = std::fs::File::open(&temp.0).map_err(|error| ExportError::Open {
            path: temp.0.clone(),
            error,
        })?;
        let size = file.metadata().map_err(ExportError::Stat)?.len();
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
