//! OCI images end to end: the real hearthd imports `spec.source.oci` from an
//! image layout umoci wrote, an archive skopeo wrote, and a real registry on
//! 127.0.0.1 (docker-registry with TLS and htpasswd), and each becomes an
//! image file checked as every import is. Ground truth: the manifest digest
//! as skopeo reads it, the source disk's own sha256, the ext4 image mounted.
//! No VM boots.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{Daemon, Image, ObjectBuilder};
use hearth_api::{OciShape, OciSource};
use hearth_test_support::oci::{
    TestRegistry, container_disk_image, sha256sum, skopeo_digest, tool, umoci_image,
};
use serde_json::Value;

const IMPORT: Duration = Duration::from_secs(120);

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn wait_phase(d: &Daemon, name: &str, phase: &str) -> Value {
    d.wait_image_phase(name, phase, IMPORT)
}

fn image(name: &str, source: OciSource) -> Value {
    Image::oci(name, source).json()
}

/// The files of the daemon's image store, its `.oci` folder aside, and
/// the build folder's entries.
fn store_files(d: &Daemon) -> (Vec<String>, Vec<String>) {
    let list = |p: &Path| -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(p)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    let images = d.state_dir().join("images");
    let files = list(&images).into_iter().filter(|n| n != ".oci").collect();
    (files, list(&images.join(".oci/build")))
}

#[test]
fn oci_images_from_a_layout_an_archive_and_a_registry_become_checked_image_files() {
    let src = tempfile::Builder::new()
        .prefix("hearth-oci-src-")
        .tempdir()
        .expect("tempdir");
    let layout = src.path().join("layout");
    // A containerDisk: a qcow2 with data in it, under /disk/.
    let qcow2 = container_disk_image(&layout, "disk", src.path(), 32, 0x5a, 2);
    // A rootfs.
    umoci_image(&layout, "root", |root| {
        fs::create_dir_all(root.join("etc")).unwrap();
        fs::write(root.join("etc/hostname"), b"from-an-archive\n").unwrap();
        fs::create_dir_all(root.join("usr/bin")).unwrap();
        fs::write(root.join("usr/bin/tool"), vec![0x7f; 1 << 20]).unwrap();
    });
    let archive = src.path().join("root.tar");
    tool(
        "skopeo",
        &[
            "copy",
            "-q",
            &format!("oci:{}:root", s(&layout)),
            &format!("docker-archive:{}:x/root:1", s(&archive)),
        ],
    );
    let registry = TestRegistry::start(true);
    let reference = registry.push(&layout, "disk", "hearth/disk:1");

    let d = Daemon::start_without_guest(&[src.path()], &["--image-retry-max-seconds", "2"]);
    d.apply(vec![
        image(
            "cd-layout",
            OciSource {
                layout: Some(layout.clone()),
                tag: Some("disk".into()),
                ..Default::default()
            },
        ),
        image(
            "root-archive",
            OciSource {
                archive: Some(archive.clone()),
                tag: Some("x/root:1".into()),
                ..Default::default()
            },
        ),
        image(
            "cd-registry",
            OciSource {
                reference: Some(reference.clone()),
                ca_file: Some(registry.ca()),
                credentials_file: Some(registry.credentials_file(TestRegistry::PASSWORD)),
                ..Default::default()
            },
        ),
    ]);

    // The containerDisk from the layout: its file is the source disk, byte
    // for byte, and the digest is the manifest skopeo reads.
    let v = wait_phase(&d, "cd-layout", "Ready");
    let st = &v["status"];
    assert_eq!(st["shape"], "containerDisk", "{v:#}");
    assert_eq!(st["format"], "qcow2", "{v:#}");
    assert_eq!(st["layers"], 1, "{v:#}");
    assert_eq!(
        st["digest"],
        skopeo_digest(&format!("oci:{}:disk", s(&layout)), &[]),
        "{v:#}"
    );
    let cd_path = st["path"].as_str().expect("path").to_string();
    assert_eq!(sha256sum(Path::new(&cd_path)), sha256sum(&qcow2));

    // The same disk from the registry: the same content, so the same file.
    let v = wait_phase(&d, "cd-registry", "Ready");
    assert_eq!(v["status"]["digest"], registry.digest(&reference), "{v:#}");
    assert_eq!(v["status"]["path"], cd_path.as_str(), "{v:#}");

    // The rootfs from the Docker archive: an ext4 image holding the tree.
    let v = wait_phase(&d, "root-archive", "Ready");
    let st = &v["status"];
    assert_eq!(st["shape"], "rootfs", "{v:#}");
    assert_eq!(st["format"], "raw", "{v:#}");
    let root_path = st["path"].as_str().expect("path").to_string();
    let label = tool("blkid", &["-o", "value", "-s", "TYPE", &root_path]);
    assert_eq!(label.trim(), "ext4");
    let mnt = tempfile::tempdir().unwrap();
    tool("mount", &["-o", "loop,ro", &root_path, s(mnt.path())]);
    let hostname = fs::read(mnt.path().join("etc/hostname"));
    let tool_len = fs::metadata(mnt.path().join("usr/bin/tool")).map(|m| m.len());
    tool("umount", &[s(mnt.path())]);
    assert_eq!(hostname.expect("etc/hostname"), b"from-an-archive\n");
    assert_eq!(tool_len.expect("usr/bin/tool"), 1 << 20);
    // Nothing of the build is left.
    assert_eq!(store_files(&d).1, Vec::<String>::new());

    // Deleted: the files go (the containerDisk's when both are gone).
    for name in ["cd-layout", "cd-registry", "root-archive"] {
        let (status, body) = d.request("DELETE", &format!("/v1/virtualimages/{name}"), None);
        assert_eq!(status, 200, "{body}");
        d.wait_gone("virtualimages", name, IMPORT);
    }
    assert_eq!(store_files(&d).0, Vec::<String>::new());
}

#[test]
fn bad_oci_sources_fail_with_their_reason_and_leave_no_file() {
    let src = tempfile::Builder::new()
        .prefix("hearth-oci-src-")
        .tempdir()
        .expect("tempdir");
    let layout = src.path().join("layout");
    umoci_image(&layout, "root", |root| {
        fs::write(root.join("file"), vec![1u8; 64 << 10]).unwrap();
    });
    let registry = TestRegistry::start(true);
    let reference = registry.push(&layout, "root", "hearth/root:1");
    // A copy of a layout with one byte of its layer changed: a layer no
    // other image here has, so no other import stores its right bytes (a
    // retry would then find the digest stored and pass).
    let own = src.path().join("own");
    umoci_image(&own, "root", |root| {
        fs::write(root.join("file"), vec![2u8; 64 << 10]).unwrap();
    });
    let bad = src.path().join("tampered");
    tool("cp", &["-a", s(&own), s(&bad)]);
    let index: Value = serde_json::from_slice(&fs::read(bad.join("index.json")).unwrap()).unwrap();
    let root = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == "root")
        .expect("the root image in index.json");
    let manifest_hex = root["digest"]
        .as_str()
        .unwrap()
        .trim_start_matches("sha256:")
        .to_string();
    let manifest: Value =
        serde_json::from_slice(&fs::read(bad.join("blobs/sha256").join(&manifest_hex)).unwrap())
            .unwrap();
    let layer = manifest["layers"][0]["digest"]
        .as_str()
        .unwrap()
        .to_string();
    let layer_file = bad
        .join("blobs/sha256")
        .join(layer.trim_start_matches("sha256:"));
    let mut bytes = fs::read(&layer_file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    fs::write(&layer_file, &bytes).unwrap();

    let d = Daemon::start_without_guest(&[src.path()], &["--image-retry-max-seconds", "2"]);
    // Outside the image roots: refused at the apply, naming the field.
    let elsewhere = tempfile::tempdir().unwrap();
    let body = serde_json::json!({"items": [image(
        "outside",
        OciSource { layout: Some(elsewhere.path().to_path_buf()), ..Default::default() },
    )]});
    let (status, body) = d.request("POST", "/v1/apply", Some(&body));
    assert!(status == 400 || status == 409, "{status} {body}");
    assert!(
        body.to_string().contains("spec.source.oci.layout"),
        "{body}"
    );

    d.apply(vec![
        image(
            "tampered",
            OciSource {
                layout: Some(bad.clone()),
                tag: Some("root".into()),
                ..Default::default()
            },
        ),
        image(
            "wrong-password",
            OciSource {
                reference: Some(reference.clone()),
                ca_file: Some(registry.ca()),
                credentials_file: Some(registry.credentials_file("not-the-password")),
                ..Default::default()
            },
        ),
        image(
            "not-a-disk",
            OciSource {
                layout: Some(layout.clone()),
                tag: Some("root".into()),
                shape: Some(OciShape::ContainerDisk),
                ..Default::default()
            },
        ),
    ]);
    let v = wait_phase(&d, "tampered", "Failed");
    assert_eq!(v["status"]["reason"], "DigestMismatch", "{v:#}");
    let message = v["status"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&layer) && message.contains("spec.source.oci.layout"),
        "{message}"
    );
    let v = wait_phase(&d, "wrong-password", "Failed");
    assert_eq!(v["status"]["reason"], "AuthFailed", "{v:#}");
    assert!(
        v["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains(&reference),
        "{v:#}"
    );
    let v = wait_phase(&d, "not-a-disk", "Failed");
    assert_eq!(v["status"]["reason"], "NotAContainerDisk", "{v:#}");
    // No image file, no temporary, no build left behind (between attempts:
    // each failed image is retried every 2 s, and an attempt has its
    // temporary while it runs).
    let _ = hearth_test_support::eventually(Duration::from_secs(10), || {
        store_files(&d) == (Vec::new(), Vec::new())
    });
    assert_eq!(store_files(&d), (Vec::new(), Vec::new()));
}

#[test]
fn a_registry_with_bearer_token_auth_is_pulled_with_a_token_its_realm_hands_out() {
    let src = tempfile::Builder::new()
        .prefix("hearth-oci-src-")
        .tempdir()
        .expect("tempdir");
    let layout = src.path().join("layout");
    umoci_image(&layout, "root", |root| {
        fs::write(root.join("token-file"), b"behind a token\n").unwrap();
    });
    let registry = TestRegistry::start_token();
    let tokens = registry.token_server().expect("a token server");
    let reference = registry.push(&layout, "root", "hearth/token:1");
    // Ground truth first: the registry refuses a pull without a token.
    let anonymous = Command::new("skopeo")
        .args(["inspect", "--raw", "--tls-verify=false"])
        .arg(format!("docker://{reference}"))
        .output()
        .expect("skopeo");
    assert!(
        !anonymous.status.success(),
        "the registry let an anonymous pull in"
    );
    let before = tokens.issued();

    let d = Daemon::start_without_guest(&[src.path()], &["--image-retry-max-seconds", "2"]);
    let with = |name: &str, password: &str| {
        image(
            name,
            OciSource {
                reference: Some(reference.clone()),
                insecure: true,
                credentials_file: Some(registry.credentials_file(password)),
                ..Default::default()
            },
        )
    };
    d.apply(vec![with("token", TestRegistry::PASSWORD)]);
    let v = wait_phase(&d, "token", "Ready");
    assert_eq!(v["status"]["digest"], registry.digest(&reference), "{v:#}");
    assert!(tokens.issued() > before, "no token was asked for");
    let root_path = path_of(&v);
    let mnt = tempfile::tempdir().unwrap();
    tool("mount", &["-o", "loop,ro", &root_path, s(mnt.path())]);
    let content = fs::read(mnt.path().join("token-file"));
    tool("umount", &[s(mnt.path())]);
    assert_eq!(content.expect("token-file"), b"behind a token\n");

    // The token server refuses a wrong password: AuthFailed, nothing left.
    let refused = tokens.refused();
    d.apply(vec![with("wrong", "not-the-password")]);
    let v = wait_phase(&d, "wrong", "Failed");
    assert_eq!(v["status"]["reason"], "AuthFailed", "{v:#}");
    assert!(tokens.refused() > refused);
    let (status, body) = d.request("DELETE", "/v1/virtualimages/wrong", None);
    assert_eq!(status, 200, "{body}");
    d.wait_gone("virtualimages", "wrong", IMPORT);
    assert_eq!(
        store_files(&d).0,
        vec![
            Path::new(&root_path)
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned()
        ]
    );
}

fn path_of(v: &Value) -> String {
    v["status"]["path"]
        .as_str()
        .expect("status.path")
        .to_string()
}
