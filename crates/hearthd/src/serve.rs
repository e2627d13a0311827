//! Serving HTTP/1.1 on hearthd's listeners (the API socket and the metrics
//! listener) so that no client can hold hearthd's descriptors:
//!
//! - A connection must send a request's headers within the header timeout,
//!   counted from when it was accepted or its last answer was sent (hyper's
//!   `header_read_timeout`): half a request, or a kept-alive connection that
//!   asks nothing, is closed after it.
//! - At most `max_connections` are open at once. When one more arrives and
//!   none is free, the oldest connection without a request in progress
//!   (half-sent or idle between requests) is closed to make room, so a
//!   client that is slow on purpose cannot keep a scraper or the CLI out.
//!   When every connection has a request in progress (watch streams,
//!   console logs followed), the new one waits in the kernel's backlog until
//!   one ends.
//! - An upgraded connection (a console attach) leaves the count once its
//!   `101` is sent: at most one per VM exists.
//!
//! Which connection makes room is [`admission`], a pure function of the
//! open connections; the rest is the shell around hyper.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::Notify;
use tower_service::Service;

/// The bounds of one listener.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
}

/// A listener hyper can serve: TCP or a unix socket.
pub trait Listener: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(&mut self) -> impl Future<Output = std::io::Result<Self::Io>> + Send;
}

impl Listener for TcpListener {
    type Io = TcpStream;
    async fn accept(&mut self) -> std::io::Result<TcpStream> {
        let (stream, _) = TcpListener::accept(self).await?;
        let _ = stream.set_nodelay(true);
        Ok(stream)
    }
}

impl Listener for UnixListener {
    type Io = UnixStream;
    async fn accept(&mut self) -> std::io::Result<UnixStream> {
        UnixListener::accept(self).await.map(|(s, _)| s)
    }
}

/// What one open connection is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activity {
    /// No request in progress (its headers not all read yet, or between
    /// requests) since `since`, a tick of the table.
    Idle { since: u64 },
    /// This many requests in progress (their answers not all sent).
    Busy { requests: u32 },
    /// Answered `101 Switching Protocols`: handed over, never closed here.
    Upgrading,
}

/// One open connection as [`admission`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Open {
    pub activity: Activity,
    /// Told to close, not gone yet.
    pub closing: bool,
}

/// What to do with a connection that has just been accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// There is room: serve it.
    Serve,
    /// Close this idle connection to make room, then ask again.
    Close(u64),
    /// Wait until a connection ends (or one being closed is gone).
    Wait,
}

/// Room for one more of at most `max` connections: at once, or by closing
/// the connection that has been idle longest; none while one already told
/// to close is still open (its room is coming).
pub fn admission(open: &BTreeMap<u64, Open>, max: usize) -> Admission {
    if open.len() < max {
        return Admission::Serve;
    }
    if open.values().any(|o| o.closing) {
        return Admission::Wait;
    }
    open.iter()
        .filter_map(|(id, o)| match o.activity {
            Activity::Idle { since } => Some((since, *id)),
            _ => None,
        })
        .min()
        .map_or(Admission::Wait, |(_, id)| Admission::Close(id))
}

#[derive(Default)]
struct Table {
    open: BTreeMap<u64, Open>,
    /// Each connection's signal to close.
    close: BTreeMap<u64, Arc<Notify>>,
    next_id: u64,
    tick: u64,
}

impl Table {
    fn tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }
}

/// The open connections of one listener.
struct Connections {
    table: Mutex<Table>,
    /// Told whenever a connection ends or goes idle.
    changed: Notify,
    max: usize,
}

impl Connections {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for room and takes it.
    async fn admit(self: &Arc<Self>) -> Slot {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut t = self.lock();
                match admission(&t.open, self.max) {
                    Admission::Serve => {
                        t.next_id += 1;
                        let id = t.next_id;
                        let since = t.tick();
                        t.open.insert(
                            id,
                            Open {
                                activity: Activity::Idle { since },
                                closing: false,
                            },
                        );
                        let close = Arc::new(Notify::new());
                        t.close.insert(id, close.clone());
                        return Slot {
                            connections: self.clone(),
                            id,
                            close,
                        };
                    }
                    Admission::Close(id) => {
                        if let Some(o) = t.open.get_mut(&id) {
                            o.closing = true;
                        }
                        if let Some(n) = t.close.get(&id) {
                            n.notify_one();
                        }
                    }
                    Admission::Wait => {}
                }
            }
            changed.await;
        }
    }

    /// Whether connection `id`, told to close, is still idle (and closes);
    /// a request that came in meanwhile keeps it, and room is sought anew.
    fn close_if_idle(&self, id: u64) -> bool {
        let mut t = self.lock();
        let Some(o) = t.open.get_mut(&id) else {
            return true;
        };
        if matches!(o.activity, Activity::Idle { .. }) {
            return true;
        }
        o.closing = false;
        drop(t);
        self.changed.notify_waiters();
        false
    }

    fn update(&self, id: u64, f: impl FnOnce(&mut Activity, u64)) {
        let mut t = self.lock();
        let tick = t.tick();
        if let Some(o) = t.open.get_mut(&id) {
            f(&mut o.activity, tick);
        }
        drop(t);
        self.changed.notify_waiters();
    }
}

/// One admitted connection; gone from the count when dropped.
struct Slot {
    connections: Arc<Connections>,
    id: u64,
    close: Arc<Notify>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut t = self.connections.lock();
        t.open.remove(&self.id);
        t.close.remove(&self.id);
        drop(t);
        self.connections.changed.notify_waiters();
    }
}

/// A request in progress on a connection, until its answer is sent (or
/// dropped).
struct InProgress {
    connections: Arc<Connections>,
    id: u64,
}

impl InProgress {
    fn begin(connections: &Arc<Connections>, id: u64) -> InProgress {
        connections.update(id, |a, _| {
            *a = match *a {
                Activity::Busy { requests } => Activity::Busy {
                    requests: requests + 1,
                },
                Activity::Idle { .. } => Activity::Busy { requests: 1 },
                Activity::Upgrading => Activity::Upgrading,
            }
        });
        InProgress {
            connections: connections.clone(),
            id,
        }
    }

    fn upgrading(&self) {
        self.connections
            .update(self.id, |a, _| *a = Activity::Upgrading);
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        self.connections.update(self.id, |a, tick| {
            *a = match *a {
                Activity::Busy { requests } if requests > 1 => Activity::Busy {
                    requests: requests - 1,
                },
                Activity::Busy { .. } | Activity::Idle { .. } => Activity::Idle { since: tick },
                Activity::Upgrading => Activity::Upgrading,
            }
        });
    }
}

/// An answer's body that keeps its request in progress until it is sent.
struct Tracked {
    body: Body,
    _in_progress: InProgress,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        hyper::body::Body::is_end_stream(&self.body)
    }

    fn size_hint(&self) -> SizeHint {
        hyper::body::Body::size_hint(&self.body)
    }
}

/// How often a failing accept says so in the log, at most.
const ACCEPT_ERROR_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Serves `router` on `listener` within `limits`, until the task is
/// dropped. `what` names the listener in the log.
pub async fn serve<L: Listener>(
    mut listener: L,
    router: Router,
    limits: Limits,
    what: &'static str,
) -> Infallible {
    let connections = Arc::new(Connections {
        table: Mutex::default(),
        changed: Notify::new(),
        max: limits.max_connections.max(1),
    });
    let mut last_said: Option<Instant> = None;
    loop {
        let io = match listener.accept().await {
            Ok(io) => io,
            Err(e) => {
                if last_said.is_none_or(|t| t.elapsed() >= ACCEPT_ERROR_LOG_INTERVAL) {
                    tracing::warn!(listener = what, error = %e, "cannot accept a connection");
                    last_said = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let slot = connections.admit().await;
        tokio::spawn(connection(
            io,
            slot,
            router.clone(),
            limits.header_timeout,
            what,
        ));
    }
}

async fn connection<I>(
    io: I,
    slot: Slot,
    router: Router,
    header_timeout: Duration,
    what: &'static str,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (connections, id) = (slot.connections.clone(), slot.id);
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let in_progress = InProgress::begin(&connections, id);
        let mut router = router.clone();
        async move {
            let response = match router.call(request).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            if response.status() == StatusCode::SWITCHING_PROTOCOLS {
                in_progress.upgrading();
            }
            Ok::<_, Infallible>(response.map(|body| {
                Body::new(Tracked {
                    body,
                    _in_progress: in_progress,
                })
            }))
        }
    });
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    tokio::pin!(served);
    loop {
        tokio::select! {
            r = &mut served => {
                if let Err(e) = r {
                    tracing::debug!(listener = what, error = %e, "connection ended");
                }
                break;
            }
            () = slot.close.notified() => {
                if slot.connections.close_if_idle(slot.id) {
                    tracing::debug!(listener = what, "idle connection closed to make room for a new one");
                    break;
                }
            }
        }
    }
    drop(slot);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn open(activity: Activity) -> Open {
        Open {
            activity,
            closing: false,
        }
    }

    #[test]
    fn room_is_made_by_closing_the_longest_idle_connection() {
        let mut t = BTreeMap::new();
        t.insert(1, open(Activity::Busy { requests: 1 }));
        t.insert(2, open(Activity::Idle { since: 9 }));
        t.insert(3, open(Activity::Idle { since: 4 }));
        t.insert(4, open(Activity::Upgrading));
        assert_eq!(admission(&t, 5), Admission::Serve);
        assert_eq!(admission(&t, 4), Admission::Close(3));
        t.get_mut(&3).unwrap().closing = true;
        assert_eq!(admission(&t, 4), Admission::Wait);
        t.remove(&3);
        assert_eq!(admission(&t, 4), Admission::Serve);
        t.insert(5, open(Activity::Busy { requests: 2 }));
        t.remove(&2);
        t.insert(2, open(Activity::Busy { requests: 1 }));
        assert_eq!(admission(&t, 4), Admission::Wait);
    }

    fn activity() -> impl Strategy<Value = Activity> {
        prop_oneof![
            (0u64..50).prop_map(|since| Activity::Idle { since }),
            (1u32..3).prop_map(|requests| Activity::Busy { requests }),
            Just(Activity::Upgrading),
        ]
    }

    proptest! {
        #[test]
        fn only_an_idle_connection_is_ever_closed_and_never_below_the_limit(
            conns in proptest::collection::vec((activity(), any::<bool>()), 0..12),
            max in 1usize..12,
        ) {
            let t: BTreeMap<u64, Open> = conns
                .iter()
                .enumerate()
                .map(|(i, (a, closing))| (i as u64, Open { activity: *a, closing: *closing }))
                .collect();
            match admission(&t, max) {
                Admission::Serve => prop_assert!(t.len() < max),
                Admission::Close(id) => {
                    prop_assert!(t.len() >= max);
                    prop_assert!(!t.values().any(|o| o.closing));
                    let Activity::Idle { since } = t[&id].activity else {
                        return Err(TestCaseError::fail("closed a connection that is not idle"));
                    };
                    for o in t.values() {
                        if let Activity::Idle { since: other } = o.activity {
                            prop_assert!(since <= other);
                        }
                    }
                }
                Admission::Wait => {
                    prop_assert!(t.len() >= max);
                    let idle = t.values().any(|o| matches!(o.activity, Activity::Idle { .. }));
                    prop_assert!(!idle || t.values().any(|o| o.closing));
                }
            }
        }
    }
}
