//! Stopping a VM's QEMU: the guest asked to power off (agent, power
//! button) for its grace period, then QEMU told to quit, then killed.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hearth_api::{EventType, Kind, VirtualMachine, VmPhase};
use hearth_qemu::process;

use super::decide::StopReason;
use crate::context::{Context, ReconcileError};
use crate::runtime::RuntimeRecord;

const FORCED_STOP_WAIT: Duration = Duration::from_secs(5);

/// Stops the VM's QEMU for `reason`: gracefully within its stop timeout,
/// then by force.
pub(super) async fn stop(
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
