//! `hearth console` end to end: the real CLI attached through a real hearthd
//! to the serial port of a real QEMU running the test guest, whose init runs
//! a shell on ttyS0 (`hearth.console_shell=1`). One boot serves every check.

mod common;

use std::io::{Read, Write};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;

/// A running `hearth console VM`: its stdin, and its stdout collected by a
/// thread as it arrives.
struct Attached {
    child: Child,
    stdin: Option<ChildStdin>,
    out: Arc<Mutex<Vec<u8>>>,
}

impl Attached {
    fn start(d: &Daemon, vm: &str) -> Attached {
        let mut child = d
            .cli_command(&["console", vm, "--tail", "5"], Stdio::piped())
            .spawn()
            .expect("run hearth console");
        let stdin = child.stdin.take();
        let mut stdout = child.stdout.take().expect("stdout");
        let out = Arc::new(Mutex::new(Vec::new()));
        let sink = out.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    return;
                }
                sink.lock().expect("lock").extend_from_slice(&buf[..n]);
            }
        });
        Attached { child, stdin, out }
    }

    fn send(&mut self, bytes: &[u8]) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(bytes).expect("write to hearth console");
        stdin.flush().expect("flush");
    }

    fn output(&self) -> String {
        String::from_utf8_lossy(&self.out.lock().expect("lock")).into_owned()
    }

    /// Waits until the attached stdout shows `needle`.
    fn wait_for(&self, needle: &str, timeout: Duration) {
        assert!(
            eventually_every(Duration::from_millis(50), timeout, || {
                self.output().contains(needle)
            }),
            "no {needle:?} on the console within {timeout:?}; got:\n{}",
            self.output()
        );
    }

    /// Sends the detach key and waits for the CLI to exit; returns stderr.
    fn detach(mut self) -> String {
        self.send(&[0x1d]);
        let mut exited = None;
        assert!(
            eventually_every(Duration::from_millis(20), Duration::from_secs(20), || {
                exited = self.child.try_wait().expect("wait");
                exited.is_some()
            }),
            "hearth console did not detach"
        );
        let status = exited.expect("exited");
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            e.read_to_string(&mut err).expect("stderr");
        }
        assert!(status.success(), "hearth console failed: {err}");
        err
    }
}

/// `echo mark-$((N+1))-end`: the guest's echo of the line shows `$((`, only
/// the shell's output shows the computed number.
fn marker_command(seed: u32) -> (String, String) {
    (
        format!("echo mark-$(({seed}+1))-end\n"),
        format!("mark-{}-end", seed + 1),
    )
}

#[test]
fn console_attach_pipes_both_ways_one_writer_at_a_time() {
    let _serial = serial();
    let d = Daemon::start();
    apply_manifest(
        &d,
        "vm.yaml",
        &vm_yaml("con", "AlwaysOn", &[], "hearth.console_shell=1"),
    );
    d.wait_agent("con");
    let log = serial_log(&d, "con");
    wait_until("console shell in the log", Duration::from_secs(60), || {
        std::fs::read_to_string(&log).is_ok_and(|s| s.contains("console shell on ttyS0"))
    });

    let seed = std::process::id() % 100_000;
    let (cmd, want) = marker_command(seed);
    let mut first = Attached::start(&d, "con");
    // The log's last lines come first, as `hearth logs` shows them.
    first.wait_for("built-in shell (ash)", Duration::from_secs(30));
    first.send(cmd.as_bytes());
    first.wait_for(&want, Duration::from_secs(60));

    // A second client is refused while the first is attached, naming the VM.
    let out = d.cli(&["console", "con", "--tail", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "second attach succeeded: {err}");
    assert!(
        err.contains("\"con\"") && err.contains("already has a client attached"),
        "{err}"
    );
    let (status, body) = d.request("GET", "/v1/virtualmachines/con/console/attach", None);
    assert_eq!(status, 400, "not an upgrade request: {body}");

    let err = first.detach();
    assert!(err.contains("Detach with Ctrl-]"), "{err}");
    assert!(
        err.contains("Detached from VirtualMachine \"con\""),
        "{err}"
    );

    // The output also reached the log file, client or not.
    let text = std::fs::read_to_string(&log).expect("serial.log");
    assert!(text.contains(&want), "{want:?} not in serial.log:\n{text}");

    // After the detach the console is free again, at once.
    let (cmd2, want2) = marker_command(seed + 7);
    let mut second = Attached::start(&d, "con");
    second.send(cmd2.as_bytes());
    second.wait_for(&want2, Duration::from_secs(60));
    second.detach();
    wait_until(
        "second marker in serial.log",
        Duration::from_secs(10),
        || std::fs::read_to_string(&log).is_ok_and(|s| s.contains(&want2)),
    );

    // A restart truncates the log (logappend=off, as the file backend did),
    // and the new QEMU's socket takes an attach again.
    d.cli_ok(&["restart", "con"]);
    wait_until(
        "a fresh serial.log after the restart",
        Duration::from_secs(120),
        || {
            std::fs::read_to_string(&log).is_ok_and(|s| {
                !s.contains(&want) && !s.contains(&want2) && s.contains("console shell on ttyS0")
            })
        },
    );
    d.wait_agent("con");
    let (cmd3, want3) = marker_command(seed + 13);
    let mut third = Attached::start(&d, "con");
    third.send(cmd3.as_bytes());
    third.wait_for(&want3, Duration::from_secs(60));
    third.detach();

    // Unknown VM: 404 naming it.
    let out = d.cli(&["console", "nope", "--tail", "0"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nope"), "{err}");
}
