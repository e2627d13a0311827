//! Guest access for people: programs run through the guest agent
//! (`hearth exec`, [`exec`]) and files copied through it (`hearth cp`,
//! [`files`]).
//!
//! The agent channel is shared with the freeze coordinator and the monitor
//! (the chardev takes one client), so nothing here holds it for longer than
//! one request: every call goes through [`Channel::call`], which takes the
//! VM's operations lock and then the agent lock for that one request and
//! lets go of both before the next. The operations lock is the one a
//! snapshot cut holds from its preparation to its thaw, so no exec poll and
//! no file chunk ever lands inside a freeze (where qemu-ga would refuse it
//! after parsing it, lengthening the window), and a cut waits for at most one
//! call, never for a whole copy or a whole program. Decisions and
//! measurements: docs/cli.md ("exec", "cp").

pub mod error;
pub mod exec;
pub mod files;
pub mod sessions;

use std::sync::Arc;
use std::time::Duration;

use hearth_qemu::ProcessIdentity;
use hearth_qemu::agent::{AgentClient, AgentError, ExecOutput, next_exec_poll};
use hearth_qemu::agent_io::{FileChunk, OpenMode};
use tokio::sync::Mutex;
use tokio::time::Instant;

pub use exec::{ExecStarted, ExecStatus};
pub use files::{Download, Upload, UploadDone};

/// Bound for one agent request (a file chunk, a poll, a program start).
/// Under TCG a 48 KiB write takes ~20-50 ms; this is for a loaded host.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a call waits for the channel to come back (agent reconnecting)
/// or for the guest to thaw (frozen by someone else), or for the VM's
/// operations lock (a start, stop or cut in progress).
const PATIENCE: Duration = Duration::from_secs(30);
/// Between two tries of a call that could not be made.
const RETRY: Duration = Duration::from_millis(200);

/// Why a call through the shared channel could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("the VM stopped")]
    Stopped,
    #[error("the guest agent is not connected")]
    NotConnected,
    #[error("the guest's filesystems stayed frozen for {}s", PATIENCE.as_secs())]
    Frozen,
    #[error("the VM was busy (starting, stopping or taking a snapshot) for {}s", PATIENCE.as_secs())]
    Busy,
    #[error("guest agent: {0}")]
    Agent(#[from] AgentError),
}

/// One running VM's agent channel as guest access uses it.
#[derive(Clone)]
pub(crate) struct Channel {
    agent: Arc<Mutex<Option<AgentClient>>>,
    process: ProcessIdentity,
    ops: Arc<Mutex<()>>,
}

impl Channel {
    pub(crate) fn new(
        agent: Arc<Mutex<Option<AgentClient>>>,
        process: ProcessIdentity,
        ops: Arc<Mutex<()>>,
    ) -> Channel {
        Channel {
            agent,
            process,
            ops,
        }
    }

    /// Makes one agent request: takes the operations lock, then the agent
    /// lock, for that request only. A request qemu-ga refused because the
    /// guest is frozen (it did not run it), or one that found the channel
    /// reconnecting, is tried again for up to [`PATIENCE`]; anything else is
    /// returned as it is.
    async fn call(&self, request: Request<'_>) -> Result<Reply, CallError> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if !hearth_qemu::process::is_alive(&self.process) {
                return Err(CallError::Stopped);
            }
            let why = {
                let Ok(_ops) = tokio::time::timeout_at(deadline, self.ops.lock()).await else {
                    return Err(CallError::Busy);
                };
                let Ok(mut guard) = tokio::time::timeout_at(deadline, self.agent.lock()).await
                else {
                    return Err(CallError::Busy);
                };
                match guard.as_mut() {
                    None => CallError::NotConnected,
                    Some(client) => match request.send(client).await {
                        Err(e) if e.is_disabled_while_frozen() => CallError::Frozen,
                        other => return other.map_err(CallError::Agent),
                    },
                }
            };
            if Instant::now() + RETRY >= deadline {
                return Err(why);
            }
            tokio::time::sleep(RETRY).await;
        }
    }

    pub(crate) async fn exec_start(
        &self,
        path: &str,
        args: &[&str],
        input: Option<&[u8]>,
    ) -> Result<i64, CallError> {
        match self.call(Request::ExecStart { path, args, input }).await? {
            Reply::Number(pid) => Ok(pid),
            other => Err(other.unexpected()),
        }
    }

    pub(crate) async fn exec_status(&self, pid: i64) -> Result<Option<ExecOutput>, CallError> {
        match self.call(Request::ExecStatus(pid)).await? {
            Reply::Status(status) => Ok(status),
            other => Err(other.unexpected()),
        }
    }

    pub(crate) async fn file_open(&self, path: &str, mode: OpenMode) -> Result<i64, CallError> {
        match self.call(Request::FileOpen(path, mode)).await? {
            Reply::Number(handle) => Ok(handle),
            other => Err(other.unexpected()),
        }
    }

    pub(crate) async fn file_read(
        &self,
        handle: i64,
        count: usize,
    ) -> Result<FileChunk, CallError> {
        match self.call(Request::FileRead(handle, count)).await? {
            Reply::Chunk(chunk) => Ok(chunk),
            other => Err(other.unexpected()),
        }
    }

    pub(crate) async fn file_write(&self, handle: i64, data: &[u8]) -> Result<usize, CallError> {
        match self.call(Request::FileWrite(handle, data)).await? {
            Reply::Number(n) => usize::try_from(n).map_err(|_| Reply::Number(n).unexpected()),
            other => Err(other.unexpected()),
        }
    }

    pub(crate) async fn file_close(&self, handle: i64) -> Result<(), CallError> {
        match self.call(Request::FileClose(handle)).await? {
            Reply::Done => Ok(()),
            other => Err(other.unexpected()),
        }
    }

    /// Runs a short helper program (`stat`, `sh -c` for a rename) and waits
    /// for it, one request per poll. For hearth's own steps, not for users'
    /// programs (those are [`exec`] sessions).
    pub(crate) async fn run(
        &self,
        path: &str,
        args: &[&str],
        timeout: Duration,
    ) -> Result<ExecOutput, CallError> {
        let deadline = Instant::now() + timeout;
        let pid = self.exec_start(path, args, None).await?;
        let mut interval = hearth_qemu::agent::EXEC_POLL_FIRST;
        loop {
            tokio::time::sleep(interval).await;
            interval = next_exec_poll(interval);
            if let Some(out) = self.exec_status(pid).await? {
                return Ok(out);
            }
            if Instant::now() >= deadline {
                return Err(CallError::Agent(hearth_qemu::agent::exec_timeout(
                    path, timeout,
                )));
            }
        }
    }
}

/// The agent requests guest access makes: a closed set, each one request
/// and one reply.
enum Request<'a> {
    ExecStart {
        path: &'a str,
        args: &'a [&'a str],
        input: Option<&'a [u8]>,
    },
    ExecStatus(i64),
    FileOpen(&'a str, OpenMode),
    FileRead(i64, usize),
    FileWrite(i64, &'a [u8]),
    FileClose(i64),
}

enum Reply {
    Number(i64),
    Status(Option<ExecOutput>),
    Chunk(FileChunk),
    Done,
}

impl Request<'_> {
    async fn send(&self, c: &mut AgentClient) -> Result<Reply, AgentError> {
        let t = CALL_TIMEOUT;
        Ok(match *self {
            Request::ExecStart { path, args, input } => {
                Reply::Number(c.exec_start_input(path, args, input, t).await?)
            }
            Request::ExecStatus(pid) => Reply::Status(c.exec_status(pid, t).await?),
            Request::FileOpen(path, mode) => Reply::Number(c.file_open(path, mode, t).await?),
            Request::FileRead(h, count) => Reply::Chunk(c.file_read(h, count, t).await?),
            Request::FileWrite(h, data) => {
                // file_write bounds the count by data.len(), which fits i64.
                Reply::Number(c.file_write(h, data, t).await? as i64)
            }
            Request::FileClose(h) => {
                c.file_close(h, t).await?;
                Reply::Done
            }
        })
    }
}

impl Reply {
    /// A reply of the wrong variant: cannot happen (each request has one
    /// reply variant), but is an error, not a panic.
    fn unexpected(self) -> CallError {
        CallError::Agent(AgentError::Protocol(
            "internal: a guest access reply of the wrong kind".into(),
        ))
    }
}

/// A name nobody can guess or repeat, for temporary files: a per-process
/// random key (std's `RandomState` is seeded from the OS) hashed with a
/// counter.
pub(crate) fn unique_token() -> u64 {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    std::collections::hash_map::RandomState::new().hash_one(n)
}

/// Checks a path in the guest given by a user: absolute, no NUL (qemu-ga
/// takes C strings), and naming something below `/`.
pub(crate) fn check_guest_path(path: &str) -> Result<(), GuestPathError> {
    let path_owned = || path.to_string();
    if !path.starts_with('/') {
        return Err(GuestPathError::NotAbsolute { path: path_owned() });
    }
    if path.contains('\0') {
        return Err(GuestPathError::Nul { path: path_owned() });
    }
    if path.trim_end_matches('/').is_empty() || path.ends_with('/') {
        return Err(GuestPathError::Directory { path: path_owned() });
    }
    Ok(())
}

/// A path in the guest, given by a user, that is refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum GuestPathError {
    #[error("guest path {path:?} is not absolute (it must start with /)")]
    NotAbsolute { path: String },
    #[error("guest path {path:?} contains a NUL byte")]
    Nul { path: String },
    #[error(
        "guest path {path:?} names a directory; name the file (e.g. {}/NAME)",
        path.trim_end_matches('/')
    )]
    Directory { path: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_paths_must_be_absolute_files() {
        assert!(check_guest_path("/tmp/x").is_ok());
        assert!(check_guest_path("/x").is_ok());
        for bad in ["tmp/x", "", "/", "//", "/tmp/", "/tmp/x\0y"] {
            let err = check_guest_path(bad).expect_err(bad).to_string();
            assert!(err.contains("guest path"), "{err}");
        }
        assert!(
            check_guest_path("/tmp/")
                .expect_err("dir")
                .to_string()
                .contains("/tmp/NAME")
        );
    }

    #[test]
    fn tokens_do_not_repeat() {
        let set: std::collections::HashSet<u64> = (0..1000).map(|_| unique_token()).collect();
        assert_eq!(set.len(), 1000);
    }
}
