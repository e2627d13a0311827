//! The async shell of the VM lifecycle: observe, ask `decide`, perform the
//! step, repeat until the VM is at rest. Idempotent: running it again with
//! nothing changed does nothing.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use chrono::Utc;
use hearth_api::{
    ConditionStatus, DiskPhase, EventType, Kind, Object, RunPolicy, VirtualDiskStatus,
    VirtualMachine, VmPhase, remove_condition, set_condition,
};
use hearth_qemu::ProcessIdentity;
use hearth_qemu::cmdline::{DiskAttachment, KernelBoot, LaunchSpec, disk_serial};
use hearth_qemu::process;
use serde_json::json;

use super::VmError;
use super::chain::ChainError;
use super::decide::{Disks, Observation, Process, Step, StopReason, decide};
use crate::context::{Context, ReconcileError};
use crate::runtime::{LaunchMarker, RuntimeRecord};

const LAUNCH_READY_TIMEOUT: Duration = Duration::from_secs(20);
const FORCED_STOP_WAIT: Duration = Duration::from_secs(5);

/// The part of a spec that needs a restart to take effect.
pub fn fingerprint(vm: &VirtualMachine) -> String {
    let s = &vm.spec;
    json!({
        "cpus": s.cpus,
        "memoryBytes": s.memory.bytes(),
        "boot": s.boot,
        "firmware": s.firmware,
        "disks": s.disks,
        "cloudInit": s.cloud_init,
        "guestAgent": s.guest_agent,
    })
    .to_string()
}

fn want_running(vm: &VirtualMachine, intent: &crate::store::RunIntent) -> bool {
    match vm.spec.run_policy {
        RunPolicy::AlwaysOn => intent.want_running.unwrap_or(true),
        RunPolicy::AlwaysOff => false,
        RunPolicy::Manual => intent.want_running.unwrap_or(false),
    }
}

pub async fn reconcile(ctx: &Arc<Context>, name: &str) -> Result<(), ReconcileError> {
    for _ in 0..4 {
        let Some(stored) = ctx.store.get(Kind::VirtualMachine, name)? else {
            ctx.drop_live(name);
            return Ok(());
        };
        let Object::VirtualMachine(vm) = &stored.object else {
            return Ok(());
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
                                return Ok(());
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
                if agent && !vm.spec.networks.is_empty() {
                    super::nics::confirm_with_agent(ctx, name).await;
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
            return Ok(());
        }
    }
    Ok(())
}

fn disks_ready(ctx: &Context, vm: &VirtualMachine) -> Result<Disks, ReconcileError> {
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

async fn launch(
    ctx: &Arc<Context>,
    vm: &VirtualMachine,
    restart_nonce: u64,
) -> Result<(), ReconcileError> {
    let name = vm.metadata.name.as_str();
    ctx.set_vm_status(name, |s| {
        s.phase = VmPhase::Starting;
        s.last_error = None;
    });
    match try_launch(ctx, vm, restart_nonce).await {
        Ok(Launched {
            record,
            cloud_init_instance_id,
            nics,
        }) => {
            let accel = ctx.config.accel.clone();
            let pid = record.process.pid;
            let generation = vm.metadata.generation;
            super::mark_running(ctx, &record, |s| {
                s.accelerator_reason = Some(accel.reason.clone());
                s.observed_generation = generation;
                s.cloud_init_instance_id = cloud_init_instance_id;
                s.interfaces = super::nics::attached(&nics);
                remove_condition(&mut s.conditions, "NetworksReady");
                remove_condition(&mut s.conditions, super::nics::NETWORKS_IN_EFFECT);
            });
            let mut message = format!("QEMU started (pid {pid}) with accelerator {}", accel.reason);
            if let Some(backend) = super::nics::describe_backend(&nics) {
                message.push_str("; ");
                message.push_str(&backend);
            }
            ctx.event(
                Kind::VirtualMachine,
                name,
                EventType::Normal,
                "Started",
                &message,
            );
            // The first snapshot of this QEMU then only has to freeze.
            ctx.snapshots.prepare_ahead(ctx, &format!("vm/{name}"));
            Ok(())
        }
        Err(e) => {
            let message = e.to_string();
            // This spec was tried: a waiter can tell this failure from one of
            // an older generation.
            let generation = vm.metadata.generation;
            ctx.set_vm_status(name, |s| {
                s.phase = VmPhase::Failed;
                s.pid = None;
                s.last_error = Some(message.clone());
                s.observed_generation = generation;
            });
            ctx.event(
                Kind::VirtualMachine,
                name,
                EventType::Warning,
                "FailedToStart",
                &message,
            );
            Err(ReconcileError::Failed(message))
        }
    }
}

/// A QEMU that runs now, and what it was given.
struct Launched {
    record: RuntimeRecord,
    /// The `instance-id` of the cloud-init seed it has, if any.
    cloud_init_instance_id: Option<String>,
    /// Its NICs, in guest order.
    nics: Vec<(
        crate::network::desired::Nic,
        hearth_qemu::cmdline::NicAttachment,
    )>,
}

async fn try_launch(
    ctx: &Arc<Context>,
    vm: &VirtualMachine,
    restart_nonce: u64,
) -> Result<Launched, VmError> {
    let name = vm.metadata.name.as_str();
    let cfg = &ctx.config;
    // Without spec.boot the firmware boots from the disks, in their order
    // (validation made sure there is at least one).
    let kernel = match &vm.spec.boot {
        Some(boot) => Some(KernelBoot {
            kernel: cfg
                .confine(&boot.kernel)
                .map_err(|source| VmError::BootFile {
                    field: "spec.boot.kernel",
                    source,
                })?,
            initrd: match &boot.initrd {
                Some(p) => Some(cfg.confine(p).map_err(|source| VmError::BootFile {
                    field: "spec.boot.initrd",
                    source,
                })?),
                None => None,
            },
            cmdline: boot.cmdline.clone(),
        }),
        None => None,
    };
    // No QEMU of this VM runs: a snapshot cut its last QEMU left unsettled
    // is settled now, so the VM boots from each disk's real head.
    let disk_names: Vec<String> = vm
        .spec
        .disks
        .iter()
        .map(|d| d.virtual_disk_name.clone())
        .collect();
    crate::snapshot::overlays::settle_offline(&ctx.store, &disk_names)
        .await
        .map_err(|e| VmError::Unsettled(e.to_string()))?;
    // And a chain merge its last QEMU (or a dead daemon's qemu-img) left:
    // the store's chain and the headers agree before QEMU opens them.
    crate::snapshot::compaction::settle_offline(ctx, &disk_names)
        .await
        .map_err(|e| VmError::Unsettled(e.to_string()))?;
    let mut disks = Vec::new();
    for (i, d) in vm.spec.disks.iter().enumerate() {
        let stored = ctx
            .store
            .get(Kind::VirtualDisk, &d.virtual_disk_name)?
            .ok_or_else(|| VmError::DiskGone {
                index: i,
                disk: d.virtual_disk_name.clone(),
            })?;
        let status: VirtualDiskStatus = serde_json::from_value(stored.status).unwrap_or_default();
        let path = status.path.ok_or_else(|| VmError::DiskWithoutFile {
            index: i,
            disk: d.virtual_disk_name.clone(),
        })?;
        let refused = |source: ChainError| VmError::Disk {
            index: i,
            disk: d.virtual_disk_name.clone(),
            source,
        };
        // The chain the store recorded, not the one the headers name now.
        let backing = super::chain::backing_layers(ctx, &d.virtual_disk_name, &path)
            .await
            .map_err(refused)?;
        let disk = DiskAttachment {
            node_name: format!("disk{i}"),
            path,
            read_only: false,
            // The guest sees it as the disk's serial, so the guest agent's
            // filesystem report can be tied back to this VirtualDisk.
            serial: disk_serial(&d.virtual_disk_name),
            backing,
        };
        // Refused here, before anything is prepared for QEMU; the handover
        // checks the same again on the descriptors it gives QEMU.
        hearth_qemu::chain::check_disk(&disk).map_err(|e| refused(e.into()))?;
        disks.push(disk);
    }
    let run_dir = cfg.vm_run_dir(name);
    let state_dir = cfg.vm_state_dir(name);
    for dir in [&run_dir, &state_dir] {
        std::fs::create_dir_all(dir).map_err(|source| VmError::Dir {
            path: dir.clone(),
            source,
        })?;
    }
    // No QEMU of this VM runs (a leftover launch was settled first), so the
    // files it reads can be made or replaced now. Both live in the VM's
    // state directory and go with it when the VM is deleted.
    let firmware = super::firmware::prepare(cfg, name, vm.spec.firmware)?;
    if let Some(template) = &firmware.vars_created_from {
        ctx.event(
            Kind::VirtualMachine,
            name,
            EventType::Normal,
            "UefiVarsCreated",
            &format!(
                "its UEFI variables file {} starts as a copy of {}",
                cfg.uefi_vars_path(name).display(),
                template.display()
            ),
        );
    }
    let seed = prepare_seed(cfg, vm).await?;
    // The interfaces and their addresses are fixed under the address lock
    // and recorded with the launch marker before it is let go: from then on
    // no lease plan moves or releases them, and the host keeps their taps
    // and forwards, whatever the spec says, until this QEMU is gone.
    let addresses = ctx.addresses.lock().unwrap_or_else(|p| p.into_inner());
    let launched_nics = super::nics::to_launch(ctx, vm)?;
    let nics = super::nics::attachments(vm, &launched_nics);
    // `process::launch` binds the sockets for QEMU, removing a stale file
    // only if nothing listens on it: a socket a running QEMU serves is
    // never cut off.
    let qmp_socket = run_dir.join("qmp.sock");
    let agent_socket = vm.spec.guest_agent.then(|| run_dir.join("agent.sock"));
    let serial_log = cfg.serial_log(name);
    let spec = LaunchSpec {
        vm_name: name.to_string(),
        cpus: vm.spec.cpus,
        memory_mib: vm.spec.memory.mebibytes(),
        accel: cfg.accel.accel,
        firmware: firmware.firmware,
        kernel,
        disks: disks.clone(),
        // After the disks, never in the record's disks: a seed is not a
        // VirtualDisk, and no snapshot ever covers it.
        seed: seed.as_ref().map(|_| cfg.cloud_init_seed_path(name)),
        nics: nics.iter().map(|(_, a)| a.clone()).collect(),
        agent_socket: agent_socket.clone(),
        qmp_socket: qmp_socket.clone(),
        serial_log: serial_log.clone(),
        serial_socket: Some(cfg.serial_socket(name)),
    };
    let qemu_log = state_dir.join("qemu.log");
    let mut record = RuntimeRecord {
        vm: name.to_string(),
        // Unknown until QEMU runs.
        process: ProcessIdentity {
            pid: 0,
            start_ticks: 0,
        },
        qmp_socket,
        agent_socket,
        serial_log,
        accel: cfg.accel.accel,
        started_at: Utc::now(),
        spec_fingerprint: fingerprint(vm),
        restart_nonce,
        disks: disks.into_iter().map(|d| d.path).collect(),
        disk_names: vm
            .spec
            .disks
            .iter()
            .map(|d| d.virtual_disk_name.clone())
            .collect(),
        networks: Some(launched_nics.clone()),
    };
    // Recorded durably before the spawn, under an id that never repeats, so a
    // daemon that dies before the runtime record below is written leaves a way
    // to find this QEMU: its pidfile path (which names the launch) is in its
    // environment.
    let launch_id = ctx
        .store
        .next_counter("launch")
        .map_err(VmError::RecordLaunch)?;
    let marker = LaunchMarker {
        id: launch_id,
        vm: name.to_string(),
        pidfile: run_dir.join(format!("qemu-launch-{launch_id}.pid")),
        boot_id: process::boot_id().unwrap_or_default(),
        not_before_ticks: process::spawn_floor_ticks().unwrap_or(0),
        created_at: Utc::now(),
        record: record.clone(),
    };
    ctx.store
        .put_launch(&marker)
        .map_err(VmError::RecordLaunch)?;
    drop(addresses);
    // The taps exist before hearthd attaches to them for QEMU (by name: a
    // missing one would be a new tap that no bridge has).
    if let Err(e) = super::nics::prepare(ctx, &launched_nics).await {
        // Nothing was spawned for this launch.
        let _ = ctx.store.drop_launch(launch_id);
        return Err(e);
    }
    let launched = process::launch_with(
        &cfg.qemu_binary,
        &spec,
        &qemu_log,
        LAUNCH_READY_TIMEOUT,
        Some(&marker.pidfile),
        cfg.qemu_user.as_ref(),
        super::launches::crash_after_spawn_hook,
    )
    .await;
    let identity = match launched {
        Ok(identity) => identity,
        Err(e) => {
            // Whatever started is gone or being killed: make sure, then drop
            // the marker. If that fails the marker stays and blocks the next
            // launch until it is settled.
            if let Some(id) = super::launches::find(&marker) {
                let _ = super::launches::stop(&marker.record.qmp_socket, &id).await;
            }
            if super::launches::find(&marker).is_none() {
                let _ = ctx.store.drop_launch(launch_id);
            }
            if let process::LaunchError::Handover(hearth_qemu::handover::HandoverError::Layer {
                index,
                source,
            }) = e
            {
                // A layer that changed since the check above.
                return Err(VmError::Disk {
                    index,
                    disk: vm
                        .spec
                        .disks
                        .get(index)
                        .map(|d| d.virtual_disk_name.clone())
                        .unwrap_or_default(),
                    source: source.into(),
                });
            }
            return Err(VmError::DidNotStart {
                hint: permission_hint(&e, cfg.qemu_user.as_ref()),
                source: e,
            });
        }
    };
    record.process = identity;
    record.started_at = Utc::now();
    // The runtime record replaces the marker in one transaction, before
    // anything else happens.
    if let Err(e) = ctx.store.record_launch(launch_id, &record) {
        let _ = process::signal(&record.process, process::Signal::Kill);
        return Err(VmError::RecordStarted(e));
    }
    ctx.ensure_live(&record).await;
    Ok(Launched {
        record,
        cloud_init_instance_id: seed.map(|s| s.instance_id),
        nics,
    })
}

/// What to add to a start-up failure that was a denied open: QEMU runs as
/// an unprivileged user, and the files it opens by path (kernel, initrd,
/// OVMF code) must be readable by that user.
fn permission_hint(
    e: &process::LaunchError,
    user: Option<&hearth_qemu::handover::QemuUser>,
) -> String {
    match (e, user) {
        (process::LaunchError::Exited { stderr_tail, .. }, Some(user))
            if stderr_tail.contains("Permission denied") =>
        {
            format!(
                " (QEMU runs as user {:?}: the kernel, initrd and OVMF code must be readable by it, and every directory above them passable)",
                user.name
            )
        }
        _ => String::new(),
    }
}

/// Builds the VM's cloud-init seed afresh (or removes an old one when it has
/// no `cloudInit` any more). Only called while no QEMU of the VM runs.
async fn prepare_seed(
    cfg: &crate::config::EngineConfig,
    vm: &VirtualMachine,
) -> Result<Option<super::seed::SeedFiles>, VmError> {
    let path = cfg.cloud_init_seed_path(&vm.metadata.name);
    let files = super::seed::SeedFiles::for_vm(vm);
    let job = files.clone();
    let at = path.clone();
    tokio::task::spawn_blocking(move || match &job {
        Some(files) => super::seed::write_seed(&at, files),
        None => super::seed::remove_seed(&at),
    })
    .await
    .map_err(VmError::SeedWriter)?
    .map_err(|source| VmError::Seed { path, source })?;
    Ok(files)
}

async fn stop(
    ctx: &Arc<Context>,
    vm: &VirtualMachine,
    record: &RuntimeRecord,
    reason: StopReason,
) -> Result<(), ReconcileError> {
    let name = vm.metadata.name.as_str();
    let why = match reason {
        StopReason::Deleting => "the VirtualMachine is being deleted",
        StopReason::NotWanted => "the run policy or a stop request says stopped",
        StopReason::SpecChanged => "its spec changed and needs a restart",
        StopReason::RestartRequested => "a restart was requested",
    };
    ctx.set_vm_status(name, |s| s.phase = VmPhase::Stopping);
    ctx.event(
        Kind::VirtualMachine,
        name,
        EventType::Normal,
        "Stopping",
        &format!("stopping: {why}"),
    );
    let live = ctx.ensure_live(record).await;
    live.stopping.store(true, Ordering::SeqCst);
    let grace = Duration::from_secs(u64::from(vm.spec.stop_timeout_seconds));

    // Graceful: the guest agent when it answers, else (or as well, when it
    // refuses) the ACPI power button, again and again until QEMU exits or
    // the grace period is over (vm/graceful.rs says why and when).
    let asked = ask_to_power_off(&live, grace).await;
    if asked.exited {
        return Ok(());
    }

    // Forced: ask QEMU to quit, then kill it. The guest did not shut down:
    // for it this is pulling the plug, so it is counted and told.
    ctx.metrics.forced_stop(name);
    let mut message = format!(
        "the guest did not power off within {}s ({}",
        grace.as_secs(),
        asked.plan.summary()
    );
    if let Some(refusal) = &asked.last_agent_error {
        message.push_str(&format!("; last agent error: {refusal}"));
    }
    message.push_str("); stopping QEMU");
    ctx.event(
        Kind::VirtualMachine,
        name,
        EventType::Warning,
        "ForcedStop",
        &message,
    );
    if let Some(qmp) = &live.qmp {
        let _ = qmp.execute("quit", None, Duration::from_secs(2)).await;
    }
    if tokio::time::timeout(FORCED_STOP_WAIT, process::wait_for_exit(&record.process))
        .await
        .is_ok()
    {
        return Ok(());
    }
    let _ = process::signal(&record.process, process::Signal::Kill);
    if tokio::time::timeout(FORCED_STOP_WAIT, process::wait_for_exit(&record.process))
        .await
        .is_err()
    {
        return Err(ReconcileError::Failed(format!(
            "QEMU pid {} survived SIGKILL",
            record.process.pid
        )));
    }
    Ok(())
}

/// How long a stop waits for the agent channel (an exec poll or a file
/// chunk holds it for one call).
const AGENT_LOCK_WAIT: Duration = Duration::from_secs(2);
/// One `guest-shutdown`: the resync, then the wait for a refusal (qemu-ga
/// answers only when its shutdown command failed).
const AGENT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);
const POWER_BUTTON_TIMEOUT: Duration = Duration::from_secs(3);

/// How asking the guest to power off went.
struct Asked {
    /// QEMU exited within the grace period.
    exited: bool,
    plan: super::graceful::Plan,
    /// The agent's last refusal or failure, for the forced stop's event.
    last_agent_error: Option<String>,
}

/// Carries out the graceful part of a stop (`graceful::Plan`): sends what
/// the plan says, waits for QEMU's exit in between.
async fn ask_to_power_off(live: &super::live::LiveVm, grace: Duration) -> Asked {
    use super::graceful::{Answer, Next, Plan, Request};
    let vm = live.record.vm.as_str();
    let process = &live.record.process;
    let started = tokio::time::Instant::now();
    let mut plan = Plan::new(grace);
    let mut last_agent_error = None;
    loop {
        let connected = live.agent_connected.load(Ordering::SeqCst);
        match plan.next(started.elapsed(), connected) {
            Next::Force => {
                return Asked {
                    exited: !process::is_alive(process),
                    plan,
                    last_agent_error,
                };
            }
            Next::WaitUntil(until) => {
                let wait = until.saturating_sub(started.elapsed());
                if tokio::time::timeout(wait, process::wait_for_exit(process))
                    .await
                    .is_ok()
                {
                    tracing::info!(vm, asked = %plan.summary(), took = ?started.elapsed(), "stop: the guest powered off");
                    return Asked {
                        exited: true,
                        plan,
                        last_agent_error,
                    };
                }
            }
            Next::Send(Request::Agent) => {
                let (answer, error) = ask_agent_to_power_off(live).await;
                match &error {
                    Some(e) => {
                        tracing::info!(vm, ?answer, error = %e, "stop: asked the guest agent to power off")
                    }
                    None => tracing::info!(vm, ?answer, "stop: asked the guest agent to power off"),
                }
                if error.is_some() {
                    last_agent_error = error;
                }
                plan.record(started.elapsed(), Request::Agent, answer);
            }
            Next::Send(Request::PowerButton) => {
                let answer = match &live.qmp {
                    Some(qmp) => match qmp
                        .execute("system_powerdown", None, POWER_BUTTON_TIMEOUT)
                        .await
                    {
                        Ok(_) => Answer::Pressed,
                        Err(e) => {
                            tracing::warn!(vm, error = %e, "stop: system_powerdown failed");
                            Answer::NotPressed
                        }
                    },
                    None => Answer::NotPressed,
                };
                tracing::info!(vm, ?answer, "stop: pressed the power button");
                plan.record(started.elapsed(), Request::PowerButton, answer);
            }
        }
    }
}

/// One `guest-shutdown` through the VM's shared agent channel: the answer,
/// and what went wrong when it was not accepted.
async fn ask_agent_to_power_off(
    live: &super::live::LiveVm,
) -> (super::graceful::Answer, Option<String>) {
    use super::graceful::Answer;
    let Ok(mut guard) = tokio::time::timeout(AGENT_LOCK_WAIT, live.agent.lock()).await else {
        return (
            Answer::NoAnswer,
            Some("the agent channel stayed busy".into()),
        );
    };
    let Some(agent) = guard.as_mut() else {
        return (Answer::NoAnswer, Some("the agent is reconnecting".into()));
    };
    match agent.shutdown("powerdown", AGENT_SHUTDOWN_TIMEOUT).await {
        Ok(()) => (Answer::Accepted, None),
        // qemu-ga's shutdown command failed in the guest.
        Err(e) if !e.is_transport() => (Answer::Refused, Some(e.to_string())),
        Err(e) => (Answer::NoAnswer, Some(e.to_string())),
    }
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
        if let Ok(Some(a)) = crate::snapshot::overlays::ahead_of_disk(&ctx.store, disk)
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
        let tail = last_lines(&ctx.config.vm_state_dir(name).join("qemu.log"), 5);
        Some(if tail.is_empty() {
            "QEMU exited unexpectedly".to_string()
        } else {
            format!("QEMU exited unexpectedly: {tail}")
        })
    } else {
        None
    };
    ctx.set_vm_status(name, |s| {
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
    });
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
    ctx.event(Kind::VirtualMachine, name, kind, reason, &message);
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
    let text = std::fs::read(path).unwrap_or_default();
    let start = text.len().saturating_sub(4096);
    let text = String::from_utf8_lossy(&text[start..]);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_qemu::handover::QemuUser;

    #[test]
    fn a_denied_open_at_start_up_names_the_qemu_user() {
        let user = QemuUser {
            name: "hearth-qemu".into(),
            uid: 995,
            gid: 995,
            kvm_gid: None,
        };
        let denied = process::LaunchError::Exited {
            status: "exit status: 1".into(),
            stderr_tail: "qemu: could not open kernel file '/root/vmlinuz': Permission denied"
                .into(),
        };
        let hint = permission_hint(&denied, Some(&user));
        assert!(hint.contains("\"hearth-qemu\""), "{hint}");
        assert!(hint.contains("kernel, initrd and OVMF code"), "{hint}");
        assert_eq!(permission_hint(&denied, None), "", "QEMU as root");
        let other = process::LaunchError::Exited {
            status: "exit status: 1".into(),
            stderr_tail: "qemu: could not open kernel file '/x': No such file or directory".into(),
        };
        assert_eq!(permission_hint(&other, Some(&user)), "");
    }
}
