//! One dnsmasq per managed network with DHCP: hearth's leases are its static
//! hosts, it hands out no address of its own.
//!
//! dnsmasq daemonises itself (it is not hearthd's child for long), so it
//! outlives a SIGKILLed hearthd. After a restart the process is found again
//! from its pid file and accepted only when `/proc/PID/cmdline` is dnsmasq
//! with this network's `--conf-file=` (observe, don't assume); it is then
//! adopted, never started twice. Signals go through a pidfd opened before
//! that check, so a recycled pid cannot be signalled by mistake.
//!
//! Files, all in the network's directory `NETWORKS_DIR/BRIDGE/`:
//! `dnsmasq.conf`, `hosts` (`MAC,IP,HOSTNAME` lines), `dnsmasq.pid`,
//! `leases`, `dnsmasq.log`, `loaded.json`. Config and hosts are written
//! atomically (temp file + rename), and only when their content changes.
//!
//! What to do is never decided from the config and hosts files: a daemon
//! killed between writing them and signalling dnsmasq leaves files that
//! already say the new thing while dnsmasq still serves the old. It is
//! decided from `loaded.json` ([`LoadedRecord`]): what one dnsmasq process
//! (pid and start time) read at its start or at its last confirmed reread,
//! written only after dnsmasq has read it. A record of another process, or
//! none, means dnsmasq's data is unknown and it is restarted. The decision
//! is the pure [`decide`]; [`steps`] lists what carries it out, each step
//! one effect on the host, in an order where a kill between any two leaves
//! something the next [`decide`] repairs.

use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, poll};
use rustix::process::{Pid, PidfdFlags, Signal, pidfd_open, pidfd_send_signal};
use serde::{Deserialize, Serialize};

use super::{Dns, HostError, HostNetwork, NetworkMode, StaticLease, prefix_mask};

/// How long a starting dnsmasq may take to daemonise.
pub const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a stopping dnsmasq gets after SIGTERM before SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(5);
/// How long a SIGHUPed dnsmasq may take to log that it reread its hosts.
pub const REREAD_TIMEOUT: Duration = Duration::from_secs(5);

/// The files of one network's dnsmasq.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsmasqFiles {
    pub dir: PathBuf,
}

impl DnsmasqFiles {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        DnsmasqFiles { dir: dir.into() }
    }
    pub fn conf(&self) -> PathBuf {
        self.dir.join("dnsmasq.conf")
    }
    pub fn hosts(&self) -> PathBuf {
        self.dir.join("hosts")
    }
    pub fn pid(&self) -> PathBuf {
        self.dir.join("dnsmasq.pid")
    }
    pub fn leases(&self) -> PathBuf {
        self.dir.join("leases")
    }
    pub fn log(&self) -> PathBuf {
        self.dir.join("dnsmasq.log")
    }
    /// What the running dnsmasq has read: [`LoadedRecord`].
    pub fn loaded(&self) -> PathBuf {
        self.dir.join("loaded.json")
    }
    /// The argument that identifies this network's dnsmasq in `/proc`.
    pub fn conf_arg(&self) -> String {
        format!("--conf-file={}", self.conf().display())
    }
}

/// The config file (dnsmasq's long options without the `--`).
///
/// - DNS ([`Dns`]): `Off` is `port=0` (DHCP then names no DNS server);
///   otherwise dnsmasq answers on the gateway, hands itself out as the DNS
///   server (DHCP option 6), and answers the VMs' names from their leases
///   (the hostnames in `hosts`). `Forward` sends every other name to the
///   `nameserver`s of its `resolv-file` (dnsmasq polls the file for
///   changes); `Local` (`no-resolv`) answers nothing else. `no-hosts` keeps
///   the host's `/etc/hosts` out; `domain-needed` and `bogus-priv` keep plain
///   names and private reverse lookups from going upstream.
/// - `dhcp-range=NET,static`: dnsmasq answers only the MACs in `hosts`,
///   hearth's IPAM is the single source of addresses.
/// - `bind-interfaces` + `interface=BRIDGE` + `except-interface=lo`: it binds
///   to the bridge only, never to the host's other interfaces.
/// - Isolated networks get no default route (`dhcp-option=3` with no value).
pub fn render_config(net: &HostNetwork, files: &DnsmasqFiles) -> String {
    let mask = std::net::Ipv4Addr::from(prefix_mask(net.prefix_len));
    let mut s = String::new();
    s.push_str(&format!(
        "# hearth: dnsmasq of network bridge {} (generated, rewritten on every resync)\n",
        net.bridge
    ));
    let dns: Vec<String> = match &net.dns {
        Dns::Off => vec!["no-resolv".into(), "no-hosts".into(), "port=0".into()],
        Dns::Local => vec![
            "no-resolv".into(),
            "no-hosts".into(),
            "domain-needed".into(),
            "bogus-priv".into(),
        ],
        Dns::Forward(upstream) => vec![
            format!("resolv-file={}", upstream.display()),
            "no-hosts".into(),
            "domain-needed".into(),
            "bogus-priv".into(),
        ],
    };
    for line in dns.into_iter().chain([
        "bind-interfaces".to_string(),
        format!("interface={}", net.bridge),
        "except-interface=lo".to_string(),
        format!("dhcp-range={},static,{mask},1h", net.subnet_addr()),
        format!("dhcp-hostsfile={}", files.hosts().display()),
        format!("dhcp-leasefile={}", files.leases().display()),
        format!("pid-file={}", files.pid().display()),
        format!("log-facility={}", files.log().display()),
        "dhcp-authoritative".to_string(),
    ]) {
        s.push_str(&line);
        s.push('\n');
    }
    match net.mode {
        NetworkMode::Nat => s.push_str(&format!("dhcp-option=option:router,{}\n", net.gateway)),
        NetworkMode::Isolated | NetworkMode::Bridge { .. } => s.push_str("dhcp-option=3\n"),
    }
    s
}

/// The `dhcp-hostsfile`: one `MAC,IP,HOSTNAME` line per lease, sorted.
pub fn render_hosts(leases: &[StaticLease]) -> String {
    let mut lines: Vec<String> = leases
        .iter()
        .map(|l| format!("{},{},{}", l.mac, l.ip, l.hostname))
        .collect();
    lines.sort();
    let mut s = lines.join("\n");
    if !s.is_empty() {
        s.push('\n');
    }
    s
}

/// Writes `content` to `path` atomically unless it is already there.
/// `true` when it wrote. Files are 0644: dnsmasq rereads the hosts file as
/// its unprivileged user on SIGHUP.
pub fn write_if_changed(path: &Path, content: &str) -> Result<bool, HostError> {
    if std::fs::read(path).ok().as_deref() == Some(content.as_bytes()) {
        return Ok(false);
    }
    let tmp = path.with_extension("tmp");
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(content.as_bytes())?;
        f.set_permissions(std::fs::Permissions::from_mode(0o644))?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| HostError::io(format!("writing {}", path.display()), e))?;
    Ok(true)
}

/// One process, told from any later one with the same pid by its start
/// time (`/proc/PID/stat` field 22, clock ticks after boot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcId {
    pub pid: u32,
    pub start_ticks: u64,
}

/// A running dnsmasq, held by a pidfd.
#[derive(Debug)]
pub struct Running {
    pub pid: u32,
    pub id: ProcId,
    pidfd: OwnedFd,
}

/// The process behind `pid`, if it is dnsmasq started with `conf_arg`.
fn open_checked(pid: u32, conf_arg: &str) -> Option<Running> {
    let p = Pid::from_raw(i32::try_from(pid).ok()?)?;
    let pidfd = pidfd_open(p, PidfdFlags::empty()).ok()?;
    // Checked after the pidfd is open: if the cmdline and start time match
    // now, the pidfd names this very process, whatever happens to the pid
    // later.
    let args = read_cmdline(pid)?;
    let identity = hearth_qemu::process::identity_of(pid)?;
    if is_dnsmasq(&args) && args.iter().any(|a| a == conf_arg) {
        Some(Running {
            pid,
            id: ProcId {
                pid,
                start_ticks: identity.start_ticks,
            },
            pidfd,
        })
    } else {
        None
    }
}

fn read_cmdline(pid: u32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        raw.split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect(),
    )
}

fn is_dnsmasq(args: &[String]) -> bool {
    args.first()
        .and_then(|a| Path::new(a).file_name())
        .is_some_and(|n| n == "dnsmasq")
}

/// The running dnsmasq of these files: the pid file's process if it is this
/// network's dnsmasq, otherwise one found in `/proc` by its `--conf-file`
/// (a pid file lost or overwritten must not lead to a second dnsmasq).
pub fn observe(files: &DnsmasqFiles) -> Option<Running> {
    let conf_arg = files.conf_arg();
    let from_pid_file = std::fs::read_to_string(files.pid())
        .ok()
        .and_then(|t| t.trim().parse::<u32>().ok())
        .and_then(|pid| open_checked(pid, &conf_arg));
    from_pid_file.or_else(|| {
        proc_dnsmasqs()
            .into_iter()
            .filter(|(_, args)| args.contains(&conf_arg))
            .find_map(|(pid, _)| open_checked(pid, &conf_arg))
    })
}

/// Every dnsmasq process in `/proc` with its arguments.
fn proc_dnsmasqs() -> Vec<(u32, Vec<String>)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out: Vec<(u32, Vec<String>)> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, read_cmdline(pid)?)))
        .filter(|(_, args)| is_dnsmasq(args))
        .collect();
    out.sort_by_key(|(pid, _)| *pid);
    out
}

impl Running {
    /// Waits up to `bound` for the process to end. `true` when it did.
    fn wait_exit(&self, bound: Duration) -> bool {
        let mut fds = [PollFd::new(&self.pidfd, PollFlags::IN)];
        let ts = rustix::time::Timespec {
            tv_sec: bound.as_secs() as i64,
            tv_nsec: i64::from(bound.subsec_nanos()),
        };
        matches!(poll(&mut fds, Some(&ts)), Ok(n) if n > 0)
    }

    fn signal(&self, sig: Signal) -> Result<(), HostError> {
        pidfd_send_signal(&self.pidfd, sig)
            .map_err(|e| HostError::io(format!("signalling dnsmasq {}", self.pid), e.into()))
    }

    /// SIGHUP: dnsmasq rereads its dhcp-hostsfile.
    pub fn reload(&self) -> Result<(), HostError> {
        self.signal(Signal::HUP)
    }

    /// SIGTERM, then SIGKILL after [`STOP_GRACE`]; returns once it is gone.
    pub fn stop(self) -> Result<(), HostError> {
        self.signal(Signal::TERM)?;
        if self.wait_exit(STOP_GRACE) {
            return Ok(());
        }
        self.signal(Signal::KILL)?;
        if self.wait_exit(STOP_GRACE) {
            Ok(())
        } else {
            Err(HostError::Command {
                what: format!("stopping dnsmasq {}", self.pid),
                detail: "still running after SIGKILL".into(),
            })
        }
    }
}

/// Starts dnsmasq on these files. It daemonises: the command returns once
/// dnsmasq has bound its sockets and written its pid file, or failed.
pub async fn start(files: &DnsmasqFiles) -> Result<Running, HostError> {
    let mut cmd = tokio::process::Command::new("dnsmasq");
    cmd.arg(files.conf_arg())
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(START_TIMEOUT, cmd.output())
        .await
        .map_err(|_| HostError::Command {
            what: "starting dnsmasq".into(),
            detail: format!("did not daemonise within {START_TIMEOUT:?}"),
        })?
        .map_err(|e| {
            HostError::io(
                "running dnsmasq (apt-get install dnsmasq-base)".to_string(),
                e,
            )
        })?;
    if !out.status.success() {
        return Err(HostError::Command {
            what: format!("starting dnsmasq {}", files.conf_arg()),
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    observe(files).ok_or_else(|| HostError::Command {
        what: format!("starting dnsmasq {}", files.conf_arg()),
        detail: format!(
            "exited 0 but {} names no running dnsmasq",
            files.pid().display()
        ),
    })
}

/// What [`ensure`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum DnsmasqOutcome {
    /// Already running with this config and hosts.
    Unchanged { pid: u32 },
    /// Running, hosts rewritten, SIGHUP sent.
    Reloaded { pid: u32 },
    /// Started (none was running, or the config changed and the old one was
    /// stopped).
    Started { pid: u32 },
}

impl DnsmasqOutcome {
    pub fn pid(&self) -> u32 {
        match *self {
            DnsmasqOutcome::Unchanged { pid }
            | DnsmasqOutcome::Reloaded { pid }
            | DnsmasqOutcome::Started { pid } => pid,
        }
    }
}

/// dnsmasq reads its hosts file as the unprivileged user it drops to
/// (`nobody`), at start and on every SIGHUP: every directory above it must be
/// traversable by others (`o+x`), or dnsmasq logs "cannot read" and serves
/// no host at all. Checked before starting, so the error is hearth's and
/// names the directory.
pub fn check_reachable(dir: &Path) -> Result<(), HostError> {
    for d in dir.ancestors() {
        let meta = std::fs::metadata(d)
            .map_err(|e| HostError::io(format!("reading {}", d.display()), e))?;
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o001 == 0 {
            return Err(HostError::Command {
                what: format!("dnsmasq files in {}", dir.display()),
                detail: format!(
                    "dnsmasq runs as nobody and cannot reach them: {} has mode {mode:04o} (needs o+x, e.g. 0711)",
                    d.display()
                ),
            });
        }
    }
    Ok(())
}

/// What a dnsmasq process has read: the config at its start, the hosts
/// file at its start or last reread.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Loaded {
    pub conf: String,
    pub hosts: String,
}

/// What one dnsmasq process has read, and may have served. It speaks of that
/// process only (pid and start time): another dnsmasq, even on the same
/// pid, is unknown.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadedRecord {
    pub process: ProcId,
    /// What it has read for certain: written once its log showed that it
    /// read the hosts file, at its start or after a SIGHUP.
    pub loaded: Loaded,
    /// Every hosts line it may have read since it started (sorted, one per
    /// line): written *before* each SIGHUP, since a SIGHUP sent lands
    /// whether or not the daemon that sent it lives to see it. dnsmasq keeps
    /// what it handed out under any of these lines until it restarts.
    pub offered: String,
}

/// What the network's dnsmasq needs, from what it has read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// It has read the desired config and hosts.
    Keep,
    /// Only lines were added to its hosts: SIGHUP.
    Reload,
    /// Its config differs, a hosts line it may have served is not desired
    /// any more (see [`released_hosts`]), or what it has read is unknown (no
    /// record of this process): stop it and start one on an empty lease
    /// file.
    Restart,
    /// None runs.
    Start,
}

/// The decision, from the running process (if any), the record of what a
/// dnsmasq has read (if any) and the desired files. Never from the files on
/// disk: they may be newer than what dnsmasq has read.
pub fn decide(running: Option<ProcId>, record: Option<&LoadedRecord>, want: &Loaded) -> Action {
    let Some(running) = running else {
        return Action::Start;
    };
    match record {
        Some(r) if r.process == running => {
            if r.loaded.conf != want.conf
                || released_hosts(&r.offered, &want.hosts)
                || released_hosts(&r.loaded.hosts, &want.hosts)
            {
                Action::Restart
            } else if r.loaded.hosts != want.hosts {
                Action::Reload
            } else {
                Action::Keep
            }
        }
        _ => Action::Restart,
    }
}

/// One effect on the host. Each lands on its own: a kill may come between
/// any two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The config file gets the desired content (temp file + rename).
    WriteConf,
    /// The hosts file gets the desired content (temp file + rename).
    WriteHosts,
    /// SIGTERM (then SIGKILL) to the running dnsmasq, until it is gone.
    Stop,
    /// The lease file is removed: a new dnsmasq remembers no MAC for an
    /// address that IPAM gave to another.
    ClearLeases,
    /// dnsmasq is started: it reads the config before it returns, and the
    /// hosts file around the time it daemonises.
    Start,
    /// The record's `offered` gets the desired hosts lines, before the
    /// signal that may make dnsmasq read them.
    Offer,
    /// SIGHUP: dnsmasq rereads the hosts file, later, on its own.
    Signal,
    /// Its log shows that it read the hosts file (`read HOSTS`) after the
    /// start or the signal.
    AwaitReread,
    /// The record names the running process, with the desired files as
    /// read.
    Record,
}

/// The steps of an action, in order. The files come first, so that
/// whatever dnsmasq reads next (at a start, or at a SIGHUP of this run or of
/// a run that died) is the desired content; what it may read is recorded
/// before the signal, what it has read once its log shows it.
pub fn steps(action: Action) -> &'static [Step] {
    use Step::*;
    match action {
        Action::Keep => &[WriteConf, WriteHosts],
        Action::Reload => &[WriteConf, WriteHosts, Offer, Signal, AwaitReread, Record],
        Action::Restart => &[
            WriteConf,
            WriteHosts,
            Stop,
            ClearLeases,
            Start,
            AwaitReread,
            Record,
        ],
        Action::Start => &[
            WriteConf,
            WriteHosts,
            ClearLeases,
            Start,
            AwaitReread,
            Record,
        ],
    }
}

/// The record after `step` (`Offer` or `Record`) of a run towards `want`:
/// `record` is the one read before (if it is of `process`).
pub fn record_after(
    step: Step,
    record: Option<&LoadedRecord>,
    process: ProcId,
    want: &Loaded,
) -> Option<LoadedRecord> {
    let same = record.filter(|r| r.process == process);
    match step {
        Step::Offer => same.map(|r| LoadedRecord {
            offered: union_lines(&r.offered, &want.hosts),
            ..r.clone()
        }),
        Step::Record => Some(LoadedRecord {
            process,
            loaded: want.clone(),
            offered: match same {
                Some(r) => union_lines(&r.offered, &want.hosts),
                None => union_lines("", &want.hosts),
            },
        }),
        _ => None,
    }
}

/// The lines of `a` and `b`, sorted, each once, one per line.
pub fn union_lines(a: &str, b: &str) -> String {
    let lines: std::collections::BTreeSet<&str> = a
        .lines()
        .chain(b.lines())
        .filter(|l| !l.is_empty())
        .collect();
    lines.into_iter().map(|l| format!("{l}\n")).collect()
}

/// The record of what a dnsmasq of these files has read, if one is there
/// and readable (anything else counts as none: dnsmasq is restarted).
pub fn read_record(files: &DnsmasqFiles) -> Option<LoadedRecord> {
    let text = std::fs::read(files.loaded()).ok()?;
    serde_json::from_slice(&text).ok()
}

fn write_record(files: &DnsmasqFiles, record: &LoadedRecord) -> Result<(), HostError> {
    let text = serde_json::to_string(record).map_err(|e| HostError::Command {
        what: format!("writing {}", files.loaded().display()),
        detail: e.to_string(),
    })?;
    write_if_changed(&files.loaded(), &text).map(|_| ())
}

/// The length of dnsmasq's log: where lines logged from now on start.
fn log_len(files: &DnsmasqFiles) -> u64 {
    std::fs::metadata(files.log()).map(|m| m.len()).unwrap_or(0)
}

/// Whether `log` (from some offset on) has process `pid`'s line saying it
/// read `hosts`. dnsmasq logs `dnsmasq-dhcp[PID]: read PATH` once it has
/// parsed the file, and `cannot read PATH: ...` when it could not.
pub fn logged_reread(log: &str, pid: u32, hosts: &Path) -> bool {
    let line_end = format!("dnsmasq-dhcp[{pid}]: read {}", hosts.display());
    log.lines().any(|l| l.ends_with(&line_end))
}

/// Waits, at most [`REREAD_TIMEOUT`], for dnsmasq `pid` to log the reread of
/// its hosts file after offset `from` of its log.
async fn await_reread(files: &DnsmasqFiles, pid: u32, from: u64) -> Result<(), HostError> {
    let deadline = tokio::time::Instant::now() + REREAD_TIMEOUT;
    loop {
        let tail = std::fs::read(files.log())
            .ok()
            .and_then(|b| {
                let from = usize::try_from(from).ok()?;
                b.get(from..)
                    .map(|t| String::from_utf8_lossy(t).into_owned())
            })
            .unwrap_or_default();
        if logged_reread(&tail, pid, &files.hosts()) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            let last = tail.lines().last().unwrap_or("nothing").to_string();
            return Err(HostError::Command {
                what: format!("reloading dnsmasq {pid} ({})", files.conf_arg()),
                detail: format!(
                    "it did not log a reread of {} within {REREAD_TIMEOUT:?} after SIGHUP (last logged: {last})",
                    files.hosts().display()
                ),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Makes the network's dnsmasq run with its current config and hosts: the
/// steps of [`decide`]'s action, from the running process and the record of
/// what it has read.
pub async fn ensure(net: &HostNetwork, files: &DnsmasqFiles) -> Result<DnsmasqOutcome, HostError> {
    std::fs::create_dir_all(&files.dir)
        .and_then(|()| std::fs::set_permissions(&files.dir, std::fs::Permissions::from_mode(0o755)))
        .map_err(|e| HostError::io(format!("creating {}", files.dir.display()), e))?;
    check_reachable(&files.dir)?;
    let want = Loaded {
        conf: render_config(net, files),
        hosts: render_hosts(&net.static_leases),
    };
    let mut running = observe(files);
    let mut record = read_record(files);
    let action = decide(running.as_ref().map(|r| r.id), record.as_ref(), &want);
    let mut log_from = 0;
    for step in steps(action) {
        match step {
            Step::WriteConf => {
                write_if_changed(&files.conf(), &want.conf)?;
            }
            Step::WriteHosts => {
                write_if_changed(&files.hosts(), &want.hosts)?;
            }
            Step::Stop => {
                if let Some(r) = running.take() {
                    r.stop()?;
                }
            }
            Step::ClearLeases => clear_leases(files)?,
            Step::Start => {
                log_from = log_len(files);
                running = Some(start(files).await?);
            }
            Step::Signal => {
                log_from = log_len(files);
                running_of(&running, files)?.reload()?;
            }
            Step::AwaitReread => {
                await_reread(files, running_of(&running, files)?.pid, log_from).await?;
            }
            Step::Offer | Step::Record => {
                let process = running_of(&running, files)?.id;
                if let Some(next) = record_after(*step, record.as_ref(), process, &want) {
                    write_record(files, &next)?;
                    record = Some(next);
                }
            }
        }
    }
    let pid = running_of(&running, files)?.pid;
    Ok(match action {
        Action::Keep => DnsmasqOutcome::Unchanged { pid },
        Action::Reload => DnsmasqOutcome::Reloaded { pid },
        Action::Restart | Action::Start => DnsmasqOutcome::Started { pid },
    })
}

fn running_of<'a>(
    running: &'a Option<Running>,
    files: &DnsmasqFiles,
) -> Result<&'a Running, HostError> {
    running.as_ref().ok_or_else(|| HostError::Command {
        what: format!("dnsmasq {}", files.conf_arg()),
        detail: "no dnsmasq runs after its start".into(),
    })
}

/// Whether `new` lacks a line of `old`: a lease was released or moved to
/// another MAC or address. dnsmasq keeps what it handed out, in memory and
/// in its lease file, for the lease time even after the host line goes, and
/// refuses an address IPAM gives to another MAC ("leased to ..."); a SIGHUP
/// does not make it forget. Then it is restarted on an empty lease file.
pub fn released_hosts(old: &str, new: &str) -> bool {
    old.lines().any(|l| !new.lines().any(|n| n == l))
}

/// Removes the lease file before a start. Nothing is lost: every address is
/// a static host and dnsmasq is authoritative, so a guest's renewal of the
/// address it has is answered as before.
fn clear_leases(files: &DnsmasqFiles) -> Result<(), HostError> {
    match std::fs::remove_file(files.leases()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(HostError::io(
            format!("removing {}", files.leases().display()),
            e,
        )),
    }
}

/// A dnsmasq started by hearth, found in `/proc` by its `--conf-file` under
/// the networks directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundDnsmasq {
    pub pid: u32,
    /// The network directory (`NETWORKS_DIR/BRIDGE`).
    pub dir: PathBuf,
}

/// Every dnsmasq whose config lies in `NETWORKS_DIR/*/dnsmasq.conf`,
/// whatever its pid file says.
pub fn find_all(networks_dir: &Path) -> Vec<FoundDnsmasq> {
    let mut out = Vec::new();
    for (pid, args) in proc_dnsmasqs() {
        for a in &args {
            if let Some(conf) = a.strip_prefix("--conf-file=") {
                let conf = Path::new(conf);
                if let Some(dir) = conf.parent()
                    && dir.parent() == Some(networks_dir)
                    && conf.file_name().is_some_and(|n| n == "dnsmasq.conf")
                {
                    out.push(FoundDnsmasq {
                        pid,
                        dir: dir.to_path_buf(),
                    });
                }
            }
        }
    }
    out
}

/// Stops a dnsmasq found by [`find_all`], after checking again that the pid
/// is still that dnsmasq. `false` when it was already gone.
pub fn stop_found(found: &FoundDnsmasq) -> Result<bool, HostError> {
    match open_checked(found.pid, &DnsmasqFiles::new(&found.dir).conf_arg()) {
        Some(r) => r.stop().map(|()| true),
        None => Ok(false),
    }
}

#[cfg(test)]
mod tests;
