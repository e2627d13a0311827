//! `qemu-img` wrapper against the real qemu-img.

mod common;

use hearth_qemu::img::{ImgError, QemuImg};

#[tokio::test]
async fn blank_overlay_and_info_round_trip_with_an_awkward_directory_name() {
    let img = QemuImg::new(common::qemu_img());
    let tmp = tempfile::tempdir().expect("tempdir");
    // Commas, '=', spaces and quotes must survive into the backing-file header.
    let dir = tmp.path().join("disks, \"odd\"=1");
    std::fs::create_dir(&dir).expect("mkdir");
    let base = dir.join("base,file=x.qcow2");
    let overlay = dir.join("overlay.qcow2");
    let bigger = dir.join("bigger.qcow2");

    img.create_blank(&base, 1 << 30)
        .await
        .expect("create blank");
    let info = img.info(&base).await.expect("info base");
    assert_eq!(info.format, "qcow2");
    assert_eq!(info.virtual_size, 1 << 30);
    assert_eq!(info.backing_filename, None);
    assert!(
        info.actual_size > 0 && info.actual_size < 1 << 20,
        "sparse: {info:?}"
    );

    img.create_overlay(&overlay, &base, "qcow2", None)
        .await
        .expect("create overlay");
    let info = img.info(&overlay).await.expect("info overlay");
    assert_eq!(info.virtual_size, 1 << 30, "inherits the base size");
    assert_eq!(info.backing_filename.as_deref(), base.to_str());
    assert_eq!(info.backing_format.as_deref(), Some("qcow2"));

    img.create_overlay(&bigger, &base, "qcow2", Some(2 << 30))
        .await
        .expect("create bigger overlay");
    assert_eq!(img.info(&bigger).await.expect("info").virtual_size, 2 << 30);

    let chain = img.backing_chain(&overlay).await.expect("chain");
    let names: Vec<&str> = chain.iter().map(|i| i.filename.as_str()).collect();
    assert_eq!(
        names,
        [
            overlay.to_str().expect("utf8"),
            base.to_str().expect("utf8")
        ]
    );
}

#[tokio::test]
async fn creating_over_an_existing_image_is_refused_and_leaves_it_alone() {
    let img = QemuImg::new(common::qemu_img());
    let tmp = tempfile::tempdir().expect("tempdir");
    let disk = tmp.path().join("disk.qcow2");
    img.create_blank(&disk, 1 << 20).await.expect("create");
    let err = img.create_blank(&disk, 1 << 30).await.expect_err("exists");
    assert!(matches!(err, ImgError::AlreadyExists { .. }), "{err}");
    assert_eq!(img.info(&disk).await.expect("info").virtual_size, 1 << 20);
}

#[tokio::test]
async fn qemu_img_failures_carry_its_message() {
    let img = QemuImg::new(common::qemu_img());
    let tmp = tempfile::tempdir().expect("tempdir");
    let missing = tmp.path().join("missing.qcow2");
    match img.info(&missing).await {
        Err(ImgError::Failed { stderr, .. }) => {
            assert!(stderr.contains("missing.qcow2"), "{stderr}");
        }
        other => panic!("expected a qemu-img failure, got {other:?}"),
    }
    let overlay = tmp.path().join("o.qcow2");
    let err = img
        .create_overlay(&overlay, &missing, "qcow2", None)
        .await
        .expect_err("backing missing");
    assert!(matches!(err, ImgError::Failed { .. }), "{err}");
    assert!(!overlay.exists(), "no half-made overlay left behind");
}

#[tokio::test]
async fn free_functions_find_qemu_img_in_path() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let disk = tmp.path().join("d.qcow2");
    hearth_qemu::img::create_blank(&disk, 4 << 20)
        .await
        .expect("create");
    let info = hearth_qemu::img::info(&disk).await.expect("info");
    assert_eq!(info.virtual_size, 4 << 20);
}
