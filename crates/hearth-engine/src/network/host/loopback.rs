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

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddrV4};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use super::{HostNetwork, NetworkMode, Protocol};

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
    pub fn sync(&mut self, networks: &[HostNetwork]) -> Vec<(LoopbackForward, std::io::Error)> {
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
                    self.running
                        .insert(f, Listener(tokio::spawn(serve(listener, f))));
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

async fn serve(listener: TcpListener, f: LoopbackForward) {
    loop {
        let (mut client, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors and the like: go on after a pause.
                tracing::warn!(listen = %f.listen, error = %e, "accepting a loopback connection");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        tokio::spawn(async move {
            let mut guest = match TcpStream::connect(f.guest).await {
                Ok(g) => g,
                Err(e) => {
                    tracing::debug!(%peer, guest = %f.guest, error = %e, "loopback forward: guest not reached");
                    return;
                }
            };
            let _ = client.set_nodelay(true);
            let _ = guest.set_nodelay(true);
            if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut guest).await {
                tracing::debug!(%peer, guest = %f.guest, error = %e, "loopback forward ended");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::host::PortForward;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn net(mode: NetworkMode, forwards: Vec<PortForward>) -> HostNetwork {
        HostNetwork {
            bridge: "hth0".into(),
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
        assert!(proxies.sync(&nets).is_empty());
        assert_eq!(proxies.listening().len(), 1);

        let mut c = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        c.write_all(b"ping through hearth").await.expect("write");
        let mut got = vec![0u8; 19];
        c.read_exact(&mut got).await.expect("read");
        assert_eq!(got, b"ping through hearth");

        // The forward goes: the port is closed.
        proxies.sync(&[]);
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
        let failed = proxies.sync(&nets);
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].1.kind(), std::io::ErrorKind::AddrInUse);
        assert!(proxies.listening().is_empty());
        drop(other);
        assert!(proxies.sync(&nets).is_empty(), "tried again once free");
    }
}
