//! What the reconcilers work with: the store, the configuration (QEMU binary,
//! directories), the operations locks, a way to wake an object, and the
//! registries each subsystem keeps in memory (the live VMs, the snapshot
//! actors' senders and export pins, the image imports, the guest exec
//! sessions, the host-networking lock, the disks' plans, the metrics). The
//! engine owns one `Context` and hands it to every reconcile.
//!
//! A leaf: each registry is plain data in a leaf module of the subsystem that
//! owns it (`vm::registry`, `snapshot::registry`, `image::registry`,
//! `guest::sessions`, `network::host::lock`, `disk::registry`,
//! `metrics::registry`); the code that works with them, such as attaching to
//! a VM (`vm::live`) or starting an actor (`snapshot::actor`), lives with its
//! subsystem and imports this, never the other way round. Nothing here knows
//! the engine's command surface or its work queue (a wake is a message the
//! engine's queue picks up).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hearth_api::{
    EventType, Kind, VirtualDiskStatus, VirtualImageStatus, VirtualMachine, VirtualMachineStatus,
};
use tokio::sync::mpsc::UnboundedSender;

use crate::config::EngineConfig;
use crate::runtime::RuntimeRecord;
use crate::store::{Store, StoreError};
use crate::vm::registry::{LiveVm, LiveVms};

/// Why a reconcile failed; the engine retries it with backoff.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("{0}")]
    Failed(String),
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

/// What a reconcile wants next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Nothing until a wake or the periodic resync.
    Done,
    /// Run again after this long, whatever happens meanwhile.
    RequeueAfter(Duration),
}

/// One object to reconcile.
pub type Key = (Kind, String);

pub struct Context {
    pub config: EngineConfig,
    pub store: Store,
    /// The live VMs; `ensure_live` (in `vm::live`) attaches to one.
    pub(crate) live: LiveVms,
    /// Per VM or disk: held while a VM starts or stops and for a whole
    /// snapshot cut, so the two never interleave.
    ops_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// The freeze coordinators, one per VM (or unattached disk).
    pub snapshots: crate::snapshot::registry::Actors,
    /// The running VirtualImage imports, one per image at most.
    pub imports: crate::image::registry::Imports,
    /// Disk snapshots an export is reading: their deletes wait.
    pub exports: crate::snapshot::registry::Pins,
    /// Programs started in guests through `hearth exec`, until collected.
    pub execs: crate::guest::sessions::Execs,
    /// Where wakes go: the engine's work queue.
    wakes: UnboundedSender<Key>,
    /// Held by an apply from its network checks until its objects are
    /// written, and by a network reconcile while it plans and writes leases:
    /// a lease never lands between an apply's check and its write.
    pub addresses: Mutex<()>,
    /// The host side of networking: one resync at a time.
    pub networking: crate::network::host::lock::HostNetworking,
    /// Reconcile and snapshot histograms for `GET /metrics`.
    pub metrics: crate::metrics::registry::EngineMetrics,
    /// What disk reconciles and resyncs keep between runs.
    pub disks: crate::disk::registry::Disks,
    /// The bound on running VMs' console logs.
    pub consoles: crate::vm::console::Consoles,
}

impl Context {
    pub(crate) fn new(config: EngineConfig, store: Store, wakes: UnboundedSender<Key>) -> Context {
        let consoles = crate::vm::console::Consoles::new(config.console_log_max_bytes);
        Context {
            consoles,
            config,
            store,
            live: LiveVms::default(),
            ops_locks: Mutex::new(HashMap::new()),
            snapshots: Default::default(),
            imports: Default::default(),
            exports: Default::default(),
            execs: Default::default(),
            wakes,
            addresses: Mutex::new(()),
            networking: Default::default(),
            metrics: Default::default(),
            disks: Default::default(),
        }
    }

    /// A context over a fresh store in `dir` (`dir/state`, `dir/run`), for
    /// unit tests of the reconcilers: no state-directory lock, no work
    /// queue (wakes go nowhere), no QEMU.
    #[cfg(test)]
    pub(crate) fn for_test(dir: &std::path::Path) -> Arc<Context> {
        let config = EngineConfig {
            state_dir: dir.join("state"),
            run_dir: dir.join("run"),
            image_roots: vec![],
            qemu_binary: "/usr/bin/qemu-system-x86_64".into(),
            qemu_user: None,
            accel: hearth_qemu::accel::AccelDecision {
                accel: hearth_qemu::Accel::Tcg,
                reason: "test".into(),
            },
            resync_interval: std::time::Duration::from_secs(10),
            images: Default::default(),
            ovmf_code: dir.join("OVMF_CODE.fd"),
            ovmf_vars: dir.join("OVMF_VARS.fd"),
            compaction_speed: 0,
            dns_resolv_file: "/etc/resolv.conf".into(),
            console_log_max_bytes: crate::config::DEFAULT_CONSOLE_LOG_MAX_BYTES,
            forwards: Default::default(),
        };
        std::fs::create_dir_all(&config.state_dir).expect("create the test state directory");
        let store = Store::open(&config.database_path()).expect("open the test store");
        let (wakes, _) = tokio::sync::mpsc::unbounded_channel();
        Arc::new(Context::new(config, store, wakes))
    }

    /// Asks for a reconcile of one object. A hint: the engine's queue runs
    /// it, never twice at once for one object, once more if it is running.
    pub fn wake(&self, kind: Kind, name: &str) {
        // Fails only once the engine is gone, when nothing is left to wake.
        let _ = self.wakes.send((kind, name.to_string()));
    }

    /// The VMs that use `disk`: first those whose running QEMU has it (what
    /// the process was started with, whatever the spec says now: a disk just
    /// removed from a spec is still written until the VM restarts), then
    /// those whose spec lists it.
    /// Both by index (running QEMUs, the specs' disk claims): nothing is
    /// read for the VMs that do not use it (every new disk asks).
    pub fn vms_using_disk(&self, disk: &str) -> Result<Vec<String>, StoreError> {
        let (running, listed) = self.store.with_tx(|tx| {
            let mut stmt = tx.prepare(
                "SELECT record FROM runtime
                 WHERE EXISTS (SELECT 1 FROM json_each(record, '$.disk_names') WHERE value = ?1)
                 ORDER BY vm",
            )?;
            let running = stmt
                .query_map(rusqlite::params![disk], |r| r.get::<_, String>(0))?
                .collect::<Result<Vec<_>, _>>()?;
            let listed = Store::disk_claimants_tx(tx, disk)?;
            Ok((running, listed))
        })?;
        let mut vms = Vec::new();
        for text in running {
            let r: RuntimeRecord = serde_json::from_str(&text)?;
            if hearth_qemu::process::is_alive(&r.process) {
                vms.push(r.vm);
            }
        }
        for vm in listed {
            if !vms.contains(&vm) {
                vms.push(vm);
            }
        }
        Ok(vms)
    }

    // ------------------------------------------------------------ status & events

    pub fn event(&self, kind: Kind, name: &str, type_: EventType, reason: &str, message: &str) {
        tracing::info!(kind = kind.as_str(), name, reason, "{message}");
        if let Err(e) = self.store.record_event(kind, name, type_, reason, message) {
            tracing::warn!(error = %e, "cannot record event");
        }
    }

    /// An event about a source of manifests (a git repository's Stale,
    /// Unverified, HistoryRewritten): in `hearth events` beside the
    /// objects'.
    pub fn source_event(&self, source: &str, type_: EventType, reason: &str, message: &str) {
        match type_ {
            EventType::Warning => tracing::warn!(source, reason, "{message}"),
            EventType::Normal => tracing::info!(source, reason, "{message}"),
        }
        if let Err(e) = self
            .store
            .record_source_event(source, type_, reason, message)
        {
            tracing::warn!(error = %e, "cannot record event");
        }
    }

    pub fn set_vm_status(&self, name: &str, f: impl FnOnce(&mut VirtualMachineStatus)) {
        if let Err(e) = self.store.update_status(Kind::VirtualMachine, name, f) {
            tracing::warn!(vm = name, error = %e, "cannot write status");
        }
    }

    /// A VM's status and the event that explains it, in one transaction:
    /// whoever sees the new phase also finds why.
    pub fn set_vm_status_with_event(
        &self,
        name: &str,
        f: impl FnOnce(&mut VirtualMachineStatus),
        type_: EventType,
        reason: &str,
        message: &str,
    ) {
        tracing::info!(kind = "VirtualMachine", name, reason, "{message}");
        let now = chrono::Utc::now();
        let written = self.store.with_tx(|tx| {
            Store::update_status_tx(tx, Kind::VirtualMachine, name, f)?;
            Store::record_event_tx(tx, now, Kind::VirtualMachine, name, type_, reason, message)
        });
        if let Err(e) = written {
            tracing::warn!(vm = name, error = %e, "cannot write status and event");
        }
    }

    pub fn set_snapshot_status(
        &self,
        kind: Kind,
        name: &str,
        f: impl FnOnce(&mut hearth_api::SnapshotStatus),
    ) {
        if let Err(e) = self.store.update_status(kind, name, f) {
            tracing::warn!(snapshot = name, error = %e, "cannot write status");
        }
    }

    pub fn set_disk_status(&self, name: &str, f: impl FnOnce(&mut VirtualDiskStatus)) {
        if let Err(e) = self.store.update_status(Kind::VirtualDisk, name, f) {
            tracing::warn!(disk = name, error = %e, "cannot write status");
        }
    }

    pub fn set_image_status(&self, name: &str, f: impl FnOnce(&mut VirtualImageStatus)) {
        if let Err(e) = self.store.update_status(Kind::VirtualImage, name, f) {
            tracing::warn!(image = name, error = %e, "cannot write status");
        }
    }

    // ------------------------------------------------------------ operations locks

    /// The operations lock of `vm/NAME` or `disk/NAME`.
    pub fn ops_lock(&self, target: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.ops_locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(target.to_string())
            .or_default()
            .clone()
    }

    /// Takes the operations locks of a VM and of each of its disks, in a
    /// fixed order (VM first, disks sorted), for a start or a stop.
    pub async fn lock_vm_ops(&self, vm: &VirtualMachine) -> Vec<tokio::sync::OwnedMutexGuard<()>> {
        // A chain compaction holding them cancels its job rather than make
        // a stop or restore wait for it (docs/snapshots.md, "Compaction").
        self.snapshots
            .ask_to_yield(&format!("vm/{}", vm.metadata.name));
        let mut guards = vec![
            self.ops_lock(&format!("vm/{}", vm.metadata.name))
                .lock_owned()
                .await,
        ];
        let mut disks: Vec<&str> = vm
            .spec
            .disks
            .iter()
            .map(|d| d.virtual_disk_name.as_str())
            .collect();
        disks.sort();
        for d in disks {
            guards.push(self.ops_lock(&format!("disk/{d}")).lock_owned().await);
        }
        guards
    }

    // ------------------------------------------------------------ live VMs

    pub fn live_get(&self, vm: &str) -> Option<Arc<LiveVm>> {
        self.live.get(vm)
    }

    pub fn take_live(&self, vm: &str) -> Option<Arc<LiveVm>> {
        self.live.take(vm)
    }

    pub fn drop_live(&self, vm: &str) {
        self.take_live(vm);
    }

    pub fn live_agent_connected(&self, vm: &str) -> bool {
        self.live_get(vm)
            .is_some_and(|l| l.agent_connected.load(std::sync::atomic::Ordering::SeqCst))
    }
}
