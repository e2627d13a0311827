//! `hearth console` end to end: the real CLI attached through a real hearthd
//! to the serial port of a real QEMU running the test guest, whose init runs
//! a shell on ttyS0 (`hearth.console_shell=1`). One boot serves every check.

mod common;

use std::io::{Read, Write};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;

/// A running `hearth console VM` (or another streaming command): its
/// stdin, and its stdout collected by a thread as it arrives.
struct Attached {
    child: Child,
    stdin: Option<ChildStdin>,
    out: Arc<Mutex<Vec<u8>>>,
}

impl Attached {
    fn start(d: &Daemon, vm: &str) -> Attached {
        Self::spawn(d, &["console", vm, "--tail", "5"])
    }

    fn spawn(d: &Daemon, args: &[&str]) -> Attached {
        let mut child = d
            .cli_command(args, Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("run hearth {args:?}: {e}"));
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

    /// Ends a command that would stream forever (`hearth logs -f`).
    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
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
    // A small bound on the console log, for the flood at the end; the
    // boots before it write far less.
    let d = Daemon::start_with(&["--console-log-max-bytes", "256Ki"]);
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

    // One start so far: no previous console, and the error names the VM.
    let out = d.cli(&["logs", "con", "--previous"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a previous console after one start");
    assert!(
        err.contains("\"con\"") && err.contains("no console of a previous start"),
        "{err}"
    );
    let (status, body) = d.request(
        "GET",
        "/v1/virtualmachines/con/console?previous=true&follow=true",
        None,
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("previous and follow"), "{body}");

    // A follower from before the restart goes on into the next start.
    let follower = Attached::spawn(&d, &["logs", "con", "-f"]);
    follower.wait_for(&want2, Duration::from_secs(30));

    // A restart starts a new log (logappend=off, as the file backend did)
    // and keeps the old one whole as the previous start's, and the new
    // QEMU's socket takes an attach again.
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
    let previous = log.with_file_name("serial.previous.log");
    let kept = std::fs::read(&previous).expect("serial.previous.log after the restart");
    let kept_text = String::from_utf8_lossy(&kept);
    assert!(
        kept_text.contains(&want) && kept_text.contains(&want2),
        "the first start's console is not kept whole:\n{kept_text}"
    );
    let shown = d.cli(&["logs", "con", "--previous"]);
    assert!(shown.status.success(), "{shown:?}");
    assert_eq!(
        shown.stdout, kept,
        "hearth logs --previous is not the kept file"
    );

    d.wait_agent("con");
    let (cmd3, want3) = marker_command(seed + 13);
    let mut third = Attached::start(&d, "con");
    third.send(cmd3.as_bytes());
    third.wait_for(&want3, Duration::from_secs(60));
    third.detach();
    // The follower read the first start's log to its end, then the new one
    // from its first byte: the new start's output once, after the old.
    follower.wait_for(&want3, Duration::from_secs(30));
    let followed = follower.output();
    follower.kill();
    let first_start = followed.find(&want2).expect("the first start's marker");
    let new_start = followed.rfind(&want3).expect("the new start's marker");
    assert!(first_start < new_start, "{followed}");
    let new_log = std::fs::read_to_string(&log).expect("serial.log");
    let shell_line = "console shell on ttyS0";
    assert_eq!(
        followed.matches(shell_line).count(),
        kept_text.matches(shell_line).count() + new_log.matches(shell_line).count(),
        "the follower missed or repeated a start's lines:\n{followed}"
    );

    // QEMU killed: the next start keeps what the guest printed last.
    let (cmd4, want4) = marker_command(seed + 29);
    let mut fourth = Attached::start(&d, "con");
    fourth.send(cmd4.as_bytes());
    fourth.wait_for(&want4, Duration::from_secs(60));
    fourth.detach();
    let pids = d.qemu_pids_of("con");
    assert_eq!(pids.len(), 1, "{pids:?}");
    let killed = std::process::Command::new("kill")
        .args(["-9", &pids[0].to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    wait_until(
        "a new start after QEMU was killed",
        Duration::from_secs(120),
        || {
            d.qemu_pids_of("con").iter().any(|p| *p != pids[0])
                && std::fs::read_to_string(&log)
                    .is_ok_and(|s| !s.contains(&want4) && s.contains("console shell on ttyS0"))
        },
    );
    let kept = std::fs::read_to_string(&previous).expect("serial.previous.log");
    assert!(
        kept.contains(&want3) && kept.contains(&want4) && !kept.contains(&want2),
        "the killed start's console is not the previous one:\n{kept}"
    );

    // A guest that floods its serial port: the log's allocated bytes stay
    // near the bound while the guest writes four times as much, the newest
    // output is kept whole where it was written, and a reader gets it
    // without the dropped part (no zeroes from the hole).
    let bound: u64 = 256 << 10;
    let flood: u64 = 1 << 20;
    let done = format!("flood-{seed}-done");
    d.wait_agent("con");
    let started = std::time::Instant::now();
    let script = format!(
        "yes 0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ | head -c {flood} > /dev/ttyS0; echo {done} > /dev/ttyS0"
    );
    d.cli_ok(&[
        "exec",
        "con",
        "--timeout",
        "300s",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let wrote = started.elapsed();
    let on_disk = |p: &std::path::Path| {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(p).expect("a VM's log");
        (m.len(), m.blocks() * 512)
    };
    let tail_has_done = || {
        let text = std::fs::read(&log).unwrap_or_default();
        String::from_utf8_lossy(&text[text.len().saturating_sub(4096)..]).contains(&done)
    };
    wait_until(
        "the flood's end in serial.log",
        Duration::from_secs(60),
        tail_has_done,
    );
    wait_until(
        "the console log trimmed to its bound",
        Duration::from_secs(30),
        || on_disk(&log).1 <= bound,
    );
    let (len, allocated) = on_disk(&log);
    assert!(len >= flood, "the guest wrote {len} bytes, not the flood");
    eprintln!(
        "console flood: {flood} bytes in {wrote:?}; serial.log {len} bytes long, {allocated} on disk"
    );
    let shown = d.cli(&["logs", "con"]);
    assert!(shown.status.success(), "{shown:?}");
    assert!(
        !shown.stdout.contains(&0u8),
        "hearth logs printed the hole as zeroes"
    );
    assert!(
        (shown.stdout.len() as u64) < len && shown.stdout.len() as u64 <= bound,
        "hearth logs printed {} bytes",
        shown.stdout.len()
    );
    let whole = std::fs::read(&log).expect("serial.log");
    assert!(
        whole.ends_with(&shown.stdout),
        "hearth logs is not the log's newest bytes"
    );
    assert!(String::from_utf8_lossy(&shown.stdout).contains(&done));

    // QEMU's own log is held to the same bound: written past it (appended
    // as QEMU's stderr is, by a writer of the test's: what the guest can
    // make QEMU print is a few warnings), it keeps its length and newest
    // bytes and loses its oldest.
    let qemu_log = log.with_file_name("qemu.log");
    let last = format!("qemu-log-{seed}-last");
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&qemu_log)
            .expect("qemu.log");
        let line = [b'w'; 1023];
        for _ in 0..(flood / 1024) {
            f.write_all(&line).unwrap();
            f.write_all(b"\n").unwrap();
        }
        writeln!(f, "{last}").unwrap();
    }
    wait_until(
        "qemu.log trimmed to its bound",
        Duration::from_secs(30),
        || on_disk(&qemu_log).1 <= bound,
    );
    let (len, allocated) = on_disk(&qemu_log);
    assert!(len > flood, "qemu.log is {len} bytes long");
    let whole = std::fs::read(&qemu_log).expect("qemu.log");
    assert!(
        whole.ends_with(format!("{last}\n").as_bytes()),
        "qemu.log lost its newest line"
    );
    assert!(
        whole[whole.len() - (bound as usize / 4)..]
            .iter()
            .all(|b| *b != 0),
        "qemu.log's newest bytes were punched out"
    );
    eprintln!("qemu.log: {len} bytes long, {allocated} on disk");

    // Unknown VM: 404 naming it.
    let out = d.cli(&["console", "nope", "--tail", "0"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nope"), "{err}");
}
