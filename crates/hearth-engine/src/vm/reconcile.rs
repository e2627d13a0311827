//! The async shell of the VM lifecycle: observe, ask `decide`, perform the
//! step, repeat until the VM is at rest. Idempotent: running it again with
//! nothing changed does nothing.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use chrono::Utc;
use hearth_api::{
    ConditionStatus, DiskPhase, EventType, Kind, Object, RunPolicy, VirtualDiskStatus,
    VirtualMachine, VmPhase, remove_condition, set_condition,
};
use hearth_qemu::process;

use super::decide::{Disks, Observation, Process, Step, StopReason, decide};
use crate::context::{Action, Context, ReconcileError};
use crate::runtime::RuntimeRecord;

use super::fingerprint;
use super::start::launch;
use super::stop::stop;

fn want_running(vm: &VirtualMachine, intent: &crate::store::RunIntent) -> bool {
    match vm.spec.run_policy {
        RunPolicy::AlwaysOn => intent.want_running.unwrap_or(true),
        RunPolicy::AlwaysOff => false,
        RunPolicy::Manual => intent.want_running.unwrap_or(false),
    }
}

pub async fn reconcile(ctx: &Arc<Context>, name: &str) -> Result<Action, ReconcileError> {
    for _ in 0..4 {
        let Some(stored) = ctx.store.get(Kind::VirtualMachine, name)? else {
            ctx.drop_live(name);
            return Ok(Action::Done);
        };
        let Object::VirtualMachine(vm) = &stored.object else {
            return Ok(Action::Done);
        };
        let intent = ctx.store.intent(name)?;
        let record = ctx.store.runtime(name)?;
        let process = match &record {
            None => Process::None,
            Some(r) if process::is_alive(&r.process) => {
                ctx.ensure_live(r).await;
                Process::Alive
            }
            Some(_) => Process::Gone,
        };
        let observation = Observation {
            deleting: stored.deleting,
            want_running: want_running(vm, &intent),
            process,
            spec_changed: record.as_ref().is_some_and(|r| {
                r.spec_fingerprint != fingerprint(vm) || super::nics::networks_changed(vm, r)
            }),
            restart_requested: record
                .as_ref()
                .is_some_and(|r| intent.restart_nonce > r.restart_nonce),
            disks: disks_ready(ctx, vm)?,
        };
        let step = decide(&observation);
        tracing::debug!(vm = name, ?observation, ?step, "reconcile");
        match &step {
            Step::Launch => {
                // Never while a snapshot cut holds the VM or one of its disks.
                let _ops = ctx.lock_vm_ops(vm).await;
                if ctx.store.runtime(name)?.is_none() {
                    // A launch a crashed daemon left unrecorded first: its
                    // QEMU is adopted (then nothing is launched) or stopped.
                    let adopted = super::launches::settle_vm(ctx, name).await?;
                    match adopted {
                        Some(record) => {
                            ctx.ensure_live(&record).await;
                        }
                        None => {
                            if let Some(why) = super::nics::waiting_for(ctx, vm)? {
                                // The network's reconcile wakes this VM once it is Ready.
                                ctx.set_vm_status(name, |s| {
                                    s.phase = VmPhase::Pending;
                                    set_condition(
                                        &mut s.conditions,
                                        "NetworksReady",
                                        ConditionStatus::False,
                                        "NetworkNotReady",
                                        &why,
                                        Utc::now(),
                                    );
                                });
                                return Ok(Action::Done);
                            }
                            launch(ctx, vm, intent.restart_nonce).await?
                        }
                    }
                }
            }
            Step::Stop(reason) => {
                if let Some(r) = &record {
                    if *reason == StopReason::SpecChanged {
                        super::nics::note_restart_for_networks(ctx, vm, r);
                    }
                    let _ops = ctx.lock_vm_ops(vm).await;
                    stop(ctx, vm, r, *reason).await?;
                }
            }
            Step::Forget => {
                if let Some(r) = &record {
                    forget(ctx, vm, r)?;
                }
            }
            Step::Remove => {
                remove(ctx, vm)?;
            }
            Step::WaitForDisks(why) => {
                ctx.set_vm_status(name, |s| {
                    s.phase = VmPhase::Pending;
                    set_condition(
                        &mut s.conditions,
                        "DisksReady",
                        ConditionStatus::False,
                        "DiskNotReady",
                        why,
                        Utc::now(),
                    );
                });
            }
            Step::KeepRunning => {
                let agent = ctx.live_agent_connected(name);
                let generation = vm.metadata.generation;
                ctx.set_vm_status(name, |s| {
                    s.phase = VmPhase::Running;
                    s.agent_connected = agent;
                    s.observed_generation = generation;
                    set_condition(
                        &mut s.conditions,
                        "DisksReady",
                        ConditionStatus::True,
                        "Attached",
                        "all disks are attached",
                        Utc::now(),
                    );
                });
                if agent
                    && !vm.spec.networks.is_empty()
                    && let Some(again) = super::nics::confirm_with_agent(ctx, name).await
                {
                    return Ok(Action::RequeueAfter(again));
                }
            }
            Step::KeepStopped => {
                let generation = vm.metadata.generation;
                ctx.set_vm_status(name, |s| {
                    if s.phase != VmPhase::Failed {
                        s.phase = VmPhase::Stopped;
                    }
                    s.pid = None;
                    s.agent_connected = false;
                    s.observed_generation = generation;
                    // No QEMU, no NIC: nothing is claimed the host does not have.
                    s.interfaces.clear();
                    remove_condition(&mut s.conditions, "DisksReady");
                    remove_condition(&mut s.conditions, "NetworksReady");
                    remove_condition(&mut s.conditions, super::nics::NETWORKS_IN_EFFECT);
                });
            }
        }
        if !step.continues() {
            return Ok(Action::Done);
        }
    }
    Ok(Action::Done)
}

fn disks_ready(ctx: &Context, vm: &VirtualMachine) -> Result<Disks, ReconcileError> {
    if let Some(why) = super::boot::kernel_image_waiting(ctx, vm)? {
        return Ok(Disks::Waiting(why));
    }
    for d in &vm.spec.disks {
        let name = &d.virtual_disk_name;
        let Some(disk) = ctx.store.get(Kind::VirtualDisk, name)? else {
            return Ok(Disks::Waiting(format!(
                "VirtualDisk {name:?} does not exist yet"
            )));
        };
        if disk.deleting {
            return Ok(Disks::Waiting(format!(
                "VirtualDisk {name:?} is being deleted"
            )));
        }
        let status: VirtualDiskStatus = serde_json::from_value(disk.status).unwrap_or_default();
        if status.phase != DiskPhase::Ready || status.path.is_none() {
            return Ok(Disks::Waiting(format!(
                "VirtualDisk {name:?} is not ready yet ({})",
                status.phase
            )));
        }
    }
    Ok(Disks::Ready)
}

/// The recorded process is gone: say how it ended and drop the record.
fn forget(
    ctx: &Arc<Context>,
    vm: &VirtualMachine,
    record: &RuntimeRecord,
) -> Result<(), ReconcileError> {
    let name = vm.metadata.name.as_str();
    let live = ctx.take_live(name);
    let by_us = live
        .as_ref()
        .is_some_and(|l| l.stopping.load(Ordering::SeqCst));
    let shutdown = live
        .as_ref()
        .is_some_and(|l| l.shutdown_seen.load(Ordering::SeqCst));
    let manual = vm.spec.run_policy == RunPolicy::Manual;
    ctx.store.clear_runtime(name)?;
    super::nics::qemu_gone(ctx, vm, record);
    // Overlays made ahead for the QEMU that is gone: nobody switched to
    // them, and the next QEMU will not have their nodes.
    for disk in &record.disk_names {
        if let Ok(Some(a)) =
            crate::snapshot::overlays::of_disk::<crate::snapshot::overlays::Ahead>(&ctx.store, disk)
                .map(|mut a| a.pop())
            && let Err(e) = crate::snapshot::overlays::forget_ahead(&ctx.store, &a)
        {
            tracing::warn!(vm = name, disk, error = %e, "cannot remove an overlay made ahead");
        }
    }
    if let Some(dir) = record.qmp_socket.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
    let crashed = !by_us && !shutdown;
    if !by_us && manual {
        // A Manual VM that stopped on its own stays stopped.
        ctx.store
            .update_intent(name, |i| i.want_running = Some(false))?;
    }
    let last_error = if crashed {
        let tail = last_lines(&ctx.config.qemu_log(name), 5);
        Some(if tail.is_empty() {
            "QEMU exited unexpectedly".to_string()
        } else {
            format!("QEMU exited unexpectedly: {tail}")
        })
    } else {
        None
    };
    let set_status = |s: &mut hearth_api::VirtualMachineStatus| {
        s.phase = if crashed {
            VmPhase::Failed
        } else {
            VmPhase::Stopped
        };
        s.pid = None;
        s.agent_connected = false;
        if last_error.is_some() {
            s.last_error = last_error.clone();
        }
    };
    let (kind, reason, message) = match (by_us, shutdown) {
        (true, _) => (EventType::Normal, "Stopped", "QEMU has exited".to_string()),
        (false, true) => (
            EventType::Normal,
            "GuestPoweredOff",
            if manual {
                "the guest powered off; it stays stopped (runPolicy Manual)".to_string()
            } else if vm.spec.run_policy == RunPolicy::AlwaysOn {
                "the guest powered off; starting it again (runPolicy AlwaysOn)".to_string()
            } else {
                "the guest powered off".to_string()
            },
        ),
        (false, false) => (
            EventType::Warning,
            "Crashed",
            last_error.clone().unwrap_or_default(),
        ),
    };
    ctx.set_vm_status_with_event(name, set_status, kind, reason, &message);
    // Layers of its disks that could be merged only with no QEMU running
    // (docs/snapshots.md, "Compaction") are merged now, not at the next resync.
    for d in &record.disk_names {
        ctx.wake(Kind::VirtualDisk, d);
    }
    if crashed && !manual {
        // Restart with backoff rather than in a tight loop.
        return Err(ReconcileError::Failed(message));
    }
    Ok(())
}

fn remove(ctx: &Arc<Context>, vm: &VirtualMachine) -> Result<(), ReconcileError> {
    let name = vm.metadata.name.as_str();
    ctx.drop_live(name);
    let _ = std::fs::remove_dir_all(ctx.config.vm_run_dir(name));
    let _ = std::fs::remove_dir_all(ctx.config.vm_state_dir(name));
    super::boot::remove_staged(&ctx.config.boot_files_dir(), name);
    ctx.store.remove(Kind::VirtualMachine, name)?;
    ctx.metrics.forget_vm(name);
    ctx.event(
        Kind::VirtualMachine,
        name,
        EventType::Normal,
        "Deleted",
        "the VirtualMachine and its runtime files are gone",
    );
    for d in &vm.spec.disks {
        ctx.wake(Kind::VirtualDisk, &d.virtual_disk_name);
    }
    // Its taps, port forwards and dnsmasq hosts go at the networks' resync.
    for n in &vm.spec.networks {
        ctx.wake(Kind::VirtualNetwork, &n.virtual_network_name);
    }
    Ok(())
}

fn last_lines(path: &std::path::Path, n: usize) -> String {
    use std::io::{Read, Seek, SeekFrom};
    // Only the end is read, from its first data: the log keeps its length
    // when its start is punched out (vm/console.rs), so it can be far longer
    // than its data, and a hole reads as zeroes.
    let mut text = Vec::new();
    if let Ok(mut file) = std::fs::File::open(path) {
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let from = super::console::data_from(&file, len.saturating_sub(4096));
        if let Some(from) = from
            && file.seek(SeekFrom::Start(from)).is_ok()
        {
            let _ = file.take(4096).read_to_end(&mut text);
        }
    }
    let text = String::from_utf8_lossy(&text);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

#[cfg(test)]
mod tests {
    use super::last_lines;

    #[test]
    fn a_crash_reason_is_the_logs_last_lines_read_from_its_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qemu.log");
        assert_eq!(last_lines(&path, 5), "", "no log");
        // A log whose start was punched out keeps its length: 64 MiB of
        // hole, then QEMU's last lines. Reading the whole file would take
        // 64 MiB of memory; the reason comes from the end alone.
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(64 << 20).unwrap();
        drop(file);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        use std::io::Write;
        writeln!(f, "first\n\nqemu: could not load kernel\nterminating").unwrap();
        assert_eq!(
            last_lines(&path, 2),
            "qemu: could not load kernel | terminating"
        );
        assert_eq!(
            last_lines(&path, 5),
            "first | qemu: could not load kernel | terminating"
        );
    }
}
