//! VirtualMachine lifecycle: a pure decision core and the async shell that
//! carries its steps out against QEMU.

mod boot;
mod chain;
pub mod console;
pub mod decide;
mod error;
pub mod firmware;
pub mod graceful;
pub mod launches;
pub mod live;
mod modules;
pub mod nics;
mod reconcile;
pub mod registry;
pub mod seed;
mod start;
mod stop;

pub use error::VmError;
pub use reconcile::reconcile;

use hearth_api::{VirtualMachineStatus, VmPhase};

use crate::context::Context;
use crate::runtime::RuntimeRecord;

/// The part of a spec that needs a restart to take effect.
pub fn fingerprint(vm: &hearth_api::VirtualMachine) -> String {
    let s = &vm.spec;
    serde_json::json!({
        "cpus": s.cpus,
        "memoryBytes": s.memory.bytes(),
        "boot": s.boot,
        "firmware": s.firmware,
        "disks": s.disks,
        "cloudInit": s.cloud_init,
        "guestAgent": s.guest_agent,
    })
    .to_string()
}

/// The status of a VM whose QEMU runs now, started or adopted: what the
/// runtime record says, plus what `more` adds.
pub(crate) fn mark_running(
    ctx: &Context,
    record: &RuntimeRecord,
    more: impl FnOnce(&mut VirtualMachineStatus),
) {
    ctx.set_vm_status(&record.vm, |s| {
        s.phase = VmPhase::Running;
        s.pid = Some(record.process.pid);
        s.accelerator = Some(record.accel.as_str().to_string());
        s.start_time = Some(record.started_at);
        s.agent_connected = false;
        s.last_error = None;
        more(s);
    });
}
