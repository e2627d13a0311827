//! The agent client against the real qemu-ga in the project's test guest.
//!
//! Needs the guest built by `guest/build.sh` (kernel, initramfs with qemu-ga, data
//! disk); `scripts/test` builds it first. A missing guest is a failure with the
//! command that builds it, never a skip.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use hearth_qemu::agent::{AgentClient, FreezeStatus};
use hearth_qemu::cmdline::{Accel, DiskAttachment, LaunchSpec};
use hearth_qemu::img::QemuImg;
use hearth_qemu::process::{self, Signal};
use hearth_qemu::qmp::QmpClient;

const T: Duration = Duration::from_secs(10);
/// Boot to agent is ~5 s under TCG on an idle machine; leave room for a busy one.
const BOOT: Duration = Duration::from_secs(180);

fn guest_dir() -> PathBuf {
    let dir = std::env::var_os("HEARTH_GUEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../guest/out"));
    for file in ["vmlinuz", "initrd.img", "data.qcow2", "cmdline"] {
        assert!(
            dir.join(file).exists(),
            "{} missing: build the test guest first with `bash guest/build.sh`",
            dir.join(file).display()
        );
    }
    dir
}

struct Cleanup(Option<process::ProcessIdentity>);
impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(id) = self.0.take() {
            let _ = process::signal(&id, Signal::Kill);
        }
    }
}

#[tokio::test]
async fn freeze_thaw_exec_and_resync_against_the_real_guest_agent() {
    let guest = guest_dir();
    let tmp = tempfile::tempdir().expect("tempdir");
    let disk = tmp.path().join("data.qcow2");
    QemuImg::new(common::qemu_img())
        .create_overlay(&disk, &guest.join("data.qcow2"), "qcow2", None)
        .await
        .expect("overlay of the guest data disk");
    let cmdline = std::fs::read_to_string(guest.join("cmdline")).expect("cmdline");
    let spec = LaunchSpec {
        vm_name: "agent-e2e".into(),
        cpus: 1,
        memory_mib: 256,
        accel: Accel::Tcg,
        kernel: guest.join("vmlinuz"),
        initrd: Some(guest.join("initrd.img")),
        cmdline: cmdline.trim().to_owned(),
        disks: vec![DiskAttachment {
            node_name: "disk-data".into(),
            path: disk,
            read_only: false,
        }],
        agent_socket: Some(tmp.path().join("qga.sock")),
        qmp_socket: tmp.path().join("qmp.sock"),
        serial_log: tmp.path().join("serial.log"),
    };
    let id = process::launch(
        &common::qemu(),
        &spec,
        &tmp.path().join("qemu.log"),
        Duration::from_secs(30),
    )
    .await
    .expect("guest starts");
    let mut cleanup = Cleanup(Some(id.clone()));
    let agent_socket = spec.agent_socket.clone().expect("agent socket");
    let mut agent = AgentClient::connect(&agent_socket).await.expect("connect");

    // Until qemu-ga runs, pings time out; each retry resyncs from scratch.
    let deadline = tokio::time::Instant::now() + BOOT;
    while let Err(e) = agent.ping(Duration::from_secs(2)).await {
        let serial = std::fs::read_to_string(&spec.serial_log).unwrap_or_default();
        assert!(
            tokio::time::Instant::now() < deadline,
            "agent never answered ({e}); serial:\n{serial}"
        );
    }
    let info = agent.info(T).await.expect("guest-info");
    assert!(
        info["version"].as_str().is_some_and(|v| !v.is_empty()),
        "{info}"
    );

    // A reply that arrives after we gave up must not answer the next question.
    let _ = agent
        .execute("guest-fsfreeze-freeze", None, Duration::from_millis(1))
        .await;
    let status = agent.fsfreeze_status(T).await.expect("status");
    // Whether or not that freeze went through, the answer must be the current
    // state, not the late "{"return": 1}" of the freeze.
    if status == FreezeStatus::Frozen {
        agent.fsfreeze_thaw(T).await.expect("thaw the late freeze");
    }
    assert_eq!(
        agent.fsfreeze_status(T).await.expect("status"),
        FreezeStatus::Thawed
    );

    let frozen = agent.fsfreeze_freeze(T).await.expect("freeze");
    assert!(frozen >= 1, "the ext4 data disk is frozen");
    assert_eq!(
        agent.fsfreeze_status(T).await.expect("status"),
        FreezeStatus::Frozen
    );
    let refused = agent
        .exec("/bin/true", &[], T)
        .await
        .expect_err("exec is refused while frozen");
    assert!(refused.is_disabled_while_frozen(), "{refused}");
    let again = agent.fsfreeze_freeze(T).await.expect_err("already frozen");
    assert!(again.is_disabled_while_frozen(), "{again}");
    agent.ping(T).await.expect("ping answers while frozen");
    assert_eq!(agent.fsfreeze_thaw(T).await.expect("thaw"), frozen);
    assert_eq!(agent.fsfreeze_thaw(T).await.expect("thaw again"), 0);

    let out = agent
        .exec("/bin/sh", &["-c", "echo hi; echo oops >&2; exit 3"], T)
        .await
        .expect("exec");
    assert_eq!(out.exit_code, Some(3));
    assert_eq!(out.stdout, b"hi\n");
    assert_eq!(out.stderr, b"oops\n");

    // A fresh connection resyncs through whatever the old one left behind.
    drop(agent);
    let mut agent = AgentClient::connect(&agent_socket)
        .await
        .expect("reconnect");
    agent.ping(T).await.expect("ping after reconnect");

    let (qmp, _events) = QmpClient::connect(&spec.qmp_socket, T).await.expect("qmp");
    qmp.execute("quit", None, T).await.expect("quit");
    tokio::time::timeout(T, process::wait_for_exit(&id))
        .await
        .expect("QEMU exits");
    cleanup.0 = None;
}
