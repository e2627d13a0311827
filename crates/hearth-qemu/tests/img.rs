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
    // Every new image is root's alone: QEMU gets it by descriptor.
    for made in [&base, &overlay, &bigger] {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(made).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{}", made.display());
    }

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

/// The first bytes of a file, as the image import reads them.
fn head_of(path: &std::path::Path) -> Vec<u8> {
    let mut bytes = std::fs::read(path).expect("read");
    bytes.truncate(hearth_qemu::probe::HEAD_BYTES);
    bytes
}

fn qemu_img_cmd(args: &[&str]) {
    let out = std::process::Command::new(common::qemu_img())
        .args(args)
        .output()
        .expect("run qemu-img");
    assert!(
        out.status.success(),
        "qemu-img {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn real_qcow2_files_with_references_are_refused_by_the_header_check() {
    use hearth_qemu::probe::{Qcow2Refusal, Sniffed, sniff};
    let tmp = tempfile::tempdir().expect("tempdir");
    let p = |n: &str| tmp.path().join(n).to_str().expect("utf8").to_owned();
    qemu_img_cmd(&["create", "-q", "-f", "qcow2", &p("plain.qcow2"), "2M"]);
    qemu_img_cmd(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "/etc/hostname",
        "-F",
        "raw",
        &p("backed.qcow2"),
        "2M",
    ]);
    qemu_img_cmd(&["create", "-q", "-f", "raw", &p("data.raw"), "2M"]);
    qemu_img_cmd(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        &format!("data_file={}", p("data.raw")),
        &p("datafile.qcow2"),
        "2M",
    ]);

    let Ok(Sniffed::Qcow2(plain)) = sniff(&head_of(tmp.path().join("plain.qcow2").as_path()))
    else {
        panic!("plain.qcow2 is not sniffed as qcow2")
    };
    assert_eq!(plain.size, 2 << 20);
    assert_eq!(plain.check(), Ok(()));

    let Ok(Sniffed::Qcow2(backed)) = sniff(&head_of(tmp.path().join("backed.qcow2").as_path()))
    else {
        panic!("backed.qcow2 is not sniffed as qcow2")
    };
    let refusal = backed.check().expect_err("backing file refused");
    assert!(
        matches!(refusal, Qcow2Refusal::BackingFile { size: 13, .. }),
        "{refusal:?}"
    );
    assert_eq!(refusal.reason(), "UnsafeImage");

    let Ok(Sniffed::Qcow2(with_data)) =
        sniff(&head_of(tmp.path().join("datafile.qcow2").as_path()))
    else {
        panic!("datafile.qcow2 is not sniffed as qcow2")
    };
    assert_eq!(with_data.check(), Err(Qcow2Refusal::ExternalDataFile));

    // qemu-img itself, given the format, agrees on what the header says.
    let img = QemuImg::new(common::qemu_img());
    let info = img
        .info_as(&tmp.path().join("plain.qcow2"), "qcow2")
        .await
        .expect("info");
    assert_eq!(
        (info.format.as_str(), info.virtual_size),
        ("qcow2", 2 << 20)
    );
    assert_eq!((info.backing_filename, info.data_file), (None, None));
    let report = img
        .check(&tmp.path().join("plain.qcow2"))
        .await
        .expect("check");
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(
        img.detect_format(&tmp.path().join("plain.qcow2"))
            .await
            .expect("detect"),
        "qcow2"
    );
    assert!(matches!(
        img.info_as(&tmp.path().join("plain.qcow2"), "qcow2,file.x=1")
            .await,
        Err(ImgError::InvalidFormat(_))
    ));
}

#[tokio::test]
async fn qemu_img_check_reports_a_damaged_qcow2() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let disk = tmp.path().join("d.qcow2");
    let img = QemuImg::new(common::qemu_img());
    img.create_blank(&disk, 4 << 20).await.expect("create");
    // Point the L1 table past the end of the file.
    let mut bytes = std::fs::read(&disk).expect("read");
    bytes[36..40].copy_from_slice(&1u32.to_be_bytes());
    bytes[40..48].copy_from_slice(&(1u64 << 40).to_be_bytes());
    std::fs::write(&disk, &bytes).expect("write");
    match img.check(&disk).await {
        Ok(report) => assert!(!report.is_clean(), "{report:?}"),
        Err(ImgError::Failed { .. }) => {}
        Err(e) => panic!("unexpected error {e}"),
    }
}

/// Writes `pattern` at `offset` into `image` through its chain (`qemu-io`).
fn write_pattern(image: &std::path::Path, offset: u64, pattern: u8) {
    let out = std::process::Command::new("qemu-io")
        .args(["-f", "qcow2", "-c"])
        .arg(format!("write -P {pattern} {offset} 64k"))
        .arg(image)
        .output()
        .expect("qemu-io (qemu-utils)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn raw_of(image: &std::path::Path, out: &std::path::Path) -> Vec<u8> {
    let st = std::process::Command::new("qemu-img")
        .args(["convert", "-U", "-O", "raw"])
        .arg(image)
        .arg(out)
        .status()
        .expect("qemu-img");
    assert!(st.success());
    let bytes = std::fs::read(out).expect("raw");
    std::fs::remove_file(out).expect("rm raw");
    bytes
}

#[tokio::test]
async fn rebase_keeps_what_the_image_reads_and_names_the_new_backing() {
    let img = QemuImg::new(common::qemu_img());
    let tmp = tempfile::tempdir().expect("tempdir");
    let (base, mid, top) = (
        tmp.path().join("base.qcow2"),
        tmp.path().join("mid.qcow2"),
        tmp.path().join("top.qcow2"),
    );
    img.create_blank(&base, 4 << 20).await.expect("base");
    write_pattern(&base, 0, 1);
    write_pattern(&base, 1 << 20, 1);
    img.create_overlay(&mid, &base, "qcow2", None)
        .await
        .expect("mid");
    // mid overrides one of base's blocks and adds one.
    write_pattern(&mid, 0, 2);
    write_pattern(&mid, 2 << 20, 2);
    img.create_overlay(&top, &mid, "qcow2", None)
        .await
        .expect("top");
    write_pattern(&top, 2 << 20, 3);
    let scratch = tmp.path().join("x.raw");
    let (base_before, top_before) = (raw_of(&base, &scratch), raw_of(&top, &scratch));

    img.rebase(&top, &base, "qcow2").await.expect("rebase");

    assert_eq!(
        img.info(&top)
            .await
            .expect("info")
            .backing_filename
            .as_deref(),
        base.to_str()
    );
    assert_eq!(raw_of(&top, &scratch), top_before, "top reads as before");
    assert_eq!(raw_of(&base, &scratch), base_before, "base untouched");
    // What top read through mid (block 0 = 2) is now top's own.
    assert_eq!(raw_of(&top, &scratch)[0], 2);
    // Relative paths are refused before anything runs.
    assert!(matches!(
        img.rebase(std::path::Path::new("top.qcow2"), &base, "qcow2")
            .await,
        Err(ImgError::NotAbsolute { .. })
    ));
}
