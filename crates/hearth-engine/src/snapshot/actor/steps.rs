//! The QEMU and guest-agent steps of a cut, over the seam's traits
//! ([`Monitor`], [`GuestAgent`]) so they run against the fake in tests, and
//! the actor's waits on time, written on tokio's clock so tests run them on
//! paused time.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hearth_qemu::agent::{AgentError, FreezeStatus};
use hearth_qemu::qmp::QmpError;
use hearth_qemu::seam::{GuestAgent, Monitor};
use serde_json::Value;
use tokio::sync::{Mutex, mpsc};
use tokio::time::Instant;

use crate::snapshot::coordinator::{AgentFault, Coordinator, Input, TxResult};
use crate::snapshot::overlays::Graph;
use crate::snapshot::registry::Msg;

/// While a burst is under way (requests came during a cut), quiet time
/// that ends the gathering of its stragglers for the next cut...
pub(super) const GATHER: Duration = Duration::from_millis(50);
/// ...and the longest they wait for company. A request that finds the
/// actor idle waits for nobody.
pub(super) const MAX_GATHER: Duration = Duration::from_millis(300);

/// Gathers the stragglers of a burst into the coming cut: every request
/// that comes within [`GATHER`] of the one before, for at most
/// [`MAX_GATHER`]. True when the channel closed.
pub(super) async fn gather(
    rx: &mut mpsc::UnboundedReceiver<Msg>,
    core: &mut Coordinator,
    compact: &mut BTreeSet<String>,
    ahead_due: &mut bool,
) -> bool {
    let started = Instant::now();
    while started.elapsed() < MAX_GATHER {
        match tokio::time::timeout(GATHER, rx.recv()).await {
            Ok(Some(Msg::Requests(rs))) => {
                for r in rs {
                    core.handle(Input::Requested(r));
                }
            }
            // Not held by a group while idle: nothing to act on.
            Ok(Some(Msg::Group(_))) => {}
            Ok(Some(Msg::Compact(d))) => {
                compact.insert(d);
            }
            Ok(Some(Msg::Ahead)) => *ahead_due = true,
            Ok(None) => return true,
            Err(_) => break,
        }
    }
    false
}

/// Waits until the guest agent's connection is up (`connected`) or
/// `deadline`; true when it came up.
pub(super) async fn await_agent(connected: &AtomicBool, deadline: Instant) -> bool {
    while !connected.load(Ordering::SeqCst) {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    true
}

/// Freezes `mountpoints` (every filesystem when `None`); how many froze.
pub(super) async fn freeze<A: GuestAgent>(
    agent: &Mutex<Option<A>>,
    timeout: Duration,
    mountpoints: &Option<Vec<String>>,
) -> Result<u32, AgentFault> {
    with_agent(agent, timeout, async |c, t| match mountpoints {
        Some(list) => c.fsfreeze_freeze_list(list, t).await,
        None => c.fsfreeze_freeze(t).await,
    })
    .await
}

/// Whether the guest is frozen.
pub(super) async fn frozen<A: GuestAgent>(
    agent: &Mutex<Option<A>>,
    timeout: Duration,
) -> Result<bool, AgentFault> {
    with_agent(agent, timeout, async |c, t| c.fsfreeze_status(t).await)
        .await
        .map(|s| s == FreezeStatus::Frozen)
}

/// Thaws the guest; how many filesystems thawed, `None` when
/// `only_if_frozen` and it was not frozen.
pub(super) async fn thaw<A: GuestAgent>(
    agent: &Mutex<Option<A>>,
    timeout: Duration,
    only_if_frozen: bool,
) -> Result<Option<u32>, AgentFault> {
    with_agent(agent, timeout, async |c, t| {
        // Thaw only a frozen guest: its thaw hook must never run without a
        // freeze before it.
        if only_if_frozen && c.fsfreeze_status(t).await? == FreezeStatus::Thawed {
            return Ok(None);
        }
        c.fsfreeze_thaw(t).await.map(Some)
    })
    .await
}

/// Runs the cut's `blockdev-snapshot` actions in one transaction. An error
/// QEMU answered means it did not run; no answer means nobody knows yet.
pub(super) async fn transaction<M: Monitor>(
    qmp: Option<&M>,
    actions: Vec<Value>,
    timeout: Duration,
) -> TxResult {
    let Some(qmp) = qmp else {
        return TxResult::Rejected("no QMP connection".into());
    };
    match qmp.transaction(actions, timeout).await {
        Ok(_) => TxResult::Applied,
        Err(e @ QmpError::Command { .. }) => TxResult::Rejected(e.to_string()),
        Err(e) => TxResult::Unknown(e.to_string()),
    }
}

/// Did the transaction run? `switches` are the cut's (device index,
/// overlay node): each device's top node is the overlay (ran) or not (did
/// not). A transaction is atomic, so a mix, or no answer within `timeout`,
/// is unknown.
pub(super) async fn observe<M: Monitor>(
    qmp: &M,
    switches: &[(usize, &str)],
    timeout: Duration,
) -> Option<bool> {
    let graph = Graph::query(qmp, timeout).await.ok()?;
    let mut seen = BTreeSet::new();
    for (i, node) in switches {
        seen.insert(graph.top_node(*i) == Some(*node));
    }
    match (seen.contains(&true), seen.contains(&false)) {
        (true, false) => Some(true),
        (false, true) => Some(false),
        _ => None,
    }
}

fn fault(e: AgentError) -> AgentFault {
    if e.is_disabled_while_frozen() {
        return AgentFault::DisabledWhileFrozen;
    }
    match e {
        AgentError::Timeout { .. } => AgentFault::Timeout,
        AgentError::Disconnected | AgentError::Connect { .. } | AgentError::Io(_) => {
            AgentFault::Disconnected
        }
        other => AgentFault::Error(other.to_string()),
    }
}

/// Runs `f` on the VM's agent connection within `timeout`, waiting for the
/// connection to come up if it is not there yet.
pub(super) async fn with_agent<A: GuestAgent, T>(
    agent: &tokio::sync::Mutex<Option<A>>,
    timeout: Duration,
    f: impl AsyncFnOnce(&mut A, Duration) -> Result<T, AgentError>,
) -> Result<T, AgentFault> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Err(AgentFault::Timeout);
        }
        let mut guard = match tokio::time::timeout(left, agent.lock()).await {
            Ok(g) => g,
            Err(_) => return Err(AgentFault::Timeout),
        };
        if let Some(client) = guard.as_mut() {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            return f(client, left.max(Duration::from_millis(1)))
                .await
                .map_err(fault);
        }
        drop(guard);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
