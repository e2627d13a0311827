//! The bound on the external programs hearthd runs for its objects
//! (`qemu-img`, `nft`): one pool for the whole process, so a burst of
//! thousands of objects never means thousands of children at once, with
//! their pipes and pidfds. A program run through [`run`] is always waited
//! for: when it ends, when its timeout kills it, and when its caller gives
//! up on it (the future is dropped); its slot is given back only once it is
//! reaped, so the pool's size bounds the children that exist, not only the
//! ones somebody still waits for.
//!
//! Long-running daemons (QEMU, dnsmasq) are not in the pool: each would
//! hold a slot for as long as it runs.
//!
//! Every program is started from one thread that lives as long as the
//! process: a caller that sets `PR_SET_PDEATHSIG` in its command (a copy,
//! a fetch: work that must not outlive hearthd) gets the signal when the
//! process dies, and not when the runtime thread that happened to start
//! it exits (the signal follows the thread that forked, and a runtime's
//! threads come and go: `block_in_place` hands a worker's place to a new
//! thread, blocking threads end when idle).

use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Which of the two pools a program takes a slot from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Programs that end within seconds: `qemu-img info`, `create`,
    /// `check`, `nft`.
    Quick,
    /// Copies whose time grows with the data (`qemu-img convert`,
    /// `rebase`): a pool of their own, half the size, so hours of copying
    /// never hold up the quick ones that make new disks.
    Copy,
}

/// The two pools: `limit` quick programs and half as many copies (at
/// least one) at once.
pub struct Pool {
    quick: Arc<Semaphore>,
    copies: Arc<Semaphore>,
    limit: usize,
}

static GLOBAL: OnceLock<Pool> = OnceLock::new();

/// Twice the CPUs this process may run on (at least 2): the programs are
/// short and partly wait for the disk, so two per CPU keep the CPUs busy
/// without queueing hundreds of processes on them.
pub fn default_limit() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    (2 * cpus).max(2)
}

/// Sizes the process's pool. Only the first call counts, and only before
/// any program ran; false when the pool was already sized.
pub fn set_limit(limit: usize) -> bool {
    GLOBAL.set(Pool::new(limit)).is_ok()
}

/// The process's pool ([`default_limit`] unless [`set_limit`] came first).
pub fn global() -> &'static Pool {
    GLOBAL.get_or_init(|| Pool::new(default_limit()))
}

/// [`Pool::run`] in the process's pool.
pub async fn run(
    command: Command,
    class: Class,
    input: Option<&[u8]>,
    limits: Limits,
) -> Result<Finished, RunError> {
    global().run(command, class, input, limits).await
}

/// [`Pool::run_watched`] in the process's pool.
pub async fn run_watched(
    command: Command,
    class: Class,
    limits: Limits,
    watch: &mut (dyn FnMut(&[u8]) + Send),
) -> Result<Finished, RunError> {
    global().run_watched(command, class, limits, watch).await
}

/// [`Pool::slot`] of the process's pool.
pub async fn slot(class: Class) -> OwnedSemaphorePermit {
    global().slot(class).await
}

/// How a program run ended.
#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    /// Up to the caller's bound; the rest was read and dropped.
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot start it: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("waiting for it failed: {0}")]
    Wait(#[source] std::io::Error),
    #[error("it did not finish within {0:?} and was killed")]
    Timeout(Duration),
}

/// What to bound a run by.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub timeout: Duration,
    pub stdout: usize,
    pub stderr: usize,
}

impl Pool {
    pub fn new(limit: usize) -> Pool {
        let limit = limit.max(1);
        Pool {
            quick: Arc::new(Semaphore::new(limit)),
            copies: Arc::new(Semaphore::new((limit / 2).max(1))),
            limit,
        }
    }

    /// How many quick programs may run at once.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// How many copies may run at once.
    pub fn copy_limit(&self) -> usize {
        (self.limit / 2).max(1)
    }

    fn semaphore(&self, class: Class) -> &Arc<Semaphore> {
        match class {
            Class::Quick => &self.quick,
            Class::Copy => &self.copies,
        }
    }

    /// A slot, for a program not started through [`Pool::run`]: hold it
    /// from before the spawn until the program was waited for.
    pub async fn slot(&self, class: Class) -> OwnedSemaphorePermit {
        self.semaphore(class)
            .clone()
            .acquire_owned()
            .await
            .expect("the program pool is never closed")
    }

    /// Runs `command` once a slot of `class` is free: stdin from `input` (or
    /// none), stdout and stderr read up to their bounds. Killed after the
    /// timeout; killed too when this future is dropped. Either way it is
    /// reaped in the background, holding its slot until then, and the caller
    /// does not wait for that (a process in uninterruptible sleep, on a hung
    /// mount, cannot die at once).
    pub async fn run(
        &self,
        command: Command,
        class: Class,
        input: Option<&[u8]>,
        limits: Limits,
    ) -> Result<Finished, RunError> {
        self.run_with(command, class, input, limits, &mut |_| {})
            .await
    }

    /// [`Pool::run`] with no input, handing `watch` each piece of stdout
    /// as it comes (a copy's progress), before the bound applies.
    pub async fn run_watched(
        &self,
        command: Command,
        class: Class,
        limits: Limits,
        watch: &mut (dyn FnMut(&[u8]) + Send),
    ) -> Result<Finished, RunError> {
        self.run_with(command, class, None, limits, watch).await
    }

    async fn run_with(
        &self,
        mut command: Command,
        class: Class,
        input: Option<&[u8]>,
        limits: Limits,
        watch: &mut (dyn FnMut(&[u8]) + Send),
    ) -> Result<Finished, RunError> {
        let slot = self.slot(class).await;
        command
            .stdin(if input.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let child = spawn_from_lasting_thread(command)
            .await
            .map_err(RunError::Spawn)?;
        let mut running = Running {
            child: Some(child),
            slot: Some(slot),
        };
        let child = running.child.as_mut().expect("just set");
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let feed = async move {
            if let (Some(mut pipe), Some(bytes)) = (stdin, input) {
                // A program that stops reading early fails on its own terms.
                let _ = pipe.write_all(bytes).await;
            }
        };
        let mut quiet = |_: &[u8]| {};
        let all = async {
            let ((), status, out, err) = tokio::join!(
                feed,
                child.wait(),
                read_bounded(stdout, limits.stdout, watch),
                read_bounded(stderr, limits.stderr, &mut quiet)
            );
            (status, out, err)
        };
        match tokio::time::timeout(limits.timeout, all).await {
            Ok((status, stdout, stderr)) => {
                let status = status.map_err(RunError::Wait)?;
                // Waited for: nothing is left to reap.
                running.child = None;
                Ok(Finished {
                    status,
                    stdout,
                    stderr,
                })
            }
            // Dropping `running` kills it and reaps it in the background.
            Err(_) => Err(RunError::Timeout(limits.timeout)),
        }
    }
}

/// A started program and its slot. Dropped before the program was waited
/// for, it kills the program and hands both to a task that reaps it and
/// only then frees the slot.
struct Running {
    child: Option<Child>,
    slot: Option<OwnedSemaphorePermit>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = child.start_kill();
        let slot = self.slot.take();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let _ = child.wait().await;
                    drop(slot);
                });
            }
            // No runtime left to wait on: tokio's own orphan reaping
            // collects it (kill_on_drop was set).
            Err(_) => drop(child),
        }
    }
}

/// Starts a program that runs beside hearthd for as long as it is wanted
/// (a reader kept open on a pipe), outside the pool: from the lasting
/// thread, so a `PR_SET_PDEATHSIG` it sets follows the process, and killed
/// (then reaped by the runtime) when its `Child` is dropped.
pub async fn spawn_lasting(mut command: Command) -> std::io::Result<Child> {
    command.kill_on_drop(true);
    spawn_from_lasting_thread(command).await
}

type SpawnRequest = (
    Command,
    tokio::runtime::Handle,
    tokio::sync::oneshot::Sender<std::io::Result<Child>>,
);

/// Spawns `command` from a thread that lives as long as the process (see
/// the module's comment), inside this runtime, so the child is reaped by
/// it as any other.
async fn spawn_from_lasting_thread(mut command: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<std::sync::Mutex<std::sync::mpsc::Sender<SpawnRequest>>> =
        OnceLock::new();
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return command.spawn();
    };
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("hearth-programs".into())
            .spawn(move || {
                for (mut command, runtime, reply) in rx {
                    let _entered = runtime.enter();
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("starting the programs' spawner thread");
        std::sync::Mutex::new(tx)
    });
    let (reply, answer) = tokio::sync::oneshot::channel();
    let gone = || std::io::Error::other("the programs' spawner thread is gone");
    spawner
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send((command, runtime, reply))
        .map_err(|_| gone())?;
    answer.await.map_err(|_| gone())?
}

/// Reads up to `limit` bytes and drains the rest, so the program never
/// blocks on a full pipe; `watch` sees every piece.
async fn read_bounded<R: AsyncRead + Unpin>(
    reader: Option<R>,
    limit: usize,
    watch: &mut (dyn FnMut(&[u8]) + Send),
) -> Vec<u8> {
    let mut kept = Vec::new();
    let Some(mut reader) = reader else {
        return kept;
    };
    let mut chunk = [0u8; 8192];
    loop {
        match reader.read(&mut chunk).await {
            Ok(0) | Err(_) => return kept,
            Ok(n) => {
                watch(&chunk[..n]);
                let room = limit.saturating_sub(kept.len());
                kept.extend_from_slice(&chunk[..n.min(room)]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn limits(timeout: Duration) -> Limits {
        Limits {
            timeout,
            stdout: 1024,
            stderr: 1024,
        }
    }

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    /// Whether `pid` exists at all (a zombie counts: it is not reaped).
    fn exists(pid: u32) -> bool {
        std::path::Path::new(&format!("/proc/{pid}")).exists()
    }

    /// The pid a script wrote to `file`, once it did.
    async fn pid_in(file: &std::path::Path) -> u32 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(pid) = std::fs::read_to_string(file)
                .ok()
                .and_then(|s| s.trim().parse().ok())
            {
                return pid;
            }
            assert!(Instant::now() < deadline, "the program never started");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A program that dies with its parent (`PR_SET_PDEATHSIG`) lives on
    /// when the thread that asked for it ends: the signal follows the
    /// thread that forked, which is the lasting spawner's. From the process
    /// table.
    #[test]
    fn a_program_outlives_the_thread_that_started_it() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let handle = runtime.handle().clone();
        let asker = std::thread::spawn(move || {
            handle.block_on(async {
                let mut c = sh("sleep 30");
                // SAFETY: prctl is async-signal-safe and touches only the child.
                unsafe {
                    c.pre_exec(|| {
                        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        Ok(())
                    });
                }
                spawn_from_lasting_thread(c).await.expect("spawn")
            })
        });
        let mut child = asker.join().expect("the asking thread");
        let pid = child.id().expect("running");
        std::thread::sleep(Duration::from_millis(300));
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let alive = status
            .lines()
            .find_map(|l| l.strip_prefix("State:"))
            .is_some_and(|s| !s.trim().starts_with(['Z', 'X']));
        runtime.block_on(async {
            let _ = child.kill().await;
        });
        assert!(
            alive,
            "the program died with the thread that asked:\n{status}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_more_programs_run_at_once_than_the_pool_has_slots() {
        let pool = Arc::new(Pool::new(3));
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("log");
        // Each program notes when it starts and ends: the log tells how
        // many overlapped, whatever the pool believes.
        let script = format!(
            "echo start >> {l}; sleep 0.2; echo end >> {l}",
            l = log.display()
        );
        let mut tasks = Vec::new();
        for class in [Class::Quick; 10] {
            let (pool, script) = (pool.clone(), script.clone());
            tasks.push(tokio::spawn(async move {
                pool.run(sh(&script), class, None, limits(Duration::from_secs(60)))
                    .await
            }));
        }
        for t in tasks {
            assert!(t.await.expect("task").expect("run").status.success());
        }
        let text = std::fs::read_to_string(&log).expect("log");
        let (mut now, mut most) = (0usize, 0usize);
        for l in text.lines() {
            if l == "start" {
                now += 1;
                most = most.max(now);
            } else {
                now -= 1;
            }
        }
        assert_eq!(text.lines().filter(|l| *l == "end").count(), 10);
        assert!(most <= 3, "{most} ran at once in a pool of 3");
        assert!(most > 1, "they ran one at a time: the test shows nothing");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn copies_have_their_own_smaller_pool() {
        let pool = Pool::new(4);
        assert_eq!(pool.copy_limit(), 2);
        assert_eq!(Pool::new(1).copy_limit(), 1);
        // Both copy slots taken: a quick program still runs.
        let _a = pool.slot(Class::Copy).await;
        let _b = pool.slot(Class::Copy).await;
        let f = pool
            .run(
                sh("true"),
                Class::Quick,
                None,
                limits(Duration::from_secs(30)),
            )
            .await
            .expect("run");
        assert!(f.status.success());
        assert_eq!(pool.semaphore(Class::Copy).available_permits(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_program_past_its_timeout_is_killed_and_reaped_before_its_slot_is_free() {
        let pool = Pool::new(1);
        let dir = tempfile::tempdir().expect("tempdir");
        let pidfile = dir.path().join("pid");
        let script = format!("echo $$ > {}; exec sleep 600", pidfile.display());
        let err = pool
            .run(
                sh(&script),
                Class::Quick,
                None,
                limits(Duration::from_millis(500)),
            )
            .await
            .expect_err("it sleeps past its timeout");
        assert!(matches!(err, RunError::Timeout(_)), "{err}");
        let pid = pid_in(&pidfile).await;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // The slot first, then the process: a free slot means the
            // process was already reaped (no zombie left either).
            let free = pool.semaphore(Class::Quick).available_permits() == 1;
            let alive = exists(pid);
            if free {
                assert!(!alive, "the slot came back while pid {pid} still exists");
                break;
            }
            assert!(Instant::now() < deadline, "pid {pid} was never reaped");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_run_its_caller_gives_up_kills_and_reaps_the_program() {
        let pool = Arc::new(Pool::new(1));
        let dir = tempfile::tempdir().expect("tempdir");
        let pidfile = dir.path().join("pid");
        let script = format!("echo $$ > {}; exec sleep 600", pidfile.display());
        let task = {
            let pool = pool.clone();
            tokio::spawn(async move {
                pool.run(
                    sh(&script),
                    Class::Quick,
                    None,
                    limits(Duration::from_secs(600)),
                )
                .await
            })
        };
        let pid = pid_in(&pidfile).await;
        assert!(exists(pid));
        task.abort();
        let _ = task.await;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let free = pool.semaphore(Class::Quick).available_permits() == 1;
            let alive = exists(pid);
            if free {
                assert!(!alive, "the slot came back while pid {pid} still exists");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "pid {pid} outlived the run that was given up"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn input_output_and_exit_status_are_the_programs() {
        let pool = Pool::new(2);
        let f = pool
            .run(
                sh("tr a-z A-Z; echo oops >&2; exit 3"),
                Class::Quick,
                Some(b"hello"),
                limits(Duration::from_secs(30)),
            )
            .await
            .expect("run");
        assert_eq!(f.status.code(), Some(3));
        assert_eq!(f.stdout, b"HELLO");
        assert_eq!(f.stderr, b"oops\n");
        let err = pool
            .run(
                Command::new("/nonexistent/program"),
                Class::Quick,
                None,
                limits(Duration::from_secs(30)),
            )
            .await
            .expect_err("no such program");
        assert!(matches!(err, RunError::Spawn(_)), "{err}");
        // A failed spawn gives its slot back.
        assert_eq!(pool.semaphore(Class::Quick).available_permits(), 2);
    }
}
