//! Guest access through the agent: the agent calls the API makes itself
//! (ping, freeze status, a short exec), `hearth exec` sessions and `hearth cp`.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hearth_api::{Kind, Object};
use hearth_qemu::ProcessIdentity;
use hearth_qemu::agent::AgentError;
use hearth_qemu::agent_io::OpenMode;
use tokio::sync::watch;
use tokio::time::Instant;

use super::{Engine, RequestError};
use crate::guest::error::GuestAccessError;
use crate::guest::exec::{
    MAX_INPUT, MAX_RUNNING, MAX_WAIT, RESULT_TTL, call_error, poll_until_exit,
};
use crate::guest::files::{
    HELPER_TIMEOUT, PREPARE, WRITE_CHUNK, bad, helper_failure, is_a_directory, no_such_file, split,
    temporary_name,
};
use crate::guest::sessions::{Session, State};
use crate::guest::{
    CallError, Channel, Download, ExecStarted, ExecStatus, Upload, check_guest_path,
};
use crate::vm::live::LiveVm;

impl Engine {
    // ------------------------------------------------------------ guest agent

    /// The live handle of a running VM whose spec has a guest agent.
    fn agent_live(&self, name: &str) -> Result<Arc<LiveVm>, RequestError> {
        let stored = self.get(Kind::VirtualMachine, name)?;
        if let Object::VirtualMachine(vm) = &stored.object
            && !vm.spec.guest_agent
        {
            return Err(GuestAccessError::AgentOff {
                vm: name.to_string(),
            }
            .into());
        }
        self.ctx
            .live_get(name)
            .ok_or_else(|| RequestError::NotRunning {
                vm: name.to_string(),
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
        let client = guard
            .as_mut()
            .ok_or_else(|| GuestAccessError::NotConnectedYet {
                vm: name.to_string(),
            })?;
        f(client).await.map_err(|reason| {
            GuestAccessError::Agent {
                vm: name.to_string(),
                reason,
            }
            .into()
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
            let vm = name.to_string();
            match e {
                ExecError::NotConnected => GuestAccessError::NotConnectedYet { vm },
                ExecError::Stopped => GuestAccessError::StoppedWhileRunning { vm },
                ExecError::Agent(reason) => GuestAccessError::Agent { vm, reason },
            }
            .into()
        })
    }
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
        let bad = |message: String| RequestError::Guest {
            vm: vm.to_string(),
            message,
        };
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
        if self.ctx.execs.running_for(vm) >= MAX_RUNNING {
            return Err(GuestAccessError::TooManyPrograms {
                vm: vm.to_string(),
                limit: MAX_RUNNING,
            }
            .into());
        }
        let (channel, process) = self.guest_channel(vm)?;
        let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let pid = channel
            .exec_start(path, &arg_refs, input)
            .await
            .map_err(|e| call_error(vm, &format!("cannot run {path:?} in the guest"), e))?;
        let id = self.ctx.execs.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let (state, _) = watch::channel(State::Running);
        let session = Arc::new(Session {
            vm: vm.to_string(),
            pid,
            process,
            state,
            asked: Mutex::new(Instant::now()),
        });
        self.ctx.execs.lock().insert(id, session.clone());
        let sessions = self.ctx.execs.sessions.clone();
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
            .ctx.execs
            .lock()
            .get(&id)
            .filter(|s| s.vm == vm)
            .cloned()
            .ok_or_else(|| {
                RequestError::NotInGuest {
                    vm: vm.to_string(),
                    what: format!(
                        "no program with id {id} started through hearthd (a finished program's result is given once and kept for {}s; a restarted hearthd has none)",
                        RESULT_TTL.as_secs()
                    ),
                }
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
                Err(GuestAccessError::ProgramLost {
                    vm: vm.to_string(),
                    id,
                    pid: session.pid,
                    why: message,
                }
                .into())
            }
        }
    }

    fn forget(&self, id: u64, session: &Arc<Session>) {
        let mut map = self.ctx.execs.lock();
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
            return Err(GuestAccessError::NoAgent { vm: vm.to_string() }.into());
        }
        let live = self
            .ctx
            .live_get(vm)
            .ok_or_else(|| RequestError::NotRunning { vm: vm.to_string() })?;
        if live.record.agent_socket.is_none() {
            return Err(GuestAccessError::NoChannel { vm: vm.to_string() }.into());
        }
        // Fail at once rather than after waiting for the agent: a request
        // in progress waits for a reconnect, a new one does not.
        if !live
            .agent_connected
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return Err(GuestAccessError::NotConnected { vm: vm.to_string() }.into());
        }
        let process = live.record.process.clone();
        let channel = Channel::new(
            live.agent.clone(),
            process.clone(),
            self.ctx.ops_lock(&format!("vm/{vm}")),
        );
        Ok((channel, process))
    }
    /// Starts writing `path` in `vm`'s guest: checks the target, creates the
    /// temporary file and opens it. `mode` (permission bits) is set when the
    /// copy is committed.
    pub async fn upload_begin(
        &self,
        vm: &str,
        path: &str,
        mode: Option<u32>,
    ) -> Result<Upload, RequestError> {
        check_guest_path(path).map_err(|m| bad(vm, m.to_string()))?;
        if let Some(m) = mode
            && m > 0o777
        {
            return Err(bad(
                vm,
                format!("mode {m:o} is not a permission mode (0 to 777 octal)"),
            ));
        }
        let (parent, name) = split(path);
        let tmp = temporary_name(parent, name);
        let (channel, _) = self.guest_channel(vm)?;
        let parent_arg = if parent.is_empty() { "/" } else { parent };
        let out = channel
            .run(
                "/bin/sh",
                &["-c", PREPARE, "hearth-cp", &tmp, path, parent_arg],
                HELPER_TIMEOUT,
            )
            .await
            .map_err(|e| match e {
                CallError::Agent(AgentError::Command { .. }) => GuestAccessError::NoShell {
                    vm: vm.to_string(),
                    reason: e,
                }
                .into(),
                e => call_error(vm, &format!("cannot prepare {path} in the guest"), e),
            })?;
        match out.exit_code {
            Some(0) => {}
            Some(11) => {
                return Err(bad(
                    vm,
                    format!(
                        "{path} is a directory in the guest; name the file to write (e.g. {path}/NAME)"
                    ),
                ));
            }
            Some(12) => {
                return Err(bad(
                    vm,
                    format!("{path} exists in the guest and is not a regular file"),
                ));
            }
            Some(13) => {
                return Err(RequestError::NotInGuest {
                    vm: vm.to_string(),
                    what: format!(
                        "cannot write {path}: directory {parent_arg} does not exist in the guest"
                    ),
                });
            }
            _ => {
                return Err(bad(
                    vm,
                    format!(
                        "cannot create a file in {parent_arg} in the guest: {}",
                        helper_failure(&out)
                    ),
                ));
            }
        }
        let mut upload = Upload {
            vm: vm.to_string(),
            path: path.to_string(),
            tmp: tmp.clone(),
            mode,
            channel,
            handle: None,
            buf: Vec::with_capacity(WRITE_CHUNK),
            written: 0,
            settled: false,
        };
        match upload.channel.file_open(&tmp, OpenMode::Write).await {
            Ok(h) => upload.handle = Some(h),
            Err(e) => {
                let err = call_error(vm, &format!("cannot open {tmp} in the guest"), e);
                upload.abort().await;
                return Err(err);
            }
        }
        Ok(upload)
    }

    /// Opens `path` in `vm`'s guest for reading. Refuses a directory or a
    /// special file; a missing path is `NotFound` naming it.
    pub async fn download_begin(&self, vm: &str, path: &str) -> Result<Download, RequestError> {
        check_guest_path(path).map_err(|m| bad(vm, m.to_string()))?;
        let (channel, _) = self.guest_channel(vm)?;
        let mut size = None;
        let mut mode = None;
        // `stat` is not the agent's: a guest without it is copied from
        // without knowing the size or mode (and a directory is found by the
        // first read).
        match channel
            .run("stat", &["-L", "-c", "%F|%a|%s", path], HELPER_TIMEOUT)
            .await
        {
            Ok(out) if out.exit_code == Some(0) => {
                let text = String::from_utf8_lossy(&out.stdout);
                let mut fields = text.trim().split('|');
                let kind = fields.next().unwrap_or_default().to_string();
                mode = fields
                    .next()
                    .and_then(|m| u32::from_str_radix(m, 8).ok())
                    .map(|m| m & 0o777);
                size = fields.next().and_then(|s| s.parse::<u64>().ok());
                if kind == "directory" {
                    return Err(is_a_directory(vm, path));
                }
                if !kind.starts_with("regular") {
                    return Err(bad(
                        vm,
                        format!("{path} is not a regular file in the guest (it is a {kind})"),
                    ));
                }
            }
            Ok(out) if String::from_utf8_lossy(&out.stderr).contains("No such file") => {
                return Err(no_such_file(vm, path));
            }
            Ok(out) => {
                tracing::debug!(vm, path, stderr = %String::from_utf8_lossy(&out.stderr), "stat failed in the guest");
            }
            Err(CallError::Agent(AgentError::Command { .. })) => {}
            Err(e) => return Err(call_error(vm, &format!("cannot stat {path}"), e)),
        }
        let handle = channel
            .file_open(path, OpenMode::Read)
            .await
            .map_err(|e| match &e {
                CallError::Agent(AgentError::Command { desc, .. })
                    if desc.contains("No such file") =>
                {
                    no_such_file(vm, path)
                }
                _ => call_error(vm, &format!("cannot open {path} in the guest"), e),
            })?;
        Ok(Download {
            vm: vm.to_string(),
            path: path.to_string(),
            channel,
            handle: Some(handle),
            size,
            mode,
            read: 0,
        })
    }
}
