//! Export of a disk snapshot through the engine, with the real store and the
//! real qemu-img (no VM: the disk is cut offline): the export is standalone,
//! and a delete of the snapshot waits while an export holds its pin.

mod common;

use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::engine_config;
use hearth_api::{Kind, parse_documents};
use hearth_engine::ExportFormat;
use hearth_engine::{Engine, RequestError};
use hearth_test_support::{Disk, DiskSnapshot, Manifest, ObjectBuilder, converters_of};

async fn until(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn phase(engine: &Engine, kind: Kind, name: &str) -> Option<String> {
    engine
        .get(kind, name)
        .ok()
        .and_then(|s| s.status["phase"].as_str().map(str::to_string))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_waits_for_the_export_that_reads_the_snapshot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let engine: Arc<Engine> = Engine::start(engine_config(dir.path(), vec![]))
        .await
        .expect("engine");
    let objects = parse_documents(
        &Manifest::new()
            .with(Disk::blank("d", "16Mi"))
            .with(DiskSnapshot::of("s", "d"))
            .yaml(),
        "t.yaml",
    )
    .expect("objects");
    engine.apply(objects, "api").expect("apply");
    until("the snapshot is Ready", || {
        phase(&engine, Kind::VirtualDiskSnapshot, "s").as_deref() == Some("Ready")
    })
    .await;

    // The export itself: standalone, the disk's size, its copy already unlinked.
    let export = engine
        .export_snapshot("s", ExportFormat::Raw)
        .await
        .expect("export");
    assert_eq!(export.size, 16 << 20);
    assert_eq!(export.virtual_size, 16 << 20);
    let mut data = Vec::new();
    (&export.file).read_to_end(&mut data).expect("read");
    assert_eq!(data.len(), 16 << 20);
    let exports = dir.path().join("state/exports");
    assert_eq!(std::fs::read_dir(&exports).expect("dir").count(), 0);
    drop(export);

    // An export holds the pin (as it does while it converts): the delete waits.
    let pin = engine.export_pin("s").read_owned().await;
    engine
        .delete(Kind::VirtualDiskSnapshot, "s", "api")
        .expect("delete");
    until("the delete says it waits", || {
        engine
            .events(Some(Kind::VirtualDiskSnapshot), Some("s"), 50)
            .expect("events")
            .iter()
            .any(|e| e.reason == "DeleteWaiting")
    })
    .await;
    // Nothing signals "did not delete": give a delete that would not wait
    // time to go wrong.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        engine.get(Kind::VirtualDiskSnapshot, "s").is_ok(),
        "still there while the pin is held"
    );
    drop(pin);
    until("the snapshot is gone", || {
        engine.get(Kind::VirtualDiskSnapshot, "s").is_err()
    })
    .await;
    match engine.export_snapshot("s", ExportFormat::Qcow2).await {
        Err(e @ RequestError::NotFound { .. }) => {
            let m = e.to_string();
            assert!(m.contains("\"s\""), "{m}")
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("exported a deleted snapshot"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_dropped_during_its_conversion_kills_qemu_img_and_leaves_no_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let engine: Arc<Engine> = Engine::start(engine_config(dir.path(), vec![]))
        .await
        .expect("engine");
    engine
        .apply(
            parse_documents(&Disk::blank("big", "1Gi").yaml(), "t.yaml").expect("disk"),
            "api",
        )
        .expect("apply");
    until("the disk is Ready", || {
        phase(&engine, Kind::VirtualDisk, "big").as_deref() == Some("Ready")
    })
    .await;
    // Data to convert, so the conversion takes a while: written into the
    // disk's layer on the host (no VM has it).
    let head = engine.get(Kind::VirtualDisk, "big").expect("disk").status["path"]
        .as_str()
        .expect("path")
        .to_string();
    let out = std::process::Command::new("qemu-io")
        .args(["-f", "qcow2", "-c", "write -P 0x5a 0 768M", &head])
        .output()
        .expect("qemu-io (apt-get install qemu-utils)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    engine
        .apply(
            parse_documents(&DiskSnapshot::of("s", "big").yaml(), "t.yaml").expect("snapshot"),
            "api",
        )
        .expect("apply");
    until("the snapshot is Ready", || {
        phase(&engine, Kind::VirtualDiskSnapshot, "s").as_deref() == Some("Ready")
    })
    .await;

    let exports = dir.path().join("state/exports");
    let task = {
        let engine = engine.clone();
        tokio::spawn(async move { engine.export_snapshot("s", ExportFormat::Raw).await })
    };
    let named = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&exports)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default()
    };
    until("the conversion runs", || {
        named()
            .first()
            .is_some_and(|p| !converters_of(p).is_empty())
    })
    .await;
    let file = named().remove(0);
    // What a client that goes away does to its request.
    task.abort();
    assert!(
        matches!(task.await, Err(e) if e.is_cancelled()),
        "cancelled"
    );
    until("qemu-img is gone", || converters_of(&file).is_empty()).await;
    assert!(named().is_empty(), "the conversion's file went with it");
}
