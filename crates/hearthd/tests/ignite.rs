//! An Ignite manifest, as Ignite's own docs write it, in the manifest
//! directory of the real hearthd, pulling from a real registry on 127.0.0.1
//! (docker-registry with TLS and htpasswd) that the manifest knows nothing
//! of: hearthd's --registry-ca and --registry-credentials carry the trust.
//! Ground truth: the objects through the API, the manifest digest as skopeo
//! reads it from the registry, and what `hearth convert ignite` prints for
//! the same file. Whether the VM boots is not asserted here.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{Daemon, eventually, hearth_bin, serial};
use hearth_test_support::oci::{TestRegistry, umoci_image};
use serde_json::{Value, json};

const IMPORT: Duration = Duration::from_secs(180);

/// docs/declarative-config.md's first example, verbatim but for the image
/// reference (Docker Hub is not reachable from the tests).
fn ignite_manifest(reference: &str, running: Option<bool>) -> String {
    let mut text = format!(
        "apiVersion: ignite.weave.works/v1alpha4
kind: VM
metadata:
  name: my-vm
spec:
  image:
    oci: {reference}
  cpus: 2
  diskSize: 3GB
  memory: 800MB
"
    );
    if let Some(r) = running {
        text.push_str(&format!("status:\n  running: {r}\n"));
    }
    text
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8")
}

fn spec(d: &Daemon, plural: &str, name: &str) -> Option<Value> {
    d.get(plural, name).map(|o| o["spec"].clone())
}

#[test]
fn an_ignite_manifest_in_the_manifest_directory_makes_hearths_objects() {
    let _serial = serial();
    let src = tempfile::Builder::new()
        .prefix("hearth-ignite-")
        .tempdir()
        .expect("tempdir");
    let layout = src.path().join("layout");
    umoci_image(&layout, "root", |root| {
        fs::create_dir_all(root.join("etc")).unwrap();
        fs::write(root.join("etc/hostname"), b"my-vm\n").unwrap();
    });
    let registry = TestRegistry::start(true);
    let reference = registry.push(&layout, "root", "ignite/rootfs:1");
    let host = reference.split('/').next().expect("host").to_string();
    let manifests = src.path().join("manifests");
    fs::create_dir(&manifests).expect("mkdir");
    let ca = format!("{host}={}", s(&registry.ca()));
    let creds = format!(
        "{host}={}",
        s(&registry.credentials_file(TestRegistry::PASSWORD))
    );
    // The translated VM has a NAT network: hearthd runs in a namespace of
    // its own, and reaches the registry on the host's loopback through a
    // relay at the same address inside it.
    let d = Daemon::start_in_netns(
        &[src.path()],
        &[
            "--manifests",
            s(&manifests),
            "--registry-ca",
            &ca,
            "--registry-credentials",
            &creds,
            "--image-retry-max-seconds",
            "2",
        ],
    );

    let port: u16 = host
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("the registry's port");
    d.netns.as_ref().expect("a namespace").relay_loopback(port);

    let file = manifests.join("my-vm.yaml");
    fs::write(&file, ignite_manifest(&reference, Some(true))).expect("write");

    // The image, pulled from the registry, is the manifest skopeo reads there.
    let image = d.wait_image_phase("my-vm-image", "Ready", IMPORT);
    assert_eq!(
        image["spec"]["source"]["oci"],
        json!({"reference": reference, "shape": "rootfs"})
    );
    assert_eq!(
        image["status"]["digest"].as_str(),
        Some(registry.digest(&reference).as_str())
    );
    let owner = format!("file:{}", s(&file));
    assert_eq!(image["metadata"]["managedBy"], owner.as_str());
    assert_eq!(
        image["metadata"]["annotations"]["ignite.hearth.dev/spec.source.oci.reference"],
        format!("spec.image.oci {reference:?}")
    );

    let disk = spec(&d, "virtualdisks", "my-vm-root").expect("the disk");
    assert_eq!(disk["source"], json!({"virtualImage": "my-vm-image"}));
    assert_eq!(disk["size"], "3Gi");
    assert_eq!(
        spec(&d, "virtualnetworks", "my-vm-net").expect("the network")["mode"],
        "NAT"
    );
    let vm = d.get("virtualmachines", "my-vm").expect("the VM");
    let v = &vm["spec"];
    assert_eq!(v["cpus"], 2);
    assert_eq!(v["memory"], "800Mi");
    assert_eq!(v["runPolicy"], "AlwaysOn");
    assert_eq!(v["disks"], json!([{"virtualDiskName": "my-vm-root"}]));
    assert_eq!(v["networks"][0]["virtualNetworkName"], "my-vm-net");
    assert_eq!(v["boot"], json!({"cmdline": ""}));
    assert_eq!(vm["metadata"]["managedBy"], owner.as_str());
    assert_eq!(
        vm["metadata"]["annotations"]["ignite.hearth.dev/spec.cpus"],
        "spec.cpus 2"
    );

    // `hearth convert ignite` prints the same objects for the same file.
    let out = Command::new(hearth_bin())
        .args(["convert", "ignite", s(&file)])
        .output()
        .expect("hearth convert");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf-8");
    // It reads back as hearth's own manifest (no Ignite document in it).
    assert!(!text.contains("ignite.weave.works/v1alpha4"), "{text}");
    let printed = hearth_api::parse_documents(&text, "convert output").expect("hearth objects");
    let names: Vec<String> = printed.iter().map(|o| o.display_name()).collect();
    assert_eq!(
        names,
        [
            "VirtualImage \"my-vm-image\"",
            "VirtualDisk \"my-vm-root\"",
            "VirtualNetwork \"my-vm-net\"",
            "VirtualMachine \"my-vm\"",
        ]
    );
    for o in &printed {
        let stored = d
            .get(o.kind().plural(), o.name())
            .unwrap_or_else(|| panic!("{} is not stored", o.display_name()));
        assert_eq!(o.spec_json(), stored["spec"], "{}", o.display_name());
        assert_eq!(
            serde_json::to_value(&o.metadata().annotations).unwrap(),
            stored["metadata"]["annotations"],
            "{}",
            o.display_name()
        );
    }

    // Ignite's `status.running: false` is hearth's AlwaysOff.
    fs::write(&file, ignite_manifest(&reference, Some(false))).expect("write");
    assert!(
        eventually(Duration::from_secs(30), || {
            spec(&d, "virtualmachines", "my-vm").is_some_and(|s| s["runPolicy"] == "AlwaysOff")
        }),
        "runPolicy did not become AlwaysOff:\n{}",
        d.log()
    );

    // Removing the file deletes every object it made.
    fs::remove_file(&file).expect("rm");
    let gone = [
        ("virtualmachines", "my-vm"),
        ("virtualdisks", "my-vm-root"),
        ("virtualnetworks", "my-vm-net"),
        ("virtualimages", "my-vm-image"),
    ];
    assert!(
        eventually(Duration::from_secs(120), || {
            gone.iter().all(|(p, n)| d.get(p, n).is_none())
        }),
        "not all deleted: {:?}\n{}",
        gone.iter()
            .filter(|(p, n)| d.get(p, n).is_some())
            .collect::<Vec<_>>(),
        d.log()
    );
    assert!(d.qemu_pids().is_empty(), "a QEMU is left");
}
