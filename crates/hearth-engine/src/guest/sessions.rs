//! The programs started in guests through `hearth exec`, by id, until their
//! result is collected. Plain data; starting and polling them is in `exec`.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use hearth_qemu::ProcessIdentity;
use hearth_qemu::agent::ExecOutput;
use tokio::sync::watch;
use tokio::time::Instant;

/// The running and recently finished programs hearthd started, by id.
#[derive(Default)]
pub struct Execs {
    pub(crate) sessions: Arc<Mutex<HashMap<u64, Arc<Session>>>>,
    pub(crate) next_id: AtomicU64,
}

pub(crate) struct Session {
    pub(crate) vm: String,
    pub(crate) pid: i64,
    pub(crate) process: ProcessIdentity,
    pub(crate) state: watch::Sender<State>,
    /// When a client last asked; the poller slows down when nobody does.
    pub(crate) asked: Mutex<Instant>,
}

#[derive(Clone)]
pub(crate) enum State {
    Running,
    Exited(Arc<ExecOutput>),
    Failed(String),
}

impl Execs {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Session>>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn running_for(&self, vm: &str) -> usize {
        self.lock()
            .values()
            .filter(|s| s.vm == vm && matches!(*s.state.borrow(), State::Running))
            .count()
    }
}
