//! What hearthd keeps about a QEMU process it started, so it can be adopted
//! after a daemon restart and torn down after its object is gone.

use std::path::PathBuf;

use chrono::{DateTime, Utc};
use hearth_qemu::{Accel, ProcessIdentity};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RuntimeRecord {
    pub vm: String,
    pub process: ProcessIdentity,
    pub qmp_socket: PathBuf,
    pub agent_socket: Option<PathBuf>,
    pub serial_log: PathBuf,
    pub accel: Accel,
    pub started_at: DateTime<Utc>,
    /// The launch-relevant spec the process was started with; a different
    /// current spec means the VM must be restarted to apply it.
    pub spec_fingerprint: String,
    /// The `restart` intent this process satisfies.
    pub restart_nonce: u64,
    /// Disk image files attached, in device order.
    pub disks: Vec<PathBuf>,
    /// The VirtualDisk of each device, in device order: what this process
    /// was started with, whatever the spec says now.
    #[serde(default)]
    pub disk_names: Vec<String>,
}
