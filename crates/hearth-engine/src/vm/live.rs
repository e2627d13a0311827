//! Connections to a running VM: QMP and the guest agent, and the tasks that
//! watch them. Held in memory only; a restarted daemon rebuilds them from the
//! runtime record (adoption).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hearth_api::{EventType, Kind, VirtualMachineStatus};
use hearth_qemu::agent::AgentClient;
use hearth_qemu::process;
use hearth_qemu::qmp::QmpClient;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use crate::engine::Engine;
use crate::runtime::RuntimeRecord;

const AGENT_SYNC_TIMEOUT: Duration = Duration::from_secs(2);
const AGENT_PING_INTERVAL: Duration = Duration::from_secs(5);
const QMP_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The live side of one running VM.
pub struct LiveVm {
    pub record: RuntimeRecord,
    pub qmp: Option<QmpClient>,
    /// The one guest-agent connection (the chardev accepts a single client);
    /// everything that talks to the guest takes this lock.
    pub agent: Arc<Mutex<Option<AgentClient>>>,
    pub agent_connected: Arc<AtomicBool>,
    /// QMP `SHUTDOWN` was seen: the guest (or we) asked to power off.
    pub shutdown_seen: Arc<AtomicBool>,
    /// Set while hearthd itself is stopping the VM.
    pub stopping: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for LiveVm {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl LiveVm {
    /// Connects to a VM's QMP socket and starts watching it: QMP events, the
    /// process's exit, and the guest agent.
    pub async fn attach(engine: &Arc<Engine>, record: RuntimeRecord) -> LiveVm {
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
            let engine = Arc::downgrade(engine);
            let id = record.process.clone();
            let vm = vm.clone();
            live.tasks.push(tokio::spawn(async move {
                process::wait_for_exit(&id).await;
                if let Some(engine) = engine.upgrade() {
                    engine.wake(Kind::VirtualMachine, &vm);
                }
            }));
        }

        // QMP events.
        if let Some(qmp) = qmp {
            let mut events = qmp.subscribe();
            let engine = Arc::downgrade(engine);
            let vm = vm.clone();
            let seen = live.shutdown_seen.clone();
            live.tasks.push(tokio::spawn(async move {
                loop {
                    let ev = match events.recv().await {
                        Ok(ev) => ev,
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                        Err(_) => break,
                    };
                    let Some(engine) = engine.upgrade() else {
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
                            engine.event(
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
                    engine.wake(Kind::VirtualMachine, &vm);
                }
            }));
        }

        // Guest agent: connect, resync, then ping to keep `agentConnected` true.
        if let Some(path) = record.agent_socket.clone() {
            let engine = Arc::downgrade(engine);
            let agent = live.agent.clone();
            let connected = live.agent_connected.clone();
            let vm = vm.clone();
            live.tasks.push(tokio::spawn(async move {
                agent_loop(engine, vm, path, agent, connected).await;
            }));
        }
        live
    }
}

async fn agent_loop(
    engine: std::sync::Weak<Engine>,
    vm: String,
    path: std::path::PathBuf,
    agent: Arc<Mutex<Option<AgentClient>>>,
    connected: Arc<AtomicBool>,
) {
    let set_connected = |engine: &Arc<Engine>, up: bool, message: &str| {
        connected.store(up, Ordering::SeqCst);
        let mut was = !up;
        let _ =
            engine
                .store
                .update_status::<VirtualMachineStatus, _>(Kind::VirtualMachine, &vm, |s| {
                    was = s.agent_connected;
                    s.agent_connected = up;
                });
        if was != up {
            engine.event(
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
            let Some(e) = engine.upgrade() else { return };
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
                    let Some(eng) = engine.upgrade() else { return };
                    set_connected(&eng, false, &format!("guest agent stopped answering: {e}"));
                    break;
                }
            }
        }
    }
}
