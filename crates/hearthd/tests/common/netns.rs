//! A network namespace a test owns. hearthd runs inside it (`ip netns exec`),
//! so every bridge, tap, dnsmasq, nftables rule and VM it makes lives there;
//! the test talks to hearthd over its API socket (a file, reachable from any
//! namespace) and sends packets only inside the namespace, through
//! [`Netns::exec`]. Dropped (also when the test fails): every process left
//! in it is killed and it is deleted, which takes its links and rules along.

use std::path::Path;
use std::process::{Command, Output};

const INSTALL: &str = "apt-get install iproute2 nftables dnsmasq-base";

pub struct Netns {
    pub name: String,
}

impl Netns {
    /// A namespace named `hth-e2e-PID-N`.
    pub fn create() -> Netns {
        Self::create_prefixed("hth-e2e")
    }

    /// A namespace named `PREFIX-PID-N` (benchmarks use `hth-bench`, so
    /// that what they leave, if anything, is told apart from the tests').
    pub fn create_prefixed(prefix: &str) -> Netns {
        assert!(
            rustix::process::geteuid().is_root(),
            "network tests create network namespaces and must run as root"
        );
        for tool in ["/usr/sbin/ip", "/usr/sbin/nft", "/usr/sbin/dnsmasq"] {
            assert!(Path::new(tool).exists(), "{tool} is missing: {INSTALL}");
        }
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{prefix}-{}-{seq}", std::process::id());
        let out = Command::new("ip")
            .args(["netns", "add", &name])
            .output()
            .unwrap_or_else(|e| panic!("ip netns add: {e} ({INSTALL})"));
        assert!(
            out.status.success(),
            "ip netns add {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let ns = Netns { name };
        // Loopback up, so that a forwarded port can be tried from inside.
        ns.exec_ok("ip", &["link", "set", "lo", "up"]);
        ns
    }

    /// Runs `cmd args` inside the namespace.
    pub fn exec(&self, cmd: &str, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name, cmd])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("ip netns exec {} {cmd}: {e}", self.name))
    }

    /// [`Netns::exec`], and fails the test unless it succeeded; its stdout.
    pub fn exec_ok(&self, cmd: &str, args: &[&str]) -> String {
        let out = self.exec(cmd, args);
        assert!(
            out.status.success(),
            "{cmd} {args:?} in {}: {}\n{}",
            self.name,
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs `f` on a thread of this process that has entered the namespace,
    /// and returns what it returns: the sockets `f` makes live in the
    /// namespace, and work from any thread afterwards.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            rustix::thread::move_into_link_name_space(
                std::os::fd::AsFd::as_fd(&ns),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )
            .unwrap_or_else(|e| panic!("setns {path}: {e}"));
            f()
        })
        .join()
        .expect("the thread in the namespace panicked")
    }

    /// Listens on 127.0.0.1:`port` inside the namespace and relays each
    /// connection to 127.0.0.1:`port` of the host's namespace, where the
    /// test runs a server (a registry): hearthd inside reaches it by the
    /// same address, and no packet leaves loopback.
    pub fn relay_loopback(&self, port: u16) {
        let listener = self.run(move || {
            std::net::TcpListener::bind(("127.0.0.1", port)).expect("listen in the namespace")
        });
        // Threads made from here are in the host's namespace: their
        // connects reach the host's loopback.
        std::thread::spawn(move || {
            for inside in listener.incoming() {
                let Ok(inside) = inside else { return };
                std::thread::spawn(move || {
                    let Ok(host) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
                        return;
                    };
                    let pipe = |mut from: std::net::TcpStream, mut to: std::net::TcpStream| {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    };
                    let (a, b) = (
                        inside.try_clone().expect("clone"),
                        host.try_clone().expect("clone"),
                    );
                    let back = std::thread::spawn(move || pipe(b, a));
                    pipe(inside, host);
                    let _ = back.join();
                });
            }
        });
    }

    /// Names of the links whose name starts with hearth's prefixes.
    pub fn hearth_links(&self) -> Vec<String> {
        let v: serde_json::Value =
            serde_json::from_str(&self.exec_ok("ip", &["-j", "link", "show"])).expect("ip -j");
        let mut names: Vec<String> = v
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l["ifname"].as_str())
            .filter(|n| n.starts_with("hth") || n.starts_with("htt"))
            .map(str::to_string)
            .collect();
        names.sort();
        names
    }

    /// The pids of processes inside the namespace.
    pub fn pids(&self) -> Vec<u32> {
        let out = Command::new("ip")
            .args(["netns", "pids", &self.name])
            .output()
            .expect("ip netns pids");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // dnsmasq daemonises and QEMU may outlive hearthd: anything left
        // would keep the namespace's devices alive.
        for pid in self.pids() {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}
