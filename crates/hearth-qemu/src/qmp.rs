//! Async QMP client.
//!
//! One reader task owns the read half of the socket: it matches replies to waiters
//! by `id` and fans events out on a broadcast channel. One writer task owns the
//! write half and writes whole lines, so a caller that gives up mid-send can never
//! leave half a command on the wire. Callers share a cheap [`QmpClient`] handle.
//!
//! Untrusted input handling:
//! - a line longer than `max_line` closes the connection; every waiter gets
//!   [`QmpError::ReplyTooLarge`] because we cannot tell whose reply it was;
//! - a line that is not JSON, or JSON that is neither a reply nor an event, is
//!   logged and skipped (QEMU never sends one, so it is noise, not a reason to drop
//!   a VM's control channel); a waiter whose reply was garbled times out;
//! - a reply whose id nobody waits for (the waiter timed out) is dropped.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::task::AbortHandle;

use crate::lines::{BoundedReader, QapiReply, ReadError, classify_reply, truncate};
use crate::seam::Monitor;

/// Default bound for one QMP line. `query-block` with a long snapshot chain is the
/// largest reply we issue; it stays far below this.
pub const DEFAULT_MAX_LINE: usize = 1024 * 1024;
/// Events buffered per subscriber before the oldest are dropped (receivers then see
/// `RecvError::Lagged`). Events are hints in hearth, so losing some is safe.
pub const DEFAULT_EVENT_CAPACITY: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("cannot connect to QMP socket {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("QMP handshake on {path} did not finish within {timeout:?}")]
    ConnectTimeout { path: PathBuf, timeout: Duration },
    #[error("QMP greeting is not valid: {0}")]
    BadGreeting(String),
    #[error("QMP command {command} got no reply within {timeout:?}")]
    Timeout { command: String, timeout: Duration },
    #[error("QMP connection closed")]
    Disconnected,
    #[error("QMP sent a line longer than {limit} bytes; connection closed")]
    ReplyTooLarge { limit: usize },
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    #[error("QMP protocol violation: {0}")]
    Protocol(String),
    #[error("QMP I/O error")]
    Io(#[source] std::io::Error),
}

/// An asynchronous QMP event.
#[derive(Debug, Clone, PartialEq)]
pub struct QmpEvent {
    pub event: String,
    pub data: Value,
    /// `(seconds, microseconds)` as QEMU stamped it.
    pub timestamp: Option<(i64, i64)>,
}

/// What QEMU said about itself in the greeting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuVersion {
    pub major: u64,
    pub minor: u64,
    pub micro: u64,
}

#[derive(Debug, Clone)]
pub struct QmpOptions {
    pub max_line: usize,
    pub event_capacity: usize,
}

impl Default for QmpOptions {
    fn default() -> Self {
        QmpOptions {
            max_line: DEFAULT_MAX_LINE,
            event_capacity: DEFAULT_EVENT_CAPACITY,
        }
    }
}

/// Why the connection ended; turned into a fresh [`QmpError`] for each waiter.
#[derive(Debug, Clone, Copy)]
enum CloseReason {
    Disconnected,
    TooLarge(usize),
}

impl CloseReason {
    fn to_error(self) -> QmpError {
        match self {
            CloseReason::Disconnected => QmpError::Disconnected,
            CloseReason::TooLarge(limit) => QmpError::ReplyTooLarge { limit },
        }
    }
}

type Reply = Result<Value, QmpError>;

struct Pending {
    waiters: HashMap<u64, oneshot::Sender<Reply>>,
    /// Set once, by the reader, under the same lock that registers waiters, so no
    /// waiter can be registered after the last drain and then hang.
    closed: Option<CloseReason>,
}

struct Shared {
    pending: Mutex<Pending>,
    closed_tx: watch::Sender<bool>,
    events: broadcast::Sender<QmpEvent>,
}

impl Shared {
    fn close(&self, reason: CloseReason) {
        let waiters = {
            let Ok(mut pending) = self.pending.lock() else {
                return;
            };
            if pending.closed.is_none() {
                pending.closed = Some(reason);
            }
            std::mem::take(&mut pending.waiters)
        };
        for (_, waiter) in waiters {
            let _ = waiter.send(Err(reason.to_error()));
        }
        self.closed_tx.send_replace(true);
    }
}

struct Inner {
    shared: Arc<Shared>,
    next_id: AtomicU64,
    lines_tx: mpsc::UnboundedSender<Outgoing>,
    version: QemuVersion,
    tasks: [AbortHandle; 2],
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last handle is gone: stop both tasks, which closes the socket.
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// A shared handle to one QMP connection. Clone it freely.
#[derive(Clone)]
pub struct QmpClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for QmpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QmpClient")
            .field("version", &self.inner.version)
            .field("closed", &self.is_closed())
            .finish()
    }
}

/// Removes a waiter if the `execute` future is dropped or times out, so the map
/// cannot grow with abandoned entries.
struct WaiterGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        if let Ok(mut pending) = self.shared.pending.lock() {
            pending.waiters.remove(&self.id);
        }
    }
}

impl QmpClient {
    /// Connects, reads the greeting and negotiates capabilities, all within `timeout`.
    pub async fn connect(
        path: &Path,
        timeout: Duration,
    ) -> Result<(QmpClient, broadcast::Receiver<QmpEvent>), QmpError> {
        Self::connect_with(path, timeout, QmpOptions::default()).await
    }

    pub async fn connect_with(
        path: &Path,
        timeout: Duration,
        options: QmpOptions,
    ) -> Result<(QmpClient, broadcast::Receiver<QmpEvent>), QmpError> {
        let handshake = async {
            let stream = UnixStream::connect(path)
                .await
                .map_err(|source| QmpError::Connect {
                    path: path.to_owned(),
                    source,
                })?;
            let (read, mut write) = stream.into_split();
            let mut reader = BoundedReader::new(read);
            let greeting = read_json_line(&mut reader, options.max_line).await?;
            let version = parse_greeting(&greeting)?;
            write
                .write_all(b"{\"execute\":\"qmp_capabilities\",\"id\":0}\n")
                .await
                .map_err(QmpError::Io)?;
            // Nothing but our reply can come before capabilities are negotiated, but
            // skip anything else rather than trust that.
            loop {
                let msg = read_json_line(&mut reader, options.max_line).await?;
                if msg.get("id") == Some(&json!(0)) {
                    parse_reply("qmp_capabilities", msg)?;
                    break;
                }
            }
            Ok::<_, QmpError>((reader, write, version))
        };
        let (reader, write, version) =
            tokio::time::timeout(timeout, handshake)
                .await
                .map_err(|_| QmpError::ConnectTimeout {
                    path: path.to_owned(),
                    timeout,
                })??;

        let (events, events_rx) = broadcast::channel(options.event_capacity.max(1));
        let (closed_tx, _) = watch::channel(false);
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending {
                waiters: HashMap::new(),
                closed: None,
            }),
            closed_tx,
            events,
        });
        let (lines_tx, lines_rx) = mpsc::unbounded_channel();
        let reader_task = tokio::spawn(read_loop(reader, shared.clone(), options.max_line));
        let writer_task = tokio::spawn(write_loop(write, lines_rx, shared.clone()));
        let client = QmpClient {
            inner: Arc::new(Inner {
                shared,
                next_id: AtomicU64::new(1),
                lines_tx,
                version,
                tasks: [reader_task.abort_handle(), writer_task.abort_handle()],
            }),
        };
        Ok((client, events_rx))
    }

    /// QEMU's version from the greeting.
    pub fn version(&self) -> &QemuVersion {
        &self.inner.version
    }

    /// Another receiver for events from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<QmpEvent> {
        self.inner.shared.events.subscribe()
    }

    /// Runs one command and returns its `return` value.
    pub async fn execute(
        &self,
        command: &str,
        arguments: Option<Value>,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        self.execute_passing(command, arguments, None, timeout)
            .await
    }

    /// [`execute`](Self::execute), sending `fd` along with the command
    /// (`SCM_RIGHTS`): for `add-fd` and `getfd`, which take the descriptor
    /// that came with them.
    pub async fn execute_with_fd(
        &self,
        command: &str,
        arguments: Option<Value>,
        fd: OwnedFd,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        self.execute_passing(command, arguments, Some(fd), timeout)
            .await
    }

    async fn execute_passing(
        &self,
        command: &str,
        arguments: Option<Value>,
        fd: Option<OwnedFd>,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        let shared = &*self.inner.shared;
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut pending = shared.pending.lock().map_err(|_| QmpError::Disconnected)?;
            if let Some(reason) = pending.closed {
                return Err(reason.to_error());
            }
            pending.waiters.insert(id, tx);
        }
        let _guard = WaiterGuard { shared, id };

        let mut msg = json!({"execute": command, "id": id});
        if let Some(arguments) = arguments {
            msg["arguments"] = arguments;
        }
        tracing::trace!(%msg, "QMP command");
        let mut line = msg.to_string().into_bytes();
        line.push(b'\n');
        if self.inner.lines_tx.send(Outgoing { line, fd }).is_err() {
            return Err(QmpError::Disconnected);
        }

        match tokio::time::timeout(timeout, rx).await {
            Err(_) => Err(QmpError::Timeout {
                command: command.to_owned(),
                timeout,
            }),
            Ok(Err(_)) => Err(QmpError::Disconnected),
            Ok(Ok(reply)) => reply.and_then(|v| parse_reply(command, v)),
        }
    }

    pub fn is_closed(&self) -> bool {
        *self.inner.shared.closed_tx.borrow()
    }

    /// Resolves once the connection is closed (EOF, error, or oversized line).
    pub async fn closed(&self) {
        let mut rx = self.inner.shared.closed_tx.subscribe();
        // `wait_for` only errs if the sender is gone, which means closed too.
        let _ = rx.wait_for(|closed| *closed).await;
    }
}

/// A file QEMU opened through an fd set hearthd passed over QMP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileNode {
    pub node: String,
    pub fdset: u64,
}

/// Opens `path` here (read-write unless `read_only`) and hands the
/// descriptor to QEMU (`add-fd` with `SCM_RIGHTS`, labelled with the path):
/// into fd set `set`, or a new set when `None`. Returns the set's id and the
/// descriptor's number in QEMU; `/dev/fdset/S` then opens it.
async fn hand_over<M: Monitor + ?Sized>(
    qmp: &M,
    path: &Path,
    read_only: bool,
    set: Option<u64>,
    timeout: Duration,
) -> Result<(u64, i64), QmpError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(!read_only)
        .open(path)
        .map_err(QmpError::Io)?;
    let mut args = json!({"opaque": path.to_string_lossy()});
    if let Some(set) = set {
        args["fdset-id"] = json!(set);
    }
    let added = qmp
        .execute_with_fd("add-fd", Some(args), file.into(), timeout)
        .await?;
    match (
        added.get("fdset-id").and_then(Value::as_u64),
        added.get("fd").and_then(Value::as_i64),
    ) {
        (Some(set), Some(fd)) => Ok((set, fd)),
        _ => Err(QmpError::Protocol(format!("add-fd answered {added}"))),
    }
}

/// Hands `path` over ([`hand_over`]) and adds `node` (`blockdev-add` of
/// `file_node(filename)`); if the node cannot be added, the fd set is
/// removed again.
async fn add_handed_over<M: Monitor + ?Sized>(
    qmp: &M,
    node: &str,
    path: &Path,
    read_only: bool,
    timeout: Duration,
    node_args: impl FnOnce(String) -> Value,
) -> Result<FileNode, QmpError> {
    let (fdset, _) = hand_over(qmp, path, read_only, None, timeout).await?;
    let result = qmp
        .execute(
            "blockdev-add",
            Some(node_args(crate::cmdline::fdset_path(fdset))),
            timeout,
        )
        .await;
    if let Err(e) = result {
        let _ = qmp
            .execute("remove-fd", Some(json!({"fdset-id": fdset})), timeout)
            .await;
        return Err(e);
    }
    Ok(FileNode {
        node: node.to_owned(),
        fdset,
    })
}

/// Adds a `qcow2` node `node` over `path`, handed over by descriptor
/// (file `/dev/fdset/S`, `backing: null`: whoever links it in gives it its
/// backing, as `blockdev-snapshot` does). QEMU itself never opens the path,
/// so it needs no access to it. With [`add_protocol_node`], the one way a
/// running QEMU gets a new file: every runtime `blockdev-add` of hearth
/// goes through these two.
pub async fn add_file_node<M: Monitor + ?Sized>(
    qmp: &M,
    node: &str,
    path: &Path,
    read_only: bool,
    timeout: Duration,
) -> Result<FileNode, QmpError> {
    add_handed_over(qmp, node, path, read_only, timeout, |filename| {
        json!({
            "driver": "qcow2",
            "node-name": node,
            "read-only": read_only,
            "file": {
                "driver": "file",
                "filename": filename,
                "read-only": read_only,
            },
            "backing": null,
        })
    })
    .await
}

/// Adds a protocol (`file` driver) node `node` over `path`, handed over by
/// descriptor: the node a `blockdev-create` job formats, and the format
/// node is then added over it by name.
pub async fn add_protocol_node<M: Monitor + ?Sized>(
    qmp: &M,
    node: &str,
    path: &Path,
    read_only: bool,
    timeout: Duration,
) -> Result<FileNode, QmpError> {
    add_handed_over(qmp, node, path, read_only, timeout, |filename| {
        json!({
            "driver": "file",
            "node-name": node,
            "filename": filename,
            "read-only": read_only,
        })
    })
    .await
}

/// Deletes node `node` (`blockdev-del`; QEMU refuses for a node in use, and
/// a node it does not know counts as deleted). With `file` (a protocol
/// node's file), then removes every fd set labelled with that path
/// (`remove-fd`), so fd sets do not pile up across cuts.
pub async fn remove_node<M: Monitor + ?Sized>(
    qmp: &M,
    node: &str,
    file: Option<&Path>,
    timeout: Duration,
) -> Result<(), QmpError> {
    match qmp
        .execute("blockdev-del", Some(json!({"node-name": node})), timeout)
        .await
    {
        Ok(_) => {}
        Err(QmpError::Command { desc, .. })
            if desc.contains("Failed to find node") || desc.contains("Cannot find node") => {}
        Err(e) => return Err(e),
    }
    let Some(path) = file else {
        return Ok(());
    };
    let label = path.to_string_lossy();
    for (set, opaque) in fdsets(qmp, timeout).await? {
        if opaque == label {
            qmp.execute("remove-fd", Some(json!({"fdset-id": set})), timeout)
                .await?;
        }
    }
    Ok(())
}

/// Reopens `file` node `node`, which QEMU opened from an fd set, read-write
/// (`read_only` false) or read-only again, over a new descriptor of `path`
/// opened here in that mode; then removes every other descriptor of the
/// set. For a merge into a layer QEMU holds read-only (a snapshot's layer
/// under the head), and back after it.
///
/// Why the other descriptors go: QEMU locks the image with OFD locks
/// (`F_OFD_SETLK`), which belong to the open file description, not to a
/// descriptor. The node reads through a `dup` of the set's descriptor;
/// after the reopen it closes its dup, but the set's own descriptor keeps
/// the old description, and its locks, alive. Its "nobody else writes"
/// lock then refuses the write the node now needs ("Failed to get "write"
/// lock", measured on QEMU 10.0.2). Removing it closes that description.
/// Another process that has the file open with locking (a VM restored from
/// the layer) holds the same lock: the write is refused, and nothing is
/// changed under that reader.
pub async fn reopen_file_node<M: Monitor + ?Sized>(
    qmp: &M,
    node: &str,
    path: &Path,
    read_only: bool,
    timeout: Duration,
) -> Result<(), QmpError> {
    let nodes = qmp
        .execute(
            "query-named-block-nodes",
            Some(json!({"flat": true})),
            timeout,
        )
        .await?;
    let set = nodes
        .as_array()
        .into_iter()
        .flatten()
        .find(|n| n["node-name"] == node)
        .and_then(|n| {
            n["file"]
                .as_str()?
                .strip_prefix("/dev/fdset/")?
                .parse::<u64>()
                .ok()
        })
        .ok_or_else(|| QmpError::Protocol(format!("node {node} is not opened from an fd set")))?;
    let (_, new_fd) = hand_over(qmp, path, read_only, Some(set), timeout).await?;
    let reopened = qmp
        .execute(
            "blockdev-reopen",
            Some(json!({"options": [{
                "driver": "file",
                "node-name": node,
                "filename": crate::cmdline::fdset_path(set),
                "read-only": read_only,
            }]})),
            timeout,
        )
        .await;
    // On failure the new descriptor goes, and the node reads on as before.
    let keep = if reopened.is_ok() { new_fd } else { -1 };
    let sets = qmp.execute("query-fdsets", None, timeout).await?;
    for fd in fds_of_set(&sets, set) {
        if fd != keep && (reopened.is_ok() || fd == new_fd) {
            qmp.execute(
                "remove-fd",
                Some(json!({"fdset-id": set, "fd": fd})),
                timeout,
            )
            .await?;
        }
    }
    reopened.map(|_| ())
}

/// The descriptors of fd set `set` in a `query-fdsets` answer.
fn fds_of_set(sets: &Value, set: u64) -> Vec<i64> {
    sets.as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["fdset-id"] == set)
        .flat_map(|s| s["fds"].as_array().cloned().unwrap_or_default())
        .filter_map(|fd| fd["fd"].as_i64())
        .collect()
}

/// Every fd set with the label of its first descriptor (`query-fdsets`).
pub async fn fdsets<M: Monitor + ?Sized>(
    qmp: &M,
    timeout: Duration,
) -> Result<Vec<(u64, String)>, QmpError> {
    let sets = qmp.execute("query-fdsets", None, timeout).await?;
    Ok(parse_fdsets(&sets))
}

fn parse_fdsets(sets: &Value) -> Vec<(u64, String)> {
    sets.as_array()
        .into_iter()
        .flatten()
        .filter_map(|set| {
            let id = set.get("fdset-id")?.as_u64()?;
            let opaque = set
                .get("fds")?
                .as_array()?
                .iter()
                .find_map(|fd| fd.get("opaque")?.as_str())?;
            Some((id, opaque.to_owned()))
        })
        .collect()
}

/// The file a node's `filename` (from `query-block`) stands for: for
/// `/dev/fdset/S`, the path set `S` is labelled with; for a `json:{...}`
/// name (what QEMU reports for a format node whose backing was given
/// explicitly), that of its own `file` child; else the name itself.
pub fn resolve_filename(filename: &str, fdsets: &[(u64, String)]) -> String {
    let own_file = filename
        .strip_prefix("json:")
        .and_then(|j| serde_json::from_str::<Value>(j).ok())
        .and_then(|v| v.pointer("/file/filename")?.as_str().map(str::to_owned));
    let filename = own_file.as_deref().unwrap_or(filename);
    filename
        .strip_prefix("/dev/fdset/")
        .and_then(|n| n.parse::<u64>().ok())
        .and_then(|n| fdsets.iter().find(|(id, _)| *id == n))
        .map(|(_, label)| label.clone())
        .unwrap_or_else(|| filename.to_owned())
}

async fn read_json_line(
    reader: &mut BoundedReader<OwnedReadHalf>,
    max_line: usize,
) -> Result<Value, QmpError> {
    loop {
        let line = match reader.read_line(max_line).await {
            Ok(line) => line,
            Err(ReadError::Eof) => return Err(QmpError::Disconnected),
            Err(ReadError::TooLarge) => return Err(QmpError::ReplyTooLarge { limit: max_line }),
            Err(ReadError::Io(e)) => return Err(QmpError::Io(e)),
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        return serde_json::from_slice(&line)
            .map_err(|e| QmpError::Protocol(format!("line is not JSON: {e}")));
    }
}

fn parse_greeting(greeting: &Value) -> Result<QemuVersion, QmpError> {
    let qemu = greeting
        .get("QMP")
        .and_then(|q| q.get("version"))
        .and_then(|v| v.get("qemu"))
        .ok_or_else(|| QmpError::BadGreeting(truncate(&greeting.to_string())))?;
    let field = |name: &str| {
        qemu.get(name)
            .and_then(Value::as_u64)
            .ok_or_else(|| QmpError::BadGreeting(format!("version.qemu.{name} missing")))
    };
    Ok(QemuVersion {
        major: field("major")?,
        minor: field("minor")?,
        micro: field("micro")?,
    })
}

/// Turns a reply object into the command's result.
fn parse_reply(command: &str, reply: Value) -> Result<Value, QmpError> {
    match classify_reply(reply) {
        QapiReply::Return(v) => Ok(v),
        QapiReply::Error { class, desc } => Err(QmpError::Command {
            command: command.to_owned(),
            class,
            desc,
        }),
        QapiReply::Malformed(text) => Err(QmpError::Protocol(format!(
            "reply to {command} has neither return nor error: {text}"
        ))),
    }
}

fn parse_event(msg: &Value) -> Option<QmpEvent> {
    let event = msg.get("event")?.as_str()?.to_owned();
    let data = msg.get("data").cloned().unwrap_or(Value::Null);
    let timestamp = msg.get("timestamp").and_then(|t| {
        Some((
            t.get("seconds")?.as_i64()?,
            t.get("microseconds")?.as_i64()?,
        ))
    });
    Some(QmpEvent {
        event,
        data,
        timestamp,
    })
}

async fn read_loop(mut reader: BoundedReader<OwnedReadHalf>, shared: Arc<Shared>, max: usize) {
    let reason = loop {
        let line = match reader.read_line(max).await {
            Ok(line) => line,
            Err(ReadError::Eof) => break CloseReason::Disconnected,
            Err(ReadError::TooLarge) => {
                tracing::warn!(limit = max, "QMP line over the size bound; closing");
                break CloseReason::TooLarge(max);
            }
            Err(ReadError::Io(e)) => {
                tracing::warn!(error = %e, "QMP read failed; closing");
                break CloseReason::Disconnected;
            }
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let msg: Value = match serde_json::from_slice(&line) {
            Ok(msg) => msg,
            Err(e) => {
                tracing::warn!(error = %e, line = %truncate(&String::from_utf8_lossy(&line)),
                    "QMP sent a line that is not JSON; skipped");
                continue;
            }
        };
        if let Some(id) = msg.get("id") {
            let waiter = id.as_u64().and_then(|id| {
                shared
                    .pending
                    .lock()
                    .ok()
                    .and_then(|mut p| p.waiters.remove(&id))
            });
            match waiter {
                Some(waiter) => {
                    // The waiter may have just given up; that is the late-reply case.
                    let _ = waiter.send(Ok(msg));
                }
                None => tracing::debug!(%id, "QMP reply nobody waits for (late); dropped"),
            }
        } else if let Some(event) = parse_event(&msg) {
            // No subscribers is fine: events are hints.
            let _ = shared.events.send(event);
        } else {
            tracing::warn!(msg = %truncate(&msg.to_string()),
                "QMP message is neither a reply with id nor an event; skipped");
        }
    };
    shared.close(reason);
}

/// One command line for the writer, with the descriptor QEMU is to receive
/// with it (`SCM_RIGHTS` on the line's first bytes, so it arrives before
/// QEMU runs the command).
struct Outgoing {
    line: Vec<u8>,
    fd: Option<OwnedFd>,
}

async fn write_loop(
    mut write: OwnedWriteHalf,
    mut lines: mpsc::UnboundedReceiver<Outgoing>,
    shared: Arc<Shared>,
) {
    while let Some(Outgoing { line, fd }) = lines.recv().await {
        let mut sent = 0;
        if let Some(fd) = fd {
            match send_with_fd(&write, &line, &fd).await {
                Ok(n) => sent = n,
                Err(e) => {
                    tracing::warn!(error = %e, "QMP write (with a descriptor) failed; closing");
                    shared.close(CloseReason::Disconnected);
                    return;
                }
            }
            // Closing our copy now is fine: the kernel holds the one in flight.
        }
        if let Err(e) = write.write_all(&line[sent..]).await {
            tracing::warn!(error = %e, "QMP write failed; closing");
            shared.close(CloseReason::Disconnected);
            return;
        }
    }
}

/// Sends a first part of `line` with `fd` attached; returns how many bytes
/// went.
async fn send_with_fd(write: &OwnedWriteHalf, line: &[u8], fd: &OwnedFd) -> std::io::Result<usize> {
    let stream: &UnixStream = write.as_ref();
    loop {
        stream.writable().await?;
        match stream.try_io(tokio::io::Interest::WRITABLE, || {
            sendmsg_fd(stream.as_raw_fd(), line, fd.as_raw_fd())
        }) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

fn sendmsg_fd(socket: RawFd, data: &[u8], fd: RawFd) -> std::io::Result<usize> {
    let fd_len = std::mem::size_of::<RawFd>() as u32;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(fd_len) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: all-zero is a valid msghdr; the pointers set below stay valid
    // (iov, control) for the duration of the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer is CMSG_SPACE(sizeof fd) bytes, so the
    // first header and its data fit; CMSG_FIRSTHDR is non-null for it.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(fd_len) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
    }
    // SAFETY: `msg` describes live buffers; MSG_NOSIGNAL: a closed peer is an
    // error value, not SIGPIPE.
    let n = unsafe { libc::sendmsg(socket, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, BufReader};
    use tokio::net::UnixListener;

    const GREETING: &str = r#"{"QMP": {"version": {"qemu": {"micro": 2, "minor": 0, "major": 10}, "package": "Debian"}, "capabilities": ["oob"]}}"#;
    const T: Duration = Duration::from_secs(5);

    /// The server side of one QMP connection, driven line by line by a test.
    struct FakeQmp {
        lines: tokio::io::Lines<BufReader<OwnedReadHalf>>,
        write: OwnedWriteHalf,
    }

    impl FakeQmp {
        async fn recv(&mut self) -> Value {
            let line = self
                .lines
                .next_line()
                .await
                .expect("read")
                .expect("client sent a line");
            serde_json::from_str(&line).expect("client sends JSON")
        }
        async fn send(&mut self, text: &str) {
            self.write.write_all(text.as_bytes()).await.expect("write");
            self.write.write_all(b"\n").await.expect("write");
        }
        async fn reply(&mut self, id: &Value, ret: Value) {
            self.send(&json!({"return": ret, "id": id}).to_string())
                .await;
        }
    }

    /// Binds a socket, accepts one client and does the greeting/capabilities dance.
    async fn setup() -> (
        tempfile::TempDir,
        QmpClient,
        broadcast::Receiver<QmpEvent>,
        FakeQmp,
    ) {
        setup_with(QmpOptions::default()).await
    }

    async fn setup_with(
        options: QmpOptions,
    ) -> (
        tempfile::TempDir,
        QmpClient,
        broadcast::Receiver<QmpEvent>,
        FakeQmp,
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let server = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.expect("accept");
            let (read, write) = stream.into_split();
            let mut fake = FakeQmp {
                lines: BufReader::new(read).lines(),
                write,
            };
            fake.send(GREETING).await;
            let caps = fake.recv().await;
            assert_eq!(caps["execute"], "qmp_capabilities");
            let id = caps["id"].clone();
            fake.reply(&id, json!({})).await;
            fake
        });
        let (client, events) = QmpClient::connect_with(&path, T, options)
            .await
            .expect("connect");
        let fake = server.await.expect("server task");
        (dir, client, events, fake)
    }

    #[test]
    fn the_descriptors_of_one_fd_set_are_listed() {
        let sets = json!([
            {"fdset-id": 2, "fds": [{"fd": 9, "opaque": "/l/2.qcow2"}, {"fd": 12, "opaque": "/l/2.qcow2"}]},
            {"fdset-id": 1, "fds": [{"fd": 8, "opaque": "/l/1.qcow2"}]},
        ]);
        assert_eq!(fds_of_set(&sets, 2), vec![9, 12]);
        assert_eq!(fds_of_set(&sets, 1), vec![8]);
        assert!(fds_of_set(&sets, 5).is_empty());
    }

    #[test]
    fn a_node_filename_resolves_to_the_label_of_its_fd_set() {
        let sets = parse_fdsets(&json!([
            {"fdset-id": 2, "fds": [{"fd": 9, "opaque": "/state/layers/2-a.qcow2"}]},
            {"fdset-id": 1, "fds": [{"fd": 8, "opaque": "/images/base.qcow2"}]},
            {"fdset-id": 3, "fds": []},
        ]));
        assert_eq!(
            sets,
            vec![
                (2, "/state/layers/2-a.qcow2".into()),
                (1, "/images/base.qcow2".into())
            ]
        );
        assert_eq!(
            resolve_filename("/dev/fdset/2", &sets),
            "/state/layers/2-a.qcow2"
        );
        let json_name = r#"json:{"backing": {"driver": "qcow2", "file": {"driver": "file", "filename": "/dev/fdset/1"}}, "driver": "qcow2", "file": {"driver": "file", "filename": "/dev/fdset/2"}}"#;
        assert_eq!(
            resolve_filename(json_name, &sets),
            "/state/layers/2-a.qcow2"
        );
        assert_eq!(resolve_filename("/dev/fdset/7", &sets), "/dev/fdset/7");
        assert_eq!(
            resolve_filename("/plain/file.qcow2", &sets),
            "/plain/file.qcow2"
        );
    }

    #[tokio::test]
    async fn handshake_reads_the_version_and_negotiates_capabilities() {
        let (_dir, client, _events, _fake) = setup().await;
        assert_eq!(
            client.version(),
            &QemuVersion {
                major: 10,
                minor: 0,
                micro: 2
            }
        );
        assert!(!client.is_closed());
    }

    #[tokio::test]
    async fn a_server_that_is_not_qmp_fails_the_handshake() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.expect("accept");
            stream.write_all(b"{\"hello\": 1}\n").await.expect("write");
            tokio::time::sleep(T).await;
        });
        let err = QmpClient::connect(&path, T)
            .await
            .expect_err("bad greeting");
        assert!(matches!(err, QmpError::BadGreeting(_)), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_server_times_out_the_handshake() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let _server = tokio::spawn(async move {
            let held = listener.accept().await;
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(held);
        });
        let err = QmpClient::connect(&path, Duration::from_secs(2))
            .await
            .expect_err("no greeting");
        assert!(matches!(err, QmpError::ConnectTimeout { .. }), "{err}");
    }

    #[tokio::test]
    async fn connecting_to_a_missing_socket_names_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("absent.sock");
        let err = QmpClient::connect(&path, T).await.expect_err("absent");
        assert!(matches!(err, QmpError::Connect { .. }));
        assert!(err.to_string().contains("absent.sock"));
    }

    #[tokio::test]
    async fn concurrent_commands_answered_out_of_order_get_their_own_replies() {
        let (_dir, client, _events, mut fake) = setup().await;
        let c1 = client.clone();
        let first = tokio::spawn(async move { c1.execute("query-status", None, T).await });
        let a = fake.recv().await;
        let c2 = client.clone();
        let second =
            tokio::spawn(async move { c2.execute("query-name", Some(json!({"x": 1})), T).await });
        let b = fake.recv().await;
        assert_eq!(a["execute"], "query-status");
        assert_eq!(b["execute"], "query-name");
        assert_eq!(b["arguments"], json!({"x": 1}));
        assert_ne!(a["id"], b["id"]);

        // Answer the second first.
        fake.reply(&b["id"], json!({"name": "demo"})).await;
        fake.reply(&a["id"], json!({"status": "running"})).await;
        let first = first.await.expect("join").expect("reply");
        let second = second.await.expect("join").expect("reply");
        assert_eq!(first, json!({"status": "running"}));
        assert_eq!(second, json!({"name": "demo"}));
    }

    #[tokio::test(start_paused = true)]
    async fn a_reply_after_the_timeout_is_dropped_and_the_next_command_gets_its_own() {
        let (_dir, client, _events, mut fake) = setup().await;
        let err = client
            .execute("query-status", None, Duration::from_secs(1))
            .await
            .expect_err("nobody answered");
        assert!(
            matches!(&err, QmpError::Timeout { command, .. } if command == "query-status"),
            "{err}"
        );
        let late = fake.recv().await;

        let c = client.clone();
        let next = tokio::spawn(async move { c.execute("query-version", None, T).await });
        let current = fake.recv().await;
        // The late reply arrives first, then the real one.
        fake.reply(&late["id"], json!({"status": "LATE"})).await;
        fake.reply(&current["id"], json!({"qemu": "ok"})).await;
        assert_eq!(
            next.await.expect("join").expect("reply"),
            json!({"qemu": "ok"})
        );
        assert!(!client.is_closed());
    }

    #[tokio::test]
    async fn command_errors_carry_class_and_description() {
        let (_dir, client, _events, mut fake) = setup().await;
        let c = client.clone();
        let call = tokio::spawn(async move {
            c.execute("blockdev-snapshot-sync", Some(json!({})), T)
                .await
        });
        let req = fake.recv().await;
        fake.send(
            &json!({"id": req["id"], "error": {"class": "GenericError",
                     "desc": "Cannot find device= nor node-name=disk-x"}})
            .to_string(),
        )
        .await;
        match call.await.expect("join") {
            Err(QmpError::Command {
                command,
                class,
                desc,
            }) => {
                assert_eq!(command, "blockdev-snapshot-sync");
                assert_eq!(class, "GenericError");
                assert!(desc.contains("disk-x"));
            }
            other => panic!("expected command error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn events_are_delivered_between_replies() {
        let (_dir, client, mut events, mut fake) = setup().await;
        let mut second_subscriber = client.subscribe();
        fake.send(r#"{"timestamp": {"seconds": 1700000000, "microseconds": 42}, "event": "STOP"}"#)
            .await;
        fake.send(r#"{"event": "BLOCK_JOB_COMPLETED", "data": {"device": "job0", "len": 5}}"#)
            .await;
        let stop = events.recv().await.expect("event");
        assert_eq!(stop.event, "STOP");
        assert_eq!(stop.timestamp, Some((1_700_000_000, 42)));
        assert_eq!(stop.data, Value::Null);
        let job = events.recv().await.expect("event");
        assert_eq!(job.event, "BLOCK_JOB_COMPLETED");
        assert_eq!(job.data["len"], 5);
        assert_eq!(second_subscriber.recv().await.expect("event").event, "STOP");
    }

    #[tokio::test]
    async fn garbage_lines_are_skipped_and_the_connection_keeps_working() {
        let (_dir, client, _events, mut fake) = setup().await;
        let c = client.clone();
        let call = tokio::spawn(async move { c.execute("query-status", None, T).await });
        let req = fake.recv().await;
        fake.send("this is not json {{{").await;
        fake.send("[1, 2, 3]").await;
        fake.send("").await;
        fake.reply(&req["id"], json!({"status": "running"})).await;
        assert_eq!(
            call.await.expect("join").expect("reply"),
            json!({"status": "running"})
        );
        assert!(!client.is_closed());
    }

    #[tokio::test]
    async fn a_line_over_the_bound_closes_the_connection_and_fails_waiters() {
        let options = QmpOptions {
            max_line: 4096,
            ..QmpOptions::default()
        };
        let (_dir, client, _events, mut fake) = setup_with(options).await;
        let c = client.clone();
        let call = tokio::spawn(async move { c.execute("query-block", None, T).await });
        let req = fake.recv().await;
        let huge = json!({"id": req["id"], "return": "x".repeat(10_000)}).to_string();
        fake.send(&huge).await;
        let err = call.await.expect("join").expect_err("too large");
        assert!(
            matches!(err, QmpError::ReplyTooLarge { limit: 4096 }),
            "{err}"
        );
        client.closed().await;
        assert!(client.is_closed());
        let after = client.execute("query-status", None, T).await;
        assert!(matches!(after, Err(QmpError::ReplyTooLarge { .. })));
    }

    #[tokio::test]
    async fn eof_mid_command_fails_the_waiter_with_disconnected() {
        let (_dir, client, _events, mut fake) = setup().await;
        let c = client.clone();
        let call = tokio::spawn(async move { c.execute("query-status", None, T).await });
        let _req = fake.recv().await;
        drop(fake);
        let err = call.await.expect("join").expect_err("eof");
        assert!(matches!(err, QmpError::Disconnected), "{err}");
        client.closed().await;
        assert!(matches!(
            client.execute("query-status", None, T).await,
            Err(QmpError::Disconnected)
        ));
    }

    #[tokio::test]
    async fn a_reply_without_return_or_error_is_a_protocol_error() {
        let (_dir, client, _events, mut fake) = setup().await;
        let c = client.clone();
        let call = tokio::spawn(async move { c.execute("query-status", None, T).await });
        let req = fake.recv().await;
        fake.send(&json!({"id": req["id"], "surprise": true}).to_string())
            .await;
        assert!(matches!(
            call.await.expect("join"),
            Err(QmpError::Protocol(_))
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn an_abandoned_call_leaves_no_waiter_behind() {
        let (_dir, client, _events, mut fake) = setup().await;
        let call = client.execute("query-status", None, T);
        // Drop the future after the command was sent but before any reply.
        let _ = tokio::time::timeout(Duration::from_millis(10), call).await;
        let _req = fake.recv().await;
        let waiting = client
            .inner
            .shared
            .pending
            .lock()
            .map(|p| p.waiters.len())
            .unwrap_or(usize::MAX);
        assert_eq!(waiting, 0);
    }
}
