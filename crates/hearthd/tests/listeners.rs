//! No client of hearthd's listeners can exhaust it: the loopback port
//! forwards, the metrics listener and the API socket hold a bounded number
//! of connections, close idle and half-sent ones after their timeouts, and
//! hearthd keeps serving its API and opening files while they are flooded.
//! Ground truth: hearthd's `/proc/PID/fd`, the far ends of the connections
//! (EOF seen by the client, accepts seen by the guest's side), and files
//! made on disk.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

const WAIT: Duration = Duration::from_secs(30);

/// hearthd's open descriptors, read from the process table.
fn open_fds(d: &Daemon) -> usize {
    let pid = d.child.as_ref().expect("running").id();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("/proc/PID/fd")
        .count()
}

/// `hearth get vm` answers, and within a second.
fn assert_api_answers_at_once(d: &Daemon, during: &str) {
    let started = Instant::now();
    d.cli_ok(&["get", "vm"]);
    let took = started.elapsed();
    eprintln!("`hearth get vm` answered in {took:?} during {during}");
    assert!(
        took < Duration::from_secs(1),
        "`hearth get vm` took {took:?} during {during}"
    );
}

/// Whether the peer has closed `stream` within `within`: a read returns
/// EOF or a reset. Data is read and dropped.
fn closed_within(stream: &mut impl Read, set_timeout: impl Fn(Duration), within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        set_timeout(left.max(Duration::from_millis(1)));
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false;
            }
            Err(_) => return true,
        }
    }
}

fn tcp_closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let t = s.try_clone().expect("clone");
    closed_within(s, |d| t.set_read_timeout(Some(d)).expect("timeout"), within)
}

fn unix_closed_within(s: &mut UnixStream, within: Duration) -> bool {
    let t = s.try_clone().expect("clone");
    closed_within(s, |d| t.set_read_timeout(Some(d)).expect("timeout"), within)
}

/// A blank disk made while the flood runs: hearthd still opens files
/// (the store, qemu-img's output, the layer).
fn make_a_disk(d: &Daemon, name: &str) {
    let (status, v) = d.apply_json(vec![Disk::blank(name, "16Mi").json()]);
    assert_eq!(status, 200, "{v}");
    let disk = d.wait_object("virtualdisks", name, "Ready", WAIT, |v| {
        v["status"]["phase"] == "Ready"
    });
    let path = disk["status"]["path"].as_str().expect("path");
    let out = std::process::Command::new("qemu-img")
        .args(["info", "-U", "--output=json", path])
        .output()
        .expect("qemu-img");
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).expect("qemu-img json");
    assert_eq!(info["virtual-size"], 16 << 20, "{info}");
}

/// The guest's side of a port forward, played by a listener on the guest's
/// address inside the namespace: it accepts, counts what is open, keeps
/// every byte it is sent and never answers.
struct SilentGuest {
    open: Arc<AtomicUsize>,
    most_open: Arc<AtomicUsize>,
    received: Arc<Mutex<Vec<u8>>>,
}

impl SilentGuest {
    fn start(listener: TcpListener) -> SilentGuest {
        let guest = SilentGuest {
            open: Arc::default(),
            most_open: Arc::default(),
            received: Arc::default(),
        };
        let (open, most_open, received) = (
            guest.open.clone(),
            guest.most_open.clone(),
            guest.received.clone(),
        );
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let now = open.fetch_add(1, Ordering::SeqCst) + 1;
                most_open.fetch_max(now, Ordering::SeqCst);
                let (open, received) = (open.clone(), received.clone());
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = conn.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        received
                            .lock()
                            .expect("received")
                            .extend_from_slice(&buf[..n]);
                    }
                    open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        guest
    }
}

#[test]
fn a_flood_of_port_forward_connections_is_bounded_and_hearthd_keeps_serving() {
    let _serial = serial();
    let images = tempfile::tempdir().expect("tempdir");
    let kernel = images.path().join("vmlinuz");
    std::fs::write(&kernel, b"never booted").expect("kernel");

    // hearthd starts with the usual soft limit of 1024 descriptors, under a
    // higher hard one: it must raise it itself.
    let ours = getrlimit(Resource::Nofile);
    let hard = ours.maximum.expect("a finite hard limit");
    assert!(
        hard >= 4096,
        "the hard open-file limit ({hard}) is too low for this test"
    );
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(1024),
            maximum: Some(hard),
        },
    )
    .expect("lower the soft limit");
    let d = Daemon::start_in_netns(
        &[images.path()],
        &[
            "--accel",
            "tcg",
            "--forward-max-connections",
            "100",
            "--forward-max-connections-total",
            "150",
            "--forward-idle-timeout-seconds",
            "10",
            "--forward-connect-timeout-seconds",
            "2",
        ],
    );
    setrlimit(Resource::Nofile, ours).expect("restore the soft limit");
    let pid = d.child.as_ref().expect("running").id();
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let open_files: Vec<&str> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files")
        .split_whitespace()
        .collect();
    assert_eq!(open_files[3], hard.to_string(), "{limits}");
    assert_eq!(open_files[4], hard.to_string(), "{limits}");
    assert!(
        d.log().contains("RLIMIT_NOFILE") && d.log().contains(&format!("from 1024 to {hard}")),
        "{}",
        d.log()
    );

    // Three forwards of one stopped VM: two to a guest port that accepts
    // and stays silent, one to a port whose SYNs are dropped.
    let guest_ip = Ipv4Addr::new(10, 78, 0, 10);
    let m = manifest(
        &d,
        "lan.yaml",
        &format!(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {{name: lan}}\nspec: {{subnet: 10.78.0.0/24}}\n---\napiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: web}}\nspec:\n  runPolicy: AlwaysOff\n  boot: {{kernel: {}}}\n  networks: [{{virtualNetworkName: lan, ipAddress: {guest_ip}, ports: [{{hostPort: 2222, guestPort: 22}}, {{hostPort: 2224, guestPort: 22}}, {{hostPort: 2223, guestPort: 23}}]}}]\n",
            kernel.display()
        ),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_object("virtualnetworks", "lan", "Ready", WAIT, |v| {
        v["status"]["phase"] == "Ready"
    });
    let ns = d.netns.as_ref().expect("netns");
    ns.exec_ok(
        "ip",
        &["addr", "add", &format!("{guest_ip}/32"), "dev", "lo"],
    );
    let guest = SilentGuest::start(
        ns.run(move || TcpListener::bind((guest_ip, 22)))
            .expect("bind the guest's port"),
    );
    ns.exec_ok("nft", &["add", "table", "ip", "blackhole"]);
    ns.exec_ok(
        "nft",
        &["add chain ip blackhole out { type filter hook output priority 0 ; }"],
    );
    ns.exec_ok(
        "nft",
        &[&format!(
            "add rule ip blackhole out ip daddr {guest_ip} tcp dport 23 drop"
        )],
    );
    let forward = |port: u16| SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
    wait_until("the forwards listen", WAIT, || {
        ns.run(move || {
            [2222, 2223, 2224]
                .iter()
                .all(|p| TcpStream::connect(forward(*p)).is_ok())
        })
    });
    wait_until("the probes are gone", WAIT, || {
        guest.open.load(Ordering::SeqCst) == 0
    });
    let before = open_fds(&d);

    // The flood: more connections than the bounds, and more than the soft
    // limit hearthd was started with.
    let flood = 1500;
    let mut held: Vec<TcpStream> = ns.run(move || {
        (0..flood)
            .filter_map(|i| {
                let port = if i % 2 == 0 { 2222 } else { 2224 };
                TcpStream::connect_timeout(&forward(port), Duration::from_secs(5)).ok()
            })
            .collect()
    });
    let flood_done = Instant::now();
    assert!(
        held.len() > 1100,
        "only {} connections were made",
        held.len()
    );
    let during = open_fds(&d);
    eprintln!("hearthd's descriptors: {before} before the flood, {during} during it");
    assert!(
        during <= before + 2 * 150 + 40,
        "hearthd holds {during} descriptors (from {before}) during the flood"
    );
    let most = guest.most_open.load(Ordering::SeqCst);
    assert!(most <= 150, "the guest saw {most} connections at once");
    assert!(most >= 100, "the guest saw only {most} connections");
    assert_api_answers_at_once(&d, "the flood");
    make_a_disk(&d, "during-the-flood");
    assert!(
        guest.open.load(Ordering::SeqCst) >= 100,
        "the flood was over before the disk was made"
    );

    // Those beyond the bounds were closed at once; the others are held
    // (the idle timeout is not over yet).
    let mut refused = 0;
    for s in &mut held {
        if tcp_closed_within(s, Duration::from_millis(5)) {
            refused += 1;
        }
    }
    eprintln!(
        "{} connections: {refused} closed at once, {} held; the API and a disk made {:?} into the flood",
        held.len(),
        held.len() - refused,
        flood_done.elapsed()
    );
    assert!(
        (held.len() - 150..=held.len() - 100).contains(&refused),
        "{refused} of {} connections closed at once",
        held.len()
    );
    // The silent ones are closed once idle for the timeout.
    let deadline = flood_done + Duration::from_secs(10 + 15);
    for s in &mut held {
        assert!(
            tcp_closed_within(s, deadline.saturating_duration_since(Instant::now())),
            "a connection is still open {:?} after the flood",
            flood_done.elapsed()
        );
    }
    wait_until("the guest's side is closed too", WAIT, || {
        guest.open.load(Ordering::SeqCst) == 0
    });
    let after = open_fds(&d);
    assert!(
        after <= before + 5,
        "hearthd holds {after} descriptors (from {before}) after"
    );

    // A guest that never answers the SYN (tried once the flood is over:
    // until then the total bound closes it at once): given up after the
    // connect timeout, the client closed.
    let mut blackholed = ns
        .run(move || TcpStream::connect(forward(2223)))
        .expect("connect 2223");
    let t = Instant::now();
    assert!(
        tcp_closed_within(&mut blackholed, Duration::from_secs(10)),
        "the unanswered forward is still open after 10 s"
    );
    assert!(
        t.elapsed() >= Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );

    // And the forward carries bytes again.
    let mut fresh = ns
        .run(move || TcpStream::connect(forward(2222)))
        .expect("connect");
    fresh.write_all(b"still forwarding").expect("write");
    wait_until("the guest got the bytes", WAIT, || {
        let got = guest.received.lock().expect("received");
        got.windows(16).any(|w| w == b"still forwarding")
    });
    assert_api_answers_at_once(&d, "the end");
    assert!(d.get_disk("during-the-flood").is_some());
}

/// `GET /metrics` over TCP; the status.
fn scrape(addr: SocketAddr) -> u16 {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).expect("read");
    String::from_utf8_lossy(&buf)
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// The start of a request, without the empty line that ends its headers.
const HALF_A_REQUEST: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: hearthd\r\nX-Slow: 1\r\n";

#[test]
fn slow_and_idle_http_clients_are_bounded_and_closed_after_the_timeout() {
    let _serial = serial();
    let images = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start_without_guest(
        &[images.path()],
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--http-header-timeout-seconds",
            "3",
            "--metrics-max-connections",
            "16",
            "--api-max-connections",
            "32",
        ],
    );
    let addr = d.metrics_addr(WAIT);
    assert_eq!(scrape(addr), 200);
    let before = open_fds(&d);

    // Keep-alive connections that asked once and went quiet: closed after
    // the timeout, and not long before.
    let mut idle_tcp = TcpStream::connect(addr).expect("connect");
    idle_tcp
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    write!(idle_tcp, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n").expect("write");
    let mut idle_unix = UnixStream::connect(d.socket()).expect("connect");
    idle_unix
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    idle_unix
        .write_all(b"GET /v1/health HTTP/1.1\r\nHost: hearthd\r\n\r\n")
        .expect("write");
    for (what, first) in [
        ("metrics", read_some(&mut idle_tcp)),
        ("API", read_some(&mut idle_unix)),
    ] {
        assert!(first.starts_with("HTTP/1.1 200"), "{what}: {first}");
    }
    let idle_since = Instant::now();
    assert!(tcp_closed_within(&mut idle_tcp, Duration::from_secs(10)));
    assert!(unix_closed_within(&mut idle_unix, Duration::from_secs(10)));
    let idle_for = idle_since.elapsed();
    assert!(
        idle_for >= Duration::from_millis(2500),
        "an idle connection was closed after {idle_for:?}"
    );

    // Slowloris: many connections that never finish their headers.
    let started = Instant::now();
    let mut slow_tcp: Vec<TcpStream> = (0..300)
        .map(|_| {
            let mut s = TcpStream::connect(addr).expect("connect");
            s.write_all(HALF_A_REQUEST).expect("write");
            s
        })
        .collect();
    let mut slow_unix: Vec<UnixStream> = (0..300)
        .map(|_| {
            let mut s = UnixStream::connect(d.socket()).expect("connect");
            s.write_all(HALF_A_REQUEST).expect("write");
            s
        })
        .collect();
    // hearthd answers on both while they hang, and holds no more than the
    // limits allow.
    assert_api_answers_at_once(&d, "the slow clients");
    let t = Instant::now();
    assert_eq!(scrape(addr), 200);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "/metrics took {:?}",
        t.elapsed()
    );
    let during = open_fds(&d);
    eprintln!("hearthd's descriptors: {before} before the slow clients, {during} with 600 of them");
    assert!(
        during <= before + 16 + 32 + 10,
        "hearthd holds {during} descriptors (from {before}) with 600 slow clients"
    );

    // Every one of them is closed: the ones beyond the limits to make room,
    // the rest after the header timeout.
    for s in &mut slow_tcp {
        let left = Duration::from_secs(10).saturating_sub(started.elapsed());
        assert!(
            tcp_closed_within(s, left),
            "a slow metrics client is open {:?} on",
            started.elapsed()
        );
    }
    for s in &mut slow_unix {
        let left = Duration::from_secs(10).saturating_sub(started.elapsed());
        assert!(
            unix_closed_within(s, left),
            "a slow API client is open {:?} on",
            started.elapsed()
        );
    }
    let after = open_fds(&d);
    assert!(
        after <= before + 3,
        "hearthd holds {after} descriptors (from {before}) after"
    );
    assert_eq!(scrape(addr), 200);
    assert_api_answers_at_once(&d, "the end");
}

/// What arrives first on a connection (one read, up to 5 s).
fn read_some(s: &mut impl Read) -> String {
    let mut buf = vec![0u8; 64 << 10];
    let n = s.read(&mut buf).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n]).into_owned()
}
