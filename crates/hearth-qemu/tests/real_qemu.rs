//! The driver against the real qemu-system-x86_64: probe boot, launch, QMP, exit.
//!
//! The "guest" is a 50-byte multiboot kernel that prints a line and halts, so these
//! tests need no guest image and run in a second or two under TCG.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use hearth_qemu::accel::{self, Accel};
use hearth_qemu::agent::{AgentClient, AgentError};
use hearth_qemu::cmdline::{DiskAttachment, Firmware, KernelBoot, LaunchSpec};
use hearth_qemu::img::QemuImg;
use hearth_qemu::process::{self, LaunchError, Signal};
use hearth_qemu::qmp::QmpClient;
use serde_json::{Value, json};

const READY: Duration = Duration::from_secs(20);
const T: Duration = Duration::from_secs(10);

struct Vm {
    spec: LaunchSpec,
    log: PathBuf,
}

/// A VM spec whose every path lives under `dir`.
fn vm_in(dir: &Path, name: &str, disks: Vec<DiskAttachment>) -> Vm {
    let kernel = dir.join("kernel.bin");
    common::write_halting_kernel(&kernel);
    Vm {
        spec: LaunchSpec {
            vm_name: name.to_owned(),
            cpus: 1,
            memory_mib: 64,
            accel: Accel::Tcg,
            firmware: Firmware::Bios,
            kernel: Some(KernelBoot {
                kernel,
                initrd: None,
                cmdline: "console=ttyS0,115200 a=b,c \"quoted\"".to_owned(),
            }),
            disks,
            seed: None,
            nics: vec![],
            agent_socket: Some(dir.join("qga.sock")),
            qmp_socket: dir.join("qmp.sock"),
            serial_log: dir.join("serial.log"),
            serial_socket: None,
        },
        log: dir.join("qemu.log"),
    }
}

/// Kills the VM even when an assertion fails half-way.
struct Cleanup(Option<process::ProcessIdentity>);
impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(id) = self.0.take() {
            let _ = process::signal(&id, Signal::Kill);
        }
    }
}

#[test]
fn the_version_line_of_any_qemu_release_is_read() {
    for (line, want) in [
        (
            "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2)\nCopyright (c) 2003-2025",
            (10, 0, 2),
        ),
        ("QEMU emulator version 7.2.15\n", (7, 2, 15)),
        ("QEMU emulator version 9.1.50 (v9.1.0-1-g0)\n", (9, 1, 50)),
    ] {
        assert_eq!(common::parse_qemu_version(line), Some(want), "{line}");
    }
    assert_eq!(common::parse_qemu_version("no number here"), None);
}

#[tokio::test]
async fn probe_boot_sector_reaches_the_exit_port_under_tcg() {
    accel::probe_boot(&common::qemu(), Accel::Tcg, Duration::from_secs(30))
        .await
        .expect("probe VM exits with 67 under TCG");
}

#[tokio::test]
async fn detect_explains_its_choice_on_this_host() {
    let decision = accel::detect(&common::qemu()).await;
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").expect("cpuinfo");
    if !accel::cpuinfo_has_virt_flags(&cpuinfo) {
        assert_eq!(decision.accel, Accel::Tcg);
        assert!(decision.reason.contains("vmx/svm"), "{}", decision.reason);
    } else if decision.accel == Accel::Kvm {
        assert!(
            decision.reason.contains("probe VM ran"),
            "{}",
            decision.reason
        );
    } else {
        assert!(decision.reason.starts_with("tcg: "), "{}", decision.reason);
    }
}

#[tokio::test]
async fn a_vm_with_hostile_paths_runs_and_qmp_sees_them_verbatim() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // Every path below contains characters QEMU's option syntax cares about.
    let dir = tmp.path().join("vm,path=x \"q\"");
    std::fs::create_dir(&dir).expect("mkdir");
    let img = QemuImg::new(common::qemu_img());
    let root = dir.join("root,driver=raw.qcow2");
    let data = dir.join("data disk.qcow2");
    img.create_blank(&root, 16 << 20).await.expect("root disk");
    img.create_blank(&data, 8 << 20).await.expect("data disk");
    let vm = vm_in(
        &dir,
        "hostile-paths",
        vec![
            DiskAttachment {
                node_name: "disk-root".into(),
                path: root.clone(),
                read_only: false,
                serial: "root".into(),
                backing: vec![],
            },
            DiskAttachment {
                node_name: "disk-data".into(),
                path: data.clone(),
                read_only: true,
                serial: hearth_qemu::cmdline::disk_serial("a-data-disk-with-a-long-name"),
                backing: vec![],
            },
        ],
    );

    let id = process::launch(&common::qemu(), &vm.spec, &vm.log, READY)
        .await
        .expect("QEMU starts");
    let mut cleanup = Cleanup(Some(id.clone()));
    assert!(process::is_alive(&id));
    assert_eq!(
        common::process_group_of(id.pid),
        Some(id.pid),
        "QEMU leads its own process group, so a signal to the daemon's group misses it"
    );
    assert_eq!(process::vm_name_of(&id).as_deref(), Some("hostile-paths"));

    let (qmp, _events) = QmpClient::connect(&vm.spec.qmp_socket, T)
        .await
        .expect("QMP handshake");
    // The greeting's version is the installed QEMU's, whichever release.
    let v = qmp.version();
    assert_eq!(
        (v.major, v.minor, v.micro),
        common::qemu_version_of(&common::qemu()),
        "QMP greeting vs `qemu-system-x86_64 --version`"
    );
    let status = qmp.execute("query-status", None, T).await.expect("status");
    assert_eq!(status["status"], "running");

    let nodes = qmp
        .execute("query-named-block-nodes", Some(json!({"flat": true})), T)
        .await
        .expect("nodes");
    // Every file went by descriptor: QEMU names the fd set, whose label is
    // the path, byte for byte.
    let fdsets = hearth_qemu::qmp::fdsets(&qmp, T)
        .await
        .expect("query-fdsets");
    let file_of = |node: &str| -> Option<(String, bool)> {
        nodes.as_array()?.iter().find_map(|n: &Value| {
            (n["node-name"] == node).then(|| {
                (
                    hearth_qemu::qmp::resolve_filename(
                        n["file"].as_str().unwrap_or_default(),
                        &fdsets,
                    ),
                    n["ro"].as_bool().unwrap_or(false),
                )
            })
        })
    };
    assert_eq!(
        file_of("disk-root"),
        Some((root.to_str().expect("utf8").to_owned(), false))
    );
    assert_eq!(
        file_of("disk-data"),
        Some((data.to_str().expect("utf8").to_owned(), true))
    );

    // Each virtio-blk device carries the serial it was given.
    for (index, disk) in vm.spec.disks.iter().enumerate() {
        let path = format!(
            "/machine/peripheral/{}",
            hearth_qemu::cmdline::disk_device_id(index)
        );
        let serial = qmp
            .execute(
                "qom-get",
                Some(json!({"path": path, "property": "serial"})),
                T,
            )
            .await
            .expect("qom-get serial");
        assert_eq!(serial, json!(disk.serial), "{path}");
    }

    // The agent chardev exists at the exact path; no agent runs in this guest, so
    // a call must time out rather than hang or succeed.
    let mut agent = AgentClient::connect(vm.spec.agent_socket.as_deref().expect("agent"))
        .await
        .expect("agent socket accepts");
    let err = agent
        .ping(Duration::from_millis(500))
        .await
        .expect_err("no agent in this guest");
    assert!(matches!(err, AgentError::Timeout { .. }), "{err}");

    // The guest printed through the serial chardev at the comma-laden path.
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let serial = std::fs::read_to_string(&vm.spec.serial_log).unwrap_or_default();
        if serial.contains("hearth") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "serial log: {serial:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // `quit` answers, then QEMU exits; both the process and the socket notice.
    qmp.execute("quit", None, T).await.expect("quit");
    tokio::time::timeout(T, process::wait_for_exit(&id))
        .await
        .expect("QEMU exits after quit");
    tokio::time::timeout(T, qmp.closed())
        .await
        .expect("QMP sees EOF");
    assert!(!process::is_alive(&id));
    cleanup.0 = None;
}

#[tokio::test]
async fn qemu_failing_at_start_reports_its_own_error_message() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // A qcow2 whose header passes hearth's checks but whose refcount table
    // offset is not cluster-aligned: QEMU itself refuses it.
    let garbage = tmp.path().join("not a disk.qcow2");
    QemuImg::new(common::qemu_img())
        .create_blank(&garbage, 16 << 20)
        .await
        .expect("qcow2");
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&garbage)
            .expect("open");
        f.write_all_at(&0x10001u64.to_be_bytes(), 48)
            .expect("refcount_table_offset");
    }
    let disk = |path: PathBuf| DiskAttachment {
        node_name: "disk-root".into(),
        path,
        read_only: false,
        serial: "root".into(),
        backing: vec![],
    };
    let vm = vm_in(tmp.path(), "broken", vec![disk(garbage)]);
    let err = process::launch(&common::qemu(), &vm.spec, &vm.log, READY)
        .await
        .expect_err("QEMU cannot use the disk");
    match err {
        LaunchError::Exited { stderr_tail, .. } => {
            assert!(
                stderr_tail.contains("Reference count table offset invalid"),
                "{stderr_tail}"
            );
            assert!(stderr_tail.contains("qemu-system-x86_64"), "{stderr_tail}");
        }
        other => panic!("expected Exited, got {other}"),
    }

    // A missing file never reaches QEMU: opening it for the handover fails,
    // naming the disk and the path, and nothing is spawned or bound.
    let tmp = tempfile::tempdir().expect("tempdir");
    let missing = tmp.path().join("no such disk.qcow2");
    let vm = vm_in(tmp.path(), "missing", vec![disk(missing.clone())]);
    let err = process::launch(&common::qemu(), &vm.spec, &vm.log, READY)
        .await
        .expect_err("no disk file");
    assert!(
        matches!(
            &err,
            LaunchError::Handover(hearth_qemu::handover::HandoverError::Layer {
                index: 0,
                source: hearth_qemu::chain::LayerError::Open { path, .. },
            }) if path == &missing
        ),
        "{err}"
    );
    assert!(err.to_string().contains("disks[0]"), "{err}");
    assert!(!vm.spec.qmp_socket.exists(), "nothing was bound");
}

#[tokio::test]
async fn a_terminated_vm_is_seen_gone_by_process_and_qmp() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut vm = vm_in(tmp.path(), "term", Vec::new());
    vm.spec.agent_socket = None;
    let id = process::launch(&common::qemu(), &vm.spec, &vm.log, READY)
        .await
        .expect("QEMU starts");
    let mut cleanup = Cleanup(Some(id.clone()));
    assert!(
        !tmp.path().join("qga.sock").exists(),
        "no agent channel requested"
    );
    let (qmp, mut events) = QmpClient::connect(&vm.spec.qmp_socket, T)
        .await
        .expect("QMP");

    process::signal(&id, Signal::Term).expect("SIGTERM");
    tokio::time::timeout(T, process::wait_for_exit(&id))
        .await
        .expect("QEMU exits on SIGTERM");
    // QEMU announces the shutdown before closing the socket.
    let event = tokio::time::timeout(T, events.recv())
        .await
        .expect("event in time")
        .expect("event");
    assert_eq!(event.event, "SHUTDOWN");
    tokio::time::timeout(T, qmp.closed()).await.expect("EOF");
    assert!(matches!(
        qmp.execute("query-status", None, T).await,
        Err(hearth_qemu::qmp::QmpError::Disconnected)
    ));
    cleanup.0 = None;
}

#[tokio::test]
async fn a_program_that_never_opens_qmp_is_killed_after_the_timeout() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let fake = tmp.path().join("fake-qemu");
    std::fs::write(&fake, "#!/bin/sh\necho starting >&2\nexec sleep 60\n").expect("write");
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let vm = vm_in(tmp.path(), "slow", Vec::new());
    let err = process::launch(&fake, &vm.spec, &vm.log, Duration::from_millis(500))
        .await
        .expect_err("never ready");
    let LaunchError::NotReady {
        pid, stderr_tail, ..
    } = err
    else {
        panic!("expected NotReady, got {err}");
    };
    assert!(stderr_tail.contains("starting"), "{stderr_tail}");
    let deadline = tokio::time::Instant::now() + T;
    while process::identity_of(pid).is_some_and(|id| process::is_alive(&id)) {
        assert!(tokio::time::Instant::now() < deadline, "still running");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_program_exiting_at_once_is_reported_with_its_output() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let fake = tmp.path().join("fake-qemu");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho 'qemu: cannot do that' >&2\nexit 1\n",
    )
    .expect("write");
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let vm = vm_in(tmp.path(), "fails", Vec::new());
    std::fs::write(&vm.log, "from an earlier run\n").expect("old log");
    match process::launch(&fake, &vm.spec, &vm.log, T).await {
        Err(LaunchError::Exited {
            status,
            stderr_tail,
        }) => {
            assert!(status.contains('1'), "{status}");
            assert_eq!(stderr_tail, "qemu: cannot do that");
        }
        other => panic!("expected Exited, got {other:?}"),
    }
}

#[tokio::test]
async fn a_second_launch_on_a_live_vms_sockets_is_refused_and_leaves_it_alone() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let vm = vm_in(tmp.path(), "twice", Vec::new());
    let id = process::launch(&common::qemu(), &vm.spec, &vm.log, READY)
        .await
        .expect("first start");
    let _cleanup = Cleanup(Some(id.clone()));

    let err = process::launch(&common::qemu(), &vm.spec, &vm.log, READY)
        .await
        .expect_err("sockets are live");
    assert!(
        matches!(&err, LaunchError::SocketInUse { path } if path == &vm.spec.qmp_socket),
        "{err}"
    );
    let (qmp, _events) = QmpClient::connect(&vm.spec.qmp_socket, T)
        .await
        .expect("first VM still reachable");
    assert!(qmp.execute("query-status", None, T).await.is_ok());
}

#[tokio::test]
async fn a_stale_socket_file_from_a_dead_vm_does_not_block_a_restart() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let vm = vm_in(tmp.path(), "restart", Vec::new());
    // What a SIGKILLed QEMU leaves behind: socket files nobody listens on.
    drop(std::os::unix::net::UnixListener::bind(&vm.spec.qmp_socket).expect("bind"));
    let agent = vm.spec.agent_socket.clone().expect("agent");
    drop(std::os::unix::net::UnixListener::bind(&agent).expect("bind"));
    let id = process::launch(&common::qemu(), &vm.spec, &vm.log, READY)
        .await
        .expect("starts despite stale sockets");
    let _cleanup = Cleanup(Some(id.clone()));
    assert!(process::is_alive(&id));
}

#[tokio::test]
async fn a_launch_with_a_pidfile_can_be_found_again_from_the_pidfile_alone() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let vm = vm_in(tmp.path(), "marked", Vec::new());
    let pidfile = tmp.path().join("qemu-launch-1.pid");
    let floor = process::spawn_floor_ticks().expect("floor");
    let mut spawned = None;
    let id = process::launch_with(
        &common::qemu(),
        &vm.spec,
        &vm.log,
        READY,
        Some(&pidfile),
        None,
        |id| spawned = Some(id.clone()),
    )
    .await
    .expect("start");
    let _cleanup = Cleanup(Some(id.clone()));
    assert_eq!(spawned.as_ref(), Some(&id), "after_spawn saw the process");
    let written: u32 = std::fs::read_to_string(&pidfile)
        .expect("the launch wrote the pidfile")
        .trim()
        .parse()
        .expect("a pid");
    assert_eq!(written, id.pid);
    assert_eq!(process::find_launched(&pidfile, floor), Some(id.clone()));
    assert_eq!(process::vm_name_of(&id).as_deref(), Some("marked"));
    // Without the pidfile (a launcher that died before writing it), the
    // process is found by the launch variable in its environment.
    std::fs::remove_file(&pidfile).expect("rm pidfile");
    assert_eq!(process::find_launched(&pidfile, floor), Some(id.clone()));

    process::signal(&id, Signal::Kill).expect("kill");
    tokio::time::timeout(T, process::wait_for_exit(&id))
        .await
        .expect("exits");
    assert_eq!(process::find_launched(&pidfile, floor), None);

    let err = process::launch_with(
        &common::qemu(),
        &vm.spec,
        &vm.log,
        READY,
        Some(Path::new("relative.pid")),
        None,
        |_| panic!("nothing may be spawned"),
    )
    .await
    .expect_err("relative pidfile");
    assert!(matches!(err, LaunchError::Pidfile { .. }), "{err}");
}

/// What QEMU needs of each fd set, checked on the installed release, as the
/// unprivileged user and with disk files only root can open: a chain's
/// backing layer opens from an `O_RDONLY` descriptor alone and the top from
/// an `O_RDWR` one alone; a snapshot overlay handed over at run time
/// (`add_file_node`, `SCM_RIGHTS`) becomes the top with `blockdev-snapshot`,
/// which reopens the old top's format node read-only but leaves its file
/// node on its descriptor; an unused node and its fd set go again with
/// `remove_node`.
#[tokio::test]
async fn chain_layers_and_a_runtime_overlay_each_need_one_descriptor_in_their_nodes_mode() {
    use std::os::unix::fs::PermissionsExt;
    let user = hearth_qemu::handover::QemuUser::lookup("hearth-qemu")
        .expect("the hearth-qemu user: run .ci/install-deps.sh");
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let img = QemuImg::new(common::qemu_img());
    let base = tmp.path().join("base.qcow2");
    let top = tmp.path().join("top.qcow2");
    img.create_blank(&base, 16 << 20).await.expect("base");
    img.create_overlay(&top, &base, "qcow2", None)
        .await
        .expect("top");
    let private = |p: &Path| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600)).expect("chmod 0600")
    };
    private(&base);
    private(&top);
    let mut vm = vm_in(
        tmp.path(),
        "chain",
        vec![DiskAttachment {
            node_name: "disk-root".into(),
            path: top.clone(),
            read_only: false,
            serial: "root".into(),
            backing: vec![hearth_qemu::cmdline::BackingLayer {
                path: base.clone(),
                format: "qcow2".into(),
                real_path: std::fs::canonicalize(&base).expect("canonical base"),
            }],
        }],
    );
    vm.spec.agent_socket = None;
    let id = process::launch_with(
        &common::qemu(),
        &vm.spec,
        &vm.log,
        READY,
        None,
        Some(&user),
        |_| {},
    )
    .await
    .expect("QEMU starts as hearth-qemu");
    let _cleanup = Cleanup(Some(id.clone()));
    let status = std::fs::read_to_string(format!("/proc/{}/status", id.pid)).expect("status");
    assert!(
        status.contains(&format!("Uid:\t{0}\t{0}\t{0}\t{0}", user.uid)),
        "{status}"
    );

    let (qmp, _events) = QmpClient::connect(&vm.spec.qmp_socket, T)
        .await
        .expect("QMP");
    let fdsets = hearth_qemu::qmp::fdsets(&qmp, T).await.expect("fdsets");
    let labels: Vec<&str> = fdsets.iter().map(|(_, l)| l.as_str()).collect();
    for want in [&base, &top, &vm.spec.serial_log] {
        assert!(labels.contains(&want.to_str().expect("utf8")), "{fdsets:?}");
    }
    let raw = qmp.execute("query-fdsets", None, T).await.expect("fdsets");
    for set in raw.as_array().expect("array") {
        assert_eq!(set["fds"].as_array().map(Vec::len), Some(1), "{set}");
    }

    // The runtime overlay: a file the QEMU user cannot open by path.
    let overlay = tmp.path().join("overlay.qcow2");
    img.create_overlay_unopened(&overlay, &top, "qcow2", 16 << 20)
        .await
        .expect("overlay");
    private(&overlay);
    let node = hearth_qemu::qmp::add_file_node(&qmp, "ov1", &overlay, false, T)
        .await
        .expect("overlay node");
    qmp.execute(
        "transaction",
        Some(json!({"actions": [{"type": "blockdev-snapshot",
                                 "data": {"node": "disk-root", "overlay": "ov1"}}]})),
        T,
    )
    .await
    .expect("blockdev-snapshot");
    let block = qmp.execute("query-block", None, T).await.expect("block");
    let inserted = &block[0]["inserted"];
    assert_eq!(inserted["node-name"], "ov1", "{block:#}");
    let fdsets = hearth_qemu::qmp::fdsets(&qmp, T).await.expect("fdsets");
    assert_eq!(
        hearth_qemu::qmp::resolve_filename(inserted["file"].as_str().unwrap_or_default(), &fdsets),
        overlay.to_str().expect("utf8")
    );
    assert!(fdsets.contains(&(node.fdset, overlay.to_string_lossy().into_owned())));
    // The guest's disk works on the new chain: a write goes to the overlay.
    qmp.execute(
        "human-monitor-command",
        Some(json!({"command-line": "qemu-io ov1 \"write -P 0x61 0 4096\""})),
        T,
    )
    .await
    .expect("write through the overlay");
    let names = qmp
        .execute("query-named-block-nodes", Some(json!({"flat": true})), T)
        .await
        .expect("nodes");
    let ro_of = |name: &str| {
        names
            .as_array()
            .and_then(|a| a.iter().find(|n| n["node-name"] == name))
            .map(|n| n["ro"].as_bool())
    };
    // The old top's format node is reopened read-only by the snapshot; its
    // file node (read-write by explicit option) keeps its O_RDWR
    // descriptor, so no O_RDONLY one was needed in its set.
    assert_eq!(ro_of("disk-root"), Some(Some(true)), "{names:#}");
    assert_eq!(ro_of("file-0"), Some(Some(false)), "{names:#}");

    // An unused node goes, and its fd set with it.
    let spare = tmp.path().join("spare.qcow2");
    img.create_overlay_unopened(&spare, &top, "qcow2", 16 << 20)
        .await
        .expect("spare");
    private(&spare);
    hearth_qemu::qmp::add_file_node(&qmp, "spare", &spare, false, T)
        .await
        .expect("spare node");
    hearth_qemu::qmp::remove_node(&qmp, "spare", Some(&spare), T)
        .await
        .expect("removed");
    let fdsets = hearth_qemu::qmp::fdsets(&qmp, T).await.expect("fdsets");
    assert!(
        !fdsets
            .iter()
            .any(|(_, l)| l == spare.to_str().expect("utf8")),
        "{fdsets:?}"
    );
    let names = qmp
        .execute("query-named-block-nodes", Some(json!({"flat": true})), T)
        .await
        .expect("nodes");
    assert!(!names.to_string().contains("\"spare\""), "{names}");
    // Removing it again is fine: a node QEMU does not know counts as gone.
    hearth_qemu::qmp::remove_node(&qmp, "spare", Some(&spare), T)
        .await
        .expect("removed twice");
    // A node in use is refused, and its set stays.
    assert!(
        hearth_qemu::qmp::remove_node(&qmp, "ov1", Some(&overlay), T)
            .await
            .is_err()
    );
    let fdsets = hearth_qemu::qmp::fdsets(&qmp, T).await.expect("fdsets");
    assert!(fdsets.iter().any(|(id, _)| *id == node.fdset), "{fdsets:?}");
    let _ = qmp.execute("quit", None, T).await;
}
