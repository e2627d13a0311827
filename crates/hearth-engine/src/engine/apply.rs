//! The commands that write desired state: apply (with the checks every
//! object passes before anything is written), delete and the VM actions.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use chrono::Utc;
use hearth_api::{DiskSource, EventType, FieldError, Kind, Object, RunPolicy};

use super::errors::ApplyConflict;
use super::{
    ApplyAction, ApplyMode, ApplyOutcome, Engine, MAX_APPLY_OBJECTS, RequestError, VmAction,
};
use crate::store::{Store, StoredObject};

impl Engine {
    /// Creates or updates objects. All or nothing: every object is checked
    /// before any is written, and they are written in one transaction,
    /// with their events. At most [`MAX_APPLY_OBJECTS`] at once.
    pub fn apply(
        self: &Arc<Self>,
        objects: Vec<Object>,
        managed_by: &str,
    ) -> Result<Vec<ApplyOutcome>, RequestError> {
        self.apply_with(objects, managed_by, ApplyMode::CreateOrUpdate)
    }

    /// [`apply`](Self::apply) with a choice of what it may do: an apply
    /// that only creates refuses, before writing anything, an object that
    /// already exists (how `hearth snapshot` takes a new snapshot without
    /// ever re-applying over an old one).
    pub fn apply_with(
        self: &Arc<Self>,
        objects: Vec<Object>,
        managed_by: &str,
        mode: ApplyMode,
    ) -> Result<Vec<ApplyOutcome>, RequestError> {
        if objects.len() > MAX_APPLY_OBJECTS {
            return Err(RequestError::TooManyObjects {
                count: objects.len(),
            });
        }
        let _w = self.writes.lock().unwrap_or_else(|p| p.into_inner());
        let mut seen = HashSet::new();
        let mut prepared = Vec::new();
        let mut old_networks: Vec<String> = Vec::new();
        // The objects whose apply the networks must see.
        let mut networked: HashSet<(Kind, String)> = HashSet::new();
        for mut obj in objects {
            obj.strip_server_fields();
            obj.validate()?;
            if !seen.insert((obj.kind(), obj.name().to_string())) {
                return Err(RequestError::Twice {
                    object: obj.display_name(),
                });
            }
            self.check_host_paths(&obj)?;
            self.check_image_source(&obj)?;
            let existing = self.ctx.store.get(obj.kind(), obj.name())?;
            if mode == ApplyMode::CreateOnly && existing.is_some() {
                return Err(RequestError::Exists {
                    kind: obj.kind(),
                    name: obj.name().to_string(),
                });
            }
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
            // Labels and annotations alone: written, no new generation.
            let relabeled = existing.as_ref().is_some_and(|e| {
                let old = e.object.metadata();
                let new = obj.metadata();
                old.labels != new.labels || old.annotations != new.annotations
            });
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
            let networking = match &obj {
                Object::VirtualNetwork(_) => action != ApplyAction::Unchanged,
                _ => changes_interfaces(existing.as_ref().map(|e| &e.object), &obj),
            };
            if networking {
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
                networked.insert((obj.kind(), obj.name().to_string()));
            }
            prepared.push((obj, action, old_owner, relabeled));
        }
        self.check_disk_exclusivity(prepared.iter().map(|(o, _, _, _)| o))?;
        let addresses = self.ctx.addresses.lock().unwrap_or_else(|p| p.into_inner());
        // An apply that changes no network and no VM's interfaces needs no
        // network check: every object admitted since was checked against
        // the interfaces it keeps. (The check reads every VM.)
        if !networked.is_empty() {
            self.check_networks(prepared.iter().map(|(o, _, _, _)| o))?;
        }

        let to_write: Vec<Object> = prepared
            .iter()
            .filter(|(_, a, old_owner, relabeled)| {
                *a != ApplyAction::Unchanged || old_owner.is_some() || *relabeled
            })
            .map(|(o, _, _, _)| o.clone())
            .collect();
        let mut events: Vec<(Kind, &str, &'static str, String)> = Vec::new();
        for (obj, action, old_owner, relabeled) in &prepared {
            if *action == ApplyAction::Unchanged && *relabeled {
                events.push((
                    obj.kind(),
                    obj.name(),
                    "Labeled",
                    format!("labels or annotations set from {managed_by}; spec unchanged"),
                ));
            }
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
        self.ctx.store.with_tx(|tx| {
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
        for (obj, action, _, _) in prepared {
            self.wake(obj.kind(), obj.name());
            if let Object::VirtualMachine(vm) = &obj {
                for d in &vm.spec.disks {
                    self.wake(Kind::VirtualDisk, &d.virtual_disk_name);
                }
                // The networks assign (or release) its addresses, when its
                // interfaces changed: an edit of anything else costs no
                // network reconcile (each reads every link on the host).
                if networked.contains(&(Kind::VirtualMachine, vm.metadata.name.clone())) {
                    for n in &vm.spec.networks {
                        self.wake(Kind::VirtualNetwork, &n.virtual_network_name);
                    }
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

    /// Sets (`Some`) or removes (`None`) labels of an object, keeping its
    /// spec, generation and owner: how a user pins a snapshot a schedule
    /// made (`hearth.dev/keep: "true"`). A source's objects take their
    /// labels from the source.
    pub fn relabel(
        self: &Arc<Self>,
        kind: Kind,
        name: &str,
        changes: &BTreeMap<String, Option<String>>,
        by: &str,
    ) -> Result<StoredObject, RequestError> {
        let _w = self.writes.lock().unwrap_or_else(|p| p.into_inner());
        let mut existing = self.get(kind, name)?;
        check_owner(&existing, by)?;
        let meta = existing.object.metadata_mut();
        for (k, v) in changes {
            match v {
                Some(v) => meta.labels.insert(k.clone(), v.clone()),
                None => meta.labels.remove(k),
            };
        }
        existing.object.validate()?;
        let text: Vec<String> = changes
            .iter()
            .map(|(k, v)| match v {
                Some(v) => format!("{k}={v}"),
                None => format!("{k}-"),
            })
            .collect();
        let message = format!("labels {} by {by}", text.join(" "));
        self.ctx.store.with_tx(|tx| {
            Store::put_objects_tx(tx, std::slice::from_ref(&existing.object))?;
            Store::record_event_tx(
                tx,
                Utc::now(),
                kind,
                name,
                EventType::Normal,
                "Labeled",
                &message,
            )
        })?;
        self.wake(kind, name);
        Ok(existing)
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
            && let Some(vm) = self.ctx.vms_using_disk(name)?.first()
        {
            return Err(ApplyConflict::DiskInUse {
                disk: name.to_string(),
                vm: vm.clone(),
            }
            .into());
        }
        if kind == Kind::VirtualNetwork {
            let vms = crate::network::desired::vms_using_network(&self.ctx.store, name)?;
            if !vms.is_empty() {
                return Err(ApplyConflict::NetworkInUse {
                    network: name.to_string(),
                    vms,
                }
                .into());
            }
        }
        if kind == Kind::VirtualImage {
            let disks = crate::image::disks_blocking_delete(&self.ctx.store, name)?;
            if !disks.is_empty() {
                return Err(ApplyConflict::ImageInUse {
                    image: name.to_string(),
                    disks,
                }
                .into());
            }
        }
        if !existing.deleting {
            self.ctx.store.mark_deleting(kind, name)?;
            self.ctx.event(
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
            return Err(RequestError::not_found(Kind::VirtualMachine, name));
        };
        if stored.deleting {
            return Err(RequestError::deleting(Kind::VirtualMachine, name, ""));
        }
        if vm.spec.run_policy == RunPolicy::AlwaysOff && action != VmAction::Stop {
            return Err(ApplyConflict::AlwaysOff {
                vm: name.to_string(),
            }
            .into());
        }
        let message = match action {
            VmAction::Start => {
                self.ctx
                    .store
                    .update_intent(name, |i| i.want_running = Some(true))?;
                format!("VirtualMachine {name:?} is starting")
            }
            VmAction::Stop => {
                self.ctx
                    .store
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
                if self.ctx.store.runtime(name)?.is_none() {
                    self.ctx
                        .store
                        .update_intent(name, |i| i.want_running = Some(true))?;
                    format!("VirtualMachine {name:?} was not running; starting it")
                } else {
                    let next = self
                        .ctx
                        .store
                        .runtime(name)?
                        .map(|r| r.restart_nonce)
                        .unwrap_or(0)
                        + 1;
                    self.ctx.store.update_intent(name, |i| {
                        i.want_running = Some(true);
                        i.restart_nonce = i.restart_nonce.max(next);
                    })?;
                    format!("VirtualMachine {name:?} is restarting")
                }
            }
        };
        self.ctx.event(
            Kind::VirtualMachine,
            name,
            EventType::Normal,
            "UserRequest",
            &message,
        );
        self.wake(Kind::VirtualMachine, name);
        Ok(message)
    }
    fn check_host_paths(&self, obj: &Object) -> Result<(), RequestError> {
        let fail = |field: &str, message: &dyn std::fmt::Display| {
            RequestError::Invalid(FieldError {
                object: obj.display_name(),
                field: field.into(),
                message: message.to_string(),
            })
        };
        match obj {
            Object::VirtualMachine(vm) => {
                if let Some(boot) = &vm.spec.boot {
                    if let Some(k) = &boot.kernel {
                        self.ctx
                            .config
                            .confine(k)
                            .map_err(|m| fail("spec.boot.kernel", &m))?;
                    }
                    if let Some(i) = &boot.initrd {
                        self.ctx
                            .config
                            .confine(i)
                            .map_err(|m| fail("spec.boot.initrd", &m))?;
                    }
                }
            }
            Object::VirtualDisk(d) => {
                if let DiskSource::Image(p) = &d.spec.source {
                    self.ctx
                        .config
                        .confine(p)
                        .map_err(|m| fail("spec.source.image", &m))?;
                }
            }
            Object::VirtualImage(image) => match &image.spec.source {
                hearth_api::ImageSource::File(p) => {
                    self.ctx
                        .config
                        .confine(p)
                        .map_err(|m| fail("spec.source.file", &m))?;
                }
                hearth_api::ImageSource::Oci(o) => {
                    if let Some(p) = &o.layout {
                        self.ctx
                            .config
                            .confine_dir(p)
                            .map_err(|m| fail("spec.source.oci.layout", &m))?;
                    }
                    if let Some(p) = &o.archive {
                        self.ctx
                            .config
                            .confine(p)
                            .map_err(|m| fail("spec.source.oci.archive", &m))?;
                    }
                }
                hearth_api::ImageSource::Http(_) => {}
            },
            Object::VirtualDiskSnapshot(_)
            | Object::VirtualMachineSnapshot(_)
            | Object::VirtualMachineSnapshotGroup(_)
            | Object::VirtualNetwork(_) => {}
            Object::VirtualMachineSnapshotSchedule(sch) => {
                if let Some(b) = &sch.spec.backup {
                    self.check_backup_target(&b.to)
                        .map_err(|m| fail("spec.backup.to", &m))?;
                }
            }
            Object::VirtualMachineBackup(b) => {
                self.check_backup_target(&b.spec.to)
                    .map_err(|m| fail("spec.to", &m))?;
            }
        }
        Ok(())
    }

    /// A backup target is never in hearthd's own state nor holds it, and
    /// only goes where a parent exists (a typo does not make a tree of
    /// directories). By real paths: a link is where it leads.
    fn check_backup_target(&self, to: &std::path::Path) -> Result<(), String> {
        let state = crate::backup::target::real_path(&self.ctx.config.state_dir);
        let real = crate::backup::target::real_path(to);
        if real.starts_with(&state) || state.starts_with(&real) {
            return Err(format!(
                "{} is hearthd's state directory or holds it; back up elsewhere",
                to.display()
            ));
        }
        if !to.parent().is_some_and(|p| p.is_dir()) {
            return Err(format!(
                "the parent directory of {} does not exist",
                to.display()
            ));
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
        let Some(stored) = self.ctx.store.get(Kind::VirtualImage, image)? else {
            return Ok(());
        };
        if stored.deleting {
            return Err(ApplyConflict::ImageDeleting {
                disk: d.metadata.name.clone(),
                image: image.clone(),
            }
            .into());
        }
        if self.ctx.store.get(Kind::VirtualDisk, obj.name())?.is_some() {
            // An existing disk's spec cannot change (checked below).
            return Ok(());
        }
        let size = d.spec.size.as_ref().map(|q| q.bytes());
        if let Err(why) = crate::image::ready_for_disk(&self.ctx.store, image, size)?
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
            return Err(RequestError::deleting(
                new.kind(),
                new.name(),
                "; apply it again once it is gone",
            ));
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
        use crate::network::admission::{self, NetworkView, VmView};
        let batch: Vec<&Object> = batch.collect();
        let touches_networks = batch.iter().any(|o| match o {
            Object::VirtualNetwork(_) => true,
            Object::VirtualMachine(vm) => !vm.spec.networks.is_empty(),
            _ => false,
        });
        if !touches_networks {
            return Ok(());
        }
        let leases = self.ctx.store.leases()?;
        let mut networks = BTreeMap::new();
        for s in self.ctx.store.list(Kind::VirtualNetwork)? {
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
            &self.ctx.store.runtimes()?,
            &self.ctx.store.launches(None)?,
        );
        let running = |vm: &hearth_api::VirtualMachine| {
            launched
                .get(&vm.metadata.name)
                .map(|l| crate::network::desired::in_effect(vm, Some(l)))
        };
        // A VM with no interface, in its spec or its QEMU, claims nothing
        // these checks look at: only the others are read.
        let mut vms = BTreeMap::new();
        for vm in crate::network::desired::networked_vms(&self.ctx.store, &launched)? {
            vms.insert(
                vm.metadata.name.clone(),
                VmView {
                    running: running(&vm),
                    vm,
                    in_batch: false,
                },
            );
        }
        for o in batch {
            match o {
                Object::VirtualNetwork(n) => {
                    let name = n.metadata.name.clone();
                    let (status, deleting) = match networks.get(&name) {
                        Some(old) => {
                            let held = leases.iter().filter(|l| l.network == name).count();
                            admission::check_network_update(old, n, held)
                                .map_err(RequestError::from)?;
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
        admission::check(&networks, &vms, &leases).map_err(RequestError::from)
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
        // The stored owners of the batch's disks only (an index kept with
        // the VMs): an apply costs its own disks, not every VM's.
        let mut owner: HashMap<String, String> = HashMap::new();
        for o in &batch {
            if let Object::VirtualMachine(vm) = o {
                for d in &vm.spec.disks {
                    if owner.contains_key(&d.virtual_disk_name) {
                        continue;
                    }
                    let stored = self.ctx.store.disk_claimants(&d.virtual_disk_name)?;
                    if let Some(other) =
                        stored.into_iter().find(|v| !batch_vms.contains(v.as_str()))
                    {
                        owner.insert(d.virtual_disk_name.clone(), other);
                    }
                }
            }
        }
        for o in batch {
            if let Object::VirtualMachine(vm) = o {
                for (i, d) in vm.spec.disks.iter().enumerate() {
                    if let Some(other) = owner.get(&d.virtual_disk_name) {
                        return Err(ApplyConflict::DiskTaken {
                            vm: vm.metadata.name.clone(),
                            index: i,
                            disk: d.virtual_disk_name.clone(),
                            other: other.clone(),
                        }
                        .into());
                    }
                    owner.insert(d.virtual_disk_name.clone(), vm.metadata.name.clone());
                }
            }
        }
        Ok(())
    }
}

fn check_owner(existing: &StoredObject, managed_by: &str) -> Result<(), RequestError> {
    let owner = existing
        .object
        .metadata()
        .managed_by
        .as_deref()
        .unwrap_or("api");
    // A source (the manifest directory, a git repository) may move an
    // object between its files; nobody else may touch what a source owns.
    use crate::manifest::owner::{FILE_PREFIX, source_of};
    let Some(source) = source_of(owner) else {
        return Ok(());
    };
    if owner == managed_by || source_of(managed_by).as_deref() == Some(source.as_str()) {
        return Ok(());
    }
    if let Some(file) = owner.strip_prefix(FILE_PREFIX) {
        return Err(RequestError::OwnedByFile {
            object: existing.object.display_name(),
            file: file.to_string(),
        });
    }
    Err(RequestError::OwnedBySource {
        object: existing.object.display_name(),
        owner: owner.to_string(),
    })
}

/// Whether applying `new` over `old` (None: a new object) changes a VM's
/// interfaces: the only part of a VM that networking reads, with its name.
fn changes_interfaces(old: Option<&Object>, new: &Object) -> bool {
    match (old, new) {
        (Some(Object::VirtualMachine(old)), Object::VirtualMachine(new)) => {
            old.spec.networks != new.spec.networks
        }
        (_, Object::VirtualMachine(new)) => !new.spec.networks.is_empty(),
        _ => false,
    }
}
