//! What goes in and out of the coordinator: requests, the mount map and
//! the freeze scope made from it, inputs, commands and outcomes.

use std::collections::{BTreeMap, BTreeSet};

pub type CutId = u64;
/// Milliseconds on a monotonic clock.
pub type Millis = u64;

/// One disk snapshot to take.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Request {
    pub snapshot: String,
    pub disk: String,
    pub required: bool,
    /// Part of a VM snapshot: the cut freezes every filesystem of the guest.
    pub whole_vm: bool,
    /// Part of a VirtualMachineSnapshotGroup (its name): cut only with the
    /// group's other requests for this VM, and held at the group's three
    /// barriers (see [`Command::GroupReport`]).
    pub group: Option<String>,
}

/// Which of the guest's mounted filesystems lie on which disk, as the guest
/// agent reported them before the freeze (`guest-get-fsinfo`, matched to the
/// running QEMU's devices).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Mounts {
    /// For each disk of the VM, the mount points of the filesystems that lie
    /// wholly or partly on it (a filesystem on several disks is under each).
    pub by_disk: BTreeMap<String, Vec<String>>,
    /// Mount points that lie on no disk of the VM (or on a device hearth
    /// does not know).
    pub unmapped: Vec<String>,
}

/// What a cut freezes, decided from its requests and the mount map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Every filesystem of the guest (`guest-fsfreeze-freeze`). `why` says
    /// why a cut of some disks only froze everything; `None` for a cut with
    /// a VM snapshot in it.
    All { why: Option<String> },
    /// Only these mount points, sorted (`guest-fsfreeze-freeze-list`). Empty:
    /// no mounted filesystem lies on the cut's disks, so nothing is frozen.
    List(Vec<String>),
}

/// The freeze a cut of `requests` needs. A VM snapshot in the cut freezes
/// everything. Otherwise the cut freezes the filesystems that lie on any of
/// its disks (one that spans disks, LVM or md, when any of them is cut),
/// unless the map cannot be trusted to name them all: the agent could not
/// list the filesystems, a filesystem lies on no disk hearth knows, or a cut
/// disk is not in the map. Then everything is frozen, and `why` says so.
pub fn freeze_scope(requests: &[Request], mounts: Option<&Result<Mounts, MountsUnknown>>) -> Scope {
    if requests.iter().any(|r| r.whole_vm) {
        return Scope::All { why: None };
    }
    let all = |why: String| Scope::All { why: Some(why) };
    let m = match mounts {
        None => return all("the guest's filesystems were not listed before the freeze".into()),
        Some(Err(e)) => {
            return all(format!(
                "the guest agent could not list the filesystems ({e})"
            ));
        }
        Some(Ok(m)) => m,
    };
    if !m.unmapped.is_empty() {
        let noun = if m.unmapped.len() == 1 {
            "filesystem"
        } else {
            "filesystems"
        };
        return all(format!(
            "{noun} {} could not be mapped to a disk",
            m.unmapped.join(", ")
        ));
    }
    let mut list = BTreeSet::new();
    for r in requests {
        match m.by_disk.get(&r.disk) {
            Some(points) => list.extend(points.iter().cloned()),
            None => {
                return all(format!(
                    "VirtualDisk {:?} is not among the disks the guest's filesystems were matched to",
                    r.disk
                ));
            }
        }
    }
    Scope::List(list.into_iter().collect())
}

/// How the VM can be reached when a cut starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Access {
    /// Not running (or the disk is not attached): an offline cut, no freeze.
    Offline,
    /// Running, with a guest agent that answers.
    Agent,
    /// Running without an agent to freeze with; the text says why.
    NoAgent(String),
}

/// Why the guest's filesystems could not be matched to the disks: what
/// the guest agent or QEMU answered, shown in the snapshots' status.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct MountsUnknown(pub String);

/// Why the store did not take a cut's freeze intent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct IntentNotRecorded(pub String);

impl From<&str> for MountsUnknown {
    fn from(why: &str) -> Self {
        MountsUnknown(why.to_string())
    }
}

impl From<&str> for IntentNotRecorded {
    fn from(why: &str) -> Self {
        IntentNotRecorded(why.to_string())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentFault {
    Timeout,
    Disconnected,
    /// The agent refuses freeze/exec because the guest is already frozen.
    DisabledWhileFrozen,
    Error(String),
}

impl std::fmt::Display for AgentFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AgentFault::Timeout => f.write_str("the guest agent did not answer in time"),
            AgentFault::Disconnected => f.write_str("the guest agent connection was lost"),
            AgentFault::DisabledWhileFrozen => {
                f.write_str("the guest was already frozen by someone else")
            }
            AgentFault::Error(e) => write!(f, "the guest agent returned an error: {e}"),
        }
    }
}

/// What became of a QMP `transaction` (atomic: all or nothing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxResult {
    Applied,
    /// QEMU answered that it did not apply it.
    Rejected(String),
    /// No answer (timeout, lost connection): QEMU may or may not have run it.
    Unknown(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    Requested(Request),
    /// The shell asks to start a cut if one is due; `access` is how the VM
    /// can be reached right now, and `cut` a fresh id from the durable
    /// counter (used only if a cut starts).
    Start {
        access: Access,
        cut: CutId,
        now: Millis,
    },
    /// Every disk's overlay is ready, except those in `failed` (disk, why),
    /// whose requests fail alone.
    Prepared {
        cut: CutId,
        failed: Vec<(String, String)>,
        /// The guest's filesystems by disk, read while preparing (live cuts
        /// with an agent); the error when the agent could not say.
        mounts: Option<Result<Mounts, MountsUnknown>>,
        now: Millis,
    },
    /// The freeze intent was (or could not be) stored.
    IntentRecorded {
        cut: CutId,
        result: Result<(), IntentNotRecorded>,
        now: Millis,
    },
    FreezeReplied {
        cut: CutId,
        result: Result<u32, AgentFault>,
        now: Millis,
    },
    /// `Ok(true)`: `guest-fsfreeze-status` said frozen.
    StatusReplied {
        cut: CutId,
        result: Result<bool, AgentFault>,
        now: Millis,
    },
    Transacted {
        cut: CutId,
        result: TxResult,
        now: Millis,
    },
    /// What QEMU's block graph says about a transaction whose outcome was
    /// unknown: `Some(applied)`, or `None` when QEMU cannot be asked.
    Observed {
        cut: CutId,
        applied: Option<bool>,
        now: Millis,
    },
    ThawReplied {
        cut: CutId,
        result: Result<u32, AgentFault>,
        now: Millis,
    },
    /// The shell has executed a `Commit`; `ok: false` when the store
    /// write failed (it is then sent again).
    Committed {
        cut: CutId,
        ok: bool,
    },
    /// The group lets a member held before its freeze go on: every member is
    /// prepared and the group's intent is stored. `deadline` is the group's
    /// one deadline, on the same clock as `now`.
    GroupGoFreeze {
        cut: CutId,
        deadline: Millis,
        now: Millis,
    },
    /// The group lets a member held before its transaction cut: every
    /// member is frozen (or needs no freeze).
    GroupGoCut {
        cut: CutId,
        now: Millis,
    },
    /// The group failed: the member thaws at once if it may be frozen, cuts
    /// nothing more, and fails its requests with `why`.
    GroupAbort {
        cut: CutId,
        why: String,
        now: Millis,
    },
    /// Every member has cut: a member held frozen after its transaction
    /// thaws.
    GroupGoThaw {
        cut: CutId,
    },
    /// Time passed; a member held frozen thaws by its deadline on its own,
    /// whatever the group does. See [`Coordinator::wake_at`].
    Tick {
        now: Millis,
    },
}

/// Where a member of a group stands, reported to the group at its barriers.
/// (Each is what it is ready for: the names say so.)
#[derive(Clone, Debug, PartialEq, Eq)]
#[allow(clippy::enum_variant_names)]
pub enum GroupReport {
    /// Prepared, and about to record its intent and freeze: held until
    /// [`Input::GroupGoFreeze`].
    ReadyToFreeze,
    /// About to run its transaction: held until [`Input::GroupGoCut`].
    /// `frozen`: its guest is frozen and the freeze is trusted; false for a
    /// cut that needs no freeze (offline, nothing mounted) or one that goes
    /// on crash-consistent.
    ReadyToCut { frozen: bool },
    /// Its transaction is over and its guest still frozen: held until
    /// [`Input::GroupGoThaw`] (or its deadline).
    ReadyToThaw,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ready {
        consistent: bool,
    },
    Failed(String),
    /// Back to Pending for another cut (after a daemon restart mid-cut).
    Retry,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Create the overlay files and block nodes, before any freeze.
    Prepare {
        cut: CutId,
        disks: Vec<String>,
    },
    /// Store the freeze intent durably; `Freeze` follows only once it is.
    RecordIntent {
        cut: CutId,
        deadline: Millis,
    },
    /// `mountpoints`: freeze only these (`guest-fsfreeze-freeze-list`),
    /// never empty; `None`: every filesystem.
    Freeze {
        cut: CutId,
        timeout: Millis,
        mountpoints: Option<Vec<String>>,
    },
    QueryFreeze {
        cut: CutId,
        timeout: Millis,
    },
    /// One atomic QMP transaction over every disk (or, offline, switching
    /// the disks' active layers).
    Transact {
        cut: CutId,
        timeout: Millis,
    },
    /// Read QEMU's block graph (`query-block`, on the monitor the
    /// transaction went to): did the transaction run? `while_frozen`: the
    /// guest is still frozen and the read is bounded by the deadline, so a
    /// switch it sees happened inside the freeze.
    Observe {
        cut: CutId,
        timeout: Millis,
        while_frozen: bool,
    },
    /// `only_if_frozen`: read `guest-fsfreeze-status` first and thaw only a
    /// frozen guest, so the guest's thaw hook never runs without a freeze.
    /// Not needed right after a status read said frozen.
    Thaw {
        cut: CutId,
        timeout: Millis,
        only_if_frozen: bool,
    },
    /// Drop what `Prepare` made, as QEMU's block graph shows it: an overlay
    /// QEMU uses is kept as the disk's head, the rest removed.
    Discard {
        cut: CutId,
    },
    /// Tell the cut's group where this member stands; the member is held
    /// until the group answers (go on, or abort).
    GroupReport {
        cut: CutId,
        report: GroupReport,
    },
    /// Record every request's outcome and settle the intent, in one store
    /// transaction. `took_cut`: the transaction happened, so the disks' new
    /// active layers must be recorded too. `keep_intent`: the thaw was not
    /// confirmed, so the intent stays and a restarted daemon thaws first.
    Commit {
        cut: CutId,
        outcomes: Vec<(String, Outcome)>,
        took_cut: bool,
        freeze_window_ms: Option<Millis>,
        keep_intent: bool,
        /// Why the cut is not consistent, if it is not.
        why_not_consistent: Option<String>,
        /// Why a cut of some disks only froze every filesystem of the guest.
        full_freeze: Option<String>,
    },
}
