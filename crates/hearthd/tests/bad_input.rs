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
    let m = manifest(&d, "disk.yaml", &Disk::blank("later", "64Mi").yaml());
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_phase("waiter", "Running", Duration::from_secs(60));
    let disk = d.get_disk("later").expect("disk");
    assert_eq!(disk["status"]["capacity"], 64 << 20);

    // A disk's source cannot change under a VM.
    let e = {
        let m = manifest(&d, "disk2.yaml", &Disk::blank("later", "128Mi").yaml());
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
    d.wait_gone("virtualmachines", "waiter", Duration::from_secs(60));
    assert!(d.qemu_pids().is_empty());
    d.cli_ok(&["delete", "disk", "later"]);
    d.wait_gone("virtualdisks", "later", Duration::from_secs(30));
}

/// One HTTP/1.1 request over the API socket with exactly these bytes as its
/// body and this `Content-Type` (none when `None`): the status, the answer's
/// `Content-Type` and its body. The body is written from a thread of its
/// own, so an answer that comes before the whole body was read is still
/// read.
fn send(
    d: &Daemon,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: Vec<u8>,
) -> (u16, String, Vec<u8>) {
    use std::io::{Read, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(d.socket()).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: hearthd\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(t) = content_type {
        head.push_str(&format!("Content-Type: {t}\r\n"));
    }
    head.push_str("\r\n");
    let mut writer = stream.try_clone().expect("clone");
    let sender = std::thread::spawn(move || {
        let _ = writer.write_all(head.as_bytes());
        let _ = writer.write_all(&body);
    });
    let mut buf = Vec::new();
    let _ = stream.read_to_end(&mut buf);
    let _ = sender.join();
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("{method} {path}: no HTTP answer: {buf:?}"));
    let head = String::from_utf8_lossy(&buf[..split]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    let content_type = head
        .lines()
        .find_map(|l| l.strip_prefix("content-type:"))
        .unwrap_or_default()
        .trim()
        .to_string();
    (status, content_type, buf[split + 4..].to_vec())
}

/// Sends a request that must be refused with `status` and the documented
/// `{"error": message}` JSON body; the message.
fn refused(
    d: &Daemon,
    (method, path): (&str, &str),
    content_type: Option<&str>,
    body: &[u8],
    status: u16,
) -> String {
    let (got, content_type, answer) = send(d, method, path, content_type, body.to_vec());
    let text = String::from_utf8_lossy(&answer).into_owned();
    assert_eq!(got, status, "{method} {path}: {text}");
    assert_eq!(
        content_type, "application/json",
        "{method} {path}: answered {got} as {content_type:?}: {text}"
    );
    let v: serde_json::Value = serde_json::from_slice(&answer)
        .unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {text}"));
    v["error"]
        .as_str()
        .unwrap_or_else(|| panic!("{method} {path}: no \"error\" string: {v}"))
        .to_string()
}

fn disk_json(name: &str) -> String {
    format!(
        r#"{{"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk", "metadata": {{"name": "{name}"}}, "spec": {{"size": "64Mi", "source": {{"blank": {{}}}}}}}}"#
    )
}

#[test]
fn malformed_requests_get_the_documented_error_body_and_limits_are_enforced() {
    let _serial = serial();
    let images = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start_without_guest(&[images.path()], &[]);
    let json = Some("application/json");
    let apply = ("POST", "/v1/apply");
    let exec = ("POST", "/v1/virtualmachines/nobody/agent/exec");

    // Not JSON at all, in the body of every kind of handler.
    let e = refused(&d, apply, json, br#"{"items": ["#, 400);
    assert!(e.contains("not JSON") && e.contains("line 1"), "{e}");
    let e = refused(&d, exec, json, br#"{"path": "/bin/true""#, 400);
    assert!(e.contains("not JSON"), "{e}");
    // JSON of the wrong shape: named.
    let e = refused(&d, exec, json, br#"{"path": 5}"#, 400);
    assert!(e.contains("path") && e.contains("invalid type"), "{e}");
    let e = refused(
        &d,
        exec,
        json,
        br#"{"path": "/bin/true", "user": "root"}"#,
        400,
    );
    assert!(e.contains("unknown field `user`"), "{e}");
    // A body that says it is something else.
    let e = refused(&d, apply, Some("text/plain"), b"{}", 415);
    assert!(
        e.contains("text/plain") && e.contains("application/json"),
        "{e}"
    );
    let e = refused(
        &d,
        exec,
        Some("application/x-www-form-urlencoded"),
        b"path=/bin/true",
        415,
    );
    assert!(e.contains("application/json"), "{e}");
    // Too large: the documented 8 MiB.
    let big = vec![b' '; (8 << 20) + 1];
    let e = refused(&d, apply, json, &big, 413);
    assert!(e.contains("8 MiB"), "{e}");

    // The envelope of an apply: unknown fields and duplicate keys anywhere
    // are refused, naming them.
    let e = refused(
        &d,
        apply,
        json,
        format!(r#"{{"items": [{}], "dryRun": true}}"#, disk_json("dry")).as_bytes(),
        400,
    );
    assert!(e.contains("dryRun"), "{e}");
    let e = refused(
        &d,
        apply,
        json,
        format!(r#"{{"items": [], "items": [{}]}}"#, disk_json("twice")).as_bytes(),
        400,
    );
    assert!(e.contains("duplicate key \"items\""), "{e}");
    let e = refused(
        &d,
        apply,
        json,
        format!(
            r#"{{"items": [{}]}}"#,
            disk_json("first").replacen(
                r#""name": "first""#,
                r#""name": "first", "name": "second""#,
                1
            )
        )
        .as_bytes(),
        400,
    );
    assert!(
        e.contains("duplicate key \"name\"") && e.contains("items[0].metadata"),
        "{e}"
    );
    let e = refused(
        &d,
        exec,
        json,
        br#"{"path": "/bin/true", "path": "/bin/rm"}"#,
        400,
    );
    assert!(e.contains("duplicate key \"path\""), "{e}");

    // Query and path parameters that do not parse, and limits beyond what
    // docs/http-api.md allows.
    let e = refused(&d, ("GET", "/v1/events?limit=many"), None, b"", 400);
    assert!(e.contains("limit"), "{e}");
    let e = refused(&d, ("GET", "/v1/events?limit=10001"), None, b"", 400);
    assert!(e.contains("limit") && e.contains("10000"), "{e}");
    let e = refused(
        &d,
        ("GET", "/v1/watch?events=true&limit=10001"),
        None,
        b"",
        400,
    );
    assert!(e.contains("limit") && e.contains("10000"), "{e}");
    let e = refused(
        &d,
        ("GET", "/v1/virtualmachines/nobody/agent/exec/first"),
        None,
        b"",
        400,
    );
    assert!(e.contains("id"), "{e}");
    let e = refused(
        &d,
        (
            "GET",
            "/v1/virtualmachines/nobody/agent/exec/1?waitMs=30001",
        ),
        None,
        b"",
        400,
    );
    assert!(e.contains("waitMs") && e.contains("30000"), "{e}");
    let e = refused(
        &d,
        exec,
        json,
        br#"{"path": "/bin/true", "timeoutSeconds": 601}"#,
        400,
    );
    assert!(e.contains("timeoutSeconds") && e.contains("600"), "{e}");
    let e = refused(
        &d,
        ("GET", "/v1/virtualmachines/nobody/console?follow=maybe"),
        None,
        b"",
        400,
    );
    assert!(e.contains("follow"), "{e}");
    // Routes and methods that do not exist.
    let e = refused(&d, ("GET", "/v1/no/such/route/at/all"), None, b"", 404);
    assert!(e.contains("/v1/no/such/route/at/all"), "{e}");
    let e = refused(&d, ("PUT", "/v1/health"), None, b"", 405);
    assert!(e.contains("PUT"), "{e}");

    // Nothing of the refused applies was stored, and the daemon answers.
    assert_nothing_stored(&d);
    assert_eq!(d.request("GET", "/v1/health", None).0, 200);
}

#[test]
fn status_on_input_is_ignored_not_validated() {
    let _serial = serial();
    let images = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start_without_guest(&[images.path()], &[]);
    // A status no hearthd would write, of the wrong shape even: ignored.
    let mut disk: serde_json::Value = serde_json::from_str(&disk_json("kept")).expect("json");
    disk["status"] = serde_json::json!({"phase": "Exploded", "capacity": "lots", "extra": true});
    let (status, v) = d.apply_json(vec![disk.clone()]);
    assert_eq!(status, 200, "{v}");
    let mut other: serde_json::Value = serde_json::from_str(&disk_json("kept-too")).expect("json");
    other["status"] = serde_json::json!("not even a mapping");
    let (status, v) = d.apply_json(vec![other]);
    assert_eq!(status, 200, "{v}");
    // The status is hearthd's own: the disk's file, made by hearthd.
    let kept = d.wait_object(
        "virtualdisks",
        "kept",
        "Ready",
        Duration::from_secs(30),
        |v| v["status"]["phase"] == "Ready",
    );
    assert_eq!(kept["status"]["capacity"], 64 << 20, "{kept}");
    assert!(kept["status"].get("extra").is_none(), "{kept}");
    let path = kept["status"]["path"].as_str().expect("path");
    assert!(std::path::Path::new(path).is_file(), "{path}");
    // Applied again with the same bogus status: nothing changed.
    let (status, v) = d.apply_json(vec![disk]);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["results"][0]["action"], "unchanged", "{v}");
}
