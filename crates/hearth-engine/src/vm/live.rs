//! Connections to a running VM: QMP and the guest agent, and the tasks that
//! watch them. Held in memory only; a restarted daemon rebuilds them from the
//! runtime record (adoption).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hearth_api::{EventType, Kind, VirtualMachineStatus};
use hearth_qemu::agent::{
    AgentClient, AgentError, EXEC_POLL_FIRST, ExecOutput, exec_timeout, next_exec_poll,
};
use hearth_qemu::process;
use hearth_qemu::qmp::QmpClient;
use tokio::sync::Mutex;

use crate::context::Context;
use crate::runtime::RuntimeRecord;
pub use crate::vm::registry::LiveVm;

const AGENT_SYNC_TIMEOUT: Duration = Duration::from_secs(2);
const AGENT_PING_INTERVAL: Duration = Duration::from_secs(5);
const QMP_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound for one `guest-exec` or `guest-exec-status` call (they answer at
/// once; the program's own run time is covered by the caller's timeout).
const EXEC_CALL_TIMEOUT: Duration = Duration::from_secs(5);

impl Context {
    /// The live handle of a recorded running process, attaching if needed.
    pub async fn ensure_live(self: &Arc<Self>, record: &RuntimeRecord) -> Arc<LiveVm> {
        if let Some(l) = self.live_get(&record.vm)
            && l.record.process == record.process
        {
            return l;
        }
        let live = Arc::new(LiveVm::attach(self, record.clone()).await);
        self.live.insert(&record.vm, live.clone());
        // This QEMU's console log and its own stderr log, bounded while it
        // writes: a guest can make either grow (the second through devices
        // that warn on what the guest does), and a crash-looping VM appends
        // to the second at every launch.
        self.consoles.watch(&record.serial_log);
        self.consoles.watch(&self.config.qemu_log(&record.vm));
        live
    }
}

impl LiveVm {
    /// Runs a program in the guest through this VM's shared agent channel,
    /// taking the channel only for each call (see [`exec_polled`]). Fails if
    /// the QEMU process this handle belongs to goes away meanwhile, so a pid
    /// is never polled in a restarted guest.
    pub async fn exec(
        &self,
        path: &str,
        args: &[&str],
        timeout: Duration,
    ) -> Result<ExecOutput, ExecError> {
        let process = self.record.process.clone();
        exec_polled(
            &self.agent,
            || process::is_alive(&process),
            path,
            args,
            timeout,
        )
        .await
    }

    /// Connects to a VM's QMP socket and starts watching it: QMP events, the
    /// process's exit, and the guest agent.
    pub async fn attach(ctx: &Arc<Context>, record: RuntimeRecord) -> LiveVm {
        let vm = record.vm.clone();
        let qmp = match QmpClient::connect(&record.qmp_socket, QMP_CONNECT_TIMEOUT).await {
            Ok((client, _events)) => Some(client),
            Err(e) => {
                tracing::warn!(vm, error = %e, "cannot connect to QMP");
                None
            }
        };
        let mut live = LiveVm {
            record: record.clone(),
            qmp: qmp.clone(),
            agent: Arc::new(Mutex::new(None)),
            agent_connected: Arc::new(AtomicBool::new(false)),
            shutdown_seen: Arc::new(AtomicBool::new(false)),
            stopping: Arc::new(AtomicBool::new(false)),
            tasks: Vec::new(),
        };

        // Process exit: the level-triggered reconcile does the rest.
        {
            let ctx = Arc::downgrade(ctx);
            let id = record.process.clone();
            let vm = vm.clone();
            live.tasks.push(tokio::spawn(async move {
                process::wait_for_exit(&id).await;
                if let Some(ctx) = ctx.upgrade() {
                    ctx.wake(Kind::VirtualMachine, &vm);
                }
            }));
        }

        // QMP events.
        if let Some(qmp) = qmp {
            let mut events = qmp.subscribe();
            let ctx = Arc::downgrade(ctx);
            let vm = vm.clone();
            let seen = live.shutdown_seen.clone();
            live.tasks.push(tokio::spawn(async move {
                loop {
                    let ev = match events.recv().await {
                        Ok(ev) => ev,
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                        Err(_) => break,
                    };
                    let Some(ctx) = ctx.upgrade() else {
                        break;
                    };
                    match ev.event.as_str() {
                        "SHUTDOWN" => {
                            seen.store(true, Ordering::SeqCst);
                            let guest =
                                ev.data.get("guest").and_then(|g| g.as_bool()) == Some(true);
                            let reason = ev
                                .data
                                .get("reason")
                                .and_then(|r| r.as_str())
                                .unwrap_or("unknown");
                            ctx.event(
                                Kind::VirtualMachine,
                                &vm,
                                EventType::Normal,
                                "Shutdown",
                                &format!(
                                    "QEMU reports shutdown (reason {reason}, requested by the {})",
                                    if guest { "guest" } else { "host" }
                                ),
                            );
                        }
                        "STOP" | "RESUME" => {}
                        _ => continue,
                    }
                    ctx.wake(Kind::VirtualMachine, &vm);
                }
            }));
        }

        // Guest agent: connect, resync, then ping to keep `agentConnected` true.
        if let Some(path) = record.agent_socket.clone() {
            let ctx = Arc::downgrade(ctx);
            let agent = live.agent.clone();
            let connected = live.agent_connected.clone();
            let vm = vm.clone();
            live.tasks.push(tokio::spawn(async move {
                agent_loop(ctx, vm, path, agent, connected).await;
            }));
        }
        live
    }
}

async fn agent_loop(
    ctx: std::sync::Weak<Context>,
    vm: String,
    path: std::path::PathBuf,
    agent: Arc<Mutex<Option<AgentClient>>>,
    connected: Arc<AtomicBool>,
) {
    let set_connected = |ctx: &Arc<Context>, up: bool, message: &str| {
        connected.store(up, Ordering::SeqCst);
        let mut was = !up;
        let _ =
            ctx.store
                .update_status::<VirtualMachineStatus, _>(Kind::VirtualMachine, &vm, |s| {
                    was = s.agent_connected;
                    s.agent_connected = up;
                });
        if was != up {
            ctx.event(
                Kind::VirtualMachine,
                &vm,
                if up {
                    EventType::Normal
                } else {
                    EventType::Warning
                },
                if up {
                    "AgentConnected"
                } else {
                    "AgentDisconnected"
                },
                message,
            );
            // What waits on the agent (the interfaces' confirmation) runs
            // in the VM's reconcile: now, not at the next periodic resync.
            ctx.wake(Kind::VirtualMachine, &vm);
        }
    };
    loop {
        // Connect and resync until the guest agent answers.
        {
            let mut guard = agent.lock().await;
            if guard.is_none() {
                match AgentClient::connect(&path).await {
                    Ok(c) => *guard = Some(c),
                    Err(_) => {
                        drop(guard);
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue;
                    }
                }
            }
            let Some(client) = guard.as_mut() else {
                continue;
            };
            let synced = client.sync(AGENT_SYNC_TIMEOUT).await;
            if let Err(e) = synced {
                if e.is_transport() {
                    *guard = None;
                }
                drop(guard);
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            let info = client
                .info(AGENT_SYNC_TIMEOUT)
                .await
                .ok()
                .and_then(|v| {
                    v.get("version")
                        .and_then(|s| s.as_str())
                        .map(str::to_string)
                })
                .unwrap_or_else(|| "unknown".into());
            drop(guard);
            let Some(e) = ctx.upgrade() else { return };
            set_connected(&e, true, &format!("guest agent answered (qemu-ga {info})"));
        }
        // Keep pinging; any failure drops back to resync.
        loop {
            tokio::time::sleep(AGENT_PING_INTERVAL).await;
            let mut guard = agent.lock().await;
            let Some(client) = guard.as_mut() else { break };
            match client.ping(AGENT_SYNC_TIMEOUT).await {
                Ok(()) => {}
                Err(e) => {
                    if e.is_transport() {
                        *guard = None;
                    }
                    drop(guard);
                    let Some(eng) = ctx.upgrade() else { return };
                    set_connected(&eng, false, &format!("guest agent stopped answering: {e}"));
                    break;
                }
            }
        }
    }
}

/// Why a program could not be run through a shared agent channel.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("the guest agent is not connected yet")]
    NotConnected,
    #[error("the VM stopped while the program ran")]
    Stopped,
    #[error(transparent)]
    Agent(#[from] AgentError),
}

/// Runs `path args...` in the guest and waits for it, holding the agent lock
/// only for each call: one `guest-exec`, then `guest-exec-status` polls 50 ms
/// apart, growing to 250 ms, with the lock released while waiting. So a
/// snapshot cut's freeze (or anything else on the channel) waits for one
/// short call, never for the program. `timeout` bounds the whole run; the
/// guest program keeps running after it (qemu-ga cannot kill it).
///
/// A poll refused because the guest is frozen is retried (qemu-ga allows
/// only a few commands while frozen, and a cut thaws soon). The channel may
/// be reconnected between polls; qemu-ga keeps the program's state, so
/// polling simply goes on. `alive` is asked before each poll.
pub async fn exec_polled(
    agent: &Mutex<Option<AgentClient>>,
    alive: impl Fn() -> bool,
    path: &str,
    args: &[&str],
    timeout: Duration,
) -> Result<ExecOutput, ExecError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let left = || deadline.saturating_duration_since(tokio::time::Instant::now());
    let timed_out = || ExecError::Agent(exec_timeout(path, timeout));
    let pid = {
        let mut guard = tokio::time::timeout_at(deadline, agent.lock())
            .await
            .map_err(|_| timed_out())?;
        let client = guard.as_mut().ok_or(ExecError::NotConnected)?;
        client
            .exec_start(path, args, left().min(EXEC_CALL_TIMEOUT))
            .await?
    };
    let mut interval = EXEC_POLL_FIRST;
    let mut connected = true;
    loop {
        tokio::time::sleep(interval.min(left())).await;
        interval = next_exec_poll(interval);
        if left().is_zero() {
            return Err(if connected {
                timed_out()
            } else {
                ExecError::NotConnected
            });
        }
        if !alive() {
            return Err(ExecError::Stopped);
        }
        let Ok(mut guard) = tokio::time::timeout_at(deadline, agent.lock()).await else {
            return Err(timed_out());
        };
        let Some(client) = guard.as_mut() else {
            // Reconnecting; the program's state lives on in qemu-ga.
            connected = false;
            continue;
        };
        connected = true;
        match client.exec_status(pid, left().min(EXEC_CALL_TIMEOUT)).await {
            Ok(Some(out)) => return Ok(out),
            Ok(None) => {}
            Err(e) if e.is_disabled_while_frozen() => {}
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    use tokio::net::UnixListener;
    use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

    /// The guest side of an agent channel: answers syncs, scripted otherwise.
    struct Guest {
        read: BufReader<OwnedReadHalf>,
        write: OwnedWriteHalf,
    }

    impl Guest {
        /// The next command, answering any resync on the way.
        async fn next(&mut self) -> Value {
            loop {
                let mut line = Vec::new();
                let n = self.read.read_until(b'\n', &mut line).await.expect("read");
                assert!(n > 0, "client closed");
                let text = line.strip_prefix(&[0xFF]).unwrap_or(&line);
                let cmd: Value = serde_json::from_slice(text).expect("JSON");
                if cmd["execute"] == "guest-sync-delimited" {
                    let id = cmd["arguments"]["id"].as_u64().expect("id");
                    self.send(&format!("\u{00ff}{{\"return\": {id}}}\n")).await;
                    continue;
                }
                return cmd;
            }
        }
        async fn send(&mut self, text: &str) {
            // The sentinel is the raw byte 0xFF, not its UTF-8 encoding.
            let bytes: Vec<u8> = text
                .chars()
                .map(|c| if c == '\u{00ff}' { 0xFF } else { c as u8 })
                .collect();
            self.write.write_all(&bytes).await.expect("write");
        }
        async fn reply(&mut self, v: Value) {
            self.send(&format!("{}\n", json!({ "return": v }))).await;
        }
    }

    async fn channel() -> (tempfile::TempDir, Arc<Mutex<Option<AgentClient>>>, Guest) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qga.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let client = AgentClient::connect(&path).await.expect("connect");
        let (stream, _) = listener.accept().await.expect("accept");
        let (read, write) = stream.into_split();
        (
            dir,
            Arc::new(Mutex::new(Some(client))),
            Guest {
                read: BufReader::new(read),
                write,
            },
        )
    }

    /// While a long program runs, another agent command gets through: the
    /// guest only lets the program end once it has seen that command, so an
    /// exec that held the channel for the whole run could never finish.
    #[tokio::test]
    async fn the_channel_is_free_between_exec_polls() {
        let (_dir, agent, mut guest) = channel().await;
        let script = tokio::spawn(async move {
            let start = guest.next().await;
            assert_eq!(start["execute"], "guest-exec");
            assert_eq!(start["arguments"]["path"], "/bin/sleep");
            guest.reply(json!({"pid": 42})).await;
            let mut polls_before = 0;
            let mut pinged = false;
            loop {
                let cmd = guest.next().await;
                match cmd["execute"].as_str() {
                    Some("guest-exec-status") => {
                        assert_eq!(cmd["arguments"]["pid"], 42);
                        if pinged {
                            guest
                                .reply(
                                    json!({"exited": true, "exitcode": 0, "out-data": "ZG9uZQo="}),
                                )
                                .await;
                            return polls_before;
                        }
                        polls_before += 1;
                        guest.reply(json!({"exited": false})).await;
                    }
                    Some("guest-ping") => {
                        pinged = true;
                        guest.reply(json!({})).await;
                    }
                    other => panic!("unexpected command {other:?}"),
                }
            }
        });

        let (done_tx, mut done_rx) = tokio::sync::oneshot::channel();
        let exec = {
            let agent = agent.clone();
            tokio::spawn(async move {
                let out = exec_polled(
                    &agent,
                    || true,
                    "/bin/sleep",
                    &["3600"],
                    Duration::from_secs(30),
                )
                .await;
                let _ = done_tx.send(());
                out
            })
        };
        // Wait until the program is known to run (at least one poll said so).
        loop {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let guard = agent.lock().await;
            if guard.as_ref().is_some_and(AgentClient::is_synced) {
                break;
            }
        }
        // Another command, while the exec is in progress.
        {
            let mut guard = tokio::time::timeout(Duration::from_secs(10), agent.lock())
                .await
                .expect("the agent lock is free between polls");
            guard
                .as_mut()
                .expect("client")
                .ping(Duration::from_secs(10))
                .await
                .expect("ping between polls");
        }
        assert!(
            done_rx.try_recv().is_err(),
            "the exec cannot have finished before the ping got through"
        );
        let out = exec.await.expect("task").expect("exec");
        assert_eq!(out.exit_code, Some(0));
        assert_eq!(out.stdout, b"done\n");
        script.await.expect("guest script");
    }

    #[tokio::test]
    async fn a_poll_refused_while_frozen_is_retried_and_a_gone_vm_stops_polling() {
        let (_dir, agent, mut guest) = channel().await;
        let script = tokio::spawn(async move {
            assert_eq!(guest.next().await["execute"], "guest-exec");
            guest.reply(json!({"pid": 5})).await;
            assert_eq!(guest.next().await["execute"], "guest-exec-status");
            guest
                .send(&format!(
                    "{}\n",
                    json!({"error": {"class": "CommandNotFound",
                        "desc": "Command guest-exec-status has been disabled: the command is not allowed"}})
                ))
                .await;
            assert_eq!(guest.next().await["execute"], "guest-exec-status");
            guest.reply(json!({"exited": true, "exitcode": 7})).await;
            guest
        });
        let out = exec_polled(&agent, || true, "/bin/false", &[], Duration::from_secs(30))
            .await
            .expect("the frozen refusal was retried");
        assert_eq!(out.exit_code, Some(7));
        let mut guest = script.await.expect("guest script");

        let script = tokio::spawn(async move {
            assert_eq!(guest.next().await["execute"], "guest-exec");
            guest.reply(json!({"pid": 6})).await;
            guest
        });
        let err = exec_polled(&agent, || false, "/bin/true", &[], Duration::from_secs(30))
            .await
            .expect_err("the VM is gone");
        assert!(matches!(err, ExecError::Stopped), "{err}");
        script.await.expect("guest script");

        *agent.lock().await = None;
        let err = exec_polled(&agent, || true, "/bin/true", &[], Duration::from_secs(30))
            .await
            .expect_err("no client");
        assert!(matches!(err, ExecError::NotConnected), "{err}");
    }
}
