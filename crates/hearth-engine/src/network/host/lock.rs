//! The host side of networking's one lock: one resync at a time. Plain
//! data; what is done under it is in `network::sync`.

use super::HostError;
use super::link::Netlink;
use super::loopback::LoopbackProxies;

/// The host side's one lock, its netlink socket (opened on first use, in
/// the namespace hearthd runs in) and the loopback port forwards' listeners.
#[derive(Default)]
pub struct HostNetworking {
    state: tokio::sync::Mutex<HostState>,
}

#[derive(Default)]
pub(crate) struct HostState {
    netlink: Option<Netlink>,
    pub(crate) loopback: LoopbackProxies,
}

/// Held while the host is read or changed.
pub struct HostGuard<'a> {
    pub(crate) state: tokio::sync::MutexGuard<'a, HostState>,
}

impl HostNetworking {
    pub async fn lock(&self) -> HostGuard<'_> {
        HostGuard {
            state: self.state.lock().await,
        }
    }
}

impl HostGuard<'_> {
    pub fn netlink(&mut self) -> Result<&Netlink, HostError> {
        if self.state.netlink.is_none() {
            self.state.netlink = Some(Netlink::open()?);
        }
        Ok(self.state.netlink.as_ref().expect("just opened"))
    }
}
