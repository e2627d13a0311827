use super::events::EVENTS_PER_OBJECT;
use super::*;
use crate::runtime::{LaunchMarker, RuntimeRecord};
use chrono::Utc;
use hearth_api::{EventType, Object};
use hearth_api::{VirtualMachineStatus, VmPhase, parse_documents};
use serde_json::Value;

fn disk(name: &str) -> Object {
    parse_documents(
        &format!("apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {{name: {name}}}\nspec: {{size: 1Gi, source: {{blank: {{}}}}}}\n"),
        "t",
    )
    .unwrap()
    .remove(0)
}

fn created(name: &str, at: &str) -> Object {
    let mut d = disk(name);
    d.metadata_mut().creation_timestamp = Some(at.parse().unwrap());
    d
}

fn reasons(s: &Store, name: Option<&str>) -> Vec<String> {
    s.events(Some(Kind::VirtualDisk), name, 100)
        .unwrap()
        .into_iter()
        .map(|e| e.reason)
        .collect()
}

#[test]
fn events_belong_to_the_life_of_their_object() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(&dir.path().join("t.db")).unwrap();
    let ev = |reason: &str| {
        s.record_event(Kind::VirtualDisk, "d", EventType::Normal, reason, "m")
            .unwrap()
    };
    ev("BeforeAnyLife");
    s.put_objects(&[created("d", "2026-01-01T00:00:00.000000001Z")])
        .unwrap();
    ev("Created");
    ev("Ready");
    s.remove(Kind::VirtualDisk, "d").unwrap();
    // Recorded once the object is gone: still its life's.
    ev("Deleted");
    assert_eq!(reasons(&s, Some("d")), ["Created", "Ready", "Deleted"]);
    s.put_objects(&[created("d", "2026-01-01T00:00:05Z")])
        .unwrap();
    ev("Created");
    assert_eq!(reasons(&s, Some("d")), ["Created"]);
    // Without a name, every event of every life.
    assert_eq!(
        reasons(&s, None),
        ["BeforeAnyLife", "Created", "Ready", "Deleted", "Created"]
    );
    // The watch's initial list agrees.
    let snap = s
        .watch_snapshot(&[Kind::VirtualDisk], false, Some("d"), false, 100)
        .unwrap();
    let got: Vec<&str> = snap.events.iter().map(|(_, e)| e.reason.as_str()).collect();
    assert_eq!(got, ["Created"]);
}

#[test]
fn an_older_database_gets_lives_for_the_events_of_its_objects() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    {
        let s = Store::open(&path).unwrap();
        s.put_objects(&[created("d", "2026-01-01T00:00:00Z")])
            .unwrap();
        s.record_event(Kind::VirtualDisk, "d", EventType::Normal, "Old", "m")
            .unwrap();
        s.record_event(Kind::VirtualDisk, "gone", EventType::Normal, "Old", "m")
            .unwrap();
    }
    // As a database from before the column.
    let conn = Connection::open(&path).unwrap();
    conn.execute_batch(
        "CREATE TABLE before AS SELECT id, time, kind, name, type, reason, message, seq FROM events;
         DROP TABLE events;
         ALTER TABLE before RENAME TO events;",
    )
    .unwrap();
    drop(conn);
    let s = Store::open(&path).unwrap();
    assert_eq!(reasons(&s, Some("d")), ["Old"]);
    assert_eq!(reasons(&s, Some("gone")), ["Old"]);
}

#[test]
fn credentials_in_event_messages_and_status_are_not_stored() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(&dir.path().join("t.db")).unwrap();
    s.put_objects(&[created("d", "2026-01-01T00:00:00Z")])
        .unwrap();
    s.record_event(
        Kind::VirtualDisk,
        "d",
        EventType::Warning,
        "Failed",
        "GET https://u:secret@h/x: 404",
    )
    .unwrap();
    s.update_status(Kind::VirtualDisk, "d", |st: &mut Value| {
        *st = serde_json::json!({"message": "GET https://u:secret@h/x: 404"});
    })
    .unwrap();
    let conn = s.conn();
    let dump: String = conn
        .query_row(
            "SELECT (SELECT group_concat(message) FROM events) || (SELECT group_concat(status) FROM objects) || (SELECT group_concat(body) FROM changes)",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(!dump.contains("secret"), "{dump}");
    assert!(dump.contains("https://***@h/x"), "{dump}");
}

fn lease(network: &str, vm: &str, interface: u32, ip: &str) -> StoredLease {
    StoredLease {
        network: network.into(),
        vm: vm.into(),
        interface,
        ip: ip.parse().unwrap(),
        mac: format!("02:00:00:00:00:0{interface}"),
    }
}

#[test]
fn leases_survive_reopen_and_go_with_their_vm_or_network() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hearth.db");
    {
        let s = Store::open(&path).unwrap();
        s.set_vm_leases(
            "web",
            &[
                lease("lan", "web", 0, "10.77.0.10"),
                lease("lab", "web", 1, "10.78.0.10"),
            ],
        )
        .unwrap();
        s.set_vm_leases("db", &[lease("lan", "db", 0, "10.77.0.11")])
            .unwrap();
    }
    let s = Store::open(&path).unwrap();
    assert_eq!(s.leases().unwrap().len(), 3);
    assert_eq!(
        s.leases_of_network("lan").unwrap(),
        vec![
            lease("lan", "db", 0, "10.77.0.11"),
            lease("lan", "web", 0, "10.77.0.10")
        ]
    );
    // Rewriting a VM's set drops what it no longer has.
    s.set_vm_leases("web", &[lease("lan", "web", 0, "10.77.0.10")])
        .unwrap();
    assert!(s.leases_of_network("lab").unwrap().is_empty());
    // A second holder of one address is refused by the table itself,
    // and the failed write changes nothing.
    let taken = s.set_vm_leases("mail", &[lease("lan", "mail", 0, "10.77.0.10")]);
    assert!(taken.is_err());
    assert_eq!(s.leases().unwrap().len(), 2);
    // Removing the VM releases its leases; removing the network, the rest.
    s.remove(Kind::VirtualMachine, "web").unwrap();
    assert_eq!(
        s.leases().unwrap(),
        vec![lease("lan", "db", 0, "10.77.0.11")]
    );
    s.remove(Kind::VirtualNetwork, "lan").unwrap();
    assert!(s.leases().unwrap().is_empty());
}

#[test]
fn objects_survive_reopen_and_status_is_kept_across_updates() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hearth.db");
    {
        let s = Store::open(&path).unwrap();
        s.put_objects(&[disk("a"), disk("b")]).unwrap();
        s.update_status::<VirtualMachineStatus, _>(Kind::VirtualDisk, "a", |st| {
            st.phase = VmPhase::Running
        })
        .unwrap();
        s.put_objects(&[disk("a")]).unwrap();
    }
    let s = Store::open(&path).unwrap();
    let all = s.list(Kind::VirtualDisk).unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!(all[0].status["phase"], "Running");
    s.remove(Kind::VirtualDisk, "a").unwrap();
    assert!(s.get(Kind::VirtualDisk, "a").unwrap().is_none());
}

#[test]
fn update_status_of_missing_object_is_none() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(&dir.path().join("db")).unwrap();
    let r = s
        .update_status::<VirtualMachineStatus, _>(Kind::VirtualMachine, "nope", |_| {})
        .unwrap();
    assert!(r.is_none());
}

#[test]
fn events_are_bounded_per_object_and_come_oldest_first() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(&dir.path().join("db")).unwrap();
    for i in 0..(EVENTS_PER_OBJECT + 10) {
        s.record_event(
            Kind::VirtualMachine,
            "a",
            EventType::Normal,
            "R",
            &i.to_string(),
        )
        .unwrap();
    }
    s.record_event(Kind::VirtualMachine, "b", EventType::Warning, "R", "other")
        .unwrap();
    let ev = s
        .events(Some(Kind::VirtualMachine), Some("a"), 1000)
        .unwrap();
    assert_eq!(ev.len() as i64, EVENTS_PER_OBJECT);
    assert_eq!(
        ev.last().unwrap().message,
        (EVENTS_PER_OBJECT + 9).to_string()
    );
    let last3 = s.events(Some(Kind::VirtualMachine), Some("a"), 3).unwrap();
    assert_eq!(last3[0].message, (EVENTS_PER_OBJECT + 7).to_string());
}

#[test]
fn intents_and_runtime_records_are_removed_with_the_vm() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(&dir.path().join("db")).unwrap();
    s.update_intent("vm1", |i| i.want_running = Some(false))
        .unwrap();
    assert_eq!(s.intent("vm1").unwrap().want_running, Some(false));
    s.remove(Kind::VirtualMachine, "vm1").unwrap();
    assert_eq!(s.intent("vm1").unwrap(), RunIntent::default());
}

#[test]
fn a_launch_marker_is_replaced_by_its_runtime_record_in_one_step() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db");
    let record = RuntimeRecord {
        vm: "vm1".into(),
        process: hearth_qemu::ProcessIdentity {
            pid: 0,
            start_ticks: 0,
        },
        qmp_socket: "/run/q.sock".into(),
        agent_socket: None,
        serial_log: "/run/serial.log".into(),
        accel: hearth_qemu::Accel::Tcg,
        started_at: Utc::now(),
        spec_fingerprint: "f".into(),
        restart_nonce: 0,
        disks: Vec::new(),
        disk_names: Vec::new(),
        networks: None,
    };
    let created_at = Utc::now();
    let marker = |id: u64, vm: &str| LaunchMarker {
        id,
        vm: vm.into(),
        pidfile: format!("/run/launch-{id}.pid").into(),
        boot_id: "b".into(),
        not_before_ticks: 1,
        created_at,
        record: RuntimeRecord {
            vm: vm.into(),
            ..record.clone()
        },
    };
    {
        let s = Store::open(&path).unwrap();
        let a = s.next_counter("launch").unwrap();
        let b = s.next_counter("launch").unwrap();
        assert_ne!(a, b);
        s.put_launch(&marker(a, "vm1")).unwrap();
        s.put_launch(&marker(b, "vm2")).unwrap();
        assert!(s.put_launch(&marker(a, "vm1")).is_err(), "ids never repeat");
    }
    // Durable across a reopen, as after a crash.
    let s = Store::open(&path).unwrap();
    assert_eq!(s.launches(None).unwrap().len(), 2);
    let mine = s.launches(Some("vm1")).unwrap();
    assert_eq!(mine, vec![marker(mine[0].id, "vm1")]);
    let running = RuntimeRecord {
        process: hearth_qemu::ProcessIdentity {
            pid: 42,
            start_ticks: 7,
        },
        ..record.clone()
    };
    s.record_launch(mine[0].id, &running).unwrap();
    assert!(s.launches(Some("vm1")).unwrap().is_empty());
    assert_eq!(s.runtime("vm1").unwrap(), Some(running));
    let other = s.launches(Some("vm2")).unwrap();
    s.drop_launch(other[0].id).unwrap();
    assert!(s.launches(None).unwrap().is_empty());
    assert_eq!(s.runtime("vm2").unwrap(), None);
}

#[test]
fn a_read_never_waits_for_a_write_in_progress() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(&dir.path().join("hearth.db")).unwrap();
    s.put_objects(&[disk("d1")]).unwrap();
    let (held_tx, held) = std::sync::mpsc::channel();
    let (release_tx, release) = std::sync::mpsc::channel::<()>();
    let writer = {
        let s = s.clone();
        std::thread::spawn(move || {
            s.with_tx(|tx| {
                Store::put_objects_tx(tx, &[disk("d2")])?;
                held_tx.send(()).unwrap();
                // The write stays open, holding the writer's lock, until
                // the read below has answered.
                let _ = release.recv_timeout(std::time::Duration::from_secs(30));
                Ok(())
            })
            .unwrap()
        })
    };
    held.recv().unwrap();
    let (read_tx, read) = std::sync::mpsc::channel();
    let reading = {
        let s = s.clone();
        std::thread::spawn(move || {
            let r = s.reader();
            let names: Vec<String> = r
                .list(Kind::VirtualDisk)
                .unwrap()
                .iter()
                .map(|o| o.object.name().to_string())
                .collect();
            read_tx
                .send((names, r.get(Kind::VirtualDisk, "d1").unwrap().is_some()))
                .unwrap();
        })
    };
    let answer = read.recv_timeout(std::time::Duration::from_secs(10));
    release_tx.send(()).unwrap();
    writer.join().unwrap();
    reading.join().unwrap();
    // The last commit, not the write in progress.
    assert_eq!(
        answer.expect("the read waited for the write"),
        (vec!["d1".to_string()], true)
    );
    // And once that commits, the reader sees it.
    assert!(s.reader().get(Kind::VirtualDisk, "d2").unwrap().is_some());
}

#[test]
fn an_unchanged_status_is_not_written_again() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(&dir.path().join("hearth.db")).unwrap();
    s.put_objects(&[disk("d1")]).unwrap();
    let set = |phase: hearth_api::DiskPhase| {
        s.update_status(
            Kind::VirtualDisk,
            "d1",
            |st: &mut hearth_api::VirtualDiskStatus| st.phase = phase,
        )
        .unwrap()
    };
    set(hearth_api::DiskPhase::Ready);
    let writes = s.conn().total_changes();
    set(hearth_api::DiskPhase::Ready);
    assert_eq!(
        s.conn().total_changes(),
        writes,
        "the same status was written again"
    );
    set(hearth_api::DiskPhase::Failed);
    assert!(
        s.conn().total_changes() > writes,
        "a changed status is written"
    );
}

fn vm_with_disks(name: &str, disks: &[&str]) -> Object {
    let list: String = disks
        .iter()
        .map(|d| format!("{{virtualDiskName: {d}}},"))
        .collect();
    parse_documents(
        &format!("apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: {name}}}\nspec: {{cpus: 1, memory: 256Mi, disks: [{list}]}}\n"),
        "t",
    )
    .unwrap()
    .remove(0)
}

#[test]
fn disk_claims_follow_every_vm_write_and_are_rebuilt_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let s = Store::open(&path).unwrap();
    let claim = |s: &Store, d: &str| s.disk_claimants(d).unwrap();
    s.put_objects(&[
        vm_with_disks("a", &["root", "data"]),
        vm_with_disks("b", &["data"]),
        disk("root"),
    ])
    .unwrap();
    assert_eq!(claim(&s, "root"), ["a"]);
    assert_eq!(claim(&s, "data"), ["a", "b"]);
    // A spec edit moves the claims; a status write keeps them.
    s.put_objects(&[vm_with_disks("a", &["other"])]).unwrap();
    s.update_status(
        Kind::VirtualMachine,
        "b",
        |st: &mut VirtualMachineStatus| st.phase = VmPhase::Running,
    )
    .unwrap();
    assert!(claim(&s, "root").is_empty());
    assert_eq!(claim(&s, "data"), ["b"]);
    assert_eq!(claim(&s, "other"), ["a"]);
    s.remove(Kind::VirtualMachine, "b").unwrap();
    assert!(claim(&s, "data").is_empty());
    // A store whose index was lost (or written by a hearthd without it)
    // gets it back from the VMs at the next open.
    s.conn()
        .execute_batch("DROP TRIGGER disk_claims_added; DELETE FROM disk_claims;")
        .unwrap();
    s.put_objects(&[vm_with_disks("c", &["data"])]).unwrap();
    assert!(claim(&s, "data").is_empty());
    drop(s);
    let s = Store::open(&path).unwrap();
    assert_eq!(claim(&s, "other"), ["a"]);
    assert_eq!(claim(&s, "data"), ["c"]);
}

fn vm_on_networks(name: &str, networks: &[&str]) -> Object {
    let list: String = networks
        .iter()
        .map(|n| format!("{{virtualNetworkName: {n}}},"))
        .collect();
    parse_documents(
        &format!("apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: {name}}}\nspec: {{cpus: 1, memory: 256Mi, boot: {{kernel: /k}}, networks: [{list}]}}\n"),
        "t",
    )
    .unwrap()
    .remove(0)
}

#[test]
fn network_claims_follow_every_vm_write_and_are_rebuilt_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let s = Store::open(&path).unwrap();
    let claim = |s: &Store, n: &str| s.network_claimants(n).unwrap();
    let networked = |s: &Store| -> Vec<String> {
        s.networked_vms()
            .unwrap()
            .iter()
            .map(|o| o.object.name().to_string())
            .collect()
    };
    s.put_objects(&[
        vm_on_networks("a", &["lan", "dmz"]),
        vm_on_networks("b", &["lan"]),
        vm_on_networks("plain", &[]),
        vm_with_disks("disky", &["data"]),
    ])
    .unwrap();
    assert_eq!(claim(&s, "lan"), ["a", "b"]);
    assert_eq!(claim(&s, "dmz"), ["a"]);
    assert_eq!(networked(&s), ["a", "b"]);
    // A spec edit moves the claims; a status write keeps them; a VM that
    // loses its last interface is no longer read as networked.
    s.put_objects(&[vm_on_networks("a", &["dmz"]), vm_on_networks("b", &[])])
        .unwrap();
    s.update_status(
        Kind::VirtualMachine,
        "a",
        |st: &mut VirtualMachineStatus| st.phase = VmPhase::Running,
    )
    .unwrap();
    assert!(claim(&s, "lan").is_empty());
    assert_eq!(claim(&s, "dmz"), ["a"]);
    assert_eq!(networked(&s), ["a"]);
    s.put_objects(&[vm_on_networks("plain", &["lan"])]).unwrap();
    assert_eq!(networked(&s), ["a", "plain"]);
    s.remove(Kind::VirtualMachine, "a").unwrap();
    assert!(claim(&s, "dmz").is_empty());
    // Lost (or never made by an older hearthd): back from the VMs at open.
    s.conn()
        .execute_batch("DROP TRIGGER network_claims_added; DELETE FROM network_claims;")
        .unwrap();
    s.put_objects(&[vm_on_networks("c", &["lan"])]).unwrap();
    assert!(networked(&s).is_empty());
    drop(s);
    let s = Store::open(&path).unwrap();
    assert_eq!(claim(&s, "lan"), ["c", "plain"]);
    assert_eq!(networked(&s), ["c", "plain"]);
    // The disks' index is its own.
    assert_eq!(s.disk_claimants("data").unwrap(), ["disky"]);
}
