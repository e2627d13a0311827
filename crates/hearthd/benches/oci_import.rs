//! Benchmark (not a test): an OCI rootfs image pulled from a registry and
//! built into an ext4 image by hearth, against doing the same by hand
//! (`skopeo copy` to an OCI layout, `umoci unpack`, `mkfs.ext4 -d`), in the
//! same run, alternating.
//!
//! The image is the Debian test guest's root filesystem
//! (guest/out/debian-12.qcow2, partition 1) as one gzip layer, pushed to a
//! real registry (docker-registry, plain http) on 127.0.0.1. Each of RUNS
//! rounds (default 3, `HEARTH_BENCH_RUNS`), with a fresh hearthd each time
//! so nothing is stored yet:
//! - hearth rootfs: apply the VirtualImage, time until `phase: Ready` (the
//!   pull with every blob hashed as it streams, the layer applied, the ext4
//!   built, the checks and the commit);
//! - a disk over that image, twice: time until each disk is Ready (an
//!   overlay, whatever the image's size);
//! - hearth pull alone: a containerDisk image of the Debian qcow2 (no build
//!   step), time until Ready, against `skopeo copy` of the same image;
//! - by hand: `skopeo copy docker://... oci:DIR:TAG`, `umoci unpack`, and
//!   `mkfs.ext4 -d` into a file of the size hearth made, timed apart.
//!
//! Prints a markdown table for docs/benchmarks.md.
//! Run: `cargo bench -p hearthd --bench oci_import`.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;
use support::{loadavg, stats};

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::Daemon;
use hearth_test_support::oci::{TestRegistry, tool, umoci_image};
use serde_json::{Value, json};

const READY: Duration = Duration::from_secs(900);

struct Round {
    rootfs: Duration,
    disks: [Duration; 2],
    pull: Duration,
    skopeo: Duration,
    unpack: Duration,
    mkfs: Duration,
    skopeo_disk: Duration,
    load: String,
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!(
            "oci_import: a benchmark; run it with `cargo bench -p hearthd --bench oci_import`"
        );
        return;
    }
    let runs: usize = std::env::var("HEARTH_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    for (program, package) in [
        ("umoci", "umoci"),
        ("skopeo", "skopeo"),
        ("docker-registry", "docker-registry"),
        ("mkfs.ext4", "e2fsprogs"),
        ("sfdisk", "fdisk"),
        ("qemu-img", "qemu-utils"),
    ] {
        assert!(
            Command::new("sh")
                .args(["-c", &format!("command -v {program}")])
                .status()
                .is_ok_and(|s| s.success()),
            "{program} is missing: run `.ci/install-deps.sh` (apt-get install {package})"
        );
    }
    let qcow2 = common::repo_root().join("guest/out/debian-12.qcow2");
    assert!(
        qcow2.is_file(),
        "{} is missing: run `guest/debian/build.sh`",
        qcow2.display()
    );
    let scratch = tempfile::Builder::new()
        .prefix("hearth-bench-oci-")
        .tempdir()
        .expect("scratch");
    let layout = scratch.path().join("layout");
    let tree_bytes = debian_layer(&qcow2, scratch.path(), &layout);
    umoci_image(&layout, "disk", |root| {
        std::fs::create_dir_all(root.join("disk")).expect("disk dir");
        std::fs::copy(&qcow2, root.join("disk/disk.qcow2")).expect("copy the qcow2");
    });
    let registry = TestRegistry::start(false);
    let rootfs_ref = registry.push(&layout, "debian", "bench/debian:12");
    let disk_ref = registry.push(&layout, "disk", "bench/debian-disk:12");
    let layer_bytes: u64 = blob_bytes(&layout);
    eprintln!(
        "oci_import: Debian tree {} MiB, layout blobs {} MiB, {runs} round(s)",
        tree_bytes >> 20,
        layer_bytes >> 20
    );

    let mut rounds = Vec::new();
    let mut image_size = 0;
    for i in 0..runs {
        let load = loadavg();
        let d = Daemon::start_without_guest(&[scratch.path()], &[]);
        let t0 = Instant::now();
        d.apply(vec![image("rootfs", &rootfs_ref)]);
        let v = d.wait_image_phase("rootfs", "Ready", READY);
        let rootfs = t0.elapsed();
        image_size = v["status"]["size"].as_u64().expect("size");
        let mut disks = [Duration::ZERO; 2];
        for (n, slot) in disks.iter_mut().enumerate() {
            let name = format!("disk-{n}");
            let t = Instant::now();
            d.apply(vec![
                json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk",
                "metadata": {"name": name},
                "spec": {"source": {"virtualImage": "rootfs"}}}),
            ]);
            d.wait_object("virtualdisks", &name, "phase Ready", READY, |v| {
                v["status"]["phase"] == "Ready"
            });
            *slot = t.elapsed();
        }
        let t1 = Instant::now();
        d.apply(vec![image("disk", &disk_ref)]);
        d.wait_image_phase("disk", "Ready", READY);
        let pull = t1.elapsed();
        drop(d);

        let by_hand = scratch.path().join("by-hand");
        let _ = std::fs::remove_dir_all(&by_hand);
        std::fs::create_dir_all(&by_hand).expect("by-hand dir");
        let copy = |reference: &str, dir: &Path| {
            let t = Instant::now();
            run(Command::new("skopeo").args([
                "copy",
                "-q",
                "--src-tls-verify=false",
                &format!("docker://{reference}"),
                &format!("oci:{}:t", s(dir)),
            ]));
            t.elapsed()
        };
        let skopeo = copy(&rootfs_ref, &by_hand.join("layout"));
        let t2 = Instant::now();
        run(Command::new("umoci").args([
            "unpack",
            "--image",
            &format!("{}:t", s(&by_hand.join("layout"))),
            s(&by_hand.join("bundle")),
        ]));
        let unpack = t2.elapsed();
        let t3 = Instant::now();
        run(Command::new("mkfs.ext4").args([
            "-q",
            "-F",
            "-d",
            s(&by_hand.join("bundle/rootfs")),
            s(&by_hand.join("root.ext4")),
            &format!("{}k", image_size / 1024),
        ]));
        let mkfs = t3.elapsed();
        let skopeo_disk = copy(&disk_ref, &by_hand.join("disk-layout"));
        std::fs::remove_dir_all(&by_hand).expect("remove the by-hand files");
        eprintln!(
            "oci_import: round {}: hearth rootfs {} ms, disks {} + {} ms, containerDisk pull {} ms; skopeo {} + umoci {} + mkfs {} ms, skopeo (disk) {} ms (load {load})",
            i + 1,
            rootfs.as_millis(),
            disks[0].as_millis(),
            disks[1].as_millis(),
            pull.as_millis(),
            skopeo.as_millis(),
            unpack.as_millis(),
            mkfs.as_millis(),
            skopeo_disk.as_millis(),
        );
        rounds.push(Round {
            rootfs,
            disks,
            pull,
            skopeo,
            unpack,
            mkfs,
            skopeo_disk,
            load,
        });
    }

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!();
    println!(
        "| round | hearth rootfs (ms) | skopeo (ms) | umoci unpack (ms) | mkfs.ext4 -d (ms) | by hand (ms) | ratio | 1st disk (ms) | 2nd disk (ms) | hearth containerDisk (ms) | skopeo (ms) | load avg |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (i, r) in rounds.iter().enumerate() {
        let hand = r.skopeo + r.unpack + r.mkfs;
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {} |",
            i + 1,
            ms(r.rootfs),
            ms(r.skopeo),
            ms(r.unpack),
            ms(r.mkfs),
            ms(hand),
            ms(r.rootfs) / ms(hand),
            ms(r.disks[0]),
            ms(r.disks[1]),
            ms(r.pull),
            ms(r.skopeo_disk),
            r.load
        );
    }
    let med = |f: &dyn Fn(&Round) -> f64| stats(&rounds.iter().map(f).collect::<Vec<_>>()).0;
    println!();
    println!(
        "median: hearth rootfs {:.0} ms, by hand {:.0} ms (ratio {:.2}); disk over it {:.0} ms; containerDisk pull {:.0} ms against skopeo copy {:.0} ms; ext4 image {} MiB",
        med(&|r| ms(r.rootfs)),
        med(&|r| ms(r.skopeo + r.unpack + r.mkfs)),
        med(&|r| ms(r.rootfs) / ms(r.skopeo + r.unpack + r.mkfs)),
        med(&|r| ms(r.disks[1])),
        med(&|r| ms(r.pull)),
        med(&|r| ms(r.skopeo_disk)),
        image_size >> 20
    );
}

fn image(name: &str, reference: &str) -> Value {
    json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualImage",
        "metadata": {"name": name},
        "spec": {"source": {"oci": {"reference": reference, "insecure": true}}}})
}

/// Puts the Debian image's root filesystem into `layout` as image `debian`
/// (one gzip layer, as `umoci raw add-layer` writes it); returns the tree's
/// size in bytes as tar counts it.
fn debian_layer(qcow2: &Path, scratch: &Path, layout: &Path) -> u64 {
    let raw = scratch.join("debian.raw");
    run(Command::new("qemu-img").args(["convert", "-O", "raw", s(qcow2), s(&raw)]));
    let table: Value = serde_json::from_str(&tool("sfdisk", &["-J", s(&raw)])).expect("sfdisk -J");
    let root = table["partitiontable"]["partitions"]
        .as_array()
        .expect("partitions")
        .iter()
        .find(|p| p["node"].as_str().is_some_and(|n| n.ends_with("raw1")))
        .expect("partition 1");
    let offset = root["start"].as_u64().expect("start") * 512;
    let mnt = scratch.join("mnt");
    std::fs::create_dir_all(&mnt).expect("mountpoint");
    tool(
        "mount",
        &["-o", &format!("loop,ro,offset={offset}"), s(&raw), s(&mnt)],
    );
    let tar = scratch.join("debian.tar");
    let made = Command::new("tar")
        .args(["--numeric-owner", "--xattrs", "--xattrs-include=*", "-C"])
        .arg(&mnt)
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .output();
    tool("umount", &[s(&mnt)]);
    let made = made.expect("tar");
    assert!(
        made.status.success(),
        "tar: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    std::fs::remove_file(&raw).expect("remove the raw image");
    let bytes = std::fs::metadata(&tar).expect("tar").len();
    tool("umoci", &["init", "--layout", s(layout)]);
    let image = format!("{}:debian", s(layout));
    tool("umoci", &["new", "--image", &image]);
    tool("umoci", &["raw", "add-layer", "--image", &image, s(&tar)]);
    std::fs::remove_file(&tar).expect("remove the tar");
    bytes
}

fn blob_bytes(layout: &Path) -> u64 {
    std::fs::read_dir(layout.join("blobs/sha256"))
        .expect("blobs")
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("spawn");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
