//! What a deleted object leaves behind for the next one of its name: none
//! of its events, and (for a network) no run directory. A real hearthd and
//! CLI; no guest boots.

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(30);

#[test]
fn a_new_object_of_a_deleted_ones_name_shows_none_of_its_events() {
    let _serial = serial();
    let images = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start_without_guest(&[images.path()], &[]);

    // The first life: created, Ready, deleted.
    let (status, v) = d.apply_json(vec![Disk::blank("data", "64Mi").json()]);
    assert_eq!(status, 200, "{v}");
    let first = d.wait_object("virtualdisks", "data", "Ready", WAIT, |v| {
        v["status"]["phase"] == "Ready"
    });
    let first_layer = first["status"]["path"].as_str().expect("path").to_string();
    d.cli_ok(&["delete", "disk", "data"]);
    d.wait_gone("virtualdisks", "data", WAIT);
    let first_events = Value::Array(d.events("VirtualDisk", "data")).to_string();
    assert!(first_events.contains("\"Deleted\""), "{first_events}");
    assert!(first_events.contains(&first_layer), "{first_events}");

    // The second life, of another size so its events tell it apart.
    let (status, v) = d.apply_json(vec![Disk::blank("data", "32Mi").json()]);
    assert_eq!(status, 200, "{v}");
    let second = d.wait_object("virtualdisks", "data", "Ready", WAIT, |v| {
        v["status"]["phase"] == "Ready"
    });
    assert_eq!(second["status"]["capacity"], 32 << 20, "{second}");
    let events = d.events("VirtualDisk", "data");
    let text = Value::Array(events.clone()).to_string();
    assert!(!text.contains("\"Deleted\""), "{events:#?}");
    assert!(!text.contains(&first_layer), "{events:#?}");
    assert_eq!(text.matches("created from api").count(), 1, "{events:#?}");
    for e in &events {
        let time: chrono::DateTime<chrono::Utc> =
            e["time"].as_str().expect("time").parse().expect("rfc3339");
        let created: chrono::DateTime<chrono::Utc> = second["metadata"]["creationTimestamp"]
            .as_str()
            .expect("creationTimestamp")
            .parse()
            .expect("rfc3339");
        assert!(time >= created, "an event older than the object: {e}");
    }
    let described = d.cli_ok(&["describe", "disk", "data"]);
    assert!(!described.contains("Deleted"), "{described}");
    assert!(!described.contains(&first_layer), "{described}");
    assert_eq!(
        described.matches("created from api").count(),
        1,
        "{described}"
    );

    // All events, unfiltered, still hold the first life's.
    let (_, all) = d.request("GET", "/v1/events?kind=VirtualDisk&limit=1000", None);
    let all: Vec<&str> = all["items"]
        .as_array()
        .expect("items")
        .iter()
        .filter_map(|e| e["reason"].as_str())
        .collect();
    assert!(all.contains(&"Deleted"), "{all:?}");
}

#[test]
fn a_deleted_networks_run_directory_goes_with_it() {
    let _serial = serial();
    let images = tempfile::tempdir().expect("tempdir");
    let mut d = Daemon::start_in_netns(&[images.path()], &["--accel", "tcg"]);
    let networks = d.run_dir().join("networks");
    let m = manifest(
        &d,
        "lan.yaml",
        &Network::new("lan").subnet("10.79.0.0/24").yaml(),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_object("virtualnetworks", "lan", "Ready", WAIT, |v| {
        v["status"]["phase"] == "Ready"
    });
    let dir = networks.join("hth-lan");
    assert!(dir.is_dir(), "{} was never made", dir.display());
    d.cli_ok(&["delete", "network", "lan"]);
    d.wait_gone("virtualnetworks", "lan", WAIT);
    assert!(!dir.exists(), "{} is still there", dir.display());

    // One left by a crash goes at the next start; what is not hearth's stays.
    d.kill();
    let stale = networks.join("hth-gone");
    std::fs::create_dir_all(&stale).expect("mkdir");
    std::fs::write(stale.join("dnsmasq.conf"), "# left over\n").expect("write");
    let foreign = networks.join("not-hearths");
    std::fs::create_dir_all(&foreign).expect("mkdir");
    d.spawn();
    wait_until("the stale run directory is removed", WAIT, || {
        !stale.exists()
    });
    assert!(foreign.is_dir(), "{} was removed", foreign.display());
}
