//! Image layouts written by real tools (umoci, skopeo), read by hearth:
//! the image chosen, every blob verified into the store, the shape told
//! from the content, and the disk of a containerDisk copied out whole.

use std::fs;
use std::path::{Path, PathBuf};

use hearth_oci::blobs::BlobStore;
use hearth_oci::layout::{Layout, REF_NAME};
use hearth_oci::shape::{self, Shape};
use hearth_oci::{Digest, OciError};
use hearth_test_support::oci::{self, sha256sum, tool, umoci_image};

fn run(program: &str, args: &[&str]) -> String {
    tool(program, args)
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The manifest digest skopeo reads for `oci:LAYOUT:TAG`.
fn skopeo_digest(layout: &Path, tag: &str) -> String {
    oci::skopeo_digest(&format!("oci:{}:{tag}", path(layout)), &[])
}

fn rootfs(root: &Path) {
    fs::create_dir_all(root.join("bin")).unwrap();
    fs::write(root.join("bin/hello"), b"#!/bin/sh\necho hello\n").unwrap();
    fs::create_dir_all(root.join("etc")).unwrap();
    fs::write(root.join("etc/hostname"), b"box\n").unwrap();
}

fn disk_file(dir: &Path) -> PathBuf {
    let f = dir.join("src.qcow2");
    run(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", path(&f), "64M"],
    );
    f
}

#[test]
fn a_umoci_rootfs_is_chosen_by_tag_verified_into_the_store_and_read_as_a_rootfs() {
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    umoci_image(&layout, "base", rootfs);
    umoci_image(&layout, "other", |r| fs::write(r.join("x"), b"x").unwrap());

    let l = Layout::open(&layout).unwrap();
    let mut tags = l.tags();
    tags.sort();
    assert_eq!(tags, ["base", "other"]);
    let e = l.image(None).unwrap_err();
    assert!(matches!(e, OciError::TagNeeded { count: 2, .. }), "{e}");
    let e = l.image(Some("nope")).unwrap_err();
    assert!(e.to_string().contains("no image tagged \"nope\""), "{e}");

    let image = l.image(Some("base")).unwrap();
    // skopeo, reading the same layout, names the same manifest.
    assert_eq!(image.digest.to_string(), skopeo_digest(&layout, "base"));
    assert_eq!(image.layers().len(), 1);

    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let copied = l.copy_into(&image, &store, |_| {}).unwrap();
    assert!(copied >= image.layer_bytes(), "{copied}");
    // Every stored file hashes, by sha256sum, to its own name, and the
    // manifest, config and layer are all there.
    let mut names = Vec::new();
    for entry in fs::read_dir(store.root().join("sha256")).unwrap() {
        let p = entry.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        assert_eq!(sha256sum(&p), name);
        names.push(name);
    }
    for d in [
        image.digest.clone(),
        image.manifest.config().digest().clone(),
    ]
    .iter()
    .chain(image.layers().iter().map(|l| l.digest()))
    {
        assert!(
            names.iter().any(|n| d.to_string() == format!("sha256:{n}")),
            "{d}"
        );
    }
    // Copied once: a second copy of the same image copies nothing.
    assert_eq!(l.copy_into(&image, &store, |_| {}).unwrap(), 0);

    let layers = image
        .layers()
        .iter()
        .map(|d| (d.clone(), store.open_blob(d.digest()).unwrap()));
    assert_eq!(shape::detect(layers, 1 << 30).unwrap(), Shape::Rootfs);
}

#[test]
fn a_container_disk_is_told_by_its_content_and_its_disk_copied_out_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let src = disk_file(dir.path());
    let layout = dir.path().join("layout");
    umoci_image(&layout, "disk", |r| {
        fs::create_dir_all(r.join("disk")).unwrap();
        fs::copy(&src, r.join("disk/disk.qcow2")).unwrap();
    });
    let l = Layout::open(&layout).unwrap();
    let image = l.image(Some("disk")).unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    l.copy_into(&image, &store, |_| {}).unwrap();
    let layers = image
        .layers()
        .iter()
        .map(|d| (d.clone(), store.open_blob(d.digest()).unwrap()));
    let s = shape::detect(layers, 1 << 30).unwrap();
    let Shape::ContainerDisk {
        path: at,
        size,
        at: source,
    } = s
    else {
        panic!("{s:?}");
    };
    assert_eq!(at, "disk/disk.qcow2");
    assert_eq!(size, fs::metadata(&src).unwrap().len());
    let layer = &image.layers()[source.layer];
    let out = dir.path().join("out.qcow2");
    let mut f = fs::File::create(&out).unwrap();
    shape::copy_file(
        layer,
        store.open_blob(layer.digest()).unwrap(),
        &source,
        1 << 30,
        &mut f,
    )
    .unwrap();
    drop(f);
    assert_eq!(sha256sum(&out), sha256sum(&src));
    // qemu-img reads what came out as the image that went in.
    let info = run("qemu-img", &["info", "--output=json", path(&out)]);
    assert!(
        info.contains("\"format\": \"qcow2\"") && info.contains("67108864"),
        "{info}"
    );
}

#[test]
fn an_index_resolves_to_linux_amd64_and_a_tampered_blob_is_refused_by_digest() {
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    umoci_image(&layout, "base", rootfs);
    let l = Layout::open(&layout).unwrap();
    let amd64 = l.image(Some("base")).unwrap();
    let manifest_size = amd64
        .documents
        .iter()
        .find(|(d, _)| *d.digest() == amd64.digest)
        .unwrap()
        .1
        .len();

    // An index (as a registry serves a multi-platform image) with an arm64
    // image first, written into the layout under the tag "multi".
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json",
             "digest": format!("sha256:{}", "a".repeat(64)), "size": 500,
             "platform": {"os": "linux", "architecture": "arm64", "variant": "v8"}},
            {"mediaType": "application/vnd.oci.image.manifest.v1+json",
             "digest": amd64.digest.to_string(), "size": manifest_size,
             "platform": {"os": "linux", "architecture": "amd64"}},
        ],
    });
    let bytes = serde_json::to_vec(&index).unwrap();
    let blob = dir.path().join("index-blob");
    fs::write(&blob, &bytes).unwrap();
    let hex = sha256sum(&blob);
    fs::rename(&blob, layout.join("blobs/sha256").join(&hex)).unwrap();
    let mut top: serde_json::Value =
        serde_json::from_slice(&fs::read(layout.join("index.json")).unwrap()).unwrap();
    top["manifests"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "digest": format!("sha256:{hex}"), "size": bytes.len(),
            "annotations": {REF_NAME: "multi"},
        }));
    fs::write(layout.join("index.json"), serde_json::to_vec(&top).unwrap()).unwrap();

    let l = Layout::open(&layout).unwrap();
    let multi = l.image(Some("multi")).unwrap();
    assert_eq!(multi.digest, amd64.digest);
    assert_eq!(multi.documents.len(), 3, "index, manifest, config");

    // One byte of the layer changed: refused by its digest, nothing stored.
    let layer = multi.layers()[0].digest().clone();
    let on_disk = layout.join("blobs/sha256").join(layer.digest());
    let mut b = fs::read(&on_disk).unwrap();
    let last = b.len() - 1;
    b[last] ^= 0xff;
    fs::write(&on_disk, &b).unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let e = l.copy_into(&multi, &store, |_| {}).unwrap_err();
    assert!(
        matches!(&e, OciError::DigestMismatch { expected, .. } if *expected == layer.to_string()),
        "{e}"
    );
    assert!(!store.contains(&layer));
    assert_eq!(fs::read_dir(store.root().join("tmp")).unwrap().count(), 0);

    // A blob that is a link (here: to a file outside the layout) is not read.
    fs::remove_file(&on_disk).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", &on_disk).unwrap();
    let e = l.copy_into(&multi, &store, |_| {}).unwrap_err();
    assert!(matches!(e, OciError::NotAFile { .. }), "{e}");
    let d: Digest = layer;
    fs::remove_file(&on_disk).unwrap();
    let e = l.copy_into(&multi, &store, |_| {}).unwrap_err();
    assert!(
        e.to_string().contains(&format!("blob {d} is missing")),
        "{e}"
    );
}

#[test]
fn archives_that_skopeo_writes_in_both_formats_give_the_image_back() {
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    umoci_image(&layout, "base", rootfs);
    let original = Layout::open(&layout).unwrap().image(Some("base")).unwrap();
    let oci_tar = dir.path().join("oci.tar");
    let docker_tar = dir.path().join("docker.tar");
    let from = format!("oci:{}:base", path(&layout));
    oci_archive(&layout, "base", &oci_tar);
    run(
        "skopeo",
        &[
            "copy",
            "-q",
            &from,
            &format!("docker-archive:{}:hearth/box:1", path(&docker_tar)),
        ],
    );

    let store = BlobStore::open(dir.path().join("store")).unwrap();
    // An OCI archive: the same manifest, by skopeo's own reading of it.
    let oci = hearth_oci::archive::import(&oci_tar, &store, Some("base"), 1 << 30).unwrap();
    assert_eq!(
        oci.digest.to_string(),
        oci::skopeo_digest(&format!("oci-archive:{}:base", path(&oci_tar)), &[])
    );
    assert_eq!(oci.digest, original.digest);

    // A Docker archive: no manifest in it; the layers hearth stored are the
    // uncompressed layers the image's own config lists as its diff_ids.
    let docker =
        hearth_oci::archive::import(&docker_tar, &store, Some("hearth/box:1"), 1 << 30).unwrap();
    let diff_ids: Vec<String> = docker
        .config
        .rootfs()
        .diff_ids()
        .iter()
        .map(|d| d.to_string())
        .collect();
    let layers: Vec<String> = docker
        .layers()
        .iter()
        .map(|l| l.digest().to_string())
        .collect();
    assert_eq!(layers, diff_ids);
    for l in docker.layers() {
        assert_eq!(
            format!("sha256:{}", sha256sum(&store.path(l.digest()).unwrap())),
            l.digest().to_string()
        );
    }
    assert_eq!(
        docker.manifest.config().digest(),
        original.manifest.config().digest()
    );
    let blobs = docker
        .layers()
        .iter()
        .map(|d| (d.clone(), store.open_blob(d.digest()).unwrap()));
    assert_eq!(shape::detect(blobs, 1 << 30).unwrap(), Shape::Rootfs);
    // By the tag alone too; a tag it does not have is named with those it has.
    assert!(hearth_oci::archive::import(&docker_tar, &store, Some("1"), 1 << 30).is_ok());
    let e = hearth_oci::archive::import(&docker_tar, &store, Some("2"), 1 << 30).unwrap_err();
    assert!(e.to_string().contains("docker.io/hearth/box:1"), "{e}");
    assert_eq!(fs::read_dir(store.root().join("tmp")).unwrap().count(), 0);
}

/// The image `tag` of `layout` as an OCI archive at `tar`, by skopeo.
fn oci_archive(layout: &Path, tag: &str, tar: &Path) {
    run(
        "skopeo",
        &[
            "copy",
            "-q",
            &format!("oci:{}:{tag}", path(layout)),
            &format!("oci-archive:{}:{tag}", path(tar)),
        ],
    );
}

/// Bytes no compressor shrinks (xorshift), so the layer stays this large.
fn noise(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// What a progress callback heard: rising, ending at `end`, and more than
/// once for a copy of several steps.
fn assert_progress(seen: &[u64], end: u64) {
    assert!(seen.len() >= 3, "{seen:?}");
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{seen:?}");
    assert_eq!(seen.last().copied(), Some(end), "{seen:?}");
}

#[test]
fn layout_and_archive_copies_report_their_progress_as_they_go() {
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    umoci_image(&layout, "big", |root| {
        fs::write(root.join("noise"), noise(20 << 20)).unwrap();
    });
    let l = Layout::open(&layout).unwrap();
    let image = l.image(Some("big")).unwrap();
    assert!(image.layer_bytes() > 16 << 20, "{}", image.layer_bytes());
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let mut seen = Vec::new();
    l.copy_into(&image, &store, |n| seen.push(n)).unwrap();
    assert_progress(&seen, image.layer_bytes());

    // An archive: bytes of the tar file read, up to its length.
    let tar = dir.path().join("big.tar");
    oci_archive(&layout, "big", &tar);
    let len = fs::metadata(&tar).unwrap().len();
    let store = BlobStore::open(dir.path().join("store2")).unwrap();
    let mut seen = Vec::new();
    let got = hearth_oci::archive::import_with_progress(&tar, &store, Some("big"), 1 << 30, |n| {
        seen.push(n)
    })
    .unwrap();
    assert_eq!(got.digest, image.digest);
    assert!(seen.len() >= 3, "{seen:?}");
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    let last = *seen.last().unwrap();
    assert!(last <= len && last + (5 << 20) > len, "{last} of {len}");
}

#[test]
fn an_archive_asks_room_only_for_the_blobs_the_store_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    umoci_image(&layout, "mid", |root| {
        fs::write(root.join("noise"), noise(3 << 20)).unwrap();
    });
    let tar = dir.path().join("mid.tar");
    oci_archive(&layout, "mid", &tar);
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let stored = || -> Vec<PathBuf> {
        fs::read_dir(store.root().join("sha256"))
            .map(|d| d.map(|e| e.unwrap().path()).collect())
            .unwrap_or_default()
    };
    let import = |room: &mut dyn FnMut(u64) -> Result<(), String>| {
        hearth_oci::archive::import_checked(&tar, &store, Some("mid"), 1 << 30, |_| {}, room)
    };

    // No room: refused before the first new blob is written.
    let mut asked = Vec::new();
    let e = import(&mut |n| {
        asked.push(n);
        Err("no room here".into())
    })
    .unwrap_err();
    match e {
        OciError::NoRoom { needs, message } => {
            assert_eq!(asked.len(), 1, "{asked:?}");
            assert_eq!(needs, asked[0]);
            assert_eq!(message, "no room here");
        }
        other => panic!("not NoRoom: {other}"),
    }
    assert!(stored().is_empty(), "{:?}", stored());
    assert_eq!(fs::read_dir(store.root().join("tmp")).unwrap().count(), 0);

    // Room: each new blob asked for once, by its size; together they are
    // exactly what the store then holds.
    let mut asked = Vec::new();
    let image = import(&mut |n| {
        asked.push(n);
        Ok(())
    })
    .unwrap();
    let held: u64 = stored()
        .iter()
        .map(|p| fs::metadata(p).unwrap().len())
        .sum();
    assert_eq!(asked.len(), stored().len(), "{asked:?}");
    assert_eq!(asked.iter().sum::<u64>(), held);
    assert!(held >= image.layer_bytes() && image.layer_bytes() > 3 << 20);

    // Everything stored: the same archive asks for nothing.
    let again = import(&mut |n| Err(format!("asked for {n} bytes"))).unwrap();
    assert_eq!(again.digest, image.digest);
}
