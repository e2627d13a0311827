//! Starting a VM's QEMU: the files it reads (firmware variables, the
//! cloud-init seed), its disks' recorded chains, its interfaces fixed under
//! the address lock, a launch marker recorded before the spawn and replaced
//! by the runtime record once QEMU runs.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use hearth_api::{EventType, Kind, VirtualDiskStatus, VirtualMachine, VmPhase, remove_condition};
use hearth_qemu::ProcessIdentity;
use hearth_qemu::cmdline::{DiskAttachment, LaunchSpec, disk_serial};
use hearth_qemu::process;

use super::VmError;
use super::boot::{kernel_boot, stage_boot_files};
use super::chain::ChainError;
use super::fingerprint;
use crate::context::{Context, ReconcileError};
use crate::runtime::{LaunchMarker, RuntimeRecord};

const LAUNCH_READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Starts the VM's QEMU and says how that went in its status and events.
pub(super) async fn launch(
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
    // Without a kernel the firmware boots from the disks, in their order
    // (validation made sure there is at least one).
    let (kernel, from_image) = kernel_boot(ctx, vm)?;
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
    // A kernel image's modules into the root disk it lacks them in: a new
    // head over the settled one, recorded before the chain is read below.
    super::modules::ensure(ctx, vm).await?;
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
            source: Box::new(source),
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
    // QEMU's user may not pass through the state directory (0700), nor
    // `run/vms/` (0700): a kernel from the image store is given to it from
    // `run/boot/` (0711, in the 0711 run directory).
    let kernel = match kernel {
        Some(k) if from_image => Some(stage_boot_files(&cfg.boot_files_dir(), name, k)?),
        k => k,
    };
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
    keep_previous_console(cfg, name);
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
    let qemu_log = cfg.qemu_log(name);
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
                    source: Box::new(source.into()),
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

/// Moves the console log of the VM's last start aside
/// (`serial.previous.log`), so the new QEMU's truncating open does not lose
/// what a crashed guest printed last. Only called while no QEMU of the VM
/// runs. An empty log (a launch that failed before the guest printed
/// anything) is not moved: the start before it stays the previous one. A
/// rename, so a crash leaves either file whole; a failure costs only the
/// old console, and is logged. The moved log is held to the bound too: one
/// that grew while hearthd was down was never trimmed.
fn keep_previous_console(cfg: &crate::config::EngineConfig, name: &str) {
    let log = cfg.serial_log(name);
    match std::fs::metadata(&log) {
        Ok(m) if m.len() > 0 => {}
        _ => return,
    }
    let previous = cfg.serial_log_previous(name);
    if let Err(e) = std::fs::rename(&log, &previous) {
        tracing::warn!(vm = name, log = %log.display(), error = %e,
            "cannot keep the previous start's console; the new start overwrites it");
        return;
    }
    if cfg.console_log_max_bytes > 0
        && let Err(e) = super::console::trim(&previous, cfg.console_log_max_bytes, None)
    {
        tracing::warn!(vm = name, log = %previous.display(), error = %e, "cannot trim a console log");
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

    #[test]
    fn a_launch_keeps_the_last_console_that_holds_anything() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = crate::context::Context::for_test(dir.path());
        let cfg = &ctx.config;
        let (log, previous) = (cfg.serial_log("v"), cfg.serial_log_previous("v"));
        // No log yet: nothing to keep.
        keep_previous_console(cfg, "v");
        assert!(!previous.exists());
        std::fs::create_dir_all(log.parent().unwrap()).unwrap();
        std::fs::write(&log, "first start\n").unwrap();
        keep_previous_console(cfg, "v");
        assert!(!log.exists());
        assert_eq!(std::fs::read_to_string(&previous).unwrap(), "first start\n");
        // A launch that failed before the guest printed: its empty log does
        // not push out the start before it.
        std::fs::write(&log, "").unwrap();
        keep_previous_console(cfg, "v");
        assert_eq!(std::fs::read_to_string(&previous).unwrap(), "first start\n");
        std::fs::write(&log, "third start\n").unwrap();
        keep_previous_console(cfg, "v");
        assert_eq!(std::fs::read_to_string(&previous).unwrap(), "third start\n");
        // A log that grew past the bound while nothing trimmed it (hearthd
        // down): kept, within the bound, its end as written.
        let text = "a line of a guest that would not stop\n".repeat(1 << 18);
        std::fs::write(&log, &text).unwrap();
        keep_previous_console(cfg, "v");
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&previous).unwrap();
        assert_eq!(m.len(), text.len() as u64);
        assert!(
            m.blocks() * 512 <= cfg.console_log_max_bytes,
            "{}",
            m.blocks() * 512
        );
        let kept = std::fs::read(&previous).unwrap();
        assert!(kept.ends_with(&text.as_bytes()[text.len() - 4096..]));
    }
}
