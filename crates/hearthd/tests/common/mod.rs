//! Test harness for end-to-end tests: a real hearthd with its own state and
//! run directories, the real `hearth` CLI, and the real test guest.
//! Everything it starts is killed when the `Daemon` is dropped, even when the
//! test panics.

#![allow(dead_code)]

pub mod debian;
pub mod debian_oci;
pub mod follow;
pub mod git;
pub mod http;
pub mod kill_wrapper;
pub mod netns;
pub mod qemu_img_log;
pub mod stream;

#[allow(unused_imports)]
pub use hearth_test_support::process::{is_alive, is_zombie, start_ticks};
#[allow(unused_imports)]
pub use hearth_test_support::{
    Disk, DiskSnapshot, Image, Manifest, Network, ObjectBuilder, SnapshotGroup, Vm, VmSnapshot,
    converters_of, eventually, eventually_every,
};

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use serde_json::Value;

/// VM boots are slow under TCG and the machine has 2 cores: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Options that keep ssh from asking anything or touching ~/.ssh.
pub const SSH_OPTS: [&str; 8] = [
    "-o",
    "BatchMode=yes",
    "-o",
    "StrictHostKeyChecking=no",
    "-o",
    "UserKnownHostsFile=/dev/null",
    "-o",
    "ConnectTimeout=10",
];

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("repo root")
        .to_path_buf()
}

/// The test guest's directory; fails loudly when it has not been built.
pub fn guest_dir() -> PathBuf {
    let dir = repo_root().join("guest/out");
    for f in ["vmlinuz", "initrd.img", "data.qcow2"] {
        assert!(
            dir.join(f).is_file(),
            "the test guest is not built ({} missing): run `.ci/install-deps.sh && guest/build.sh`",
            dir.join(f).display()
        );
    }
    dir
}

pub fn hearthd_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hearthd"))
}

pub fn hearth_bin() -> PathBuf {
    let p = hearthd_bin().with_file_name("hearth");
    assert!(
        p.is_file(),
        "the hearth CLI is not built at {}: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub child: Option<Child>,
    pub extra_args: Vec<String>,
    /// `--image-root`s; the test guest's directory when empty.
    pub image_roots: Vec<PathBuf>,
    /// The network namespace hearthd (and so every VM and dnsmasq) runs in.
    /// Dropped after the daemon: whatever is left in it is killed and the
    /// namespace deleted.
    pub netns: Option<netns::Netns>,
}

impl Daemon {
    pub fn start() -> Daemon {
        Self::start_with(&[])
    }

    pub fn start_with(extra_args: &[&str]) -> Daemon {
        Self::start_with_env(extra_args, &[])
    }

    /// Like [`Daemon::start`], with extra environment variables for hearthd.
    pub fn start_env(env: &[(&str, &str)]) -> Daemon {
        Self::start_with_env(&[], env)
    }

    fn start_with_env(extra_args: &[&str], env: &[(&str, &str)]) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix("hearth-e2e-")
            .tempdir()
            .expect("tempdir");
        let mut d = Daemon {
            dir,
            child: None,
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            image_roots: Vec::new(),
            netns: None,
        };
        d.spawn_env(env);
        d
    }

    /// A daemon that runs no VM (so it needs no test guest): `--accel tcg`
    /// without the probe, the given image roots, and `extra_args`.
    pub fn start_without_guest(image_roots: &[&Path], extra_args: &[&str]) -> Daemon {
        Self::start_without_guest_env(image_roots, extra_args, &[])
    }

    /// [`Daemon::start_without_guest`] with extra environment variables
    /// for hearthd (a restart with `spawn` does not keep them).
    pub fn start_without_guest_env(
        image_roots: &[&Path],
        extra_args: &[&str],
        env: &[(&str, &str)],
    ) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix("hearth-e2e-")
            .tempdir()
            .expect("tempdir");
        Self::start_without_guest_in_env(dir, image_roots, extra_args, env)
    }

    /// [`Daemon::start_without_guest`] in a directory the test prepared
    /// (its `state` may be a filesystem of its own, mounted there).
    pub fn start_without_guest_in(
        dir: tempfile::TempDir,
        image_roots: &[&Path],
        extra_args: &[&str],
    ) -> Daemon {
        Self::start_without_guest_in_env(dir, image_roots, extra_args, &[])
    }

    fn start_without_guest_in_env(
        dir: tempfile::TempDir,
        image_roots: &[&Path],
        extra_args: &[&str],
        env: &[(&str, &str)],
    ) -> Daemon {
        let mut args = vec!["--accel".to_string(), "tcg".to_string()];
        args.extend(extra_args.iter().map(|s| s.to_string()));
        let mut d = Daemon {
            dir,
            child: None,
            extra_args: args,
            image_roots: image_roots.iter().map(|p| p.to_path_buf()).collect(),
            netns: None,
        };
        d.spawn_env(env);
        d
    }

    /// A daemon inside a network namespace of its own, created here: every
    /// bridge, tap, dnsmasq and VM it makes lives there, never in the host's
    /// namespace. `image_roots` empty: the test guest's directory.
    pub fn start_in_netns(image_roots: &[&Path], extra_args: &[&str]) -> Daemon {
        let ns = netns::Netns::create();
        let dir = tempfile::Builder::new()
            .prefix("hearth-e2e-")
            .tempdir()
            .expect("tempdir");
        // dnsmasq, once it has dropped to `nobody`, must pass through to
        // its hosts file under the run directory.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o711),
        )
        .expect("chmod");
        let mut d = Daemon {
            dir,
            child: None,
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            image_roots: image_roots.iter().map(|p| p.to_path_buf()).collect(),
            netns: Some(ns),
        };
        d.spawn();
        d
    }

    /// The real CLI inside the daemon's namespace (so that its ssh reaches
    /// the guests there), with `home` as HOME when given.
    pub fn hearth_in_netns(&self, args: &[&str], home: Option<&Path>) -> Output {
        let ns = self
            .netns
            .as_ref()
            .expect("a daemon started in a namespace");
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &ns.name])
            .arg(hearth_bin())
            .args(args)
            .env("HEARTH_SOCKET", self.socket());
        if let Some(h) = home {
            c.env("HOME", h).env_remove("XDG_DATA_HOME");
        }
        c.output().expect("hearth")
    }

    /// Runs a command inside the daemon's namespace (`ip netns exec`).
    pub fn in_netns(&self, cmd: &str, args: &[&str]) -> Output {
        let ns = self
            .netns
            .as_ref()
            .expect("a daemon started in a namespace");
        ns.exec(cmd, args)
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    pub fn run_dir(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    pub fn socket(&self) -> PathBuf {
        self.run_dir().join("hearthd.sock")
    }

    /// Starts hearthd and waits until its API answers.
    pub fn spawn(&mut self) {
        self.spawn_env(&[]);
    }

    /// Starts hearthd with extra environment variables and waits until its
    /// API answers.
    pub fn spawn_env(&mut self, env: &[(&str, &str)]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("hearthd.log"))
            .expect("log file");
        let roots = if self.image_roots.is_empty() {
            vec![guest_dir()]
        } else {
            self.image_roots.clone()
        };
        let mut command = match &self.netns {
            // `ip netns exec` execs hearthd: the child's pid is hearthd's.
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &ns.name]).arg(hearthd_bin());
                c
            }
            None => Command::new(hearthd_bin()),
        };
        let child = command
            .arg("--state-dir")
            .arg(self.state_dir())
            .arg("--run-dir")
            .arg(self.run_dir())
            .args(
                roots
                    .iter()
                    .flat_map(|r| [OsStr::new("--image-root"), r.as_os_str()]),
            )
            .args(&self.extra_args)
            // Never the host's /etc/hearth/manifests: a test daemon watches a
            // directory of its own unless the test names one.
            .args(
                (!self.extra_args.iter().any(|a| a == "--manifests"))
                    .then(|| {
                        [
                            "--manifests".into(),
                            self.dir.path().join("manifests").into_os_string(),
                        ]
                    })
                    .into_iter()
                    .flatten(),
            )
            // Never the host's resolvers: a test's guests resolve nothing
            // outside, unless the test names a resolver of its own (one in
            // its namespace).
            .args(
                (!self.extra_args.iter().any(|a| a == "--dns-resolv-file"))
                    .then(|| {
                        let none = self.dir.path().join("no-upstream-resolv.conf");
                        std::fs::write(&none, "").expect("empty resolver file");
                        std::fs::set_permissions(
                            &none,
                            std::os::unix::fs::PermissionsExt::from_mode(0o644),
                        )
                        .expect("chmod");
                        ["--dns-resolv-file".into(), none.into_os_string()]
                    })
                    .into_iter()
                    .flatten(),
            )
            .envs(env.iter().copied())
            .env("HEARTH_LOG", "info,hearth_engine=debug")
            // Never the host's /etc/hearth/hearthd.toml: an empty file of
            // its own unless the test names one.
            .envs(
                (!env.iter().any(|(k, _)| *k == "HEARTH_CONFIG")
                    && !self.extra_args.iter().any(|a| a == "--config"))
                .then(|| {
                    let empty = self.dir.path().join("hearthd.toml");
                    std::fs::write(&empty, "").expect("empty config file");
                    ("HEARTH_CONFIG", empty)
                }),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn hearthd");
        self.child = Some(child);
        let up = eventually(Duration::from_secs(60), || {
            if let Ok((200, _)) = self.try_request("GET", "/v1/health", None) {
                return true;
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!("hearthd exited with {status}:\n{}", self.log());
            }
            false
        });
        assert!(up, "hearthd did not answer:\n{}", self.log());
    }

    /// SIGKILL, as a crash would: VMs must survive it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("hearthd.log")).unwrap_or_default()
    }

    pub fn try_request(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> std::io::Result<(u16, Value)> {
        let (status, bytes) = raw_request(&self.socket(), method, path, body)?;
        let value = serde_json::from_slice(&bytes)
            .unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into()));
        Ok((status, value))
    }

    pub fn request(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        self.try_request(method, path, body)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}\n{}", self.log()))
    }

    pub fn get_vm(&self, name: &str) -> Option<Value> {
        match self.request("GET", &format!("/v1/virtualmachines/{name}"), None) {
            (200, v) => Some(v),
            (404, _) => None,
            (s, v) => panic!("GET vm {name}: {s} {v}"),
        }
    }

    pub fn get_disk(&self, name: &str) -> Option<Value> {
        match self.request("GET", &format!("/v1/virtualdisks/{name}"), None) {
            (200, v) => Some(v),
            (404, _) => None,
            (s, v) => panic!("GET disk {name}: {s} {v}"),
        }
    }

    pub fn get_image(&self, name: &str) -> Option<Value> {
        match self.request("GET", &format!("/v1/virtualimages/{name}"), None) {
            (200, v) => Some(v),
            (404, _) => None,
            (s, v) => panic!("GET image {name}: {s} {v}"),
        }
    }

    /// Any object by its API path (`plural` as in `/v1/{plural}/{name}`);
    /// `None` when there is none.
    pub fn get(&self, plural: &str, name: &str) -> Option<Value> {
        match self.request("GET", &format!("/v1/{plural}/{name}"), None) {
            (200, v) => Some(v),
            (404, _) => None,
            (s, v) => panic!("GET {plural}/{name}: {s} {v}"),
        }
    }

    /// A disk's head image on the host, as its status names it.
    pub fn disk_path(&self, disk: &str) -> PathBuf {
        PathBuf::from(
            self.get_disk(disk).expect("disk")["status"]["path"]
                .as_str()
                .expect("disk path"),
        )
    }

    /// The address the metrics listener serves on, read from hearthd's log
    /// (`serving metrics ... metrics_listen=ADDR`) once it is there.
    pub fn metrics_addr(&self, timeout: Duration) -> std::net::SocketAddr {
        let mut addr = None;
        let found = eventually(timeout, || {
            addr = self
                .log()
                .lines()
                .filter(|l| l.contains("serving metrics"))
                .find_map(|l| l.split("metrics_listen=").nth(1))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|a| a.parse().ok());
            addr.is_some()
        });
        assert!(found, "no metrics listener:\n{}", self.log());
        addr.expect("found")
    }

    /// Follows an object (`plural` as in the API path) on the change
    /// stream until `pred` holds on it, or panics with its last state, its
    /// events and the daemon's log.
    /// Waits on the change stream for VirtualImage `name` to reach `phase`.
    pub fn wait_image_phase(&self, name: &str, phase: &str, timeout: Duration) -> Value {
        self.wait_object(
            "virtualimages",
            name,
            &format!("phase {phase}"),
            timeout,
            |v| v["status"]["phase"] == phase,
        )
    }

    pub fn wait_object(
        &self,
        plural: &str,
        name: &str,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        match stream::watch_object(&self.socket(), plural, name, timeout, false, pred) {
            stream::Seen::Done(v) => v,
            stream::Seen::Gone => unreachable!("not asked for"),
            stream::Seen::Timeout(last) => {
                let kind = last["kind"].as_str().unwrap_or_default().to_string();
                panic!(
                    "{plural}/{name}: {what} not reached in {timeout:?}; last: {last:#}\nevents: {:#?}\nlog:\n{}",
                    self.events(&kind, name),
                    self.log()
                );
            }
        }
    }

    /// Waits until an object is gone from the API.
    pub fn wait_gone(&self, plural: &str, name: &str, timeout: Duration) {
        match stream::watch_object(&self.socket(), plural, name, timeout, true, |_| false) {
            stream::Seen::Gone => {}
            _ => panic!("{plural}/{name} is gone: not true after {timeout:?}"),
        }
    }

    /// Waits on the change stream until a snapshot-like object
    /// (`plural/name`) is final: its phase Ready or Failed. Returns it.
    pub fn wait_final(&self, plural: &str, name: &str, timeout: Duration) -> Value {
        self.wait_object(plural, name, "phase Ready or Failed", timeout, |v| {
            matches!(v["status"]["phase"].as_str(), Some("Ready" | "Failed"))
        })
    }

    /// Runs `/bin/sh -c SCRIPT` in a VM's guest through the agent
    /// (`guest-exec`); its exit code (-1 when killed) and stdout.
    pub fn agent_sh(&self, vm: &str, script: &str) -> (i64, String) {
        let (status, v) = self.request(
            "POST",
            &format!("/v1/virtualmachines/{vm}/agent/exec"),
            Some(
                &serde_json::json!({"path": "/bin/sh", "args": ["-c", script],
                                     "timeoutSeconds": 120}),
            ),
        );
        assert_eq!(status, 200, "exec {script:?} in {vm}: {v}");
        (
            v["exitCode"].as_i64().unwrap_or(-1),
            v["stdout"].as_str().unwrap_or_default().to_string(),
        )
    }

    /// [`Daemon::agent_sh`] that must exit 0; its stdout.
    pub fn agent_sh_ok(&self, vm: &str, script: &str) -> String {
        let (code, out) = self.agent_sh(vm, script);
        assert_eq!(code, 0, "exec {script:?} in {vm} exited {code}: {out}");
        out
    }

    /// Applies objects through the HTTP API (`POST /v1/apply`); the status
    /// and the answer.
    pub fn apply_json(&self, items: Vec<Value>) -> (u16, Value) {
        self.request(
            "POST",
            "/v1/apply",
            Some(&serde_json::json!({"items": items})),
        )
    }

    /// Applies objects through the HTTP API and expects a 200; the answer.
    pub fn apply(&self, items: Vec<Value>) -> Value {
        let (status, v) = self.apply_json(items);
        assert_eq!(status, 200, "apply: {v}");
        v
    }

    pub fn events(&self, kind: &str, name: &str) -> Vec<Value> {
        let (_, v) = self.request(
            "GET",
            &format!("/v1/events?kind={kind}&name={name}&limit=500"),
            None,
        );
        v["items"].as_array().cloned().unwrap_or_default()
    }

    pub fn event_reasons(&self, kind: &str, name: &str) -> Vec<String> {
        self.events(kind, name)
            .iter()
            .map(|e| e["reason"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    /// The real CLI against this daemon, not started yet: stdout and
    /// stderr piped, stdin `stdin`.
    pub fn cli_command(&self, args: &[&str], stdin: Stdio) -> Command {
        let mut c = Command::new(hearth_bin());
        c.args(args)
            .env("HEARTH_SOCKET", self.socket())
            .current_dir(repo_root())
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    /// Runs the real CLI against this daemon.
    pub fn cli(&self, args: &[&str]) -> Output {
        self.cli_command(args, Stdio::null())
            .output()
            .expect("run hearth")
    }

    /// Runs the CLI and expects success; returns stdout.
    pub fn cli_ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(
            out.status.success(),
            "hearth {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs the CLI and expects failure; returns stderr.
    pub fn cli_err(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(
            !out.status.success(),
            "hearth {args:?} should have failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    /// Polls a VM until `pred` holds on it, or panics with its last state.
    pub fn wait_vm(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        self.wait_object("virtualmachines", name, what, timeout, pred)
    }

    pub fn wait_phase(&self, name: &str, phase: &str, timeout: Duration) -> Value {
        self.wait_vm(name, &format!("phase {phase}"), timeout, |v| {
            v["status"]["phase"] == phase
        })
    }

    pub fn wait_agent(&self, name: &str) -> Value {
        self.wait_vm(name, "agent connected", BOOT_TIMEOUT, |v| {
            v["status"]["phase"] == "Running" && v["status"]["agentConnected"] == true
        })
    }

    /// QEMU processes started by this daemon, found by the paths of this
    /// daemon's directory in their command line (the fd sets' labels: every
    /// QEMU has at least its serial log there).
    pub fn qemu_pids(&self) -> Vec<u32> {
        let marker = format!("{}/", self.dir.path().display());
        let mut pids = Vec::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            let cmdline = String::from_utf8_lossy(&cmdline);
            if cmdline.contains("qemu-system") && cmdline.contains(&marker) && !is_zombie(pid) {
                pids.push(pid);
            }
        }
        pids
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
        for pid in self.qemu_pids() {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
        }
    }
}

/// A guest under TCG on a busy 2-core machine: generous.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(180);

/// Polls a condition outside hearthd (a file, the process table) until it
/// holds, or panics naming it.
pub fn wait_until(what: &str, timeout: Duration, f: impl Fn() -> bool) {
    assert!(eventually(timeout, f), "{what}: not true after {timeout:?}");
}

/// A minimal HTTP/1.1 client over a unix socket (`Connection: close`).
pub fn raw_request(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> std::io::Result<(u16, Vec<u8>)> {
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(Duration::from_secs(120)))?;
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let sent = write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: hearthd\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    // A server that refuses a body (too large) answers and closes before
    // reading it all: the write then fails, but the answer is waiting.
    if let Err(e) = sent
        && !matches!(
            e.kind(),
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
        )
    {
        return Err(e);
    }
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf)?;
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no HTTP header end"))?;
    let head = String::from_utf8_lossy(&buf[..split]).to_string();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other("bad status line"))?;
    let mut body = buf[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    Ok((status, body))
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = data.windows(2).position(|w| w == b"\r\n") {
        let size =
            usize::from_str_radix(String::from_utf8_lossy(&data[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 || data.len() < eol + 2 + size {
            break;
        }
        out.extend_from_slice(&data[eol + 2..eol + 2 + size]);
        data = &data[(eol + 2 + size + 2).min(data.len())..];
    }
    out
}

/// Writes a manifest into the daemon's temp dir and returns its path.
pub fn manifest(d: &Daemon, file: &str, text: &str) -> PathBuf {
    let p = d.dir.path().join(file);
    std::fs::write(&p, text).expect("write manifest");
    p
}

/// A small VM booting the test guest's kernel and initrd (absolute
/// paths), with `extra_cmdline` after the guest's usual command line.
pub fn guest_vm(name: &str, extra_cmdline: &str) -> Vm {
    let g = guest_dir();
    Vm::small(name).boot(
        &g.join("vmlinuz"),
        Some(&g.join("initrd.img")),
        &format!("console=ttyS0 quiet panic=-1 {extra_cmdline}"),
    )
}

/// A VM manifest booting the test guest, with absolute paths. Kept as
/// text: tests edit it with `str::replace` (a builder writes every default,
/// so an added key would be a duplicate).
pub fn vm_yaml(name: &str, run_policy: &str, disks: &[&str], extra_cmdline: &str) -> String {
    let g = guest_dir();
    let disks: String = disks
        .iter()
        .map(|d| format!("    - virtualDiskName: {d}\n"))
        .collect();
    let disks = if disks.is_empty() {
        "  disks: []\n".to_string()
    } else {
        format!("  disks:\n{disks}")
    };
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata:\n  name: {name}\nspec:\n  runPolicy: {run_policy}\n  memory: 256Mi\n  stopTimeoutSeconds: 10\n  boot:\n    kernel: {k}\n    initrd: {i}\n    cmdline: \"console=ttyS0 quiet panic=-1 {extra_cmdline}\"\n{disks}",
        k = g.join("vmlinuz").display(),
        i = g.join("initrd.img").display(),
    )
}

/// An overlay disk over the test guest's data image.
pub fn guest_disk(name: &str) -> Disk {
    Disk::from_image(name, guest_dir().join("data.qcow2"))
}

pub fn overlay_disk_yaml(name: &str) -> String {
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata:\n  name: {name}\nspec:\n  source:\n    image: {}\n",
        guest_dir().join("data.qcow2").display()
    )
}

/// A VM's serial console file, as QEMU writes it.
pub fn serial_log(d: &Daemon, vm: &str) -> PathBuf {
    d.state_dir().join("vms").join(vm).join("serial.log")
}

/// (freezes, thaws) the test guest's fsfreeze hook has printed on its
/// console so far: the guest's own count, whatever hearthd believes. qemu-ga
/// runs the hook once per freeze command, before freezing, and once per
/// thaw that thawed something, after thawing.
pub fn hook_counts(d: &Daemon, vm: &str) -> (usize, usize) {
    let text = std::fs::read_to_string(serial_log(d, vm)).unwrap_or_default();
    (
        text.matches("fsfreeze hook: freeze").count(),
        text.matches("fsfreeze hook: thaw").count(),
    )
}

impl Daemon {
    /// Waits for hearthd to exit by itself and returns how it ended.
    pub fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let mut exited = None;
        let child = self.child.as_mut().expect("hearthd was started");
        let ended = eventually(timeout, || {
            exited = child.try_wait().expect("try_wait");
            exited.is_some()
        });
        assert!(
            ended,
            "hearthd did not exit within {timeout:?}:\n{}",
            self.log()
        );
        self.child = None;
        exited.expect("exited")
    }

    /// Live QEMU processes of this daemon whose command line names VM `vm`
    /// (`-name guest=<vm>`), read from the process table.
    pub fn qemu_pids_of(&self, vm: &str) -> Vec<u32> {
        let name = format!("guest={vm}");
        self.qemu_pids()
            .into_iter()
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .map(|raw| raw.split(|b| *b == 0).any(|a| a == name.as_bytes()))
                    .unwrap_or(false)
            })
            .collect()
    }
}

/// Checks a raw ext4 image on the host: `e2fsck -fn` passes *and* the journal
/// has nothing to replay (`e2fsck -fn` alone passes an unfrozen, dirty
/// image). Returns the `dumpe2fs -h` header.
pub fn assert_clean_ext4(raw: &Path, what: &str) -> String {
    let fsck = Command::new("e2fsck")
        .arg("-fn")
        .arg(raw)
        .output()
        .expect("e2fsck");
    assert!(
        fsck.status.success(),
        "{what}: e2fsck -fn failed:\n{}",
        String::from_utf8_lossy(&fsck.stdout)
    );
    let header = Command::new("dumpe2fs")
        .arg("-h")
        .arg(raw)
        .output()
        .expect("dumpe2fs");
    let header = String::from_utf8_lossy(&header.stdout).into_owned();
    assert!(
        !header.contains("needs_recovery"),
        "{what}: the ext4 journal has something to replay:\n{header}"
    );
    header
}

/// A file's content in a raw ext4 image, read with `debugfs`.
pub fn debugfs_cat(raw: &Path, file: &str) -> String {
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(format!("cat {file}"))
        .arg(raw)
        .output()
        .expect("debugfs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every file of `image`'s backing chain, top first, read by
/// `qemu-img info --backing-chain` (with `-U`: QEMU may hold the image).
pub fn backing_chain(image: &Path) -> Vec<PathBuf> {
    let out = Command::new("qemu-img")
        .args(["info", "-U", "--backing-chain", "--output=json"])
        .arg(image)
        .output()
        .expect("qemu-img");
    assert!(
        out.status.success(),
        "qemu-img info --backing-chain {}: {}",
        image.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    v.as_array()
        .expect("array")
        .iter()
        .filter_map(|i| i["filename"].as_str().map(PathBuf::from))
        .collect()
}

/// A disk snapshot's image as raw bytes: a VirtualDisk `chk-SNAPSHOT`
/// restored from it, converted with `qemu-img` into `scratch`. The disk
/// stays; the caller deletes it when it must not.
pub fn restored_raw(d: &Daemon, snapshot: &str, scratch: &Path) -> PathBuf {
    let disk = format!("chk-{snapshot}");
    d.apply(vec![Disk::from_snapshot(&disk, snapshot).json()]);
    d.wait_object(
        "virtualdisks",
        &disk,
        "Ready",
        Duration::from_secs(60),
        |v| v["status"]["phase"] == "Ready",
    );
    let raw = scratch.join(format!("{disk}.raw"));
    to_raw(&d.disk_path(&disk), &raw);
    raw
}

/// An image as raw bytes on the host, through its whole backing chain
/// (`-U`: QEMU may hold it).
pub fn to_raw(image: &Path, out: &Path) {
    let done = Command::new("qemu-img")
        .args(["convert", "-U", "-O", "raw"])
        .arg(image)
        .arg(out)
        .output()
        .expect("qemu-img (apt install qemu-utils)");
    assert!(
        done.status.success(),
        "qemu-img convert {}: {}",
        image.display(),
        String::from_utf8_lossy(&done.stderr)
    );
}

/// Runs a program to its end and expects it to succeed.
pub fn run_ok(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e} (install it: apt-get install qemu-utils)"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A 4 MiB qcow2 image whose first MiB is 0xab; its bytes.
pub fn make_qcow2(path: &Path) -> Vec<u8> {
    let p = path.to_str().expect("utf8");
    run_ok("qemu-img", &["create", "-q", "-f", "qcow2", p, "4M"]);
    run_ok(
        "qemu-io",
        &["-f", "qcow2", "-c", "write -q -P 0xab 0 1M", p],
    );
    std::fs::read(path).expect("read qcow2")
}

/// The QEMU pid a VM's status names.
pub fn pid_of(vm: &Value) -> u32 {
    vm["status"]["pid"].as_u64().expect("pid") as u32
}

/// Waits until a disk snapshot is Ready or Failed and returns it.
pub fn snapshot_final(d: &Daemon, name: &str, timeout: Duration) -> Value {
    d.wait_final("virtualdisksnapshots", name, timeout)
}

/// Takes a disk snapshot through the API and waits until it is final: it
/// must be Ready. Returns it.
pub fn snapshot_ready(d: &Daemon, name: &str, disk: &str, timeout: Duration) -> Value {
    d.apply(vec![DiskSnapshot::of(name, disk).json()]);
    let s = snapshot_final(d, name, timeout);
    assert_eq!(s["status"]["phase"], "Ready", "{s:#}\n{}", d.log());
    s
}

/// Writes a manifest file for this test and applies it with the real CLI
/// (`hearth apply -f`); returns the CLI's output.
pub fn apply_manifest(d: &Daemon, file: &str, text: &str) -> String {
    let m = manifest(d, file, text);
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")])
}

/// The SHA-256 of a file, as `sha256sum` prints it (64 hex digits).
pub fn sha256_file(path: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum (coreutils)");
    assert!(out.status.success(), "sha256sum {}", path.display());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("digest")
        .to_string()
}

/// `guest-fsfreeze-status` of a VM, asked through hearthd.
pub fn freeze_status(d: &Daemon, vm: &str) -> String {
    let (status, v) = d.request(
        "POST",
        &format!("/v1/virtualmachines/{vm}/agent/fsfreeze-status"),
        None,
    );
    assert_eq!(status, 200, "{v}");
    v["status"].as_str().unwrap_or_default().to_string()
}

/// `guest-fsfreeze-status` asked of qemu-ga directly on the VM's agent
/// socket (while no hearthd holds it): resynchronises with
/// `guest-sync` first, so an old reply queued for hearthd is never taken
/// for this one.
pub fn agent_freeze_status(socket: &Path) -> Option<String> {
    use std::io::{BufRead, BufReader};
    let mut s = std::os::unix::net::UnixStream::connect(socket).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    let id = std::process::id() as u64 * 1000 + 7;
    s.write_all(
        format!("{{\"execute\":\"guest-sync\",\"arguments\":{{\"id\":{id}}}}}\n").as_bytes(),
    )
    .ok()?;
    let mut r = BufReader::new(s.try_clone().ok()?);
    let mut line = String::new();
    loop {
        line.clear();
        r.read_line(&mut line).ok()?;
        if line.is_empty() {
            return None;
        }
        let v: Value = serde_json::from_str(line.trim()).unwrap_or(Value::Null);
        if v["return"].as_u64() == Some(id) {
            break;
        }
    }
    s.write_all(b"{\"execute\":\"guest-fsfreeze-status\"}\n")
        .ok()?;
    line.clear();
    r.read_line(&mut line).ok()?;
    let v: Value = serde_json::from_str(line.trim()).ok()?;
    v["return"].as_str().map(str::to_string)
}

/// `hearth_vm_forced_stops_total{vm=VM}` in a scrape of `GET /metrics` over
/// the API socket, read as a scraper would. Panics unless there is exactly
/// one such series.
pub fn forced_stops(d: &Daemon, vm: &str) -> f64 {
    let (status, body) = raw_request(&d.socket(), "GET", "/metrics", None)
        .unwrap_or_else(|e| panic!("GET /metrics: {e}\n{}", d.log()));
    let text = String::from_utf8(body).expect("metrics are UTF-8");
    assert_eq!(status, 200, "{text}");
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
        .unwrap_or_else(|e| panic!("not Prometheus text: {e}\n{text}"));
    let found: Vec<f64> = scrape
        .samples
        .iter()
        .filter(|s| s.metric == "hearth_vm_forced_stops_total" && s.labels.get("vm") == Some(vm))
        .filter_map(|s| match s.value {
            prometheus_parse::Value::Counter(v) => Some(v),
            _ => None,
        })
        .collect();
    assert_eq!(
        found.len(),
        1,
        "hearth_vm_forced_stops_total{{vm={vm:?}}}: {} counter series, not one:\n{text}",
        found.len()
    );
    found[0]
}
