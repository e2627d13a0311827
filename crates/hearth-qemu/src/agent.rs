//! Async client for the QEMU guest agent (qemu-ga) over its virtio-serial chardev.
//!
//! The agent protocol has no greeting and no ids in replies: a reply is simply the
//! next JSON line. Whatever was sent or buffered before we connected, or before a
//! call of ours timed out, is still in the pipe, so pairing "next line" with "my
//! command" is only valid after a resync:
//!
//! 1. send `0xFF` (qemu-ga resets its parser on it) and
//!    `guest-sync-delimited {"id": N}` with a fresh random N;
//! 2. discard every byte up to the `0xFF` sentinel qemu-ga writes right before the
//!    reply to that command, then read a line;
//! 3. accept it only if it is `{"return": N}` for this N; anything else (a late
//!    reply to an older sync, garbage) means "keep discarding until the next
//!    sentinel".
//!
//! qemu-ga handles requests strictly in order, so once our N comes back every older
//! reply has already been consumed and discarded. The channel is marked unsynced
//! before each command is written and synced again only when its reply has been
//! read, so a timeout, an error or a caller abandoning the future all force the
//! next call to resync first.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::time::Instant;

use crate::fsmap::{FsInfo, parse_fsinfo};
use crate::lines::{BoundedReader, QapiReply, ReadError, classify_reply, truncate};

/// Default bound for one reply line; `guest-exec-status` carries captured output
/// base64-encoded inside one line.
pub const DEFAULT_MAX_REPLY: usize = 16 * 1024 * 1024;
/// The first wait between `guest-exec-status` polls; see [`next_exec_poll`].
pub const EXEC_POLL_FIRST: Duration = Duration::from_millis(50);
/// The longest wait between `guest-exec-status` polls.
pub const EXEC_POLL_MAX: Duration = Duration::from_millis(250);
/// qemu-ga's resync sentinel and parser-reset byte.
const SENTINEL: u8 = 0xFF;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot connect to guest agent socket {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("guest agent did not answer {command} within {timeout:?}")]
    Timeout { command: String, timeout: Duration },
    #[error("guest agent connection closed")]
    Disconnected,
    #[error("guest agent sent a reply longer than {limit} bytes")]
    ReplyTooLarge { limit: usize },
    #[error("guest agent protocol violation: {0}")]
    Protocol(String),
    #[error("guest agent command {command} failed: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("guest agent I/O error")]
    Io(#[source] std::io::Error),
}

impl AgentError {
    /// True when the agent refused a command because filesystems are frozen.
    ///
    /// qemu-ga 7.2 says "...has been disabled: the agent is in frozen state", 10.0
    /// "...has been disabled: the command is not allowed". 10.0 uses the same words
    /// for commands an operator blocked with `--block-rpcs`, so treat this as a hint
    /// and confirm with `guest-fsfreeze-status`, which is never blocked.
    pub fn is_disabled_while_frozen(&self) -> bool {
        match self {
            AgentError::Command { class, desc, .. } => {
                let desc = desc.to_ascii_lowercase();
                class == "CommandNotFound"
                    && (desc.contains("disabled")
                        || desc.contains("not allowed")
                        || desc.contains("frozen"))
            }
            _ => false,
        }
    }

    /// True for failures after which the channel state is unknown and the next call
    /// resyncs (as opposed to a clean error reply from the agent).
    pub fn is_transport(&self) -> bool {
        !matches!(
            self,
            AgentError::Command { .. } | AgentError::InvalidArgument(_)
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreezeStatus {
    Thawed,
    Frozen,
}

/// Result of a finished `guest-exec`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// `None` if the process was killed by a signal.
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// qemu-ga caps captured output (16 MiB in current versions) and says so.
    pub truncated: bool,
}

#[derive(Debug, Clone)]
pub struct AgentOptions {
    pub max_reply: usize,
}

impl Default for AgentOptions {
    fn default() -> Self {
        AgentOptions {
            max_reply: DEFAULT_MAX_REPLY,
        }
    }
}

/// One connection to a guest agent. Methods take `&mut self`: the protocol is
/// strictly one request at a time, so the type enforces it.
pub struct AgentClient {
    reader: BoundedReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    synced: bool,
    options: AgentOptions,
}

impl std::fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentClient")
            .field("synced", &self.synced)
            .finish()
    }
}

/// A sync id nobody can predict or repeat: a per-process random key (std's
/// `RandomState` is seeded from the OS) hashed with a counter. Kept below 2^53 so
/// it survives any JSON number handling on the way.
fn fresh_sync_id() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    RandomState::new().hash_one(n) & ((1 << 53) - 1)
}

impl AgentClient {
    /// Connects to the chardev socket. No I/O happens yet; the first call resyncs.
    ///
    /// QEMU serves one client per chardev: a second connection is accepted by the
    /// kernel but never gets data, so its first call times out.
    pub async fn connect(path: &Path) -> Result<AgentClient, AgentError> {
        Self::connect_with(path, AgentOptions::default()).await
    }

    pub async fn connect_with(
        path: &Path,
        options: AgentOptions,
    ) -> Result<AgentClient, AgentError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| AgentError::Connect {
                path: path.to_owned(),
                source,
            })?;
        let (read, writer) = stream.into_split();
        Ok(AgentClient {
            reader: BoundedReader::new(read),
            writer,
            synced: false,
            options,
        })
    }

    /// Whether the next call can skip the resync.
    pub fn is_synced(&self) -> bool {
        self.synced
    }

    /// Resynchronises the channel (see the module docs).
    pub async fn sync(&mut self, timeout: Duration) -> Result<(), AgentError> {
        let deadline = Instant::now() + timeout;
        self.sync_until(deadline, timeout).await
    }

    async fn sync_until(&mut self, deadline: Instant, timeout: Duration) -> Result<(), AgentError> {
        self.synced = false;
        let id = fresh_sync_id();
        let mut msg = vec![SENTINEL];
        msg.extend_from_slice(
            json!({"execute": "guest-sync-delimited", "arguments": {"id": id}})
                .to_string()
                .as_bytes(),
        );
        msg.push(b'\n');
        let exchange = async {
            self.writer.write_all(&msg).await.map_err(write_error)?;
            self.reader.skip_past(SENTINEL).await.map_err(read_error)?;
            loop {
                // Positioned right after a sentinel: the next line is a candidate.
                let (line, delim) = match self
                    .reader
                    .read_until_any(&[b'\n', SENTINEL], self.options.max_reply)
                    .await
                {
                    Ok(found) => found,
                    Err(ReadError::TooLarge) => {
                        // Not our small reply; look for the next sentinel.
                        self.reader.skip_past(SENTINEL).await.map_err(read_error)?;
                        continue;
                    }
                    Err(e) => return Err(read_error(e)),
                };
                if delim == SENTINEL {
                    // A later sentinel supersedes the earlier one.
                    continue;
                }
                match serde_json::from_slice::<Value>(&line) {
                    Ok(v) if v.get("return").and_then(Value::as_u64) == Some(id) => {
                        return Ok(());
                    }
                    Ok(v) => tracing::debug!(reply = %truncate(&v.to_string()), expected = id,
                        "discarding stale agent reply"),
                    Err(_) => tracing::debug!("discarding non-JSON agent output during resync"),
                }
                self.reader.skip_past(SENTINEL).await.map_err(read_error)?;
            }
        };
        match tokio::time::timeout_at(deadline, exchange).await {
            Ok(Ok(())) => {
                self.synced = true;
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(AgentError::Timeout {
                command: "guest-sync-delimited".into(),
                timeout,
            }),
        }
    }

    /// Runs one command and returns its `return` value. Resyncs first if the
    /// channel state is unknown; `timeout` covers the resync too.
    pub async fn execute(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        timeout: Duration,
    ) -> Result<Value, AgentError> {
        let deadline = Instant::now() + timeout;
        self.send_command(command, arguments, deadline, timeout)
            .await?;
        let reply = self.read_reply(command, deadline, timeout).await?;
        parse_reply(command, reply)
    }

    /// Writes `command`, resyncing first if needed. Leaves the channel unsynced: it
    /// becomes synced again only once the reply has been read.
    async fn send_command(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<(), AgentError> {
        if self.synced && self.unsolicited_output()? {
            // Something arrived that nobody asked for; its origin is unknown, so the
            // next line cannot be trusted to be our reply.
            tracing::debug!("unsolicited guest agent output; resyncing");
            self.synced = false;
        }
        if !self.synced {
            self.sync_until(deadline, timeout).await?;
        }
        self.reader.clear();
        let mut msg = json!({"execute": command});
        if let Some(arguments) = arguments {
            msg["arguments"] = arguments;
        }
        let mut line = msg.to_string().into_bytes();
        line.push(b'\n');
        self.synced = false;
        match tokio::time::timeout_at(deadline, self.writer.write_all(&line)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(write_error(e)),
            Err(_) => Err(AgentError::Timeout {
                command: command.to_owned(),
                timeout,
            }),
        }
    }

    /// Whether bytes are waiting that no request of ours asked for. Only looks at
    /// what is buffered or already in the socket; it does not wait.
    fn unsolicited_output(&mut self) -> Result<bool, AgentError> {
        let mut found = self.reader.has_unread_data();
        let mut scratch = [0u8; 4096];
        loop {
            match self.reader.get_ref().try_read(&mut scratch) {
                Ok(0) => return Err(AgentError::Disconnected),
                Ok(n) => {
                    if scratch[..n].iter().any(|b| !b.is_ascii_whitespace()) {
                        found = true;
                        // The resync discards the rest; no need to drain it all here.
                        return Ok(found);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(found),
                Err(e) => return Err(AgentError::Io(e)),
            }
        }
    }

    /// Reads the next reply line; marks the channel synced again if it is one.
    async fn read_reply(
        &mut self,
        command: &str,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Value, AgentError> {
        let max = self.options.max_reply;
        let read = async {
            loop {
                let line = self.reader.read_line(max).await.map_err(|e| match e {
                    ReadError::TooLarge => AgentError::ReplyTooLarge { limit: max },
                    other => read_error(other),
                })?;
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return serde_json::from_slice::<Value>(&line).map_err(|e| {
                    AgentError::Protocol(format!("reply to {command} is not JSON: {e}"))
                });
            }
        };
        let reply = match tokio::time::timeout_at(deadline, read).await {
            Ok(result) => result?,
            Err(_) => {
                return Err(AgentError::Timeout {
                    command: command.to_owned(),
                    timeout,
                });
            }
        };
        if reply.get("return").is_some() || reply.get("error").is_some() {
            self.synced = true;
        }
        Ok(reply)
    }

    pub async fn ping(&mut self, timeout: Duration) -> Result<(), AgentError> {
        self.execute("guest-ping", None, timeout).await.map(|_| ())
    }

    pub async fn info(&mut self, timeout: Duration) -> Result<Value, AgentError> {
        self.execute("guest-info", None, timeout).await
    }

    /// Freezes all guest filesystems; returns how many were frozen.
    pub async fn fsfreeze_freeze(&mut self, timeout: Duration) -> Result<u32, AgentError> {
        let v = self.execute("guest-fsfreeze-freeze", None, timeout).await?;
        count("guest-fsfreeze-freeze", &v)
    }

    /// Freezes only the filesystems mounted at `mountpoints`
    /// (`guest-fsfreeze-freeze-list`); returns how many were frozen. qemu-ga
    /// counts a filesystem mounted twice (a bind mount) once, and one that
    /// cannot be frozen (vfat) not at all, so the count may be below the
    /// list's length. An empty list is refused here: qemu-ga would enter its
    /// frozen state with nothing frozen.
    pub async fn fsfreeze_freeze_list(
        &mut self,
        mountpoints: &[String],
        timeout: Duration,
    ) -> Result<u32, AgentError> {
        if mountpoints.is_empty() {
            return Err(AgentError::InvalidArgument(
                "guest-fsfreeze-freeze-list needs at least one mount point".into(),
            ));
        }
        let v = self
            .execute(
                "guest-fsfreeze-freeze-list",
                Some(json!({ "mountpoints": mountpoints })),
                timeout,
            )
            .await?;
        count("guest-fsfreeze-freeze-list", &v)
    }

    pub async fn fsfreeze_status(&mut self, timeout: Duration) -> Result<FreezeStatus, AgentError> {
        let v = self.execute("guest-fsfreeze-status", None, timeout).await?;
        match v.as_str() {
            Some("thawed") => Ok(FreezeStatus::Thawed),
            Some("frozen") => Ok(FreezeStatus::Frozen),
            _ => Err(AgentError::Protocol(format!(
                "guest-fsfreeze-status returned {}",
                truncate(&v.to_string())
            ))),
        }
    }

    /// Thaws all guest filesystems; returns how many were thawed (0 if none were frozen).
    pub async fn fsfreeze_thaw(&mut self, timeout: Duration) -> Result<u32, AgentError> {
        let v = self.execute("guest-fsfreeze-thaw", None, timeout).await?;
        count("guest-fsfreeze-thaw", &v)
    }

    /// The guest's mounted filesystems and the disks under each
    /// (`guest-get-fsinfo`), parsed and bounded by [`crate::fsmap::parse_fsinfo`].
    /// A reply of the wrong shape is a `Protocol` error; the channel stays in
    /// sync (the reply was read whole).
    pub async fn get_fsinfo(&mut self, timeout: Duration) -> Result<Vec<FsInfo>, AgentError> {
        let v = self.execute("guest-get-fsinfo", None, timeout).await?;
        parse_fsinfo(&v).map_err(|e| AgentError::Protocol(format!("guest-get-fsinfo: {e}")))
    }

    /// Asks the guest to shut down (`mode`: "powerdown", "halt" or "reboot").
    ///
    /// qemu-ga sends no reply when the request succeeds (the guest goes away), so a
    /// timeout or EOF after sending counts as success; only an error reply fails
    /// (qemu-ga's shutdown command exited non-zero: in a systemd guest, typically
    /// because systemd-logind does not run yet). Silence means success only from
    /// an agent that is known to read: the channel is always resynchronised first,
    /// even when it is in sync, so an agent that died since its last answer fails
    /// here instead of being taken to shut the guest down. The channel is left
    /// unsynced either way.
    pub async fn shutdown(&mut self, mode: &str, timeout: Duration) -> Result<(), AgentError> {
        if !matches!(mode, "powerdown" | "halt" | "reboot") {
            return Err(AgentError::InvalidArgument(format!(
                "shutdown mode {mode:?} (expected powerdown, halt or reboot)"
            )));
        }
        let command = "guest-shutdown";
        let deadline = Instant::now() + timeout;
        self.synced = false;
        self.send_command(command, Some(json!({"mode": mode})), deadline, timeout)
            .await?;
        let outcome = self.read_reply(command, deadline, timeout).await;
        self.synced = false;
        match outcome {
            Ok(reply) => parse_reply(command, reply).map(|_| ()),
            Err(AgentError::Timeout { .. } | AgentError::Disconnected) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Starts `path args...` in the guest with its output captured and returns
    /// the guest pid to poll with [`exec_status`](Self::exec_status). Returns as
    /// soon as qemu-ga has started the program: the channel is free meanwhile.
    pub async fn exec_start(
        &mut self,
        path: &str,
        args: &[&str],
        timeout: Duration,
    ) -> Result<i64, AgentError> {
        let started = self
            .execute(
                "guest-exec",
                Some(json!({"path": path, "arg": args, "capture-output": true})),
                timeout,
            )
            .await?;
        started
            .get("pid")
            .and_then(Value::as_i64)
            .ok_or_else(|| AgentError::Protocol("guest-exec reply has no pid".into()))
    }

    /// One `guest-exec-status` for a program [`exec_start`](Self::exec_start)
    /// started: `None` while it runs, its output once it has exited. qemu-ga
    /// forgets the program once it has reported the exit, so the output comes
    /// back exactly once.
    pub async fn exec_status(
        &mut self,
        pid: i64,
        timeout: Duration,
    ) -> Result<Option<ExecOutput>, AgentError> {
        let status = self
            .execute("guest-exec-status", Some(json!({"pid": pid})), timeout)
            .await?;
        if status.get("exited").and_then(Value::as_bool) == Some(true) {
            parse_exec_status(&status).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Runs `path args...` in the guest, waits for it and returns its output.
    /// `timeout` covers the whole run; on timeout the guest process keeps running
    /// (qemu-ga has no way to kill it). This holds `&mut self` for the whole run;
    /// a caller that shares the channel polls with
    /// [`exec_start`](Self::exec_start) and [`exec_status`](Self::exec_status)
    /// instead, letting go of it between polls.
    pub async fn exec(
        &mut self,
        path: &str,
        args: &[&str],
        timeout: Duration,
    ) -> Result<ExecOutput, AgentError> {
        let deadline = Instant::now() + timeout;
        let remaining = |now: Instant| deadline.saturating_duration_since(now);
        let pid = self.exec_start(path, args, timeout).await?;
        let mut interval = EXEC_POLL_FIRST;
        loop {
            let left = remaining(Instant::now());
            if left.is_zero() {
                return Err(exec_timeout(path, timeout));
            }
            if let Some(out) = self.exec_status(pid, left).await? {
                return Ok(out);
            }
            let left = remaining(Instant::now());
            tokio::time::sleep(interval.min(left)).await;
            interval = next_exec_poll(interval);
        }
    }
}

/// The error for a guest program that did not finish within `timeout`.
pub fn exec_timeout(path: &str, timeout: Duration) -> AgentError {
    AgentError::Timeout {
        command: format!("guest-exec {path}"),
        timeout,
    }
}

/// The wait before the next `guest-exec-status`: starts at 50 ms and grows by
/// half each poll up to 250 ms, so short programs answer fast and long ones do
/// not flood the channel.
pub fn next_exec_poll(interval: Duration) -> Duration {
    (interval + interval / 2).clamp(EXEC_POLL_FIRST, EXEC_POLL_MAX)
}

fn parse_exec_status(status: &Value) -> Result<ExecOutput, AgentError> {
    let decode = |key: &str| -> Result<Vec<u8>, AgentError> {
        match status.get(key).and_then(Value::as_str) {
            None => Ok(Vec::new()),
            Some(text) => base64::engine::general_purpose::STANDARD
                .decode(text)
                .map_err(|e| AgentError::Protocol(format!("guest-exec-status {key}: {e}"))),
        }
    };
    let small_int = |key: &str| {
        status
            .get(key)
            .and_then(Value::as_i64)
            .and_then(|v| i32::try_from(v).ok())
    };
    let flag = |key: &str| status.get(key).and_then(Value::as_bool) == Some(true);
    Ok(ExecOutput {
        exit_code: small_int("exitcode"),
        signal: small_int("signal"),
        stdout: decode("out-data")?,
        stderr: decode("err-data")?,
        truncated: flag("out-truncated") || flag("err-truncated"),
    })
}

fn count(command: &str, v: &Value) -> Result<u32, AgentError> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| {
            AgentError::Protocol(format!(
                "{command} returned {} instead of a count",
                truncate(&v.to_string())
            ))
        })
}

fn parse_reply(command: &str, reply: Value) -> Result<Value, AgentError> {
    match classify_reply(reply) {
        QapiReply::Return(v) => Ok(v),
        QapiReply::Error { class, desc } => Err(AgentError::Command {
            command: command.to_owned(),
            class,
            desc,
        }),
        QapiReply::Malformed(text) => Err(AgentError::Protocol(format!(
            "reply to {command} has neither return nor error: {text}"
        ))),
    }
}

fn read_error(e: ReadError) -> AgentError {
    match e {
        ReadError::Eof => AgentError::Disconnected,
        // Callers that care about the bound map TooLarge themselves.
        ReadError::TooLarge => AgentError::Protocol("oversized output".into()),
        ReadError::Io(e) => AgentError::Io(e),
    }
}

fn write_error(e: std::io::Error) -> AgentError {
    match e.kind() {
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => {
            AgentError::Disconnected
        }
        _ => AgentError::Io(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
    use tokio::net::UnixListener;

    const T: Duration = Duration::from_secs(5);

    /// The guest side of the channel, scripted by each test.
    struct FakeAgent {
        read: BufReader<OwnedReadHalf>,
        write: OwnedWriteHalf,
    }

    impl FakeAgent {
        /// Expects the 0xFF + guest-sync-delimited pair and returns the id.
        async fn recv_sync(&mut self) -> u64 {
            let mut ff = [0u8; 1];
            self.read.read_exact(&mut ff).await.expect("read sentinel");
            assert_eq!(ff[0], SENTINEL, "a resync starts with 0xFF");
            let cmd = self.recv().await;
            assert_eq!(cmd["execute"], "guest-sync-delimited", "{cmd}");
            cmd["arguments"]["id"].as_u64().expect("numeric id")
        }
        async fn recv(&mut self) -> Value {
            let mut line = String::new();
            let n = self.read.read_line(&mut line).await.expect("read");
            assert!(n > 0, "client closed");
            serde_json::from_str(&line).expect("client sends JSON lines")
        }
        async fn send(&mut self, bytes: &[u8]) {
            self.write.write_all(bytes).await.expect("write");
        }
        async fn sync_reply(&mut self, id: u64) {
            let mut msg = vec![SENTINEL];
            msg.extend_from_slice(format!("{{\"return\": {id}}}\n").as_bytes());
            self.send(&msg).await;
        }
        /// Accepts a resync and answers it properly.
        async fn handle_sync(&mut self) {
            let id = self.recv_sync().await;
            self.sync_reply(id).await;
        }
        async fn reply(&mut self, ret: Value) {
            self.send(format!("{}\n", json!({ "return": ret })).as_bytes())
                .await;
        }
        async fn error(&mut self, class: &str, desc: &str) {
            let msg = json!({"error": {"class": class, "desc": desc}});
            self.send(format!("{msg}\n").as_bytes()).await;
        }
    }

    async fn setup_with(options: AgentOptions) -> (tempfile::TempDir, AgentClient, FakeAgent) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qga.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let client = AgentClient::connect_with(&path, options)
            .await
            .expect("connect");
        let (stream, _) = listener.accept().await.expect("accept");
        let (read, write) = stream.into_split();
        let fake = FakeAgent {
            read: BufReader::new(read),
            write,
        };
        (dir, client, fake)
    }

    async fn setup() -> (tempfile::TempDir, AgentClient, FakeAgent) {
        setup_with(AgentOptions::default()).await
    }

    #[tokio::test]
    async fn first_call_resyncs_and_discards_stale_output_parse_error_and_old_ids() {
        let (_dir, mut client, mut fake) = setup().await;
        // Left in the pipe from a previous connection: a reply nobody will read.
        fake.send(b"{\"return\": \"frozen\"}\n").await;
        let guest = tokio::spawn(async move {
            let id = fake.recv_sync().await;
            // What real qemu-ga says about the 0xFF byte, then an older sync's reply,
            // a sentinel followed by junk, and only then ours.
            fake.send(
                b"{\"error\": {\"class\": \"GenericError\", \"desc\": \"JSON parse error, stray '\\ufffd'\"}}\n",
            )
            .await;
            fake.send(b"\xff{\"return\": 12345}\n").await;
            fake.send(b"\xffnot json at all\n").await;
            fake.send(b"\xff{\"ret").await;
            // None of that may be taken as our sync reply: the client must still
            // be waiting, not sending its command.
            let early = tokio::time::timeout(Duration::from_millis(200), fake.recv()).await;
            assert!(
                early.is_err(),
                "client acted before its own sync reply: {early:?}"
            );
            fake.sync_reply(id).await;
            let cmd = fake.recv().await;
            assert_eq!(cmd["execute"], "guest-fsfreeze-status");
            fake.reply(json!("thawed")).await;
            fake
        });
        assert!(!client.is_synced());
        let status = client.fsfreeze_status(T).await.expect("status");
        assert_eq!(status, FreezeStatus::Thawed, "stale 'frozen' was not taken");
        assert!(client.is_synced());
        guest.await.expect("fake agent");
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_reply_after_a_timeout_is_never_taken_for_the_next_command() {
        let (_dir, mut client, mut fake) = setup().await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            let first = fake.recv().await;
            assert_eq!(first["execute"], "guest-fsfreeze-status");
            // Too slow: the client gives up after 1 s.
            tokio::time::sleep(Duration::from_secs(2)).await;
            fake.reply(json!("frozen")).await;
            // The next call must start with a resync, not the command.
            let id = fake.recv_sync().await;
            fake.sync_reply(id).await;
            let second = fake.recv().await;
            assert_eq!(second["execute"], "guest-fsfreeze-status");
            fake.reply(json!("thawed")).await;
            fake
        });
        let err = client
            .fsfreeze_status(Duration::from_secs(1))
            .await
            .expect_err("no reply in time");
        assert!(
            matches!(&err, AgentError::Timeout { command, .. } if command == "guest-fsfreeze-status"),
            "{err}"
        );
        assert!(!client.is_synced());
        tokio::time::sleep(Duration::from_secs(3)).await;
        let status = client.fsfreeze_status(T).await.expect("second call");
        assert_eq!(status, FreezeStatus::Thawed);
        guest.await.expect("fake agent");
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_agent_times_out_the_resync() {
        let (_dir, mut client, mut fake) = setup().await;
        let guest = tokio::spawn(async move {
            let _ = fake.recv_sync().await;
            tokio::time::sleep(Duration::from_secs(3600)).await;
            fake
        });
        let err = client
            .ping(Duration::from_secs(2))
            .await
            .expect_err("silent");
        assert!(
            matches!(&err, AgentError::Timeout { command, .. } if command == "guest-sync-delimited"),
            "{err}"
        );
        guest.abort();
    }

    #[tokio::test]
    async fn a_command_error_keeps_the_channel_in_sync() {
        let (_dir, mut client, mut fake) = setup().await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            assert_eq!(fake.recv().await["execute"], "guest-fsfreeze-freeze");
            fake.error(
                "CommandNotFound",
                "Command guest-fsfreeze-freeze has been disabled: the command is not allowed",
            )
            .await;
            // No resync expected: the error reply was the reply.
            assert_eq!(fake.recv().await["execute"], "guest-ping");
            fake.reply(json!({})).await;
            fake
        });
        let err = client.fsfreeze_freeze(T).await.expect_err("frozen");
        assert!(err.is_disabled_while_frozen(), "{err}");
        assert!(!err.is_transport());
        assert!(client.is_synced());
        client.ping(T).await.expect("ping still works while frozen");
        guest.await.expect("fake agent");
    }

    #[test]
    fn disabled_while_frozen_is_recognised_for_both_qemu_ga_versions_only() {
        let err = |class: &str, desc: &str| AgentError::Command {
            command: "guest-exec".into(),
            class: class.into(),
            desc: desc.into(),
        };
        assert!(
            err(
                "CommandNotFound",
                "Command guest-exec has been disabled: the agent is in frozen state"
            )
            .is_disabled_while_frozen()
        );
        assert!(
            err(
                "CommandNotFound",
                "Command guest-exec has been disabled: the command is not allowed"
            )
            .is_disabled_while_frozen()
        );
        assert!(
            !err(
                "CommandNotFound",
                "The command guest-foo has not been found"
            )
            .is_disabled_while_frozen()
        );
        assert!(!err("GenericError", "disabled").is_disabled_while_frozen());
        assert!(!AgentError::Disconnected.is_disabled_while_frozen());
    }

    #[tokio::test]
    async fn freeze_and_thaw_return_filesystem_counts() {
        let (_dir, mut client, mut fake) = setup().await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            assert_eq!(fake.recv().await["execute"], "guest-fsfreeze-freeze");
            fake.reply(json!(2)).await;
            assert_eq!(fake.recv().await["execute"], "guest-fsfreeze-status");
            fake.reply(json!("frozen")).await;
            assert_eq!(fake.recv().await["execute"], "guest-fsfreeze-thaw");
            fake.reply(json!(2)).await;
            assert_eq!(fake.recv().await["execute"], "guest-fsfreeze-thaw");
            fake.reply(json!(-1)).await;
            fake
        });
        assert_eq!(client.fsfreeze_freeze(T).await.expect("freeze"), 2);
        assert_eq!(
            client.fsfreeze_status(T).await.expect("status"),
            FreezeStatus::Frozen
        );
        assert_eq!(client.fsfreeze_thaw(T).await.expect("thaw"), 2);
        let err = client.fsfreeze_thaw(T).await.expect_err("negative count");
        assert!(matches!(err, AgentError::Protocol(_)), "{err}");
        guest.await.expect("fake agent");
    }

    #[tokio::test]
    async fn freeze_list_sends_the_mount_points_and_refuses_an_empty_list() {
        let (_dir, mut client, mut fake) = setup().await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            let cmd = fake.recv().await;
            assert_eq!(cmd["execute"], "guest-fsfreeze-freeze-list");
            assert_eq!(
                cmd["arguments"]["mountpoints"],
                json!(["/mnt/vdb", "/mnt/vdc"])
            );
            fake.reply(json!(2)).await;
            fake
        });
        let list = vec!["/mnt/vdb".to_string(), "/mnt/vdc".to_string()];
        assert_eq!(
            client.fsfreeze_freeze_list(&list, T).await.expect("freeze"),
            2
        );
        let err = client
            .fsfreeze_freeze_list(&[], T)
            .await
            .expect_err("empty list");
        assert!(matches!(err, AgentError::InvalidArgument(_)), "{err}");
        guest.await.expect("fake agent");
    }

    #[tokio::test]
    async fn a_reply_over_the_bound_fails_and_the_next_call_resyncs() {
        let (_dir, mut client, mut fake) = setup_with(AgentOptions { max_reply: 1024 }).await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            assert_eq!(fake.recv().await["execute"], "guest-info");
            let huge = json!({"return": {"version": "x".repeat(100_000)}});
            fake.send(format!("{huge}\n").as_bytes()).await;
            fake.handle_sync().await;
            assert_eq!(fake.recv().await["execute"], "guest-info");
            fake.reply(json!({"version": "10.0.2"})).await;
            fake
        });
        let err = client.info(T).await.expect_err("too large");
        assert!(
            matches!(err, AgentError::ReplyTooLarge { limit: 1024 }),
            "{err}"
        );
        assert!(!client.is_synced());
        let info = client.info(T).await.expect("after resync");
        assert_eq!(info["version"], "10.0.2");
        guest.await.expect("fake agent");
    }

    #[tokio::test]
    async fn eof_is_disconnected() {
        let (_dir, mut client, mut fake) = setup().await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            let _ = fake.recv().await;
            drop(fake);
        });
        let err = client.ping(T).await.expect_err("eof");
        assert!(matches!(err, AgentError::Disconnected), "{err}");
        guest.await.expect("fake agent");
    }

    #[tokio::test]
    async fn unsolicited_output_while_synced_forces_a_resync() {
        let (_dir, mut client, mut fake) = setup().await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            assert_eq!(fake.recv().await["execute"], "guest-ping");
            fake.reply(json!({})).await;
            // A reply nobody asked for.
            fake.reply(json!("frozen")).await;
            fake
        });
        client.ping(T).await.expect("ping");
        let mut fake = guest.await.expect("fake agent");
        // Let the unsolicited line reach the client's socket buffer.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            assert_eq!(fake.recv().await["execute"], "guest-fsfreeze-status");
            fake.reply(json!("thawed")).await;
            fake
        });
        assert_eq!(
            client.fsfreeze_status(T).await.expect("status"),
            FreezeStatus::Thawed
        );
        guest.await.expect("fake agent");
    }

    #[tokio::test(start_paused = true)]
    async fn exec_polls_until_exit_and_decodes_output() {
        let (_dir, mut client, mut fake) = setup().await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            let start = fake.recv().await;
            assert_eq!(start["execute"], "guest-exec");
            assert_eq!(start["arguments"]["path"], "/bin/sh");
            assert_eq!(
                start["arguments"]["arg"],
                json!(["-c", "echo hi; echo oops >&2"])
            );
            assert_eq!(start["arguments"]["capture-output"], true);
            fake.reply(json!({"pid": 77})).await;
            let poll = fake.recv().await;
            assert_eq!(poll["arguments"]["pid"], 77);
            fake.reply(json!({"exited": false})).await;
            let _ = fake.recv().await;
            fake.reply(json!({"exited": true, "exitcode": 3,
                "out-data": "aGkK", "err-data": "b29wcwo="}))
                .await;
            fake
        });
        let out = client
            .exec("/bin/sh", &["-c", "echo hi; echo oops >&2"], T)
            .await
            .expect("exec");
        assert_eq!(out.exit_code, Some(3));
        assert_eq!(out.signal, None);
        assert_eq!(out.stdout, b"hi\n");
        assert_eq!(out.stderr, b"oops\n");
        assert!(!out.truncated);
        guest.await.expect("fake agent");
    }

    #[tokio::test]
    async fn exec_start_and_status_are_separate_calls_and_other_commands_fit_between() {
        let (_dir, mut client, mut fake) = setup().await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            let start = fake.recv().await;
            assert_eq!(start["execute"], "guest-exec");
            assert_eq!(start["arguments"]["path"], "/bin/sleep");
            assert_eq!(start["arguments"]["arg"], json!(["30"]));
            fake.reply(json!({"pid": 9})).await;
            let poll = fake.recv().await;
            assert_eq!(poll["execute"], "guest-exec-status");
            assert_eq!(poll["arguments"]["pid"], 9);
            fake.reply(json!({"exited": false})).await;
            // Between two polls the channel carries anything else, in sync.
            assert_eq!(fake.recv().await["execute"], "guest-fsfreeze-status");
            fake.reply(json!("thawed")).await;
            let poll = fake.recv().await;
            assert_eq!(poll["execute"], "guest-exec-status");
            fake.reply(json!({"exited": true, "signal": 9})).await;
            fake
        });
        let pid = client
            .exec_start("/bin/sleep", &["30"], T)
            .await
            .expect("start");
        assert_eq!(pid, 9);
        assert!(client.is_synced(), "start returns once qemu-ga answered");
        assert_eq!(client.exec_status(pid, T).await.expect("status"), None);
        assert_eq!(
            client.fsfreeze_status(T).await.expect("between polls"),
            FreezeStatus::Thawed
        );
        let out = client
            .exec_status(pid, T)
            .await
            .expect("status")
            .expect("exited");
        assert_eq!(out.exit_code, None);
        assert_eq!(out.signal, Some(9));
        assert!(out.stdout.is_empty());
        guest.await.expect("fake agent");
    }

    #[tokio::test]
    async fn get_fsinfo_returns_typed_filesystems_and_ignores_unknown_fields() {
        let (_dir, mut client, mut fake) = setup().await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            assert_eq!(fake.recv().await["execute"], "guest-get-fsinfo");
            fake.reply(json!([
                {"name": "vdb", "mountpoint": "/mnt/vdb", "type": "ext4",
                 "used-bytes": 24576, "total-bytes": 55025664, "something-new": {"x": 1},
                 "disk": [{"serial": "data", "dev": "/dev/vdb", "bus-type": "virtio",
                           "bus": 0, "target": 0, "unit": 0,
                           "pci-controller": {"domain": 0, "bus": 0, "slot": 3, "function": 0}}]},
                {"name": "dm-0", "mountpoint": "/srv", "type": "xfs",
                 "disk": [{"bus-type": "virtio", "bus": 0, "target": 0, "unit": 0,
                           "pci-controller": {"domain": 0, "bus": 0, "slot": 2, "function": 0}},
                          {"bus-type": "virtio", "bus": 0, "target": 0, "unit": 0,
                           "pci-controller": {"domain": 0, "bus": 0, "slot": 3, "function": 0}}]},
            ]))
            .await;
            fake
        });
        let list = client.get_fsinfo(T).await.expect("fsinfo");
        assert_eq!(list.len(), 2);
        assert_eq!(list[0].mountpoint, "/mnt/vdb");
        assert_eq!(list[0].name, "vdb");
        assert_eq!(list[0].fs_type, "ext4");
        assert_eq!(list[0].disks.len(), 1);
        assert_eq!(list[0].disks[0].serial.as_deref(), Some("data"));
        assert_eq!(list[0].disks[0].dev.as_deref(), Some("/dev/vdb"));
        assert_eq!(list[0].disks[0].bus_type, "virtio");
        assert_eq!(
            list[0].disks[0].pci_controller,
            Some(crate::fsmap::PciAddress {
                domain: 0,
                bus: 0,
                slot: 3,
                function: 0
            })
        );
        assert_eq!(list[1].fs_type, "xfs");
        assert_eq!(list[1].disks.len(), 2);
        assert_eq!(list[1].disks[1].serial, None);
        assert!(client.is_synced());
        guest.await.expect("fake agent");
    }

    #[tokio::test]
    async fn a_malformed_fsinfo_reply_is_a_protocol_error_and_the_channel_stays_in_sync() {
        let (_dir, mut client, mut fake) = setup().await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            assert_eq!(fake.recv().await["execute"], "guest-get-fsinfo");
            fake.reply(json!([{"name": "vda", "type": "ext4", "mountpoint": ["/"]}]))
                .await;
            // The reply was read whole: the next command comes without a resync.
            assert_eq!(fake.recv().await["execute"], "guest-get-fsinfo");
            let entry = json!({"name": "vda", "type": "ext4", "mountpoint": "/", "disk": []});
            fake.reply(json!(vec![entry; crate::fsmap::MAX_FILESYSTEMS + 1]))
                .await;
            assert_eq!(fake.recv().await["execute"], "guest-get-fsinfo");
            fake.error("GenericError", "failed to open /proc/self/mountinfo")
                .await;
            fake
        });
        let err = client.get_fsinfo(T).await.expect_err("bad mountpoint");
        assert!(
            matches!(&err, AgentError::Protocol(m) if m.contains("mountpoint")),
            "{err}"
        );
        assert!(client.is_synced());
        let err = client.get_fsinfo(T).await.expect_err("too many");
        assert!(
            matches!(&err, AgentError::Protocol(m) if m.contains("257 filesystems")),
            "{err}"
        );
        let err = client.get_fsinfo(T).await.expect_err("error reply");
        assert!(
            matches!(&err, AgentError::Command { command, .. } if command == "guest-get-fsinfo"),
            "{err}"
        );
        guest.await.expect("fake agent");
    }

    #[tokio::test]
    async fn exec_start_without_a_pid_is_a_protocol_error() {
        let (_dir, mut client, mut fake) = setup().await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            let _ = fake.recv().await;
            fake.reply(json!({"pid": "seven"})).await;
            fake
        });
        let err = client
            .exec_start("/bin/true", &[], T)
            .await
            .expect_err("no numeric pid");
        assert!(matches!(err, AgentError::Protocol(_)), "{err}");
        guest.await.expect("fake agent");
    }

    #[test]
    fn exec_polls_start_at_50ms_and_grow_to_250ms() {
        let mut seen = vec![EXEC_POLL_FIRST];
        for _ in 0..10 {
            let next = next_exec_poll(*seen.last().expect("one"));
            seen.push(next);
        }
        assert_eq!(seen[0], Duration::from_millis(50));
        assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{seen:?}");
        assert!(seen[1] > seen[0], "{seen:?}");
        assert_eq!(*seen.last().expect("last"), Duration::from_millis(250));
        assert!(seen.iter().all(|d| *d <= EXEC_POLL_MAX));
    }

    #[tokio::test]
    async fn exec_with_invalid_base64_is_a_protocol_error() {
        let (_dir, mut client, mut fake) = setup().await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            let _ = fake.recv().await;
            fake.reply(json!({"pid": 1})).await;
            let _ = fake.recv().await;
            fake.reply(json!({"exited": true, "exitcode": 0, "out-data": "!!!"}))
                .await;
            fake
        });
        let err = client.exec("/bin/true", &[], T).await.expect_err("bad b64");
        assert!(matches!(err, AgentError::Protocol(_)), "{err}");
        guest.await.expect("fake agent");
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_without_reply_counts_as_sent_but_an_error_reply_fails() {
        let (_dir, mut client, mut fake) = setup().await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            let cmd = fake.recv().await;
            assert_eq!(cmd["execute"], "guest-shutdown");
            assert_eq!(cmd["arguments"]["mode"], "powerdown");
            // Success: qemu-ga says nothing. Next attempt gets an error.
            fake.handle_sync().await;
            let _ = fake.recv().await;
            fake.error("GenericError", "shutdown failed").await;
            fake
        });
        client
            .shutdown("powerdown", Duration::from_secs(2))
            .await
            .expect("no reply is success");
        assert!(!client.is_synced());
        let err = client
            .shutdown("powerdown", Duration::from_secs(2))
            .await
            .expect_err("error reply");
        assert!(matches!(err, AgentError::Command { .. }), "{err}");
        let err = client.shutdown("now", T).await.expect_err("bad mode");
        assert!(matches!(err, AgentError::InvalidArgument(_)));
        guest.await.expect("fake agent");
    }

    /// An agent that answered a moment ago and then went silent (qemu-ga
    /// stopped in the guest, the port still open) must not be taken to have
    /// accepted a shutdown: its silence is not the silence of a success.
    #[tokio::test(start_paused = true)]
    async fn shutdown_on_a_synced_channel_to_a_silent_agent_fails() {
        let (_dir, mut client, mut fake) = setup().await;
        let guest = tokio::spawn(async move {
            fake.handle_sync().await;
            assert_eq!(fake.recv().await["execute"], "guest-ping");
            fake.reply(json!({})).await;
            // From here on it reads and never answers.
            let _ = fake.recv_sync().await;
            let mut rest = String::new();
            let _ = fake.read.read_line(&mut rest).await;
            (fake, rest)
        });
        client.ping(T).await.expect("ping");
        assert!(client.is_synced());
        let err = client
            .shutdown("powerdown", Duration::from_secs(2))
            .await
            .expect_err("no answer to the resync: not a shutdown");
        assert!(
            matches!(&err, AgentError::Timeout { command, .. } if command == "guest-sync-delimited"),
            "{err}"
        );
        assert!(err.is_transport());
        drop(client);
        let (_fake, rest) = guest.await.expect("fake agent");
        assert!(
            !rest.contains("guest-shutdown"),
            "guest-shutdown was sent to an agent that did not answer: {rest:?}"
        );
    }

    #[test]
    fn sync_ids_do_not_repeat() {
        let ids: std::collections::HashSet<u64> = (0..1000).map(|_| fresh_sync_id()).collect();
        assert_eq!(ids.len(), 1000);
        assert!(ids.iter().all(|id| *id < (1 << 53)));
    }
}
