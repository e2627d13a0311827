//! What the reconcilers work with: the store, the configuration (QEMU binary,
//! directories), the live VMs, the operations locks, the snapshot actors and
//! a way to wake an object. The engine owns one `Context` and hands it to
//! every reconcile; nothing here knows the engine's command surface or its
//! work queue (a wake is a message the engine's queue picks up).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use hearth_api::{
    EventType, Kind, Object, VirtualDiskStatus, VirtualImageStatus, VirtualMachine,
    VirtualMachineStatus,
};
use tokio::sync::mpsc::UnboundedSender;

use crate::config::EngineConfig;
use crate::runtime::RuntimeRecord;
use crate::store::{Store, StoreError};
use crate::vm::live::LiveVm;

/// Why a reconcile failed; the engine retries it with backoff.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("{0}")]
    Failed(String),
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

/// One object to reconcile.
pub type Key = (Kind, String);

pub struct Context {
    pub config: EngineConfig,
    pub store: Store,
    live: Mutex<HashMap<String, Arc<LiveVm>>>,
    /// Per VM or disk: held while a VM starts or stops and for a whole
    /// snapshot cut, so the two never interleave.
    ops_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// The freeze coordinators, one per VM (or unattached disk).
    pub snapshots: crate::snapshot::Actors,
    /// The running VirtualImage imports, one per image at most.
    pub imports: crate::image::Imports,
    /// Disk snapshots an export is reading: their deletes wait.
    pub exports: crate::snapshot::export::Pins,
    /// Programs started in guests through `hearth exec`, until collected.
    pub execs: crate::guest::Execs,
    /// Where wakes go: the engine's work queue.
    wakes: UnboundedSender<Key>,
    /// Held by an apply from its network checks until its objects are
    /// written, and by a network reconcile while it plans and writes leases:
    /// a lease never lands between an apply's check and its write.
    pub addresses: Mutex<()>,
    /// The host side of networking: one resync at a time.
    pub networking: crate::network::sync::HostNetworking,
    /// Reconcile and snapshot histograms for `GET /metrics`.
    pub metrics: crate::metrics::EngineMetrics,
    /// What disk reconciles and resyncs keep between runs.
    pub disks: crate::disk::Disks,
}

impl Context {
    pub(crate) fn new(config: EngineConfig, store: Store, wakes: UnboundedSender<Key>) -> Context {
        Context {
            config,
            store,
            live: Mutex::new(HashMap::new()),
            ops_locks: Mutex::new(HashMap::new()),
            snapshots: crate::snapshot::Actors::default(),
            imports: crate::image::Imports::default(),
            exports: Default::default(),
            execs: crate::guest::Execs::default(),
            wakes,
            addresses: Mutex::new(()),
            networking: Default::default(),
            metrics: Default::default(),
            disks: Default::default(),
        }
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
    /// SQLite finds them in the stored JSON: nothing is parsed for the VMs
    /// that do not use it (every new disk asks).
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
            let mut stmt = tx.prepare(
                "SELECT name FROM objects WHERE kind = ?1 AND EXISTS (
                     SELECT 1 FROM json_each(body, '$.spec.disks')
                     WHERE json_extract(value, '$.virtualDiskName') = ?2)
                 ORDER BY name",
            )?;
            let listed = stmt
                .query_map(
                    rusqlite::params![Kind::VirtualMachine.as_str(), disk],
                    |r| r.get::<_, String>(0),
                )?
                .collect::<Result<Vec<_>, _>>()?;
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

    /// The VMs whose spec, or whose QEMU, has an interface on `network`,
    /// sorted.
    pub fn vms_using_network(&self, network: &str) -> Result<Vec<String>, StoreError> {
        vms_using_network(&self.store, network)
    }

    // ------------------------------------------------------------ status & events

    pub fn event(&self, kind: Kind, name: &str, type_: EventType, reason: &str, message: &str) {
        tracing::info!(kind = kind.as_str(), name, reason, "{message}");
        if let Err(e) = self.store.record_event(kind, name, type_, reason, message) {
            tracing::warn!(error = %e, "cannot record event");
        }
    }

    pub fn set_vm_status(&self, name: &str, f: impl FnOnce(&mut VirtualMachineStatus)) {
        if let Err(e) = self.store.update_status(Kind::VirtualMachine, name, f) {
            tracing::warn!(vm = name, error = %e, "cannot write status");
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

    /// The live handle of a recorded running process, attaching if needed.
    pub async fn ensure_live(self: &Arc<Self>, record: &RuntimeRecord) -> Arc<LiveVm> {
        if let Some(l) = self.live_get(&record.vm)
            && l.record.process == record.process
        {
            return l;
        }
        let live = Arc::new(LiveVm::attach(self, record.clone()).await);
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(record.vm.clone(), live.clone());
        live
    }

    pub fn live_get(&self, vm: &str) -> Option<Arc<LiveVm>> {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(vm)
            .cloned()
    }

    pub fn take_live(&self, vm: &str) -> Option<Arc<LiveVm>> {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(vm)
    }

    pub fn drop_live(&self, vm: &str) {
        self.take_live(vm);
    }

    pub fn live_agent_connected(&self, vm: &str) -> bool {
        self.live_get(vm)
            .is_some_and(|l| l.agent_connected.load(std::sync::atomic::Ordering::SeqCst))
    }
}

/// The VMs whose spec has an interface on `network`, sorted.
pub fn vms_using_network(store: &Store, network: &str) -> Result<Vec<String>, StoreError> {
    let mut vms: Vec<String> = store
        .list(Kind::VirtualMachine)?
        .into_iter()
        .filter_map(|s| match s.object {
            Object::VirtualMachine(vm)
                if vm
                    .spec
                    .networks
                    .iter()
                    .any(|n| n.virtual_network_name == network) =>
            {
                Some(vm.metadata.name)
            }
            _ => None,
        })
        .collect();
    // A QEMU started with an interface on it holds its tap there until it
    // exits, whatever its spec says now.
    let launched =
        crate::network::desired::launched_by_vm(&store.runtimes()?, &store.launches(None)?);
    for (vm, nics) in launched {
        if nics.iter().any(|n| n.spec.virtual_network_name == network) && !vms.contains(&vm) {
            vms.push(vm);
        }
    }
    vms.sort();
    Ok(vms)
}
