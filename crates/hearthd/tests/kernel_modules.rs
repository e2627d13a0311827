//! A kernel image's modules copied into a VM's root disk, with hearthd
//! SIGKILLed right after debugfs wrote them into the new overlay (before
//! it was flushed, synced and recorded): the disk's head is the old one,
//! the overlay is swept at the restart, the copy is made again, and the
//! module's bytes are read from the disk's chain after QEMU is gone.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::debian::*;
use common::debian_oci::debian_oci;
use common::kill_wrapper::KillWrapper;
use common::*;
use hearth_api::OciSource;
use hearth_test_support::oci::{TestRegistry, sha256sum};
use serde_json::json;

fn layer_files(d: &Daemon) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d.dir.path().join("state/layers"))
        .map(|r| {
            r.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn tool(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().expect(program);
    assert!(out.status.success(), "{program} {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_copy_killed_after_its_write_is_swept_and_made_again() {
    let _serial = serial();
    let work = tempfile::Builder::new()
        .prefix("hearth-modules-")
        .tempdir()
        .unwrap();
    let images = debian_oci(work.path(), false);
    let registry = TestRegistry::start(false);
    let noboot = registry.push(&images.layout, "noboot", "debian/noboot:12");
    let kernel = registry.push(&images.layout, "kernel", "debian/kernel:12");

    // A debugfs ahead in hearthd's PATH: the real one, then, once armed,
    // a SIGKILL to hearthd right after a write.
    let wrapper = KillWrapper::new("debugfs", "*\" -w \"*");
    let env = [("PATH", wrapper.path.as_str())];
    let mut d = Daemon::start_env(&env);
    let oci = |name: &str, reference: &str| {
        Image::oci(
            name,
            OciSource {
                reference: Some(reference.to_string()),
                insecure: true,
                ..Default::default()
            },
        )
        .json()
    };
    d.apply(vec![
        oci("km-rootfs", &noboot),
        oci("km-kernel", &kernel),
        image_disk("km-root", "km-rootfs", None),
    ]);
    for name in ["km-rootfs", "km-kernel"] {
        d.wait_object(
            "virtualimages",
            name,
            "Ready",
            Duration::from_secs(600),
            |v| {
                assert_ne!(v["status"]["phase"], "Failed", "{v:#}");
                v["status"]["phase"] == "Ready"
            },
        );
    }
    let disk_ready = |d: &Daemon| {
        d.wait_object(
            "virtualdisks",
            "km-root",
            "Ready",
            Duration::from_secs(120),
            |v| v["status"]["phase"] == "Ready",
        )
    };
    let first_head = PathBuf::from(disk_ready(&d)["status"]["path"].as_str().unwrap());
    let before = layer_files(&d);

    wrapper.arm();
    let vm = json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualMachine",
        "metadata": {"name": "km"},
        "spec": {"runPolicy": "AlwaysOn", "cpus": 1, "memory": "768Mi", "stopTimeoutSeconds": 5,
                 "disks": [{"virtualDiskName": "km-root"}],
                 "boot": {"kernelImage": "km-kernel"}, "guestAgent": true}});
    // The apply is answered before the start; the kill comes during it.
    let _ = d.try_request("POST", "/v1/apply", Some(&json!({"items": [vm.clone()]})));
    let died = hearth_test_support::eventually(Duration::from_secs(300), || {
        d.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_some())
    });
    assert!(died, "hearthd was not killed after the write:\n{}", d.log());
    d.kill();
    // What the crash left: one overlay more than the store names, written
    // but not recorded; no QEMU was started.
    let crashed = layer_files(&d);
    let stray: Vec<&String> = crashed.iter().filter(|f| !before.contains(f)).collect();
    assert_eq!(stray.len(), 1, "{before:?} -> {crashed:?}");
    let stray = stray[0].clone();
    assert!(d.qemu_pids_of("km").is_empty());

    d.spawn_env(&env);
    d.wait_vm("km", "Running", Duration::from_secs(300), |v| {
        assert_ne!(v["status"]["phase"], "Failed", "{v:#}");
        v["status"]["phase"] == "Running"
    });
    assert!(
        !layer_files(&d).contains(&stray),
        "the crash's overlay was swept"
    );
    // Stopped, then the disk read through its chain with QEMU gone.
    let mut off = vm;
    off["spec"]["runPolicy"] = json!("AlwaysOff");
    d.apply(vec![off]);
    d.wait_vm("km", "Stopped", Duration::from_secs(120), |v| {
        v["status"]["phase"] == "Stopped"
    });
    wait_until("km's QEMU is gone", Duration::from_secs(30), || {
        d.qemu_pids_of("km").is_empty()
    });
    let head = PathBuf::from(disk_ready(&d)["status"]["path"].as_str().unwrap());
    assert_ne!(head, first_head, "the copy is a new head");
    let raw = work.path().join("root.raw");
    tool(
        "qemu-img",
        &[
            "convert",
            "-O",
            "raw",
            head.to_str().unwrap(),
            raw.to_str().unwrap(),
        ],
    );
    let module = format!("/usr/lib/modules/{}/{}", images.version, images.module);
    let out = work.path().join("module.ko");
    tool(
        "debugfs",
        &[
            "-R",
            &format!("dump {module} {}", out.display()),
            raw.to_str().unwrap(),
        ],
    );
    assert_eq!(sha256sum(&out), images.module_sha, "{module}");
    let _ = std::fs::remove_file(&raw);
    // The first head is below the new one, unchanged: it has no modules.
    let first_raw = work.path().join("first.raw");
    tool(
        "qemu-img",
        &[
            "convert",
            "-U",
            "-O",
            "raw",
            first_head.to_str().unwrap(),
            first_raw.to_str().unwrap(),
        ],
    );
    let stat = Command::new("debugfs")
        .args(["-R", &format!("stat {module}"), first_raw.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&stat.stderr).contains("File not found"),
        "{stat:?}"
    );
    let _ = std::fs::remove_file(&first_raw);
}
