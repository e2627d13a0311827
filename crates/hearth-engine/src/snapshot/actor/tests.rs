//! The actor's steps without QEMU: the waits on paused time, and each QEMU
//! step of a cut against the seam's fake, failing where QEMU can fail.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use hearth_qemu::seam::Monitor;
use hearth_qemu::seam::fake::{FakeAgent, FakeQemu, Fault};
use serde_json::{Value, json};
use tokio::sync::{Mutex, mpsc};
use tokio::time::Instant;

use super::cut::add_overlay_node;
use super::steps::{GATHER, MAX_GATHER};
use super::*;
use crate::snapshot::coordinator::{Access, Command, Coordinator, Input, Outcome, Request};

/// Prints a test's wall time when it ends (run with `--nocapture`).
struct Timed(&'static str, std::time::Instant);

impl Timed {
    fn start(name: &'static str) -> Timed {
        Timed(name, std::time::Instant::now())
    }
}

impl Drop for Timed {
    fn drop(&mut self) {
        println!("timing: {} took {:?}", self.0, self.1.elapsed());
    }
}

fn req(snapshot: &str, disk: &str) -> Request {
    Request {
        snapshot: snapshot.into(),
        disk: disk.into(),
        required: true,
        whole_vm: false,
        group: None,
    }
}

fn pending(core: &Coordinator) -> Vec<String> {
    core.pending().iter().map(|r| r.snapshot.clone()).collect()
}

/// Sends one request `after` the previous one.
fn send_at(tx: &mpsc::UnboundedSender<Msg>, plan: &[(u64, &str)]) {
    let tx = tx.clone();
    let plan: Vec<(u64, String)> = plan.iter().map(|(t, n)| (*t, n.to_string())).collect();
    tokio::spawn(async move {
        let start = Instant::now();
        for (at, name) in plan {
            tokio::time::sleep_until(start + Duration::from_millis(at)).await;
            let _ = tx.send(Msg::Requests(vec![req(&name, "d")]));
        }
    });
}

#[tokio::test(start_paused = true)]
async fn requests_within_the_gather_window_share_a_cut_and_a_later_one_waits_for_the_next() {
    let _t = Timed::start("gather window");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut core = Coordinator::new(10_000);
    // Each within GATHER (50 ms) of the one before; then 100 ms of quiet.
    send_at(&tx, &[(0, "a"), (30, "b"), (70, "c"), (170, "late")]);
    let (mut compact, mut ahead) = (BTreeSet::new(), false);
    let start = Instant::now();
    let closed = steps::gather(&mut rx, &mut core, &mut compact, &mut ahead).await;
    assert!(!closed);
    assert_eq!(pending(&core), ["a", "b", "c"]);
    // The window closed GATHER after the last request.
    assert_eq!(start.elapsed(), Duration::from_millis(120));
    tokio::time::sleep(Duration::from_millis(100)).await;
    match rx.try_recv() {
        Ok(Msg::Requests(rs)) => assert_eq!(rs[0].snapshot, "late"),
        _ => panic!("the late request is left for the next cut"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_steady_stream_is_gathered_for_at_most_max_gather() {
    let _t = Timed::start("gather limit");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut core = Coordinator::new(10_000);
    let names: Vec<String> = (0..25).map(|i| format!("s{i}")).collect();
    let plan: Vec<(u64, &str)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (40 * i as u64, n.as_str()))
        .collect();
    send_at(&tx, &plan);
    let (mut compact, mut ahead) = (BTreeSet::new(), false);
    let start = Instant::now();
    steps::gather(&mut rx, &mut core, &mut compact, &mut ahead).await;
    // The request that came at 320 ms was taken, then the limit (300 ms) ended it.
    assert_eq!(start.elapsed(), Duration::from_millis(320));
    assert_eq!(pending(&core).len(), 9);
    assert!(start.elapsed() < MAX_GATHER + GATHER);
}

#[tokio::test(start_paused = true)]
async fn the_gather_ends_when_the_actor_is_dropped_and_keeps_other_messages() {
    let _t = Timed::start("gather closed");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut core = Coordinator::new(10_000);
    tx.send(Msg::Compact("d".into())).expect("send");
    tx.send(Msg::Ahead).expect("send");
    drop(tx);
    let (mut compact, mut ahead) = (BTreeSet::new(), false);
    assert!(steps::gather(&mut rx, &mut core, &mut compact, &mut ahead).await);
    assert!(ahead);
    assert_eq!(compact.into_iter().collect::<Vec<_>>(), ["d"]);
}

#[tokio::test(start_paused = true)]
async fn an_agent_that_connects_late_is_waited_for_and_one_that_never_does_is_given_up() {
    let _t = Timed::start("agent wait");
    let connected = Arc::new(AtomicBool::new(false));
    let flag = connected.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    let start = Instant::now();
    assert!(steps::await_agent(&connected, start + AGENT_WAIT).await);
    // Seen at the next poll (every 200 ms).
    assert!(start.elapsed() >= Duration::from_secs(3));
    assert!(start.elapsed() <= Duration::from_millis(3200));

    let never = AtomicBool::new(false);
    let start = Instant::now();
    assert!(!steps::await_agent(&never, start + AGENT_WAIT).await);
    assert!(start.elapsed() >= AGENT_WAIT);
    assert!(start.elapsed() < AGENT_WAIT + Duration::from_millis(200));
}

#[tokio::test(start_paused = true)]
async fn an_agent_call_waits_for_the_connection_within_its_timeout() {
    let _t = Timed::start("agent call wait");
    let slot: Arc<Mutex<Option<FakeAgent>>> = Arc::new(Mutex::new(None));
    let guest = FakeAgent::new();
    let (s, g) = (slot.clone(), guest.clone());
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        *s.lock().await = Some(g);
    });
    let start = Instant::now();
    assert_eq!(
        steps::freeze(&slot, Duration::from_secs(5), &None).await,
        Ok(1)
    );
    assert!(start.elapsed() < Duration::from_millis(1200));
    assert!(guest.is_frozen());

    // No connection within the timeout.
    let empty: Mutex<Option<FakeAgent>> = Mutex::new(None);
    let start = Instant::now();
    assert_eq!(
        steps::thaw(&empty, Duration::from_secs(5), true).await,
        Err(AgentFault::Timeout)
    );
    assert!(start.elapsed() >= Duration::from_secs(5));
    assert!(start.elapsed() < Duration::from_millis(5200));

    // Connected, but the reply comes too late.
    guest.inject("guest-fsfreeze-status", 1, Fault::Hang);
    let start = Instant::now();
    assert_eq!(
        steps::frozen(&slot, Duration::from_secs(2)).await,
        Err(AgentFault::Timeout)
    );
    assert_eq!(start.elapsed(), Duration::from_secs(2));
}

/// A live VM with disk `d` on device 0 (node `disk0`), its cut overlay
/// `h1d0` added the way a cut adds it.
async fn vm_with_overlay(dir: &Path) -> (FakeQemu, PathBuf) {
    let qemu = FakeQemu::new();
    qemu.attach(
        &hearth_qemu::cmdline::disk_device_id(0),
        "disk0",
        "/layers/base",
        1 << 20,
    );
    let path = dir.join("h1d0.qcow2");
    add_overlay_node(
        Some(&qemu),
        &path,
        Path::new("/layers/base"),
        1 << 20,
        "h1d0",
    )
    .await
    .expect("overlay node");
    (qemu, path)
}

fn snapshot_action(node: &str, overlay: &str) -> Vec<Value> {
    vec![json!({"type": "blockdev-snapshot", "data": {"node": node, "overlay": overlay}})]
}

/// Drives one cut of snapshot `s` (disk `d`, device 0, overlay `h1d0`)
/// through the coordinator, running each QEMU and agent command on the
/// fakes, on paused time; returns the commit's outcomes and whether it took
/// the cut.
async fn drive_cut(
    qemu: &FakeQemu,
    agent: &Mutex<Option<FakeAgent>>,
    deadline: Millis,
) -> (Vec<(String, Outcome)>, bool, Vec<&'static str>) {
    let start = Instant::now();
    let now = || start.elapsed().as_millis() as Millis;
    let ms = Duration::from_millis;
    let mut core = Coordinator::new(deadline);
    core.handle(Input::Requested(req("s", "d")));
    let mut queue: VecDeque<Command> = core
        .handle(Input::Start {
            access: Access::Agent,
            cut: 1,
            now: now(),
        })
        .into();
    let mut seen = Vec::new();
    while let Some(cmd) = queue.pop_front() {
        let input = match cmd {
            Command::Prepare { cut, .. } => {
                seen.push("prepare");
                Input::Prepared {
                    cut,
                    failed: vec![],
                    mounts: None,
                    now: now(),
                }
            }
            Command::RecordIntent { cut, .. } => {
                seen.push("intent");
                Input::IntentRecorded {
                    cut,
                    result: Ok(()),
                    now: now(),
                }
            }
            Command::Freeze {
                cut,
                timeout,
                mountpoints,
            } => {
                seen.push("freeze");
                let result = steps::freeze(agent, ms(timeout), &mountpoints).await;
                Input::FreezeReplied {
                    cut,
                    result,
                    now: now(),
                }
            }
            Command::QueryFreeze { cut, timeout } => {
                seen.push("status");
                let result = steps::frozen(agent, ms(timeout)).await;
                Input::StatusReplied {
                    cut,
                    result,
                    now: now(),
                }
            }
            Command::Transact { cut, timeout } => {
                seen.push("transact");
                let result =
                    steps::transaction(Some(qemu), snapshot_action("disk0", "h1d0"), ms(timeout))
                        .await;
                Input::Transacted {
                    cut,
                    result,
                    now: now(),
                }
            }
            Command::Observe { cut, timeout, .. } => {
                seen.push("observe");
                let applied = steps::observe(qemu, &[(0, "h1d0")], ms(timeout)).await;
                Input::Observed {
                    cut,
                    applied,
                    now: now(),
                }
            }
            Command::Thaw {
                cut,
                timeout,
                only_if_frozen,
            } => {
                seen.push("thaw");
                let result = steps::thaw(agent, ms(timeout), only_if_frozen)
                    .await
                    .map(|n| n.unwrap_or(0));
                Input::ThawReplied {
                    cut,
                    result,
                    now: now(),
                }
            }
            Command::Discard { .. } => {
                seen.push("discard");
                continue;
            }
            Command::Commit {
                outcomes, took_cut, ..
            } => return (outcomes, took_cut, seen),
            Command::GroupReport { .. } => unreachable!("no group"),
        };
        queue.extend(core.handle(input));
    }
    panic!("the cut did not commit: {seen:?}");
}

#[tokio::test(start_paused = true)]
async fn a_cut_switches_the_device_inside_one_freeze() {
    let _t = Timed::start("cut");
    let dir = tempfile::tempdir().expect("tmp");
    let (qemu, _) = vm_with_overlay(dir.path()).await;
    let guest = FakeAgent::new();
    let agent = Mutex::new(Some(guest.clone()));
    let (outcomes, took_cut, _) = drive_cut(&qemu, &agent, 10_000).await;
    assert_eq!(
        outcomes,
        [("s".to_string(), Outcome::Ready { consistent: true })]
    );
    assert!(took_cut);
    assert_eq!(qemu.top("vdisk0").as_deref(), Some("h1d0"));
    // The freeze is confirmed before the switch.
    assert_eq!(
        guest.commands(),
        [
            "guest-fsfreeze-freeze",
            "guest-fsfreeze-status",
            "guest-fsfreeze-thaw"
        ]
    );
    assert!(!guest.is_frozen());
}

#[tokio::test(start_paused = true)]
async fn a_freeze_that_outlasts_the_deadline_is_thawed_and_the_cut_fails() {
    let _t = Timed::start("freeze deadline");
    let dir = tempfile::tempdir().expect("tmp");
    let (qemu, _) = vm_with_overlay(dir.path()).await;
    let guest = FakeAgent::new();
    // The guest freezes, but only answers after the deadline.
    guest.inject(
        "guest-fsfreeze-freeze",
        1,
        Fault::Late(Duration::from_secs(60)),
    );
    let agent = Mutex::new(Some(guest.clone()));
    let start = Instant::now();
    let (outcomes, took_cut, seen) = drive_cut(&qemu, &agent, 10_000).await;
    println!("freeze deadline: {seen:?} {outcomes:?}");
    assert!(
        matches!(&outcomes[..], [(s, Outcome::Failed(why))]
            if s == "s" && why.starts_with("the freeze did not complete within the 10 s deadline")),
        "{outcomes:?}"
    );
    assert!(!took_cut);
    // The late freeze is thawed right away, and the overlay discarded.
    assert_eq!(seen, ["prepare", "intent", "freeze", "thaw", "discard"]);
    // Never switched, and thawed.
    assert!(!qemu.commands().contains(&"transaction".to_string()));
    assert_eq!(qemu.top("vdisk0").as_deref(), Some("disk0"));
    assert!(!guest.is_frozen(), "{:?}", guest.commands());
    assert!(
        guest
            .commands()
            .contains(&"guest-fsfreeze-thaw".to_string())
    );
    assert!(start.elapsed() >= Duration::from_secs(10));
}

#[tokio::test(start_paused = true)]
async fn a_transaction_whose_reply_is_lost_is_observed_in_the_graph() {
    let _t = Timed::start("transaction reply lost");
    let dir = tempfile::tempdir().expect("tmp");
    let (qemu, _) = vm_with_overlay(dir.path()).await;
    qemu.inject("transaction", 1, Fault::LoseReply);
    let guest = FakeAgent::new();
    let agent = Mutex::new(Some(guest.clone()));
    let (outcomes, took_cut, seen) = drive_cut(&qemu, &agent, 10_000).await;
    println!("lost reply: {seen:?} {outcomes:?}");
    assert!(seen.contains(&"observe"), "{seen:?}");
    // It ran: the graph says so, and the cut counts.
    assert!(took_cut, "{outcomes:?}");
    assert_eq!(qemu.top("vdisk0").as_deref(), Some("h1d0"));
    assert!(!guest.is_frozen());
}

#[tokio::test(start_paused = true)]
async fn a_transaction_that_never_answers_and_never_ran_fails_the_cut() {
    let _t = Timed::start("transaction hangs");
    let dir = tempfile::tempdir().expect("tmp");
    let (qemu, _) = vm_with_overlay(dir.path()).await;
    qemu.inject("transaction", 1, Fault::Hang);
    let guest = FakeAgent::new();
    let agent = Mutex::new(Some(guest.clone()));
    let (outcomes, took_cut, seen) = drive_cut(&qemu, &agent, 10_000).await;
    println!("hung transaction: {seen:?} {outcomes:?}");
    assert!(seen.contains(&"observe"), "{seen:?}");
    assert!(!took_cut);
    assert!(
        matches!(&outcomes[..], [(_, Outcome::Failed(_))]),
        "{outcomes:?}"
    );
    assert_eq!(qemu.top("vdisk0").as_deref(), Some("disk0"));
    assert!(!guest.is_frozen());
}

#[tokio::test(start_paused = true)]
async fn a_refused_transaction_switches_nothing() {
    let _t = Timed::start("transaction refused");
    let dir = tempfile::tempdir().expect("tmp");
    let (qemu, _) = vm_with_overlay(dir.path()).await;
    let t = Duration::from_secs(5);
    // One action QEMU refuses: the whole transaction is refused.
    let mut actions = snapshot_action("disk0", "h1d0");
    actions.extend(snapshot_action("disk9", "h1d9"));
    let r = steps::transaction(Some(&qemu), actions, t).await;
    assert!(matches!(r, TxResult::Rejected(_)), "{r:?}");
    assert_eq!(qemu.top("vdisk0").as_deref(), Some("disk0"));
    assert_eq!(steps::observe(&qemu, &[(0, "h1d0")], t).await, Some(false));
    // Without a monitor nothing is sent.
    let none: Option<&FakeQemu> = None;
    assert_eq!(
        steps::transaction(none, snapshot_action("disk0", "h1d0"), t).await,
        TxResult::Rejected("no QMP connection".into())
    );
    // A graph that cannot be read says nothing.
    qemu.inject("query-block", 1, Fault::Hang);
    assert_eq!(steps::observe(&qemu, &[(0, "h1d0")], t).await, None);
}

#[tokio::test(start_paused = true)]
async fn a_failed_node_add_leaves_only_what_its_discard_removes() {
    let _t = Timed::start("node add fails");
    let dir = tempfile::tempdir().expect("tmp");
    let qemu = FakeQemu::new();
    qemu.attach("vdisk0", "disk0", "/layers/base", 1 << 20);
    let base = Path::new("/layers/base");
    // (the failing call, its number, whether QEMU keeps the file node)
    let cases = [
        ("blockdev-add", 1, false),
        ("blockdev-create", 1, true),
        ("job", 1, true),
        ("blockdev-add", 2, true),
    ];
    for (n, (fail, nth, file_node)) in cases.into_iter().enumerate() {
        let node = format!("h{n}d0");
        let path = dir.path().join(format!("{node}.qcow2"));
        match fail {
            "job" => qemu.fail_next_job("Could not write"),
            c => qemu.inject(c, nth, Fault::fail("refused")),
        }
        let e = add_overlay_node(Some(&qemu), &path, base, 1 << 20, &node)
            .await
            .expect_err("fails");
        println!("{fail} #{nth}: {e}");
        // The file exists (the overlay is journalled, so its discard
        // removes it); QEMU has no format node, and its file node only once
        // it was added.
        assert!(path.exists());
        assert_eq!(
            qemu.node(&format!("{node}f")).is_some(),
            file_node,
            "{fail}"
        );
        assert!(qemu.node(&node).is_none(), "{fail}");
        assert_eq!(qemu.fdset_labels().len(), usize::from(file_node), "{fail}");
        overlays::delete_nodes(&qemu, &node, &path)
            .await
            .expect("discarded");
        assert_eq!(qemu.node_names(), ["disk0", "disk0-file"], "{fail}");
        assert!(qemu.fdset_labels().is_empty(), "{fail}");
        assert!(qemu.jobs().is_empty(), "{fail}: {:?}", qemu.jobs());
    }
    // A file that exists already is never handed to QEMU.
    let path = dir.path().join("h0d0.qcow2");
    let calls = qemu.calls().len();
    assert!(
        add_overlay_node(Some(&qemu), &path, base, 1 << 20, "h9d0")
            .await
            .is_err()
    );
    assert_eq!(qemu.calls().len(), calls);
}

#[tokio::test(start_paused = true)]
async fn a_discard_removes_an_unused_overlay_and_never_one_in_use() {
    let _t = Timed::start("discard");
    let dir = tempfile::tempdir().expect("tmp");
    let t = Duration::from_secs(5);
    let (qemu, path) = vm_with_overlay(dir.path()).await;
    // A deletion QEMU refuses half way: the file node and its fd set stay
    // for the next settle.
    qemu.inject("blockdev-del", 2, Fault::fail("refused"));
    assert!(overlays::delete_nodes(&qemu, "h1d0", &path).await.is_err());
    assert!(qemu.node("h1d0").is_none());
    assert!(qemu.node("h1d0f").is_some());
    assert_eq!(qemu.fdset_labels().len(), 1);
    overlays::delete_nodes(&qemu, "h1d0", &path)
        .await
        .expect("the next settle");
    assert!(qemu.fdset_labels().is_empty());

    // In use (the cut switched to it): refused, nothing removed.
    let path = dir.path().join("h2d0.qcow2");
    add_overlay_node(
        Some(&qemu),
        &path,
        Path::new("/layers/base"),
        1 << 20,
        "h2d0",
    )
    .await
    .expect("overlay");
    assert_eq!(
        steps::transaction(Some(&qemu), snapshot_action("disk0", "h2d0"), t).await,
        TxResult::Applied
    );
    let e = overlays::delete_nodes(&qemu, "h2d0", &path)
        .await
        .expect_err("in use");
    assert!(e.to_string().contains("busy"), "{e}");
    assert!(qemu.node("h2d0").is_some() && qemu.node("h2d0f").is_some());
    assert_eq!(qemu.top("vdisk0").as_deref(), Some("h2d0"));
    assert_eq!(qemu.fdset_labels().len(), 1);
    assert!(qemu.query_block(t).await.is_ok());
}
