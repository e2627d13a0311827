//! `hearth exec`: a program started in the guest and watched by hearthd.
//!
//! qemu-ga (7.2 in the test guest, and every version to date) returns a
//! program's captured output only once it has exited, and forgets the
//! program once it has said so. So hearthd, not the client, polls it: a start
//! makes one `guest-exec` and leaves a session behind, whose poller asks
//! `guest-exec-status` (one request each, see [`super::Channel::call`]) until
//! the program ends, and keeps the result until a client fetches it. A
//! client that goes away (Ctrl-C) therefore leaves nothing behind in qemu-ga:
//! the poller still collects the exit, and the result is dropped after
//! [`RESULT_TTL`]. Sessions live in memory; a restarted hearthd has none.

use std::sync::Arc;
use std::time::Duration;

use hearth_qemu::agent::{AgentError, EXEC_POLL_FIRST, ExecOutput, next_exec_poll};

use super::error::GuestAccessError;
use super::sessions::{Session, State};
use super::{CallError, Channel};
use crate::error::RequestError;

/// The most stdin a program may be given: it travels inside the one
/// `guest-exec` request (base64), which holds the channel while the guest
/// decodes it (~0.4 s for 1 MiB under TCG). More goes through `hearth cp`.
pub const MAX_INPUT: usize = 1 << 20;
/// Programs of one VM that may run through hearthd at once.
pub const MAX_RUNNING: usize = 64;
/// How long a finished program's result waits for its client.
pub const RESULT_TTL: Duration = Duration::from_secs(60);
/// The longest a status request may wait for the program to end.
pub const MAX_WAIT: Duration = Duration::from_secs(30);
/// While nobody has asked about a program for this long, it is polled only
/// every [`IDLE_POLL`].
const CLIENT_GONE: Duration = Duration::from_secs(10);
const IDLE_POLL: Duration = Duration::from_secs(2);

/// What a start returns: hearthd's id for the session (what the client
/// polls) and the program's pid in the guest (what a person can `kill`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExecStarted {
    pub id: u64,
    pub pid: i64,
}

/// A program's state as a status request sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExecStatus {
    Running { pid: i64 },
    Exited { pid: i64, output: ExecOutput },
}

/// Polls one program until it ends, the VM stops or qemu-ga forgets it.
pub(crate) async fn poll_until_exit(channel: &Channel, session: &Session) -> State {
    let mut interval = EXEC_POLL_FIRST;
    loop {
        let idle = session
            .asked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
            > CLIENT_GONE;
        tokio::time::sleep(if idle { IDLE_POLL } else { interval }).await;
        interval = next_exec_poll(interval);
        let pid = session.pid;
        match channel.exec_status(pid).await {
            Ok(Some(out)) => return State::Exited(Arc::new(out)),
            Ok(None) => {}
            Err(CallError::Stopped) => {
                return State::Failed("the VM stopped while the program ran".into());
            }
            // Still there, just not reachable right now: go on polling; the
            // program's state lives on in qemu-ga.
            Err(CallError::NotConnected | CallError::Frozen | CallError::Busy) => {}
            Err(CallError::Agent(AgentError::ReplyTooLarge { limit })) => {
                return State::Failed(format!(
                    "its output (base64 in one guest-exec-status reply) was larger than the {} MiB hearthd accepts; write it to a file in the guest and copy that with `hearth cp`",
                    limit >> 20
                ));
            }
            Err(CallError::Agent(e)) if e.is_transport() => {
                tracing::debug!(vm = session.vm, pid, error = %e, "exec poll failed; polling on");
            }
            Err(CallError::Agent(e)) => {
                return State::Failed(format!(
                    "the guest agent stopped answering about it ({e}); its result is lost"
                ));
            }
        }
        if !hearth_qemu::process::is_alive(&session.process) {
            return State::Failed("the VM stopped while the program ran".into());
        }
    }
}

/// A failed call as the API shows it: what was being done, for which VM.
pub(crate) fn call_error(vm: &str, doing: &str, e: CallError) -> RequestError {
    match e {
        // The guest said no (no such program, permission denied, ...).
        CallError::Agent(AgentError::Command { .. }) => RequestError::Guest {
            vm: vm.to_string(),
            message: format!("{doing}: {e}"),
        },
        _ => GuestAccessError::Call {
            vm: vm.to_string(),
            doing: doing.to_string(),
            reason: e,
        }
        .into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Refusal;

    /// As `error::tests::pin`: each case against the text of the `format!`
    /// it replaced, and its class (all were conflicts, 409).
    fn pin(cases: Vec<(RequestError, String)>) {
        for (e, old) in cases {
            assert_eq!(e.to_string(), old, "{e:?}");
            assert_eq!(e.refusal(), Refusal::Conflict, "{e:?}");
        }
    }

    fn call() -> CallError {
        CallError::Agent(hearth_qemu::agent::AgentError::Command {
            command: "guest-exec".into(),
            class: "GenericError".into(),
            desc: "No such file".into(),
        })
    }
    #[test]
    fn guest_access_refusals_read_as_before() {
        let (name, vm, id, pid) = ("a", "a", 7u64, 42i64);
        let agent = hearth_qemu::agent::AgentError::Disconnected;
        let e = call();
        let (doing, message) = (
            "cannot open /etc/x in the guest",
            "the VM stopped while the program ran",
        );
        pin(vec![
            (
                GuestAccessError::AgentOff { vm: name.into() }.into(),
                format!("VirtualMachine {name:?} has spec.guestAgent false"),
            ),
            (
                GuestAccessError::NotConnectedYet { vm: name.into() }.into(),
                format!("VirtualMachine {name:?}: the guest agent is not connected yet"),
            ),
            (
                GuestAccessError::Agent {
                    vm: name.into(),
                    reason: hearth_qemu::agent::AgentError::Disconnected,
                }
                .into(),
                format!("VirtualMachine {name:?}: guest agent: {agent}"),
            ),
            (
                GuestAccessError::StoppedWhileRunning { vm: name.into() }.into(),
                format!("VirtualMachine {name:?} stopped while the program ran"),
            ),
            (
                GuestAccessError::NoAgent { vm: vm.into() }.into(),
                format!("VirtualMachine {vm:?} has no guest agent (spec.guestAgent is false)"),
            ),
            (
                GuestAccessError::NoChannel { vm: vm.into() }.into(),
                format!(
                    "VirtualMachine {vm:?} was started without a guest agent channel; restart it to get one"
                ),
            ),
            (
                GuestAccessError::NotConnected { vm: vm.into() }.into(),
                format!(
                    "VirtualMachine {vm:?}: its guest agent is not connected (the guest may still be booting: hearth wait vm {vm} --for agent)"
                ),
            ),
            (
                GuestAccessError::TooManyPrograms {
                    vm: vm.into(),
                    limit: MAX_RUNNING,
                }
                .into(),
                format!(
                    "VirtualMachine {vm:?}: {MAX_RUNNING} programs started through hearthd are still running; wait for some to end"
                ),
            ),
            (
                GuestAccessError::ProgramLost {
                    vm: vm.into(),
                    id,
                    pid,
                    why: message.into(),
                }
                .into(),
                format!(
                    "VirtualMachine {vm:?}: program {id} (pid {} in the guest): {message}",
                    pid
                ),
            ),
            (
                GuestAccessError::NoShell {
                    vm: vm.into(),
                    reason: call(),
                }
                .into(),
                format!(
                    "VirtualMachine {vm:?}: copying into the guest needs guest-exec of /bin/sh (to create the file privately and rename it into place when complete), which the guest agent refused: {e}"
                ),
            ),
            (
                call_error(vm, doing, CallError::Busy),
                format!("VirtualMachine {vm:?}: {doing}: {}", CallError::Busy),
            ),
        ]);
        // What the guest refuses stays a bad request.
        let refused = call_error(vm, doing, call());
        assert_eq!(refused.refusal(), Refusal::BadRequest);
        assert_eq!(
            refused.to_string(),
            format!("VirtualMachine {vm:?}: {doing}: {e}")
        );
    }
}
