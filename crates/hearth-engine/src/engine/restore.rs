//! Restore: a VM's disks rebuilt from a Ready snapshot, one VM or every
//! member of a snapshot group.

use std::sync::Arc;
use std::time::Duration;

use hearth_api::{EventType, Kind, Object, VirtualDiskStatus, VirtualMachine};

use super::errors::RestoreError;
use super::{Engine, RequestError};

impl Engine {
    /// Restores every member of a Ready VirtualMachineSnapshotGroup, side
    /// by side: each member VM is stopped, rebuilt from its member snapshot
    /// and started again if it ran (`restore_vm`). Everything is checked
    /// before any VM is stopped; a member that fails to restore does not stop
    /// the others, and the answer names it.
    pub async fn restore_group(self: &Arc<Self>, name: &str) -> Result<String, RequestError> {
        let stored = self.get(Kind::VirtualMachineSnapshotGroup, name)?;
        let Object::VirtualMachineSnapshotGroup(group) = &stored.object else {
            return Err(RequestError::not_found(
                Kind::VirtualMachineSnapshotGroup,
                name,
            ));
        };
        let status: hearth_api::SnapshotStatus =
            serde_json::from_value(stored.status.clone()).unwrap_or_default();
        if status.phase != hearth_api::SnapshotPhase::Ready {
            return Err(RestoreError::GroupNotReady {
                group: name.to_string(),
                phase: status.phase,
                message: status.message,
            }
            .into());
        }
        let mut plan = Vec::new();
        for vm in &group.spec.virtual_machine_names {
            let member = crate::snapshot::group_member_name(name, vm);
            self.get(Kind::VirtualMachine, vm)?;
            let m = self.get(Kind::VirtualMachineSnapshot, &member)?;
            let ms: hearth_api::SnapshotStatus =
                serde_json::from_value(m.status.clone()).unwrap_or_default();
            if ms.phase != hearth_api::SnapshotPhase::Ready {
                return Err(RestoreError::MemberNotReady {
                    member,
                    phase: ms.phase,
                }
                .into());
            }
            plan.push((vm.clone(), member));
        }
        let each = plan.iter().map(|(vm, member)| {
            let engine = self.clone();
            async move { (vm, engine.restore_vm(vm, member).await) }
        });
        let results = futures_util::future::join_all(each).await;
        let failed: Vec<(String, String)> = results
            .iter()
            .filter_map(|(vm, r)| r.as_ref().err().map(|e| (vm.to_string(), e.to_string())))
            .collect();
        if !failed.is_empty() {
            return Err(RestoreError::MembersFailed {
                group: name.to_string(),
                members: plan.len(),
                failed,
            }
            .into());
        }
        let message = format!(
            "VirtualMachineSnapshotGroup {name:?}: {} VM(s) restored ({})",
            plan.len(),
            plan.iter()
                .map(|(vm, m)| format!("{vm} from {m}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        self.ctx.event(
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
            return Err(RequestError::not_found(Kind::VirtualMachine, vm_name));
        };
        let snap = self.get(Kind::VirtualMachineSnapshot, from)?;
        let Object::VirtualMachineSnapshot(vmsnap) = &snap.object else {
            return Err(RequestError::not_found(Kind::VirtualMachineSnapshot, from));
        };
        if snap.deleting {
            return Err(RequestError::deleting(
                Kind::VirtualMachineSnapshot,
                from,
                "; nothing was restored",
            ));
        }
        if vmsnap.spec.virtual_machine_name != vm_name {
            return Err(RestoreError::OtherVm {
                snapshot: from.to_string(),
                of: vmsnap.spec.virtual_machine_name.clone(),
                vm: vm_name.to_string(),
            }
            .into());
        }
        let status: hearth_api::SnapshotStatus =
            serde_json::from_value(snap.status.clone()).unwrap_or_default();
        if status.phase != hearth_api::SnapshotPhase::Ready {
            return Err(RestoreError::NotReady {
                snapshot: from.to_string(),
                phase: status.phase,
            }
            .into());
        }
        // Each disk snapshot's pin is held from reading its layer until the
        // restored heads are recorded (from then on the store keeps the
        // layers): a delete of the snapshot waits for the restore, and a
        // snapshot whose delete came first is not restored.
        let mut _pins = Vec::new();
        for child in &status.virtual_disk_snapshot_names {
            _pins.push(self.ctx.exports.of(child).read_owned().await);
        }
        if self.get(Kind::VirtualMachineSnapshot, from)?.deleting {
            return Err(RequestError::deleting(
                Kind::VirtualMachineSnapshot,
                from,
                "; nothing was restored",
            ));
        }
        let mut plan = Vec::new();
        for child in &status.virtual_disk_snapshot_names {
            let c = self.get(Kind::VirtualDiskSnapshot, child)?;
            if c.deleting {
                return Err(RestoreError::DiskSnapshotDeleting {
                    disk_snapshot: child.clone(),
                    snapshot: from.to_string(),
                }
                .into());
            }
            let Object::VirtualDiskSnapshot(ds) = &c.object else {
                continue;
            };
            let disk = ds.spec.virtual_disk_name.clone();
            if !vm.spec.disks.iter().any(|d| d.virtual_disk_name == disk) {
                return Err(RestoreError::DiskGone {
                    disk,
                    vm: vm_name.to_string(),
                }
                .into());
            }
            let layer = storage::snapshot_layer(&self.ctx.store, child)?.ok_or_else(|| {
                RestoreError::NoLayer {
                    disk_snapshot: child.clone(),
                }
            })?;
            plan.push((disk, layer));
        }
        let was_running = self
            .ctx
            .store
            .runtime(vm_name)?
            .is_some_and(|r| hearth_qemu::process::is_alive(&r.process));
        let previous = self.ctx.store.intent(vm_name)?;
        if was_running {
            self.ctx
                .store
                .update_intent(vm_name, |i| i.want_running = Some(false))?;
            self.ctx.event(
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
            self.ctx.store.update_intent(vm_name, |i| {
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
        self.ctx.event(
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
            while self.ctx.store.runtime(vm_name)?.is_some() {
                if started.elapsed() > limit {
                    return Err(RestoreError::DidNotStop {
                        vm: vm_name.to_string(),
                        seconds: limit.as_secs(),
                    }
                    .into());
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        let _ops = self.ctx.lock_vm_ops(vm).await;
        if self.ctx.store.runtime(vm_name)?.is_some() {
            return Err(RestoreError::Running {
                vm: vm_name.to_string(),
            }
            .into());
        }
        // The last QEMU is gone: a cut it left unsettled is settled first,
        // so the heads replaced below are the real ones.
        let disks: Vec<String> = plan.iter().map(|(d, _)| d.clone()).collect();
        crate::snapshot::overlays::settle_offline(&self.ctx.store, &disks)
            .await
            .map_err(RestoreError::SettleOverlays)?;
        crate::snapshot::compaction::settle_offline(&self.ctx, &disks)
            .await
            .map_err(RestoreError::SettleCompaction)?;
        let state_dir = self.ctx.config.state_dir.clone();
        std::fs::create_dir_all(storage::layers_dir(&state_dir))
            .map_err(RestoreError::LayersDir)?;
        let mut made = Vec::new();
        for (disk, layer) in plan {
            let new = storage::allocate(&self.ctx.store, &state_dir, disk)?;
            if let Err(e) =
                hearth_qemu::img::create_overlay(&new.path, &layer.path, "qcow2", None).await
            {
                for (_, m, _) in &made {
                    let m: &storage::NewLayer = m;
                    let _ = std::fs::remove_file(&m.path);
                }
                return Err(RestoreError::Overlay {
                    disk: disk.clone(),
                    reason: e,
                }
                .into());
            }
            made.push((disk.clone(), new, layer.id.clone()));
        }
        self.ctx.store.with_tx(|tx| {
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
        storage::collect_garbage(&self.ctx.store)?;
        Ok(())
    }
}
