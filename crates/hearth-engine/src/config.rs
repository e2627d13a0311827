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
    /// The user every QEMU runs as; `None`: as hearthd itself (root), the
    /// escape hatch `--qemu-user root`.
    pub qemu_user: Option<hearth_qemu::handover::QemuUser>,
    pub accel: AccelDecision,
    /// How often every object is reconciled even without a hint.
    pub resync_interval: Duration,
    /// VirtualImage imports: timeouts, size limit, retry backoff.
    pub images: ImageImportConfig,
    /// The loopback port forwards' connection bounds and timeouts.
    pub forwards: crate::network::host::loopback::ForwardLimits,
    // ---- firmware (see docs/guests.md) ----
    /// OVMF's code image for `firmware: UEFI`, attached read-only.
    pub ovmf_code: PathBuf,
    /// The variables store each UEFI VM's own copy starts from.
    pub ovmf_vars: PathBuf,
    /// Bytes per second a running VM's chain compaction may copy (QMP
    /// `block-stream`'s `speed`); 0: unlimited.
    pub compaction_speed: u64,
    /// The resolver file (`nameserver` lines) whose servers a NAT network's
    /// DNS forwards guests' queries to (dnsmasq's `resolv-file`).
    pub dns_resolv_file: PathBuf,
    /// Bytes of a console log kept on disk at most (its oldest part is
    /// punched out past it, `vm::console`); 0: unbounded.
    pub console_log_max_bytes: u64,
}

/// The console log bound by default: a boot's output many times over.
pub const DEFAULT_CONSOLE_LOG_MAX_BYTES: u64 = 8 << 20;

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

/// What an import leaves free by default: room for the database and for
/// the guests' disks to keep growing a while after an import is stopped.
pub const DEFAULT_FREE_SPACE_RESERVE: u64 = 1 << 30;

/// Limits of a VirtualImage import (see docs/images.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageImportConfig {
    /// Longest wait for a TCP (and TLS) connection to the server.
    pub connect_timeout: Duration,
    /// Longest time without a byte from the server: waiting for the response
    /// headers, then between two pieces of the body. A stalled server fails
    /// the attempt instead of holding it forever.
    pub read_timeout: Duration,
    /// Largest image accepted, in bytes (the source's length or what was
    /// read so far, whichever says more first).
    pub max_bytes: u64,
    /// Bytes an import always leaves free on the image store's filesystem
    /// (the state directory's: the database and every disk's layers live
    /// there too). An import that would leave less stops with `NoSpace`.
    pub free_space_reserve: u64,
    /// The first retry's delay; each further failure doubles it.
    pub retry_base: Duration,
    /// The longest delay between two attempts.
    pub retry_max: Duration,
    /// Trust per registry host (`HOST[:PORT]`), for images whose manifest
    /// says nothing of it: an Ignite manifest, used as it is, names only
    /// the reference. The image's own `caFile`, `credentialsFile` and
    /// `insecure` come first.
    pub registries: std::collections::BTreeMap<String, RegistryTrust>,
}

/// What hearthd itself knows of one registry host (hearthd's
/// `--registry-ca`, `--registry-credentials`, `--registry-insecure`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegistryTrust {
    /// A PEM file of CA certificates the registry's certificate chains to.
    pub ca_file: Option<PathBuf>,
    /// A JSON file `{"username": .., "password": ..}`.
    pub credentials_file: Option<PathBuf>,
    /// Plain http to this host.
    pub insecure: bool,
}

impl ImageImportConfig {
    /// The daemon's trust for the registry of `reference` (`HOST/REPO:TAG`).
    pub fn registry_trust(&self, reference: &str) -> RegistryTrust {
        let host = reference.split('/').next().unwrap_or_default();
        self.registries.get(host).cloned().unwrap_or_default()
    }
}

impl Default for ImageImportConfig {
    fn default() -> Self {
        ImageImportConfig {
            connect_timeout: Duration::from_secs(30),
            read_timeout: Duration::from_secs(60),
            max_bytes: 256 << 30,
            free_space_reserve: DEFAULT_FREE_SPACE_RESERVE,
            retry_base: Duration::from_secs(2),
            retry_max: Duration::from_secs(300),
            registries: Default::default(),
        }
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

    /// The content-addressed image store: `sha256-<hex>.<format>` files,
    /// and the temporaries of imports in progress (`.import-*.tmp`).
    pub fn images_dir(&self) -> PathBuf {
        self.state_dir.join("images")
    }

    /// Per-VM files that outlive the VM's process (console log, QEMU's stderr).
    pub fn vm_state_dir(&self, vm: &str) -> PathBuf {
        self.state_dir.join("vms").join(vm)
    }

    /// One directory per network's dnsmasq (config, hosts, pid, log).
    /// Under the run directory, which is 0711 so that dnsmasq, once it drops
    /// to `nobody`, can still reread its hosts file (docs/networking.md).
    pub fn networks_dir(&self) -> PathBuf {
        self.run_dir.join("networks")
    }

    /// Kernels and initrds from images, where the QEMU user can read them
    /// (`VM.kernel`, `VM.initrd`; vm/boot.rs).
    pub fn boot_files_dir(&self) -> PathBuf {
        self.run_dir.join("boot")
    }

    pub fn vm_run_dir(&self, vm: &str) -> PathBuf {
        self.run_dir.join("vms").join(vm)
    }

    pub fn serial_log(&self, vm: &str) -> PathBuf {
        self.vm_state_dir(vm).join("serial.log")
    }

    /// The console of the VM's previous start: [`serial_log`](Self::serial_log)
    /// as its QEMU left it, moved aside when the next QEMU is launched.
    pub fn serial_log_previous(&self, vm: &str) -> PathBuf {
        self.vm_state_dir(vm).join("serial.previous.log")
    }

    /// QEMU's own stdout and stderr, appended by every launch of the VM
    /// (why a start failed or QEMU died).
    pub fn qemu_log(&self, vm: &str) -> PathBuf {
        self.vm_state_dir(vm).join("qemu.log")
    }

    /// The serial port's unix socket (QEMU serves it; `hearth console`
    /// attaches through hearthd). Next to `agent.sock`, so as short.
    pub fn serial_socket(&self, vm: &str) -> PathBuf {
        self.vm_run_dir(vm).join("serial.sock")
    }

    /// Canonicalises a user-supplied host path and checks it lies inside an
    /// allowed root, so a manifest cannot hand QEMU an arbitrary host file.
    pub fn confine(&self, path: &Path) -> Result<PathBuf, ConfigError> {
        self.confine_as(path, false)
    }

    /// As [`EngineConfig::confine`], for a directory (an OCI image layout).
    pub fn confine_dir(&self, path: &Path) -> Result<PathBuf, ConfigError> {
        self.confine_as(path, true)
    }

    fn confine_as(&self, path: &Path, dir: bool) -> Result<PathBuf, ConfigError> {
        let real = std::fs::canonicalize(path).map_err(|source| ConfigError::Unreadable {
            path: path.to_path_buf(),
            source,
        })?;
        let meta = std::fs::metadata(&real).map_err(|source| ConfigError::Unreadable {
            path: real.clone(),
            source,
        })?;
        if dir && !meta.is_dir() {
            return Err(ConfigError::NotADirectory { path: real });
        }
        if !dir && !meta.is_file() {
            return Err(ConfigError::NotAFile { path: real });
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
        Err(ConfigError::OutsideRoots {
            path: real,
            roots: roots.join(", "),
        })
    }
}

/// Why a host path given in a manifest may not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: {source}", path.display())]
    Unreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not a regular file", path.display())]
    NotAFile { path: PathBuf },
    #[error("{} is not a directory", path.display())]
    NotADirectory { path: PathBuf },
    #[error(
        "{} is outside the allowed image roots ({roots}); start hearthd with --image-root DIR to allow another directory",
        path.display()
    )]
    OutsideRoots { path: PathBuf, roots: String },
}
