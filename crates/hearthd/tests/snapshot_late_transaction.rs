//! A snapshot transaction that QEMU runs late, end to end. hearthd's QMP
//! connection goes through a proxy that holds the `transaction` command
//! (and, since a stream keeps its order, everything hearthd sends after it)
//! for longer than hearthd waits for its reply: QEMU runs it late, as it
//! would with a busy monitor, while the guest and its agent go on. The
//! proxy is put in place as an operator could: hearthd is killed, the VM's
//! QMP socket renamed and the proxy bound at its path; the restarted
//! hearthd adopts the QEMU and connects to the proxy.
//!
//! Ground truth: the guest writes numbered lines to its data disk, each
//! synced, and prints each number on its console after the sync; qemu-ga's
//! fsfreeze hook prints each freeze and thaw there too. A snapshot's image,
//! converted with `qemu-img convert -U` once the VM is gone, must hold no
//! line the guest wrote after the thaw when hearthd calls it consistent.

mod common;

use std::io::Write;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde_json::{Value, json};

const SNAP_TIMEOUT: Duration = Duration::from_secs(90);
/// hearthd's budget for the transaction's reply (`TRANSACTION_BUDGET_MS`).
const TRANSACTION_BUDGET: Duration = Duration::from_secs(2);

/// Holds at most this many descriptors per message (QMP's `add-fd` sends one).
const MAX_FDS: usize = 8;

/// A proxy on a unix socket between hearthd and QEMU's QMP socket. It
/// passes every byte and every descriptor (`SCM_RIGHTS`) through, and, when
/// asked, holds the next `transaction` command for a while before passing
/// it on.
struct QmpProxy {
    hold: Arc<Mutex<Option<Duration>>>,
    /// When each held transaction reached the proxy and when QEMU got it.
    held: Arc<Mutex<Vec<(Instant, Instant)>>>,
    connections: Arc<AtomicUsize>,
}

impl QmpProxy {
    fn start(listen: &Path, qemu: PathBuf) -> QmpProxy {
        let listener = UnixListener::bind(listen).expect("bind the proxy's socket");
        let proxy = QmpProxy {
            hold: Arc::new(Mutex::new(None)),
            held: Arc::new(Mutex::new(Vec::new())),
            connections: Arc::new(AtomicUsize::new(0)),
        };
        let (hold, held, connections) = (
            proxy.hold.clone(),
            proxy.held.clone(),
            proxy.connections.clone(),
        );
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { break };
                let Ok(upstream) = UnixStream::connect(&qemu) else {
                    continue;
                };
                connections.fetch_add(1, Ordering::SeqCst);
                let (c2, u2) = (
                    client.try_clone().expect("clone"),
                    upstream.try_clone().expect("clone"),
                );
                let (hold, held) = (hold.clone(), held.clone());
                std::thread::spawn(move || to_qemu(c2, u2, &hold, &held));
                std::thread::spawn(move || to_hearthd(upstream, client));
            }
        });
        proxy
    }

    /// The next `transaction` reaches QEMU `d` after hearthd sent it.
    fn hold_next_transaction(&self, d: Duration) {
        *self.hold.lock().expect("lock") = Some(d);
    }

    fn held(&self) -> Vec<(Instant, Instant)> {
        self.held.lock().expect("lock").clone()
    }
}

/// hearthd → QEMU, descriptors included. Holding a chunk holds everything
/// after it too: the proxy reads nothing more from hearthd meanwhile.
fn to_qemu(
    client: UnixStream,
    qemu: UnixStream,
    hold: &Mutex<Option<Duration>>,
    held: &Mutex<Vec<(Instant, Instant)>>,
) {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let n = match rustix::net::recvmsg(
            &client,
            &mut [std::io::IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(m) if m.bytes > 0 => m.bytes,
            _ => break,
        };
        let fds: Vec<OwnedFd> = control
            .drain()
            .flat_map(|m| match m {
                RecvAncillaryMessage::ScmRights(fds) => fds.collect::<Vec<_>>(),
                _ => Vec::new(),
            })
            .collect();
        let chunk = &buf[..n];
        if contains(chunk, br#""execute":"transaction""#)
            && let Some(d) = hold.lock().expect("lock").take()
        {
            let at = Instant::now();
            std::thread::sleep(d);
            held.lock().expect("lock").push((at, Instant::now()));
        }
        let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
        let mut out_space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut out_control = SendAncillaryBuffer::new(&mut out_space);
        if !borrowed.is_empty() {
            assert!(out_control.push(SendAncillaryMessage::ScmRights(&borrowed)));
        }
        let Ok(sent) = rustix::net::sendmsg(
            &qemu,
            &[std::io::IoSlice::new(chunk)],
            &mut out_control,
            SendFlags::NOSIGNAL,
        ) else {
            break;
        };
        if (&qemu).write_all(&chunk[sent..]).is_err() {
            break;
        }
    }
    let _ = qemu.shutdown(std::net::Shutdown::Both);
    let _ = client.shutdown(std::net::Shutdown::Both);
}

/// QEMU → hearthd (QEMU sends no descriptors).
fn to_hearthd(mut qemu: UnixStream, mut client: UnixStream) {
    let _ = std::io::copy(&mut qemu, &mut client);
    let _ = client.shutdown(std::net::Shutdown::Both);
    let _ = qemu.shutdown(std::net::Shutdown::Both);
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

fn vm_manifest(deadline_s: u32) -> String {
    format!(
        "{}  freezeDeadlineSeconds: {deadline_s}\n",
        vm_yaml("late", "AlwaysOn", &["late-data"], "")
    )
}

/// What the guest's console shows of one cut (the `n`-th freeze and
/// thaw of its fsfreeze hook, from 1): the last line number the guest had
/// synced before the freeze, and the first it printed after the thaw.
/// Every line after that one was written after the thaw.
fn console_around_cut(d: &Daemon, n: usize) -> (u64, u64) {
    let text = std::fs::read_to_string(serial_log(d, "late")).expect("serial log");
    let nth = |pat: &str| -> usize {
        text.match_indices(pat)
            .nth(n - 1)
            .unwrap_or_else(|| panic!("no {pat:?} number {n} on the console"))
            .0
    };
    let freeze = nth("fsfreeze hook: freeze");
    let thaw = nth("fsfreeze hook: thaw");
    let seq_at = |s: &str| -> Option<u64> {
        s.strip_prefix("hearth-seq ")?
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    };
    let before = text[..freeze]
        .rmatch_indices("hearth-seq ")
        .find_map(|(i, _)| seq_at(&text[i..]))
        .expect("the guest wrote before the freeze");
    let after = text[thaw..]
        .match_indices("hearth-seq ")
        .find_map(|(i, _)| seq_at(&text[thaw + i..]))
        .expect("the guest wrote after the thaw");
    (before, after)
}

/// The last line number the guest printed (and so had synced).
fn last_console_seq(d: &Daemon) -> u64 {
    let text = std::fs::read_to_string(serial_log(d, "late")).expect("serial log");
    text.match_indices("hearth-seq ")
        .filter_map(|(i, _)| {
            text[i + "hearth-seq ".len()..]
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<u64>()
                .ok()
        })
        .max()
        .expect("the guest wrote")
}

/// `/seq` of a raw ext4 image, after replaying its journal on a copy (what
/// a guest booting from it would read). Checks it is 1, 2, 3, ... and
/// returns its last number.
fn replayed_seq(raw: &Path, what: &str) -> u64 {
    let copy = raw.with_extension("replayed");
    std::fs::copy(raw, &copy).expect("copy");
    let st = Command::new("e2fsck")
        .arg("-fy")
        .arg(&copy)
        .output()
        .expect("e2fsck (apt install e2fsprogs)");
    assert!(
        st.status.code().is_some_and(|c| c <= 1),
        "{what}: e2fsck -fy: {}",
        String::from_utf8_lossy(&st.stdout)
    );
    let last = gapless_seq(&debugfs_cat(&copy, "/seq"), what);
    let _ = std::fs::remove_file(&copy);
    last
}

/// Checks `text` is the lines 1, 2, 3, ... and returns the last number.
fn gapless_seq(text: &str, what: &str) -> u64 {
    let mut last = 0;
    for l in text.lines() {
        assert_eq!(
            l,
            (last + 1).to_string(),
            "{what}: /seq is not a gapless prefix of what the guest wrote after line {last}"
        );
        last += 1;
    }
    last
}

/// Requests `name`, with the proxy holding its transaction for `hold`;
/// returns the snapshot once final, the console's view of its cut and the
/// time QEMU held the transaction back.
fn late_cut(
    d: &Daemon,
    proxy: &QmpProxy,
    name: &str,
    required: bool,
    hold: Duration,
) -> (Value, (u64, u64), Duration) {
    let (freezes, _) = hook_counts(d, "late");
    let held_before = proxy.held().len();
    proxy.hold_next_transaction(hold);
    let (status, v) = d.request(
        "POST",
        "/v1/apply",
        Some(&json!({"items": [DiskSnapshot::of(name, "late-data")
            .required_consistency(required)
            .json()]})),
    );
    assert_eq!(status, 200, "{v}");
    let s = snapshot_final(d, name, SNAP_TIMEOUT);
    let held = proxy.held();
    assert_eq!(
        held.len(),
        held_before + 1,
        "{name}: the proxy did not hold a transaction: {s:#}\n{}",
        d.log()
    );
    let (at, released) = held[held.len() - 1];
    let late = released - at;
    assert!(
        late > TRANSACTION_BUDGET,
        "{name}: QEMU got the transaction {late:?} after hearthd sent it"
    );
    wait_until(
        &format!("{name}: the guest's hook thawed"),
        Duration::from_secs(30),
        || {
            let (f, t) = hook_counts(d, "late");
            f == freezes + 1 && t == f
        },
    );
    // A few lines after the thaw, so the console shows where it was.
    let (_, thaws) = hook_counts(d, "late");
    wait_until(
        &format!("{name}: the guest writes after the thaw"),
        Duration::from_secs(30),
        || {
            std::fs::read_to_string(serial_log(d, "late"))
                .ok()
                .and_then(|t| {
                    let at = t.match_indices("fsfreeze hook: thaw").nth(thaws - 1)?.0;
                    Some(t[at..].matches("hearth-seq ").count() >= 2)
                })
                .unwrap_or(false)
        },
    );
    (s, console_around_cut(d, freezes + 1), late)
}

fn events_of(d: &Daemon, reason: &str) -> Vec<String> {
    d.events("VirtualMachine", "late")
        .into_iter()
        .filter(|e| e["reason"] == reason)
        .map(|e| e["message"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[test]
fn a_transaction_qemu_runs_late_is_consistent_only_when_seen_before_the_thaw() {
    let _serial = serial();
    let mut d = Daemon::start();
    let scratch = d.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).expect("scratch");
    apply_manifest(
        &d,
        "late.yaml",
        &format!("{}---\n{}", overlay_disk_yaml("late-data"), vm_manifest(10)),
    );
    d.wait_agent("late");
    let pids = d.qemu_pids_of("late");
    assert_eq!(pids.len(), 1, "{pids:?}");
    let qemu = pids[0];

    // The proxy goes between a restarted hearthd and the running QEMU.
    d.kill();
    let sock = d.run_dir().join("vms/late/qmp.sock");
    let real = d.run_dir().join("vms/late/qmp.sock.qemu");
    std::fs::rename(&sock, &real).expect("rename QEMU's QMP socket");
    let proxy = QmpProxy::start(&sock, real);
    d.spawn();
    d.wait_agent("late");
    wait_until(
        "hearthd talks to QEMU through the proxy",
        Duration::from_secs(30),
        || proxy.connections.load(Ordering::SeqCst) >= 1,
    );
    assert_eq!(d.qemu_pids_of("late"), vec![qemu], "the same QEMU, adopted");

    // The guest writes all the time: each line synced, then its number on
    // the console.
    let (status, v) = d.request(
        "POST",
        "/v1/virtualmachines/late/agent/exec",
        Some(&json!({"path": "/bin/sh", "args": ["-c",
            "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i >> /data/seq; sync /data/seq; echo \"hearth-seq $i\" > /dev/console; usleep 20000; done' </dev/null >/dev/null 2>&1 &"]})),
    );
    assert_eq!(status, 200, "{v}");
    wait_until("the guest writes", Duration::from_secs(30), || {
        std::fs::read_to_string(serial_log(&d, "late"))
            .is_ok_and(|t| t.matches("hearth-seq ").count() >= 20)
    });

    // 1. QEMU runs the transaction 4.5 s late, well inside the 10 s
    // deadline: hearthd can keep the guest frozen until QEMU's block graph
    // shows the switch. 2. QEMU runs it after the 4 s deadline: the guest
    // is thawed by then, and the switch comes after the thaw.
    let mut cuts = Vec::new();
    for (name, required, deadline_s, hold_ms) in [
        ("inside", true, 10, 4500),
        ("after-required", true, 4, 5500),
        ("after-loose", false, 4, 5500),
    ] {
        apply_manifest(&d, "late.yaml", &vm_manifest(deadline_s));
        let (s, console, late) =
            late_cut(&d, &proxy, name, required, Duration::from_millis(hold_ms));
        println!(
            "{name}: transaction {late:?} late, console (synced before the freeze, first after the thaw) {console:?}, phase {}, consistent {}, window {} ms",
            s["status"]["phase"], s["status"]["consistent"], s["status"]["freezeWindowMs"]
        );
        cuts.push((name, s, console));
    }

    // The VM goes; every layer is final.
    d.cli_ok(&["stop", "late"]);
    d.wait_phase("late", "Stopped", Duration::from_secs(60));
    wait_until("QEMU gone", Duration::from_secs(30), || !is_alive(qemu));
    let last_written = last_console_seq(&d);

    // Whatever hearthd calls consistent is: a clean filesystem holding
    // every line synced before the freeze and none written after the thaw.
    for (name, s, (before, after)) in &cuts {
        if s["status"]["phase"] != "Ready" || s["status"]["consistent"] != true {
            continue;
        }
        let raw = restored_raw(&d, name, &scratch);
        assert_clean_ext4(&raw, name);
        let last = gapless_seq(&debugfs_cat(&raw, "/seq"), name);
        println!("{name}: clean, its /seq ends at line {last}");
        assert!(
            last >= *before && last <= *after,
            "{name}: the snapshot ends at line {last}; the guest had synced {before} before the freeze and printed {after} first after the thaw"
        );
    }

    // A switch seen while the guest was still frozen is consistent.
    let (_, inside, _) = &cuts[0];
    assert_eq!(
        inside["status"]["phase"],
        "Ready",
        "{inside:#}\n{}",
        d.log()
    );
    assert_eq!(inside["status"]["consistent"], true, "{inside:#}");
    let window = inside["status"]["freezeWindowMs"].as_u64().expect("window");
    assert!(
        window >= 4000,
        "inside: the guest stays frozen until the switch is seen: window {window} ms"
    );
    let observed = events_of(&d, "TransactionObserved");
    assert!(
        observed
            .iter()
            .any(|m| m.contains("while the guest is still frozen, says it ran")),
        "{observed:?}"
    );

    // One that was not seen by the deadline is not: Failed, with a reason
    // a person can act on, or Ready and not consistent.
    let (_, required, _) = &cuts[1];
    assert_eq!(required["status"]["phase"], "Failed", "{required:#}");
    let why = required["status"]["message"].as_str().unwrap_or_default();
    assert!(
        why.contains("after the guest was thawed") && why.contains("spec.freezeDeadlineSeconds"),
        "{required:#}"
    );
    let (name, loose, (_, after)) = &cuts[2];
    assert_eq!(loose["status"]["phase"], "Ready", "{loose:#}");
    assert_eq!(loose["status"]["consistent"], false, "{loose:#}");
    assert_eq!(loose["status"]["reason"], "NotConsistent", "{loose:#}");
    // And it really holds writes made after the thaw: the switch came
    // after it.
    let raw = restored_raw(&d, name, &scratch);
    let last = replayed_seq(&raw, name);
    println!("{name}: its /seq, journal replayed, ends at line {last}");
    assert!(
        last > *after,
        "{name}: the snapshot ends at line {last}, not after line {after} (the first after the thaw): the switch did not come after the thaw"
    );

    // Both late switches were settled: the disk holds every line the guest
    // synced.
    let live = d.get_disk("late-data").expect("disk")["status"]["path"]
        .as_str()
        .expect("path")
        .to_string();
    let live_raw = scratch.join("live.raw");
    let st = Command::new("qemu-img")
        .args(["convert", "-U", "-O", "raw", &live])
        .arg(&live_raw)
        .status()
        .expect("qemu-img (apt install qemu-utils)");
    assert!(st.success(), "qemu-img convert {live}");
    let last = replayed_seq(&live_raw, "the live disk");
    println!("the live disk's /seq ends at line {last}; the guest printed {last_written} last");
    assert!(
        last >= last_written,
        "the live disk ends at line {last}; the guest synced up to {last_written}"
    );
}
