//! OCI imports against crashes and hostile registries, proven from the
//! bytes on disk: hearthd is SIGKILLed mid-pull (a registry behind a proxy
//! that stalls mid-layer), during the rootfs unpack, during mkfs.ext4, and
//! (strace fault injection) after the image file is built and verified but
//! before its commit. After each kill: no mkfs.ext4 or qemu-img of the
//! daemon is left in the process table; after the restart on the same
//! state directory the image is Ready with the manifest skopeo reads, its
//! file holds the right bytes (a containerDisk's sha256 is the source
//! disk's, a rootfs mounts and holds the files), and the store holds no
//! temporary, no build directory and no blob whose bytes do not hash to its
//! name. Also: blobs go with the last image using them, a registry that
//! hangs mid-blob fails the attempt with `Timeout` and leaves nothing, and
//! a manifest over 4 MiB is refused as `TooLarge`. No VM boots.

mod common;

use std::fs;
use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Daemon, Image, ObjectBuilder, wait_until};
use hearth_api::OciSource;
use hearth_test_support::oci::{
    HugeManifestRegistry, StallingProxy, TestRegistry, container_disk_image, sha256sum,
    skopeo_digest, tool, umoci_image, umoci_tag,
};
use hearth_test_support::process::{all_threads_traced, command_lines, is_zombie};
use serde_json::Value;

const IMPORT: Duration = Duration::from_secs(180);

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn images(d: &Daemon) -> PathBuf {
    d.state_dir().join("images")
}

fn blobs(d: &Daemon) -> PathBuf {
    images(d).join(".oci/blobs")
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// `n` bytes from /dev/urandom: a layer gzip cannot shrink.
fn random(n: u64) -> Vec<u8> {
    let mut v = Vec::new();
    fs::File::open("/dev/urandom")
        .expect("urandom")
        .take(n)
        .read_to_end(&mut v)
        .expect("read");
    v
}

/// Live processes (the daemon's children, orphaned or not) whose command
/// line names the daemon's state directory: mkfs.ext4, qemu-img.
fn leftovers(d: &Daemon) -> Vec<(u32, Vec<String>)> {
    let state = d.state_dir().to_string_lossy().into_owned();
    let me = std::process::id();
    command_lines()
        .into_iter()
        .filter(|(pid, args)| {
            *pid != me && !is_zombie(*pid) && args.iter().any(|a| a.contains(&state))
        })
        .collect()
}

/// SIGKILLs hearthd, then checks nothing it started is left running.
fn crash(d: &mut Daemon) {
    d.kill();
    // The kernel sends a child's death signal while the daemon exits, so
    // by the time it is reaped a child has been killed.
    let _ = hearth_test_support::eventually(Duration::from_millis(500), || leftovers(d).is_empty());
    let left = leftovers(d);
    assert!(left.is_empty(), "left running: {left:?}");
}

/// The store after recovery, read from its bytes: no import temporary, an
/// empty blob `tmp/` and build directory, and every blob hashing to its
/// name. Returns the blobs' names.
fn assert_store_sound(d: &Daemon) -> Vec<String> {
    let temps: Vec<String> = entries(&images(d))
        .into_iter()
        .filter(|n| n.starts_with(".import-"))
        .collect();
    assert_eq!(temps, Vec::<String>::new(), "import temporaries left");
    assert_eq!(
        entries(&blobs(d).join("tmp")),
        Vec::<String>::new(),
        "blob temporaries left"
    );
    assert_eq!(
        entries(&images(d).join(".oci/build")),
        Vec::<String>::new(),
        "build directories left"
    );
    let names = entries(&blobs(d).join("sha256"));
    for n in &names {
        let hash = sha256sum(&blobs(d).join("sha256").join(n));
        assert_eq!(&hash, n, "the blob {n} holds bytes that hash to {hash}");
    }
    names
}

/// Mounts the raw ext4 image read-only and returns what `read` reads.
fn with_mounted<T>(raw: &str, read: impl FnOnce(&Path) -> T) -> T {
    let label = tool("blkid", &["-o", "value", "-s", "TYPE", raw]);
    assert_eq!(label.trim(), "ext4", "{raw}");
    let mnt = tempfile::tempdir().unwrap();
    tool("mount", &["-o", "loop,ro", raw, s(mnt.path())]);
    let out = read(mnt.path());
    tool("umount", &[s(mnt.path())]);
    out
}

fn path_of(v: &Value) -> String {
    v["status"]["path"]
        .as_str()
        .expect("status.path")
        .to_string()
}

fn layer_digests(layout: &Path, tag: &str) -> Vec<String> {
    let raw = tool(
        "skopeo",
        &["inspect", "--raw", &format!("oci:{}:{tag}", s(layout))],
    );
    let m: Value = serde_json::from_str(&raw).expect("manifest");
    m["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .map(|l| {
            l["digest"]
                .as_str()
                .unwrap()
                .trim_start_matches("sha256:")
                .to_string()
        })
        .collect()
}

#[test]
fn a_pull_killed_mid_layer_resumes_after_a_restart_with_nothing_torn_left() {
    let src = tempfile::Builder::new()
        .prefix("hearth-oci-crash-")
        .tempdir()
        .expect("tempdir");
    let layout = src.path().join("layout");
    let big = random(24 << 20);
    let big_sum = {
        let f = src.path().join("big.bin");
        fs::write(&f, &big).unwrap();
        sha256sum(&f)
    };
    umoci_image(&layout, "big", |root| {
        fs::create_dir_all(root.join("data")).unwrap();
        fs::write(root.join("data/big.bin"), &big).unwrap();
        fs::write(root.join("data/hello"), b"hello\n").unwrap();
    });
    let layer = layer_digests(&layout, "big").pop().expect("a layer");
    let registry = TestRegistry::start(false);
    registry.push(&layout, "big", "hearth/big:1");
    let proxy = StallingProxy::start(registry.addr());
    let reference = format!("{}/hearth/big:1", proxy.addr());
    // Mid-layer: the documents are a few KiB, the layer 24 MiB.
    proxy.stall_after(Some(4 << 20));

    let mut d = Daemon::start_without_guest(&[src.path()], &["--image-retry-max-seconds", "2"]);
    d.apply(vec![
        Image::oci(
            "big",
            OciSource {
                reference: Some(reference.clone()),
                insecure: true,
                ..Default::default()
            },
        )
        .json(),
    ]);
    // The layer's temporary exists, holds part of it, and the proxy holds
    // the connection.
    let tmp = blobs(&d).join("tmp");
    wait_until("a stalled pull with a partial blob", IMPORT, || {
        proxy.stalled() > 0
            && entries(&tmp)
                .iter()
                .any(|n| fs::metadata(tmp.join(n)).is_ok_and(|m| m.len() > (1 << 20)))
    });
    crash(&mut d);
    // What the crash left: a partial blob in tmp/, not under its name.
    let partial: Vec<u64> = entries(&tmp)
        .iter()
        .map(|n| fs::metadata(tmp.join(n)).unwrap().len())
        .collect();
    assert!(
        partial.iter().any(|&n| n > 0 && n < big.len() as u64),
        "partial blobs: {partial:?}"
    );
    assert!(!blobs(&d).join("sha256").join(&layer).exists());

    proxy.stall_after(None);
    d.spawn();
    let v = d.wait_image_phase("big", "Ready", IMPORT);
    assert_eq!(
        v["status"]["digest"],
        registry.digest(&format!("{}/hearth/big:1", registry.addr())),
        "{v:#}"
    );
    let (sum, hello) = with_mounted(&path_of(&v), |m| {
        (
            sha256sum(&m.join("data/big.bin")),
            fs::read(m.join("data/hello")).unwrap(),
        )
    });
    assert_eq!(sum, big_sum);
    assert_eq!(hello, b"hello\n");
    let names = assert_store_sound(&d);
    assert!(names.contains(&layer), "{names:?}");
}

#[test]
fn a_rootfs_import_killed_during_its_unpack_and_during_mkfs_is_built_again_from_its_blobs() {
    let src = tempfile::Builder::new()
        .prefix("hearth-oci-crash-")
        .tempdir()
        .expect("tempdir");
    let layout = src.path().join("layout");
    let big = random(64 << 20);
    umoci_image(&layout, "root", |root| {
        for i in 0..40 {
            let dir = root.join(format!("d{i:02}"));
            fs::create_dir_all(&dir).unwrap();
            for j in 0..50 {
                fs::write(dir.join(format!("f{j:02}")), format!("{i} {j}\n")).unwrap();
            }
        }
        fs::write(root.join("big.bin"), &big).unwrap();
    });
    let big_sum = {
        let f = src.path().join("big.bin");
        fs::write(&f, &big).unwrap();
        sha256sum(&f)
    };
    let mut d = Daemon::start_without_guest(&[src.path()], &["--image-retry-max-seconds", "2"]);
    d.apply(vec![
        Image::oci(
            "root",
            OciSource {
                layout: Some(layout.clone()),
                tag: Some("root".into()),
                ..Default::default()
            },
        )
        .json(),
    ]);
    let build = images(&d).join(".oci/build");
    let mkfs_running = |d: &Daemon| {
        leftovers(d)
            .iter()
            .any(|(_, args)| args.first().is_some_and(|a| a.ends_with("mkfs.ext4")))
    };
    // During the unpack: the build directory holds files, no mkfs yet.
    wait_until("the unpack under way", IMPORT, || {
        entries(&build)
            .first()
            .is_some_and(|b| entries(&build.join(b)).len() > 3)
            && !mkfs_running(&d)
    });
    crash(&mut d);
    assert!(
        !entries(&build).is_empty(),
        "the crash left a build directory"
    );

    // Restarted: the sweep removes it, the import starts again; killed
    // again while mkfs.ext4 runs.
    d.spawn();
    wait_until("mkfs.ext4 under way", IMPORT, || mkfs_running(&d));
    crash(&mut d);

    d.spawn();
    let v = d.wait_image_phase("root", "Ready", IMPORT);
    assert_eq!(
        v["status"]["digest"],
        skopeo_digest(&format!("oci:{}:root", s(&layout)), &[]),
        "{v:#}"
    );
    let (sum, small, count) = with_mounted(&path_of(&v), |m| {
        (
            sha256sum(&m.join("big.bin")),
            fs::read_to_string(m.join("d39/f49")).unwrap(),
            (0..40)
                .map(|i| entries(&m.join(format!("d{i:02}"))).len())
                .sum::<usize>(),
        )
    });
    assert_eq!(sum, big_sum);
    assert_eq!(small, "39 49\n");
    assert_eq!(count, 40 * 50);
    let names = assert_store_sound(&d);
    for l in layer_digests(&layout, "root") {
        assert!(names.contains(&l), "{names:?}");
    }
}

#[test]
fn an_import_killed_between_its_verified_file_and_its_commit_commits_after_a_restart() {
    let src = tempfile::Builder::new()
        .prefix("hearth-oci-crash-")
        .tempdir()
        .expect("tempdir");
    let layout = src.path().join("layout");
    let qcow2 = container_disk_image(&layout, "disk", src.path(), 64, 0x6b, 4);
    let disk_sum = sha256sum(&qcow2);
    let target = |d: &Daemon| images(d).join(format!("sha256-{disk_sum}.qcow2"));
    let mut d = Daemon::start_without_guest(&[src.path()], &["--image-retry-max-seconds", "2"]);
    let pid = d.child.as_ref().expect("hearthd").id();
    // The commit's first system call is the chmod that makes the verified
    // temporary read-only, right before its rename into the store: the
    // first chmod of an import that unpacks nothing. strace kills hearthd
    // as it makes it.
    let mut strace = Command::new("strace")
        .args(["-f", "-qq", "-o", "/dev/null", "-p", &pid.to_string()])
        .args(["-e", "trace=chmod,fchmodat,fchmod"])
        .args(["-e", "inject=chmod,fchmodat,fchmod:signal=KILL:when=1"])
        .stdin(Stdio::null())
        .spawn()
        .expect("strace");
    wait_until(
        "strace traces every thread of hearthd",
        Duration::from_secs(20),
        || all_threads_traced(pid),
    );
    d.apply(vec![
        Image::oci(
            "disk",
            OciSource {
                layout: Some(layout.clone()),
                tag: Some("disk".into()),
                ..Default::default()
            },
        )
        .json(),
    ]);
    let child = d.child.as_mut().expect("hearthd");
    let deadline = Instant::now() + IMPORT;
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "hearthd was not killed:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    d.child = None;
    assert_eq!(status.signal(), Some(9), "{status:?}\n{}", d.log());
    let _ = strace.wait();
    let left = leftovers(&d);
    assert!(left.is_empty(), "left running: {left:?}");
    // What the crash left: the blobs, verified; the image's file, whole and
    // verified, still under its temporary name; nothing under its own name.
    let stored = entries(&blobs(&d).join("sha256"));
    for l in layer_digests(&layout, "disk") {
        assert!(stored.contains(&l), "{stored:?}");
    }
    let temps: Vec<String> = entries(&images(&d))
        .into_iter()
        .filter(|n| n.starts_with(".import-"))
        .collect();
    assert_eq!(temps.len(), 1, "{temps:?}");
    assert_eq!(sha256sum(&images(&d).join(&temps[0])), disk_sum);
    assert!(!target(&d).exists());

    d.spawn();
    let v = d.wait_image_phase("disk", "Ready", IMPORT);
    assert_eq!(
        v["status"]["digest"],
        skopeo_digest(&format!("oci:{}:disk", s(&layout)), &[]),
        "{v:#}"
    );
    assert_eq!(path_of(&v), s(&target(&d)));
    assert_eq!(sha256sum(&target(&d)), disk_sum);
    assert_store_sound(&d);
}

/// A tar of `files` (path, content), made by `tar`.
fn layer_tar(dir: &Path, name: &str, files: &[(&str, &[u8])]) -> PathBuf {
    let root = dir.join(format!("{name}.d"));
    for (p, bytes) in files {
        let f = root.join(p);
        fs::create_dir_all(f.parent().unwrap()).unwrap();
        fs::write(f, bytes).unwrap();
    }
    let out = dir.join(format!("{name}.tar"));
    tool("tar", &["-C", s(&root), "-cf", s(&out), "."]);
    out
}

/// The blobs of image `tag`: its manifest, config and layers (hex).
fn blobs_of(layout: &Path, tag: &str) -> Vec<String> {
    let at = format!("oci:{}:{tag}", s(layout));
    let raw = tool("skopeo", &["inspect", "--raw", &at]);
    let m: Value = serde_json::from_str(&raw).expect("manifest");
    let mut v = vec![
        skopeo_digest(&at, &[])
            .trim_start_matches("sha256:")
            .to_string(),
        m["config"]["digest"]
            .as_str()
            .unwrap()
            .trim_start_matches("sha256:")
            .to_string(),
    ];
    v.extend(layer_digests(layout, tag));
    v
}

/// Waits until the blob store holds exactly `want` (sorted), each blob
/// hashing to its name.
fn wait_blobs(d: &Daemon, want: &[String]) {
    let _ = hearth_test_support::eventually(Duration::from_secs(10), || {
        entries(&blobs(d).join("sha256")) == want
    });
    assert_eq!(assert_store_sound(d), want);
}

fn delete_image(d: &Daemon, name: &str) {
    let (status, body) = d.request("DELETE", &format!("/v1/virtualimages/{name}"), None);
    assert_eq!(status, 200, "{body}");
    d.wait_gone("virtualimages", name, IMPORT);
}

#[test]
fn blobs_go_with_the_last_image_using_them_and_never_from_under_an_import() {
    let src = tempfile::Builder::new()
        .prefix("hearth-oci-release-")
        .tempdir()
        .expect("tempdir");
    let dir = src.path();
    let shared = layer_tar(dir, "shared", &[("etc/os-release", b"ID=shared\n")]);
    let only_a = layer_tar(dir, "a", &[("a", b"a\n")]);
    let only_b = layer_tar(dir, "b", &[("b", b"b\n")]);
    let big = random(16 << 20);
    let only_c = layer_tar(dir, "c", &[("c.bin", &big)]);
    let layout = dir.join("layout");
    umoci_tag(&layout, "a", &[&shared, &only_a]);
    umoci_tag(&layout, "b", &[&shared, &only_b]);
    umoci_tag(&layout, "c", &[&shared, &only_c]);
    let (a, b, c) = (
        blobs_of(&layout, "a"),
        blobs_of(&layout, "b"),
        blobs_of(&layout, "c"),
    );
    let shared_hex = a[2].clone();
    assert_eq!(b[2], shared_hex, "the images share their first layer");
    assert_eq!(c[2], shared_hex, "the images share their first layer");
    let registry = TestRegistry::start(false);
    registry.push(&layout, "c", "hearth/c:1");
    let proxy = StallingProxy::start(registry.addr());

    let d = Daemon::start_without_guest(
        &[dir],
        &[
            "--image-retry-max-seconds",
            "2",
            "--image-read-timeout-seconds",
            "15",
        ],
    );
    let from_layout = |name: &str| {
        Image::oci(
            name,
            OciSource {
                layout: Some(layout.clone()),
                tag: Some(name.into()),
                ..Default::default()
            },
        )
        .json()
    };
    d.apply(vec![from_layout("a"), from_layout("b")]);
    d.wait_image_phase("a", "Ready", IMPORT);
    d.wait_image_phase("b", "Ready", IMPORT);
    let mut both: Vec<String> = a.iter().chain(&b).cloned().collect();
    both.sort();
    both.dedup();
    assert_eq!(assert_store_sound(&d), both);

    // a goes: its own blobs go, the shared layer and b's stay.
    delete_image(&d, "a");
    let mut want = b.clone();
    want.sort();
    wait_blobs(&d, &want);

    // c is pulled, stalled in its own layer, having found the shared one
    // stored; b (the shared layer's last committed user) goes meanwhile.
    proxy.stall_after(Some(2 << 20));
    d.apply(vec![
        Image::oci(
            "c",
            OciSource {
                reference: Some(format!("{}/hearth/c:1", proxy.addr())),
                insecure: true,
                ..Default::default()
            },
        )
        .json(),
    ]);
    wait_until("c's pull stalled", IMPORT, || proxy.stalled() > 0);
    delete_image(&d, "b");
    // The release runs right after the delete's transaction; a second is
    // ample for it to have run, had it not been put off.
    std::thread::sleep(Duration::from_secs(1));
    let stored = entries(&blobs(&d).join("sha256"));
    assert!(
        stored.contains(&shared_hex),
        "the shared layer went from under c's import: {stored:?}"
    );
    proxy.stall_after(None);
    // The stalled connection stays stalled; the read timeout ends it and
    // the retry passes.
    let v = d.wait_image_phase("c", "Ready", IMPORT);
    let (os, len) = with_mounted(&path_of(&v), |m| {
        (
            fs::read(m.join("etc/os-release")).unwrap(),
            fs::metadata(m.join("c.bin")).unwrap().len(),
        )
    });
    assert_eq!(os, b"ID=shared\n");
    assert_eq!(len, big.len() as u64);
    // Once c is committed the put-off release ran: only c's blobs are left.
    let mut want = c.clone();
    want.sort();
    wait_blobs(&d, &want);

    delete_image(&d, "c");
    wait_blobs(&d, &[]);
    assert_eq!(entries(&blobs(&d).join("sha256")), Vec::<String>::new());
}

#[test]
fn a_registry_that_hangs_mid_blob_times_out_and_a_huge_manifest_is_refused() {
    let src = tempfile::Builder::new()
        .prefix("hearth-oci-hostile-")
        .tempdir()
        .expect("tempdir");
    let layout = src.path().join("layout");
    let big = random(16 << 20);
    umoci_image(&layout, "big", |root| {
        fs::write(root.join("big.bin"), &big).unwrap();
    });
    umoci_image(&layout, "other", |root| {
        fs::write(root.join("other"), b"other\n").unwrap();
    });
    let layer = layer_digests(&layout, "big").pop().expect("a layer");
    let registry = TestRegistry::start(false);
    registry.push(&layout, "big", "hearth/big:1");
    let proxy = StallingProxy::start(registry.addr());
    let with_length = HugeManifestRegistry::start(5 << 20, true);
    let chunked = HugeManifestRegistry::start(5 << 20, false);

    let d = Daemon::start_without_guest(
        &[src.path()],
        &[
            "--image-retry-max-seconds",
            "2",
            "--image-read-timeout-seconds",
            "3",
        ],
    );
    // Another image, Ready before: untouched by what follows.
    d.apply(vec![
        Image::oci(
            "other",
            OciSource {
                layout: Some(layout.clone()),
                tag: Some("other".into()),
                ..Default::default()
            },
        )
        .json(),
    ]);
    let other = d.wait_image_phase("other", "Ready", IMPORT);
    let other_sum = sha256sum(Path::new(&path_of(&other)));
    let other_blobs = blobs_of(&layout, "other");

    proxy.stall_after(Some(2 << 20));
    let reference = format!("{}/hearth/big:1", proxy.addr());
    let oci = |name: &str, reference: String| {
        Image::oci(
            name,
            OciSource {
                reference: Some(reference),
                insecure: true,
                ..Default::default()
            },
        )
        .json()
    };
    d.apply(vec![
        oci("hang", reference.clone()),
        oci("huge", format!("{}/x/huge:1", with_length.addr())),
        oci("huge-chunked", format!("{}/x/huge:1", chunked.addr())),
    ]);
    wait_until("the pull stalled", IMPORT, || proxy.stalled() > 0);
    let stalled_at = Instant::now();
    let v = d.wait_image_phase("hang", "Failed", IMPORT);
    let waited = stalled_at.elapsed();
    // Right when it failed (the retry is 2 s away): nothing partial left.
    let tmp = entries(&blobs(&d).join("tmp"));
    assert_eq!(tmp, Vec::<String>::new(), "partial blobs left");
    assert!(!blobs(&d).join("sha256").join(&layer).exists());
    assert_eq!(v["status"]["reason"], "Timeout", "{v:#}");
    let message = v["status"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&reference) && message.contains(&layer),
        "{message}"
    );
    assert!(
        waited >= Duration::from_millis(2500),
        "failed after {waited:?}"
    );

    // Retried: a new connection, and once the registry answers again the
    // image is Ready with the right bytes.
    let before = proxy.accepted();
    wait_until("a retry", IMPORT, || proxy.accepted() > before);
    proxy.stall_after(None);
    let v = d.wait_image_phase("hang", "Ready", IMPORT);
    assert!(v["status"]["attempts"].as_u64().unwrap_or(0) >= 2, "{v:#}");
    let sum = with_mounted(&path_of(&v), |m| sha256sum(&m.join("big.bin")));
    let f = src.path().join("big.bin");
    fs::write(&f, &big).unwrap();
    assert_eq!(sum, sha256sum(&f));

    // A manifest over 4 MiB, told by its Content-Length or by its bytes.
    for name in ["huge", "huge-chunked"] {
        let v = d.wait_image_phase(name, "Failed", IMPORT);
        assert_eq!(v["status"]["reason"], "TooLarge", "{v:#}");
        let message = v["status"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("manifest") && message.contains(&(4u64 << 20).to_string()),
            "{message}"
        );
    }
    for name in ["huge", "huge-chunked"] {
        delete_image(&d, name);
    }

    // The other image is as it was.
    let again = d.get_image("other").expect("other");
    assert_eq!(again["status"]["phase"], "Ready", "{again:#}");
    assert_eq!(again["status"]["path"], other["status"]["path"]);
    assert_eq!(sha256sum(Path::new(&path_of(&again))), other_sum);
    let names = assert_store_sound(&d);
    for b in &other_blobs {
        assert!(names.contains(b), "{names:?}");
    }
}
