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
    /// The network interfaces this process was started with, in guest
    /// order: while it runs, the host keeps their taps, addresses and port
    /// forwards, whatever the spec says now (docs/networking.md). `None` in a
    /// record written before interfaces were recorded: its spec stands in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub networks: Option<Vec<LaunchedInterface>>,
}

/// One network interface as a QEMU got it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchedInterface {
    /// Its entry of `spec.networks` at the launch.
    pub spec: hearth_api::NetworkInterface,
    /// The address leased to it at the launch; none on a Bridge network
    /// without a reservation.
    pub ip: Option<std::net::Ipv4Addr>,
}

/// A QEMU launch, recorded durably before the process is spawned and cleared
/// in the same store transaction that records its [`RuntimeRecord`]. One left
/// behind means a daemon died in between: the next one finds that QEMU (see
/// `hearth_qemu::process::find_launched`) and adopts or stops it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LaunchMarker {
    /// From the store's `launch` counter: never repeats.
    pub id: u64,
    pub vm: String,
    /// Written by the launch with QEMU's pid; its path names the launch, so
    /// it is also the token looked for in the process's environment
    /// (`HEARTH_LAUNCH`).
    pub pidfile: PathBuf,
    /// The kernel boot the launch happened in; after a reboot nothing runs.
    pub boot_id: String,
    /// No process that started before this (clock ticks since boot) is ours.
    pub not_before_ticks: u64,
    pub created_at: DateTime<Utc>,
    /// The record the launch writes once QEMU runs. Its `process` is a
    /// placeholder (pid 0) until then.
    pub record: RuntimeRecord,
}
