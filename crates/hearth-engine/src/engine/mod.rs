//! The engine: the one command surface (apply, delete, VM actions) that the
//! HTTP API and the manifest directory both drive, plus the work queue that
//! runs reconciles — never two at once for one object. Reconcilers get the
//! engine's `Context` (store, config, live VMs, locks, a way to wake), never
//! the engine itself; their wakes come back to the queue over a channel.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::ops::Deref;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use hearth_api::{
    DiskSource, Event, EventType, FieldError, Kind, Object, RunPolicy, VirtualDiskStatus,
    VirtualMachine,
};
use serde_json::Value;

use crate::config::EngineConfig;
use crate::context::{Context, Key};
use crate::store::{Store, StoreError, StoredObject};
use crate::vm::live::LiveVm;

pub use hearth_api::limits::MAX_APPLY_OBJECTS;

/// Why a request was refused. Each maps to one HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("{0}")]
    Invalid(#[from] FieldError),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot create {path}: {source}")]
    Dir {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("another hearthd already uses the state directory {0} (only one daemon may manage it)")]
    Locked(std::path::PathBuf),
    #[error("cannot open the store {path}: {source}")]
    Store {
        path: std::path::PathBuf,
        source: StoreError,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ApplyAction {
    Created,
    Configured,
    Unchanged,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ApplyOutcome {
    pub kind: Kind,
    pub name: String,
    pub action: ApplyAction,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmAction {
    Start,
    Stop,
    Restart,
}

pub struct Engine {
    /// What the reconcilers get: store, config, live VMs, operations locks,
    /// snapshot actors, and a sender whose wakes land in `queue`.
    ctx: Arc<Context>,
    /// Keys with a running worker; `true` means "changed while running: go again".
    queue: Mutex<HashMap<Key, bool>>,
    failures: Mutex<HashMap<Key, u32>>,
    /// Serialises apply/delete so their checks and writes are one step.
    writes: Mutex<()>,
    _lock: File,
}

/// The API-facing commands read the store, the config and the live VMs
/// through the context, as the reconcilers do.
impl Deref for Engine {
    type Target = Context;
    fn deref(&self) -> &Context {
        &self.ctx
    }
}

impl Engine {
    /// Opens the store, takes the state-directory lock, adopts running VMs and
    /// starts reconciling everything.
    pub async fn start(config: EngineConfig) -> Result<Arc<Engine>, StartError> {
        // The run directory is 0711: dnsmasq, once it has dropped to
        // `nobody`, must pass through it to reread its hosts file under
        // `networks/`. Nothing in it can be listed, and the VMs' sockets sit
        // one level down in `vms/`, which stays 0700.
        let vms_run_dir = config.run_dir.join("vms");
        for (dir, mode) in [
            (&config.state_dir, 0o700),
            (&config.run_dir, 0o711),
            (&vms_run_dir, 0o700),
        ] {
            std::fs::create_dir_all(dir).map_err(|source| StartError::Dir {
                path: dir.clone(),
                source,
            })?;
            let _ =
                std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(mode));
        }
        let lock_path = config.state_dir.join("hearthd.lock");
        let lock = File::create(&lock_path).map_err(|source| StartError::Dir {
            path: lock_path.clone(),
            source,
        })?;
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive)
            .map_err(|_| StartError::Locked(config.state_dir.clone()))?;
        let db = config.database_path();
        let store = Store::open(&db).map_err(|source| StartError::Store { path: db, source })?;
        let (wakes, mut woken) = tokio::sync::mpsc::unbounded_channel::<Key>();
        let engine = Arc::new(Engine {
            ctx: Arc::new(Context::new(config, store, wakes)),
            queue: Mutex::new(HashMap::new()),
            failures: Mutex::new(HashMap::new()),
            writes: Mutex::new(()),
            _lock: lock,
        });
        // Wakes sent by reconcilers, live VMs and snapshot actors go through
        // the same queue as the commands' own.
        let weak = Arc::downgrade(&engine);
        tokio::spawn(async move {
            while let Some((kind, name)) = woken.recv().await {
                let Some(engine) = weak.upgrade() else { return };
                engine.wake(kind, &name);
            }
        });

        // Adopt what a previous daemon started: connect to the QEMU processes
        // that still run, so no reconcile ever starts a second one.
        if let Ok(records) = engine.store.runtimes() {
            for mut r in records {
                if hearth_qemu::process::is_alive(&r.process) {
                    if r.disk_names.is_empty() && !r.disks.is_empty() {
                        // A record from before the devices' disks were
                        // recorded: the launch-time files name them.
                        match crate::snapshot::storage::disks_of_layer_files(
                            &engine.store,
                            &r.disks,
                        ) {
                            Ok(Some(names)) => {
                                r.disk_names = names;
                                if let Err(e) = engine.store.put_runtime(&r) {
                                    tracing::warn!(vm = %r.vm, error = %e, "cannot update the runtime record");
                                }
                            }
                            Ok(None) => {
                                tracing::warn!(vm = %r.vm, "cannot tell which VirtualDisk each device of the running QEMU holds; snapshots of it wait for a restart")
                            }
                            Err(e) => {
                                tracing::warn!(vm = %r.vm, error = %e, "cannot read the layers")
                            }
                        }
                    }
                    engine.ctx.ensure_live(&r).await;
                    engine.event(
                        Kind::VirtualMachine,
                        &r.vm,
                        EventType::Normal,
                        "Adopted",
                        &format!(
                            "hearthd restarted; adopted running QEMU pid {}",
                            r.process.pid
                        ),
                    );
                }
            }
        }
        // Launches a crashed daemon spawned but never recorded: their QEMUs
        // are found from the process table and adopted or stopped, before
        // any reconcile could start a second one.
        for r in crate::vm::launches::settle_all(&engine.ctx).await {
            engine.ctx.ensure_live(&r).await;
        }
        match crate::snapshot::storage::sweep_orphans(&engine.store, &engine.config.state_dir) {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(
                    count = removed.len(),
                    "removed layer files a crash left behind"
                )
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot sweep orphan layer files"),
        }
        // Conversions a crash cut short (docs/snapshots.md "Export").
        let n = crate::snapshot::export::sweep(&engine.config.state_dir);
        if n > 0 {
            tracing::info!(count = n, "removed export files a crash left behind");
        }
        // Before any import starts: temporaries of cut-short imports, and
        // image files nothing refers to.
        match crate::image::sweep(&engine.store, &engine.config.images_dir()) {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(count = removed.len(), "removed image files no image needs")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot sweep the image store"),
        }
        // Before any VM starts: bridges, taps, dnsmasqs and the table as the
        // store says, and nothing a crash left behind.
        crate::network::sync::startup(&engine.ctx).await;
        engine.wake_all();
        // Guests a crashed daemon left frozen are thawed right away.
        engine.snapshots.resume_all(&engine.ctx);
        let weak = Arc::downgrade(&engine);
        let interval = engine.config.resync_interval;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                let Some(engine) = weak.upgrade() else { return };
                engine.wake_all();
            }
        });
        Ok(engine)
    }

    // ------------------------------------------------------------ queries

    // The API's reads use the store's reading connection: they never wait
    // for a reconciler's write.

    pub fn get(&self, kind: Kind, name: &str) -> Result<StoredObject, RequestError> {
        self.store
            .reader()
            .get(kind, name)?
            .ok_or_else(|| RequestError::NotFound(format!("{kind} {name:?} not found")))
    }

    pub fn list(&self, kind: Kind) -> Result<Vec<StoredObject>, RequestError> {
        Ok(self.store.reader().list(kind)?)
    }

    pub fn events(
        &self,
        kind: Option<Kind>,
        name: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Event>, RequestError> {
        Ok(self.store.reader().events(kind, name, limit)?)
    }

    /// The console log of a VM that exists.
    pub fn console_path(&self, name: &str) -> Result<std::path::PathBuf, RequestError> {
        self.get(Kind::VirtualMachine, name)?;
        Ok(self.config.serial_log(name))
    }

    /// The serial console socket of a VM that exists (QEMU serves it while
    /// the VM runs).
    pub fn console_socket(&self, name: &str) -> Result<std::path::PathBuf, RequestError> {
        self.get(Kind::VirtualMachine, name)?;
        Ok(self.config.serial_socket(name))
    }

    // ------------------------------------------------------------ commands

    /// Creates or updates objects. All or nothing: every object is checked
    /// before any is written, and they are written in one transaction,
    /// with their events. At most [`MAX_APPLY_OBJECTS`] at once.
    pub fn apply(
        self: &Arc<Self>,
        objects: Vec<Object>,
        managed_by: &str,
    ) -> Result<Vec<ApplyOutcome>, RequestError> {
        if objects.len() > MAX_APPLY_OBJECTS {
            return Err(RequestError::BadRequest(format!(
                "{} objects in one apply, more than the limit of {MAX_APPLY_OBJECTS} objects per apply; split them over several applies",
                objects.len()
            )));
        }
        let _w = self.writes.lock().unwrap_or_else(|p| p.into_inner());
        let mut seen = HashSet::new();
        let mut prepared = Vec::new();
        let mut old_networks: Vec<String> = Vec::new();
        for mut obj in objects {
            obj.strip_server_fields();
            obj.validate()?;
            if !seen.insert((obj.kind(), obj.name().to_string())) {
                return Err(RequestError::BadRequest(format!(
                    "{} appears twice in one apply",
                    obj.display_name()
                )));
            }
            self.check_host_paths(&obj)?;
            self.check_image_source(&obj)?;
            let existing = self.store.get(obj.kind(), obj.name())?;
            // The owner alone can change (a manifest file renamed, or a file
            // taking over an API object): written, but the spec is unchanged.
            let old_owner = existing
                .as_ref()
                .map(|e| {
                    e.object
                        .metadata()
                        .managed_by
                        .clone()
                        .unwrap_or_else(|| "api".into())
                })
                .filter(|o| o != managed_by);
            let action = if let Some(existing) = &existing {
                self.check_update(existing, &obj, managed_by)?;
                if existing.object.spec_json() == obj.spec_json() {
                    ApplyAction::Unchanged
                } else {
                    ApplyAction::Configured
                }
            } else {
                ApplyAction::Created
            };
            let meta = obj.metadata_mut();
            match &existing {
                Some(e) => {
                    let old = e.object.metadata();
                    meta.creation_timestamp = old.creation_timestamp;
                    meta.generation = old.generation + u64::from(action == ApplyAction::Configured);
                }
                None => {
                    meta.creation_timestamp = Some(Utc::now());
                    meta.generation = 1;
                }
            }
            meta.managed_by = Some(managed_by.to_string());
            // A VM leaving a network frees its address there.
            if let Some(StoredObject {
                object: Object::VirtualMachine(old),
                ..
            }) = &existing
            {
                old_networks.extend(
                    old.spec
                        .networks
                        .iter()
                        .map(|n| n.virtual_network_name.clone()),
                );
            }
            prepared.push((obj, action, old_owner));
        }
        self.check_disk_exclusivity(prepared.iter().map(|(o, _, _)| o))?;
        let addresses = self.addresses.lock().unwrap_or_else(|p| p.into_inner());
        self.check_networks(prepared.iter().map(|(o, _, _)| o))?;

        let to_write: Vec<Object> = prepared
            .iter()
            .filter(|(_, a, old_owner)| *a != ApplyAction::Unchanged || old_owner.is_some())
            .map(|(o, _, _)| o.clone())
            .collect();
        let mut events: Vec<(Kind, &str, &'static str, String)> = Vec::new();
        for (obj, action, old_owner) in &prepared {
            if *action == ApplyAction::Unchanged
                && let Some(old) = old_owner
            {
                events.push((
                    obj.kind(),
                    obj.name(),
                    "SourceChanged",
                    format!("now managed by {managed_by} (was {old}); spec unchanged"),
                ));
            }
            if *action != ApplyAction::Unchanged {
                let (reason, verb) = match action {
                    ApplyAction::Created => ("Created", "created"),
                    _ => ("Updated", "updated"),
                };
                events.push((
                    obj.kind(),
                    obj.name(),
                    reason,
                    format!(
                        "{verb} from {managed_by} (generation {})",
                        obj.metadata().generation
                    ),
                ));
            }
        }
        // One commit for the objects and their events: one sync of the
        // store, however many objects.
        let now = Utc::now();
        self.store.with_tx(|tx| {
            Store::put_objects_tx(tx, &to_write)?;
            for (kind, name, reason, message) in &events {
                Store::record_event_tx(tx, now, *kind, name, EventType::Normal, reason, message)?;
            }
            Ok(())
        })?;
        drop(addresses);
        for (kind, name, reason, message) in &events {
            tracing::info!(kind = kind.as_str(), name, reason, "{message}");
        }

        let mut outcomes = Vec::new();
        for (obj, action, _) in prepared {
            self.wake(obj.kind(), obj.name());
            if let Object::VirtualMachine(vm) = &obj {
                for d in &vm.spec.disks {
                    self.wake(Kind::VirtualDisk, &d.virtual_disk_name);
                }
                // The networks assign (or release) its addresses.
                for n in &vm.spec.networks {
                    self.wake(Kind::VirtualNetwork, &n.virtual_network_name);
                }
            }
            outcomes.push(ApplyOutcome {
                kind: obj.kind(),
                name: obj.name().to_string(),
                action,
            });
        }
        for n in old_networks {
            self.wake(Kind::VirtualNetwork, &n);
        }
        Ok(outcomes)
    }

    /// Marks an object for deletion; its reconcile tears it down.
    pub fn delete(
        self: &Arc<Self>,
        kind: Kind,
        name: &str,
        managed_by: &str,
    ) -> Result<(), RequestError> {
        let _w = self.writes.lock().unwrap_or_else(|p| p.into_inner());
        let existing = self.get(kind, name)?;
        check_owner(&existing, managed_by)?;
        if kind == Kind::VirtualDisk
            && let Some(vm) = self.vms_using_disk(name)?.first()
        {
            return Err(RequestError::Conflict(format!(
                "VirtualDisk {name:?} is in use by VirtualMachine {vm:?} (its spec.disks, or its running QEMU until it restarts); delete the VM or remove the disk from it first"
            )));
        }
        if kind == Kind::VirtualNetwork {
            let vms = crate::context::vms_using_network(&self.store, name)?;
            if !vms.is_empty() {
                let list: Vec<String> = vms.iter().map(|v| format!("{v:?}")).collect();
                return Err(RequestError::Conflict(format!(
                    "VirtualNetwork {name:?} is in use by VirtualMachine {} (its spec.networks, or its running QEMU until it restarts); delete those VMs or remove the network from them first",
                    list.join(", ")
                )));
            }
        }
        if kind == Kind::VirtualImage {
            let disks = crate::image::disks_blocking_delete(&self.store, name)?;
            if !disks.is_empty() {
                let list: Vec<String> = disks.iter().map(|d| format!("{d:?}")).collect();
                return Err(RequestError::Conflict(format!(
                    "VirtualImage {name:?} is in use by VirtualDisk {} (made from it); delete those disks first",
                    list.join(", ")
                )));
            }
        }
        if !existing.deleting {
            self.store.mark_deleting(kind, name)?;
            self.event(
                kind,
                name,
                EventType::Normal,
                "Deleting",
                &format!("deletion requested by {managed_by}"),
            );
        }
        self.wake(kind, name);
        Ok(())
    }

    pub fn vm_action(
        self: &Arc<Self>,
        name: &str,
        action: VmAction,
    ) -> Result<String, RequestError> {
        let stored = self.get(Kind::VirtualMachine, name)?;
        let Object::VirtualMachine(vm) = &stored.object else {
            return Err(RequestError::NotFound(format!(
                "VirtualMachine {name:?} not found"
            )));
        };
        if stored.deleting {
            return Err(RequestError::Conflict(format!(
                "VirtualMachine {name:?} is being deleted"
            )));
        }
        if vm.spec.run_policy == RunPolicy::AlwaysOff && action != VmAction::Stop {
            return Err(RequestError::Conflict(format!(
                "VirtualMachine {name:?} has spec.runPolicy AlwaysOff; set it to AlwaysOn or Manual to start it"
            )));
        }
        let message = match action {
            VmAction::Start => {
                self.store
                    .update_intent(name, |i| i.want_running = Some(true))?;
                format!("VirtualMachine {name:?} is starting")
            }
            VmAction::Stop => {
                self.store
                    .update_intent(name, |i| i.want_running = Some(false))?;
                if vm.spec.run_policy == RunPolicy::AlwaysOn {
                    format!(
                        "VirtualMachine {name:?} is stopping; it stays stopped until `hearth start {name}`"
                    )
                } else {
                    format!("VirtualMachine {name:?} is stopping")
                }
            }
            VmAction::Restart => {
                if self.store.runtime(name)?.is_none() {
                    self.store
                        .update_intent(name, |i| i.want_running = Some(true))?;
                    format!("VirtualMachine {name:?} was not running; starting it")
                } else {
                    let next = self
                        .store
                        .runtime(name)?
                        .map(|r| r.restart_nonce)
                        .unwrap_or(0)
                        + 1;
                    self.store.update_intent(name, |i| {
                        i.want_running = Some(true);
                        i.restart_nonce = i.restart_nonce.max(next);
                    })?;
                    format!("VirtualMachine {name:?} is restarting")
                }
            }
        };
        self.event(
            Kind::VirtualMachine,
            name,
            EventType::Normal,
            "UserRequest",
            &message,
        );
        self.wake(Kind::VirtualMachine, name);
        Ok(message)
    }

    /// Restores every member of a Ready VirtualMachineSnapshotGroup, side
    /// by side: each member VM is stopped, rebuilt from its member snapshot
    /// and started again if it ran (`restore_vm`). Everything is checked
    /// before any VM is stopped; a member that fails to restore does not stop
    /// the others, and the answer names it.
    pub async fn restore_group(self: &Arc<Self>, name: &str) -> Result<String, RequestError> {
        let stored = self.get(Kind::VirtualMachineSnapshotGroup, name)?;
        let Object::VirtualMachineSnapshotGroup(group) = &stored.object else {
            return Err(RequestError::NotFound(format!(
                "VirtualMachineSnapshotGroup {name:?} not found"
            )));
        };
        let status: hearth_api::SnapshotStatus =
            serde_json::from_value(stored.status.clone()).unwrap_or_default();
        if status.phase != hearth_api::SnapshotPhase::Ready {
            return Err(RequestError::Conflict(format!(
                "VirtualMachineSnapshotGroup {name:?} is {}, not Ready{}",
                status.phase,
                status
                    .message
                    .as_ref()
                    .map(|m| format!(" ({m})"))
                    .unwrap_or_default()
            )));
        }
        let mut plan = Vec::new();
        for vm in &group.spec.virtual_machine_names {
            let member = crate::snapshot::group_member_name(name, vm);
            self.get(Kind::VirtualMachine, vm)?;
            let m = self.get(Kind::VirtualMachineSnapshot, &member)?;
            let ms: hearth_api::SnapshotStatus =
                serde_json::from_value(m.status.clone()).unwrap_or_default();
            if ms.phase != hearth_api::SnapshotPhase::Ready {
                return Err(RequestError::Conflict(format!(
                    "member VirtualMachineSnapshot {member:?} is {}, not Ready",
                    ms.phase
                )));
            }
            plan.push((vm.clone(), member));
        }
        let each = plan.iter().map(|(vm, member)| {
            let engine = self.clone();
            async move { (vm, engine.restore_vm(vm, member).await) }
        });
        let results = futures_util::future::join_all(each).await;
        let failed: Vec<String> = results
            .iter()
            .filter_map(|(vm, r)| r.as_ref().err().map(|e| format!("{vm}: {e}")))
            .collect();
        if !failed.is_empty() {
            return Err(RequestError::Conflict(format!(
                "VirtualMachineSnapshotGroup {name:?}: {} of {} member(s) not restored: {}",
                failed.len(),
                plan.len(),
                failed.join("; ")
            )));
        }
        let message = format!(
            "VirtualMachineSnapshotGroup {name:?}: {} VM(s) restored ({})",
            plan.len(),
            plan.iter()
                .map(|(vm, m)| format!("{vm} from {m}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        self.event(
            Kind::VirtualMachineSnapshotGroup,
            name,
            EventType::Normal,
            "Restored",
            &message,
        );
        Ok(message)
    }

    /// Rebuilds a VM's disks from a Ready VirtualMachineSnapshot: stops the
    /// VM, puts a fresh overlay over each snapshot layer as the disk's head
    /// (time independent of disk size), and starts the VM again if it ran.
    pub async fn restore_vm(
        self: &Arc<Self>,
        vm_name: &str,
        from: &str,
    ) -> Result<String, RequestError> {
        use crate::snapshot::storage;
        let stored = self.get(Kind::VirtualMachine, vm_name)?;
        let Object::VirtualMachine(vm) = &stored.object else {
            return Err(RequestError::NotFound(format!(
                "VirtualMachine {vm_name:?} not found"
            )));
        };
        let snap = self.get(Kind::VirtualMachineSnapshot, from)?;
        let Object::VirtualMachineSnapshot(vmsnap) = &snap.object else {
            return Err(RequestError::NotFound(format!(
                "VirtualMachineSnapshot {from:?} not found"
            )));
        };
        if snap.deleting {
            return Err(RequestError::Conflict(format!(
                "VirtualMachineSnapshot {from:?} is being deleted; nothing was restored"
            )));
        }
        if vmsnap.spec.virtual_machine_name != vm_name {
            return Err(RequestError::Conflict(format!(
                "VirtualMachineSnapshot {from:?} is of VirtualMachine {:?}, not {vm_name:?}",
                vmsnap.spec.virtual_machine_name
            )));
        }
        let status: hearth_api::SnapshotStatus =
            serde_json::from_value(snap.status.clone()).unwrap_or_default();
        if status.phase != hearth_api::SnapshotPhase::Ready {
            return Err(RequestError::Conflict(format!(
                "VirtualMachineSnapshot {from:?} is {}, not Ready",
                status.phase
            )));
        }
        // Each disk snapshot's pin is held from reading its layer until the
        // restored heads are recorded (from then on the store keeps the
        // layers): a delete of the snapshot waits for the restore, and a
        // snapshot whose delete came first is not restored.
        let mut _pins = Vec::new();
        for child in &status.virtual_disk_snapshot_names {
            _pins.push(self.exports.of(child).read_owned().await);
        }
        if self.get(Kind::VirtualMachineSnapshot, from)?.deleting {
            return Err(RequestError::Conflict(format!(
                "VirtualMachineSnapshot {from:?} is being deleted; nothing was restored"
            )));
        }
        let mut plan = Vec::new();
        for child in &status.virtual_disk_snapshot_names {
            let c = self.get(Kind::VirtualDiskSnapshot, child)?;
            if c.deleting {
                return Err(RequestError::Conflict(format!(
                    "VirtualDiskSnapshot {child:?} of VirtualMachineSnapshot {from:?} is being deleted; nothing was restored"
                )));
            }
            let Object::VirtualDiskSnapshot(ds) = &c.object else {
                continue;
            };
            let disk = ds.spec.virtual_disk_name.clone();
            if !vm.spec.disks.iter().any(|d| d.virtual_disk_name == disk) {
                return Err(RequestError::Conflict(format!(
                    "VirtualDisk {disk:?} of the snapshot is no longer in VirtualMachine {vm_name:?} (spec.disks)"
                )));
            }
            let layer = storage::snapshot_layer(&self.store, child)?.ok_or_else(|| {
                RequestError::Conflict(format!("VirtualDiskSnapshot {child:?} has no stored layer"))
            })?;
            plan.push((disk, layer));
        }
        let was_running = self
            .store
            .runtime(vm_name)?
            .is_some_and(|r| hearth_qemu::process::is_alive(&r.process));
        let previous = self.store.intent(vm_name)?;
        if was_running {
            self.store
                .update_intent(vm_name, |i| i.want_running = Some(false))?;
            self.event(
                Kind::VirtualMachine,
                vm_name,
                EventType::Normal,
                "Restoring",
                &format!("stopping to restore from {from}"),
            );
            self.wake(Kind::VirtualMachine, vm_name);
        }
        let result = self.restore_disks(vm, &plan, was_running).await;
        // Whatever happened, the VM goes back to what it was asked to be.
        if was_running {
            self.store.update_intent(vm_name, |i| {
                i.want_running = previous.want_running.or(Some(true))
            })?;
        }
        for (disk, _) in &plan {
            self.wake(Kind::VirtualDisk, disk);
        }
        self.wake(Kind::VirtualMachine, vm_name);
        result?;
        let message = format!(
            "VirtualMachine {vm_name:?}: {} disk(s) restored from VirtualMachineSnapshot {from:?}",
            plan.len()
        );
        self.event(
            Kind::VirtualMachine,
            vm_name,
            EventType::Normal,
            "Restored",
            &message,
        );
        Ok(message)
    }

    /// Waits for the VM to stop, then switches each disk's head to a new
    /// overlay over the snapshot's layer, all heads in one transaction.
    async fn restore_disks(
        &self,
        vm: &VirtualMachine,
        plan: &[(String, crate::snapshot::storage::Layer)],
        was_running: bool,
    ) -> Result<(), RequestError> {
        use crate::snapshot::storage;
        let vm_name = vm.metadata.name.as_str();
        if was_running {
            let limit = Duration::from_secs(u64::from(vm.spec.stop_timeout_seconds) + 60);
            let started = std::time::Instant::now();
            while self.store.runtime(vm_name)?.is_some() {
                if started.elapsed() > limit {
                    return Err(RequestError::Conflict(format!(
                        "VirtualMachine {vm_name:?} did not stop within {} s; nothing was restored",
                        limit.as_secs()
                    )));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        let _ops = self.lock_vm_ops(vm).await;
        if self.store.runtime(vm_name)?.is_some() {
            return Err(RequestError::Conflict(format!(
                "VirtualMachine {vm_name:?} is running; stop it first (nothing was restored)"
            )));
        }
        // The last QEMU is gone: a cut it left unsettled is settled first,
        // so the heads replaced below are the real ones.
        let disks: Vec<String> = plan.iter().map(|(d, _)| d.clone()).collect();
        crate::snapshot::overlays::settle_offline(&self.store, &disks)
            .await
            .map_err(|e| RequestError::Conflict(format!("{e} (nothing was restored)")))?;
        crate::snapshot::compaction::settle_offline(self, &disks)
            .await
            .map_err(|e| RequestError::Conflict(format!("{e} (nothing was restored)")))?;
        let state_dir = self.config.state_dir.clone();
        std::fs::create_dir_all(storage::layers_dir(&state_dir))
            .map_err(|e| RequestError::Conflict(e.to_string()))?;
        let mut made = Vec::new();
        for (disk, layer) in plan {
            let new = storage::allocate(&self.store, &state_dir, disk)?;
            if let Err(e) =
                hearth_qemu::img::create_overlay(&new.path, &layer.path, "qcow2", None).await
            {
                for (_, m, _) in &made {
                    let m: &storage::NewLayer = m;
                    let _ = std::fs::remove_file(&m.path);
                }
                return Err(RequestError::Conflict(format!(
                    "VirtualDisk {disk:?}: {e} (nothing was restored)"
                )));
            }
            made.push((disk.clone(), new, layer.id.clone()));
        }
        self.store.with_tx(|tx| {
            for (disk, new, backing) in &made {
                storage::set_head_tx(tx, disk, new, Some(backing))?;
                let path = new.path.clone();
                crate::store::Store::update_status_tx::<VirtualDiskStatus, _>(
                    tx,
                    Kind::VirtualDisk,
                    disk,
                    |s| {
                        s.path = Some(path);
                    },
                )?;
            }
            Ok(())
        })?;
        storage::collect_garbage(&self.store)?;
        Ok(())
    }

    fn check_host_paths(&self, obj: &Object) -> Result<(), RequestError> {
        let fail = |field: &str, message: crate::config::ConfigError| {
            RequestError::Invalid(FieldError {
                object: obj.display_name(),
                field: field.into(),
                message: message.to_string(),
            })
        };
        match obj {
            Object::VirtualMachine(vm) => {
                if let Some(boot) = &vm.spec.boot {
                    self.config
                        .confine(&boot.kernel)
                        .map_err(|m| fail("spec.boot.kernel", m))?;
                    if let Some(i) = &boot.initrd {
                        self.config
                            .confine(i)
                            .map_err(|m| fail("spec.boot.initrd", m))?;
                    }
                }
            }
            Object::VirtualDisk(d) => {
                if let DiskSource::Image(p) = &d.spec.source {
                    self.config
                        .confine(p)
                        .map_err(|m| fail("spec.source.image", m))?;
                }
            }
            Object::VirtualImage(image) => {
                if let hearth_api::ImageSource::File(p) = &image.spec.source {
                    self.config
                        .confine(p)
                        .map_err(|m| fail("spec.source.file", m))?;
                }
            }
            Object::VirtualDiskSnapshot(_)
            | Object::VirtualMachineSnapshot(_)
            | Object::VirtualMachineSnapshotGroup(_)
            | Object::VirtualNetwork(_) => {}
        }
        Ok(())
    }

    /// A disk from an image that is Ready must not be smaller than it; an
    /// image being deleted makes no new disks.
    fn check_image_source(&self, obj: &Object) -> Result<(), RequestError> {
        let Object::VirtualDisk(d) = obj else {
            return Ok(());
        };
        let DiskSource::VirtualImage(image) = &d.spec.source else {
            return Ok(());
        };
        let Some(stored) = self.store.get(Kind::VirtualImage, image)? else {
            return Ok(());
        };
        if stored.deleting {
            return Err(RequestError::Conflict(format!(
                "{}: spec.source.virtualImage: VirtualImage {image:?} is being deleted",
                obj.display_name()
            )));
        }
        if self.store.get(Kind::VirtualDisk, obj.name())?.is_some() {
            // An existing disk's spec cannot change (checked below).
            return Ok(());
        }
        let size = d.spec.size.as_ref().map(|q| q.bytes());
        if let Err(why) = crate::image::ready_for_disk(&self.store, image, size)?
            && why.is_permanent()
        {
            let (field, message) = why.field_and_message();
            return Err(RequestError::Invalid(FieldError {
                object: obj.display_name(),
                field: field.into(),
                message,
            }));
        }
        Ok(())
    }

    fn check_update(
        &self,
        existing: &StoredObject,
        new: &Object,
        managed_by: &str,
    ) -> Result<(), RequestError> {
        check_owner(existing, managed_by)?;
        if existing.deleting {
            return Err(RequestError::Conflict(format!(
                "{} is being deleted; apply it again once it is gone",
                new.display_name()
            )));
        }
        if let Some(why) = new.kind().immutable_spec()
            && existing.object.spec_json() != new.spec_json()
        {
            return Err(RequestError::Invalid(FieldError {
                object: new.display_name(),
                field: "spec".into(),
                message: why.into(),
            }));
        }
        Ok(())
    }

    /// Subnets, addresses, port forwards and interface names over the state
    /// this apply would leave (docs/networking.md).
    fn check_networks<'a>(
        &self,
        batch: impl Iterator<Item = &'a Object>,
    ) -> Result<(), RequestError> {
        use crate::network::admission::{self, NetworkView, Refusal, VmView};
        let batch: Vec<&Object> = batch.collect();
        let touches_networks = batch.iter().any(|o| match o {
            Object::VirtualNetwork(_) => true,
            Object::VirtualMachine(vm) => !vm.spec.networks.is_empty(),
            _ => false,
        });
        if !touches_networks {
            return Ok(());
        }
        let leases = self.store.leases()?;
        let mut networks = BTreeMap::new();
        for s in self.store.list(Kind::VirtualNetwork)? {
            if let Object::VirtualNetwork(n) = s.object {
                let status = serde_json::from_value(s.status).unwrap_or_default();
                networks.insert(
                    n.metadata.name.clone(),
                    NetworkView {
                        network: n,
                        status,
                        deleting: s.deleting,
                        in_batch: false,
                    },
                );
            }
        }
        // What running QEMUs were started with: held until they exit.
        let launched = crate::network::desired::launched_by_vm(
            &self.store.runtimes()?,
            &self.store.launches(None)?,
        );
        let running = |vm: &hearth_api::VirtualMachine| {
            launched
                .get(&vm.metadata.name)
                .map(|l| crate::network::desired::in_effect(vm, Some(l)))
        };
        let mut vms = BTreeMap::new();
        for s in self.store.list(Kind::VirtualMachine)? {
            if let Object::VirtualMachine(vm) = s.object {
                vms.insert(
                    vm.metadata.name.clone(),
                    VmView {
                        running: running(&vm),
                        vm,
                        in_batch: false,
                    },
                );
            }
        }
        let refused = |r: Refusal| match r {
            Refusal::Invalid(e) => RequestError::Invalid(e),
            Refusal::Conflict(m) => RequestError::Conflict(m),
        };
        for o in batch {
            match o {
                Object::VirtualNetwork(n) => {
                    let name = n.metadata.name.clone();
                    let (status, deleting) = match networks.get(&name) {
                        Some(old) => {
                            let held = leases.iter().filter(|l| l.network == name).count();
                            admission::check_network_update(old, n, held).map_err(refused)?;
                            (old.status.clone(), old.deleting)
                        }
                        None => (Default::default(), false),
                    };
                    networks.insert(
                        name,
                        NetworkView {
                            network: n.clone(),
                            status,
                            deleting,
                            in_batch: true,
                        },
                    );
                }
                Object::VirtualMachine(vm) => {
                    vms.insert(
                        vm.metadata.name.clone(),
                        VmView {
                            vm: vm.clone(),
                            in_batch: true,
                            running: running(vm),
                        },
                    );
                }
                _ => {}
            }
        }
        admission::check(&networks, &vms, &leases).map_err(refused)
    }

    /// A disk belongs to at most one VM.
    fn check_disk_exclusivity<'a>(
        &self,
        batch: impl Iterator<Item = &'a Object>,
    ) -> Result<(), RequestError> {
        let batch: Vec<&Object> = batch.collect();
        let batch_vms: HashSet<&str> = batch
            .iter()
            .filter(|o| o.kind() == Kind::VirtualMachine)
            .map(|o| o.name())
            .collect();
        let mut owner: HashMap<String, String> = HashMap::new();
        for s in self.store.list(Kind::VirtualMachine)? {
            if let Object::VirtualMachine(vm) = s.object {
                if batch_vms.contains(vm.metadata.name.as_str()) {
                    continue;
                }
                for d in vm.spec.disks {
                    owner.insert(d.virtual_disk_name, vm.metadata.name.clone());
                }
            }
        }
        for o in batch {
            if let Object::VirtualMachine(vm) = o {
                for (i, d) in vm.spec.disks.iter().enumerate() {
                    if let Some(other) = owner.get(&d.virtual_disk_name) {
                        return Err(RequestError::Conflict(format!(
                            "{}: spec.disks[{i}].virtualDiskName: VirtualDisk {:?} is already used by VirtualMachine {other:?}",
                            o.display_name(),
                            d.virtual_disk_name
                        )));
                    }
                    owner.insert(d.virtual_disk_name.clone(), vm.metadata.name.clone());
                }
            }
        }
        Ok(())
    }

    // ------------------------------------------------------------ guest agent

    /// The live handle of a running VM whose spec has a guest agent.
    fn agent_live(&self, name: &str) -> Result<Arc<LiveVm>, RequestError> {
        let stored = self.get(Kind::VirtualMachine, name)?;
        if let Object::VirtualMachine(vm) = &stored.object
            && !vm.spec.guest_agent
        {
            return Err(RequestError::Conflict(format!(
                "VirtualMachine {name:?} has spec.guestAgent false"
            )));
        }
        self.live_get(name).ok_or_else(|| {
            RequestError::Conflict(format!("VirtualMachine {name:?} is not running"))
        })
    }

    /// Runs `f` with the VM's guest-agent connection, which it shares with
    /// the monitor and the freeze coordinator (the channel takes one client).
    /// Holds the channel for all of `f`: only for calls that answer at once.
    async fn with_agent<T>(
        &self,
        name: &str,
        f: impl AsyncFnOnce(
            &mut hearth_qemu::agent::AgentClient,
        ) -> Result<T, hearth_qemu::agent::AgentError>,
    ) -> Result<T, RequestError> {
        let live = self.agent_live(name)?;
        let mut guard = live.agent.lock().await;
        let client = guard.as_mut().ok_or_else(|| {
            RequestError::Conflict(format!(
                "VirtualMachine {name:?}: the guest agent is not connected yet"
            ))
        })?;
        f(client).await.map_err(|e| {
            RequestError::Conflict(format!("VirtualMachine {name:?}: guest agent: {e}"))
        })
    }

    /// `guest-ping` through the guest agent.
    pub async fn agent_ping(&self, name: &str) -> Result<(), RequestError> {
        self.with_agent(name, async |c| c.ping(Duration::from_secs(5)).await)
            .await
    }

    /// `guest-fsfreeze-status` through the guest agent: true when frozen.
    pub async fn agent_freeze_status(&self, name: &str) -> Result<bool, RequestError> {
        self.with_agent(name, async |c| {
            c.fsfreeze_status(Duration::from_secs(5))
                .await
                .map(|s| s == hearth_qemu::agent::FreezeStatus::Frozen)
        })
        .await
    }

    /// `guest-exec` through the guest agent; waits for the program to end.
    /// The agent channel is taken per call (start, then each status poll), not
    /// for the program's run, so a snapshot cut never waits behind it.
    pub async fn agent_exec(
        &self,
        name: &str,
        path: &str,
        args: &[String],
        timeout: Duration,
    ) -> Result<hearth_qemu::agent::ExecOutput, RequestError> {
        let live = self.agent_live(name)?;
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        live.exec(path, &args, timeout).await.map_err(|e| {
            use crate::vm::live::ExecError;
            RequestError::Conflict(match e {
                ExecError::NotConnected => {
                    format!("VirtualMachine {name:?}: the guest agent is not connected yet")
                }
                ExecError::Stopped => {
                    format!("VirtualMachine {name:?} stopped while the program ran")
                }
                ExecError::Agent(e) => format!("VirtualMachine {name:?}: guest agent: {e}"),
            })
        })
    }

    // ------------------------------------------------------------ work queue

    /// Asks for a reconcile of one object. Level-triggered: a hint, not a
    /// command; many wakes while a reconcile runs collapse into one rerun.
    pub fn wake(self: &Arc<Self>, kind: Kind, name: &str) {
        let key = (kind, name.to_string());
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(dirty) = q.get_mut(&key) {
            *dirty = true;
            return;
        }
        q.insert(key.clone(), false);
        drop(q);
        let engine = self.clone();
        tokio::spawn(async move { engine.worker(key).await });
    }

    /// The resync: every object is woken, except the disks, which are
    /// looked at in one pass that wakes only those it finds out of date
    /// (`disk::resync`, docs/reconciler.md "Disks").
    pub fn wake_all(self: &Arc<Self>) {
        for kind in Kind::ALL {
            if kind == Kind::VirtualDisk {
                match crate::disk::resync(&self.ctx) {
                    Ok(names) => {
                        for n in names {
                            self.wake(kind, &n);
                        }
                        continue;
                    }
                    // Each disk then looks for itself.
                    Err(e) => tracing::warn!(error = %e, "cannot resync the disks in one pass"),
                }
            }
            if let Ok(objs) = self.store.list(kind) {
                for o in objs {
                    self.wake(kind, o.object.name());
                }
            }
        }
    }

    async fn worker(self: Arc<Self>, key: Key) {
        loop {
            // Disk reconciles take turns: a burst of thousands of new disks
            // waits here, parked, not in the runtime's queue.
            let _slot = match key.0 {
                Kind::VirtualDisk => Some(self.ctx.disks.slot().await),
                _ => None,
            };
            let started = std::time::Instant::now();
            let result = match key.0 {
                Kind::VirtualMachine => crate::vm::reconcile(&self.ctx, &key.1).await,
                Kind::VirtualDisk => crate::disk::reconcile(&self.ctx, &key.1).await,
                Kind::VirtualDiskSnapshot => {
                    crate::snapshot::reconcile_disk_snapshot(&self.ctx, &key.1).await
                }
                Kind::VirtualMachineSnapshot => {
                    crate::snapshot::reconcile_vm_snapshot(&self.ctx, &key.1).await
                }
                Kind::VirtualMachineSnapshotGroup => {
                    crate::snapshot::reconcile_group(&self.ctx, &key.1).await
                }
                Kind::VirtualImage => crate::image::reconcile(&self.ctx, &key.1).await,
                Kind::VirtualNetwork => crate::network::reconcile(&self.ctx, &key.1).await,
            };
            self.metrics
                .reconcile_done(key.0, started.elapsed(), result.is_err());
            match result {
                Ok(()) => {
                    self.failures
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&key);
                }
                Err(e) => {
                    let n = {
                        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
                        let n = f.entry(key.clone()).or_insert(0);
                        *n += 1;
                        *n
                    };
                    let delay = backoff(n);
                    tracing::warn!(kind = key.0.as_str(), name = key.1, error = %e, retry_in = ?delay, "reconcile failed");
                    let weak = Arc::downgrade(&self);
                    let k = key.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        if let Some(engine) = weak.upgrade() {
                            engine.wake(k.0, &k.1);
                        }
                    });
                }
            }
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            match q.get_mut(&key) {
                Some(dirty) if *dirty => *dirty = false,
                _ => {
                    q.remove(&key);
                    return;
                }
            }
        }
    }

    pub fn status_json(&self, stored: &StoredObject) -> Value {
        stored.to_json()
    }
}

fn check_owner(existing: &StoredObject, managed_by: &str) -> Result<(), RequestError> {
    let owner = existing
        .object
        .metadata()
        .managed_by
        .as_deref()
        .unwrap_or("api");
    // The manifest directory may move an object between its files; nobody
    // else may touch what a file owns.
    if owner != managed_by && owner.starts_with("file:") && !managed_by.starts_with("file:") {
        return Err(RequestError::Conflict(format!(
            "{} is owned by the manifest file {}; edit or remove that file instead",
            existing.object.display_name(),
            owner.trim_start_matches("file:")
        )));
    }
    Ok(())
}

/// 1 s, 2 s, 4 s ... capped at 60 s.
fn backoff(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}

#[cfg(test)]
mod tests {
    use super::backoff;
    use std::time::Duration;

    #[test]
    fn backoff_grows_and_caps() {
        assert_eq!(backoff(1), Duration::from_secs(1));
        assert_eq!(backoff(2), Duration::from_secs(2));
        assert_eq!(backoff(4), Duration::from_secs(8));
        assert_eq!(backoff(50), Duration::from_secs(60));
    }
}
