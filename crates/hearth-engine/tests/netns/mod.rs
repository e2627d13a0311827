//! Running a test inside a network namespace it creates: the test binary
//! re-runs itself (`--exact` on the test's name) under `ip netns exec NS`
//! with `HEARTH_TEST_NETNS=NS` set, so the whole process (every tokio
//! worker, every child: dnsmasq, nft, QEMU) lives in the namespace. The
//! parent holds a guard that kills every process left in the namespace and
//! deletes it, also when the test fails.

#![allow(dead_code)]

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

const INNER_ENV: &str = "HEARTH_TEST_NETNS";
const GUESTS_ENV: &str = "HEARTH_TEST_NETNS_GUESTS";
const CHILD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(180);
pub const INSTALL: &str = "apt-get install dnsmasq-base nftables iproute2";

pub fn require_tools() {
    for (tool, path) in [
        ("ip", "/usr/sbin/ip"),
        ("nft", "/usr/sbin/nft"),
        ("dnsmasq", "/usr/sbin/dnsmasq"),
    ] {
        let found = Path::new(path).exists()
            || Command::new(tool)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success());
        assert!(found, "{tool} is missing: {INSTALL}");
    }
    assert!(
        rustix::process::geteuid().is_root(),
        "the host network tests create network namespaces and must run as root"
    );
}

/// A namespace the test owns; dropped: its processes are killed and it is
/// deleted.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn create() -> Netns {
        require_tools();
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("hth-test-{}-{seq}-{:x}", std::process::id(), nanos());
        run("ip", &["netns", "add", &name]);
        Netns { name }
    }
}

fn nanos() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() & 0xffff)
        .unwrap_or(0)
}

impl Drop for Netns {
    fn drop(&mut self) {
        // dnsmasq daemonises: a leftover one would keep the namespace alive.
        if let Ok(out) = Command::new("ip")
            .args(["netns", "pids", &self.name])
            .output()
        {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-KILL", pid]).status();
            }
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd} {args:?}: {e} ({INSTALL})"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// In the parent: creates a namespace and runs `test` inside it; returns
/// `None`. In the child: checks it is in that namespace; returns `Some(())`
/// so the caller runs the body.
pub fn inside_netns(test: &str) -> Option<()> {
    inside_netns_with_guests(test, 0).map(|_| ())
}

/// Like [`inside_netns`], and the parent also creates `guests` more
/// namespaces (to stand in for VMs: a server behind a port forward); the
/// child gets their names.
pub fn inside_netns_with_guests(test: &str, guests: usize) -> Option<Vec<String>> {
    match std::env::var(INNER_ENV) {
        Ok(ns) => {
            let mine = std::fs::metadata("/proc/self/ns/net").expect("/proc/self/ns/net");
            let theirs = std::fs::metadata(format!("/run/netns/{ns}")).expect("/run/netns/NS");
            assert_eq!(
                (mine.dev(), mine.ino()),
                (theirs.dev(), theirs.ino()),
                "refusing to run: not inside network namespace {ns}"
            );
            let guests = std::env::var(GUESTS_ENV).unwrap_or_default();
            Some(
                guests
                    .split(',')
                    .filter(|g| !g.is_empty())
                    .map(str::to_string)
                    .collect(),
            )
        }
        Err(_) => {
            let ns = Netns::create();
            let guest_ns: Vec<Netns> = (0..guests).map(|_| Netns::create()).collect();
            let guest_names: Vec<&str> = guest_ns.iter().map(|g| g.name.as_str()).collect();
            let exe = std::env::current_exe().expect("current_exe");
            // The child's output is captured and shown only on failure: its
            // own "test result:" line would otherwise be counted twice by
            // scripts/test's total.
            let child = Command::new("ip")
                .args(["netns", "exec", &ns.name])
                .arg(exe)
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(INNER_ENV, &ns.name)
                .env(GUESTS_ENV, guest_names.join(","))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("ip netns exec");
            // Bounded: a child that hangs is killed (`ip netns exec` execs
            // the test binary, so the pid is the test's) and the test fails.
            let pid = child.id();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = tx.send(child.wait_with_output());
            });
            let out = match rx.recv_timeout(CHILD_TIMEOUT) {
                Ok(out) => out.expect("waiting for the namespaced test"),
                Err(_) => {
                    let _ = Command::new("kill")
                        .args(["-KILL", &pid.to_string()])
                        .status();
                    panic!("{test} inside {} took more than {CHILD_TIMEOUT:?}", ns.name);
                }
            };
            assert!(
                out.status.success(),
                "{test} inside {} failed: {}\n--- stdout\n{}\n--- stderr\n{}",
                ns.name,
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                stdout.contains("test result: ok. 1 passed"),
                "{test} did not run inside {}: {stdout}",
                ns.name
            );
            None
        }
    }
}

/// `ADDR/LEN` of every IPv4 address on link `name`, from `ip -j addr`.
pub fn ipv4_of(name: &str) -> Vec<String> {
    let v: serde_json::Value =
        serde_json::from_str(&run("ip", &["-j", "addr", "show", "dev", name])).expect("ip -j");
    v[0]["addr_info"]
        .as_array()
        .expect("addr_info")
        .iter()
        .filter(|a| a["family"] == "inet")
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap_or(""), a["prefixlen"]))
        .collect()
}
