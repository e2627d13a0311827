//! The change stream end to end: the real hearthd, its real store, the
//! real `hearth` CLI. No guest boots: blank disks and `AlwaysOff` VMs.
//!
//! Streams are read line by line from the socket with a bounded wait for
//! each line (the lines themselves are the signal; nothing sleeps).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use common::follow::Cli;
use common::*;
use serde_json::Value;

/// How long one expected line may take: a disk is a `qemu-img create`.
const LINE: Duration = Duration::from_secs(30);

/// One open `GET` of a stream, read a line at a time (chunked framing).
struct Stream {
    reader: BufReader<UnixStream>,
    /// Decoded body bytes not yet returned as a line.
    pending: Vec<u8>,
    path: String,
}

impl Stream {
    fn open(d: &Daemon, path: &str) -> Stream {
        let mut sock = UnixStream::connect(d.socket()).expect("connect to hearthd");
        write!(
            sock,
            "GET {path} HTTP/1.1\r\nHost: hearthd\r\nConnection: close\r\n\r\n"
        )
        .expect("send");
        let mut reader = BufReader::new(sock);
        let mut head = String::new();
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).expect("response head");
            if line == "\r\n" || line.is_empty() {
                break;
            }
            head.push_str(&line);
        }
        assert!(head.starts_with("HTTP/1.1 200"), "GET {path}: {head}");
        let lower = head.to_ascii_lowercase();
        assert!(
            lower.contains("content-type: application/x-ndjson"),
            "{head}"
        );
        assert!(lower.contains("transfer-encoding: chunked"), "{head}");
        Stream {
            reader,
            pending: Vec::new(),
            path: path.to_string(),
        }
    }

    /// The next line, or None when the server closed the stream.
    fn next(&mut self, within: Duration) -> Option<Value> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(end) = self.pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=end).collect();
                let v: Value = serde_json::from_slice(&line)
                    .unwrap_or_else(|e| panic!("{}: not a JSON line ({e}): {line:?}", self.path));
                return Some(v);
            }
            let left = deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
                .unwrap_or_else(|| panic!("{}: no line within {within:?}", self.path));
            self.reader
                .get_ref()
                .set_read_timeout(Some(left))
                .expect("timeout");
            let mut size = String::new();
            match self.reader.read_line(&mut size) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    panic!("{}: no line within {within:?}", self.path)
                }
                Err(_) => return None,
            }
            let size = usize::from_str_radix(size.trim(), 16)
                .unwrap_or_else(|e| panic!("{}: bad chunk size {size:?}: {e}", self.path));
            if size == 0 {
                return None;
            }
            let mut chunk = vec![0u8; size + 2];
            if self.reader.read_exact(&mut chunk).is_err() {
                return None;
            }
            chunk.truncate(size);
            self.pending.extend_from_slice(&chunk);
        }
    }

    /// Lines up to and including the next bookmark.
    fn until_bookmark(&mut self) -> Vec<Value> {
        let mut lines = Vec::new();
        loop {
            let line = self
                .next(LINE)
                .unwrap_or_else(|| panic!("{}: closed before a bookmark: {lines:#?}", self.path));
            let done = line["type"] == "BOOKMARK";
            lines.push(line);
            if done {
                return lines;
            }
        }
    }

    /// Change lines (heartbeats skipped) until `done` holds on all of them
    /// so far.
    fn until(&mut self, what: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let mut lines = Vec::new();
        loop {
            let line = self
                .next(LINE)
                .unwrap_or_else(|| panic!("{}: closed before {what}: {lines:#?}", self.path));
            if line["type"] == "BOOKMARK" {
                continue;
            }
            lines.push(line);
            if done(&lines) {
                return lines;
            }
        }
    }
}

fn seq(line: &Value) -> u64 {
    line["seq"].as_u64().expect("every line has a seq")
}

fn is(line: &Value, type_: &str, kind: &str, name: &str) -> bool {
    line["type"] == type_ && line["kind"] == kind && line["name"] == name
}

fn phase(line: &Value) -> Option<&str> {
    line["object"]["status"]["phase"].as_str()
}

/// Seqs of change lines only grow, and never repeat.
fn assert_increasing(lines: &[Value]) {
    let seqs: Vec<u64> = lines.iter().map(seq).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "seqs must strictly increase: {seqs:?}"
    );
}

/// Objects only: bookmarks dropped.
fn changes(lines: Vec<Value>) -> Vec<Value> {
    lines
        .into_iter()
        .filter(|l| l["type"] != "BOOKMARK")
        .collect()
}

/// An image root holding stand-ins for a kernel and an initrd: the VMs here
/// are AlwaysOff and never boot, but their boot paths must exist.
fn boot_root() -> tempfile::TempDir {
    let root = tempfile::tempdir().expect("tempdir");
    std::fs::write(root.path().join("vmlinuz"), b"not a kernel").expect("kernel");
    std::fs::write(root.path().join("initrd.img"), b"not an initrd").expect("initrd");
    root
}

fn daemon(root: &Path) -> Daemon {
    Daemon::start_without_guest(&[root], &[])
}

/// VM `box` on disk `data`, never started: it boots nothing, so the fake
/// kernel under `root` will do.
fn box_vm(root: &Path, memory: &str) -> Vm {
    Vm::new("box")
        .always_off()
        .memory(memory)
        .boot(&root.join("vmlinuz"), Some(&root.join("initrd.img")), "")
        .disk("data")
}

/// Whether some line is a `type_` of `kind/name` (with `phase`, if given).
fn saw(lines: &[Value], type_: &str, kind: &str, name: &str, want: Option<&str>) -> bool {
    lines
        .iter()
        .any(|l| is(l, type_, kind, name) && want.is_none_or(|p| phase(l) == Some(p)))
}

#[test]
fn a_watcher_started_before_an_apply_sees_added_then_status_then_deleted_in_order() {
    let _serial = serial();
    let root = boot_root();
    let d = daemon(root.path());
    let mut w = Stream::open(
        &d,
        "/v1/watch?kinds=virtualdisks,virtualmachines&heartbeat=1",
    );
    let initial = w.until_bookmark();
    assert_eq!(initial.len(), 1, "nothing exists yet: {initial:#?}");
    let start = seq(&initial[0]);

    apply_manifest(
        &d,
        "box.yaml",
        &Manifest::new()
            .with(Disk::blank("data", "16Mi"))
            .with(box_vm(root.path(), "256Mi"))
            .yaml(),
    );
    let mut lines = w.until("data Ready and box Stopped", |l| {
        saw(l, "MODIFIED", "VirtualDisk", "data", Some("Ready"))
            && saw(l, "MODIFIED", "VirtualMachine", "box", Some("Stopped"))
    });
    // An idle stream beats: a bookmark at the last change.
    let beat = w.next(Duration::from_secs(5)).expect("a heartbeat");
    assert_eq!(beat["type"], "BOOKMARK", "{beat}");
    assert_eq!(seq(&beat), seq(lines.last().expect("lines")));

    d.cli_ok(&["delete", "vm", "box"]);
    lines.extend(w.until("box deleted", |l| {
        saw(l, "DELETED", "VirtualMachine", "box", None)
    }));
    d.cli_ok(&["delete", "disk", "data"]);
    lines.extend(w.until("data deleted", |l| {
        saw(l, "DELETED", "VirtualDisk", "data", None)
    }));

    assert!(seq(&lines[0]) > start, "{lines:#?}");
    assert_increasing(&lines);
    for (kind, name) in [("VirtualDisk", "data"), ("VirtualMachine", "box")] {
        let mine: Vec<&str> = lines
            .iter()
            .filter(|l| l["kind"] == kind && l["name"] == name)
            .map(|l| l["type"].as_str().unwrap_or("?"))
            .collect();
        assert_eq!(mine.first(), Some(&"ADDED"), "{kind} {name}: {mine:?}");
        assert_eq!(mine.last(), Some(&"DELETED"), "{kind} {name}: {mine:?}");
        assert!(
            mine[1..mine.len() - 1].iter().all(|t| *t == "MODIFIED") && mine.len() >= 3,
            "{kind} {name}: {mine:?}"
        );
    }
    // The deletion carries the object's last state, and the mark that it
    // was being deleted.
    let gone = lines
        .iter()
        .find(|l| is(l, "DELETED", "VirtualDisk", "data"))
        .expect("deleted");
    assert_eq!(gone["object"]["metadata"]["name"], "data");
    assert_eq!(gone["deleting"], true, "{gone}");
}

#[test]
fn a_client_that_reconnects_with_since_misses_nothing_and_gets_nothing_twice() {
    let _serial = serial();
    let root = boot_root();
    let d = daemon(root.path());
    apply_manifest(&d, "a.yaml", &Disk::blank("a", "16Mi").yaml());
    let mut w = Stream::open(&d, "/v1/virtualdisks?watch=true");
    let seen = w.until("a Ready", |l| {
        l.iter()
            .any(|l| l["name"] == "a" && phase(l) == Some("Ready"))
    });
    let last = seq(seen.last().expect("a line"));
    drop(w);

    // While it is away: two disks come, one goes.
    apply_manifest(
        &d,
        "bc.yaml",
        &Manifest::new()
            .with(Disk::blank("b", "16Mi"))
            .with(Disk::blank("c", "16Mi"))
            .yaml(),
    );
    for n in ["b", "c"] {
        d.wait_object("virtualdisks", n, "Ready", LINE, |v| {
            v["status"]["phase"] == "Ready"
        });
    }
    d.cli_ok(&["delete", "disk", "a"]);
    d.wait_gone("virtualdisks", "a", LINE);

    let mut w = Stream::open(&d, &format!("/v1/virtualdisks?watch=true&since={last}"));
    let replay = changes(w.until_bookmark());
    assert!(replay.iter().all(|l| seq(l) > last), "{replay:#?}");
    assert_increasing(&replay);
    for (type_, name, want) in [
        ("ADDED", "b", None),
        ("ADDED", "c", None),
        ("MODIFIED", "b", Some("Ready")),
        ("MODIFIED", "c", Some("Ready")),
        ("DELETED", "a", None),
    ] {
        assert!(
            saw(&replay, type_, "VirtualDisk", name, want),
            "{type_} {name} missing: {replay:#?}"
        );
    }
    // Exactly the log's changes after `last`, no more, no fewer: the whole
    // history from the start, cut at `last`, is the same list.
    let mut all = Stream::open(&d, "/v1/watch?kinds=virtualdisks&since=0");
    let history: Vec<Value> = changes(all.until_bookmark())
        .into_iter()
        .filter(|l| seq(l) > last)
        .collect();
    let seqs = |ls: &[Value]| ls.iter().map(seq).collect::<Vec<_>>();
    assert_eq!(seqs(&replay), seqs(&history));
}

#[test]
fn the_seq_is_durable_across_a_sigkill_and_streams_resume_after_the_restart() {
    let _serial = serial();
    let root = boot_root();
    let mut d = daemon(root.path());
    apply_manifest(&d, "a.yaml", &Disk::blank("a", "16Mi").yaml());
    let mut w = Stream::open(&d, "/v1/virtualdisks?watch=true");
    let seen = w.until("a Ready", |l| {
        l.iter()
            .any(|l| l["name"] == "a" && phase(l) == Some("Ready"))
    });
    let last = seq(seen.last().expect("a line"));
    // The CLI follows too, from before the crash.
    let mut cli = Cli::spawn(&d, &["get", "disks", "-w"]);
    cli.line_with("the table's row for a", |l| {
        l.starts_with("a ") && l.contains("Ready")
    });

    d.kill();
    assert!(
        w.next(Duration::from_secs(10))
            .is_none_or(|l| l["type"] == "BOOKMARK"),
        "the stream of a killed hearthd ends"
    );
    d.spawn();
    apply_manifest(&d, "b.yaml", &Disk::blank("b", "16Mi").yaml());

    let mut w = Stream::open(&d, &format!("/v1/virtualdisks?watch=true&since={last}"));
    let after = w.until("b Ready", |l| {
        l.iter()
            .any(|l| l["name"] == "b" && phase(l) == Some("Ready"))
    });
    assert!(after.iter().all(|l| seq(l) > last), "{after:#?}");
    assert_increasing(&after);
    assert!(saw(&after, "ADDED", "VirtualDisk", "b", None), "{after:#?}");
    assert!(
        !saw(&after, "ADDED", "VirtualDisk", "a", None),
        "a was added before `last`: {after:#?}"
    );

    // The CLI reconnected by itself, said so, and shows b.
    cli.line_with("a row for b", |l| l.starts_with("b "));
    let notes = cli.stop();
    // It went on from where it was: its list's seq (at least `last`; events
    // recorded since take seqs too), not from scratch.
    let from: u64 = notes
        .split("reconnecting from seq ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no reconnect note: {notes}"));
    assert!(from >= last, "{notes}");
    assert!(notes.contains("reconnected to hearthd"), "{notes}");
}

#[test]
fn get_vms_watch_prints_a_new_row_when_a_vm_changes() {
    let _serial = serial();
    let root = boot_root();
    let d = daemon(root.path());
    apply_manifest(
        &d,
        "box.yaml",
        &Manifest::new()
            .with(Disk::blank("data", "16Mi"))
            .with(box_vm(root.path(), "256Mi"))
            .yaml(),
    );
    d.wait_phase("box", "Stopped", LINE);

    let mut cli = Cli::spawn(&d, &["get", "vms", "-w", "--output-watch-events"]);
    let header = cli.line_with("the header", |l| l.starts_with("EVENT"));
    assert!(
        header.contains("NAME") && header.contains("PHASE"),
        "{header}"
    );
    cli.line_with("box's row", |l| l.starts_with("ADDED") && l.contains("box"));

    // A spec change is a new row.
    apply_manifest(&d, "box.yaml", &box_vm(root.path(), "320Mi").yaml());
    let row = cli.line_with("box modified", |l| l.starts_with("MODIFIED"));
    assert!(row.contains("box") && row.contains("Stopped"), "{row}");
    d.cli_ok(&["delete", "vm", "box"]);
    cli.line_with("box deleted", |l| {
        l.starts_with("DELETED") && l.contains("box")
    });
    cli.stop();
}

#[test]
fn events_print_as_json_lines_and_follow_with_watch() {
    let _serial = serial();
    let root = boot_root();
    let d = daemon(root.path());
    apply_manifest(&d, "a.yaml", &Disk::blank("a", "16Mi").yaml());
    d.wait_object("virtualdisks", "a", "Ready", LINE, |v| {
        v["status"]["phase"] == "Ready"
    });

    let out = d.cli_ok(&["events", "-o", "json"]);
    let events: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect();
    assert!(!events.is_empty(), "{out}");
    for e in &events {
        assert!(e["seq"].as_u64().is_some_and(|s| s > 0), "{e}");
        for field in ["time", "kind", "name", "type", "reason", "message"] {
            assert!(e[field].is_string(), "{field} in {e}");
        }
    }
    assert!(
        events
            .iter()
            .any(|e| e["kind"] == "VirtualDisk" && e["name"] == "a"),
        "{out}"
    );
    let table = d.cli_ok(&["events", "--for", "disk/a"]);
    assert!(table.starts_with("AGE"), "{table}");
    assert!(
        table.lines().skip(1).all(|l| l.contains("disk/a")),
        "{table}"
    );

    let mut cli = Cli::spawn(&d, &["events", "-w", "-o", "json", "--for", "disk/b"]);
    apply_manifest(&d, "b.yaml", &Disk::blank("b", "16Mi").yaml());
    let line = cli.line_with("an event about b", |_| true);
    let e: Value = serde_json::from_str(&line).expect("a JSON line");
    assert_eq!(
        (e["kind"].as_str(), e["name"].as_str()),
        (Some("VirtualDisk"), Some("b"))
    );
    assert!(
        e["seq"]
            .as_u64()
            .is_some_and(|s| s > events.iter().map(seq).max().unwrap_or(0))
    );
    cli.stop();
}

#[test]
fn bad_watch_queries_name_the_parameter_and_a_foreign_seq_relists() {
    let _serial = serial();
    let root = boot_root();
    let d = daemon(root.path());
    for (path, needle) in [
        (
            "/v1/watch?kinds=pods",
            "query parameter kinds: unknown kind \"pods\"",
        ),
        ("/v1/watch?name=Bad_Name", "query parameter name"),
        ("/v1/watch?heartbeat=0", "query parameter heartbeat"),
        ("/v1/watch?objects=false", "nothing to watch"),
        ("/v1/watch?since=soon", "bad query"),
        ("/v1/watch?colour=blue", "bad query"),
        ("/v1/virtualdisks?watch=true&since=-1", "bad query"),
    ] {
        let (status, v) = d.request("GET", path, None);
        assert_eq!(status, 400, "{path}: {v}");
        assert!(
            v["error"].as_str().is_some_and(|m| m.contains(needle)),
            "{path}: {v}"
        );
    }
    // A plain list is what it always was.
    let (status, v) = d.request("GET", "/v1/virtualdisks", None);
    assert_eq!((status, v), (200, serde_json::json!({"items": []})));

    apply_manifest(&d, "a.yaml", &Disk::blank("a", "16Mi").yaml());
    // A seq this store never handed out (another database's): a re-list.
    let mut w = Stream::open(&d, "/v1/virtualdisks?watch=true&since=999999");
    let lines = w.until_bookmark();
    assert_eq!(lines[0]["type"], "RELIST", "{lines:#?}");
    assert!(
        lines[0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("ahead of this store")),
        "{lines:#?}"
    );
    assert!(saw(&lines, "ADDED", "VirtualDisk", "a", None), "{lines:#?}");
}
