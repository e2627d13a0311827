//! `hearth_qemu::chain` against real files made by the real qemu-img: a
//! chain is opened only when every file is what the caller recorded, and
//! the descriptors handed back are of the files that were checked.

mod common;

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use hearth_qemu::chain::{self, LayerError};
use hearth_qemu::cmdline::{BackingLayer, DiskAttachment};
use hearth_qemu::img::QemuImg;

fn qemu_img(args: &[&str]) {
    let out = Command::new(common::qemu_img())
        .args(args)
        .output()
        .expect("qemu-img (apt-get install qemu-utils)");
    assert!(
        out.status.success(),
        "qemu-img {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf8")
}

/// base.qcow2 (standalone) <- top.qcow2, in `dir`.
async fn chain_in(dir: &Path) -> (PathBuf, PathBuf) {
    let img = QemuImg::new(common::qemu_img());
    let base = dir.join("base.qcow2");
    let top = dir.join("top.qcow2");
    img.create_blank(&base, 16 << 20).await.expect("base");
    img.create_overlay(&top, &base, "qcow2", None)
        .await
        .expect("top");
    (base, top)
}

fn disk(top: &Path, backing: Vec<BackingLayer>) -> DiskAttachment {
    DiskAttachment {
        node_name: "disk0".into(),
        path: top.to_path_buf(),
        read_only: false,
        serial: String::new(),
        backing,
    }
}

fn layer(path: &Path, real_path: &Path, format: &str) -> BackingLayer {
    BackingLayer {
        path: path.to_path_buf(),
        format: format.into(),
        real_path: real_path.to_path_buf(),
    }
}

fn fd_target(fd: &std::os::fd::OwnedFd) -> PathBuf {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).expect("readlink")
}

#[tokio::test]
async fn a_chain_as_recorded_opens_and_the_descriptors_are_its_files() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (base, top) = chain_in(tmp.path()).await;
    let fds = chain::open_disk(&disk(&top, vec![layer(&base, &base, "qcow2")])).expect("opens");
    assert_eq!(fds.len(), 2);
    assert_eq!(fd_target(&fds[0]), top);
    assert_eq!(fd_target(&fds[1]), base);
    // An ordinary descriptor: the non-blocking open is not left on it.
    let flags = rustix::fs::fcntl_getfl(&fds[1]).expect("getfl");
    assert!(!flags.contains(rustix::fs::OFlags::NONBLOCK), "{flags:?}");
    assert!(
        !flags.intersects(rustix::fs::OFlags::RDWR | rustix::fs::OFlags::WRONLY),
        "a backing layer is read-only: {flags:?}"
    );
    let top_flags = rustix::fs::fcntl_getfl(&fds[0]).expect("getfl");
    assert!(
        top_flags.contains(rustix::fs::OFlags::RDWR),
        "{top_flags:?}"
    );
}

#[tokio::test]
async fn a_base_rebased_onto_a_device_or_another_file_is_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (base, top) = chain_in(tmp.path()).await;
    let secret = tmp.path().join("secret.raw");
    std::fs::write(&secret, vec![7u8; 1 << 20]).expect("secret");
    for target in [Path::new("/dev/null"), secret.as_path()] {
        qemu_img(&[
            "rebase",
            "-u",
            "-f",
            "qcow2",
            "-b",
            s(target),
            "-F",
            "raw",
            s(&base),
        ]);
        let e =
            chain::open_disk(&disk(&top, vec![layer(&base, &base, "qcow2")])).expect_err("refused");
        assert!(matches!(e, LayerError::WrongBacking { .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.contains(s(&base)) && text.contains(s(target)),
            "names the file and what it names: {text}"
        );
    }
    // Made standalone again, it opens.
    qemu_img(&["rebase", "-u", "-f", "qcow2", "-b", "", s(&base)]);
    chain::open_disk(&disk(&top, vec![layer(&base, &base, "qcow2")])).expect("opens again");
}

#[tokio::test]
async fn a_base_swapped_for_a_link_or_a_special_file_is_refused_without_blocking() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (base, top) = chain_in(tmp.path()).await;
    let kept = tmp.path().join("base.kept");
    std::fs::rename(&base, &kept).expect("keep");
    let img = QemuImg::new(common::qemu_img());
    let foreign = tmp.path().join("foreign.qcow2");
    img.create_blank(&foreign, 16 << 20).await.expect("foreign");
    std::os::unix::fs::symlink(&foreign, &base).expect("symlink");
    let e = chain::open_disk(&disk(&top, vec![layer(&base, &base, "qcow2")])).expect_err("link");
    assert!(matches!(e, LayerError::Symlink { .. }), "{e:?}");
    assert!(e.to_string().contains(s(&foreign)), "{e}");
    std::fs::remove_file(&base).expect("unlink");

    // A FIFO would block an open for reading until a writer came.
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &base,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .expect("mkfifo");
    let e = chain::open_disk(&disk(&top, vec![layer(&base, &base, "qcow2")])).expect_err("fifo");
    assert!(
        matches!(e, LayerError::NotRegular { kind: "FIFO", .. }),
        "{e:?}"
    );
    std::fs::remove_file(&base).expect("unlink");
    std::fs::rename(&kept, &base).expect("back");
    chain::open_disk(&disk(&top, vec![layer(&base, &base, "qcow2")])).expect("opens again");
}

#[tokio::test]
async fn a_directory_of_the_path_replaced_by_a_link_opens_another_file_and_is_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let img = QemuImg::new(common::qemu_img());
    let images = tmp.path().join("images");
    let layers = tmp.path().join("layers");
    let elsewhere = tmp.path().join("elsewhere");
    for d in [&images, &layers, &elsewhere] {
        std::fs::create_dir(d).expect("mkdir");
    }
    let base = images.join("base.qcow2");
    let top = layers.join("top.qcow2");
    img.create_blank(&base, 16 << 20).await.expect("base");
    img.create_overlay(&top, &base, "qcow2", None)
        .await
        .expect("top");
    let recorded = vec![layer(&base, &base, "qcow2")];
    chain::open_disk(&disk(&top, recorded.clone())).expect("opens as made");

    // A file of the same name, self-contained and so passing every header
    // check, in a directory swapped in for the base's.
    img.create_blank(&elsewhere.join("base.qcow2"), 16 << 20)
        .await
        .expect("foreign");
    std::fs::rename(&images, tmp.path().join("images.kept")).expect("move away");
    std::os::unix::fs::symlink(&elsewhere, &images).expect("link the directory");
    let e = chain::open_disk(&disk(&top, recorded.clone())).expect_err("elsewhere");
    match &e {
        LayerError::Elsewhere { real, expected, .. } => {
            assert_eq!(real, &elsewhere.join("base.qcow2"));
            assert_eq!(expected, &base);
        }
        other => panic!("{other:?}"),
    }
    std::fs::remove_file(&images).expect("unlink");
    std::fs::rename(tmp.path().join("images.kept"), &images).expect("back");
    chain::open_disk(&disk(&top, recorded)).expect("opens again");
}

#[tokio::test]
async fn a_raw_layer_above_another_and_an_unknown_format_are_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (base, top) = chain_in(tmp.path()).await;
    let raw = tmp.path().join("disk.raw");
    std::fs::write(&raw, vec![0u8; 1 << 20]).expect("raw");
    let e = chain::open_disk(&disk(
        &top,
        vec![layer(&base, &base, "raw"), layer(&raw, &raw, "raw")],
    ))
    .expect_err("raw in the middle");
    assert!(matches!(e, LayerError::NotBottom { .. }), "{e:?}");
    let e = chain::open_disk(&disk(&top, vec![layer(&base, &base, "vmdk")])).expect_err("vmdk");
    assert!(matches!(e, LayerError::Format { .. }), "{e:?}");
    // The top names `base`; a chain recorded with nothing below is refused.
    let e = chain::open_disk(&disk(&top, vec![])).expect_err("nothing below");
    assert!(matches!(e, LayerError::WrongBacking { .. }), "{e:?}");
    // A raw bottom names nothing: any content is fine.
    let over_raw = tmp.path().join("over-raw.qcow2");
    QemuImg::new(common::qemu_img())
        .create_overlay(&over_raw, &raw, "raw", None)
        .await
        .expect("overlay of raw");
    chain::open_disk(&disk(&over_raw, vec![layer(&raw, &raw, "raw")])).expect("raw bottom");
}
