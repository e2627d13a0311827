//! Bad input is refused with a message naming the object and field, and
//! changes nothing. Needs a real daemon but boots no guest.

mod common;

use std::time::Duration;

use common::*;

fn apply_err(d: &Daemon, file: &str, text: &str) -> String {
    let m = manifest(d, file, text);
    d.cli_err(&["apply", "-f", m.to_str().expect("utf8")])
}

fn assert_nothing_stored(d: &Daemon) {
    let (_, vms) = d.request("GET", "/v1/virtualmachines", None);
    let (_, disks) = d.request("GET", "/v1/virtualdisks", None);
    assert_eq!(vms["items"].as_array().map(Vec::len), Some(0), "{vms}");
    assert_eq!(disks["items"].as_array().map(Vec::len), Some(0), "{disks}");
}

#[test]
fn invalid_manifests_are_refused_and_change_nothing() {
    let _serial = serial();
    let d = Daemon::start();
    let vm = vm_yaml("bad", "AlwaysOff", &[], "");

    let e = apply_err(
        &d,
        "syntax.yaml",
        "apiVersion: hearth.dev/v1alpha1\nkind: [VirtualMachine\n",
    );
    assert!(e.contains("syntax.yaml") && e.contains("line"), "{e}");

    let e = apply_err(
        &d,
        "unknown.yaml",
        &vm.replace("memory: 256Mi", "memory: 256Mi\n  gpus: 2"),
    );
    assert!(
        e.contains("VirtualMachine \"bad\"") && e.contains("spec.gpus"),
        "{e}"
    );

    let e = apply_err(&d, "size.yaml", &vm.replace("256Mi", "12XB"));
    assert!(e.contains("spec.memory") && e.contains("12XB"), "{e}");

    let e = apply_err(&d, "name.yaml", &vm.replace("name: bad", "name: Bad_Name"));
    assert!(
        e.contains("metadata.name") && e.contains("DNS label"),
        "{e}"
    );

    let e = apply_err(
        &d,
        "kind.yaml",
        &vm.replace("kind: VirtualMachine", "kind: Pod"),
    );
    assert!(e.contains("unknown kind \"Pod\""), "{e}");

    let e = apply_err(&d, "kernel.yaml", &vm.replace("vmlinuz", "no-such-kernel"));
    assert!(
        e.contains("spec.boot.kernel") && e.contains("no-such-kernel"),
        "{e}"
    );

    // A freeze deadline no snapshot could meet.
    let e = apply_err(
        &d,
        "deadline.yaml",
        &vm.replace("memory: 256Mi", "memory: 256Mi\n  freezeDeadlineSeconds: 2"),
    );
    assert!(
        e.contains("VirtualMachine \"bad\"") && e.contains("spec.freezeDeadlineSeconds"),
        "{e}"
    );

    // A path outside the allowed roots is refused even though it exists.
    let e = apply_err(
        &d,
        "root.yaml",
        &format!(
            "{vm}---\napiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {{name: etc}}\nspec:\n  source: {{image: /etc/hostname}}\n"
        ),
    );
    assert!(
        e.contains("spec.source.image") && e.contains("outside the allowed image roots"),
        "{e}"
    );

    // A valid object next to an invalid one is not applied either.
    let e = apply_err(
        &d,
        "half.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("ok-disk"),
            vm.replace("cpus", "cpu")
                .replace("memory: 256Mi", "memory: 256Mi\n  cpux: 1")
        ),
    );
    assert!(e.contains("spec.cpux"), "{e}");

    assert_nothing_stored(&d);

    // Straight to the API, bypassing the CLI's own checks.
    let (status, v) = d.request("POST", "/v1/apply", Some(&serde_json::json!({"items": [{"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk", "metadata": {"name": "x"}, "spec": {"size": "1Gi", "source": {"blank": {}}, "extra": 1}}]})));
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap_or_default()
            .contains("spec.extra"),
        "{v}"
    );
    assert_nothing_stored(&d);
    assert!(d.qemu_pids().is_empty());
}

#[test]
fn disk_rules_and_objects_arriving_in_any_order() {
    let _serial = serial();
    let d = Daemon::start();

    // A VM whose disk does not exist yet is accepted and waits, naming it.
    let m = manifest(
        &d,
        "vm.yaml",
        &vm_yaml("waiter", "AlwaysOn", &["later"], ""),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    let vm = d.wait_phase("waiter", "Pending", Duration::from_secs(20));
    let cond = vm["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "DisksReady").cloned())
        .expect("DisksReady condition");
    assert_eq!(cond["status"], "False");
    assert!(
        cond["message"]
            .as_str()
            .unwrap_or_default()
            .contains("\"later\""),
        "{cond}"
    );
    assert!(d.qemu_pids().is_empty());

    // A second VM may not take the same disk.
    let e = {
        let m = manifest(
            &d,
            "vm2.yaml",
            &vm_yaml("thief", "AlwaysOff", &["later"], ""),
        );
        d.cli_err(&["apply", "-f", m.to_str().expect("utf8")])
    };
    assert!(
        e.contains("VirtualMachine \"thief\"")
            && e.contains("spec.disks[0].virtualDiskName")
            && e.contains("already used by VirtualMachine \"waiter\""),
        "{e}"
    );
    assert!(d.get_vm("thief").is_none());

    // The disk arrives: the VM starts without being touched.
    let m = manifest(
        &d,
        "disk.yaml",
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {name: later}\nspec: {size: 64Mi, source: {blank: {}}}\n",
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_phase("waiter", "Running", Duration::from_secs(60));
    let disk = d.get_disk("later").expect("disk");
    assert_eq!(disk["status"]["capacity"], 64 << 20);

    // A disk's source cannot change under a VM.
    let e = {
        let m = manifest(
            &d,
            "disk2.yaml",
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {name: later}\nspec: {size: 128Mi, source: {blank: {}}}\n",
        );
        d.cli_err(&["apply", "-f", m.to_str().expect("utf8")])
    };
    assert!(
        e.contains("VirtualDisk \"later\"") && e.contains("spec"),
        "{e}"
    );

    // Deleting a disk in use is refused; the disk stays.
    let e = d.cli_err(&["delete", "disk", "later"]);
    assert!(e.contains("in use"), "{e}");
    assert!(d.get_disk("later").is_some());

    d.cli_ok(&["delete", "vm", "waiter"]);
    wait_until("VM gone", Duration::from_secs(60), || {
        d.get_vm("waiter").is_none()
    });
    assert!(d.qemu_pids().is_empty());
    d.cli_ok(&["delete", "disk", "later"]);
    wait_until("disk gone", Duration::from_secs(30), || {
        d.get_disk("later").is_none()
    });
}
