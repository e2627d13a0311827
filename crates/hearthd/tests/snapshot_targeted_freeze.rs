//! A snapshot of some disks of a running VM freezes only the filesystems on
//! those disks; a VM snapshot freezes them all. Real QEMU, the real qemu-ga in
//! the test guest; the guest's own writers are the ground truth: a write(2)
//! to a frozen filesystem blocks until the thaw, so a writer on a disk that
//! is not frozen keeps completing writes while the frozen disk's writer
//! waits.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

const SNAP_TIMEOUT: Duration = Duration::from_secs(90);
/// How long each writer runs (long enough for one snapshot of a booted VM).
const WRITE_SECONDS: u64 = 8;

fn apply(d: &Daemon, items: Vec<Value>) {
    let (status, v) = d.request("POST", "/v1/apply", Some(&json!({"items": items})));
    assert_eq!(status, 200, "apply: {v}");
}

fn get(d: &Daemon, plural: &str, name: &str) -> Value {
    match d.request("GET", &format!("/v1/{plural}/{name}"), None) {
        (200, v) => v,
        (s, v) => panic!("GET {plural}/{name}: {s} {v}"),
    }
}

fn wait_final(d: &Daemon, plural: &str, name: &str) -> Value {
    let deadline = Instant::now() + SNAP_TIMEOUT;
    loop {
        let v = get(d, plural, name);
        if v["status"]["phase"] == "Ready" || v["status"]["phase"] == "Failed" {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{plural}/{name} not final: {v:#}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One writer's report: the longest gaps between completed writes, as
/// (start, length) in guest ms, longest first.
struct Gaps(Vec<(f64, f64)>);

impl Gaps {
    fn longest(&self) -> (f64, f64) {
        *self.0.first().expect("the writer reported no gap")
    }

    /// The longest of this writer's gaps that overlaps `(start, start +
    /// len)`. Only the longest gaps are reported, so the answer is known
    /// only up to the shortest one listed, which must be below `bound`.
    fn longest_during(&self, (start, len): (f64, f64), bound: f64) -> f64 {
        let shortest = self.0.last().map_or(f64::MAX, |g| g.1);
        assert!(
            shortest < bound,
            "inconclusive: every listed gap ({:?}) is at least {bound} ms",
            self.0
        );
        self.0
            .iter()
            .filter(|&&(s, l)| s < start + len && start < s + l)
            .map(|g| g.1)
            .fold(0.0, f64::max)
    }
}

fn start_writers(d: &Daemon, vm: &str, devs: &[&str]) {
    let script: String = devs
        .iter()
        .map(|dev| {
            format!(
                "rm -f /mnt/{dev}/stall.dat /run/stall-{dev}.out; \
                 /bin/stallwatch /mnt/{dev}/stall.dat {WRITE_SECONDS} > /run/stall-{dev}.out 2>&1 &\n"
            )
        })
        .collect();
    d.agent_sh_ok(vm, &script);
    let check: String = devs
        .iter()
        .map(|dev| format!("test -s /mnt/{dev}/stall.dat && "))
        .collect::<String>()
        + "true";
    wait_until("writers started", Duration::from_secs(20), || {
        d.agent_sh(vm, &check).0 == 0
    });
}

fn collect_writers(d: &Daemon, vm: &str, devs: &[&str]) -> Vec<Gaps> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let reports: Vec<String> = devs
            .iter()
            .map(|dev| {
                d.agent_sh(vm, &format!("cat /run/stall-{dev}.out 2>/dev/null"))
                    .1
            })
            .collect();
        if reports.iter().all(|r| r.contains("top_gaps=")) {
            return reports
                .iter()
                .map(|r| {
                    let field = r
                        .split_whitespace()
                        .find_map(|kv| kv.strip_prefix("top_gaps="))
                        .unwrap_or_default();
                    Gaps(
                        field
                            .split(',')
                            .filter_map(|g| {
                                let (a, b) = g.split_once(':')?;
                                Some((a.parse().ok()?, b.parse().ok()?))
                            })
                            .collect(),
                    )
                })
                .collect();
        }
        assert!(
            Instant::now() < deadline,
            "writers did not report: {reports:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The guest's own mount points of a device, sorted (from /proc/mounts).
fn mounts_of(d: &Daemon, vm: &str, dev: &str) -> Value {
    let mounts = d.agent_sh_ok(vm, "cat /proc/mounts");
    let mut v: Vec<String> = mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            (f.next() == Some(dev)).then(|| f.next().unwrap_or_default().to_string())
        })
        .collect();
    v.sort();
    assert!(!v.is_empty(), "{dev} is not mounted: {mounts}");
    json!(v)
}

#[test]
fn a_disk_snapshot_freezes_only_its_disk_and_a_vm_snapshot_freezes_all() {
    let _serial = serial();
    let d = Daemon::start();
    let m = manifest(
        &d,
        "vm.yaml",
        &format!(
            "{}---\n{}---\n{}",
            overlay_disk_yaml("data-a"),
            overlay_disk_yaml("data-b"),
            vm_yaml("tf", "AlwaysOn", &["data-a", "data-b"], "")
        ),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_agent("tf");
    let on_vda = mounts_of(&d, "tf", "/dev/vda");
    let on_vdb = mounts_of(&d, "tf", "/dev/vdb");
    let devs = ["vda", "vdb"];

    // 1. A snapshot of data-b (the guest's vdb): only vdb's writer stalls.
    let (freezes, thaws) = hook_counts(&d, "tf");
    start_writers(&d, "tf", &devs);
    apply(
        &d,
        vec![
            json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDiskSnapshot",
                    "metadata": {"name": "only-b"},
                    "spec": {"virtualDiskName": "data-b"}}),
        ],
    );
    let s = wait_final(&d, "virtualdisksnapshots", "only-b");
    let gaps = collect_writers(&d, "tf", &devs);
    assert_eq!(s["status"]["phase"], "Ready", "{s:#}");
    assert_eq!(s["status"]["consistent"], true, "{s:#}");
    assert_eq!(s["status"]["frozenMountPoints"], on_vdb, "{s:#}");
    assert!(s["status"]["reason"].is_null(), "{s:#}");
    // The guest's own hook ran once for the freeze and once for the thaw.
    assert_eq!(hook_counts(&d, "tf"), (freezes + 1, thaws + 1));
    let frozen = gaps[1].longest();
    let window = s["status"]["freezeWindowMs"].as_f64().expect("window");
    assert!(
        frozen.1 >= window / 4.0,
        "vdb's writer never stalled for the freeze: longest gap {frozen:?}, window {window} ms"
    );
    // qemu-ga freezes one filesystem after another: had vda been frozen
    // too, its writer would have stalled for a good part of vdb's stall.
    let bound = frozen.1 / 4.0;
    let vda = gaps[0].longest_during(frozen, bound);
    eprintln!(
        "vdb frozen {frozen:?}; vda's longest gap meanwhile {vda} ms; vda gaps {:?}",
        gaps[0].0
    );
    assert!(
        vda < bound,
        "vda's writer stalled {vda} ms while vdb was frozen ({frozen:?}): {:?}",
        gaps[0].0
    );

    // 2. A VM snapshot freezes everything: both writers stall together.
    let (freezes, thaws) = hook_counts(&d, "tf");
    start_writers(&d, "tf", &devs);
    apply(
        &d,
        vec![
            json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualMachineSnapshot",
                    "metadata": {"name": "all"}, "spec": {"virtualMachineName": "tf"}}),
        ],
    );
    let v = wait_final(&d, "virtualmachinesnapshots", "all");
    let gaps = collect_writers(&d, "tf", &devs);
    assert_eq!(v["status"]["phase"], "Ready", "{v:#}");
    assert_eq!(hook_counts(&d, "tf"), (freezes + 1, thaws + 1));
    let children = v["status"]["virtualDiskSnapshotNames"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(children.len(), 2, "{v:#}");
    for c in children {
        let c = get(&d, "virtualdisksnapshots", c.as_str().expect("name"));
        assert_eq!(c["status"]["consistent"], true, "{c:#}");
        let expected = if c["spec"]["virtualDiskName"] == "data-a" {
            &on_vda
        } else {
            &on_vdb
        };
        assert_eq!(&c["status"]["frozenMountPoints"], expected, "{c:#}");
    }
    // Each writer's longest stall is the freeze; they overlap.
    let (a, b) = (gaps[0].longest(), gaps[1].longest());
    eprintln!("VM snapshot: vda {a:?}, vdb {b:?}");
    assert!(
        a.0 < b.0 + b.1 && b.0 < a.0 + a.1,
        "the writers did not stall together: vda {a:?}, vdb {b:?}"
    );
}
