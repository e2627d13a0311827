use std::time::Duration;

use serde_json::json;

use super::*;

const T: Duration = Duration::from_secs(5);

fn snapshot(node: &str, overlay: &str) -> Value {
    json!({"type": "blockdev-snapshot", "data": {"node": node, "overlay": overlay}})
}

/// An overlay node over a file handed over by descriptor, as a cut adds it.
async fn add_overlay(q: &FakeQemu, dir: &std::path::Path, node: &str) {
    let path = dir.join(node);
    std::fs::write(&path, b"").expect("file");
    q.add_protocol_node(&format!("{node}f"), &path, false, T)
        .await
        .expect("file node");
    q.blockdev_create(
        &format!("{node}-create"),
        json!({"driver": "qcow2", "file": format!("{node}f"), "size": 1024}),
        T,
    )
    .await
    .expect("create");
    q.job_dismiss(&format!("{node}-create"), T)
        .await
        .expect("dismiss");
    q.blockdev_add(
        json!({"driver": "qcow2", "node-name": node, "file": format!("{node}f"), "backing": null}),
        T,
    )
    .await
    .expect("add");
}

#[tokio::test]
async fn a_transaction_runs_whole_or_not_at_all() {
    let dir = tempfile::tempdir().expect("tmp");
    let q = FakeQemu::new();
    q.attach("vdisk0", "disk0", "/l/a", 1024);
    q.attach("vdisk1", "disk1", "/l/b", 1024);
    add_overlay(&q, dir.path(), "h1d0").await;
    // One action names a node QEMU does not have: nothing switches.
    let e = q
        .transaction(
            vec![snapshot("disk0", "h1d0"), snapshot("disk1", "h1d1")],
            T,
        )
        .await
        .expect_err("refused");
    assert!(matches!(e, QmpError::Command { .. }), "{e}");
    assert_eq!(q.top("vdisk0").as_deref(), Some("disk0"));
    assert_eq!(q.node("h1d0").expect("node").backing, None);
    add_overlay(&q, dir.path(), "h1d1").await;
    q.transaction(
        vec![snapshot("disk0", "h1d0"), snapshot("disk1", "h1d1")],
        T,
    )
    .await
    .expect("ran");
    assert_eq!(q.top("vdisk0").as_deref(), Some("h1d0"));
    assert_eq!(q.top("vdisk1").as_deref(), Some("h1d1"));
    assert_eq!(
        q.node("h1d1").expect("node").backing.as_deref(),
        Some("disk1")
    );
}

#[tokio::test]
async fn a_node_in_use_is_not_removed_and_an_unknown_one_counts_as_removed() {
    let dir = tempfile::tempdir().expect("tmp");
    let q = FakeQemu::new();
    q.attach("vdisk0", "disk0", "/l/a", 1024);
    add_overlay(&q, dir.path(), "h1d0").await;
    let path = dir.path().join("h1d0");
    // The file node is under the format node: refused.
    assert!(q.remove_node("h1d0f", Some(&path), T).await.is_err());
    q.remove_node("h1d0", None, T).await.expect("format node");
    q.remove_node("h1d0f", Some(&path), T)
        .await
        .expect("file node");
    assert_eq!(q.node_names(), vec!["disk0", "disk0-file"]);
    assert!(q.fdset_labels().is_empty(), "{:?}", q.fdset_labels());
    q.remove_node("h1d0", None, T).await.expect("again");
    // The device's node is in use.
    assert!(q.remove_node("disk0", None, T).await.is_err());
}

#[tokio::test(start_paused = true)]
async fn an_injected_fault_hits_only_its_call() {
    let q = FakeQemu::new();
    q.attach("vdisk0", "disk0", "/l/a", 1024);
    q.inject("query-block", 2, Fault::Hang);
    q.inject("query-status", 1, Fault::fail("no"));
    assert!(q.query_block(T).await.is_ok());
    let before = tokio::time::Instant::now();
    let e = q.query_block(T).await.expect_err("hangs");
    assert!(matches!(e, QmpError::Timeout { .. }), "{e}");
    assert_eq!(before.elapsed(), T);
    assert!(q.query_block(T).await.is_ok());
    assert!(q.query_status(T).await.is_err());
    assert_eq!(q.query_status(T).await.expect("status"), "running");
    assert_eq!(
        q.commands(),
        [
            "query-block",
            "query-block",
            "query-block",
            "query-status",
            "query-status"
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_lost_reply_still_ran() {
    let dir = tempfile::tempdir().expect("tmp");
    let q = FakeQemu::new();
    q.attach("vdisk0", "disk0", "/l/a", 1024);
    add_overlay(&q, dir.path(), "h1d0").await;
    q.inject("transaction", 1, Fault::LoseReply);
    assert!(
        q.transaction(vec![snapshot("disk0", "h1d0")], T)
            .await
            .is_err()
    );
    assert_eq!(q.top("vdisk0").as_deref(), Some("h1d0"));
}

#[tokio::test(start_paused = true)]
async fn the_fake_agent_freezes_thaws_and_refuses_while_frozen() {
    let mut a = FakeAgent::new();
    assert_eq!(a.fsfreeze_freeze(T).await.expect("freeze"), 1);
    assert!(a.is_frozen());
    let e = a.get_fsinfo(T).await.expect_err("frozen");
    assert!(e.is_disabled_while_frozen(), "{e}");
    assert_eq!(
        a.fsfreeze_status(T).await.expect("status"),
        FreezeStatus::Frozen
    );
    assert_eq!(a.fsfreeze_thaw(T).await.expect("thaw"), 1);
    a.inject(
        "guest-fsfreeze-freeze-list",
        1,
        Fault::Late(Duration::from_secs(9)),
    );
    let e = a
        .fsfreeze_freeze_list(&["/data".into()], T)
        .await
        .expect_err("late");
    assert!(matches!(e, AgentError::Timeout { .. }), "{e}");
    // It froze all the same, after the caller gave up.
    assert!(a.is_frozen());
}
