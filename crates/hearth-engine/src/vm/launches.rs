//! Launch markers: a QEMU launch is recorded before the spawn and the marker
//! is replaced by the runtime record in one transaction once QEMU runs. A
//! marker left over means a daemon died in between; settling it finds that
//! QEMU from the process table and adopts it (or stops it), so no second
//! QEMU is ever started for the VM.

use std::sync::Arc;
use std::time::Duration;

use hearth_api::{EventType, Kind};
use hearth_qemu::ProcessIdentity;
use hearth_qemu::process;
use hearth_qemu::qmp::QmpClient;

use super::VmError;
use crate::context::Context;
use crate::runtime::{LaunchMarker, RuntimeRecord};

/// How long an orphaned QEMU may take to finish starting before it is stopped
/// instead of adopted (the same bound a launch has).
pub const ADOPT_READY_TIMEOUT: Duration = Duration::from_secs(20);
const READY_POLL: Duration = Duration::from_millis(50);
const QUIT_WAIT: Duration = Duration::from_secs(5);
const KILL_WAIT: Duration = Duration::from_secs(5);

/// Test-only fault injection, compiled in but inert unless the daemon runs
/// with `HEARTH_TEST_CRASH_AFTER_SPAWN=1`: then it aborts right after QEMU is
/// spawned and before the launch is recorded, the window launch markers exist
/// for. The end-to-end test `crash_launch` uses it.
pub fn crash_after_spawn_hook(id: &ProcessIdentity) {
    if std::env::var_os("HEARTH_TEST_CRASH_AFTER_SPAWN").is_some_and(|v| v == "1") {
        eprintln!(
            "HEARTH_TEST_CRASH_AFTER_SPAWN: aborting after spawning QEMU pid {}",
            id.pid
        );
        std::process::abort();
    }
}

/// Settles every leftover launch (at start-up, before any reconcile runs).
/// Returns the records of the QEMUs it adopted.
pub async fn settle_all(ctx: &Arc<Context>) -> Vec<RuntimeRecord> {
    let markers = match ctx.store.launches(None) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read launch markers");
            return Vec::new();
        }
    };
    let mut adopted = Vec::new();
    for marker in markers {
        match settle(ctx, &marker).await {
            Ok(Some(record)) => adopted.push(record),
            Ok(None) => {}
            Err(e) => tracing::warn!(vm = marker.vm, launch = marker.id, error = %e,
                "cannot settle a launch a crash left behind; it is retried before the VM starts"),
        }
    }
    adopted
}

/// Settles the leftover launches of one VM; called before launching it.
/// `Some` when a QEMU was adopted (then it must not be launched again).
/// An error leaves the marker, and so blocks the launch.
pub async fn settle_vm(ctx: &Arc<Context>, vm: &str) -> Result<Option<RuntimeRecord>, VmError> {
    let mut adopted = None;
    for marker in ctx.store.launches(Some(vm))? {
        if let Some(record) = settle(ctx, &marker).await? {
            adopted = Some(record);
        }
    }
    Ok(adopted)
}

/// The QEMU a marker's launch started, if it still runs.
pub fn find(marker: &LaunchMarker) -> Option<ProcessIdentity> {
    if !marker.boot_id.is_empty() && process::boot_id().as_deref() != Some(marker.boot_id.as_str())
    {
        return None;
    }
    process::find_launched(&marker.pidfile, marker.not_before_ticks)
}

/// One leftover launch: no process → drop the marker; a process that
/// finishes starting while no other is recorded for its (existing) VM →
/// adopt it; anything else → stop it, then drop the marker.
async fn settle(
    ctx: &Arc<Context>,
    marker: &LaunchMarker,
) -> Result<Option<RuntimeRecord>, VmError> {
    let Some(id) = find(marker) else {
        ctx.store.drop_launch(marker.id)?;
        tracing::info!(
            vm = marker.vm,
            launch = marker.id,
            "a launch left behind has no QEMU running"
        );
        return Ok(None);
    };
    let vm = marker.vm.as_str();
    let recorded = ctx.store.runtime(vm)?;
    let exists = ctx.store.get(Kind::VirtualMachine, vm)?.is_some();
    if recorded.is_none() && exists && ready(&marker.record.qmp_socket, &id).await {
        let record = RuntimeRecord {
            process: id.clone(),
            started_at: marker.created_at,
            ..marker.record.clone()
        };
        ctx.store.record_launch(marker.id, &record)?;
        super::mark_running(ctx, &record, |_| {});
        ctx.event(
            Kind::VirtualMachine,
            vm,
            EventType::Normal,
            "Adopted",
            &format!(
                "hearthd died while starting QEMU; adopted the QEMU that launch started (pid {})",
                id.pid
            ),
        );
        return Ok(Some(record));
    }
    let why = if !exists {
        "its VirtualMachine is gone"
    } else if recorded.is_some() {
        "another QEMU is recorded for the VM"
    } else {
        "it did not finish starting"
    };
    stop(&marker.record.qmp_socket, &id).await?;
    ctx.store.drop_launch(marker.id)?;
    if exists {
        ctx.event(
            Kind::VirtualMachine,
            vm,
            EventType::Warning,
            "StoppedOrphan",
            &format!(
                "hearthd died while starting QEMU; stopped the QEMU that launch started (pid {}): {why}",
                id.pid
            ),
        );
    }
    Ok(None)
}

/// Whether the process answers a full QMP handshake (its main loop runs, so
/// start-up succeeded) before it exits or the bound passes.
async fn ready(qmp_socket: &std::path::Path, id: &ProcessIdentity) -> bool {
    let deadline = tokio::time::Instant::now() + ADOPT_READY_TIMEOUT;
    while process::is_alive(id) && tokio::time::Instant::now() < deadline {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if QmpClient::connect(qmp_socket, left.min(Duration::from_secs(2)))
            .await
            .is_ok()
        {
            // A QEMU can answer and die right away (its guest ended); the
            // reconcile that follows sees that like any other exit.
            return process::is_alive(id);
        }
        tokio::time::sleep(READY_POLL).await;
    }
    false
}

/// QMP `quit`, then SIGKILL; Ok once the process is gone.
pub async fn stop(qmp_socket: &std::path::Path, id: &ProcessIdentity) -> Result<(), VmError> {
    if let Ok((qmp, _events)) = QmpClient::connect(qmp_socket, Duration::from_secs(2)).await {
        let _ = qmp.execute("quit", None, Duration::from_secs(2)).await;
        if tokio::time::timeout(QUIT_WAIT, process::wait_for_exit(id))
            .await
            .is_ok()
        {
            return Ok(());
        }
    }
    let _ = process::signal(id, process::Signal::Kill);
    tokio::time::timeout(KILL_WAIT, process::wait_for_exit(id))
        .await
        .map_err(|_| VmError::SurvivedKill { pid: id.pid })
}
