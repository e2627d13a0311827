//! Liveness, waiting and signalling against real processes, children and not.

use std::process::Command;
use std::time::Duration;

use hearth_qemu::process::{
    ProcessIdentity, Signal, SignalError, find_launched, identity_of, is_alive, signal,
    spawn_floor_ticks, wait_for_exit,
};

/// Starts `sleep 30` so that it is NOT our child: the shell that forked it exits
/// right away and the sleep is re-parented, like a VM adopted after a restart.
fn orphan_sleep() -> ProcessIdentity {
    let out = Command::new("sh")
        .args(["-c", "sleep 30 >/dev/null 2>&1 & echo $!"])
        .output()
        .expect("run sh");
    let pid: u32 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("pid printed by sh");
    identity_of(pid).expect("sleep is running")
}

#[tokio::test]
async fn a_child_is_alive_until_terminated_and_then_wait_resolves() {
    let mut child = Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("spawn sleep");
    let id = identity_of(child.id()).expect("identity");
    assert!(is_alive(&id));

    let waiter = tokio::spawn({
        let id = id.clone();
        async move { wait_for_exit(&id).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "must not resolve while the process runs"
    );

    signal(&id, Signal::Term).expect("signal");
    tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("wait_for_exit resolves after exit")
        .expect("join");
    // Not reaped yet: a zombie counts as gone.
    assert!(!is_alive(&id));
    let _ = child.wait();
}

#[tokio::test]
async fn an_adopted_non_child_can_be_watched_and_killed() {
    let id = orphan_sleep();
    assert!(is_alive(&id));
    let waiter = tokio::spawn({
        let id = id.clone();
        async move { wait_for_exit(&id).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());

    signal(&id, Signal::Kill).expect("kill");
    tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("wait_for_exit sees a non-child exit")
        .expect("join");
    assert!(!is_alive(&id));
    let err = signal(&id, Signal::Term).expect_err("gone");
    assert!(matches!(err, SignalError::Gone { .. }), "{err}");
}

#[tokio::test]
async fn a_stale_identity_never_signals_whoever_has_the_pid_now() {
    let id = orphan_sleep();
    // Same pid, different start time: what a recycled pid looks like.
    let stale = ProcessIdentity {
        pid: id.pid,
        start_ticks: id.start_ticks.wrapping_sub(1),
    };
    assert!(!is_alive(&stale));
    let err = signal(&stale, Signal::Kill).expect_err("refused");
    assert!(matches!(err, SignalError::Gone { .. }), "{err}");
    assert!(is_alive(&id), "the real process was not touched");
    tokio::time::timeout(Duration::from_millis(100), wait_for_exit(&stale))
        .await
        .expect("a stale identity counts as already exited");
    signal(&id, Signal::Kill).expect("cleanup");
    tokio::time::timeout(Duration::from_secs(5), wait_for_exit(&id))
        .await
        .expect("exits");
}

#[tokio::test]
async fn a_pid_that_does_not_exist_is_gone() {
    // Above the default pid_max (4194304), so nothing can own it.
    let id = ProcessIdentity {
        pid: 4_194_305,
        start_ticks: 1,
    };
    assert!(identity_of(id.pid).is_none());
    assert!(!is_alive(&id));
    assert!(matches!(
        signal(&id, Signal::Term),
        Err(SignalError::Gone { .. })
    ));
    tokio::time::timeout(Duration::from_millis(100), wait_for_exit(&id))
        .await
        .expect("resolves at once");
}

/// A process whose environment carries `HEARTH_LAUNCH=<path>` like a
/// marked QEMU launch; it writes its pid there when `write` is set.
fn marked(path: &std::path::Path, write: bool) -> std::process::Child {
    let script = if write {
        "echo $$ > \"$HEARTH_LAUNCH\"; exec sleep 30"
    } else {
        "exec sleep 30"
    };
    // `exec`: one process carries the variable, as QEMU (which may not
    // spawn anything) does; a forked child would inherit it.
    Command::new("sh")
        .args(["-c", script])
        .env(hearth_qemu::process::LAUNCH_ENV, path)
        .spawn()
        .expect("spawn sh")
}

#[tokio::test]
async fn a_marked_launch_is_found_by_its_pidfile_or_its_environment_and_nothing_else_is() {
    let dir = tempfile::tempdir().expect("tempdir");
    let floor = spawn_floor_ticks().expect("floor");

    // Found through the pid it wrote.
    let with = dir.path().join("launch-1.pid");
    let mut a = marked(&with, true);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !with.exists() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let found = find_launched(&with, floor).expect("found by pidfile");
    assert_eq!(found.pid, a.id());
    assert!(is_alive(&found));

    // Found without a pidfile, and despite one naming an unrelated live process
    // (our own pid: alive, but its environment does not name the pidfile).
    let without = dir.path().join("launch-2.pid");
    let mut b = marked(&without, false);
    tokio::time::sleep(Duration::from_millis(100)).await;
    std::fs::write(&without, format!("{}\n", std::process::id())).expect("write");
    let found = find_launched(&without, floor).expect("found by its environment");
    assert_eq!(found.pid, b.id());

    // Started before the marker: not this launch.
    let future = identity_of(b.id()).expect("id").start_ticks + 1;
    assert_eq!(find_launched(&without, future), None);
    // Another launch's path is not a prefix match.
    assert_eq!(find_launched(&dir.path().join("launch-"), floor), None);

    // Gone: a live pid in the pidfile is not taken for it.
    b.kill().expect("kill");
    b.wait().expect("reap");
    assert_eq!(find_launched(&without, floor), None);
    a.kill().expect("kill");
    a.wait().expect("reap");
    assert_eq!(find_launched(&with, floor), None);
}
