//! The agent client against the real qemu-ga in the project's test guest, and
//! the mapping of its filesystems to hearth's disks.
//!
//! Needs the guest built by `guest/build.sh` (kernel, initramfs with qemu-ga, data
//! disk); `scripts/test` builds it first. A missing guest is a failure with the
//! command that builds it, never a skip.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use hearth_qemu::agent::{AgentClient, FreezeStatus};
use std::collections::BTreeSet;

use hearth_qemu::cmdline::{Accel, DiskAttachment, Firmware, KernelBoot, LaunchSpec, disk_serial};
use hearth_qemu::fsmap::{self, map_mount_points};
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
async fn freeze_thaw_exec_resync_and_fs_mapping_against_the_real_guest_agent() {
    let guest = guest_dir();
    let tmp = tempfile::tempdir().expect("tempdir");
    // Two disks, each an overlay over the guest's ext4 data disk: the guest
    // mounts them at /mnt/vda (bound at /data too) and /mnt/vdb. The second
    // disk's name is too long to be its own serial, so it gets a hashed one.
    let disk_names = ["data-a", "a-second-data-disk-with-a-long-name"];
    let mut disks = Vec::new();
    for (i, name) in disk_names.iter().enumerate() {
        let path = tmp.path().join(format!("{name}.qcow2"));
        QemuImg::new(common::qemu_img())
            .create_overlay(&path, &guest.join("data.qcow2"), "qcow2", None)
            .await
            .expect("overlay of the guest data disk");
        disks.push(DiskAttachment {
            node_name: format!("disk{i}"),
            path,
            read_only: false,
            serial: disk_serial(name),
            // The guest data disk below the overlay, as its own node.
            backing: vec![hearth_qemu::cmdline::BackingLayer {
                path: guest.join("data.qcow2"),
                format: "qcow2".into(),
                real_path: std::fs::canonicalize(guest.join("data.qcow2"))
                    .expect("canonical guest data disk"),
            }],
        });
    }
    assert_eq!(disks[1].serial.len(), 20, "{}", disks[1].serial);
    let cmdline = std::fs::read_to_string(guest.join("cmdline")).expect("cmdline");
    let spec = LaunchSpec {
        vm_name: "agent-e2e".into(),
        cpus: 1,
        memory_mib: 256,
        accel: Accel::Tcg,
        firmware: Firmware::Bios,
        kernel: Some(KernelBoot {
            kernel: guest.join("vmlinuz"),
            initrd: Some(guest.join("initrd.img")),
            cmdline: cmdline.trim().to_owned(),
        }),
        disks,
        seed: None,
        nics: vec![],
        agent_socket: Some(tmp.path().join("qga.sock")),
        qmp_socket: tmp.path().join("qmp.sock"),
        serial_log: tmp.path().join("serial.log"),
        serial_socket: None,
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
    eprintln!("qemu-ga version {}", info["version"]);
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

    // Which filesystems lie on which disk: the agent's report, tied to the
    // devices by serial or by PCI address, must agree with /proc/mounts.
    let (qmp, _events) = QmpClient::connect(&spec.qmp_socket, T).await.expect("qmp");
    let raw = agent
        .execute("guest-get-fsinfo", None, T)
        .await
        .expect("raw guest-get-fsinfo");
    eprintln!("guest-get-fsinfo: {raw}");
    let fsinfo = agent.get_fsinfo(T).await.expect("guest-get-fsinfo");
    let pci = fsmap::disk_pci_addresses(&qmp, T).await.expect("query-pci");
    eprintln!("disk PCI addresses: {pci:?}");
    assert_eq!(
        pci.keys().copied().collect::<Vec<_>>(),
        vec![0, 1],
        "both disk devices are on the PCI bus: {pci:?}"
    );
    let serials: Vec<String> = spec.disks.iter().map(|d| d.serial.clone()).collect();
    let map = map_mount_points(&fsinfo, &serials, &pci);
    eprintln!("mapping: {map:?}");

    // The guest sees each serial hearth gave (whether or not its qemu-ga can
    // report it: without udev it cannot, and the PCI address decides).
    for (i, disk) in spec.disks.iter().enumerate() {
        let dev = ["vda", "vdb"][i];
        let out = agent
            .exec("/bin/cat", &[&format!("/sys/block/{dev}/serial")], T)
            .await
            .expect("read the serial in the guest");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim_end(),
            disk.serial,
            "{dev}"
        );
    }

    let mounts = agent
        .exec("/bin/sh", &["-c", "cat /proc/mounts"], T)
        .await
        .expect("cat /proc/mounts");
    assert_eq!(mounts.exit_code, Some(0));
    let mounts = String::from_utf8_lossy(&mounts.stdout).into_owned();
    let mounted_from = |dev: &str| -> Vec<String> {
        let set: BTreeSet<String> = mounts
            .lines()
            .filter_map(|line| {
                let mut fields = line.split_whitespace();
                let source = fields.next()?;
                let target = fields.next()?;
                (source == dev).then(|| target.to_owned())
            })
            .collect();
        set.into_iter().collect()
    };
    let on_vda = mounted_from("/dev/vda");
    let on_vdb = mounted_from("/dev/vdb");
    assert!(
        on_vda.contains(&"/mnt/vda".to_owned()) && on_vda.contains(&"/data".to_owned()),
        "the guest mounts the first disk at /mnt/vda and /data: {mounts}"
    );
    assert_eq!(on_vdb, vec!["/mnt/vdb"], "{mounts}");
    assert_eq!(map.by_disk.len(), 2, "{map:?}");
    assert_eq!(map.by_disk[0], on_vda, "device 0 is /dev/vda; {raw}");
    assert_eq!(map.by_disk[1], on_vdb, "device 1 is /dev/vdb; {raw}");
    // Every filesystem the agent reported here lies on one of our two disks.
    assert!(map.unmapped.is_empty(), "{map:?}");
    // The agent names the device nodes, so check the mapping did not just
    // swap two filesystems that look alike.
    for fs in &fsinfo {
        for disk in &fs.disks {
            if let Some(dev) = &disk.dev {
                let index = match dev.as_str() {
                    "/dev/vda" => 0,
                    "/dev/vdb" => 1,
                    other => panic!("unexpected disk {other} in {raw}"),
                };
                assert!(map.by_disk[index].contains(&fs.mountpoint), "{raw}");
            }
        }
    }

    // A fresh connection resyncs through whatever the old one left behind.
    drop(agent);
    let mut agent = AgentClient::connect(&agent_socket)
        .await
        .expect("reconnect");
    agent.ping(T).await.expect("ping after reconnect");

    qmp.execute("quit", None, T).await.expect("quit");
    tokio::time::timeout(T, process::wait_for_exit(&id))
        .await
        .expect("QEMU exits");
    cleanup.0 = None;
}
