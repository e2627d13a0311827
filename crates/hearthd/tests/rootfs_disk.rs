//! Disks from a rootfs OCI image: the real hearthd grows the ext4 to the
//! disk's size and writes `spec.files` into it before the disk is Ready.
//! Ground truth without hearthd: the disk's layer converted with
//! `qemu-img convert`, checked with `e2fsck -fn` and `dumpe2fs -h`,
//! loop-mounted read-only; the process table for qemu-storage-daemon;
//! `/proc/self/mountinfo` for FUSE mounts. No VM boots.

mod common;

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{Daemon, Disk, Image, ObjectBuilder, Vm, assert_clean_ext4, sha256_file, to_raw};
use hearth_api::{DiskFile, OciSource};
use hearth_test_support::oci::{tool, umoci_image};
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(180);
const MIB: u64 = 1 << 20;

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// A rootfs image `root` in a layout under `src`: /etc with a motd to be
/// replaced, and /lib a symlink to usr/lib, as in distributions.
fn rootfs_layout(src: &Path) -> PathBuf {
    let layout = src.join("layout");
    umoci_image(&layout, "root", |root| {
        fs::create_dir_all(root.join("etc")).unwrap();
        fs::write(root.join("etc/hostname"), b"rootfs\n").unwrap();
        fs::write(root.join("etc/motd"), b"the image's motd\n").unwrap();
        fs::create_dir_all(root.join("usr/lib")).unwrap();
        std::os::unix::fs::symlink("usr/lib", root.join("lib")).unwrap();
    });
    layout
}

fn start(src: &Path) -> Daemon {
    Daemon::start_without_guest(&[src], &[])
}

/// The image from the layout, Ready; its file's path.
fn import(d: &Daemon, layout: &Path) -> PathBuf {
    d.apply(vec![
        Image::oci(
            "root",
            OciSource {
                layout: Some(layout.to_path_buf()),
                tag: Some("root".into()),
                ..Default::default()
            },
        )
        .json(),
    ]);
    let v = d.wait_image_phase("root", "Ready", WAIT);
    assert_eq!(v["status"]["shape"], "rootfs", "{v:#}");
    PathBuf::from(v["status"]["path"].as_str().expect("image path"))
}

fn text_file(path: &str, content: &str, mode: &str, uid: u32) -> DiskFile {
    DiskFile {
        path: path.into(),
        source: None,
        content: Some(content.into()),
        mode: Some(mode.into()),
        uid,
        gid: uid,
    }
}

fn host_file(path: &str, source: &Path) -> DiskFile {
    DiskFile {
        path: path.into(),
        source: Some(source.to_path_buf()),
        content: None,
        mode: None,
        uid: 0,
        gid: 0,
    }
}

fn disk(name: &str, size: &str, files: Vec<DiskFile>) -> Value {
    let mut disk = Disk::from_virtual_image(name, "root").size(size);
    disk.0.spec.files = files;
    disk.json()
}

fn wait_final(d: &Daemon, name: &str) -> Value {
    d.wait_object("virtualdisks", name, "Ready or Failed", WAIT, |v| {
        matches!(v["status"]["phase"].as_str(), Some("Ready" | "Failed"))
    })
}

/// Layer files of `disk` in the daemon's layers directory.
fn layer_files(d: &Daemon, disk: &str) -> Vec<PathBuf> {
    let suffix = format!("-{disk}.qcow2");
    let mut v: Vec<PathBuf> = fs::read_dir(d.state_dir().join("layers"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.to_string_lossy().ends_with(&suffix))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The pids of qemu-storage-daemons whose command line names a path under
/// `dir`, from the process table.
fn storage_daemons(dir: &Path) -> Vec<(u32, String)> {
    let dir = dir.to_string_lossy().into_owned();
    let mut out = Vec::new();
    for p in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = p.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = fs::read(p.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args
            .first()
            .is_some_and(|a| a.ends_with("qemu-storage-daemon"))
            && args.iter().any(|a| a.contains(&dir))
        {
            out.push((pid, args.join(" ")));
        }
    }
    out
}

/// Mount points under `dir`, from this process's mountinfo.
fn mounts_under(dir: &Path) -> Vec<String> {
    let dir = dir.to_string_lossy().into_owned();
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .filter(|m| m.starts_with(&dir))
        .collect()
}

/// The disk's ext4 as raw bytes in `scratch`, checked clean; its size in
/// bytes from `dumpe2fs -h`.
fn raw_ext4(d: &Daemon, disk: &str, scratch: &Path) -> (PathBuf, u64) {
    let raw = scratch.join(format!("{disk}.raw"));
    to_raw(&d.disk_path(disk), &raw);
    let header = assert_clean_ext4(&raw, disk);
    let field = |key: &str| -> u64 {
        header
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split(':').nth(1))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {key} in\n{header}"))
    };
    (raw, field("Block count:") * field("Block size:"))
}

/// Loop-mounted read-only for as long as it lives.
struct Mounted(tempfile::TempDir);

impl Mounted {
    fn new(raw: &Path) -> Mounted {
        let dir = tempfile::tempdir().unwrap();
        tool("mount", &["-o", "loop,ro", s(raw), s(dir.path())]);
        Mounted(dir)
    }
    fn path(&self, p: &str) -> PathBuf {
        self.0.path().join(p.trim_start_matches('/'))
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.0.path())
            .status();
    }
}

#[test]
fn a_rootfs_disk_is_grown_to_its_size_and_holds_its_files_and_a_path_through_a_symlink_fails() {
    let _serial = common::serial();
    let src = tempfile::Builder::new()
        .prefix("hearth-rootfs-src-")
        .tempdir()
        .unwrap();
    let layout = rootfs_layout(src.path());
    let motd = src.path().join("motd");
    fs::write(&motd, b"welcome to a hearth disk\n").unwrap();
    let d = start(src.path());
    let image = import(&d, &layout);
    let image_sum = sha256_file(&image);
    let image_bytes = fs::metadata(&image).unwrap().len();
    assert!(image_bytes < 256 * MIB, "the image is small: {image_bytes}");

    d.apply(vec![disk(
        "grown",
        "512Mi",
        vec![
            text_file(
                "/home/user/.ssh/authorized_keys",
                "ssh-ed25519 AAAA test\n",
                "0600",
                1000,
            ),
            host_file("/etc/motd", &motd),
        ],
    )]);
    let v = wait_final(&d, "grown");
    assert_eq!(v["status"]["phase"], "Ready", "{v:#}\n{}", d.log());

    let scratch = tempfile::tempdir().unwrap();
    let (raw, fs_bytes) = raw_ext4(&d, "grown", scratch.path());
    assert!(
        fs_bytes <= 512 * MIB && fs_bytes > 510 * MIB,
        "the ext4 is {fs_bytes} bytes, not about 512 MiB (the image is {image_bytes})"
    );
    {
        let m = Mounted::new(&raw);
        let key = m.path("/home/user/.ssh/authorized_keys");
        assert_eq!(fs::read(&key).unwrap(), b"ssh-ed25519 AAAA test\n");
        let meta = fs::symlink_metadata(&key).unwrap();
        assert!(meta.is_file());
        assert_eq!(meta.mode() & 0o7777, 0o600);
        assert_eq!((meta.uid(), meta.gid()), (1000, 1000));
        let parent = fs::symlink_metadata(m.path("/home/user/.ssh")).unwrap();
        assert!(parent.is_dir());
        assert_eq!((parent.mode() & 0o7777, parent.uid()), (0o755, 0));
        let motd_meta = fs::symlink_metadata(m.path("/etc/motd")).unwrap();
        assert_eq!(
            fs::read(m.path("/etc/motd")).unwrap(),
            b"welcome to a hearth disk\n"
        );
        assert_eq!((motd_meta.mode() & 0o7777, motd_meta.uid()), (0o644, 0));
        // What the files did not touch is the image's.
        assert_eq!(fs::read(m.path("/etc/hostname")).unwrap(), b"rootfs\n");
        assert_eq!(fs::read_link(m.path("/lib")).unwrap(), Path::new("usr/lib"));
    }
    // The image file below the disk is as it was.
    assert_eq!(sha256_file(&image), image_sum);

    // A VM without spec.boot on this kernel-less root filesystem: refused
    // at start, naming the disk field and what to give, and no QEMU runs
    // (the firmware would find no boot loader on a bare ext4).
    d.apply(vec![Vm::small("bare").disk("grown").no_boot().json()]);
    let v = d.wait_phase("bare", "Failed", WAIT);
    let err = v["status"]["lastError"].as_str().unwrap_or_default();
    assert!(
        err.starts_with("spec.disks[0]:") && err.contains("\"root\""),
        "{err}"
    );
    assert!(err.contains("spec.boot.kernelImage"), "{err}");
    assert_eq!(d.qemu_pids_of("bare"), Vec::<u32>::new());
    d.request("DELETE", "/v1/virtualmachines/bare", None);
    common::wait_until("VM gone", WAIT, || d.get_vm("bare").is_none());

    // A path through the image's /lib symlink: Failed, naming the disk and
    // the field, and no layer file, no daemon, no mount left.
    d.apply(vec![disk(
        "through-link",
        "512Mi",
        vec![
            text_file("/etc/ok", "fine\n", "0644", 0),
            text_file("/lib/evil.so", "x", "0644", 0),
        ],
    )]);
    let v = wait_final(&d, "through-link");
    assert_eq!(v["status"]["phase"], "Failed", "{v:#}");
    let why = v["status"]["lastError"].as_str().unwrap_or_default();
    assert!(
        why.contains("VirtualDisk \"through-link\"") && why.contains("spec.files[1].path"),
        "{why}"
    );
    assert!(why.contains("symlink"), "{why}");
    assert_eq!(layer_files(&d, "through-link"), Vec::<PathBuf>::new());
    assert_eq!(storage_daemons(&d.state_dir()), Vec::new());
    assert_eq!(mounts_under(&d.state_dir()), Vec::<String>::new());
    assert_eq!(sha256_file(&image), image_sum);
}

#[test]
fn a_hearthd_killed_while_a_disk_is_prepared_leaves_no_storage_daemon_and_the_disk_is_made_again() {
    let _serial = common::serial();
    let src = tempfile::Builder::new()
        .prefix("hearth-rootfs-src-")
        .tempdir()
        .unwrap();
    let layout = rootfs_layout(src.path());
    // Large enough that debugfs writes for a while through the export.
    let big = src.path().join("big");
    let bytes: Vec<u8> = (0..192 * MIB as usize)
        .map(|i| (i / 4096 % 251) as u8)
        .collect();
    fs::write(&big, &bytes).unwrap();
    let big_sum = sha256_file(&big);
    let mut d = start(src.path());
    import(&d, &layout);

    d.apply(vec![disk("big", "1Gi", vec![host_file("/opt/big", &big)])]);
    let state = d.state_dir();
    let mut seen = Vec::new();
    let found = common::eventually_every(Duration::from_millis(5), WAIT, || {
        seen = storage_daemons(&state);
        !seen.is_empty()
    });
    assert!(found, "no qemu-storage-daemon ever ran:\n{}", d.log());
    // The overlay it has open: the layer file being made.
    let overlay = seen[0]
        .1
        .split("filename=")
        .nth(1)
        .and_then(|r| r.split([' ', ',']).next())
        .map(PathBuf::from)
        .expect("the daemon names its image");
    d.kill();
    let gone = common::eventually(Duration::from_secs(10), || {
        storage_daemons(&state).is_empty()
    });
    assert!(
        gone,
        "a qemu-storage-daemon outlived hearthd: {:?}",
        storage_daemons(&state)
    );

    d.spawn();
    let v = wait_final(&d, "big");
    assert_eq!(v["status"]["phase"], "Ready", "{v:#}\n{}", d.log());
    let head = d.disk_path("big");
    assert_ne!(head, overlay, "the disk was made from scratch");
    assert!(!overlay.exists(), "the cut-short layer file is swept");
    assert_eq!(layer_files(&d, "big"), vec![head]);
    assert_eq!(mounts_under(&state), Vec::<String>::new());
    assert_eq!(storage_daemons(&state), Vec::new());

    let scratch = tempfile::tempdir().unwrap();
    let (raw, fs_bytes) = raw_ext4(&d, "big", scratch.path());
    assert!(
        fs_bytes > 1020 * MIB && fs_bytes <= 1024 * MIB,
        "{fs_bytes}"
    );
    let m = Mounted::new(&raw);
    assert_eq!(sha256_file(&m.path("/opt/big")), big_sum);
}
