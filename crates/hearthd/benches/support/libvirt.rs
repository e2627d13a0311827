//! libvirt, for the benchmarks that compare hearth with it (never CI): its
//! daemons, `virsh`, and the guest agent through it.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{Value, json};

pub const URI: &str = "qemu:///system";

/// Runs `cmd` to its end; its stdout, or a panic naming it with its output.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn virsh(args: &[&str]) -> String {
    run(Command::new("virsh").arg("-c").arg(URI).args(args))
}

/// libvirt's daemons up and /dev/kvm usable by its QEMU user
/// (`support/libvirt-up.sh`); `also`: the bench's packages besides libvirt's,
/// for the install line a failure prints.
pub fn up(repo_root: &Path, also: &str) {
    let script = repo_root.join("crates/hearthd/benches/support/libvirt-up.sh");
    let status = Command::new(&script)
        .status()
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    assert!(
        status.success(),
        "{} failed: libvirt is needed for this benchmark (see docs/benchmarks.md: \
         apt-get install -y --no-install-recommends libvirt-daemon-system \
         libvirt-daemon-system-sysv libvirt-clients{also})",
        script.display()
    );
}

/// One guest-agent command to domain `dom`; its `return`.
pub fn agent(dom: &str, cmd: &Value) -> Result<Value, String> {
    let out = Command::new("virsh")
        .args(["-c", URI, "qemu-agent-command", dom, &cmd.to_string()])
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    serde_json::from_slice::<Value>(&out.stdout)
        .map(|v| v["return"].clone())
        .map_err(|e| e.to_string())
}

/// `script` run by `/bin/sh` in `dom`'s guest (`guest-exec`), waited for up
/// to `timeout`: its exit code and stdout.
pub fn agent_sh(dom: &str, script: &str, timeout: Duration) -> (i64, String) {
    let started = agent(
        dom,
        &json!({"execute": "guest-exec", "arguments": {
            "path": "/bin/sh", "arg": ["-c", script], "capture-output": true}}),
    )
    .unwrap_or_else(|e| panic!("guest-exec {script}: {e}"));
    let pid = started["pid"].as_i64().expect("guest-exec pid");
    let deadline = Instant::now() + timeout;
    loop {
        let s = agent(
            dom,
            &json!({"execute": "guest-exec-status", "arguments": {"pid": pid}}),
        )
        .unwrap_or_else(|e| panic!("guest-exec-status: {e}"));
        if s["exited"] == true {
            let out = s["out-data"]
                .as_str()
                .map(|b| {
                    base64::engine::general_purpose::STANDARD
                        .decode(b)
                        .expect("base64 out-data")
                })
                .unwrap_or_default();
            return (
                s["exitcode"].as_i64().unwrap_or(-1),
                String::from_utf8_lossy(&out).into_owned(),
            );
        }
        assert!(Instant::now() < deadline, "guest-exec {script} did not end");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts the transient domain `name` (`virsh create`) of the small test
/// guest (`guest_dir`'s kernel and initramfs), 256 MiB, 1 vCPU, q35, TCG,
/// acpi, a qemu-ga channel, no balloon, no NIC, on `disks_xml` (`<disk>`
/// elements); its serial console goes to `dir/serial.log`.
pub fn create_domain(name: &str, guest_dir: &Path, dir: &Path, disks_xml: &str) {
    let xml = format!(
        "<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>256</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='q35'>hvm</type><kernel>{k}</kernel><initrd>{i}</initrd><cmdline>console=ttyS0 quiet panic=-1</cmdline></os>
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff><on_reboot>destroy</on_reboot><on_crash>destroy</on_crash>
  <devices>
    {disks_xml}
    <serial type='file'><source path='{log}'/><target port='0'/></serial>
    <channel type='unix'><source mode='bind'/><target type='virtio' name='org.qemu.guest_agent.0'/></channel>
    <memballoon model='none'/>
  </devices>
</domain>
",
        k = guest_dir.join("vmlinuz").display(),
        i = guest_dir.join("initrd.img").display(),
        log = dir.join("serial.log").display(),
    );
    let path = dir.join("domain.xml");
    std::fs::write(&path, xml).expect("domain xml");
    virsh(&["create", path.to_str().expect("utf-8")]);
}

/// Waits until `dom`'s guest agent answers a ping.
pub fn wait_agent(dom: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while agent(dom, &json!({"execute": "guest-ping"})).is_err() {
        assert!(
            Instant::now() < deadline,
            "libvirt guest agent of {dom}: no answer after {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
