//! VirtualMachineSnapshotGroup end to end: real QEMU, the real qemu-ga in
//! each test guest. Claims are read from ground truth: each guest's own
//! writer (stallwatch: the time every write completed, on the guest's
//! clock, related to the host's), the guests' fsfreeze hooks on their
//! consoles, qemu-ga asked directly, and the restored images read on the
//! host with e2fsprogs.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

const FINAL: Duration = Duration::from_secs(120);

fn group(name: &str, vms: &[&str], required: bool) -> Value {
    SnapshotGroup::of(name, vms)
        .required_consistency(required)
        .json()
}

fn message(v: &Value) -> String {
    v["status"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// [`restored_raw`], and the check disk deleted again.
fn restored_raw_once(d: &Daemon, snapshot: &str, scratch: &Path) -> PathBuf {
    let raw = restored_raw(d, snapshot, scratch);
    d.cli_ok(&["delete", "disk", &format!("chk-{snapshot}")]);
    raw
}

/// Guest CLOCK_MONOTONIC → host ms since `epoch`: an interval (lo, hi) such
/// that host = guest + offset for some offset in it. Each probe brackets one
/// guest reading (`stallwatch -t` through the agent) between two host
/// readings; the intersection of ten is kept (the narrowest probe when they
/// do not intersect). Half the probes read the guest's clock early (a
/// program run through the agent, whose answer comes a poll later), half late
/// (`/proc/uptime` read through the agent's file calls, just before the
/// answer; 10 ms resolution), which bounds the offset from both sides.
/// (`CLOCK_BOOTTIME` is `CLOCK_MONOTONIC` in a guest that never suspends.)
fn clock_offset(d: &Daemon, vm: &str, epoch: Instant) -> (f64, f64) {
    let ms = |i: Instant| i.duration_since(epoch).as_secs_f64() * 1e3;
    let mut best = (f64::NEG_INFINITY, f64::INFINITY);
    let mut narrowest = (f64::NEG_INFINITY, f64::INFINITY);
    for k in 0..10 {
        let before = ms(Instant::now());
        let probe = if k % 2 == 0 {
            let out = d.agent_sh_ok(vm, "/bin/stallwatch -t");
            let after = ms(Instant::now());
            let g: f64 = out
                .trim()
                .strip_prefix("now_ms=")
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("stallwatch -t printed {out:?}"));
            (before - g, after - g)
        } else {
            let (status, body) = raw_request(
                &d.socket(),
                "GET",
                &format!("/v1/virtualmachines/{vm}/agent/files?path=/proc/uptime"),
                None,
            )
            .expect("GET /proc/uptime");
            let after = ms(Instant::now());
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            let text = String::from_utf8_lossy(&body).into_owned();
            let g: f64 = text
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("/proc/uptime read {text:?}"))
                * 1e3;
            // The reading lies in [g, g + 10 ms).
            (before - (g + 10.0), after - g)
        };
        best = (best.0.max(probe.0), best.1.min(probe.1));
        if probe.1 - probe.0 < narrowest.1 - narrowest.0 {
            narrowest = probe;
        }
    }
    if best.0 <= best.1 { best } else { narrowest }
}

/// What a guest's stallwatch run wrote: its records' send times (ms from
/// its start) and its absolute start and its longest gaps between two
/// completed writes (guest ms).
struct Run {
    start: f64,
    gaps: Vec<(f64, f64)>,
}

fn parse_run(out: &str) -> Run {
    let start = out
        .split_whitespace()
        .find_map(|w| w.strip_prefix("start_ms="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no start_ms in {out:?}"));
    let gaps = out
        .split_whitespace()
        .find_map(|w| w.strip_prefix("top_gaps="))
        .unwrap_or_default()
        .split(',')
        .filter_map(|g| {
            let (s, l) = g.split_once(':')?;
            Some((s.parse().ok()?, l.parse().ok()?))
        })
        .collect();
    Run { start, gaps }
}

/// The records of a stallwatch file: (index, ms from the run's start at
/// which the record was sent).
fn records(text: &str) -> Vec<(u64, f64)> {
    text.lines()
        .filter_map(|l| {
            let (n, t) = l.split_once(' ')?;
            Some((n.parse().ok()?, t.parse().ok()?))
        })
        .collect()
}

/// Checks a snapshot of `vm`'s disk against what its writer did: a clean
/// ext4 holding a prefix of the records, ending where the writer stalled
/// (the last record in it completed as a stall began, the next one only
/// when it ended). Returns that stall (start, length), guest ms.
fn image_stall(
    d: &Daemon,
    vm: &str,
    snapshot: &str,
    run: &Run,
    live: &[(u64, f64)],
    scratch: &Path,
) -> (f64, f64) {
    let raw = restored_raw_once(d, snapshot, scratch);
    assert_clean_ext4(&raw, snapshot);
    let image = records(&debugfs_cat(&raw, "/sw"));
    let _ = std::fs::remove_file(&raw);
    assert!(
        !image.is_empty(),
        "{snapshot}: the snapshot holds no record"
    );
    assert!(
        image.len() < live.len(),
        "{snapshot}: the writer went on after the cut"
    );
    assert_eq!(
        image[..],
        live[..image.len()],
        "{snapshot}: the image is a prefix of what the guest wrote"
    );
    let last = run.start + image[image.len() - 1].1;
    let next = run.start + live[image.len()].1;
    let stall = run
        .gaps
        .iter()
        .find(|(s, _)| *s >= last && *s <= next)
        .copied()
        .unwrap_or_else(|| {
            panic!(
                "{snapshot}: no stall between the image's end ({last}) and the next record ({next}): {:?}",
                run.gaps
            )
        });
    println!(
        "{vm}: {snapshot} ends at record {} of {}, stall {:.1} ms",
        image.len(),
        live.len(),
        stall.1
    );
    stall
}

#[test]
fn a_group_cuts_two_busy_guests_at_one_frozen_instant_and_restores_both() {
    let _serial = serial();
    let d = Daemon::start();
    let epoch = Instant::now();
    apply_manifest(
        &d,
        "vms.yaml",
        &format!(
            "{}---\n{}---\n{}---\n{}",
            overlay_disk_yaml("app-data"),
            overlay_disk_yaml("db-data"),
            vm_yaml("app", "AlwaysOn", &["app-data"], ""),
            vm_yaml("db", "AlwaysOn", &["db-data"], "")
        ),
    );
    d.wait_agent("app");
    d.wait_agent("db");
    let vms = ["app", "db"];
    let offsets: Vec<(f64, f64)> = vms.iter().map(|vm| clock_offset(&d, vm, epoch)).collect();
    for (vm, (lo, hi)) in vms.iter().zip(&offsets) {
        println!("{vm}: guest clock to host known within {:.1} ms", hi - lo);
    }
    let hooks_before: Vec<(usize, usize)> = vms.iter().map(|vm| hook_counts(&d, vm)).collect();

    // Each guest writes all the time: a record every 5 ms, for 12 s, with
    // the completion time of every write tracked by the writer.
    for vm in vms {
        d.agent_sh_ok(
            vm,
            "setsid sh -c '/bin/stallwatch /data/sw 12 5000 > /data/sw.out 2>&1' </dev/null >/dev/null 2>&1 &",
        );
    }
    // Deliberate: the writers run a while first, so the cut lands among
    // their writes.
    std::thread::sleep(Duration::from_secs(3));
    let out = d.cli(&[
        "snapshot", "group", "pair", "--vm", "app", "--vm", "db", "--wait",
    ]);
    assert!(
        out.status.success(),
        "hearth snapshot group: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        d.log()
    );
    let out = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.contains("vmsnapshotgroup/pair: Ready, consistent: true"),
        "{out}"
    );
    let g = d.wait_final("virtualmachinesnapshotgroups", "pair", FINAL);
    assert_eq!(g["status"]["phase"], "Ready", "{g:#}");
    assert_eq!(g["status"]["consistent"], true, "{g:#}");
    assert_eq!(
        g["status"]["virtualMachineSnapshotNames"],
        json!(["pair-app", "pair-db"])
    );
    let window = g["status"]["freezeWindowMs"].as_u64().expect("window");
    // A control for the check below: the same two guests snapshotted one
    // after the other, each by itself.
    for vm in vms {
        d.cli_ok(&[
            "snapshot",
            "vm",
            vm,
            "--name",
            &format!("solo-{vm}"),
            "--wait",
        ]);
    }
    println!("group frozen window (host, longest member): {window} ms");
    for vm in vms {
        let m = d
            .get("virtualmachinesnapshots", &format!("pair-{vm}"))
            .expect("member");
        assert_eq!(m["status"]["phase"], "Ready", "{m:#}");
        assert_eq!(m["status"]["consistent"], true, "{m:#}");
        assert_eq!(
            m["metadata"]["managedBy"], "VirtualMachineSnapshotGroup/pair",
            "{m:#}"
        );
    }
    // Each guest froze once and thawed once for the group and once for its
    // own snapshot (its own hook says so).
    for (i, vm) in vms.iter().enumerate() {
        let (f, t) = hook_counts(&d, vm);
        assert_eq!(
            (f - hooks_before[i].0, t - hooks_before[i].1),
            (2, 2),
            "{vm}"
        );
    }

    // The writers end; their own view of every stall.
    wait_until("the writers finish", Duration::from_secs(30), || {
        vms.iter()
            .all(|vm| d.agent_sh(vm, "cat /data/sw.out").1.contains("top_gaps="))
    });
    let scratch = tempfile::tempdir().expect("tempdir");
    let mut stalls = Vec::new();
    let mut solo = Vec::new();
    for (i, vm) in vms.iter().enumerate() {
        let run = parse_run(&d.agent_sh_ok(vm, "cat /data/sw.out"));
        let live = records(&d.agent_sh_ok(vm, "cat /data/sw"));
        let (lo, hi) = offsets[i];
        let stall = image_stall(
            &d,
            vm,
            &format!("pair-{vm}-{vm}-data"),
            &run,
            &live,
            scratch.path(),
        );
        // In host time, narrowed by the clock relation's uncertainty: the
        // guest could not write during all of it.
        stalls.push((stall.0 + hi, stall.0 + stall.1 + lo));
        let alone = image_stall(
            &d,
            vm,
            &format!("solo-{vm}-{vm}-data"),
            &run,
            &live,
            scratch.path(),
        );
        // Widened: the guest may have written at any time outside it.
        solo.push((alone.0 + lo, alone.0 + alone.1 + hi));
    }
    // The control: two VM snapshots taken one after the other stall their
    // guests at different times, and this check tells them apart.
    assert!(
        solo[0].1 < solo[1].0 || solo[1].1 < solo[0].0,
        "two snapshots taken one after the other show overlapping stalls (host ms): {solo:?}"
    );
    println!(
        "control, one VM snapshot after the other: stalls {:.1} ms apart",
        (solo[1].0 - solo[0].1).max(solo[0].0 - solo[1].1)
    );
    // Both stalls overlap: there is one instant at which neither guest
    // could write, and both images end before it.
    let latest_start = stalls.iter().map(|s| s.0).fold(f64::MIN, f64::max);
    let earliest_end = stalls.iter().map(|s| s.1).fold(f64::MAX, f64::min);
    assert!(
        latest_start < earliest_end,
        "the members' stalls do not overlap (host ms): {stalls:?}"
    );
    println!(
        "common frozen instant: host {latest_start:.1}..{earliest_end:.1} ms ({:.1} ms)",
        earliest_end - latest_start
    );

    // Restore the whole group: both VMs come back with their disks as cut.
    let out = d.cli_ok(&["restore", "vmsnapshotgroup", "pair"]);
    assert!(out.contains("2 VM(s) restored"), "{out}");
    for vm in vms {
        d.wait_agent(vm);
        let raw_count = records(&d.agent_sh_ok(vm, "cat /data/sw")).len();
        let snap = format!("pair-{vm}-{vm}-data");
        let raw = restored_raw_once(&d, &snap, scratch.path());
        assert_eq!(
            raw_count,
            records(&debugfs_cat(&raw, "/sw")).len(),
            "{vm}: the restored VM reads its snapshot's records"
        );
    }

    let table = d.cli_ok(&["get", "vmsnapshotgroups"]);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("pair ") && l.contains("app,db") && l.contains("Ready")),
        "{table}"
    );

    // Deleting the group deletes its member snapshots.
    d.cli_ok(&["delete", "vmsnapshotgroup", "pair"]);
    d.wait_gone(
        "virtualmachinesnapshotgroups",
        "pair",
        Duration::from_secs(60),
    );
    for vm in vms {
        assert!(
            d.get("virtualmachinesnapshots", &format!("pair-{vm}"))
                .is_none()
        );
        assert!(
            d.get("virtualdisksnapshots", &format!("pair-{vm}-{vm}-data"))
                .is_none()
        );
    }
}

#[test]
fn no_agent_a_slow_freeze_hook_and_a_sigkill_fail_the_whole_group_and_thaw_every_member() {
    let _serial = serial();
    let mut d = Daemon::start();
    let slow = |deadline: u32| {
        vm_yaml(
            "slow",
            "AlwaysOn",
            &["slow-data"],
            "hearth.freeze_hook_sleep=4",
        )
        .replace(
            "memory: 256Mi",
            &format!("memory: 256Mi\n  freezeDeadlineSeconds: {deadline}"),
        )
    };
    apply_manifest(
        &d,
        "vms.yaml",
        &format!(
            "{}---\n{}---\n{}---\n{}---\n{}---\n{}",
            overlay_disk_yaml("app-data"),
            overlay_disk_yaml("blind-data"),
            overlay_disk_yaml("slow-data"),
            vm_yaml("app", "AlwaysOn", &["app-data"], ""),
            vm_yaml("blind", "AlwaysOn", &["blind-data"], "")
                .replace("memory: 256Mi", "memory: 256Mi\n  guestAgent: false"),
            slow(3)
        ),
    );
    d.wait_agent("app");
    d.wait_agent("slow");
    d.wait_phase("blind", "Running", Duration::from_secs(60));

    // 1. A member without an agent fails a required group; the other
    //    member is never frozen.
    let before = hook_counts(&d, "app");
    let (status, v) = d.apply_json(vec![group("blind-req", &["app", "blind"], true)]);
    assert_eq!(status, 200, "{v}");
    let g = d.wait_final("virtualmachinesnapshotgroups", "blind-req", FINAL);
    assert_eq!(g["status"]["phase"], "Failed", "{g:#}");
    assert!(message(&g).contains("\"blind\""), "names the member: {g:#}");
    assert!(message(&g).contains("guestAgent"), "says why: {g:#}");
    for m in ["blind-req-app", "blind-req-blind"] {
        let m = d.wait_final("virtualmachinesnapshots", m, FINAL);
        assert_eq!(m["status"]["phase"], "Failed", "{m:#}");
    }
    assert_eq!(hook_counts(&d, "app"), before, "app was never frozen");
    // ... and with consistency not required, the group is taken, marked
    // not consistent, with the agent's member consistent.
    let (status, v) = d.apply_json(vec![group("blind-may", &["app", "blind"], false)]);
    assert_eq!(status, 200, "{v}");
    let g = d.wait_final("virtualmachinesnapshotgroups", "blind-may", FINAL);
    assert_eq!(g["status"]["phase"], "Ready", "{g:#}");
    assert_eq!(g["status"]["consistent"], false, "{g:#}");
    let app = d
        .get("virtualmachinesnapshots", "blind-may-app")
        .expect("app member");
    assert_eq!(app["status"]["consistent"], true, "{app:#}");
    let blind = d
        .get("virtualmachinesnapshots", "blind-may-blind")
        .expect("blind member");
    assert_eq!(blind["status"]["consistent"], false, "{blind:#}");
    let after = hook_counts(&d, "app");
    assert_eq!((after.0 - before.0, after.1 - before.1), (1, 1));

    // 2. A member whose freeze hook (4 s) outlasts the group's deadline
    //    (3 s, slow's freezeDeadlineSeconds): the group fails, and app,
    //    frozen and waiting for slow, is thawed at once — while slow is
    //    still in its hook.
    let app0 = hook_counts(&d, "app");
    let slow0 = hook_counts(&d, "slow");
    let (status, v) = d.apply_json(vec![group("late", &["app", "slow"], true)]);
    assert_eq!(status, 200, "{v}");
    assert!(
        eventually_every(Duration::from_millis(20), Duration::from_secs(60), || {
            hook_counts(&d, "app") == (app0.0 + 1, app0.1 + 1)
        }),
        "app not frozen and thawed: {:?} from {app0:?}; {:#}\n{}",
        hook_counts(&d, "app"),
        d.get("virtualmachinesnapshotgroups", "late")
            .unwrap_or_default(),
        d.log()
    );
    assert_eq!(
        hook_counts(&d, "slow"),
        (slow0.0 + 1, slow0.1),
        "slow is still in its freeze hook when app is thawed"
    );
    let g = d.wait_final("virtualmachinesnapshotgroups", "late", FINAL);
    assert_eq!(g["status"]["phase"], "Failed", "{g:#}");
    assert!(message(&g).contains("deadline"), "{g:#}");
    for m in ["late-app", "late-slow"] {
        let m = d.wait_final("virtualmachinesnapshots", m, FINAL);
        assert_eq!(m["status"]["phase"], "Failed", "{m:#}");
    }
    // slow's freeze happened after its hook; the thaw queued behind it
    // undid it.
    wait_until("slow thawed", Duration::from_secs(30), || {
        hook_counts(&d, "slow") == (slow0.0 + 1, slow0.1 + 1)
    });
    assert_eq!(freeze_status(&d, "slow"), "thawed");
    assert_eq!(freeze_status(&d, "app"), "thawed");

    // 3. hearthd is SIGKILLed mid-group: app frozen, waiting at the
    //    barrier for slow (now with a 10 s deadline), whose hook sleeps.
    apply_manifest(
        &d,
        "slow.yaml",
        &format!("{}---\n{}", overlay_disk_yaml("slow-data"), slow(10)),
    );
    let app0 = hook_counts(&d, "app");
    let slow0 = hook_counts(&d, "slow");
    let (status, v) = d.apply_json(vec![group("killed", &["app", "slow"], true)]);
    assert_eq!(status, 200, "{v}");
    wait_until(
        "app's freeze and slow's hook",
        Duration::from_secs(60),
        || hook_counts(&d, "app").0 == app0.0 + 1 && hook_counts(&d, "slow").0 == slow0.0 + 1,
    );
    // Deliberate: the hook prints before qemu-ga freezes; a moment more and
    // app's freeze has taken effect when the daemon dies.
    std::thread::sleep(Duration::from_millis(300));
    d.kill();
    // With no daemon: app is frozen, and slow freezes once its hook ends.
    let app_sock = d.run_dir().join("vms/app/agent.sock");
    let slow_sock = d.run_dir().join("vms/slow/agent.sock");
    assert_eq!(agent_freeze_status(&app_sock).as_deref(), Some("frozen"));
    wait_until(
        "slow frozen with no daemon",
        Duration::from_secs(30),
        || agent_freeze_status(&slow_sock).as_deref() == Some("frozen"),
    );
    d.spawn();
    let g = d.wait_final("virtualmachinesnapshotgroups", "killed", FINAL);
    assert_eq!(g["status"]["phase"], "Failed", "{g:#}");
    assert!(message(&g).contains("restarted"), "{g:#}");
    for m in ["killed-app", "killed-slow"] {
        let m = d.wait_final("virtualmachinesnapshots", m, FINAL);
        assert_eq!(
            m["status"]["phase"], "Failed",
            "no half group shown Ready: {m:#}"
        );
    }
    // Both guests were thawed by the restarted daemon: their hooks saw it.
    wait_until("both thawed", Duration::from_secs(30), || {
        hook_counts(&d, "app") == (app0.0 + 1, app0.1 + 1)
            && hook_counts(&d, "slow") == (slow0.0 + 1, slow0.1 + 1)
    });
    assert_eq!(freeze_status(&d, "app"), "thawed");
    assert_eq!(freeze_status(&d, "slow"), "thawed");
    // No overlay left behind: every layer file is in a disk's chain or a
    // snapshot's.
    let layers = d.state_dir().join("layers");
    let mut kept: BTreeSet<PathBuf> = BTreeSet::new();
    for disk in ["app-data", "blind-data", "slow-data"] {
        let head = PathBuf::from(
            d.get_disk(disk).expect("disk")["status"]["path"]
                .as_str()
                .expect("path"),
        );
        kept.extend(backing_chain(&head));
    }
    let stray: Vec<PathBuf> = std::fs::read_dir(&layers)
        .expect("layers")
        .flatten()
        .map(|e| e.path())
        .filter(|p| !kept.contains(p))
        .collect();
    assert!(
        stray.is_empty(),
        "layer files outside every disk's chain: {stray:?}"
    );

    // The VMs are still usable for a group afterwards.
    let (status, v) = d.apply_json(vec![group("after", &["app", "slow"], true)]);
    assert_eq!(status, 200, "{v}");
    let g = d.wait_final("virtualmachinesnapshotgroups", "after", FINAL);
    assert_eq!(g["status"]["phase"], "Ready", "{g:#}\n{}", d.log());
    assert_eq!(g["status"]["consistent"], true, "{g:#}");

    // 4. A group deleted while it is being taken (slow still in its hook)
    //    shows Terminating, goes once its members have settled, takes them
    //    with it, and leaves both guests thawed.
    let app0 = hook_counts(&d, "app");
    let (status, v) = d.apply_json(vec![group("doomed", &["app", "slow"], true)]);
    assert_eq!(status, 200, "{v}");
    wait_until("app frozen for doomed", Duration::from_secs(60), || {
        hook_counts(&d, "app").0 == app0.0 + 1
    });
    d.cli_ok(&["delete", "vmsnapshotgroup", "doomed"]);
    // The group's reconcile writes Terminating after the delete returns; it
    // cannot go before `slow` leaves its hook, so it is seen on the way.
    let g = d.wait_object(
        "virtualmachinesnapshotgroups",
        "doomed",
        "Terminating",
        Duration::from_secs(30),
        |g| g["status"]["phase"] == "Terminating",
    );
    assert_eq!(g["status"]["phase"], "Terminating", "{g:#}");
    d.wait_gone(
        "virtualmachinesnapshotgroups",
        "doomed",
        Duration::from_secs(60),
    );
    for m in ["doomed-app", "doomed-slow"] {
        d.wait_gone("virtualmachinesnapshots", m, Duration::from_secs(60));
    }
    wait_until("both thawed after doomed", Duration::from_secs(30), || {
        let (af, at) = hook_counts(&d, "app");
        let (sf, st) = hook_counts(&d, "slow");
        af == at && sf == st
    });
    assert_eq!(freeze_status(&d, "app"), "thawed");
    assert_eq!(freeze_status(&d, "slow"), "thawed");
}
