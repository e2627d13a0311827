//! Where hearthd keeps things and which host paths it may use.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hearth_qemu::accel::AccelDecision;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Database, disk images, console logs. Survives restarts.
    pub state_dir: PathBuf,
    /// Sockets of running VMs.
    pub run_dir: PathBuf,
    /// Kernels, initrds and base images must resolve inside one of these.
    pub image_roots: Vec<PathBuf>,
    pub qemu_binary: PathBuf,
    pub accel: AccelDecision,
    /// How often every object is reconciled even without a hint.
    pub resync_interval: Duration,
    // ---- firmware (see docs/guests.md) ----
    /// OVMF's code image for `firmware: UEFI`, attached read-only.
    pub ovmf_code: PathBuf,
    /// The variables store each UEFI VM's own copy starts from.
    pub ovmf_vars: PathBuf,
}

// ---- firmware and cloud-init files (see docs/guests.md) ----

/// Debian's OVMF (`apt-get install ovmf`): the 4 MiB build, without Secure
/// Boot (that one needs SMM, which hearth does not set up).
pub const DEFAULT_OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
/// The variables template that goes with [`DEFAULT_OVMF_CODE`].
pub const DEFAULT_OVMF_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";

impl EngineConfig {
    /// A UEFI VM's own variables store: copied from `ovmf_vars` on its first
    /// UEFI start, kept across restarts, removed with the VM.
    pub fn uefi_vars_path(&self, vm: &str) -> PathBuf {
        self.vm_state_dir(vm).join("uefi-vars.fd")
    }

    /// A VM's cloud-init NoCloud seed image, rebuilt before each start.
    pub fn cloud_init_seed_path(&self, vm: &str) -> PathBuf {
        self.vm_state_dir(vm).join("cidata.img")
    }
}

impl EngineConfig {
    pub fn database_path(&self) -> PathBuf {
        self.state_dir.join("hearth.db")
    }

    pub fn disks_dir(&self) -> PathBuf {
        self.state_dir.join("disks")
    }

    pub fn disk_path(&self, disk: &str) -> PathBuf {
        self.disks_dir().join(format!("{disk}.qcow2"))
    }

    /// Per-VM files that outlive the VM's process (console log, QEMU's stderr).
    pub fn vm_state_dir(&self, vm: &str) -> PathBuf {
        self.state_dir.join("vms").join(vm)
    }

    pub fn vm_run_dir(&self, vm: &str) -> PathBuf {
        self.run_dir.join("vms").join(vm)
    }

    pub fn serial_log(&self, vm: &str) -> PathBuf {
        self.vm_state_dir(vm).join("serial.log")
    }

    /// Canonicalises a user-supplied host path and checks it lies inside an
    /// allowed root, so a manifest cannot hand QEMU an arbitrary host file.
    pub fn confine(&self, path: &Path) -> Result<PathBuf, String> {
        let real = std::fs::canonicalize(path).map_err(|e| format!("{}: {}", path.display(), e))?;
        let meta = std::fs::metadata(&real).map_err(|e| format!("{}: {}", real.display(), e))?;
        if !meta.is_file() {
            return Err(format!("{} is not a regular file", real.display()));
        }
        for root in &self.image_roots {
            if let Ok(root) = std::fs::canonicalize(root)
                && real.starts_with(&root)
            {
                return Ok(real);
            }
        }
        let roots: Vec<String> = self
            .image_roots
            .iter()
            .map(|r| r.display().to_string())
            .collect();
        Err(format!(
            "{} is outside the allowed image roots ({}); start hearthd with --image-root DIR to allow another directory",
            real.display(),
            roots.join(", ")
        ))
    }
}
