//! Snapshot schedules end to end, on the real clock: two running test
//! guests, a per-VM schedule picked by label and a group schedule, both
//! every minute. hearthd is down across two slots (one run at the restart,
//! for the latest), a run is pinned, retention keeps the newest, a user's
//! own snapshot is never touched. Every run is read back from the objects
//! hearthd made (their slot annotations, their cut times) and the guests'
//! freeze hooks.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::*;
use serde_json::Value;

const SLOT: &str = "hearth.dev/schedule-slot";

fn schedule_yaml(backups: &std::path::Path) -> String {
    format!(
        "{}---
apiVersion: hearth.dev/v1alpha1
kind: VirtualMachineSnapshotSchedule
metadata: {{name: saved}}
spec:
  schedule: \"* * * * *\"
  virtualMachineNames: [db]
  backup: {{to: {}, keep: 2}}
  retention: {{keep: 1}}
",
        snapshot_schedules(),
        backups.display()
    )
}

fn snapshot_schedules() -> String {
    "apiVersion: hearth.dev/v1alpha1
kind: VirtualMachineSnapshotSchedule
metadata: {name: minutely}
spec:
  schedule: \"* * * * *\"
  selector: {matchLabels: {tier: prod}}
  retention: {keep: 1}
---
apiVersion: hearth.dev/v1alpha1
kind: VirtualMachineSnapshotSchedule
metadata: {name: both}
spec:
  schedule: \"* * * * *\"
  timeZone: Europe/Berlin
  virtualMachineNames: [app, db]
  virtualMachineSnapshotGroupTemplate: {}
  retention: {keep: 1}
"
    .to_string()
}

/// The objects of `plural` a schedule made, as (name, slot, object).
fn runs(d: &Daemon, plural: &str, schedule: &str) -> Vec<(String, DateTime<Utc>, Value)> {
    let (_, list) = d.request("GET", &format!("/v1/{plural}"), None);
    let mut out: Vec<_> = list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|o| o["metadata"]["labels"]["hearth.dev/schedule"] == schedule)
        .filter(|o| o["status"]["phase"] != "Terminating")
        .map(|o| {
            let slot = o["metadata"]["annotations"][SLOT]
                .as_str()
                .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
                .unwrap_or_else(|| panic!("no slot annotation: {o:#}"))
                .with_timezone(&Utc);
            (
                o["metadata"]["name"].as_str().unwrap().to_string(),
                slot,
                o.clone(),
            )
        })
        .collect();
    out.sort_by_key(|r| r.1);
    out
}

fn slots(runs: &[(String, DateTime<Utc>, Value)]) -> Vec<DateTime<Utc>> {
    runs.iter().map(|r| r.1).collect()
}

fn schedule(d: &Daemon, name: &str) -> Value {
    d.get("virtualmachinesnapshotschedules", name)
        .unwrap_or_else(|| panic!("schedule {name} is gone"))
}

fn sleep_until(t: DateTime<Utc>) {
    if let Ok(d) = (t - Utc::now()).to_std() {
        std::thread::sleep(d);
    }
}

/// Waits until `f` holds of the schedule's runs; the runs.
fn wait_runs(
    d: &Daemon,
    plural: &str,
    schedule: &str,
    what: &str,
    f: impl Fn(&[(String, DateTime<Utc>, Value)]) -> bool,
) -> Vec<(String, DateTime<Utc>, Value)> {
    let mut last = Vec::new();
    let ok = hearth_test_support::eventually(Duration::from_secs(150), || {
        last = runs(d, plural, schedule);
        f(&last)
    });
    assert!(
        ok,
        "{schedule}: {what}: {:#?}",
        last.iter()
            .map(|r| (&r.0, r.1, &r.2["status"]))
            .collect::<Vec<_>>()
    );
    last
}

fn all_ready(r: &[(String, DateTime<Utc>, Value)]) -> bool {
    r.iter().all(|r| r.2["status"]["phase"] == "Ready")
}

#[test]
fn schedules_run_on_the_minute_once_after_downtime_and_keep_the_newest_and_the_pinned() {
    let _serial = serial();
    let mut d = Daemon::start();
    let m = manifest(
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
    d.cli_ok(&["apply", "-f", m.to_str().unwrap()]);
    d.wait_agent("app");
    d.wait_agent("db");
    d.cli_ok(&["label", "vm", "app", "tier=prod"]);
    // A user's own snapshot of the same VM: no schedule ever deletes it.
    d.cli_ok(&["snapshot", "vm", "app", "--name", "mine", "--wait"]);

    // Well inside a minute, so the first slot (A) is far enough ahead to
    // stop hearthd before it.
    use chrono::Timelike;
    while !(5..40).contains(&Utc::now().second()) {
        std::thread::sleep(Duration::from_millis(500));
    }
    let backups = d.dir.path().join("backups");
    let s = manifest(&d, "schedules.yaml", &schedule_yaml(&backups));
    d.cli_ok(&["apply", "-f", s.to_str().unwrap()]);
    let first = d.wait_object(
        "virtualmachinesnapshotschedules",
        "minutely",
        "the next run known",
        Duration::from_secs(20),
        |v| v["status"]["nextRunTime"].is_string(),
    );
    let slot_a: DateTime<Utc> = first["status"]["nextRunTime"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    // Down across two slots: A and B pass while hearthd is gone.
    d.kill();
    let slot_b = slot_a + chrono::Duration::minutes(1);
    sleep_until(slot_b + chrono::Duration::seconds(3));
    d.spawn();

    // One run at the start, for the latest slot (B); A never runs.
    let per_vm = wait_runs(
        &d,
        "virtualmachinesnapshots",
        "minutely",
        "one run for B",
        |r| r.len() == 1 && all_ready(r),
    );
    assert_eq!(slots(&per_vm), [slot_b]);
    assert!(
        per_vm[0].0.starts_with("minutely-app-"),
        "{:?}",
        per_vm[0].0
    );
    let groups = wait_runs(
        &d,
        "virtualmachinesnapshotgroups",
        "both",
        "one run for B",
        |r| r.len() == 1 && all_ready(r),
    );
    assert_eq!(slots(&groups), [slot_b]);
    let pinned = per_vm[0].0.clone();
    d.cli_ok(&["label", "vmsnapshot", &pinned, "hearth.dev/keep=true"]);

    // Slots C and D run on time; keep 1 then leaves D and the pinned B.
    let slot_d = slot_b + chrono::Duration::minutes(2);
    let per_vm = wait_runs(
        &d,
        "virtualmachinesnapshots",
        "minutely",
        "B (pinned) and D left",
        |r| slots(r) == [slot_b, slot_d] && all_ready(r),
    );
    for (name, slot, o) in &per_vm {
        assert_eq!(o["spec"]["virtualMachineName"], "app", "{name}");
        assert_eq!(o["status"]["consistent"], true, "{o:#}");
        if *slot == slot_d {
            let cut: DateTime<Utc> = o["status"]["cutTime"].as_str().unwrap().parse().unwrap();
            let late = (cut - *slot).num_milliseconds();
            assert!(
                (0..15_000).contains(&late),
                "{name} cut {late} ms after its slot"
            );
        }
    }
    let groups = wait_runs(
        &d,
        "virtualmachinesnapshotgroups",
        "both",
        "only D left",
        |r| slots(r) == [slot_d] && all_ready(r),
    );
    // The group's members are both VMs, cut together; the members of the
    // runs retention took are gone with them.
    let members: BTreeSet<String> = groups[0].2["status"]["virtualMachineSnapshotNames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap().to_string())
        .collect();
    assert_eq!(members.len(), 2, "{:#}", groups[0].2);
    wait_until(
        "the old group runs' members gone",
        Duration::from_secs(60),
        || {
            let (_, list) = d.request("GET", "/v1/virtualmachinesnapshots", None);
            list["items"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|o| o["metadata"]["name"].as_str())
                .filter(|n| n.starts_with("both-"))
                .all(|n| members.contains(n))
        },
    );
    assert!(d.get("virtualmachinesnapshots", "mine").is_some());
    assert!(d.get("virtualmachinesnapshots", &pinned).is_some());

    let st = schedule(&d, "minutely");
    assert_eq!(st["status"]["lastResult"], "Succeeded", "{st:#}");
    assert_eq!(st["status"]["snapshots"], 2, "{st:#}");
    let reasons = d.event_reasons("VirtualMachineSnapshotSchedule", "minutely");
    assert_eq!(
        reasons.iter().filter(|r| *r == "RunStarted").count(),
        3,
        "{reasons:?}"
    );
    assert!(reasons.iter().any(|r| r == "Pruned"), "{reasons:?}");

    // The backup schedule: one backup per slot (B full, C and D
    // incremental), `keep: 2` points in the target (B merged into C, which
    // is full now), `retention: keep 1` backup object.
    let saved = wait_runs(
        &d,
        "virtualmachinebackups",
        "saved",
        "only D's backup left",
        |r| slots(r) == [slot_d] && all_ready(r),
    );
    assert_eq!(
        saved[0].2["spec"]["to"],
        backups.join("db").to_str().unwrap()
    );
    let m: Value =
        serde_json::from_slice(&std::fs::read(backups.join("db/hearth-backup.json")).unwrap())
            .unwrap();
    let kinds: Vec<(u64, &str)> = m["points"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["point"].as_u64().unwrap(), p["kind"].as_str().unwrap()))
        .collect();
    assert_eq!(kinds, [(2, "Full"), (3, "Incremental")], "{m:#}");
    for p in m["points"].as_array().unwrap() {
        for f in p["files"].as_array().unwrap() {
            let file = backups.join("db").join(f["file"].as_str().unwrap());
            assert_eq!(sha256_file(&file), f["sha256"].as_str().unwrap());
        }
    }
    let cp = saved[0].2["status"]["checkpoint"].as_str().unwrap();
    assert!(d.get("virtualmachinesnapshots", cp).is_some(), "{cp}");
}
