//! TCP port forwards reached on the host's loopback address
//! (`ssh -p 2222 127.0.0.1`).
//!
//! The nftables forwards cannot serve loopback: a connection to 127.0.0.1
//! DNATed to a guest keeps its source 127.0.0.1, which the kernel drops on
//! any interface but `lo` unless `route_localnet` is set, and that setting
//! opens every service bound to 127.0.0.1 to the LAN's routed packets. So
//! hearthd listens on the loopback port itself and copies each connection
//! to the guest (as Docker's `docker-proxy` does); the guest sees the
//! bridge's gateway as the peer. The table's rules leave loopback alone
//! (`nft.rs`). TCP only: a UDP relay would need per-peer state for a
//! protocol without connections; UDP forwards are reached on the host's
//! other addresses.
//!
//! The listeners belong to the daemon: they are made by every network
//! resync (also the one at start-up, so a restarted hearthd listens again)
//! and dropped when their forward goes. A connection already made runs to
//! its end; a restart of hearthd ends it.
//!
//! Any local user can connect to 127.0.0.1, so what one connection costs
//! hearthd (two descriptors: the client's and the guest's) is bounded
//! ([`ForwardLimits`]): so many per listener and so many over all of them,
//! a connection beyond either closed at once; a guest that does not answer
//! the connection within the connect timeout, and a connection that carries
//! no byte either way for the idle timeout, are closed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

use super::{HostNetwork, NetworkMode, Protocol};

/// What the loopback forwards may hold (docs/limits.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardLimits {
    /// Connections one listener relays at once.
    pub per_listener: usize,
    /// Connections all listeners together relay at once.
    pub total: usize,
    /// Longest wait for the guest to accept a relayed connection.
    pub connect_timeout: Duration,
    /// A relayed connection with no byte either way for this long is closed.
    pub idle_timeout: Duration,
}

impl Default for ForwardLimits {
    fn default() -> Self {
        ForwardLimits {
            per_listener: 256,
            total: 1024,
            connect_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(600),
        }
    }
}

/// One loopback listener and the guest address it forwards to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct LoopbackForward {
    pub listen: SocketAddrV4,
    pub guest: SocketAddrV4,
}

/// The loopback listeners `networks` need: every TCP forward of a NAT
/// network that is not bound to a non-loopback host address, on its own
/// loopback address or 127.0.0.1.
pub fn wanted(networks: &[HostNetwork]) -> BTreeSet<LoopbackForward> {
    networks
        .iter()
        .filter(|n| n.mode == NetworkMode::Nat)
        .flat_map(|n| n.port_forwards.iter())
        .filter(|f| f.protocol == Protocol::Tcp)
        .filter_map(|f| {
            let addr = match f.host_addr {
                None => Ipv4Addr::LOCALHOST,
                Some(a) if a.is_loopback() => a,
                Some(_) => return None,
            };
            Some(LoopbackForward {
                listen: SocketAddrV4::new(addr, f.host_port),
                guest: SocketAddrV4::new(f.guest_ip, f.guest_port),
            })
        })
        .collect()
}

/// The running listeners. Dropping one stops it.
#[derive(Default)]
pub struct LoopbackProxies {
    running: BTreeMap<LoopbackForward, Listener>,
    /// The limits of the first sync (they are hearthd's configuration, the
    /// same at every sync) and the connections of all listeners together.
    shared: Option<(ForwardLimits, Arc<Semaphore>)>,
}

struct Listener(JoinHandle<()>);

impl Drop for Listener {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl LoopbackProxies {
    /// Makes the listeners exactly [`wanted`]`(networks)`. Returns the ones
    /// that could not listen (the port taken by another program), each
    /// with its error; they are tried again at the next resync.
    pub fn sync(
        &mut self,
        networks: &[HostNetwork],
        limits: &ForwardLimits,
    ) -> Vec<(LoopbackForward, std::io::Error)> {
        let (limits, total) = self
            .shared
            .get_or_insert_with(|| (*limits, Arc::new(Semaphore::new(limits.total))))
            .clone();
        let want = wanted(networks);
        self.running.retain(|f, _| want.contains(f));
        let mut failed = Vec::new();
        for f in want {
            if self.running.contains_key(&f) {
                continue;
            }
            match listen(f.listen) {
                Ok(listener) => {
                    tracing::info!(listen = %f.listen, guest = %f.guest, "loopback port forward listening");
                    let bounds = Bounds {
                        limits,
                        own: Arc::new(Semaphore::new(limits.per_listener)),
                        total: total.clone(),
                    };
                    self.running
                        .insert(f, Listener(tokio::spawn(serve(listener, f, bounds))));
                }
                Err(e) => failed.push((f, e)),
            }
        }
        failed
    }

    /// What listens now.
    pub fn listening(&self) -> Vec<LoopbackForward> {
        self.running.keys().copied().collect()
    }
}

/// Binds at once (so a taken port is told now, not in a task). std sets
/// `SO_REUSEADDR`, so a restarted hearthd binds again while connections of
/// the one before are in `TIME_WAIT`.
fn listen(addr: SocketAddrV4) -> std::io::Result<TcpListener> {
    let std_listener = std::net::TcpListener::bind(addr)?;
    std_listener.set_nonblocking(true)?;
    TcpListener::from_std(std_listener)
}

/// One listener's share of the limits.
struct Bounds {
    limits: ForwardLimits,
    /// This listener's connections.
    own: Arc<Semaphore>,
    /// Every listener's connections.
    total: Arc<Semaphore>,
}

impl Bounds {
    /// Room for one more connection, held until it ends; `None` (and
    /// which bound is full) when there is none.
    fn admit(&self) -> Result<(OwnedSemaphorePermit, OwnedSemaphorePermit), &'static str> {
        let own = self
            .own
            .clone()
            .try_acquire_owned()
            .map_err(|_| "the listener's limit (hearthd --forward-max-connections)")?;
        let total = self.total.clone().try_acquire_owned().map_err(
            |_| "the limit of all loopback forwards (hearthd --forward-max-connections-total)",
        )?;
        Ok((own, total))
    }
}

/// How often a full listener says so in the log, at most.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(60);

async fn serve(listener: TcpListener, f: LoopbackForward, bounds: Bounds) {
    let mut refused: u64 = 0;
    let mut last_said: Option<Instant> = None;
    loop {
        let (client, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors and the like: go on after a pause.
                tracing::warn!(listen = %f.listen, error = %e, "accepting a loopback connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let permits = match bounds.admit() {
            Ok(p) => p,
            Err(which) => {
                // Closed at once: the client sees the connection end.
                drop(client);
                refused += 1;
                if last_said.is_none_or(|t| t.elapsed() >= REFUSAL_LOG_INTERVAL) {
                    tracing::warn!(
                        listen = %f.listen,
                        guest = %f.guest,
                        refused,
                        "loopback forward full: connections closed at once; the bound is {which}"
                    );
                    last_said = Some(Instant::now());
                    refused = 0;
                }
                continue;
            }
        };
        tokio::spawn(relay(client, peer, f, bounds.limits, permits));
    }
}

async fn relay(
    client: TcpStream,
    peer: SocketAddr,
    f: LoopbackForward,
    limits: ForwardLimits,
    _permits: (OwnedSemaphorePermit, OwnedSemaphorePermit),
) {
    let guest = match tokio::time::timeout(limits.connect_timeout, TcpStream::connect(f.guest))
        .await
    {
        Ok(Ok(g)) => g,
        Ok(Err(e)) => {
            tracing::debug!(%peer, guest = %f.guest, error = %e, "loopback forward: guest not reached");
            return;
        }
        Err(_) => {
            tracing::debug!(%peer, guest = %f.guest, timeout = ?limits.connect_timeout, "loopback forward: the guest did not answer");
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = guest.set_nodelay(true);
    let activity = Activity::new();
    let mut client = Watched {
        inner: client,
        activity: activity.clone(),
    };
    let mut guest = Watched {
        inner: guest,
        activity: activity.clone(),
    };
    let copy = tokio::io::copy_bidirectional(&mut client, &mut guest);
    tokio::pin!(copy);
    loop {
        let quiet = activity.quiet_for();
        if quiet >= limits.idle_timeout {
            tracing::debug!(%peer, guest = %f.guest, idle = ?quiet, "loopback forward closed: idle");
            return;
        }
        tokio::select! {
            r = &mut copy => {
                if let Err(e) = r {
                    tracing::debug!(%peer, guest = %f.guest, error = %e, "loopback forward ended");
                }
                return;
            }
            () = tokio::time::sleep(limits.idle_timeout - quiet) => {}
        }
    }
}

/// When a relayed connection last carried a byte, either way.
#[derive(Clone)]
struct Activity {
    start: Instant,
    /// Milliseconds from `start` to the last byte.
    last_ms: Arc<AtomicU64>,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            start: Instant::now(),
            last_ms: Arc::new(AtomicU64::new(0)),
        }
    }

    fn touch(&self) {
        let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.fetch_max(now, Ordering::Relaxed);
    }

    fn quiet_for(&self) -> Duration {
        self.start
            .elapsed()
            .saturating_sub(Duration::from_millis(self.last_ms.load(Ordering::Relaxed)))
    }
}

/// A stream that marks its [`Activity`] at every byte read or written.
struct Watched {
    inner: TcpStream,
    activity: Activity,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, data);
        if let Poll::Ready(Ok(n)) = r
            && n > 0
        {
            self.activity.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::host::PortForward;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn net(mode: NetworkMode, forwards: Vec<PortForward>) -> HostNetwork {
        HostNetwork {
            bridge: "hth-0".into(),
            gateway: Ipv4Addr::new(10, 77, 0, 1),
            prefix_len: 24,
            mode,
            dhcp: true,
            dns: crate::network::host::Dns::Off,
            static_leases: vec![],
            port_forwards: forwards,
        }
    }

    fn fwd(protocol: Protocol, host_addr: Option<Ipv4Addr>, port: u16) -> PortForward {
        PortForward {
            protocol,
            host_addr,
            host_port: port,
            guest_ip: Ipv4Addr::new(10, 77, 0, 10),
            guest_port: 22,
        }
    }

    #[test]
    fn only_tcp_forwards_of_nat_networks_not_bound_elsewhere_listen_on_loopback() {
        let nat = net(
            NetworkMode::Nat,
            vec![
                fwd(Protocol::Tcp, None, 2222),
                fwd(Protocol::Tcp, Some(Ipv4Addr::new(127, 0, 0, 2)), 2223),
                fwd(Protocol::Tcp, Some(Ipv4Addr::new(192, 0, 2, 7)), 2224),
                fwd(Protocol::Udp, None, 5353),
            ],
        );
        let iso = net(NetworkMode::Isolated, vec![fwd(Protocol::Tcp, None, 2225)]);
        let guest = SocketAddrV4::new(Ipv4Addr::new(10, 77, 0, 10), 22);
        assert_eq!(
            wanted(&[nat, iso]).into_iter().collect::<Vec<_>>(),
            vec![
                LoopbackForward {
                    listen: SocketAddrV4::new(Ipv4Addr::LOCALHOST, 2222),
                    guest
                },
                LoopbackForward {
                    listen: SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 2), 2223),
                    guest
                },
            ]
        );
    }

    /// A real listener and a real "guest" (an echo server on loopback):
    /// bytes go both ways, a removed forward stops listening, and a taken
    /// port is reported and tried again.
    #[tokio::test]
    async fn a_forward_copies_both_ways_and_goes_with_its_network() {
        let echo = TcpListener::bind("127.0.0.1:0").await.expect("echo");
        let echo_port = echo.local_addr().expect("addr").port();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = echo.accept().await.expect("accept");
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    let n = s.read(&mut buf).await.expect("read");
                    s.write_all(&buf[..n]).await.expect("write");
                });
            }
        });
        // A free port for the forward: bound, read, let go.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let mut f = fwd(Protocol::Tcp, None, port);
        f.guest_ip = Ipv4Addr::LOCALHOST;
        f.guest_port = echo_port;
        let nets = vec![net(NetworkMode::Nat, vec![f])];
        let mut proxies = LoopbackProxies::default();
        assert!(proxies.sync(&nets, &ForwardLimits::default()).is_empty());
        assert_eq!(proxies.listening().len(), 1);

        let mut c = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        c.write_all(b"ping through hearth").await.expect("write");
        let mut got = vec![0u8; 19];
        c.read_exact(&mut got).await.expect("read");
        assert_eq!(got, b"ping through hearth");

        // The forward goes: the port is closed.
        proxies.sync(&[], &ForwardLimits::default());
        assert!(proxies.listening().is_empty());
        tokio::task::yield_now().await;
        let mut closed = false;
        for _ in 0..100 {
            if TcpStream::connect(("127.0.0.1", port)).await.is_err() {
                closed = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(closed, "the port still accepts after its forward went");

        // Taken by another program: reported, and not listening.
        let other = std::net::TcpListener::bind(("127.0.0.1", port)).expect("take the port");
        let failed = proxies.sync(&nets, &ForwardLimits::default());
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].1.kind(), std::io::ErrorKind::AddrInUse);
        assert!(proxies.listening().is_empty());
        drop(other);
        assert!(
            proxies.sync(&nets, &ForwardLimits::default()).is_empty(),
            "tried again once free"
        );
    }

    /// A free loopback port: bound, read, let go.
    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port()
    }

    /// A guest on loopback that accepts, reads and never writes; how many
    /// of its connections are open.
    async fn silent_guest() -> (u16, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("guest");
        let port = listener.local_addr().expect("addr").port();
        let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = open.clone();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.expect("accept");
                let count = count.clone();
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                    }
                    count.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        (port, open)
    }

    /// Whether the forward closed `c` within `within` (EOF or reset).
    async fn closed_within(c: &mut TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 64];
        match tokio::time::timeout(within, c.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => true,
            Ok(Ok(_)) => panic!("the silent guest sent something"),
            Err(_) => false,
        }
    }

    async fn until(what: &str, f: impl Fn() -> bool) {
        for _ in 0..300 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{what}: not after 3 s");
    }

    #[tokio::test]
    async fn connections_beyond_the_bounds_are_closed_at_once_and_idle_ones_after_the_timeout() {
        let (guest_port, open) = silent_guest().await;
        let (a, b) = (free_port(), free_port());
        let mut forwards = vec![fwd(Protocol::Tcp, None, a), fwd(Protocol::Tcp, None, b)];
        for f in &mut forwards {
            f.guest_ip = Ipv4Addr::LOCALHOST;
            f.guest_port = guest_port;
        }
        let limits = ForwardLimits {
            per_listener: 3,
            total: 5,
            connect_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_millis(1500),
        };
        let mut proxies = LoopbackProxies::default();
        assert!(
            proxies
                .sync(&[net(NetworkMode::Nat, forwards)], &limits)
                .is_empty()
        );

        // Three on the first listener, its fourth closed at once; two more
        // on the second, then all of them are full.
        let mut kept = Vec::new();
        for (port, admitted) in [(a, 3), (a, 0), (b, 2), (b, 0), (a, 0)] {
            let tries = admitted.max(1);
            for _ in 0..tries {
                let mut c = TcpStream::connect(("127.0.0.1", port))
                    .await
                    .expect("connect");
                if admitted == 0 {
                    assert!(
                        closed_within(&mut c, Duration::from_secs(2)).await,
                        "a connection beyond the bounds on port {port} stayed open"
                    );
                } else {
                    kept.push(c);
                }
            }
        }
        until("the guest holds five", || open.load(Ordering::SeqCst) == 5).await;
        for c in &mut kept {
            assert!(!closed_within(c, Duration::from_millis(10)).await);
        }

        // One keeps talking past the idle timeout; the quiet ones are closed
        // after it, and their room is free again.
        let mut talker = kept.pop().expect("one");
        let started = Instant::now();
        while started.elapsed() < Duration::from_millis(2500) {
            talker.write_all(b"x").await.expect("still open");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        for c in &mut kept {
            assert!(
                closed_within(c, Duration::from_millis(10)).await,
                "idle, yet open"
            );
        }
        assert!(!closed_within(&mut talker, Duration::from_millis(10)).await);
        until("the guest holds one", || open.load(Ordering::SeqCst) == 1).await;
        let mut again = TcpStream::connect(("127.0.0.1", a)).await.expect("connect");
        assert!(!closed_within(&mut again, Duration::from_millis(200)).await);
    }
}
