//! Export of snapshots end to end: a real guest writes, a consistent VM
//! snapshot cuts, the guest writes more; `hearth export` writes standalone
//! images whose content is checked on the host (qemu-img, e2fsprogs), and the
//! exported VM is re-created from its manifest on a second daemon, where it
//! boots and its guest reads the snapshot's data.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::Value;

const SNAP_TIMEOUT: Duration = Duration::from_secs(90);

/// The files hearthd (pid) holds open under its exports directory: the
/// conversion copies, named or already unlinked.
fn export_fds(pid: u32, state: &Path) -> Vec<String> {
    let marker = state.join("exports").to_string_lossy().into_owned();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    fds.flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .map(|t| t.to_string_lossy().into_owned())
        .filter(|t| t.starts_with(&marker))
        .collect()
}

fn named_exports(state: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(state.join("exports"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

fn img_info(path: &Path) -> Value {
    let out = Command::new("qemu-img")
        .args(["info", "--output=json"])
        .arg(path)
        .output()
        .expect("qemu-img");
    assert!(out.status.success(), "qemu-img info {}", path.display());
    serde_json::from_slice(&out.stdout).expect("json")
}

fn compare(a: &Path, b: &Path) -> (bool, String) {
    let out = Command::new("qemu-img")
        .args(["compare", "-U"])
        .arg(a)
        .arg(b)
        .output()
        .expect("qemu-img");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// The `HEX  FILE` line `hearth export` printed for `file`.
fn printed_sha(stdout: &str, file: &Path) -> String {
    let want = file.display().to_string();
    stdout
        .lines()
        .find_map(|l| {
            let (hex, name) = l.split_once("  ")?;
            (name == want).then(|| hex.to_string())
        })
        .unwrap_or_else(|| panic!("no sha256 line for {want} in {stdout:?}"))
}

fn wait_snapshot(d: &Daemon, plural: &str, name: &str) -> Value {
    d.wait_object(plural, name, "Ready or Failed", SNAP_TIMEOUT, |v| {
        matches!(v["status"]["phase"].as_str(), Some("Ready" | "Failed"))
    })
}

fn guest_sha(d: &Daemon, vm: &str, file: &str) -> String {
    d.agent_sh_ok(vm, &format!("sha256sum {file}"))
        .split_whitespace()
        .next()
        .expect("digest")
        .to_string()
}

fn text_sha(text: &str) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("t");
    std::fs::write(&p, text).expect("write");
    sha256_file(&p)
}

#[test]
fn exported_snapshots_hold_the_cut_and_the_exported_vm_boots_elsewhere() {
    let _serial = serial();
    let a = Daemon::start();
    let state = a.state_dir();
    let hearthd = a.child.as_ref().expect("hearthd").id();
    let root = tempfile::Builder::new()
        .prefix("hearth-export-")
        .tempdir()
        .expect("tempdir");
    let out = root.path().join("files");
    std::fs::create_dir_all(&out).expect("mkdir");

    // d2 is 1 GiB so that its raw export streams long enough to be cut off.
    let big = format!("{}  size: 1Gi\n", overlay_disk_yaml("d2"));
    apply_manifest(
        &a,
        "src.yaml",
        &format!(
            "{}---\n{big}---\n{}",
            overlay_disk_yaml("d1"),
            vm_yaml("src", "AlwaysOn", &["d1", "d2"], "")
        ),
    );
    a.wait_agent("src");
    let before: String = (0..500)
        .map(|i| format!("line {i} written before the snapshot\n"))
        .collect();
    let before2 = "on the second disk, before the snapshot\n";
    a.agent_sh_ok(
        "src",
        &format!(
            "printf '%s' '{before}' > /data/before.txt && printf '%s' '{before2}' > /mnt/vdb/before2.txt && sync"
        ),
    );
    let sha_in_guest = guest_sha(&a, "src", "/data/before.txt");
    assert_eq!(
        sha_in_guest,
        text_sha(&before),
        "the guest wrote what we sent"
    );

    let (status, v) = a.apply_json(vec![VmSnapshot::of("pre", "src").json()]);
    assert_eq!(status, 200, "{v}");
    let pre = wait_snapshot(&a, "virtualmachinesnapshots", "pre");
    assert_eq!(pre["status"]["phase"], "Ready", "{pre:#}");
    assert_eq!(
        pre["status"]["virtualMachineSpec"]["disks"]
            .as_array()
            .map(Vec::len),
        Some(2),
        "the VM snapshot records the VM's spec: {pre:#}"
    );
    for child in ["pre-d1", "pre-d2"] {
        let c = wait_snapshot(&a, "virtualdisksnapshots", child);
        assert_eq!(c["status"]["consistent"], true, "{c:#}");
    }
    // After the cut: must not be in any export.
    a.agent_sh_ok(
        "src",
        "echo 'written after the snapshot' >> /data/before.txt && echo after > /data/after.txt && sync",
    );

    // ---- bad input: clear errors, nothing written.
    let nope = out.join("nope.qcow2");
    let err = a.cli_err(&["export", "snapshot", "nope", "-o", nope.to_str().unwrap()]);
    assert!(
        err.contains("\"nope\"") && err.contains("not found"),
        "{err}"
    );
    let (status, v) = a.request("GET", "/v1/virtualdisksnapshots/nope/export", None);
    assert_eq!(status, 404, "{v}");
    let (status, v) = a.request(
        "GET",
        "/v1/virtualdisksnapshots/..%2F..%2Fescape/export",
        None,
    );
    assert_eq!(status, 404, "{v}");
    let err = a.cli_err(&[
        "export",
        "snapshot",
        "pre-d1",
        "-o",
        nope.to_str().unwrap(),
        "--format",
        "vmdk",
    ]);
    assert!(err.contains("vmdk") && err.contains("qcow2"), "{err}");
    let (status, v) = a.request(
        "GET",
        "/v1/virtualdisksnapshots/pre-d1/export?format=vmdk",
        None,
    );
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"].as_str().unwrap_or_default().contains("vmdk"),
        "{v}"
    );
    // Failed: its disk does not exist. Pending: its disk waits for an image.
    let (status, v) = a.apply_json(vec![
        DiskSnapshot::of("broken", "no-such-disk").json(),
        Disk::from_virtual_image("waiting", "no-such-image").json(),
        DiskSnapshot::of("early", "waiting").json(),
    ]);
    assert_eq!(status, 200, "{v}");
    let broken = wait_snapshot(&a, "virtualdisksnapshots", "broken");
    assert_eq!(broken["status"]["phase"], "Failed", "{broken:#}");
    let err = a.cli_err(&["export", "snapshot", "broken", "-o", nope.to_str().unwrap()]);
    assert!(
        err.contains("\"broken\"") && err.contains("Failed") && err.contains("not Ready"),
        "{err}"
    );
    let (_, early) = a.request("GET", "/v1/virtualdisksnapshots/early", None);
    assert_eq!(
        early["status"]["phase"].as_str().unwrap_or("Pending"),
        "Pending",
        "{early:#}"
    );
    let err = a.cli_err(&["export", "snapshot", "early", "-o", nope.to_str().unwrap()]);
    assert!(
        err.contains("\"early\"") && err.contains("Pending"),
        "{err}"
    );
    let kept = out.join("kept.qcow2");
    std::fs::write(&kept, b"keep me").expect("write");
    let err = a.cli_err(&["export", "snapshot", "pre-d1", "-o", kept.to_str().unwrap()]);
    assert!(err.contains("exists") && err.contains("--force"), "{err}");
    assert_eq!(std::fs::read(&kept).expect("read"), b"keep me");
    assert!(!nope.exists());
    assert_eq!(
        std::fs::read_dir(&out).expect("list").count(),
        1,
        "only the file that was there"
    );

    // ---- qcow2 and raw exports of pre-d1.
    let q = out.join("d1.qcow2");
    let r = out.join("d1.raw");
    let run = a.cli(&["export", "snapshot", "pre-d1", "-o", q.to_str().unwrap()]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    assert_eq!(printed_sha(&stdout, &q), sha256_file(&q));
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    // Not a terminal: no bar, one final line.
    let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
    assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
    assert!(
        stderr.starts_with("exported snapshot/pre-d1 to ") && stderr.contains("(qcow2, "),
        "{stderr}"
    );
    let stdout = a.cli_ok(&[
        "export",
        "snapshot",
        "pre-d1",
        "-o",
        r.to_str().unwrap(),
        "--format",
        "raw",
    ]);
    assert_eq!(printed_sha(&stdout, &r), sha256_file(&r));
    let qi = img_info(&q);
    assert_eq!(qi["format"], "qcow2", "{qi:#}");
    assert!(qi.get("backing-filename").is_none(), "standalone: {qi:#}");
    assert_eq!(qi["virtual-size"], 64 << 20, "{qi:#}");
    let ri = img_info(&r);
    assert_eq!(ri["format"], "raw", "{ri:#}");
    let raw_meta = std::fs::metadata(&r).expect("raw");
    assert_eq!(raw_meta.len(), 64 << 20);
    assert!(
        std::os::unix::fs::MetadataExt::blocks(&raw_meta) * 512 < 16 << 20,
        "the raw file is written sparse: {} blocks",
        std::os::unix::fs::MetadataExt::blocks(&raw_meta)
    );
    let (same, text) = compare(&q, &r);
    assert!(same, "the qcow2 and raw exports differ: {text}");
    // Against the snapshot's own chain: the layer the cut froze is right
    // below the disk's head now.
    let head = PathBuf::from(
        a.get_disk("d1").expect("d1")["status"]["path"]
            .as_str()
            .expect("head path"),
    );
    let chain = backing_chain(&head);
    assert!(chain.len() >= 2, "{chain:?}");
    let (same, text) = compare(&chain[1], &q);
    assert!(
        same,
        "the export differs from the snapshot's layer chain: {text}"
    );
    let (same, _) = compare(&head, &q);
    assert!(!same, "the disk as it is now has the later writes");
    let unpacked = root.path().join("d1-from-qcow2.raw");
    to_raw(&q, &unpacked);
    for image in [&unpacked, &r] {
        assert_clean_ext4(image, "exported pre-d1");
        let got = debugfs_cat(image, "/before.txt");
        assert_eq!(
            text_sha(&got),
            sha_in_guest,
            "{}: the snapshot's data",
            image.display()
        );
        assert!(!got.contains("after the snapshot"), "{}", image.display());
        assert_eq!(debugfs_cat(image, "/after.txt"), "", "{}", image.display());
    }
    // --force replaces an existing file.
    a.cli_ok(&[
        "export",
        "snapshot",
        "pre-d1",
        "-o",
        kept.to_str().unwrap(),
        "--force",
    ]);
    assert_eq!(sha256_file(&kept), sha256_file(&q));
    assert!(
        named_exports(&state).is_empty(),
        "{:?}",
        named_exports(&state)
    );
    assert!(export_fds(hearthd, &state).is_empty());

    // ---- a client that goes away mid-stream: hearthd lets the copy go.
    let mut s = UnixStream::connect(a.socket()).expect("connect");
    write!(
        s,
        "GET /v1/virtualdisksnapshots/pre-d2/export?format=raw HTTP/1.1\r\nHost: hearthd\r\n\r\n"
    )
    .expect("send");
    let mut got = vec![0u8; 1 << 20];
    s.read_exact(&mut got).expect("the first MiB");
    let head = String::from_utf8_lossy(&got[..512]).to_string();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("content-length: 1073741824"), "{head}");
    let open = export_fds(hearthd, &state);
    assert_eq!(open.len(), 1, "hearthd streams from one file: {open:?}");
    assert!(open[0].ends_with("(deleted)"), "already unlinked: {open:?}");
    assert!(named_exports(&state).is_empty());
    drop(s);
    wait_until("hearthd closes the copy", Duration::from_secs(20), || {
        export_fds(hearthd, &state).is_empty()
    });

    // ---- a CLI killed mid-stream leaves no file, named or not.
    let killed_dir = out.join("killed");
    std::fs::create_dir_all(&killed_dir).expect("mkdir");
    let target = killed_dir.join("d2.raw");
    let mut child = a
        .cli_command(
            &[
                "export",
                "snapshot",
                "pre-d2",
                "--format",
                "raw",
                "-o",
                target.to_str().unwrap(),
            ],
            Stdio::null(),
        )
        .spawn()
        .expect("hearth export");
    wait_until("the stream starts", Duration::from_secs(60), || {
        !export_fds(hearthd, &state).is_empty()
    });
    child.kill().expect("kill");
    let status = child.wait().expect("wait");
    assert!(!status.success(), "killed before it finished");
    assert_eq!(
        std::fs::read_dir(&killed_dir).expect("list").count(),
        0,
        "nothing left where the file was to be"
    );
    wait_until("hearthd closes the copy", Duration::from_secs(20), || {
        export_fds(hearthd, &state).is_empty()
    });
    assert!(named_exports(&state).is_empty());

    // ---- a client that goes away while hearthd converts: the same. A disk
    // no VM uses, with data written into its layer on the host so that the
    // conversion takes a while.
    apply_manifest(&a, "big.yaml", &Disk::blank("big", "1Gi").yaml());
    let big = a.wait_object("virtualdisks", "big", "Ready", SNAP_TIMEOUT, |v| {
        v["status"]["phase"] == "Ready"
    });
    let big_head = big["status"]["path"].as_str().expect("path").to_string();
    let filled = Command::new("qemu-io")
        .args(["-f", "qcow2", "-c", "write -P 0x5a 0 768M", &big_head])
        .output()
        .expect("qemu-io (apt-get install qemu-utils)");
    assert!(
        filled.status.success(),
        "{}",
        String::from_utf8_lossy(&filled.stderr)
    );
    let (status, v) = a.apply_json(vec![DiskSnapshot::of("big-snap", "big").json()]);
    assert_eq!(status, 200, "{v}");
    let snap = wait_snapshot(&a, "virtualdisksnapshots", "big-snap");
    assert_eq!(snap["status"]["phase"], "Ready", "{snap:#}");
    let mut s = UnixStream::connect(a.socket()).expect("connect");
    write!(
        s,
        "GET /v1/virtualdisksnapshots/big-snap/export?format=raw HTTP/1.1\r\nHost: hearthd\r\n\r\n"
    )
    .expect("send");
    wait_until("the conversion runs", Duration::from_secs(30), || {
        named_exports(&state)
            .first()
            .is_some_and(|p| !converters_of(p).is_empty())
    });
    let converting = named_exports(&state).remove(0);
    drop(s);
    wait_until("qemu-img is gone", Duration::from_secs(60), || {
        converters_of(&converting).is_empty()
    });
    wait_until("hearthd holds no copy", Duration::from_secs(20), || {
        named_exports(&state).is_empty() && export_fds(hearthd, &state).is_empty()
    });

    // ---- the VM snapshot: an image per disk and the manifest.
    let vmdir = root.path().join("pre");
    let stdout = a.cli_ok(&["export", "vmsnapshot", "pre", "-o", vmdir.to_str().unwrap()]);
    let manifest = vmdir.join("virtualmachine.yaml");
    for f in ["d1.qcow2", "d2.qcow2", "virtualmachine.yaml"] {
        let p = vmdir.join(f);
        assert_eq!(printed_sha(&stdout, &p), sha256_file(&p), "{f}");
    }
    assert_eq!(std::fs::read_dir(&vmdir).expect("list").count(), 3);
    assert_eq!(
        sha256_file(&vmdir.join("d1.qcow2")),
        sha256_file(&q),
        "same export"
    );
    let text = std::fs::read_to_string(&manifest).expect("manifest");
    let objects = hearth_api::parse_documents(&text, "virtualmachine.yaml").expect("parses");
    let names: Vec<String> = objects.iter().map(|o| o.display_name()).collect();
    assert_eq!(names.len(), 5, "{names:?}\n{text}");
    let err = a.cli_err(&["export", "vmsnapshot", "pre", "-o", vmdir.to_str().unwrap()]);
    assert!(err.contains("exists") && err.contains("--force"), "{err}");
    assert!(named_exports(&state).is_empty());
    // Its VM goes with it (memory for the second one).
    drop(a);

    // ---- re-created on a second daemon from the manifest alone.
    let b = Daemon::start_without_guest(&[&guest_dir(), root.path()], &[]);
    b.cli_ok(&["apply", "-f", manifest.to_str().unwrap()]);
    for image in ["pre-d1", "pre-d2"] {
        let v = b.wait_object(
            "virtualimages",
            image,
            "Ready",
            Duration::from_secs(60),
            |v| v["status"]["phase"] == "Ready",
        );
        assert_eq!(v["status"]["format"], "qcow2", "{v:#}");
    }
    b.wait_agent("src");
    assert_eq!(
        guest_sha(&b, "src", "/data/before.txt"),
        sha_in_guest,
        "the re-created VM's guest reads the snapshot's data"
    );
    let (code, _) = b.agent_sh("src", "test -e /data/after.txt");
    assert_ne!(code, 0, "nothing written after the snapshot");
    assert_eq!(b.agent_sh_ok("src", "cat /mnt/vdb/before2.txt"), before2);
}
