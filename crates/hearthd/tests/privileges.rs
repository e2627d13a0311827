//! QEMU runs unprivileged and reaches only its own files, which hearthd
//! handed over by descriptor: checked from the process table, the
//! descriptor table and a process running as the QEMU user, with two real
//! VMs, one of them snapshotted (so a runtime overlay exists).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

/// The user the harness's daemons run QEMU as (hearthd's default).
const QEMU_USER: &str = "hearth-qemu";

fn id_of(flag: &str) -> u32 {
    let out = Command::new("id")
        .args([flag, QEMU_USER])
        .output()
        .expect("run id");
    assert!(
        out.status.success(),
        "user {QEMU_USER} is missing: run .ci/install-deps.sh (it runs `useradd --system --user-group --no-create-home --shell /usr/sbin/nologin {QEMU_USER}`)"
    );
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("numeric id")
}

/// `Uid:`, `Gid:` and `Groups:` of a process, from /proc/PID/status.
fn creds(pid: u32) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let field = |name: &str| -> Vec<u32> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {status}"))
            .split_whitespace()
            .map(|n| n.parse().expect("id"))
            .collect()
    };
    (field("Uid:"), field("Gid:"), field("Groups:"))
}

/// What the descriptors of a process point to.
fn open_files(pid: u32) -> Vec<PathBuf> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .collect()
}

/// Every layer of a disk's chain, top first, as qemu-img reads it.
fn layers(head: &Path) -> Vec<PathBuf> {
    let out = Command::new("qemu-img")
        .args(["info", "--backing-chain", "-U", "--output=json"])
        .arg(head)
        .output()
        .expect("qemu-img");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let chain: Vec<Value> = serde_json::from_slice(&out.stdout).expect("json");
    chain
        .iter()
        .map(|i| PathBuf::from(i["filename"].as_str().expect("filename")))
        .collect()
}

/// Runs `cmd` as the QEMU user with no supplementary groups (util-linux
/// `setpriv`) and returns (success, stderr).
fn as_qemu_user(cmd: &[&str]) -> (bool, String) {
    let out = Command::new("setpriv")
        .args([
            &format!("--reuid={QEMU_USER}"),
            &format!("--regid={QEMU_USER}"),
            "--clear-groups",
            "--",
        ])
        .args(cmd)
        .output()
        .expect("setpriv (util-linux)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn assert_denied(path: &Path) {
    let (ok, err) = as_qemu_user(&["head", "-c", "1", path.to_str().expect("utf8")]);
    assert!(!ok, "the QEMU user could read {}", path.display());
    assert!(
        err.contains("Permission denied"),
        "{}: {err}",
        path.display()
    );
}

fn disk_head(d: &Daemon, disk: &str) -> PathBuf {
    PathBuf::from(
        d.get_disk(disk).expect("disk")["status"]["path"]
            .as_str()
            .expect("path"),
    )
}

#[test]
fn qemu_runs_as_its_user_holds_only_its_own_files_and_cannot_open_others() {
    let _serial = serial();
    let uid = id_of("-u");
    let gid = id_of("-g");
    let d = Daemon::start();
    let m = manifest(
        &d,
        "vms.yaml",
        &format!(
            "{}---\n{}---\n{}---\n{}",
            overlay_disk_yaml("disk-a"),
            overlay_disk_yaml("disk-b"),
            vm_yaml("vm-a", "AlwaysOn", &["disk-a"], ""),
            vm_yaml("vm-b", "AlwaysOn", &["disk-b"], ""),
        ),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    let a = d.wait_agent("vm-a");
    d.wait_agent("vm-b");

    // A consistent snapshot of vm-a's disk: its old head becomes a backing
    // layer and a new overlay, handed over at run time, is written.
    let (freezes_before, _) = hook_counts(&d, "vm-a");
    let (status, v) = d.request(
        "POST",
        "/v1/apply",
        Some(&json!({"items": [{"apiVersion": "hearth.dev/v1alpha1",
            "kind": "VirtualDiskSnapshot", "metadata": {"name": "snap-a"},
            "spec": {"virtualDiskName": "disk-a", "requiredConsistency": true}}]})),
    );
    assert_eq!(status, 200, "{v}");
    let snap = d.wait_object(
        "virtualdisksnapshots",
        "snap-a",
        "final",
        Duration::from_secs(90),
        |s| s["status"]["phase"] == "Ready" || s["status"]["phase"] == "Failed",
    );
    assert_eq!(snap["status"]["phase"], "Ready", "{snap:#}");
    assert_eq!(snap["status"]["consistent"], true, "{snap:#}");
    assert_eq!(hook_counts(&d, "vm-a").0 - freezes_before, 1, "one freeze");
    // The guest still writes to its disk (now the overlay) and answers.
    d.agent_sh_ok("vm-a", "echo after-snapshot > /data/after.txt && sync");
    assert_eq!(
        d.agent_sh_ok("vm-a", "cat /data/after.txt").trim(),
        "after-snapshot"
    );

    let pid_a = a["status"]["pid"].as_u64().expect("pid") as u32;
    let mut pids = Vec::new();
    for vm in ["vm-a", "vm-b"] {
        let found = d.qemu_pids_of(vm);
        assert_eq!(found.len(), 1, "{vm}: {found:?}");
        pids.push(found[0]);
    }
    assert_eq!(pids[0], pid_a, "the status names the process");

    // Credentials from the process table: the user's uid and gid, real,
    // effective, saved and filesystem, and no supplementary group (TCG:
    // kvm only when KVM is used).
    for pid in &pids {
        let (uids, gids, groups) = creds(*pid);
        assert_eq!(uids, vec![uid; 4], "pid {pid}");
        assert_eq!(gids, vec![gid; 4], "pid {pid}");
        assert_eq!(a["status"]["accelerator"], "tcg");
        assert!(groups.is_empty(), "pid {pid}: {groups:?}");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
        let cap_eff = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .expect("CapEff")
            .trim();
        assert_eq!(cap_eff, "0000000000000000", "no capability");
    }

    // Each QEMU holds every layer of its own disk's chain open (vm-a's:
    // the runtime overlay, the old head, the image below), and none of the
    // other VM's.
    let layers_a = layers(&disk_head(&d, "disk-a"));
    let layers_b = layers(&disk_head(&d, "disk-b"));
    assert_eq!(layers_a.len(), 3, "{layers_a:?}");
    assert_eq!(layers_b.len(), 2, "{layers_b:?}");
    let files_a = open_files(pids[0]);
    let files_b = open_files(pids[1]);
    for l in &layers_a {
        assert!(files_a.contains(l), "vm-a does not hold {l:?}: {files_a:?}");
    }
    for l in &layers_b {
        assert!(files_b.contains(l), "vm-b does not hold {l:?}: {files_b:?}");
    }
    assert!(!files_a.contains(&layers_b[0]), "{files_a:?}");
    assert!(!files_b.contains(&layers_a[0]), "{files_b:?}");

    // A second cut: fd sets do not pile up. Each layer of the chain is held
    // exactly twice (its fd set's descriptor and the node's own copy),
    // however many cuts handed files over.
    let (status, v) = d.request(
        "POST",
        "/v1/apply",
        Some(&json!({"items": [{"apiVersion": "hearth.dev/v1alpha1",
            "kind": "VirtualDiskSnapshot", "metadata": {"name": "snap-a2"},
            "spec": {"virtualDiskName": "disk-a", "requiredConsistency": true}}]})),
    );
    assert_eq!(status, 200, "{v}");
    let snap = d.wait_object(
        "virtualdisksnapshots",
        "snap-a2",
        "final",
        Duration::from_secs(90),
        |s| s["status"]["phase"] == "Ready" || s["status"]["phase"] == "Failed",
    );
    assert_eq!(snap["status"]["phase"], "Ready", "{snap:#}");
    let layers_a = layers(&disk_head(&d, "disk-a"));
    assert_eq!(layers_a.len(), 4, "{layers_a:?}");
    let files_a = open_files(pids[0]);
    for l in &layers_a {
        let held = files_a.iter().filter(|f| *f == l).count();
        assert_eq!(held, 2, "{l:?} held {held} times: {files_a:?}");
    }

    // hearth's directories are root's and private, and everything in the
    // VMs' run and state directories is root's: QEMU made none of it.
    use std::os::unix::fs::MetadataExt;
    for (dir, mode) in [(d.state_dir(), 0o700), (d.run_dir().join("vms"), 0o700)] {
        let meta = std::fs::metadata(&dir).expect("dir");
        assert_eq!(meta.mode() & 0o777, mode, "{}", dir.display());
        assert_eq!(meta.uid(), 0, "{}", dir.display());
    }
    for vm in ["vm-a", "vm-b"] {
        for dir in [
            d.run_dir().join("vms").join(vm),
            d.state_dir().join("vms").join(vm),
        ] {
            for e in std::fs::read_dir(&dir).expect("vm dir").flatten() {
                let meta = e.metadata().expect("meta");
                assert_eq!(meta.uid(), 0, "{} is not root's", e.path().display());
            }
        }
        let log = std::fs::metadata(serial_log(&d, vm)).expect("serial log");
        assert_eq!(log.mode() & 0o777, 0o600);
    }

    // As the QEMU user, by path: no disk layer of either VM opens (the
    // shared base image under the image root aside: it is readable on
    // purpose, like the kernel), and no VM's QMP socket connects.
    for l in layers_a.iter().chain(&layers_b) {
        if l.starts_with(d.state_dir()) {
            assert_denied(l);
            let meta = std::fs::metadata(l).expect("layer");
            assert_eq!((meta.uid(), meta.mode() & 0o777), (0, 0o600), "{l:?}");
        }
    }
    // Nor through another QEMU's descriptors: /proc/PID/fd of a process of
    // the same user can be walked, but reopening a layer checks the file
    // itself, which is root's 0600.
    let fd_of_b = std::fs::read_dir(format!("/proc/{}/fd", pids[1]))
        .expect("fd dir")
        .flatten()
        .find(|e| std::fs::read_link(e.path()).ok().as_ref() == Some(&layers_b[0]))
        .map(|e| e.path())
        .expect("vm-b holds its head");
    assert_denied(&fd_of_b);

    for vm in ["vm-a", "vm-b"] {
        for socket in ["qmp.sock", "agent.sock", "serial.sock"] {
            let socket = d.run_dir().join("vms").join(vm).join(socket);
            assert!(socket.exists(), "{}", socket.display());
            let (ok, err) = as_qemu_user(&[
                "timeout",
                "5",
                "socat",
                "-u",
                &format!("UNIX-CONNECT:{}", socket.display()),
                "STDOUT",
            ]);
            assert!(!ok, "the QEMU user connected to {}", socket.display());
            assert!(err.contains("Permission denied"), "{err}");
        }
        assert_denied(&serial_log(&d, vm));
    }
}

#[test]
fn a_kernel_the_qemu_user_cannot_read_fails_the_start_naming_the_user() {
    let _serial = serial();
    // An image root in a private (0700) directory: hearthd may use it, the
    // QEMU user cannot pass through it, and a kernel goes by path.
    let root = tempfile::tempdir().expect("tempdir");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o700))
            .expect("chmod 0700");
    }
    let g = guest_dir();
    for f in ["vmlinuz", "initrd.img"] {
        std::fs::copy(g.join(f), root.path().join(f)).expect("copy");
    }
    let d = Daemon::start_without_guest(&[root.path()], &[]);
    let (status, v) = d.request(
        "POST",
        "/v1/apply",
        Some(&json!({"items": [{"apiVersion": "hearth.dev/v1alpha1",
            "kind": "VirtualMachine", "metadata": {"name": "hidden"},
            "spec": {"runPolicy": "AlwaysOn", "memory": "128Mi", "disks": [],
                     "boot": {"kernel": root.path().join("vmlinuz"),
                              "initrd": root.path().join("initrd.img"),
                              "cmdline": "console=ttyS0"}}}]})),
    );
    assert_eq!(status, 200, "{v}");
    let v = d.wait_vm("hidden", "a start-up error", Duration::from_secs(60), |v| {
        v["status"]["lastError"]
            .as_str()
            .is_some_and(|e| !e.is_empty())
    });
    let err = v["status"]["lastError"].as_str().unwrap_or_default();
    assert!(err.contains("Permission denied"), "{err}");
    assert!(err.contains("vmlinuz"), "{err}");
    assert!(
        err.contains(&format!("QEMU runs as user \"{QEMU_USER}\"")),
        "{err}"
    );
    assert!(d.qemu_pids().is_empty(), "no QEMU runs");
}
