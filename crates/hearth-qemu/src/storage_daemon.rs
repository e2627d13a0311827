//! A qcow2 image opened by QEMU's own qcow2 driver and shown as a plain
//! file: `qemu-storage-daemon` with a FUSE export on an empty regular file.
//! Host tools that read and write a raw filesystem (`e2fsck`, `resize2fs`,
//! `debugfs`) then work on the qcow2's virtual disk, every write going
//! through the driver QEMU itself uses, without an NBD device (no module
//! here) and without mounting anything in the host's file tree but the
//! export.
//!
//! The daemon never outlives its caller: it is spawned with
//! `PR_SET_PDEATHSIG` = SIGKILL from a thread that lives as long as the
//! process (the signal follows the thread that forked, and a runtime's
//! threads come and go), so a hearthd killed with SIGKILL takes it along;
//! dropping the handle kills it too. A FUSE mount whose daemon was killed
//! stays behind as a dead mount: [`unmount`] and [`sweep`] take it away.

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::tools::{MissingTool, find_binary};

/// How often readiness and exit are looked at.
const POLL: Duration = Duration::from_millis(20);
const LOG_TAIL: usize = 2048;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    MissingTool(#[from] MissingTool),
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start qemu-storage-daemon: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("qemu-storage-daemon exited ({status}) before its export was mounted: {log}")]
    Exited { status: String, log: String },
    #[error("qemu-storage-daemon did not mount its export within {0:?} and was killed")]
    Timeout(Duration),
    #[error("qemu-storage-daemon did not exit within {0:?} of SIGTERM and was killed")]
    StopTimeout(Duration),
    #[error("qemu-storage-daemon exited with {status} when stopped: {log}")]
    StopFailed { status: String, log: String },
    #[error("cannot unmount the export {}: {source}", path.display())]
    Unmount {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What the process became: `None` while it runs.
type ExitState = Option<String>;

/// The process and whether it was reaped, under one lock: a signal is sent
/// only while it was not (so never to a pid the kernel handed out again).
struct Proc {
    pid: libc::pid_t,
    reaped: Mutex<bool>,
}

impl Proc {
    fn signal(&self, sig: libc::c_int) {
        let reaped = self.reaped.lock().unwrap_or_else(|p| p.into_inner());
        if !*reaped {
            // SAFETY: plain syscall; the pid is our unreaped child.
            unsafe { libc::kill(self.pid, sig) };
        }
    }
}

/// A running `qemu-storage-daemon` exporting one qcow2 image at a file.
pub struct FuseExport {
    proc: Arc<Proc>,
    exit: watch::Receiver<ExitState>,
    mountpoint: PathBuf,
    log: PathBuf,
    stopped: bool,
}

impl std::fmt::Debug for FuseExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FuseExport")
            .field("pid", &self.proc.pid)
            .field("mountpoint", &self.mountpoint)
            .finish()
    }
}

/// The argv of the daemon: the image through the `file` and `qcow2`
/// drivers, exported writable at `mountpoint`. Paths go in as they are:
/// the caller's, absolute, without `,` (QEMU's option separator).
pub fn args(image: &Path, mountpoint: &Path) -> Vec<OsString> {
    args_with(image, mountpoint, Access::ReadWrite)
}

/// Whether the export may be written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    ReadWrite,
    /// The image (and its backing chain) opened read-only: a layer below a
    /// running VM's head can be read while QEMU holds it.
    ReadOnly,
}

fn args_with(image: &Path, mountpoint: &Path, access: Access) -> Vec<OsString> {
    let (ro, writable) = match access {
        Access::ReadWrite => ("off", "on"),
        Access::ReadOnly => ("on", "off"),
    };
    let mut file = OsString::from(format!("driver=file,node-name=f,read-only={ro},filename="));
    file.push(image);
    let mut export = OsString::from(format!(
        "type=fuse,id=e,node-name=q,writable={writable},mountpoint="
    ));
    export.push(mountpoint);
    vec![
        "--blockdev".into(),
        file,
        "--blockdev".into(),
        format!("driver=qcow2,node-name=q,file=f,read-only={ro}").into(),
        "--export".into(),
        export,
    ]
}

/// Whether a path can go into a QEMU option string as it is.
fn plain_option_path(p: &Path) -> bool {
    p.is_absolute()
        && !p
            .as_os_str()
            .as_bytes()
            .iter()
            .any(|b| *b == b',' || *b < 0x20)
}

impl FuseExport {
    /// Starts the daemon on the qcow2 `image` and waits until the export is
    /// mounted at `mountpoint` (made here as an empty 0600 file). Its output
    /// goes to `log`. Nothing may have `image` open for writing.
    pub async fn start(
        image: &Path,
        mountpoint: &Path,
        log: &Path,
        timeout: Duration,
    ) -> Result<FuseExport, DaemonError> {
        Self::start_with(image, mountpoint, log, timeout, Access::ReadWrite).await
    }

    /// [`FuseExport::start`] with the access asked for.
    pub async fn start_with(
        image: &Path,
        mountpoint: &Path,
        log: &Path,
        timeout: Duration,
        access: Access,
    ) -> Result<FuseExport, DaemonError> {
        for p in [image, mountpoint] {
            if !plain_option_path(p) {
                return Err(DaemonError::Io {
                    what: "refusing a path with `,` or a control character",
                    path: p.to_path_buf(),
                    source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
                });
            }
        }
        let binary = find_binary("qemu-storage-daemon")?;
        let io = |what, path: &Path| {
            let path = path.to_path_buf();
            move |source| DaemonError::Io { what, path, source }
        };
        {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(mountpoint)
                .map_err(io("making the mountpoint", mountpoint))?;
        }
        // The kernel lists the mount by its real path.
        let mountpoint = &std::fs::canonicalize(mountpoint)
            .map_err(io("resolving the mountpoint", mountpoint))?;
        if !plain_option_path(mountpoint) {
            return Err(DaemonError::Io {
                what: "refusing a path with `,` or a control character",
                path: mountpoint.to_path_buf(),
                source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
            });
        }
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(io("opening", log))?;
        let err = out.try_clone().map_err(io("opening", log))?;
        let mut command = std::process::Command::new(&binary);
        command
            .args(args_with(image, mountpoint, access))
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: between fork and exec only async-signal-safe syscalls
        // (prctl, getppid) on a value copied before the fork.
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent died before the prctl: nobody would kill us.
                if libc::getppid() != parent {
                    return Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
                }
                Ok(())
            });
        }
        let child = spawn_from_lasting_thread(command).map_err(DaemonError::Spawn)?;
        let proc = Arc::new(Proc {
            pid: child.id() as libc::pid_t,
            reaped: Mutex::new(false),
        });
        let (tx, exit) = watch::channel(None);
        {
            let proc = proc.clone();
            std::thread::spawn(move || reap(child, &proc, &tx));
        }
        let mut export = FuseExport {
            proc,
            exit,
            mountpoint: mountpoint.to_path_buf(),
            log: log.to_path_buf(),
            stopped: false,
        };
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = export.exit.borrow().clone() {
                export.stopped = true;
                let _ = unmount(mountpoint);
                return Err(DaemonError::Exited {
                    status,
                    log: log_tail(log),
                });
            }
            if is_mounted(mountpoint) {
                return Ok(export);
            }
            if Instant::now() >= deadline {
                // Dropping `export` kills it.
                return Err(DaemonError::Timeout(timeout));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid as u32
    }

    /// The exported file: the qcow2's virtual disk, read and written raw.
    pub fn device(&self) -> &Path {
        &self.mountpoint
    }

    /// SIGTERM, and waits until the daemon has exited: QEMU closes its block
    /// nodes on the way out, which flushes the qcow2 (data, L2 tables,
    /// refcounts) and unmounts the export. Past `timeout` it is killed and
    /// that is an error: the image may lack writes. The mountpoint file
    /// stays for the caller to remove.
    pub async fn stop(mut self, timeout: Duration) -> Result<(), DaemonError> {
        self.proc.signal(libc::SIGTERM);
        let mut exit = self.exit.clone();
        let waited = tokio::time::timeout(timeout, exit.wait_for(|s| s.is_some())).await;
        let status = match waited {
            Ok(Ok(s)) => s.clone(),
            _ => None,
        };
        self.stopped = true;
        let Some(status) = status else {
            self.proc.signal(libc::SIGKILL);
            let _ = unmount(&self.mountpoint);
            return Err(DaemonError::StopTimeout(timeout));
        };
        unmount(&self.mountpoint)?;
        if status != "exit status: 0" {
            return Err(DaemonError::StopFailed {
                status,
                log: log_tail(&self.log),
            });
        }
        Ok(())
    }
}

impl Drop for FuseExport {
    fn drop(&mut self) {
        if !self.stopped {
            self.proc.signal(libc::SIGKILL);
            // The kernel may not have torn the connection down yet: a lazy
            // unmount takes the mount away whatever its state.
            let _ = unmount(&self.mountpoint);
        }
    }
}

/// Waits for the child to exit without reaping it (`WNOWAIT`: the pid stays
/// ours), marks it reaped under the lock signals take, then reaps it.
fn reap(mut child: std::process::Child, proc: &Proc, tx: &watch::Sender<ExitState>) {
    loop {
        // SAFETY: a zeroed siginfo_t is a valid out-parameter.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: plain syscall on our child's pid.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                proc.pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if r == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            break;
        }
    }
    let mut reaped = proc.reaped.lock().unwrap_or_else(|p| p.into_inner());
    let status = match child.wait() {
        Ok(s) => s.to_string(),
        Err(e) => format!("wait failed: {e}"),
    };
    *reaped = true;
    drop(reaped);
    let _ = tx.send(Some(status));
}

type SpawnRequest = (
    std::process::Command,
    mpsc::Sender<std::io::Result<std::process::Child>>,
);

/// Spawns `command` from a thread that lives as long as the process, so a
/// `PR_SET_PDEATHSIG` set in the child fires when the process dies, not
/// when some runtime thread exits.
fn spawn_from_lasting_thread(
    command: std::process::Command,
) -> std::io::Result<std::process::Child> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("hearth-spawner".into())
            .spawn(move || {
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("starting the spawner thread");
        Mutex::new(tx)
    });
    let (reply, answer) = mpsc::channel();
    spawner
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send((command, reply))
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))?;
    answer
        .recv()
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))?
}

/// Whether something is mounted at `path` (this process's mount namespace).
pub fn is_mounted(path: &Path) -> bool {
    std::fs::read("/proc/self/mountinfo")
        .map(|text| mount_points(&text).iter().any(|m| m == path))
        .unwrap_or(false)
}

/// The mount points of a `/proc/self/mountinfo` text (field 5, with the
/// kernel's octal escapes of space, tab, newline and backslash undone).
pub fn mount_points(text: &[u8]) -> Vec<PathBuf> {
    use std::os::unix::ffi::OsStringExt;
    text.split(|b| *b == b'\n')
        .filter_map(|line| line.split(|b| *b == b' ').nth(4))
        .map(|field| PathBuf::from(OsString::from_vec(unescape(field))))
        .collect()
}

fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        if field[i] == b'\\'
            && i + 3 < field.len()
            && field[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let v = field[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, b| acc * 8 + u32::from(b - b'0'));
            out.push(v as u8);
            i += 4;
        } else {
            out.push(field[i]);
            i += 1;
        }
    }
    out
}

/// Takes away whatever is mounted at `path` (a live export or a dead one),
/// lazily: nothing blocks on a daemon that no longer answers. Nothing
/// mounted is not an error.
pub fn unmount(path: &Path) -> Result<(), DaemonError> {
    if !is_mounted(path) {
        return Ok(());
    }
    let c =
        std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| DaemonError::Unmount {
            path: path.to_path_buf(),
            source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
        })?;
    // SAFETY: a NUL-terminated path that lives across the call.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
        let source = std::io::Error::last_os_error();
        if is_mounted(path) {
            return Err(DaemonError::Unmount {
                path: path.to_path_buf(),
                source,
            });
        }
    }
    Ok(())
}

/// After a crash: kills every `qemu-storage-daemon` whose command line
/// names a path under `dir` (one a killed hearthd could not take along)
/// and unmounts every mount under `dir`. Returns how many of each.
pub fn sweep(dir: &Path) -> (usize, usize) {
    let mut killed = 0;
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for p in procs.flatten() {
            let Ok(pid) = p.file_name().to_string_lossy().parse::<libc::pid_t>() else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(p.path().join("cmdline")) else {
                continue;
            };
            if names_daemon_under(&cmdline, dir) {
                // SAFETY: plain syscall; a pid read from /proc this moment.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                killed += 1;
            }
        }
    }
    let mut unmounted = 0;
    if let Ok(text) = std::fs::read("/proc/self/mountinfo") {
        for m in mount_points(&text) {
            if m.starts_with(dir) && unmount(&m).is_ok() {
                unmounted += 1;
            }
        }
    }
    (killed, unmounted)
}

/// At start-up, for a work directory whose exports no run uses any more:
/// [`sweep`] (twice, when it found anything: a killed daemon closes its
/// files as it dies), then the directory removed. Says what it took away.
pub fn clear_work_dir(dir: &Path, what: &str) {
    if !dir.exists() {
        return;
    }
    let (killed, unmounted) = sweep(dir);
    if killed + unmounted > 0 {
        tracing::info!(killed, unmounted, "took away {what} a crash left behind");
        std::thread::sleep(Duration::from_millis(200));
        let _ = sweep(dir);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Whether a `/proc/PID/cmdline` is a `qemu-storage-daemon` with an
/// argument naming a path under `dir`.
pub fn names_daemon_under(cmdline: &[u8], dir: &Path) -> bool {
    let mut args = cmdline.split(|b| *b == 0);
    let Some(argv0) = args.next() else {
        return false;
    };
    if !argv0.ends_with(b"qemu-storage-daemon") {
        return false;
    }
    let dir = dir.as_os_str().as_bytes();
    args.any(|a| {
        a.windows(dir.len() + 1)
            .any(|w| w.starts_with(dir) && w[dir.len()] == b'/')
    })
}

fn log_tail(log: &Path) -> String {
    let text = std::fs::read(log).unwrap_or_default();
    let start = text.len().saturating_sub(LOG_TAIL);
    String::from_utf8_lossy(&text[start..]).trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_undo_the_kernels_escapes() {
        let text = b"36 25 0:32 / /sys rw - sysfs sysfs rw\n\
47 27 0:41 / /var/lib/a\\040b/c\\134d rw - fuse /dev/fuse rw\n";
        assert_eq!(
            mount_points(text),
            vec![PathBuf::from("/sys"), PathBuf::from("/var/lib/a b/c\\d")]
        );
    }

    #[test]
    fn only_a_storage_daemon_naming_a_path_below_the_directory_is_swept() {
        let dir = Path::new("/state/disk-prepare");
        let ours = b"/usr/bin/qemu-storage-daemon\0--blockdev\0driver=file,node-name=f,filename=/state/layers/1.qcow2\0--export\0type=fuse,mountpoint=/state/disk-prepare/1/disk\0";
        assert!(names_daemon_under(ours, dir));
        let other_dir =
            b"/usr/bin/qemu-storage-daemon\0--export\0mountpoint=/state/disk-prepare-x/1\0";
        assert!(!names_daemon_under(other_dir, dir));
        let not_qsd = b"/usr/bin/sleep\0/state/disk-prepare/1/disk\0";
        assert!(!names_daemon_under(not_qsd, dir));
    }

    #[test]
    fn the_argv_puts_the_image_under_the_qcow2_driver_and_exports_it_writable() {
        let a = args(Path::new("/l/1.qcow2"), Path::new("/p/disk"));
        let a: Vec<String> = a.iter().map(|s| s.to_string_lossy().into_owned()).collect();
        assert_eq!(
            a,
            [
                "--blockdev",
                "driver=file,node-name=f,read-only=off,filename=/l/1.qcow2",
                "--blockdev",
                "driver=qcow2,node-name=q,file=f,read-only=off",
                "--export",
                "type=fuse,id=e,node-name=q,writable=on,mountpoint=/p/disk",
            ]
        );
        let ro = args_with(
            Path::new("/l/1.qcow2"),
            Path::new("/p/disk"),
            Access::ReadOnly,
        );
        let ro: Vec<String> = ro
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            ro[1],
            "driver=file,node-name=f,read-only=on,filename=/l/1.qcow2"
        );
        assert_eq!(ro[3], "driver=qcow2,node-name=q,file=f,read-only=on");
        assert_eq!(
            ro[5],
            "type=fuse,id=e,node-name=q,writable=off,mountpoint=/p/disk"
        );
        assert!(!plain_option_path(Path::new("/a,b")));
        assert!(!plain_option_path(Path::new("rel")));
        assert!(plain_option_path(Path::new("/a b")));
    }
}
