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

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hearth_api::{Kind, Object};
use hearth_qemu::ProcessIdentity;
use hearth_qemu::agent::{AgentError, EXEC_POLL_FIRST, ExecOutput, next_exec_poll};
use tokio::sync::watch;
use tokio::time::Instant;

use super::sessions::{Session, State};
use super::{CallError, Channel};
use crate::engine::{Engine, RequestError};

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

impl Engine {
    /// Starts `path args...` in the guest of `vm` with its output captured
    /// and `input` (at most [`MAX_INPUT`] bytes) as its stdin, and leaves a
    /// poller to collect its exit. Returns as soon as qemu-ga started it.
    pub async fn exec_start(
        &self,
        vm: &str,
        path: &str,
        args: &[String],
        input: Option<&[u8]>,
    ) -> Result<ExecStarted, RequestError> {
        let bad = |m: String| RequestError::BadRequest(format!("VirtualMachine {vm:?}: {m}"));
        if path.is_empty() {
            return Err(bad("no program to run (path is empty)".into()));
        }
        if path.contains('\0') || args.iter().any(|a| a.contains('\0')) {
            return Err(bad(
                "the program and its arguments may not contain NUL bytes".into(),
            ));
        }
        if let Some(input) = input
            && input.len() > MAX_INPUT
        {
            return Err(bad(format!(
                "stdin is {} bytes, more than the {} MiB a program can be given through the guest agent; copy it with `hearth cp` and redirect it in the guest",
                input.len(),
                MAX_INPUT >> 20
            )));
        }
        if self.execs.running_for(vm) >= MAX_RUNNING {
            return Err(RequestError::Conflict(format!(
                "VirtualMachine {vm:?}: {MAX_RUNNING} programs started through hearthd are still running; wait for some to end"
            )));
        }
        let (channel, process) = self.guest_channel(vm)?;
        let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let pid = channel
            .exec_start(path, &arg_refs, input)
            .await
            .map_err(|e| call_error(vm, &format!("cannot run {path:?} in the guest"), e))?;
        let id = self.execs.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let (state, _) = watch::channel(State::Running);
        let session = Arc::new(Session {
            vm: vm.to_string(),
            pid,
            process,
            state,
            asked: Mutex::new(Instant::now()),
        });
        self.execs.lock().insert(id, session.clone());
        let sessions = self.execs.sessions.clone();
        tokio::spawn(async move {
            let end = poll_until_exit(&channel, &session).await;
            let _ = session.state.send_replace(end);
            tokio::time::sleep(RESULT_TTL).await;
            let mut map = sessions.lock().unwrap_or_else(|p| p.into_inner());
            if map.get(&id).is_some_and(|s| Arc::ptr_eq(s, &session)) {
                map.remove(&id);
            }
        });
        tracing::debug!(vm, path, id, pid, "program started in the guest");
        Ok(ExecStarted { id, pid })
    }

    /// The state of a program [`exec_start`](Self::exec_start) started,
    /// waiting up to `wait` (at most [`MAX_WAIT`]) for it to end. A finished
    /// program's output is returned once; the session is gone after that.
    pub async fn exec_status(
        &self,
        vm: &str,
        id: u64,
        wait: Duration,
    ) -> Result<ExecStatus, RequestError> {
        let session = self
            .execs
            .lock()
            .get(&id)
            .filter(|s| s.vm == vm)
            .cloned()
            .ok_or_else(|| {
                RequestError::NotFound(format!(
                    "VirtualMachine {vm:?}: no program with id {id} started through hearthd (a finished program's result is given once and kept for {}s; a restarted hearthd has none)",
                    RESULT_TTL.as_secs()
                ))
            })?;
        *session.asked.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        let mut rx = session.state.subscribe();
        let _ = tokio::time::timeout(
            wait.min(MAX_WAIT),
            rx.wait_for(|s| !matches!(s, State::Running)),
        )
        .await;
        let state = rx.borrow().clone();
        match state {
            State::Running => Ok(ExecStatus::Running { pid: session.pid }),
            State::Exited(output) => {
                self.forget(id, &session);
                Ok(ExecStatus::Exited {
                    pid: session.pid,
                    output: (*output).clone(),
                })
            }
            State::Failed(message) => {
                self.forget(id, &session);
                Err(RequestError::Conflict(format!(
                    "VirtualMachine {vm:?}: program {id} (pid {} in the guest): {message}",
                    session.pid
                )))
            }
        }
    }

    fn forget(&self, id: u64, session: &Arc<Session>) {
        let mut map = self.execs.lock();
        if map.get(&id).is_some_and(|s| Arc::ptr_eq(s, session)) {
            map.remove(&id);
        }
    }

    /// The channel guest access uses for a running VM with an agent, and
    /// the QEMU process it belongs to. Errors name the VM: not found, no
    /// agent in its spec, not running, agent not connected.
    pub(crate) fn guest_channel(
        &self,
        vm: &str,
    ) -> Result<(Channel, ProcessIdentity), RequestError> {
        let stored = self.get(Kind::VirtualMachine, vm)?;
        if let Object::VirtualMachine(v) = &stored.object
            && !v.spec.guest_agent
        {
            return Err(RequestError::Conflict(format!(
                "VirtualMachine {vm:?} has no guest agent (spec.guestAgent is false)"
            )));
        }
        let live = self.live_get(vm).ok_or_else(|| {
            RequestError::Conflict(format!("VirtualMachine {vm:?} is not running"))
        })?;
        if live.record.agent_socket.is_none() {
            return Err(RequestError::Conflict(format!(
                "VirtualMachine {vm:?} was started without a guest agent channel; restart it to get one"
            )));
        }
        // Fail at once rather than after waiting for the agent: a request
        // in progress waits for a reconnect, a new one does not.
        if !live
            .agent_connected
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return Err(RequestError::Conflict(format!(
                "VirtualMachine {vm:?}: its guest agent is not connected (the guest may still be booting: hearth wait vm {vm} --for agent)"
            )));
        }
        let process = live.record.process.clone();
        let channel = Channel::new(
            live.agent.clone(),
            process.clone(),
            self.ops_lock(&format!("vm/{vm}")),
        );
        Ok((channel, process))
    }
}

/// Polls one program until it ends, the VM stops or qemu-ga forgets it.
async fn poll_until_exit(channel: &Channel, session: &Session) -> State {
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
    let message = format!("VirtualMachine {vm:?}: {doing}: {e}");
    match e {
        // The guest said no (no such program, permission denied, ...).
        CallError::Agent(AgentError::Command { .. }) => RequestError::BadRequest(message),
        _ => RequestError::Conflict(message),
    }
}
