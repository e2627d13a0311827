//! VirtualImage end to end: the real hearthd imports images from a real HTTP
//! server on 127.0.0.1 (written here: it serves, answers 404, hangs, or cuts
//! a body short) and from files, with real qemu-img, and makes disks from
//! them. No VM boots.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::http::{Behaviour, Server};
use common::{
    Daemon, Disk, DiskSnapshot, Image, Manifest, ObjectBuilder, eventually, make_qcow2, run_ok,
};
use hearth_test_support::oci::umoci_image;
use serde_json::{Value, json};

const IMPORT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------- images

/// A raw 2 MiB disk with a DOS partition table: one Linux partition.
fn make_raw_mbr(path: &Path) -> Vec<u8> {
    let mut disk = vec![0u8; 2 << 20];
    let entry = &mut disk[446..462];
    entry[4] = 0x83; // Linux
    entry[8..12].copy_from_slice(&2048u32.to_le_bytes()); // first sector
    entry[12..16].copy_from_slice(&2048u32.to_le_bytes()); // sectors
    disk[510] = 0x55;
    disk[511] = 0xaa;
    disk[1 << 20..(1 << 20) + 4].copy_from_slice(b"data");
    std::fs::write(path, &disk).expect("write raw");
    disk
}

fn sha256_of(bytes: &[u8]) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("b");
    std::fs::write(&p, bytes).expect("write");
    common::sha256_file(&p)
}

fn http_image(name: &str, url: &str, sha256: &str) -> Value {
    Image::http(name, url, sha256).json()
}

fn file_image(name: &str, path: &Path) -> Value {
    Image::file(name, path).json()
}

fn disk_from(name: &str, image: &str, size: Option<&str>) -> Value {
    let mut spec = json!({"source": {"virtualImage": image}});
    if let Some(s) = size {
        spec["size"] = json!(s);
    }
    json!({
        "apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk",
        "metadata": {"name": name}, "spec": spec
    })
}

fn wait_image_phase(d: &Daemon, name: &str, phase: &str) -> Value {
    d.wait_image_phase(name, phase, IMPORT)
}

/// Waits for an event of a VirtualImage (it is recorded after the status
/// that it reports).
fn wait_event(d: &Daemon, name: &str, reason: &str) {
    common::wait_until(&format!("{name}: event {reason}"), IMPORT, || {
        d.event_reasons("VirtualImage", name)
            .iter()
            .any(|r| r == reason)
    });
}

fn wait_failed(d: &Daemon, name: &str, reason: &str) -> Value {
    let v = wait_image_phase(d, name, "Failed");
    assert_eq!(v["status"]["reason"], reason, "{v:#}");
    v
}

/// Every file in the daemon's image store, hidden ones included.
fn store_files(d: &Daemon) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(d.state_dir().join("images"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn qemu_img_info(path: &Path) -> Value {
    let out = Command::new("qemu-img")
        .args(["info", "-U", "--output=json"])
        .arg(path)
        .output()
        .expect("qemu-img");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

fn delete(d: &Daemon, plural: &str, name: &str) -> (u16, Value) {
    d.request("DELETE", &format!("/v1/{plural}/{name}"), None)
}

/// Deletes an object (the API must accept it) and waits until it is gone.
fn delete_and_wait(d: &Daemon, plural: &str, name: &str) {
    let (status, v) = delete(d, plural, name);
    assert_eq!(status, 200, "DELETE {plural}/{name}: {v}");
    d.wait_gone(plural, name, IMPORT);
}

/// A directory for source files, also the daemon's image root.
fn roots() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("hearth-images-src-")
        .tempdir()
        .expect("tempdir")
}

// ---------------------------------------------------------------- tests

#[test]
fn an_http_image_is_verified_stored_by_digest_and_disks_grow_from_it() {
    let src = roots();
    let server = Server::start();
    let qcow2 = make_qcow2(&src.path().join("good.qcow2"));
    let digest = sha256_of(&qcow2);
    server.route("/good.qcow2", Behaviour::Serve(qcow2.clone()));
    let d = Daemon::start_without_guest(&[src.path()], &[]);

    // A disk smaller than the image, applied before the image is Ready,
    // fails once the image's size is known.
    d.apply(vec![
        http_image("base", &server.url("/good.qcow2"), &digest),
        disk_from("tiny", "base", Some("2Mi")),
    ]);
    let image = wait_image_phase(&d, "base", "Ready");
    let st = &image["status"];
    assert_eq!(st["format"], "qcow2", "{image:#}");
    assert_eq!(st["size"], qcow2.len() as u64);
    assert_eq!(st["virtualSize"], 4u64 << 20);
    assert_eq!(st["digest"], format!("sha256:{digest}"));
    assert_eq!(st["progress"], "100%");
    let path = PathBuf::from(st["path"].as_str().expect("path"));
    assert_eq!(
        path,
        d.state_dir()
            .join("images")
            .join(format!("sha256-{digest}.qcow2"))
    );
    assert_eq!(
        common::sha256_file(&path),
        digest,
        "the stored file is what was served"
    );
    assert_eq!(store_files(&d), vec![format!("sha256-{digest}.qcow2")]);
    let reasons = d.event_reasons("VirtualImage", "base");
    assert!(
        reasons.contains(&"ImportStarted".to_string()) && reasons.contains(&"Imported".to_string()),
        "{reasons:?}"
    );

    let tiny = d.wait_object("virtualdisks", "tiny", "Failed", IMPORT, |v| {
        v["status"]["phase"] == "Failed"
    });
    let err = tiny["status"]["lastError"].as_str().unwrap_or_default();
    assert!(
        err.contains("spec.size")
            && err.contains(&(2u64 << 20).to_string())
            && err.contains(&(4u64 << 20).to_string()),
        "{err}"
    );
    // With the image Ready, a too-small disk is refused at apply time.
    let (status, v) = d.apply_json(vec![disk_from("small", "base", Some("1Mi"))]);
    assert_eq!(status, 400, "{v}");
    let msg = v["error"].as_str().unwrap_or_default();
    assert!(
        msg.contains("spec.size") && msg.contains("virtualSize 4194304"),
        "{msg}"
    );

    // A disk twice the image's size: an overlay whose backing file is the
    // stored image.
    d.apply(vec![disk_from("web-root", "base", Some("8Mi"))]);
    let disk = d.wait_object("virtualdisks", "web-root", "Ready", IMPORT, |v| {
        v["status"]["phase"] == "Ready"
    });
    let disk_path = PathBuf::from(disk["status"]["path"].as_str().expect("disk path"));
    let info = qemu_img_info(&disk_path);
    assert_eq!(info["backing-filename"], path.to_str().expect("utf8"));
    assert_eq!(info["virtual-size"], 8u64 << 20);
    assert_eq!(info["backing-filename-format"], "qcow2");
    // The image was only read.
    assert_eq!(common::sha256_file(&path), digest);

    d.wait_object("virtualimages", "base", "usedBy both disks", IMPORT, |v| {
        v["status"]["usedBy"] == json!(["tiny", "web-root"])
    });
    // In use: refused, naming the disks.
    let (status, v) = delete(&d, "virtualimages", "base");
    assert_eq!(status, 409, "{v}");
    let msg = v["error"].as_str().unwrap_or_default();
    assert!(
        msg.contains("\"web-root\"") && msg.contains("\"tiny\""),
        "{msg}"
    );
    let out = d.cli(&["delete", "image", "base"]);
    assert!(!out.status.success(), "the CLI must fail too");
    assert!(path.is_file());

    for disk in ["tiny", "web-root"] {
        delete_and_wait(&d, "virtualdisks", disk);
    }
    delete_and_wait(&d, "virtualimages", "base");
    assert!(!path.exists(), "the image file goes with its last user");
    assert_eq!(store_files(&d), Vec::<String>::new());
}

#[test]
fn failed_downloads_say_why_leave_no_file_and_are_retried_until_the_server_is_fixed() {
    let src = roots();
    let server = Server::start();
    let qcow2 = make_qcow2(&src.path().join("good.qcow2"));
    let digest = sha256_of(&qcow2);
    // First retry 2 s after a failure: the store is looked at in between.
    let d = Daemon::start_without_guest(&[src.path()], &["--image-read-timeout-seconds", "2"]);

    let truncated_says = qcow2.len().to_string();
    let cases: Vec<(&str, Behaviour, &str, &str)> = vec![
        (
            "wrong-sum",
            Behaviour::Serve(qcow2.clone()),
            "ChecksumMismatch",
            "SHA-256",
        ),
        (
            "hang",
            Behaviour::Hang(qcow2.len() as u64),
            "Timeout",
            "2 s",
        ),
        (
            "cut",
            Behaviour::Truncate {
                body: qcow2[..qcow2.len() / 2].to_vec(),
                claimed: qcow2.len() as u64,
            },
            "Truncated",
            &truncated_says,
        ),
    ];
    for (name, behaviour, reason, says) in cases {
        let path = format!("/{name}.qcow2");
        server.route(&path, behaviour);
        let sum = if name == "wrong-sum" {
            "0".repeat(64)
        } else {
            digest.clone()
        };
        d.apply(vec![http_image(name, &server.url(&path), &sum)]);
        let v = wait_failed(&d, name, reason);
        let message = v["status"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{name}: {message}");
        assert_eq!(
            store_files(&d),
            Vec::<String>::new(),
            "{name}: a failed download leaves nothing in the image store"
        );
        assert!(
            d.event_reasons("VirtualImage", name)
                .contains(&"ImportFailed".to_string())
        );
        delete_and_wait(&d, "virtualimages", name);
        assert_eq!(
            store_files(&d),
            Vec::<String>::new(),
            "{name}: after delete"
        );
    }

    // 404 until the file is put on the server; then the retry succeeds.
    d.apply(vec![http_image(
        "later",
        &server.url("/later.qcow2"),
        &digest,
    )]);
    let v = wait_failed(&d, "later", "HttpStatus");
    assert!(
        v["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("404"),
        "{v:#}"
    );
    assert_eq!(store_files(&d), Vec::<String>::new());
    server.route("/later.qcow2", Behaviour::Serve(qcow2.clone()));
    let v = wait_image_phase(&d, "later", "Ready");
    assert!(v["status"]["attempts"].as_u64().unwrap_or(0) >= 2, "{v:#}");
    assert_eq!(v["status"]["digest"], format!("sha256:{digest}"));
    assert!(v["status"]["reason"].is_null(), "{v:#}");
    // Failed, then Importing again, then Ready.
    wait_event(&d, "later", "Imported");
    let reasons = d.event_reasons("VirtualImage", "later");
    let failed = reasons.iter().position(|r| r == "ImportFailed");
    let restarted = reasons.iter().rposition(|r| r == "ImportStarted");
    let imported = reasons.iter().position(|r| r == "Imported");
    assert!(
        failed < restarted && restarted < imported && failed.is_some(),
        "{reasons:?}"
    );
    assert_eq!(store_files(&d), vec![format!("sha256-{digest}.qcow2")]);
}

#[test]
fn images_that_name_other_files_or_are_not_images_are_refused() {
    let src = roots();
    let p = |n: &str| src.path().join(n);
    let s = |n: &str| p(n).to_str().expect("utf8").to_owned();
    // A qcow2 whose backing file lies outside every root.
    run_ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-u",
            "-b",
            "/etc/shadow",
            "-F",
            "raw",
            &s("backed.qcow2"),
            "4M",
        ],
    );
    run_ok(
        "qemu-img",
        &["create", "-q", "-f", "raw", &s("data.raw"), "4M"],
    );
    run_ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            &format!("data_file={}", s("data.raw")),
            &s("external.qcow2"),
            "4M",
        ],
    );
    std::fs::write(
        p("notes.txt"),
        "these are my notes, not a disk\n".repeat(64),
    )
    .expect("write");
    std::fs::write(
        p("desc.vmdk"),
        "# Disk DescriptorFile\nversion=1\ncreateType=\"monolithicFlat\"\nRW 8 FLAT \"/etc/shadow\" 0\n",
    )
    .expect("write");
    let d = Daemon::start_without_guest(&[src.path()], &[]);
    d.apply(vec![
        file_image("backed", &p("backed.qcow2")),
        file_image("external", &p("external.qcow2")),
        file_image("notes", &p("notes.txt")),
        file_image("desc", &p("desc.vmdk")),
    ]);
    let v = wait_failed(&d, "backed", "UnsafeImage");
    assert!(
        v["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("backing file"),
        "{v:#}"
    );
    let v = wait_failed(&d, "external", "UnsafeImage");
    assert!(
        v["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("external data file"),
        "{v:#}"
    );
    wait_failed(&d, "notes", "NotAnImage");
    let v = wait_failed(&d, "desc", "UnsupportedFormat");
    assert!(
        v["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("vmdk"),
        "{v:#}"
    );
    // None of them was kept.
    assert!(
        store_files(&d).iter().all(|f| !f.starts_with("sha256-")),
        "{:?}",
        store_files(&d)
    );
    // The same files as a disk's base image (`source: {image: PATH}`) are
    // refused too, before qemu-img or QEMU opens them.
    let base_disk = |name: &str, path: PathBuf| Disk::from_image(name, path).json();
    d.apply(vec![
        base_disk("on-backed", p("backed.qcow2")),
        base_disk("on-desc", p("desc.vmdk")),
    ]);
    for (disk, says) in [("on-backed", "backing file"), ("on-desc", "vmdk")] {
        let v = d.wait_object("virtualdisks", disk, "Failed", IMPORT, |v| {
            v["status"]["phase"] == "Failed"
        });
        let error = v["status"]["lastError"].as_str().unwrap_or_default();
        assert!(
            error.contains("spec.source.image") && error.contains(says),
            "{disk}: {v:#}"
        );
        assert!(v["status"]["path"].is_null(), "{disk}: no disk file: {v:#}");
    }
    // A source outside the roots is refused at apply time.
    let (status, v) = d.apply_json(vec![file_image("shadow", Path::new("/etc/hostname"))]);
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap_or_default()
            .contains("spec.source.file"),
        "{v}"
    );
}

#[test]
fn images_with_the_same_content_share_one_file_and_file_sources_work() {
    let src = roots();
    let server = Server::start();
    let qcow2 = make_qcow2(&src.path().join("good.qcow2"));
    let digest = sha256_of(&qcow2);
    server.route("/good.qcow2", Behaviour::Serve(qcow2.clone()));
    let raw = make_raw_mbr(&src.path().join("disk.raw"));
    let raw_digest = sha256_of(&raw);
    let d = Daemon::start_without_guest(&[src.path()], &[]);

    d.apply(vec![
        file_image("from-file", &src.path().join("good.qcow2")),
        file_image("raw", &src.path().join("disk.raw")),
    ]);
    let a = wait_image_phase(&d, "from-file", "Ready");
    assert_eq!(a["status"]["digest"], format!("sha256:{digest}"));
    assert_eq!(a["status"]["format"], "qcow2");
    let r = wait_image_phase(&d, "raw", "Ready");
    assert_eq!(r["status"]["format"], "raw", "{r:#}");
    assert_eq!(r["status"]["virtualSize"], raw.len() as u64);
    assert_eq!(r["status"]["digest"], format!("sha256:{raw_digest}"));

    // The same content over http: already stored, so not downloaded.
    d.apply(vec![http_image(
        "from-http",
        &server.url("/good.qcow2"),
        &digest,
    )]);
    let b = wait_image_phase(&d, "from-http", "Ready");
    assert_eq!(b["status"]["path"], a["status"]["path"]);
    assert_eq!(
        server.hits("/good.qcow2"),
        0,
        "no download for stored content"
    );
    assert_eq!(store_files(&d), {
        let mut v = vec![
            format!("sha256-{digest}.qcow2"),
            format!("sha256-{raw_digest}.raw"),
        ];
        v.sort();
        v
    });
    // A second file source with the same bytes: one file still.
    std::fs::copy(src.path().join("good.qcow2"), src.path().join("copy.qcow2")).expect("copy");
    d.apply(vec![file_image("copy", &src.path().join("copy.qcow2"))]);
    let c = wait_image_phase(&d, "copy", "Ready");
    assert_eq!(c["status"]["path"], a["status"]["path"]);
    assert_eq!(store_files(&d).len(), 2);

    // Deleting two of three keeps the file; the last one takes it.
    let shared = PathBuf::from(a["status"]["path"].as_str().expect("path"));
    for name in ["from-file", "copy"] {
        delete_and_wait(&d, "virtualimages", name);
        assert!(shared.is_file(), "{name}: still used by from-http");
    }
    delete_and_wait(&d, "virtualimages", "from-http");
    assert!(!shared.exists());
    assert_eq!(store_files(&d), vec![format!("sha256-{raw_digest}.raw")]);
}

#[test]
fn a_snapshot_of_a_disk_keeps_its_image_file_after_the_image_is_deleted() {
    let src = roots();
    make_qcow2(&src.path().join("good.qcow2"));
    let mut d = Daemon::start_without_guest(&[src.path()], &[]);
    d.apply(vec![
        file_image("base", &src.path().join("good.qcow2")),
        disk_from("data", "base", None),
    ]);
    let image = wait_image_phase(&d, "base", "Ready");
    let path = PathBuf::from(image["status"]["path"].as_str().expect("path"));
    d.wait_object("virtualdisks", "data", "Ready", IMPORT, |v| {
        v["status"]["phase"] == "Ready"
    });
    d.apply(vec![DiskSnapshot::of("data-1", "data").json()]);
    let snap = common::snapshot_final(&d, "data-1", IMPORT);
    assert_eq!(snap["status"]["phase"], "Ready", "{snap:#}");
    // A disk restored from the snapshot also stands on the image.
    d.apply(vec![Disk::from_snapshot("restored", "data-1").json()]);
    let restored = d.wait_object("virtualdisks", "restored", "Ready", IMPORT, |v| {
        v["status"]["phase"] == "Ready"
    });
    let chain = common::backing_chain(Path::new(
        restored["status"]["path"].as_str().expect("path"),
    ));
    assert_eq!(chain.last(), Some(&path), "{chain:?}");

    // The disk made from the image goes; nothing names the image now, so it
    // may be deleted, but its file stays: the snapshot's layers need it.
    delete_and_wait(&d, "virtualdisks", "data");
    delete_and_wait(&d, "virtualimages", "base");
    assert!(
        path.is_file(),
        "the snapshot and the restored disk still need it"
    );
    // The event follows the removal.
    common::wait_until("a Deleted event saying the file is kept", IMPORT, || {
        d.events("VirtualImage", "base").iter().any(|e| {
            e["reason"] == "Deleted" && e["message"].as_str().unwrap_or_default().contains("kept")
        })
    });

    // A restart keeps it too: the store says a layer is made from it.
    d.kill();
    d.spawn();
    assert!(path.is_file());

    for (plural, name) in [
        ("virtualdisksnapshots", "data-1"),
        ("virtualdisks", "restored"),
    ] {
        assert!(path.is_file(), "before deleting {name}");
        delete_and_wait(&d, plural, name);
    }
    assert!(!path.exists(), "the last layer made from it is gone");
}

#[test]
fn a_restart_removes_leftover_temporaries_but_never_a_stored_image() {
    let src = roots();
    make_qcow2(&src.path().join("good.qcow2"));
    let mut d = Daemon::start_without_guest(&[src.path()], &[]);
    d.apply(vec![file_image("base", &src.path().join("good.qcow2"))]);
    let image = wait_image_phase(&d, "base", "Ready");
    let path = PathBuf::from(image["status"]["path"].as_str().expect("path"));
    d.kill();
    // What a crash mid-import leaves, and a stored file no image refers to.
    let dir = d.state_dir().join("images");
    std::fs::write(dir.join(".import-00000099-base.tmp"), b"half").expect("write");
    let stray = dir.join(format!("sha256-{}.raw", "a".repeat(64)));
    std::fs::write(&stray, b"x").expect("write");
    let mine = dir.join("my-own.qcow2");
    std::fs::write(&mine, b"a user's file").expect("write");
    d.spawn();
    let mut want = vec![
        path.file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned(),
        "my-own.qcow2".to_string(),
    ];
    want.sort();
    assert_eq!(store_files(&d), want);
    assert_eq!(
        wait_image_phase(&d, "base", "Ready")["status"]["path"],
        image["status"]["path"]
    );
}

#[test]
fn deleting_an_image_while_it_downloads_cancels_the_download_and_leaves_nothing() {
    let src = roots();
    let server = Server::start();
    server.route("/stuck.qcow2", Behaviour::Hang(64 << 20));
    let d = Daemon::start_without_guest(&[src.path()], &["--image-read-timeout-seconds", "120"]);
    d.apply(vec![http_image(
        "stuck",
        &server.url("/stuck.qcow2"),
        &"1".repeat(64),
    )]);
    // The response headers came: the status shows the length, nothing done.
    let v = d.wait_object("virtualimages", "stuck", "importing", IMPORT, |v| {
        v["status"]["phase"] == "Importing" && v["status"]["bytesTotal"] == (64u64 << 20)
    });
    assert_eq!(v["status"]["progress"], "0%", "{v:#}");
    assert_eq!(v["status"]["bytesDone"], 0);
    let files = store_files(&d);
    assert!(
        files.len() == 1 && files[0].starts_with(".import-") && files[0].ends_with("-stuck.tmp"),
        "{files:?}"
    );
    let asked = Instant::now();
    assert_eq!(delete(&d, "virtualimages", "stuck").0, 200);
    d.wait_gone("virtualimages", "stuck", Duration::from_secs(10));
    assert!(asked.elapsed() < Duration::from_secs(10));
    assert_eq!(store_files(&d), Vec::<String>::new());
    assert_eq!(server.hits("/stuck.qcow2"), 1);
}

#[test]
fn a_slow_download_shows_its_progress_while_it_runs() {
    let src = roots();
    let server = Server::start();
    let qcow2 = make_qcow2(&src.path().join("good.qcow2"));
    let digest = sha256_of(&qcow2);
    // About 3 s for the whole file.
    let chunk = qcow2.len() / 30 + 1;
    server.route(
        "/slow.qcow2",
        Behaviour::Drip {
            body: qcow2.clone(),
            chunk,
            pause: Duration::from_millis(100),
        },
    );
    let d = Daemon::start_without_guest(&[src.path()], &[]);
    d.apply(vec![http_image(
        "slow",
        &server.url("/slow.qcow2"),
        &digest,
    )]);
    let mut seen: Vec<(u64, String, u64)> = Vec::new();
    let mut v = Value::Null;
    let ready = eventually(IMPORT, || {
        v = d.get_image("slow").expect("image");
        let st = &v["status"];
        if st["phase"] == "Ready" {
            return true;
        }
        if st["phase"] == "Importing"
            && let Some(done) = st["bytesDone"].as_u64()
            && done > 0
        {
            assert_eq!(st["bytesTotal"], qcow2.len() as u64, "{v:#}");
            seen.push((
                done,
                st["progress"].as_str().unwrap_or_default().to_string(),
                st["bytesPerSecond"].as_u64().unwrap_or(0),
            ));
        }
        false
    });
    assert!(ready, "not Ready: {v:#}");
    seen.dedup_by_key(|s| s.0);
    assert!(seen.len() >= 2, "at least two progress reports: {seen:?}");
    assert!(seen.windows(2).all(|w| w[0].0 < w[1].0), "{seen:?}");
    for (done, progress, rate) in &seen {
        let pct: u64 = progress
            .trim_end_matches('%')
            .parse()
            .unwrap_or_else(|_| panic!("{progress:?}"));
        assert_eq!(pct, done * 100 / qcow2.len() as u64, "{seen:?}");
        assert!(*rate > 0, "{seen:?}");
    }
    // Twice a second, not per chunk: ~30 chunks over ~3 s.
    assert!(seen.len() <= 10, "{seen:?}");
    let v = wait_image_phase(&d, "slow", "Ready");
    assert!(v["status"]["bytesDone"].is_null(), "{v:#}");
    assert_eq!(v["status"]["progress"], "100%");
}

#[test]
fn removing_a_manifest_with_an_image_and_a_disk_from_it_removes_both_and_the_file() {
    let src = roots();
    make_qcow2(&src.path().join("good.qcow2"));
    let d = Daemon::start_without_guest(&[src.path()], &["--manifests-delete-grace-ms", "300"]);
    let manifests = d.dir.path().join("manifests");
    std::fs::create_dir_all(&manifests).expect("mkdir");
    let file = manifests.join("web.yaml");
    std::fs::write(
        &file,
        Manifest::new()
            .with(Image::file("base", src.path().join("good.qcow2")))
            .with(Disk::from_virtual_image("root", "base").size("16Mi"))
            .yaml(),
    )
    .expect("write manifest");
    let image = wait_image_phase(&d, "base", "Ready");
    let path = PathBuf::from(image["status"]["path"].as_str().expect("path"));
    let disk = d.wait_object("virtualdisks", "root", "Ready", IMPORT, |v| {
        v["status"]["phase"] == "Ready"
    });
    assert_eq!(disk["status"]["capacity"], 16u64 << 20);
    std::fs::remove_file(&file).expect("rm manifest");
    d.wait_gone("virtualdisks", "root", IMPORT);
    d.wait_gone("virtualimages", "base", IMPORT);
    assert!(!path.exists(), "the image file goes with both");
    assert_eq!(store_files(&d), Vec::<String>::new());
}

#[test]
fn images_larger_than_the_limit_are_refused_whether_or_not_their_length_is_said() {
    let src = roots();
    let server = Server::start();
    let qcow2 = make_qcow2(&src.path().join("good.qcow2"));
    assert!(qcow2.len() > 1 << 20);
    let digest = sha256_of(&qcow2);
    server.route("/big.qcow2", Behaviour::Serve(qcow2.clone()));
    server.route("/unsaid.qcow2", Behaviour::NoLength(qcow2.clone()));
    let d = Daemon::start_without_guest(&[src.path()], &["--image-max-bytes", "1Mi"]);
    d.apply(vec![
        http_image("said", &server.url("/big.qcow2"), &digest),
        http_image("unsaid", &server.url("/unsaid.qcow2"), &digest),
        file_image("local", &src.path().join("good.qcow2")),
    ]);
    for name in ["said", "unsaid", "local"] {
        let v = wait_failed(&d, name, "TooLarge");
        let message = v["status"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("--image-max-bytes"), "{name}: {message}");
    }
    // Without a limit in the way, a body without a length is fine.
    let d2 = Daemon::start_without_guest(&[src.path()], &[]);
    d2.apply(vec![http_image(
        "unsaid",
        &server.url("/unsaid.qcow2"),
        &digest,
    )]);
    let v = wait_image_phase(&d2, "unsaid", "Ready");
    assert_eq!(v["status"]["digest"], format!("sha256:{digest}"));
}

// ---------------------------------------------------- free space and size

/// A tmpfs of its own mounted on `at` (which it creates), detached when
/// dropped (lazily: a daemon still running on it keeps it until it exits),
/// so that the directory it is in can then be removed.
struct SmallFs {
    at: PathBuf,
}

impl SmallFs {
    fn mount(at: &Path, size: &str) -> SmallFs {
        std::fs::create_dir_all(at).expect("mount point");
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(at)
            .output()
            .expect("mount (util-linux)");
        assert!(
            out.status.success(),
            "mount -t tmpfs on {} (the tests run as root): {}",
            at.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        SmallFs {
            at: at.to_path_buf(),
        }
    }

    fn resize(&self, size: &str) {
        let out = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.at)
            .output()
            .expect("mount");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Bytes available, from the filesystem itself.
    fn available(&self) -> u64 {
        free_bytes(&self.at)
    }
}

fn free_bytes(path: &Path) -> u64 {
    let s = rustix::fs::statvfs(path).expect("statvfs");
    s.f_bavail * s.f_frsize
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
    }
}

/// The lowest free space a thread sees on a filesystem, polling it as fast
/// as it can until stopped.
struct LowWater {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl LowWater {
    fn watch(path: &Path) -> LowWater {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (flag, path) = (stop.clone(), path.to_path_buf());
        let thread = std::thread::spawn(move || {
            let mut low = u64::MAX;
            while !flag.load(std::sync::atomic::Ordering::SeqCst) {
                match rustix::fs::statvfs(&path) {
                    Ok(s) => low = low.min(s.f_bavail * s.f_frsize),
                    // Unmounted under it: the test is over.
                    Err(_) => break,
                }
            }
            low
        });
        LowWater {
            stop,
            thread: Some(thread),
        }
    }

    fn lowest(mut self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.thread
            .take()
            .map(|t| t.join().expect("watcher"))
            .unwrap_or(u64::MAX)
    }
}

#[test]
fn a_download_stops_at_the_free_space_reserve_leaves_nothing_and_waits_for_room() {
    const MIB: u64 = 1 << 20;
    let reserve = 64 * MIB;
    let src = roots();
    let server = Server::start();
    server.route("/endless.img", Behaviour::Endless);
    // Says 1 GiB, then sends nothing.
    server.route("/claims-a-gigabyte.img", Behaviour::Hang(1 << 30));
    let qcow2 = make_qcow2(&src.path().join("small.qcow2"));
    server.route("/small.qcow2", Behaviour::Serve(qcow2.clone()));
    let dir = tempfile::Builder::new()
        .prefix("hearth-e2e-")
        .tempdir()
        .expect("tempdir");
    // The state directory on a 200 MiB filesystem of its own.
    let mounted = SmallFs::mount(&dir.path().join("state"), "200m");
    let d = Daemon::start_without_guest_in(
        dir,
        &[src.path()],
        &[
            "--image-free-space-reserve",
            "64Mi",
            "--image-read-timeout-seconds",
            "20",
            "--image-retry-max-seconds",
            "2",
            "--resync-seconds",
            "1",
        ],
    );
    // Declared after the daemon: detached before the daemon's directory
    // is removed.
    let fs = mounted;
    let start = fs.available();
    assert!(start > 150 * MIB, "{start}");

    // A length that does not fit: refused before a byte is written, not
    // after the read timeout.
    d.apply(vec![http_image(
        "claims",
        &server.url("/claims-a-gigabyte.img"),
        &"0".repeat(64),
    )]);
    let v = wait_failed(&d, "claims", "NoSpace");
    let message = v["status"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("1073741824 bytes") && message.contains("free space"),
        "{message}"
    );
    assert_eq!(store_files(&d), Vec::<String>::new());
    delete_and_wait(&d, "virtualimages", "claims");

    // An endless body: written until the filesystem would keep less than
    // the reserve, then stopped.
    let low = LowWater::watch(&fs.at);
    d.apply(vec![http_image(
        "endless",
        &server.url("/endless.img"),
        &"0".repeat(64),
    )]);
    let v = wait_failed(&d, "endless", "NoSpace");
    let lowest = low.lowest();
    eprintln!("free space: {start} bytes at the start, {lowest} at the lowest, reserve {reserve}");
    let message = v["status"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("free space") && message.contains("--image-free-space-reserve"),
        "{message}"
    );
    // The filesystem, not hearthd, says so: it never went below the
    // reserve (the database's own few writes aside), and the download did
    // fill what was above it.
    assert!(
        lowest >= reserve - 8 * MIB,
        "the filesystem went down to {lowest} bytes free, below the {reserve} reserve"
    );
    assert!(
        lowest <= reserve + 40 * MIB,
        "the download stopped early: the lowest free space was {lowest} bytes"
    );
    assert_eq!(
        store_files(&d),
        Vec::<String>::new(),
        "the partial file is gone"
    );
    assert!(fs.available() >= start - 8 * MIB, "{}", fs.available());

    // Not tried again while the room is the same: several backoffs (2 s)
    // and resyncs (1 s) later the server has still seen one request.
    assert_eq!(server.hits("/endless.img"), 1);
    std::thread::sleep(Duration::from_secs(8));
    assert_eq!(server.hits("/endless.img"), 1, "retried without more room");
    let v = d.get_image("endless").expect("image");
    assert_eq!(v["status"]["phase"], "Failed", "{v:#}");
    assert_eq!(v["status"]["attempts"], 1, "{v:#}");

    // The daemon keeps serving, and other imports that fit still work.
    let (status, _) = d.request("GET", "/v1/health", None);
    assert_eq!(status, 200);
    d.apply(vec![http_image(
        "small",
        &server.url("/small.qcow2"),
        &sha256_of(&qcow2),
    )]);
    wait_image_phase(&d, "small", "Ready");

    // More room: the next attempt goes, and stops at the reserve again.
    fs.resize("300m");
    common::wait_until("a second attempt", IMPORT, || {
        server.hits("/endless.img") >= 2
    });
    let v = d.wait_object(
        "virtualimages",
        "endless",
        "attempt 2 failed",
        IMPORT,
        |v| v["status"]["phase"] == "Failed" && v["status"]["attempts"] == 2,
    );
    assert_eq!(v["status"]["reason"], "NoSpace", "{v:#}");
    // The next attempt may already be filling the room again (the backoff
    // is 2 s): the floor is the reserve, less the database's few writes,
    // as above.
    assert!(
        fs.available() >= reserve - 8 * MIB,
        "the filesystem has {} bytes free, below the {reserve} reserve",
        fs.available()
    );
    let files = store_files(&d);
    assert_eq!(files.len(), 1, "only the small image: {files:?}");
    delete_and_wait(&d, "virtualimages", "endless");
}

/// Random bytes: a layer holding them is as large as the file.
fn random_file(path: &Path, mib: u64) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    let out = Command::new("head")
        .args(["-c", &(mib << 20).to_string(), "/dev/urandom"])
        .output()
        .expect("head");
    std::fs::write(path, out.stdout).expect("write");
}

#[test]
fn an_oci_image_keeps_the_free_space_reserve_in_its_blobs_and_its_unpacked_tree() {
    const MIB: u64 = 1 << 20;
    let reserve = 32 * MIB;
    let src = roots();
    let layout = src.path().join("layout");
    // Two rootfs images of one random file each: 140 MiB (its blob does
    // not fit above the reserve), and 72 MiB (its blob fits, its tree then
    // does not).
    umoci_image(&layout, "big", |root| random_file(&root.join("data"), 140));
    umoci_image(&layout, "mid", |root| random_file(&root.join("data"), 72));
    let dir = tempfile::Builder::new()
        .prefix("hearth-e2e-")
        .tempdir()
        .expect("tempdir");
    let mounted = SmallFs::mount(&dir.path().join("state"), "160m");
    let d =
        Daemon::start_without_guest_in(dir, &[src.path()], &["--image-free-space-reserve", "32Mi"]);
    let fs = mounted;
    let start = fs.available();
    assert!(start > 150 * MIB, "{start}");
    let oci = |name: &str, tag: &str| {
        Image::oci(
            name,
            hearth_api::OciSource {
                layout: Some(layout.clone()),
                tag: Some(tag.into()),
                ..Default::default()
            },
        )
        .json()
    };
    let low = LowWater::watch(&fs.at);

    // The blobs: refused before the copy, by the layers' own sizes.
    d.apply(vec![oci("big", "big")]);
    let v = wait_failed(&d, "big", "NoSpace");
    let message = v["status"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("the image's layers") && message.contains("--image-free-space-reserve"),
        "{message}"
    );
    assert!(
        fs.available() >= start - 8 * MIB,
        "big: {} bytes free after the refusal, {start} at the start",
        fs.available()
    );

    // The tree: its blob is stored, then the unpack stops at the file that
    // would eat into the reserve.
    d.apply(vec![oci("mid", "mid")]);
    let v = wait_failed(&d, "mid", "NoSpace");
    let lowest = low.lowest();
    eprintln!("free space: {start} bytes at the start, {lowest} at the lowest, reserve {reserve}");
    let message = v["status"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("a file of the image's tree") && message.contains("\"data\""),
        "{message}"
    );
    // The filesystem itself never went below the reserve (the database's
    // few writes aside): without the check the tree took it to ~10 MiB.
    assert!(
        lowest >= reserve - 8 * MIB,
        "the filesystem went down to {lowest} bytes free, below the {reserve} reserve"
    );
    // The build folder went with the attempt; the blob stays until its
    // image goes, then nothing is left.
    let build = d.state_dir().join("images/.oci/build");
    let left: Vec<_> = std::fs::read_dir(&build)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
    delete_and_wait(&d, "virtualimages", "big");
    delete_and_wait(&d, "virtualimages", "mid");
    assert!(
        eventually(IMPORT, || fs.available() >= start - 8 * MIB),
        "{} bytes free after both images went, {start} at the start",
        fs.available()
    );
}

#[test]
fn an_image_larger_than_the_largest_disk_makes_no_disk_from_it() {
    let src = roots();
    let big = src.path().join("big.qcow2");
    // One Ti more than spec.size may ask for; sparse, a few hundred KiB.
    run_ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            big.to_str().expect("utf8"),
            "17T",
        ],
    );
    let d = Daemon::start_without_guest(&[src.path()], &[]);
    let over_base = Disk::from_image("over-big", &big).json();
    // Applied before the image is Ready: the disk waits, then fails.
    d.apply(vec![
        file_image("big", &big),
        disk_from("from-big", "big", None),
        over_base,
    ]);
    let image = wait_image_phase(&d, "big", "Ready");
    assert_eq!(image["status"]["virtualSize"], 17u64 << 40, "{image:#}");
    for (disk, field) in [
        ("from-big", "spec.source.virtualImage"),
        ("over-big", "spec.source.image"),
    ] {
        let v = d.wait_object("virtualdisks", disk, "Failed", IMPORT, |v| {
            v["status"]["phase"] == "Failed"
        });
        let err = v["status"]["lastError"].as_str().unwrap_or_default();
        assert!(
            err.contains(field)
                && err.contains(&(17u64 << 40).to_string())
                && err.contains(&(16u64 << 40).to_string()),
            "{disk}: {err}"
        );
        assert!(v["status"]["capacity"].is_null(), "{v:#}");
    }
    // No layer file was made for either.
    let layers: Vec<String> = std::fs::read_dir(d.state_dir().join("layers"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        !layers.iter().any(|l| l.contains("big")),
        "a layer was made: {layers:?}"
    );
    // With the image Ready, refused at apply time, naming disk and field.
    let (status, v) = d.apply_json(vec![disk_from("later-big", "big", None)]);
    assert_eq!(status, 400, "{v}");
    let msg = v["error"].as_str().unwrap_or_default();
    assert!(
        msg.contains("later-big") && msg.contains("spec.source.virtualImage"),
        "{msg}"
    );
}
