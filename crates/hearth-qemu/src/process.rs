//! Launching, adopting, watching and signalling QEMU processes.
//!
//! A VM must outlive the daemon (a restarted hearthd adopts it), so QEMU runs as a
//! plain child in its own process group, with output going to a file (never a pipe
//! whose reader could die) and no parent-death signal. A process is identified by
//! pid *and* its start time in clock ticks (`/proc/<pid>/stat` field 22), so a
//! recycled pid is never mistaken for our VM.

use std::io::{Read, Seek, SeekFrom};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;

use crate::cmdline::{CmdlineError, LaunchSpec, build_args};
use crate::handover::{Handover, HandoverError, QemuUser};
use crate::qmp::QmpClient;

/// The environment variable that carries a marked launch's pidfile path into
/// QEMU's environment (`/proc/<pid>/environ`), where [`find_launched`] looks
/// for it. QEMU ignores it.
pub const LAUNCH_ENV: &str = "HEARTH_LAUNCH";

/// How often liveness is polled when pidfds are unavailable.
const POLL_INTERVAL: Duration = Duration::from_millis(200);
/// How often `launch` retries the QMP handshake.
const READY_POLL: Duration = Duration::from_millis(20);
/// How much of the end of the stderr log goes into a launch error.
const STDERR_TAIL_BYTES: u64 = 4096;
const STDERR_TAIL_LINES: usize = 10;

/// A process as it was when we saw it start: pid plus kernel start time.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ProcessIdentity {
    pub pid: u32,
    /// `/proc/<pid>/stat` field 22, clock ticks after boot.
    pub start_ticks: u64,
}

/// Signals the driver sends; a closed set so callers cannot send anything odd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    Term,
    Kill,
    Int,
    Hup,
    Stop,
    Cont,
}

impl Signal {
    fn to_rustix(self) -> rustix::process::Signal {
        use rustix::process::Signal as S;
        match self {
            Signal::Term => S::TERM,
            Signal::Kill => S::KILL,
            Signal::Int => S::INT,
            Signal::Hup => S::HUP,
            Signal::Stop => S::STOP,
            Signal::Cont => S::CONT,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SignalError {
    #[error("process {pid} is gone (or its pid now belongs to another process)")]
    Gone { pid: u32 },
    #[error("cannot signal process {pid}")]
    Os {
        pid: u32,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("invalid launch spec")]
    Cmdline(#[from] CmdlineError),
    #[error("cannot open QEMU log {path}")]
    Log {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start {binary}")]
    Spawn {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("QEMU exited during start-up ({status}): {stderr_tail}")]
    Exited { status: String, stderr_tail: String },
    #[error(
        "QEMU (pid {pid}) did not answer on QMP within {timeout:?} and was killed; last output: {stderr_tail}"
    )]
    NotReady {
        pid: u32,
        timeout: Duration,
        stderr_tail: String,
    },
    #[error("socket {path} is in use by a running process; is this VM already running?")]
    SocketInUse { path: PathBuf },
    #[error("cannot read the identity of the new QEMU process {pid}")]
    NoIdentity { pid: u32 },
    #[error("pidfile path {path:?} is not usable: {why}")]
    Pidfile { path: PathBuf, why: &'static str },
    #[error("cannot write the pidfile {path}")]
    PidfileWrite {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Handover(HandoverError),
}

impl From<HandoverError> for LaunchError {
    fn from(e: HandoverError) -> Self {
        match e {
            HandoverError::SocketInUse { path } => LaunchError::SocketInUse { path },
            other => LaunchError::Handover(other),
        }
    }
}

/// Parsed bits of `/proc/<pid>/stat`.
struct Stat {
    state: char,
    start_ticks: u64,
}

fn parse_stat(text: &str) -> Option<Stat> {
    // The command name (field 2) is in parentheses and may itself contain ") ", so
    // split at the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `fields[0]` is field 3 (state); field 22 is therefore at index 19.
    let state = fields.first()?.chars().next()?;
    let start_ticks = fields.get(19)?.parse().ok()?;
    Some(Stat { state, start_ticks })
}

fn read_stat(pid: u32) -> Option<Stat> {
    if pid == 0 {
        return None;
    }
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text)
}

/// The identity of `pid` right now, or `None` if there is no such process.
pub fn identity_of(pid: u32) -> Option<ProcessIdentity> {
    read_stat(pid).map(|stat| ProcessIdentity {
        pid,
        start_ticks: stat.start_ticks,
    })
}

/// True if the very process `id` describes still runs (same pid, same start time,
/// not a zombie).
pub fn is_alive(id: &ProcessIdentity) -> bool {
    match read_stat(id.pid) {
        Some(stat) => stat.start_ticks == id.start_ticks && !matches!(stat.state, 'Z' | 'X'),
        None => false,
    }
}

/// The VM name from a QEMU argv built by [`build_args`] (`-name guest=<name>`), read
/// from `/proc/<pid>/cmdline`. Lets an adopting daemon check that a pid is the VM
/// it thinks it is, not merely some live process.
pub fn vm_name_of(id: &ProcessIdentity) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{}/cmdline", id.pid)).ok()?;
    // Re-check after reading: the pid could have been recycled in between.
    if !is_alive(id) {
        return None;
    }
    let args: Vec<&[u8]> = raw.split(|b| *b == 0).collect();
    let at = args.iter().position(|a| *a == b"-name")?;
    let value = std::str::from_utf8(args.get(at + 1)?).ok()?;
    value.strip_prefix("guest=").map(str::to_owned)
}

fn pidfd_of(id: &ProcessIdentity) -> std::io::Result<OwnedFd> {
    let raw = i32::try_from(id.pid).map_err(|_| std::io::Error::from_raw_os_error(libc_esrch()))?;
    let pid = rustix::process::Pid::from_raw(raw)
        .ok_or_else(|| std::io::Error::from_raw_os_error(libc_esrch()))?;
    rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).map_err(Into::into)
}

fn libc_esrch() -> i32 {
    rustix::io::Errno::SRCH.raw_os_error()
}

/// Sends `sig` to the process, refusing if its identity no longer matches.
///
/// With a pidfd the check and the signal refer to the same process even if the pid
/// is recycled in between; without one (old kernels) there is a tiny window.
pub fn signal(id: &ProcessIdentity, sig: Signal) -> Result<(), SignalError> {
    let gone = || SignalError::Gone { pid: id.pid };
    match pidfd_of(id) {
        Ok(fd) => {
            // The fd pins this exact process; check that it is the one we mean.
            if !is_alive(id) {
                return Err(gone());
            }
            rustix::process::pidfd_send_signal(fd.as_fd(), sig.to_rustix()).map_err(|e| {
                if e == rustix::io::Errno::SRCH {
                    gone()
                } else {
                    SignalError::Os {
                        pid: id.pid,
                        source: e.into(),
                    }
                }
            })
        }
        Err(e) if e.raw_os_error() == Some(libc_esrch()) => Err(gone()),
        Err(_) => {
            if !is_alive(id) {
                return Err(gone());
            }
            let raw = i32::try_from(id.pid).map_err(|_| gone())?;
            let pid = rustix::process::Pid::from_raw(raw).ok_or_else(gone)?;
            rustix::process::kill_process(pid, sig.to_rustix()).map_err(|e| {
                if e == rustix::io::Errno::SRCH {
                    gone()
                } else {
                    SignalError::Os {
                        pid: id.pid,
                        source: e.into(),
                    }
                }
            })
        }
    }
}

/// Resolves once the process is gone (exited, or a zombie waiting to be reaped).
/// Works for processes that are not our children, e.g. adopted after a restart.
pub async fn wait_for_exit(id: &ProcessIdentity) {
    if let Ok(fd) = pidfd_of(id) {
        // Opened after the pid might have been recycled: make sure it is ours.
        if !is_alive(id) {
            return;
        }
        // SAFETY: an `OwnedFd` stays open and returns the same raw fd until the
        // `AsyncFd` that owns it is dropped; nothing else can close it.
        let registered = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) };
        if let Ok(async_fd) = registered {
            // A pidfd becomes readable when the process exits. Readiness is
            // edge-triggered and an exit fires once, so never wait for a second
            // edge: the poll below confirms (and covers any lag in /proc).
            let _ = async_fd.readable().await;
        }
    }
    while is_alive(id) {
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Starts QEMU for `spec` and waits until QMP answers on its socket.
///
/// QEMU runs as our child in its own process group with stdin at /dev/null and
/// stdout/stderr appended to `stderr_log`, so it survives the daemon being killed.
/// The child is reaped by a background task while the daemon lives. If QEMU exits
/// first, the error carries the end of its log; if it is not ready by
/// `ready_timeout`, it is killed and the error says so. It runs as the
/// calling user (see [`launch_with`] for another one).
pub async fn launch(
    qemu_binary: &Path,
    spec: &LaunchSpec,
    stderr_log: &Path,
    ready_timeout: Duration,
) -> Result<ProcessIdentity, LaunchError> {
    launch_with(
        qemu_binary,
        spec,
        stderr_log,
        ready_timeout,
        None,
        None,
        |_| {},
    )
    .await
}

/// [`launch`], plus:
///
/// - with `pidfile`, QEMU's environment carries [`LAUNCH_ENV`]`=<pidfile>`
///   and the pidfile is written (by us, right after the spawn: QEMU could
///   not create it in the private run directory), so a launch whose caller
///   died before learning the pid can be found again with [`find_launched`]
///   (give every launch a path that never repeats: the path is the token);
/// - with `user`, QEMU runs as that user: its uid, its primary gid, and as
///   supplementary groups only `kvm` when KVM is used and `/dev/kvm` belongs
///   to it. Every file and socket it needs is opened here and inherited
///   ([`Handover`]), so the user needs access to none of them;
/// - `after_spawn` runs right after the process exists (and its pidfile is
///   written), before waiting for it to become ready.
pub async fn launch_with(
    qemu_binary: &Path,
    spec: &LaunchSpec,
    stderr_log: &Path,
    ready_timeout: Duration,
    pidfile: Option<&Path>,
    user: Option<&QemuUser>,
    after_spawn: impl FnOnce(&ProcessIdentity),
) -> Result<ProcessIdentity, LaunchError> {
    if let Some(pidfile) = pidfile {
        check_pidfile_path(pidfile)?;
    }
    // The argv is checked before anything is opened or bound.
    build_args(spec, &crate::cmdline::FdNumbers::for_spec(spec))?;
    let handover = Handover::open(spec)?;
    let args = build_args(spec, &handover.numbers)?;

    let log_err = |source| LaunchError::Log {
        path: stderr_log.to_owned(),
        source,
    };
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(stderr_log)
        .map_err(log_err)?;
    let log_start = log.metadata().map(|m| m.len()).unwrap_or(0);
    let log_out = log.try_clone().map_err(log_err)?;

    let mut command = tokio::process::Command::new(qemu_binary);
    command
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log_out))
        .stderr(Stdio::from(log))
        .process_group(0)
        .kill_on_drop(false);
    if let Some(pidfile) = pidfile {
        command.env(LAUNCH_ENV, pidfile);
    }
    let inherit = handover.inherited();
    let creds = user
        .filter(|u| !u.is_root())
        .map(|u| (u.uid, u.gid, u.groups_for(spec.accel)));
    // SAFETY: the closure runs between fork and exec and only makes
    // async-signal-safe syscalls (fcntl, setgroups, setresgid, setresuid)
    // on data prepared before the fork; it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            crate::handover::child_setup(
                &inherit,
                creds
                    .as_ref()
                    .map(|(u, g, groups)| (*u, *g, groups.as_slice())),
            )
        });
    }
    let mut child = command.spawn().map_err(|source| LaunchError::Spawn {
        binary: qemu_binary.to_owned(),
        source,
    })?;
    // QEMU holds its copies now; ours go (a listening socket we kept would
    // still accept connections after QEMU died).
    drop(handover);
    let pid = child.id().ok_or(LaunchError::NoIdentity { pid: 0 })?;
    // Until we wait on it the child cannot be reaped, so its stat is readable.
    let identity = identity_of(pid).ok_or(LaunchError::NoIdentity { pid })?;

    // If our caller abandons this future, the half-started QEMU must not linger
    // with nobody knowing its identity.
    let mut kill_guard = KillOnDrop(Some(identity.clone()));
    if let Some(pidfile) = pidfile {
        write_pidfile(pidfile, pid).map_err(|source| LaunchError::PidfileWrite {
            path: pidfile.to_owned(),
            source,
        })?;
    }
    after_spawn(&identity);

    let (exit_tx, mut exit_rx) = oneshot::channel();
    tokio::spawn(async move {
        let status = child.wait().await;
        let _ = exit_tx.send(status);
    });

    // QEMU opens its chardev sockets before it opens disks, so a bare connect can
    // succeed for a QEMU that is about to fail. Command replies, though, come from
    // the main loop, which only runs once start-up succeeded: a finished QMP
    // handshake (capabilities reply) is the readiness signal.
    let ready = async {
        loop {
            if QmpClient::connect(&spec.qmp_socket, ready_timeout)
                .await
                .is_ok()
            {
                return;
            }
            tokio::time::sleep(READY_POLL).await;
        }
    };
    tokio::select! {
        biased;
        status = &mut exit_rx => {
            let status = match status {
                Ok(Ok(s)) => s.to_string(),
                Ok(Err(e)) => format!("wait failed: {e}"),
                Err(_) => "unknown status".to_owned(),
            };
            Err(LaunchError::Exited { status, stderr_tail: log_tail(stderr_log, log_start) })
        }
        outcome = tokio::time::timeout(ready_timeout, ready) => match outcome {
            Ok(()) => {
                kill_guard.0 = None;
                Ok(identity)
            }
            Err(_) => {
                // A QEMU that never became manageable must not linger; the guard
                // kills it on the way out.
                Err(LaunchError::NotReady {
                    pid,
                    timeout: ready_timeout,
                    stderr_tail: log_tail(stderr_log, log_start),
                })
            }
        },
    }
}

fn check_pidfile_path(path: &Path) -> Result<(), LaunchError> {
    let bad = |why| LaunchError::Pidfile {
        path: path.to_owned(),
        why,
    };
    let text = path.to_str().ok_or_else(|| bad("not valid UTF-8"))?;
    if !path.is_absolute() {
        return Err(bad("must be absolute"));
    }
    if text.chars().any(char::is_control) {
        return Err(bad("contains a control character"));
    }
    Ok(())
}

/// Writes `pid` to a new pidfile (mode 0600), replacing none.
fn write_pidfile(path: &Path, pid: u32) -> std::io::Result<()> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    writeln!(file, "{pid}")?;
    file.sync_all()
}

/// Whether `environ` (a NUL-separated `/proc/<pid>/environ`) has
/// [`LAUNCH_ENV`]`=<path>`.
fn environ_names_pidfile(raw: &[u8], pidfile: &Path) -> bool {
    let mut want = format!("{LAUNCH_ENV}=").into_bytes();
    want.extend_from_slice(pidfile.as_os_str().as_encoded_bytes());
    raw.split(|b| *b == 0).any(|v| v == want.as_slice())
}

/// The process `pid` if it was started with [`LAUNCH_ENV`]`=<pidfile>` and
/// no earlier than `not_before` (boot clock ticks). The identity is read
/// before and checked after reading the environment, so a pid recycled in
/// between is never taken.
fn launched_as(pid: u32, pidfile: &Path, not_before: u64) -> Option<ProcessIdentity> {
    let id = identity_of(pid)?;
    let raw = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    if !environ_names_pidfile(&raw, pidfile) || id.start_ticks < not_before || !is_alive(&id) {
        return None;
    }
    Some(id)
}

/// Finds the process a [`launch_with`] with this `pidfile` started, if it
/// still runs: first the pid written into the pidfile, then (the launcher
/// may have died before writing it) every process. A pid
/// is taken only if its environment names this pidfile (whose path never
/// repeats) and it started no earlier than `not_before` (from
/// [`spawn_floor_ticks`] taken before the launch); a bare pid is never trusted.
pub fn find_launched(pidfile: &Path, not_before: u64) -> Option<ProcessIdentity> {
    if let Some(pid) = std::fs::read_to_string(pidfile)
        .ok()
        .and_then(|t| t.trim().parse::<u32>().ok())
        && let Some(id) = launched_as(pid, pidfile, not_before)
    {
        return Some(id);
    }
    let mut found = std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| launched_as(pid, pidfile, not_before));
    found.next()
}

/// A lower bound, in `/proc/<pid>/stat` start-time units (clock ticks since
/// boot), for the start time of any process spawned from now on; one second
/// of slack covers the rounding of `/proc/uptime`.
pub fn spawn_floor_ticks() -> Option<u64> {
    let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
    let hz = clock_ticks_per_second();
    Some(uptime_ticks(uptime.split_whitespace().next()?, hz)?.saturating_sub(hz))
}

/// `/proc/uptime`'s `SECONDS.CENTISECONDS` in clock ticks, in whole numbers
/// (a float would round 12345.67 s down a tick).
fn uptime_ticks(text: &str, hz: u64) -> Option<u64> {
    let (secs, frac) = text.split_once('.').unwrap_or((text, "0"));
    let secs: u64 = secs.parse().ok()?;
    let centis: u64 = format!("{frac:0<2}").get(..2)?.parse().ok()?;
    Some(secs * hz + centis * hz / 100)
}

/// The kernel's boot id: start times and pids mean nothing across a reboot.
pub fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// `sysconf(_SC_CLK_TCK)`, from the auxiliary vector (`AT_CLKTCK`); 100, the
/// value on every common architecture, if it cannot be read.
pub(crate) fn clock_ticks_per_second() -> u64 {
    const AT_CLKTCK: u64 = 17;
    let auxv = std::fs::read("/proc/self/auxv").unwrap_or_default();
    let words: Vec<u64> = auxv
        .chunks_exact(8)
        .map(|c| u64::from_ne_bytes(c.try_into().unwrap_or([0; 8])))
        .collect();
    words
        .chunks_exact(2)
        .find(|kv| kv[0] == AT_CLKTCK)
        .map(|kv| kv[1])
        .filter(|hz| *hz > 0)
        .unwrap_or(100)
}

/// Kills the process it holds when dropped, unless disarmed by taking the identity.
struct KillOnDrop(Option<ProcessIdentity>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(id) = self.0.take() {
            let _ = signal(&id, Signal::Kill);
        }
    }
}

/// The last few lines QEMU wrote since `start`, bounded in size.
fn log_tail(path: &Path, start: u64) -> String {
    let read = || -> std::io::Result<Vec<u8>> {
        let mut file = std::fs::File::open(path)?;
        let len = file.metadata()?.len();
        // `start` past the end means the log was truncated meanwhile: read the tail.
        let tail = len.saturating_sub(STDERR_TAIL_BYTES);
        let from = if start > len { tail } else { start.max(tail) };
        file.seek(SeekFrom::Start(from))?;
        let mut buf = Vec::new();
        file.take(STDERR_TAIL_BYTES).read_to_end(&mut buf)?;
        Ok(buf)
    };
    match read() {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            // A part hearthd punched out of the log reads as NULs.
            let blank = |l: &str| {
                l.trim_matches(|c: char| c.is_whitespace() || c == '\0')
                    .is_empty()
            };
            let lines: Vec<&str> = text.lines().filter(|l| !blank(l)).collect();
            let keep = &lines[lines.len().saturating_sub(STDERR_TAIL_LINES)..];
            if keep.is_empty() {
                "(no output)".to_owned()
            } else {
                keep.join("\n")
            }
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_survives_hostile_command_names() {
        // comm "a) R 1 (b" tries to shift the fields.
        let line = "1234 (a) R 1 (b) S 1 1234 1234 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 987654 1000 10 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0";
        let stat = parse_stat(line).expect("parses");
        assert_eq!(stat.state, 'S');
        assert_eq!(stat.start_ticks, 987654);
        assert!(parse_stat("garbage").is_none());
        assert!(parse_stat("1 (x) S 1 2").is_none(), "too few fields");
    }

    #[test]
    fn our_own_process_has_a_stable_identity() {
        let me = std::process::id();
        let a = identity_of(me).expect("self");
        let b = identity_of(me).expect("self");
        assert_eq!(a, b);
        assert!(is_alive(&a));
        let recycled = ProcessIdentity {
            pid: me,
            start_ticks: a.start_ticks + 1,
        };
        assert!(!is_alive(&recycled), "same pid, other start time");
        assert!(identity_of(0).is_none());
        assert!(identity_of(u32::MAX).is_none());
    }

    #[test]
    fn only_an_exact_launch_variable_counts() {
        let pidfile = Path::new("/run/hearth/vms/a/qemu-launch-7.pid");
        let env = |parts: &[&str]| parts.join("\0").into_bytes();
        assert!(environ_names_pidfile(
            &env(&[
                "PATH=/usr/bin",
                "HEARTH_LAUNCH=/run/hearth/vms/a/qemu-launch-7.pid",
                ""
            ]),
            pidfile
        ));
        for other in [
            env(&["HEARTH_LAUNCH=/run/hearth/vms/a/qemu-launch-70.pid"]),
            env(&["HEARTH_LAUNCH=/run/hearth/vms/a/qemu-launch-7.pid.x"]),
            env(&["X=/run/hearth/vms/a/qemu-launch-7.pid"]),
            env(&["XHEARTH_LAUNCH=/run/hearth/vms/a/qemu-launch-7.pid"]),
            Vec::new(),
        ] {
            assert!(!environ_names_pidfile(&other, pidfile), "{other:?}");
        }
    }

    #[test]
    fn pidfile_paths_must_be_plain() {
        assert!(check_pidfile_path(Path::new("/run/x,y=z/launch-1.pid")).is_ok());
        assert!(check_pidfile_path(Path::new("run/launch-1.pid")).is_err());
        assert!(check_pidfile_path(Path::new("/run/a\nb.pid")).is_err());
    }

    #[test]
    fn the_spawn_floor_is_before_our_own_start_and_the_clock_rate_is_sane() {
        let hz = clock_ticks_per_second();
        assert!((10..=10_000).contains(&hz), "{hz}");
        let me = identity_of(std::process::id()).expect("self");
        // Read after our start time: the floor a second before now.
        let floor = spawn_floor_ticks().expect("uptime");
        assert!(
            me.start_ticks <= floor + hz,
            "we started before now: started at tick {}, now is tick {}",
            me.start_ticks,
            floor + hz
        );
        assert_eq!(uptime_ticks("12345.67", 100), Some(1_234_567));
        assert_eq!(uptime_ticks("7.5", 100), Some(750));
        assert_eq!(uptime_ticks("3.05", 1000), Some(3050));
        assert!(boot_id().is_some_and(|b| b.len() >= 32));
    }

    #[test]
    fn identity_round_trips_through_json() {
        let id = ProcessIdentity {
            pid: 42,
            start_ticks: 123_456,
        };
        let text = serde_json::to_string(&id).expect("serialize");
        assert_eq!(text, r#"{"pid":42,"start_ticks":123456}"#);
        assert_eq!(
            serde_json::from_str::<ProcessIdentity>(&text).expect("parse"),
            id
        );
    }

    #[test]
    fn log_tail_keeps_only_new_last_lines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qemu.log");
        std::fs::write(&path, "old run: error\n").expect("write");
        let start = std::fs::metadata(&path).expect("meta").len();
        let mut new = String::new();
        for i in 0..30 {
            new.push_str(&format!("line {i}\n"));
        }
        new.push_str("qemu-system-x86_64: -blockdev x: Could not open 'x'\n");
        std::fs::write(&path, format!("old run: error\n{new}")).expect("write");
        let tail = log_tail(&path, start);
        assert!(!tail.contains("old run"));
        assert!(tail.ends_with("Could not open 'x'"));
        assert_eq!(tail.lines().count(), STDERR_TAIL_LINES);
        let len = std::fs::metadata(&path).expect("meta").len();
        assert_eq!(log_tail(&path, len), "(no output)");
        // A start offset past the end (log truncated meanwhile) still shows the tail.
        assert!(log_tail(&path, u64::MAX).ends_with("Could not open 'x'"));
        // A launch whose log start was punched out meanwhile: the hole
        // (NULs when read) is no line of its own.
        let mut holed = vec![0u8; 100];
        holed.extend_from_slice(b"\nqemu: terminating\n");
        std::fs::write(&path, &holed).expect("write");
        assert_eq!(log_tail(&path, 0), "qemu: terminating");
    }
}
