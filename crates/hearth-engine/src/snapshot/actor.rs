//! The async shell of the freeze coordinator: one actor task per target (a
//! VM, or a disk no VM uses). It owns all freeze/thaw traffic of its VM and
//! performs the coordinator's commands one at a time, in order, each bounded
//! by the timeout the coordinator gave.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use chrono::Utc;
use hearth_api::{
    EventType, Kind, Object, SnapshotPhase, SnapshotStatus, VirtualDiskSnapshot, VirtualDiskStatus,
};
use hearth_qemu::agent::{AgentClient, AgentError, FreezeStatus};
use rusqlite::params;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::coordinator::{
    Access, AgentFault, Command, Coordinator, CutId, Durable, Input, Millis, Outcome, Request,
};
use super::storage::{self, Layer, NewLayer};
use crate::engine::Engine;
use crate::store::{Store, StoreError};
use crate::vm::live::LiveVm;

/// How long a cut waits for a just-started guest's agent before giving up.
const AGENT_WAIT: Duration = Duration::from_secs(20);
const QMP_TIMEOUT: Duration = Duration::from_secs(5);
/// Quiet time that ends the gathering of requests for a cut...
const GATHER: Duration = Duration::from_millis(50);
/// ...and the longest a request waits for company.
const MAX_GATHER: Duration = Duration::from_millis(300);

enum Msg {
    Requests(Vec<Request>),
}

/// The running actors, by target (`vm/NAME` or `disk/NAME`).
#[derive(Default)]
pub struct Actors {
    map: Mutex<HashMap<String, mpsc::UnboundedSender<Msg>>>,
}

impl Actors {
    /// Hands requests to the target's actor, starting it if needed. Requests
    /// sent together are always served by the same cut.
    pub fn request(&self, engine: &Arc<Engine>, target: &str, requests: Vec<Request>) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = map.get(target)
            && tx.send(Msg::Requests(requests.clone())).is_ok()
        {
            return;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(Msg::Requests(requests));
        map.insert(target.to_string(), tx);
        let weak = Arc::downgrade(engine);
        let target = target.to_string();
        tokio::spawn(async move { run(weak, target, rx).await });
    }

    /// Starts the actor of every target that has unsettled work in the store
    /// (after a daemon restart), so frozen guests are thawed right away.
    pub fn resume_all(&self, engine: &Arc<Engine>) {
        let mut targets: Vec<String> = engine
            .store
            .with_tx(|tx| {
                let mut stmt = tx.prepare("SELECT target FROM freeze_intents")?;
                let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
                Ok(rows.filter_map(Result::ok).collect::<Vec<_>>())
            })
            .unwrap_or_default();
        if let Ok(snaps) = engine.store.list(Kind::VirtualDiskSnapshot) {
            for s in snaps {
                if let Object::VirtualDiskSnapshot(snap) = &s.object {
                    let status: SnapshotStatus =
                        serde_json::from_value(s.status.clone()).unwrap_or_default();
                    if matches!(
                        status.phase,
                        SnapshotPhase::Pending | SnapshotPhase::InProgress
                    ) && let Ok(t) = target_of(engine, &snap.spec.virtual_disk_name)
                    {
                        targets.push(t);
                    }
                }
            }
        }
        targets.sort();
        targets.dedup();
        for t in targets {
            self.request(engine, &t, Vec::new());
        }
    }
}

/// The actor that serves snapshots of `disk`: its VM's, or its own when no
/// VM uses it.
pub fn target_of(engine: &Engine, disk: &str) -> Result<String, StoreError> {
    Ok(match engine.vms_using_disk(disk)?.first() {
        Some(vm) => format!("vm/{vm}"),
        None => format!("disk/{disk}"),
    })
}

/// Everything a cut in progress holds in memory.
#[derive(Default)]
struct CutContext {
    live: Option<Arc<LiveVm>>,
    prepared: Vec<Prepared>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
    freeze_started: Option<chrono::DateTime<Utc>>,
}

struct Prepared {
    disk: String,
    new: NewLayer,
    old_head: Layer,
    /// The node the overlay goes on top of, and the overlay's node (live cuts).
    top_node: Option<String>,
    new_node: Option<String>,
    capacity: u64,
}

async fn run(engine: Weak<Engine>, target: String, mut rx: mpsc::UnboundedReceiver<Msg>) {
    let epoch = Instant::now();
    let now = || epoch.elapsed().as_millis() as Millis;
    let Some(e) = engine.upgrade() else { return };
    let (mut core, first) = match recover(&e, &target) {
        Ok(x) => x,
        Err(err) => {
            tracing::error!(target, error = %err, "cannot load snapshot state");
            return;
        }
    };
    drop(e);
    let mut queue: VecDeque<Command> = first.into();
    let mut ctx = CutContext::default();
    loop {
        while let Some(cmd) = queue.pop_front() {
            let Some(e) = engine.upgrade() else { return };
            let input = execute(&e, &target, &mut ctx, &core, cmd, now).await;
            if let Some(input) = input {
                let committed = matches!(input, Input::Committed { .. });
                queue.extend(core.handle(input));
                if committed && core.is_idle() {
                    ctx = CutContext::default();
                }
            }
        }
        // Take every message already waiting, so simultaneous requests share a cut.
        let mut closed = false;
        loop {
            match rx.try_recv() {
                Ok(Msg::Requests(rs)) => {
                    for r in rs {
                        core.handle(Input::Requested(r));
                    }
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    closed = true;
                    break;
                }
            }
        }
        if core.is_idle() && core.has_pending() && !closed {
            // Requests made together (one apply, a VM snapshot and its
            // siblings, parallel clients) arrive a few ms apart: gather them
            // briefly so they share one cut and one freeze.
            let started = Instant::now();
            while started.elapsed() < MAX_GATHER {
                match tokio::time::timeout(GATHER, rx.recv()).await {
                    Ok(Some(Msg::Requests(rs))) => {
                        for r in rs {
                            core.handle(Input::Requested(r));
                        }
                    }
                    Ok(None) => {
                        closed = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
        }
        if core.is_idle() && (core.has_pending() || core.needs_thaw()) {
            let Some(e) = engine.upgrade() else { return };
            let lock = e.ops_lock(&target);
            let guard = lock.lock_owned().await;
            let (access, live) = access(&e, &target).await;
            core.set_deadline(deadline_of(&e, &target));
            let out = core.handle(Input::Start { access, now: now() });
            if out.is_empty() {
                drop(guard);
            } else {
                ctx = CutContext {
                    live,
                    guard: Some(guard),
                    ..CutContext::default()
                };
                queue.extend(out);
                continue;
            }
        }
        if closed {
            return;
        }
        // Idle: wait for work; retry a pending thaw every second.
        let wait = if core.needs_thaw() {
            Duration::from_secs(1)
        } else {
            Duration::from_secs(3600)
        };
        match tokio::time::timeout(wait, rx.recv()).await {
            Ok(Some(Msg::Requests(rs))) => {
                for r in rs {
                    core.handle(Input::Requested(r));
                }
            }
            Ok(None) => return,
            Err(_) => {}
        }
    }
}

/// Rebuilds the coordinator from the store: unsettled snapshots, and the
/// intent of a cut the previous daemon did not finish.
fn recover(engine: &Arc<Engine>, target: &str) -> Result<(Coordinator, Vec<Command>), StoreError> {
    let deadline_ms = deadline_of(engine, target);
    let mut pending = Vec::new();
    for s in engine.store.list(Kind::VirtualDiskSnapshot)? {
        let Object::VirtualDiskSnapshot(snap) = &s.object else {
            continue;
        };
        let status: SnapshotStatus = serde_json::from_value(s.status.clone()).unwrap_or_default();
        if !matches!(
            status.phase,
            SnapshotPhase::Pending | SnapshotPhase::InProgress
        ) {
            continue;
        }
        if target_of(engine, &snap.spec.virtual_disk_name)? != target {
            continue;
        }
        pending.push(request_of(snap));
    }
    let intent: Option<(CutId, Vec<Request>)> = engine.store.with_tx(|tx| {
        let row: Option<(i64, String)> = rusqlite::OptionalExtension::optional(tx.query_row(
            "SELECT cut, requests FROM freeze_intents WHERE target = ?1",
            params![target],
            |r| Ok((r.get(0)?, r.get(1)?)),
        ))?;
        Ok(row.map(|(cut, reqs)| {
            let names: Vec<String> = serde_json::from_str(&reqs).unwrap_or_default();
            let open: Vec<Request> = pending
                .iter()
                .filter(|r| names.contains(&r.snapshot))
                .cloned()
                .collect();
            (cut as CutId, open)
        }))
    })?;
    if let Some((cut, _)) = &intent
        && let Some(vm) = target.strip_prefix("vm/")
    {
        engine.event(
                Kind::VirtualMachine,
                vm,
                EventType::Warning,
                "RecoveringCut",
                &format!("hearthd restarted during snapshot cut {cut}: thawing the guest and settling its snapshots"),
            );
    }
    let next_cut = engine.store.next_counter(&format!("cut/{target}"))?;
    Ok(Coordinator::recover(
        deadline_ms,
        next_cut,
        Durable { pending, intent },
    ))
}

/// The VM's `spec.freezeDeadlineSeconds`, in ms (10 s when there is no VM).
fn deadline_of(engine: &Engine, target: &str) -> Millis {
    let default = 10_000;
    let Some(vm) = target.strip_prefix("vm/") else {
        return default;
    };
    match engine.store.get(Kind::VirtualMachine, vm) {
        Ok(Some(s)) => match &s.object {
            Object::VirtualMachine(v) => u64::from(v.spec.freeze_deadline_seconds) * 1000,
            _ => default,
        },
        _ => default,
    }
}

pub fn request_of(snap: &VirtualDiskSnapshot) -> Request {
    Request {
        snapshot: snap.metadata.name.clone(),
        disk: snap.spec.virtual_disk_name.clone(),
        required: snap.spec.required_consistency,
    }
}

/// How the target can be reached right now. Called with the target's
/// operations lock held, so the VM cannot start or stop meanwhile.
async fn access(engine: &Arc<Engine>, target: &str) -> (Access, Option<Arc<LiveVm>>) {
    let Some(vm) = target.strip_prefix("vm/") else {
        return (Access::Offline, None);
    };
    let Ok(Some(stored)) = engine.store.get(Kind::VirtualMachine, vm) else {
        return (Access::Offline, None);
    };
    let Object::VirtualMachine(spec) = &stored.object else {
        return (Access::Offline, None);
    };
    let record = match engine.store.runtime(vm) {
        Ok(Some(r)) if hearth_qemu::process::is_alive(&r.process) => r,
        _ => return (Access::Offline, None),
    };
    let live = engine.ensure_live(&record).await;
    if !spec.spec.guest_agent {
        return (
            Access::NoAgent("spec.guestAgent is false".into()),
            Some(live),
        );
    }
    if let Some(qmp) = &live.qmp
        && let Ok(v) = qmp.execute("query-status", None, QMP_TIMEOUT).await
    {
        let status = v.get("status").and_then(Value::as_str).unwrap_or("unknown");
        if status != "running" {
            return (
                Access::NoAgent(format!(
                    "the VM is not running its vCPUs (QEMU status {status})"
                )),
                Some(live),
            );
        }
    }
    let deadline = Instant::now() + AGENT_WAIT;
    while !live
        .agent_connected
        .load(std::sync::atomic::Ordering::SeqCst)
    {
        if Instant::now() >= deadline {
            return (
                Access::NoAgent(format!(
                    "the guest agent does not answer (waited {} s)",
                    AGENT_WAIT.as_secs()
                )),
                Some(live),
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    (Access::Agent, Some(live))
}

fn fault(e: AgentError) -> AgentFault {
    if e.is_disabled_while_frozen() {
        return AgentFault::DisabledWhileFrozen;
    }
    match e {
        AgentError::Timeout { .. } => AgentFault::Timeout,
        AgentError::Disconnected | AgentError::Connect { .. } | AgentError::Io(_) => {
            AgentFault::Disconnected
        }
        other => AgentFault::Error(other.to_string()),
    }
}

/// Runs `f` on the VM's agent connection within `timeout`, waiting for the
/// connection to come up if it is not there yet.
async fn with_agent<T>(
    live: &LiveVm,
    timeout: Duration,
    f: impl AsyncFnOnce(&mut AgentClient, Duration) -> Result<T, AgentError>,
) -> Result<T, AgentFault> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(AgentFault::Timeout);
        }
        let mut guard = match tokio::time::timeout(left, live.agent.lock()).await {
            Ok(g) => g,
            Err(_) => return Err(AgentFault::Timeout),
        };
        if let Some(client) = guard.as_mut() {
            let left = deadline.saturating_duration_since(Instant::now());
            return f(client, left.max(Duration::from_millis(1)))
                .await
                .map_err(fault);
        }
        drop(guard);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The live VM of a target, if its process runs.
async fn live_of(engine: &Arc<Engine>, target: &str) -> Option<Arc<LiveVm>> {
    let vm = target.strip_prefix("vm/")?;
    match engine.store.runtime(vm) {
        Ok(Some(r)) if hearth_qemu::process::is_alive(&r.process) => {
            Some(engine.ensure_live(&r).await)
        }
        _ => None,
    }
}

fn vm_event(engine: &Engine, target: &str, type_: EventType, reason: &str, message: &str) {
    match target.strip_prefix("vm/") {
        Some(vm) => engine.event(Kind::VirtualMachine, vm, type_, reason, message),
        None => {
            let disk = target.trim_start_matches("disk/");
            engine.event(Kind::VirtualDisk, disk, type_, reason, message)
        }
    }
}

async fn execute(
    engine: &Arc<Engine>,
    target: &str,
    ctx: &mut CutContext,
    core: &Coordinator,
    cmd: Command,
    now: impl Fn() -> Millis,
) -> Option<Input> {
    match cmd {
        Command::Prepare { cut, disks } => {
            let result = prepare(engine, target, ctx, cut, &disks).await;
            if result.is_ok() {
                let names: Vec<String> = core
                    .cut_requests()
                    .iter()
                    .map(|r| r.snapshot.clone())
                    .collect();
                for n in &names {
                    engine.set_snapshot_status(Kind::VirtualDiskSnapshot, n, |s| {
                        s.phase = SnapshotPhase::InProgress;
                        s.cut_id = Some(cut);
                    });
                }
            }
            Some(Input::Prepared {
                cut,
                result,
                now: now(),
            })
        }
        Command::RecordIntent { cut, deadline } => {
            let names: Vec<String> = core
                .cut_requests()
                .iter()
                .map(|r| r.snapshot.clone())
                .collect();
            let left = deadline.saturating_sub(now());
            let wall = Utc::now() + chrono::Duration::milliseconds(left as i64);
            let r = engine.store.with_tx(|tx| {
                tx.execute(
                    "INSERT INTO freeze_intents (target, cut, deadline, requests) VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT (target) DO UPDATE SET cut = excluded.cut, deadline = excluded.deadline, requests = excluded.requests",
                    params![target, cut as i64, wall.to_rfc3339(), serde_json::to_string(&names)?],
                )?;
                Ok(())
            });
            if let Err(e) = r {
                // Without a durable intent a crash could leave the guest frozen
                // unnoticed; the freeze that follows still has its deadline.
                tracing::error!(target, error = %e, "cannot record the freeze intent");
            }
            None
        }
        Command::Freeze { cut, timeout } => {
            ctx.freeze_started = Some(Utc::now());
            vm_event(
                engine,
                target,
                EventType::Normal,
                "Freezing",
                &format!(
                    "cut {cut}: freezing the guest's filesystems for {} snapshot(s): {}",
                    core.cut_requests().len(),
                    core.cut_requests()
                        .iter()
                        .map(|r| r.snapshot.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
            let result = match &ctx.live {
                Some(live) => {
                    with_agent(live, Duration::from_millis(timeout), async |c, t| {
                        c.fsfreeze_freeze(t).await
                    })
                    .await
                }
                None => Err(AgentFault::Disconnected),
            };
            Some(Input::FreezeReplied {
                cut,
                result,
                now: now(),
            })
        }
        Command::QueryFreeze { cut, timeout } => {
            let result = match &ctx.live {
                Some(live) => with_agent(live, Duration::from_millis(timeout), async |c, t| {
                    c.fsfreeze_status(t).await
                })
                .await
                .map(|s| s == FreezeStatus::Frozen),
                None => Err(AgentFault::Disconnected),
            };
            Some(Input::StatusReplied {
                cut,
                result,
                now: now(),
            })
        }
        Command::Transact { cut, timeout } => {
            let result = transact(ctx, Duration::from_millis(timeout)).await;
            Some(Input::Transacted {
                cut,
                result,
                now: now(),
            })
        }
        Command::Thaw { cut, timeout } => {
            let live = match &ctx.live {
                Some(l) => Some(l.clone()),
                None => live_of(engine, target).await,
            };
            let result = match live {
                Some(live) => {
                    with_agent(&live, Duration::from_millis(timeout), async |c, t| {
                        c.fsfreeze_thaw(t).await
                    })
                    .await
                }
                // No process, nothing frozen.
                None => Ok(0),
            };
            match &result {
                Ok(n) => vm_event(
                    engine,
                    target,
                    EventType::Normal,
                    "Thawed",
                    &format!("cut {cut}: the guest thawed {n} filesystem(s)"),
                ),
                Err(f) => vm_event(
                    engine,
                    target,
                    EventType::Warning,
                    "ThawFailed",
                    &format!("cut {cut}: thaw failed: {f}; retrying"),
                ),
            }
            Some(Input::ThawReplied {
                cut,
                result,
                now: now(),
            })
        }
        Command::Discard { cut: _ } => {
            discard(ctx).await;
            None
        }
        Command::Commit {
            cut,
            outcomes,
            took_cut,
            freeze_window_ms,
            keep_intent,
            why_not_consistent,
        } => {
            commit(
                engine,
                target,
                ctx,
                core,
                cut,
                &outcomes,
                took_cut,
                freeze_window_ms,
                keep_intent,
                why_not_consistent,
            )
            .await;
            Some(Input::Committed { cut })
        }
    }
}

async fn prepare(
    engine: &Arc<Engine>,
    target: &str,
    ctx: &mut CutContext,
    cut: CutId,
    disks: &[String],
) -> Result<(), String> {
    let state_dir = engine.config.state_dir.clone();
    std::fs::create_dir_all(storage::layers_dir(&state_dir)).map_err(|e| e.to_string())?;
    // The VM's device order decides which QEMU device holds which disk.
    let vm_disks: Vec<String> = match target.strip_prefix("vm/") {
        Some(vm) => match engine
            .store
            .get(Kind::VirtualMachine, vm)
            .map_err(|e| e.to_string())?
        {
            Some(s) => match s.object {
                Object::VirtualMachine(v) => v
                    .spec
                    .disks
                    .into_iter()
                    .map(|d| d.virtual_disk_name)
                    .collect(),
                _ => Vec::new(),
            },
            None => Vec::new(),
        },
        None => Vec::new(),
    };
    let block = match &ctx.live {
        Some(live) => match &live.qmp {
            Some(qmp) => Some(
                qmp.execute("query-block", None, QMP_TIMEOUT)
                    .await
                    .map_err(|e| format!("query-block: {e}"))?,
            ),
            None => return Err("no QMP connection to the VM".into()),
        },
        None => None,
    };
    for disk in disks {
        let mut head = storage::head(&engine.store, disk)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("VirtualDisk {disk:?} has no image yet"))?;
        let new = storage::allocate(&engine.store, &state_dir, disk).map_err(|e| e.to_string())?;
        if let Some(block) = &block {
            let index = vm_disks
                .iter()
                .position(|d| d == disk)
                .ok_or_else(|| format!("VirtualDisk {disk:?} is not attached to the VM"))?;
            let device = hearth_qemu::cmdline::disk_device_id(index);
            let inserted = block
                .as_array()
                .and_then(|a| {
                    a.iter().find(|b| {
                        b.get("qdev").and_then(Value::as_str).is_some_and(|q| {
                            q == device || q.ends_with(&format!("/{device}/virtio-backend"))
                        }) || b.get("device").and_then(Value::as_str) == Some(device.as_str())
                    })
                })
                .and_then(|b| b.get("inserted"))
                .ok_or_else(|| format!("QEMU has no device {device} for VirtualDisk {disk:?}"))?;
            let top_node = inserted
                .get("node-name")
                .and_then(Value::as_str)
                .ok_or("query-block gave no node-name")?
                .to_string();
            let top_file = inserted
                .get("file")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            let capacity = inserted
                .pointer("/image/virtual-size")
                .and_then(Value::as_u64)
                .ok_or("query-block gave no virtual-size")?;
            if !top_file.is_empty() && std::path::Path::new(&top_file) != head.path {
                // QEMU writes to a newer layer than the store knows (a cut
                // finished in QEMU just before a daemon crash): adopt it.
                let adopted = NewLayer {
                    id: format!("{}-adopted", new.id),
                    path: std::path::PathBuf::from(&top_file),
                };
                engine
                    .store
                    .with_tx(|tx| storage::set_head_tx(tx, disk, &adopted, Some(&head.id)))
                    .map_err(|e| e.to_string())?;
                head = storage::head(&engine.store, disk)
                    .map_err(|e| e.to_string())?
                    .ok_or("adopted head vanished")?;
            }
            hearth_qemu::img::create_overlay_unopened(&new.path, &head.path, "qcow2", capacity)
                .await
                .map_err(|e| format!("creating the overlay for {disk:?}: {e}"))?;
            let new_node = format!("c{cut}d{index}");
            let qmp = ctx
                .live
                .as_ref()
                .and_then(|l| l.qmp.clone())
                .ok_or("no QMP connection")?;
            let added = qmp
                .execute(
                    "blockdev-add",
                    Some(json!({
                        "driver": "qcow2",
                        "node-name": new_node,
                        "file": {"driver": "file", "filename": new.path.to_string_lossy()},
                        "backing": null,
                    })),
                    QMP_TIMEOUT,
                )
                .await;
            if let Err(e) = added {
                let _ = std::fs::remove_file(&new.path);
                return Err(format!("blockdev-add for {disk:?}: {e}"));
            }
            ctx.prepared.push(Prepared {
                disk: disk.clone(),
                new,
                old_head: head,
                top_node: Some(top_node),
                new_node: Some(new_node),
                capacity,
            });
        } else {
            let info = hearth_qemu::img::info(&head.path)
                .await
                .map_err(|e| e.to_string())?;
            hearth_qemu::img::create_overlay(&new.path, &head.path, "qcow2", None)
                .await
                .map_err(|e| format!("creating the overlay for {disk:?}: {e}"))?;
            ctx.prepared.push(Prepared {
                disk: disk.clone(),
                new,
                old_head: head,
                top_node: None,
                new_node: None,
                capacity: info.virtual_size,
            });
        }
    }
    Ok(())
}

/// One atomic QMP transaction over every disk of the cut. Offline, the
/// switch happens in the store at commit.
async fn transact(ctx: &CutContext, timeout: Duration) -> Result<(), String> {
    let Some(live) = &ctx.live else { return Ok(()) };
    let actions: Vec<Value> = ctx
        .prepared
        .iter()
        .filter_map(|p| match (&p.top_node, &p.new_node) {
            (Some(top), Some(new)) => Some(json!({
                "type": "blockdev-snapshot",
                "data": {"node": top, "overlay": new},
            })),
            _ => None,
        })
        .collect();
    if actions.is_empty() {
        return Ok(());
    }
    let qmp = live.qmp.as_ref().ok_or("no QMP connection")?;
    qmp.execute("transaction", Some(json!({"actions": actions})), timeout)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

async fn discard(ctx: &mut CutContext) {
    for p in ctx.prepared.drain(..) {
        if let (Some(live), Some(node)) = (&ctx.live, &p.new_node)
            && let Some(qmp) = &live.qmp
        {
            let _ = qmp
                .execute(
                    "blockdev-del",
                    Some(json!({"node-name": node})),
                    QMP_TIMEOUT,
                )
                .await;
        }
        let _ = std::fs::remove_file(&p.new.path);
    }
}

#[allow(clippy::too_many_arguments)]
async fn commit(
    engine: &Arc<Engine>,
    target: &str,
    ctx: &mut CutContext,
    core: &Coordinator,
    cut: CutId,
    outcomes: &[(String, Outcome)],
    took_cut: bool,
    freeze_window_ms: Option<Millis>,
    keep_intent: bool,
    why_not_consistent: Option<String>,
) {
    let disk_of: HashMap<String, String> = core
        .cut_requests()
        .iter()
        .map(|r| (r.snapshot.clone(), r.disk.clone()))
        .collect();
    let cut_time = ctx.freeze_started.unwrap_or_else(Utc::now);
    let prepared: HashMap<String, &Prepared> =
        ctx.prepared.iter().map(|p| (p.disk.clone(), p)).collect();
    // Results, new heads and the intent: one store transaction.
    let r = engine.store.with_tx(|tx| {
        if took_cut {
            for p in prepared.values() {
                storage::set_head_tx(tx, &p.disk, &p.new, Some(&p.old_head.id))?;
                let path = p.new.path.clone();
                Store::update_status_tx::<VirtualDiskStatus, _>(
                    tx,
                    Kind::VirtualDisk,
                    &p.disk,
                    |s| {
                        s.path = Some(path);
                    },
                )?;
            }
        }
        for (name, outcome) in outcomes {
            let exists: bool = tx
                .query_row(
                    "SELECT COUNT(*) FROM objects WHERE kind = ?1 AND name = ?2",
                    params![Kind::VirtualDiskSnapshot.as_str(), name],
                    |r| r.get::<_, i64>(0),
                )
                .map(|n| n > 0)?;
            if !exists {
                continue;
            }
            let layer = disk_of.get(name).and_then(|d| prepared.get(d));
            if let (Outcome::Ready { .. }, Some(p)) = (outcome, layer) {
                storage::set_snapshot_layer_tx(tx, name, &p.old_head.id)?;
            }
            Store::update_status_tx::<SnapshotStatus, _>(
                tx,
                Kind::VirtualDiskSnapshot,
                name,
                |s| {
                    s.cut_id = Some(cut);
                    match outcome {
                        Outcome::Ready { consistent } => {
                            s.phase = SnapshotPhase::Ready;
                            s.consistent = Some(*consistent);
                            s.cut_time = Some(cut_time);
                            s.freeze_window_ms = freeze_window_ms;
                            s.capacity = layer.map(|p| p.capacity);
                            if *consistent {
                                s.reason = None;
                                s.message = None;
                            } else {
                                s.reason = Some("NotConsistent".into());
                                s.message = why_not_consistent.clone();
                            }
                        }
                        Outcome::Failed(why) => {
                            s.phase = SnapshotPhase::Failed;
                            s.consistent = None;
                            s.freeze_window_ms = freeze_window_ms;
                            s.reason = Some("NotConsistent".into());
                            s.message = Some(why.clone());
                        }
                        Outcome::Retry => {
                            s.phase = SnapshotPhase::Pending;
                            s.message =
                                Some("hearthd restarted during the cut; taking it again".into());
                        }
                    }
                },
            )?;
        }
        if !keep_intent {
            tx.execute(
                "DELETE FROM freeze_intents WHERE target = ?1",
                params![target],
            )?;
        }
        Ok(())
    });
    if let Err(e) = r {
        tracing::error!(target, cut, error = %e, "cannot record the cut's results");
    }
    // Sizes of the new snapshot layers, outside the transaction.
    for (name, outcome) in outcomes {
        if let (Outcome::Ready { .. }, Some(p)) =
            (outcome, disk_of.get(name).and_then(|d| prepared.get(d)))
            && let Ok(info) = hearth_qemu::img::info(&p.old_head.path).await
        {
            engine.set_snapshot_status(Kind::VirtualDiskSnapshot, name, |s| {
                s.size = Some(info.actual_size)
            });
        }
    }
    let ready = outcomes
        .iter()
        .filter(|(_, o)| matches!(o, Outcome::Ready { .. }))
        .count();
    let failed = outcomes
        .iter()
        .filter(|(_, o)| matches!(o, Outcome::Failed(_)))
        .count();
    if !outcomes.is_empty() {
        vm_event(
            engine,
            target,
            if failed > 0 {
                EventType::Warning
            } else {
                EventType::Normal
            },
            "SnapshotCut",
            &format!(
                "cut {cut}: {ready} ready, {failed} failed{}{}",
                freeze_window_ms
                    .map(|w| format!(", frozen window {w} ms"))
                    .unwrap_or_default(),
                if took_cut { "" } else { ", no cut taken" }
            ),
        );
    }
    for (name, outcome) in outcomes {
        let (t, reason, msg) = match outcome {
            Outcome::Ready { consistent } => (
                EventType::Normal,
                "Ready",
                format!("taken in cut {cut}, consistent: {consistent}"),
            ),
            Outcome::Failed(why) => (EventType::Warning, "Failed", why.clone()),
            Outcome::Retry => (
                EventType::Warning,
                "Retrying",
                "hearthd restarted during the cut; taking it again".to_string(),
            ),
        };
        engine.event(Kind::VirtualDiskSnapshot, name, t, reason, &msg);
        engine.wake(Kind::VirtualDiskSnapshot, name);
    }
    // VM snapshots aggregate their disk snapshots.
    if let Ok(vmsnaps) = engine.store.list(Kind::VirtualMachineSnapshot) {
        for s in vmsnaps {
            engine.wake(Kind::VirtualMachineSnapshot, s.object.name());
        }
    }
    ctx.prepared.clear();
    ctx.guard = None;
}
