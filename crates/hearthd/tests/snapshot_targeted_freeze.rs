//! A snapshot of some disks of a running VM freezes only the filesystems on
//! those disks; a VM snapshot freezes them all. Real QEMU, the real qemu-ga in
//! the test guest; the guest's own writers are the ground truth: a write(2)
//! to a frozen filesystem blocks until the thaw, so a writer on a disk that
//! is not frozen keeps completing writes while the frozen disk's writer
//! waits.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const SNAP_TIMEOUT: Duration = Duration::from_secs(90);
/// How long each writer runs (long enough for one snapshot of a booted VM).
const WRITE_SECONDS: u64 = 8;

/// One writer's report: the longest gaps between completed writes, as
/// (start, length) in guest ms, longest first.
struct Gaps(Vec<(f64, f64)>);

impl Gaps {
    /// This writer's longest listed gap that overlaps `(start, start + len)`.
    fn longest_in(&self, (start, len): (f64, f64)) -> Option<(f64, f64)> {
        self.0
            .iter()
            .copied()
            .filter(|&(s, l)| s < start + len && start < s + l)
            .max_by(|a, b| a.1.total_cmp(&b.1))
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
    // Every half second, not faster: each look runs programs in the guest.
    let mut reports: Vec<String> = Vec::new();
    let reported = eventually_every(Duration::from_millis(500), Duration::from_secs(60), || {
        reports = devs
            .iter()
            .map(|dev| {
                d.agent_sh(vm, &format!("cat /run/stall-{dev}.out 2>/dev/null"))
                    .1
            })
            .collect();
        reports.iter().all(|r| r.contains("top_gaps="))
    });
    assert!(reported, "writers did not report: {reports:?}");
    reports
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
        .collect()
}

/// The last freeze as the guest's fsfreeze hook timed it: (start, length)
/// in ms of the guest's clock, from its "freeze" line (written just before
/// qemu-ga's FIFREEZE) to the "thaw" line after it (just after FITHAW),
/// widened by the 10 ms resolution of /proc/uptime on each side.
fn last_freeze(d: &Daemon, vm: &str) -> (f64, f64) {
    let times = d.agent_sh_ok(vm, "cat /run/fsfreeze-times");
    let mut freeze = None;
    let mut found = None;
    for line in times.lines() {
        let mut f = line.split_whitespace();
        let (Some(what), Some(Ok(t))) = (f.next(), f.next().map(str::parse::<f64>)) else {
            continue;
        };
        match what {
            "freeze" => freeze = Some(t * 1000.0),
            "thaw" => {
                if let Some(start) = freeze.take() {
                    found = Some((start - 10.0, t * 1000.0 - start + 20.0));
                }
            }
            _ => {}
        }
    }
    found.unwrap_or_else(|| panic!("no freeze and thaw in the guest's hook times: {times:?}"))
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
    // Unexpedited freezes: each filesystem's freeze then takes its RCU
    // grace periods (~40 ms under TCG), so a filesystem frozen by mistake
    // stalls its writer for a good part of the other's stall. Expedited,
    // both freezes take a few ms and the difference drowns in the noise of
    // a shared host (the expedited step is tested in snapshot_expedite.rs).
    let vm = vm_yaml("tf", "AlwaysOn", &["data-a", "data-b"], "")
        .replace("spec:\n", "spec:\n  expediteFreeze: false\n");
    let m = manifest(
        &d,
        "vm.yaml",
        &format!(
            "{}---\n{}---\n{vm}",
            overlay_disk_yaml("data-a"),
            overlay_disk_yaml("data-b"),
        ),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_agent("tf");
    let on_vda = mounts_of(&d, "tf", "/dev/vda");
    let on_vdb = mounts_of(&d, "tf", "/dev/vdb");
    let devs = ["vda", "vdb"];

    // 1. A snapshot of data-b (the guest's vdb): only vdb's writer stalls.
    // The writers are timed by the guest's clock on a shared host: a vCPU
    // descheduled for a while stalls both writers at once, and a freeze is
    // short (~20 ms expedited), so one such stall can look like vda frozen
    // with vdb. A frozen vda would stall in every attempt; noise does not, so
    // the stall comparison may take up to three snapshots. Everything else
    // is checked on each of them.
    let mut seen = Vec::new();
    for attempt in 1..=3 {
        let name = format!("only-b-{attempt}");
        let (freezes, thaws) = hook_counts(&d, "tf");
        start_writers(&d, "tf", &devs);
        d.apply(vec![DiskSnapshot::of(&name, "data-b").json()]);
        let s = d.wait_final("virtualdisksnapshots", &name, SNAP_TIMEOUT);
        let gaps = collect_writers(&d, "tf", &devs);
        assert_eq!(s["status"]["phase"], "Ready", "{s:#}");
        assert_eq!(s["status"]["consistent"], true, "{s:#}");
        assert_eq!(s["status"]["frozenMountPoints"], on_vdb, "{s:#}");
        assert!(s["status"]["reason"].is_null(), "{s:#}");
        // The guest's own hook ran once for the freeze and once for the thaw.
        assert_eq!(hook_counts(&d, "tf"), (freezes + 1, thaws + 1));
        // vdb's stall is the one inside the freeze the guest's hook timed.
        let freeze = last_freeze(&d, "tf");
        let frozen = gaps[1].longest_in(freeze).unwrap_or_else(|| {
            panic!(
                "vdb's writer never stalled during the freeze {freeze:?}: {:?}",
                gaps[1].0
            )
        });
        // qemu-ga freezes one filesystem after another: had vda been frozen
        // too, its writer would have stalled for a good part of vdb's stall.
        let bound = frozen.1 / 4.0;
        let vda = gaps[0].longest_during(frozen, bound);
        eprintln!(
            "attempt {attempt}: vdb frozen {frozen:?}; vda's longest gap meanwhile {vda} ms; vda gaps {:?}",
            gaps[0].0
        );
        if vda < bound {
            seen.clear();
            break;
        }
        seen.push(format!(
            "vda's writer stalled {vda} ms while vdb was frozen ({frozen:?}): {:?}",
            gaps[0].0
        ));
    }
    assert!(seen.is_empty(), "in every attempt: {seen:#?}");

    // 2. A VM snapshot freezes everything: both writers stall together.
    let (freezes, thaws) = hook_counts(&d, "tf");
    start_writers(&d, "tf", &devs);
    d.apply(vec![VmSnapshot::of("all", "tf").json()]);
    let v = d.wait_final("virtualmachinesnapshots", "all", SNAP_TIMEOUT);
    let gaps = collect_writers(&d, "tf", &devs);
    assert_eq!(v["status"]["phase"], "Ready", "{v:#}");
    assert_eq!(hook_counts(&d, "tf"), (freezes + 1, thaws + 1));
    let children = v["status"]["virtualDiskSnapshotNames"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(children.len(), 2, "{v:#}");
    for c in children {
        let c = d
            .get("virtualdisksnapshots", c.as_str().expect("name"))
            .expect("a child snapshot");
        assert_eq!(c["status"]["consistent"], true, "{c:#}");
        let expected = if c["spec"]["virtualDiskName"] == "data-a" {
            &on_vda
        } else {
            &on_vdb
        };
        assert_eq!(&c["status"]["frozenMountPoints"], expected, "{c:#}");
    }
    // Both writers stalled inside the freeze the guest's hook timed, and
    // together: qemu-ga froze both filesystems before it thawed either.
    let freeze = last_freeze(&d, "tf");
    let in_freeze = |g: &Gaps, dev: &str| {
        g.longest_in(freeze).unwrap_or_else(|| {
            panic!(
                "{dev}'s writer did not stall during the freeze {freeze:?}: {:?}",
                g.0
            )
        })
    };
    let (a, b) = (in_freeze(&gaps[0], "vda"), in_freeze(&gaps[1], "vdb"));
    eprintln!("VM snapshot: freeze {freeze:?}, vda {a:?}, vdb {b:?}");
    assert!(
        a.0 < b.0 + b.1 && b.0 < a.0 + a.1,
        "the writers did not stall together: vda {a:?}, vdb {b:?}"
    );
}
