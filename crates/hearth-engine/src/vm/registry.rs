//! The live VMs: one handle per running QEMU this daemon is connected to.
//! Plain data and a map; attaching to a VM is in `vm::live`.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use hearth_qemu::agent::AgentClient;
use hearth_qemu::qmp::QmpClient;
use tokio::task::JoinHandle;

use crate::runtime::RuntimeRecord;

/// The live side of one running VM.
pub struct LiveVm {
    pub record: RuntimeRecord,
    pub qmp: Option<QmpClient>,
    /// The one guest-agent connection (the chardev accepts a single client);
    /// everything that talks to the guest takes this lock.
    pub agent: Arc<tokio::sync::Mutex<Option<AgentClient>>>,
    pub agent_connected: Arc<AtomicBool>,
    /// QMP `SHUTDOWN` was seen: the guest (or we) asked to power off.
    pub shutdown_seen: Arc<AtomicBool>,
    /// Set while hearthd itself is stopping the VM.
    pub stopping: Arc<AtomicBool>,
    pub(super) tasks: Vec<JoinHandle<()>>,
}

impl Drop for LiveVm {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The live handles, by VM name.
#[derive(Default)]
pub struct LiveVms(Mutex<HashMap<String, Arc<LiveVm>>>);

impl LiveVms {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<LiveVm>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, vm: &str) -> Option<Arc<LiveVm>> {
        self.lock().get(vm).cloned()
    }

    pub fn insert(&self, vm: &str, live: Arc<LiveVm>) {
        self.lock().insert(vm.to_string(), live);
    }

    pub fn take(&self, vm: &str) -> Option<Arc<LiveVm>> {
        self.lock().remove(vm)
    }
}
