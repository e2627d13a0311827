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
        Some(&json!({"items": [DiskSnapshot::of("snap-a", "disk-a").json()]})),
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
    let layers_a = layers(&d.disk_path("disk-a"));
    let layers_b = layers(&d.disk_path("disk-b"));
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
        Some(&json!({"items": [DiskSnapshot::of("snap-a2", "disk-a").json()]})),
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
    let layers_a = layers(&d.disk_path("disk-a"));
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
        Some(&json!({"items": [Vm::new("hidden")
            .always_on()
            .memory("128Mi")
            .boot(
                &root.path().join("vmlinuz"),
                Some(&root.path().join("initrd.img")),
                "console=ttyS0"
            )
            .json()]})),
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

/// A loop device over a file of the test's own, detached when dropped.
struct LoopDevice(PathBuf);

impl LoopDevice {
    fn attach(file: &Path) -> LoopDevice {
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(file)
            .output()
            .expect("losetup (apt-get install util-linux)");
        assert!(
            out.status.success(),
            "losetup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        LoopDevice(PathBuf::from(
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        ))
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

fn utf8(p: &Path) -> &str {
    p.to_str().expect("utf8")
}

/// A change made to the files on the host.
type Step = Box<dyn Fn()>;

/// One way to change a base image after its disk was made, what it makes
/// the base point at, and how to undo it.
struct Attack {
    disk: &'static str,
    base: PathBuf,
    target: PathBuf,
    attack: Step,
    undo: Step,
}

#[test]
fn a_base_image_changed_after_its_disk_was_made_is_refused_at_start_and_qemu_gets_nothing() {
    let _serial = serial();
    let root = tempfile::Builder::new()
        .prefix("hearth-bases-")
        .tempdir()
        .expect("tempdir");
    let outside = tempfile::Builder::new()
        .prefix("hearth-outside-")
        .tempdir()
        .expect("tempdir");
    let root = root.path().to_path_buf();
    let out = outside.path().to_path_buf();
    // What the attacks point at, outside every image root: a file, a
    // block device, and a qcow2 image (so a follower of the link sees an
    // image it can open).
    let mut marked = vec![0u8; 1 << 20];
    marked[..20].copy_from_slice(b"HOST-SECRET-20-BYTES");
    let secret = out.join("secret.raw");
    std::fs::write(&secret, &marked).expect("secret");
    std::fs::write(out.join("device.img"), &marked).expect("device file");
    let device = LoopDevice::attach(&out.join("device.img"));
    let foreign = out.join("foreign.qcow2");
    run_ok(
        "qemu-img",
        &[
            "convert",
            "-q",
            "-O",
            "qcow2",
            utf8(&secret),
            utf8(&foreign),
        ],
    );
    let elsewhere = out.join("elsewhere");
    std::fs::create_dir(&elsewhere).expect("mkdir");
    std::fs::copy(&foreign, elsewhere.join("base.qcow2")).expect("copy");

    // Each disk has a base of its own, a copy of the guest's data disk.
    let data = guest_dir().join("data.qcow2");
    let mut attacks = Vec::new();
    for disk in ["rebased-device", "rebased-file", "linked", "moved-dir"] {
        let dir = root.join(disk);
        std::fs::create_dir(&dir).expect("mkdir");
        let base = dir.join("base.qcow2");
        std::fs::copy(&data, &base).expect("copy base");
        let (target, attack, undo): (PathBuf, Step, Step) = match disk {
            "rebased-device" | "rebased-file" => {
                let target = if disk == "rebased-device" {
                    device.0.clone()
                } else {
                    secret.clone()
                };
                let (b, t) = (base.clone(), target.clone());
                let b2 = base.clone();
                (
                    target,
                    Box::new(move || {
                        run_ok(
                            "qemu-img",
                            &[
                                "rebase",
                                "-u",
                                "-f",
                                "qcow2",
                                "-b",
                                utf8(&t),
                                "-F",
                                "raw",
                                utf8(&b),
                            ],
                        )
                    }),
                    Box::new(move || {
                        run_ok(
                            "qemu-img",
                            &["rebase", "-u", "-f", "qcow2", "-b", "", utf8(&b2)],
                        )
                    }),
                )
            }
            "linked" => {
                let (b, f, kept) = (base.clone(), foreign.clone(), dir.join("base.kept"));
                let (b2, kept2) = (base.clone(), kept.clone());
                (
                    foreign.clone(),
                    Box::new(move || {
                        std::fs::rename(&b, &kept).expect("keep");
                        std::os::unix::fs::symlink(&f, &b).expect("symlink");
                    }),
                    Box::new(move || {
                        std::fs::remove_file(&b2).expect("unlink");
                        std::fs::rename(&kept2, &b2).expect("back");
                    }),
                )
            }
            _ => {
                let (d, e, kept) = (dir.clone(), elsewhere.clone(), root.join("moved-dir.kept"));
                let (d2, kept2) = (dir.clone(), kept.clone());
                (
                    elsewhere.join("base.qcow2"),
                    Box::new(move || {
                        std::fs::rename(&d, &kept).expect("keep");
                        std::os::unix::fs::symlink(&e, &d).expect("symlink");
                    }),
                    Box::new(move || {
                        std::fs::remove_file(&d2).expect("unlink");
                        std::fs::rename(&kept2, &d2).expect("back");
                    }),
                )
            }
        };
        attacks.push(Attack {
            disk,
            base,
            target,
            attack,
            undo,
        });
    }

    let d = Daemon::start_without_guest(&[&guest_dir(), &root], &[]);
    let mut yaml = String::new();
    for a in &attacks {
        yaml.push_str(&format!(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata:\n  name: {}\nspec:\n  source:\n    image: {}\n---\n",
            a.disk,
            a.base.display()
        ));
    }
    let names: Vec<&str> = attacks.iter().map(|a| a.disk).collect();
    yaml.push_str(&vm_yaml("guarded", "Manual", &names, ""));
    let m = manifest(&d, "guarded.yaml", &yaml);
    d.cli_ok(&["apply", "-f", utf8(&m)]);
    for a in &attacks {
        d.wait_object(
            "virtualdisks",
            a.disk,
            "Ready",
            Duration::from_secs(60),
            |v| v["status"]["phase"] == "Ready",
        );
    }
    d.wait_phase("guarded", "Stopped", Duration::from_secs(30));

    // Every base changed while the VM is stopped; then it is started. Each
    // start stops at the first disk whose base is not what it was made
    // from; that one is put back, and the next start finds the next.
    for a in &attacks {
        (a.attack)();
    }
    let targets: Vec<PathBuf> = attacks.iter().map(|a| a.target.clone()).collect();
    let holding_a_target = |d: &Daemon| -> Option<String> {
        d.qemu_pids().into_iter().find_map(|pid| {
            let files = open_files(pid);
            targets
                .iter()
                .find(|t| files.contains(t))
                .map(|t| format!("QEMU {pid} holds {} among {files:?}", t.display()))
        })
    };
    for (i, a) in attacks.iter().enumerate() {
        d.cli_ok(&["start", "guarded"]);
        let mut v = Value::Null;
        let failed = eventually_every(Duration::from_millis(200), Duration::from_secs(60), || {
            if let Some(held) = holding_a_target(&d) {
                panic!("{}: the changed base reached QEMU: {held}", a.disk);
            }
            v = d.get_vm("guarded").expect("vm");
            v["status"]["lastError"]
                .as_str()
                .unwrap_or_default()
                .contains(&format!("spec.disks[{i}]"))
        });
        assert!(
            failed,
            "{}: the VM did not fail naming the disk: {v:#}",
            a.disk
        );
        let err = v["status"]["lastError"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert_eq!(v["status"]["phase"], "Failed", "{v:#}");
        eprintln!("{}: {err}", a.disk);
        assert!(
            err.contains(&format!("VirtualDisk \"{}\"", a.disk)) && err.contains(utf8(&a.base)),
            "{}: the reason names the disk and its base: {err}",
            a.disk
        );
        assert!(
            d.qemu_pids_of("guarded").is_empty(),
            "{}: no QEMU was started",
            a.disk
        );
        (a.undo)();
    }

    // Everything as it was made: the VM starts, and its QEMU holds each
    // base and none of the targets.
    d.cli_ok(&["start", "guarded"]);
    let v = d.wait_phase("guarded", "Running", Duration::from_secs(90));
    let pid = v["status"]["pid"].as_u64().expect("pid") as u32;
    let files = open_files(pid);
    for a in &attacks {
        let real = std::fs::canonicalize(&a.base).expect("base");
        assert!(
            files.contains(&real),
            "QEMU does not hold {real:?}: {files:?}"
        );
        assert!(!files.contains(&a.target), "{files:?}");
    }
    assert!(holding_a_target(&d).is_none());
}

/// `sqlite3 DB SQL`: the rows it prints.
fn sqlite(db: &Path, sql: &str) -> String {
    let out = Command::new("sqlite3")
        .arg(db)
        .arg(sql)
        .output()
        .expect("sqlite3 (apt-get install sqlite3)");
    assert!(
        out.status.success(),
        "sqlite3 {sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A disk made before its base was recorded (the row removed while the
/// daemon is down): the first start takes the base from the bottom layer's
/// header, which hearthd wrote, checks it like a recorded one, and records
/// it.
#[test]
fn a_disk_without_a_recorded_base_is_checked_by_the_base_its_layer_names_and_then_recorded() {
    let _serial = serial();
    let root = tempfile::Builder::new()
        .prefix("hearth-bases-")
        .tempdir()
        .expect("tempdir");
    let outside = tempfile::Builder::new()
        .prefix("hearth-outside-")
        .tempdir()
        .expect("tempdir");
    let base = root.path().join("base.qcow2");
    std::fs::copy(guest_dir().join("data.qcow2"), &base).expect("copy base");
    let foreign = outside.path().join("foreign.qcow2");
    std::fs::copy(guest_dir().join("data.qcow2"), &foreign).expect("copy foreign");
    let mut d = Daemon::start_without_guest(&[&guest_dir(), root.path()], &[]);
    let m = manifest(
        &d,
        "old.yaml",
        &format!(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata:\n  name: old\nspec:\n  source:\n    image: {}\n---\n{}",
            base.display(),
            vm_yaml("older", "Manual", &["old"], "")
        ),
    );
    d.cli_ok(&["apply", "-f", utf8(&m)]);
    d.wait_object(
        "virtualdisks",
        "old",
        "Ready",
        Duration::from_secs(60),
        |v| v["status"]["phase"] == "Ready",
    );
    let db = d.state_dir().join("hearth.db");
    let recorded = format!(
        "{}|qcow2",
        std::fs::canonicalize(&base).expect("base").display()
    );
    let rows = "SELECT path || '|' || format FROM layer_source_images";
    assert_eq!(sqlite(&db, rows), recorded);
    d.kill();
    sqlite(&db, "DELETE FROM layer_source_images");
    d.spawn();

    // The base swapped for a link: refused although nothing was recorded.
    let kept = root.path().join("base.kept");
    std::fs::rename(&base, &kept).expect("keep");
    std::os::unix::fs::symlink(&foreign, &base).expect("symlink");
    d.cli_ok(&["start", "older"]);
    let v = d.wait_vm("older", "refused", Duration::from_secs(60), |v| {
        v["status"]["lastError"]
            .as_str()
            .is_some_and(|e| e.contains("VirtualDisk \"old\""))
    });
    let err = v["status"]["lastError"].as_str().unwrap_or_default();
    assert!(
        err.contains(utf8(&base)) && err.contains("symbolic link"),
        "{err}"
    );
    assert!(d.qemu_pids_of("older").is_empty());
    assert_eq!(sqlite(&db, rows), "", "a refused base is not recorded");

    // Put back: it starts, and the base is recorded again.
    std::fs::remove_file(&base).expect("unlink");
    std::fs::rename(&kept, &base).expect("back");
    d.cli_ok(&["start", "older"]);
    let v = d.wait_phase("older", "Running", Duration::from_secs(90));
    let pid = v["status"]["pid"].as_u64().expect("pid") as u32;
    let real = std::fs::canonicalize(&base).expect("base");
    assert!(open_files(pid).contains(&real));
    assert!(!open_files(pid).contains(&foreign));
    assert_eq!(sqlite(&db, rows), recorded);
}
