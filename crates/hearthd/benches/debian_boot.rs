//! Benchmark (not a test): the Debian test image booted to "guest agent
//! answers", through hearth against plain QEMU with the same disk, the same
//! firmware and the same cloud-init seed, in the same run.
//!
//! Once: a hearthd imports guest/out/debian-12.qcow2 (file source). Then
//! RUNS times each (default 2, `HEARTH_BENCH_RUNS`; a boot takes tens of
//! seconds under TCG), alternating:
//! - hearth: one apply of a VirtualDisk from the image and an AlwaysOn
//!   VirtualMachine (firmware `HEARTH_BENCH_FIRMWARE`, default BIOS, with
//!   cloud-init user data), timed from the request until its status shows
//!   the agent connected; its seed file is kept for the plain run; then both
//!   are deleted.
//! - plain QEMU: a qcow2 overlay over the same stored image, that seed, and
//!   the same firmware, started by hand; timed from the spawn until qemu-ga
//!   answers `guest-sync-delimited` on the agent socket.
//!
//! Prints a markdown table for docs/benchmarks.md.
//! Run: `cargo bench -p hearthd --bench debian_boot`.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;
use support::{loadavg, stats};

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(900);

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!(
            "debian_boot: a benchmark; run it with `cargo bench -p hearthd --bench debian_boot`"
        );
        return;
    }
    let runs: usize = std::env::var("HEARTH_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let firmware = std::env::var("HEARTH_BENCH_FIRMWARE").unwrap_or_else(|_| "BIOS".into());
    let image = repo_root().join("guest/out/debian-12.qcow2");
    assert!(
        image.is_file(),
        "{} is missing: run `guest/debian/build.sh`",
        image.display()
    );
    // The harness's image root is guest/out, where the image is.
    let d = Daemon::start();
    apply(
        &d,
        json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualImage",
               "metadata": {"name": "debian"}, "spec": {"source": {"file": image}}}),
    );
    let img = wait_json(&d, "/v1/virtualimages/debian", |v| {
        v["status"]["phase"] == "Ready"
    });
    let stored = PathBuf::from(img["status"]["path"].as_str().expect("path"));
    let scratch = tempfile::tempdir().expect("scratch");
    let mut hearth_times = Vec::new();
    let mut plain_times = Vec::new();
    let mut loads = Vec::new();

    for i in 0..runs {
        // --- hearth ---
        let (vm, disk) = (format!("deb{i}"), format!("deb{i}-root"));
        let load = loadavg();
        let t0 = Instant::now();
        let (s, v) = d.request(
            "POST",
            "/v1/apply",
            Some(&json!({"items": [
                {"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk",
                 "metadata": {"name": disk}, "spec": {"source": {"virtualImage": "debian"}}},
                {"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualMachine",
                 "metadata": {"name": vm},
                 "spec": {"cpus": 1, "memory": "768Mi", "firmware": firmware,
                          "disks": [{"virtualDiskName": disk}],
                          "cloudInit": {"userData": "#cloud-config\n{}\n"}}}]})),
        );
        assert_eq!(s, 200, "apply: {v}");
        d.wait_vm(&vm, "agent connected", TIMEOUT, |v| {
            v["status"]["agentConnected"] == true
        });
        let hearth = t0.elapsed();
        let seed = find_seed(&d.state_dir().join("vms").join(&vm));
        let kept_seed = scratch.path().join(format!("seed{i}.img"));
        std::fs::copy(&seed, &kept_seed).expect("copy the seed");
        let vars = (firmware == "UEFI").then(|| scratch.path().join(format!("vars{i}.fd")));
        if let Some(v) = &vars {
            std::fs::copy("/usr/share/OVMF/OVMF_VARS_4M.fd", v).expect("OVMF vars template");
        }
        let (s, v) = d.request("DELETE", &format!("/v1/virtualmachines/{vm}"), None);
        assert_eq!(s, 200, "{v}");
        wait_until("VM gone", Duration::from_secs(180), || {
            d.get_vm(&vm).is_none() && d.qemu_pids().is_empty()
        });
        let (s, v) = d.request("DELETE", &format!("/v1/virtualdisks/{disk}"), None);
        assert_eq!(s, 200, "{v}");
        std::thread::sleep(Duration::from_secs(2));

        // --- plain QEMU ---
        let overlay = scratch.path().join(format!("plain{i}.qcow2"));
        let out = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
            .arg(&stored)
            .arg(&overlay)
            .output()
            .expect("qemu-img");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let agent = scratch.path().join(format!("agent{i}.sock"));
        let plain = plain_boot(
            &overlay,
            &kept_seed,
            vars.as_deref(),
            &agent,
            scratch.path(),
        );
        eprintln!(
            "debian_boot: run {}: hearth {} ms, plain QEMU {} ms ({firmware}, load {load})",
            i + 1,
            hearth.as_millis(),
            plain.as_millis()
        );
        hearth_times.push(hearth.as_secs_f64() * 1e3);
        plain_times.push(plain.as_secs_f64() * 1e3);
        loads.push(load);
    }

    println!();
    println!(
        "| run | firmware | hearth: apply → agent (ms) | plain QEMU: spawn → agent (ms) | load avg |"
    );
    println!("|---|---|---|---|---|");
    for i in 0..hearth_times.len() {
        println!(
            "| {} | {firmware} | {:.0} | {:.0} | {} |",
            i + 1,
            hearth_times[i],
            plain_times[i],
            loads[i]
        );
    }
    let (hm, _, _) = stats(&hearth_times);
    let (pm, _, _) = stats(&plain_times);
    println!();
    println!("median: hearth {hm:.0} ms, plain QEMU {pm:.0} ms ({firmware})");
}

fn apply(d: &Daemon, item: Value) {
    let (s, v) = d.request("POST", "/v1/apply", Some(&json!({"items": [item]})));
    assert_eq!(s, 200, "apply: {v}");
}

fn wait_json(d: &Daemon, path: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let t0 = Instant::now();
    loop {
        let (_, v) = d.request("GET", path, None);
        if pred(&v) {
            return v;
        }
        assert!(v["status"]["phase"] != "Failed", "{path}: {v:#}");
        assert!(t0.elapsed() < TIMEOUT, "{path}: {v:#}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The NoCloud seed hearth wrote for a VM.
fn find_seed(dir: &Path) -> PathBuf {
    let seed = dir.join("cidata.img");
    assert!(seed.is_file(), "no cloud-init seed at {}", seed.display());
    seed
}

/// Boots the disk with plain QEMU; returns the time until qemu-ga answers.
fn plain_boot(disk: &Path, seed: &Path, vars: Option<&Path>, agent: &Path, dir: &Path) -> Duration {
    let blockdev = |node: &str, file: &Path, format: &str, read_only: bool| {
        json!({"driver": format, "node-name": node, "read-only": read_only,
               "file": {"driver": "file", "filename": file, "read-only": read_only}})
        .to_string()
    };
    let mut machine = "q35".to_string();
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args([
        "-accel",
        "tcg",
        "-nodefaults",
        "-nographic",
        "-no-reboot",
        "-m",
        "768",
        "-smp",
        "1",
    ]);
    if let Some(vars) = vars {
        cmd.arg("-blockdev").arg(blockdev(
            "fw-code",
            Path::new("/usr/share/OVMF/OVMF_CODE_4M.fd"),
            "raw",
            true,
        ));
        cmd.arg("-blockdev")
            .arg(blockdev("fw-vars", vars, "raw", false));
        machine.push_str(",pflash0=fw-code,pflash1=fw-vars");
    }
    cmd.args(["-machine", &machine]);
    cmd.arg("-blockdev")
        .arg(blockdev("root", disk, "qcow2", false));
    cmd.args([
        "-device",
        r#"{"driver":"virtio-blk-pci","drive":"root","bootindex":0}"#,
    ]);
    cmd.arg("-blockdev")
        .arg(blockdev("seed", seed, "raw", true));
    cmd.args(["-device", r#"{"driver":"virtio-blk-pci","drive":"seed"}"#]);
    cmd.args(["-device", "virtio-serial-pci"]);
    cmd.arg("-chardev").arg(format!(
        "socket,id=ga,path={},server=on,wait=off",
        agent.display()
    ));
    cmd.args([
        "-device",
        "virtserialport,chardev=ga,name=org.qemu.guest_agent.0",
    ]);
    cmd.arg("-serial")
        .arg(format!("file:{}", dir.join("plain-serial.log").display()));
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let t0 = Instant::now();
    let mut child = cmd.spawn().expect("qemu-system-x86_64");
    let mut id = 1000u64;
    let answered = loop {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("plain QEMU exited: {status}");
        }
        if t0.elapsed() > TIMEOUT {
            break false;
        }
        id += 1;
        if agent_answers(agent, id) {
            break true;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let took = t0.elapsed();
    let _ = child.kill();
    let _ = child.wait();
    assert!(answered, "plain QEMU: the agent never answered");
    took
}

/// One resynchronisation with qemu-ga: 0xFF, `guest-sync-delimited`, and
/// its reply carrying our id after the 0xFF sentinel.
fn agent_answers(socket: &Path, id: u64) -> bool {
    let Ok(mut s) = UnixStream::connect(socket) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    // The sentinel is the raw byte 0xFF, then the command.
    let mut bytes = vec![0xffu8];
    bytes.extend_from_slice(
        format!("{{\"execute\":\"guest-sync-delimited\",\"arguments\":{{\"id\":{id}}}}}\n")
            .as_bytes(),
    );
    if s.write_all(&bytes).is_err() {
        return false;
    }
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    let deadline = Instant::now() + Duration::from_millis(800);
    while Instant::now() < deadline && buf.len() < 64 << 10 {
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(_) => break,
        }
        let text = String::from_utf8_lossy(&buf);
        if text.contains(&format!("\"return\": {id}")) || text.contains(&format!("\"return\":{id}"))
        {
            return true;
        }
    }
    false
}
