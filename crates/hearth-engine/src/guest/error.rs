//! Why guest access (the API's agent calls, `hearth exec`, `hearth cp`)
//! cannot be had right now: the VM has no agent, the agent is not connected
//! or a call through it failed. All are conflicts (409). What the guest
//! itself refuses is `RequestError::Guest`; what is not there,
//! `RequestError::NotInGuest`.

use hearth_qemu::agent::AgentError;

use super::CallError;

#[derive(Debug, thiserror::Error)]
pub enum GuestAccessError {
    /// The API's own agent calls (ping, freeze status, a short exec).
    #[error("VirtualMachine {vm:?} has spec.guestAgent false")]
    AgentOff { vm: String },
    #[error("VirtualMachine {vm:?}: the guest agent is not connected yet")]
    NotConnectedYet { vm: String },
    #[error("VirtualMachine {vm:?}: guest agent: {reason}")]
    Agent { vm: String, reason: AgentError },
    #[error("VirtualMachine {vm:?} stopped while the program ran")]
    StoppedWhileRunning { vm: String },
    /// `hearth exec` and `hearth cp`.
    #[error("VirtualMachine {vm:?} has no guest agent (spec.guestAgent is false)")]
    NoAgent { vm: String },
    #[error(
        "VirtualMachine {vm:?} was started without a guest agent channel; restart it to get one"
    )]
    NoChannel { vm: String },
    #[error(
        "VirtualMachine {vm:?}: its guest agent is not connected (the guest may still be booting: hearth wait vm {vm} --for agent)"
    )]
    NotConnected { vm: String },
    /// `limit` is `guest::exec::MAX_RUNNING`.
    #[error(
        "VirtualMachine {vm:?}: {limit} programs started through hearthd are still running; wait for some to end"
    )]
    TooManyPrograms { vm: String, limit: usize },
    /// A program whose end hearthd could not collect; `why` says what
    /// happened to it.
    #[error("VirtualMachine {vm:?}: program {id} (pid {pid} in the guest): {why}")]
    ProgramLost {
        vm: String,
        id: u64,
        pid: i64,
        why: String,
    },
    #[error(
        "VirtualMachine {vm:?}: copying into the guest needs guest-exec of /bin/sh (to create the file privately and rename it into place when complete), which the guest agent refused: {reason}"
    )]
    NoShell { vm: String, reason: CallError },
    /// A call through the shared channel that could not be made; `doing`
    /// says what it was for (`cannot open /etc/x in the guest`).
    #[error("VirtualMachine {vm:?}: {doing}: {reason}")]
    Call {
        vm: String,
        doing: String,
        reason: CallError,
    },
}
