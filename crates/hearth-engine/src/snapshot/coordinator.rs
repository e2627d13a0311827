//! The freeze coordinator of one VM: a pure state machine.
//!
//! Inputs are requests and the results of the commands it asked for; outputs
//! are commands. The async shell (`actor.rs`) performs the commands one at a
//! time, in order, with the timeouts given here, and feeds each result back.
//! Because one coordinator owns all freeze/thaw traffic of its VM and its
//! commands run strictly in sequence, two freezes, or a thaw during a cut,
//! cannot happen by construction; the property tests below check it anyway,
//! together with the rest of the protocol's invariants.
//!
//! A *cut* serves every request pending when it starts: one freeze, one
//! atomic transaction over every disk in the cut, one thaw. A cut starts as
//! soon as a request finds the coordinator idle (a lone request waits for
//! nobody). Requests that arrive while the cut is being prepared join it
//! when all their disks are among those prepared (all or none: requests made
//! together are never split); otherwise they wait for the next cut, which
//! the shell gathers briefly first (see [`Coordinator::gather_first`]), so a
//! burst of requests takes at most two cuts.
//!
//! The coordinator holds no counter of its own: the shell hands it a cut id
//! from the store's durable counter, so ids (and the QEMU node names made
//! from them) never repeat, not even across daemon restarts. Every result
//! the coordinator acts on is an observation: a transaction whose reply did
//! not come is looked up in QEMU before anything is decided.

use std::collections::{BTreeMap, BTreeSet};

pub type CutId = u64;
/// Milliseconds on a monotonic clock.
pub type Millis = u64;

/// Budget for the QMP transaction; it is only started if it can finish
/// before the deadline, so the guest is never frozen past the deadline.
pub const TRANSACTION_BUDGET_MS: Millis = 2_000;
/// Bound for one thaw attempt.
pub const THAW_TIMEOUT_MS: Millis = 5_000;
/// Bound for reading QEMU's block graph after the thaw (before it, the
/// time left to the deadline bounds it).
pub const OBSERVE_TIMEOUT_MS: Millis = 5_000;
/// A request that comes this soon after a cut ended may be a straggler of
/// the burst that cut served: the shell gathers before the next cut.
pub const BURST_WINDOW_MS: Millis = 300;

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
#[derive(Clone, Debug, PartialEq, Eq)]
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Offline,
    Live { freeze: bool },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Preparing,
    /// Thawing a guest that an earlier cut may have left frozen.
    ThawingPrevious,
    Freezing,
    Confirming,
    Transacting,
    /// The transaction's reply did not come: reading QEMU's block graph
    /// before the thaw.
    ObservingFrozen,
    Thawing,
    /// Reading QEMU's block graph after the thaw.
    Observing,
    Committing,
    /// A group member, prepared, waiting for the group to freeze.
    GroupHoldFreeze,
    /// A group member, ready to cut (frozen, or needing no freeze), waiting
    /// for every other member.
    GroupHoldCut,
    /// A group member, cut and still frozen, waiting for every other member
    /// to cut.
    GroupHoldThaw,
}

#[derive(Clone, Debug)]
struct Cut {
    id: CutId,
    requests: Vec<Request>,
    /// Outcomes fixed before the cut (no agent and consistency required).
    settled: Vec<(String, Outcome)>,
    mode: Mode,
    step: Step,
    /// The disks `Prepare` was asked for.
    disks: Vec<String>,
    deadline: Option<Millis>,
    freeze_sent_at: Option<Millis>,
    frozen_count: Option<u32>,
    /// Frozen is believed: our freeze reply, then a status read saying frozen.
    trusted: bool,
    /// The guest's filesystems by disk, from `Prepared`.
    mounts: Option<Result<Mounts, MountsUnknown>>,
    /// What the freeze covers, decided just before the intent.
    scope: Option<Scope>,
    /// No mounted filesystem lies on the cut's disks: nothing to freeze.
    nothing_to_freeze: bool,
    /// Why the cut is not consistent, once something made it so.
    distrust: Option<String>,
    thaw_done: bool,
    transacted: Option<TxResult>,
    window: Option<Millis>,
    recovered: bool,
    /// The commit, kept to be sent again if the store write fails.
    commit: Option<Command>,
    /// The group this cut serves, if it is a group member's cut.
    group: Option<String>,
    /// The group's deadline, once the group let the member freeze.
    group_deadline: Option<Millis>,
    /// The group let the member cut.
    group_go_cut: bool,
    /// The group failed: why.
    group_abort: Option<String>,
}

/// What survives a crash: the requests not yet settled, and the intent of a
/// cut whose thaw was never confirmed, with those of its requests that are
/// not settled yet.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Durable {
    pub pending: Vec<Request>,
    pub intent: Option<(CutId, Vec<Request>)>,
}

#[derive(Clone, Debug)]
pub struct Coordinator {
    deadline_ms: Millis,
    pending: Vec<Request>,
    cut: Option<Cut>,
    /// An earlier cut's thaw was never confirmed: the guest may be frozen.
    needs_thaw: bool,
    /// Requests arrived while a cut was running: a burst is under way.
    burst: bool,
    /// When the last cut was decided (its outcomes fixed).
    last_cut_end: Option<Millis>,
}

impl Cut {
    fn new(id: CutId, requests: Vec<Request>, mode: Mode, step: Step) -> Cut {
        let group = requests.first().and_then(|r| r.group.clone());
        Cut {
            id,
            requests,
            settled: Vec::new(),
            mode,
            step,
            disks: Vec::new(),
            deadline: None,
            freeze_sent_at: None,
            frozen_count: None,
            trusted: false,
            mounts: None,
            scope: None,
            nothing_to_freeze: false,
            distrust: None,
            thaw_done: false,
            transacted: None,
            window: None,
            recovered: false,
            commit: None,
            group,
            group_deadline: None,
            group_go_cut: false,
            group_abort: None,
        }
    }
}

impl Coordinator {
    pub fn new(deadline_ms: Millis) -> Self {
        Coordinator {
            deadline_ms,
            pending: Vec::new(),
            cut: None,
            needs_thaw: false,
            burst: false,
            last_cut_end: None,
        }
    }

    /// Rebuilds a coordinator after a daemon restart. A cut that was in its
    /// frozen window when the daemon died is settled first: thaw the guest
    /// (it may be frozen, and nobody else will), then put its requests back
    /// for a fresh cut, never claiming a consistency nobody can prove.
    pub fn recover(deadline_ms: Millis, durable: Durable) -> (Self, Vec<Command>) {
        let mut c = Coordinator::new(deadline_ms);
        let in_intent: BTreeSet<&str> = durable
            .intent
            .iter()
            .flat_map(|(_, r)| r.iter().map(|r| r.snapshot.as_str()))
            .collect();
        c.pending = durable
            .pending
            .iter()
            .filter(|r| !in_intent.contains(r.snapshot.as_str()))
            .cloned()
            .collect();
        let mut out = Vec::new();
        if let Some((id, requests)) = durable.intent {
            c.needs_thaw = true;
            let mut cut = Cut::new(id, requests, Mode::Live { freeze: true }, Step::Thawing);
            cut.distrust = Some("hearthd stopped during the cut".into());
            cut.recovered = true;
            c.cut = Some(cut);
            out.push(Command::Thaw {
                cut: id,
                timeout: THAW_TIMEOUT_MS,
                only_if_frozen: true,
            });
        }
        (c, out)
    }

    /// A new deadline (the VM's spec changed); used from the next cut on.
    pub fn set_deadline(&mut self, deadline_ms: Millis) {
        self.deadline_ms = deadline_ms;
    }

    pub fn is_idle(&self) -> bool {
        self.cut.is_none()
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    pub fn needs_thaw(&self) -> bool {
        self.needs_thaw
    }

    /// Whether the shell should gather more requests before the next
    /// `Start`: only when the pending ones arrived while a cut was running
    /// or within [`BURST_WINDOW_MS`] of its end (a burst is under way, and
    /// its stragglers should share the next cut rather than each take one).
    /// A request that finds the coordinator idle, with no cut just ended,
    /// starts its cut at once.
    pub fn gather_first(&self, now: Millis) -> bool {
        let just_cut = self
            .last_cut_end
            .is_some_and(|t| now < t.saturating_add(BURST_WINDOW_MS));
        (self.burst || just_cut) && self.cut.is_none() && !self.pending.is_empty()
    }

    /// Whether `Start` with this access would start a cut (and so needs a
    /// fresh cut id): requests are pending, or a thaw is owed and the agent
    /// can be reached (or no QEMU runs any more, and the owed thaw is moot).
    pub fn is_due(&self, access: &Access) -> bool {
        self.cut.is_none()
            && (!self.pending.is_empty()
                || (self.needs_thaw && matches!(access, Access::Agent | Access::Offline)))
    }

    pub fn current_cut(&self) -> Option<(CutId, Step)> {
        self.cut.as_ref().map(|c| (c.id, c.step))
    }

    pub fn pending(&self) -> &[Request] {
        &self.pending
    }

    /// Hands every pending request back (to move it to another actor); the
    /// shell gives back, as `Requested`, those that stay.
    pub fn take_pending(&mut self) -> Vec<Request> {
        std::mem::take(&mut self.pending)
    }

    /// What the cut in progress freezes, once decided (just before its
    /// intent).
    pub fn cut_scope(&self) -> Option<&Scope> {
        self.cut.as_ref().and_then(|c| c.scope.as_ref())
    }

    /// The requests of the cut in progress.
    pub fn cut_requests(&self) -> &[Request] {
        self.cut
            .as_ref()
            .map(|c| c.requests.as_slice())
            .unwrap_or(&[])
    }

    pub fn handle(&mut self, input: Input) -> Vec<Command> {
        match input {
            Input::Requested(r) => {
                let known = self.pending.iter().any(|p| p.snapshot == r.snapshot)
                    || self
                        .cut
                        .as_ref()
                        .is_some_and(|c| c.requests.iter().any(|p| p.snapshot == r.snapshot));
                if !known {
                    self.pending.push(r);
                    if self.cut.is_some() {
                        self.burst = true;
                    }
                }
                Vec::new()
            }
            Input::Start { access, cut, now } => self.start(access, cut, now),
            Input::Prepared {
                cut,
                failed,
                mounts,
                now,
            } => self.with_cut(cut, Step::Preparing, |c, this| {
                c.mounts = mounts;
                this.prepared(c, failed, now)
            }),
            Input::IntentRecorded { cut, result, now } => {
                self.with_cut(cut, Step::Freezing, |c, this| {
                    this.intent_recorded(c, result, now)
                })
            }
            Input::FreezeReplied { cut, result, now } => {
                self.with_cut(cut, Step::Freezing, |c, this| {
                    this.freeze_replied(c, result, now)
                })
            }
            Input::StatusReplied { cut, result, now } => {
                self.with_cut(cut, Step::Confirming, |c, this| {
                    this.status_replied(c, result, now)
                })
            }
            Input::Transacted { cut, result, now } => {
                self.with_cut(cut, Step::Transacting, |c, this| {
                    this.transacted(c, result, now)
                })
            }
            Input::Observed { cut, applied, now }
                if self
                    .cut
                    .as_ref()
                    .is_some_and(|c| c.id == cut && c.step == Step::ObservingFrozen) =>
            {
                self.with_cut(cut, Step::ObservingFrozen, |c, this| {
                    this.observed_frozen(c, applied, now)
                })
            }
            Input::Observed { cut, applied, now } => {
                self.with_cut(cut, Step::Observing, |c, this| {
                    c.transacted = Some(match applied {
                        Some(true) => TxResult::Applied,
                        Some(false) => {
                            TxResult::Rejected("QEMU did not apply the transaction".into())
                        }
                        None => TxResult::Unknown(
                            "QEMU did not answer, so whether the snapshot was cut is unknown"
                                .into(),
                        ),
                    });
                    this.finish(c, now)
                })
            }
            Input::ThawReplied { cut, result, now } => {
                let Some(c) = self.cut.as_ref() else {
                    return Vec::new();
                };
                if c.id != cut {
                    return Vec::new();
                }
                match c.step {
                    Step::ThawingPrevious => {
                        self.with_cut(cut, Step::ThawingPrevious, |c, this| {
                            this.previous_thawed(c, result, now)
                        })
                    }
                    _ => self.with_cut(cut, Step::Thawing, |c, this| {
                        this.thaw_replied(c, result, now)
                    }),
                }
            }
            Input::Committed { cut, ok } => {
                let Some(c) = self.cut.as_ref() else {
                    return Vec::new();
                };
                if c.id != cut || c.step != Step::Committing {
                    return Vec::new();
                }
                if ok {
                    self.cut = None;
                    Vec::new()
                } else {
                    // The results are not stored yet: write them again.
                    c.commit.clone().into_iter().collect()
                }
            }
            Input::GroupGoFreeze { cut, deadline, now } => {
                self.with_cut(cut, Step::GroupHoldFreeze, |c, this| {
                    c.group_deadline = Some(deadline);
                    this.record_intent(c, now)
                })
            }
            Input::GroupGoCut { cut, now } => {
                // A member that left its hold on its own (it thawed at its
                // deadline) keeps the permission for its crash-consistent
                // cut, if its requests allow one.
                if let Some(c) = self.cut.as_mut().filter(|c| c.id == cut)
                    && c.step != Step::GroupHoldCut
                {
                    if c.group.is_some() && c.group_abort.is_none() {
                        c.group_go_cut = true;
                    }
                    return Vec::new();
                }
                self.with_cut(cut, Step::GroupHoldCut, |c, this| {
                    c.group_go_cut = true;
                    if this.frozen_by_us(c)
                        && now + TRANSACTION_BUDGET_MS > c.deadline.unwrap_or(now)
                    {
                        c.distrust = Some(this.deadline_text());
                        return this.thaw_now(c);
                    }
                    this.transact(c)
                })
            }
            Input::GroupGoThaw { cut } => {
                self.with_cut(cut, Step::GroupHoldThaw, |c, this| this.thaw_now(c))
            }
            Input::GroupAbort { cut, why, now } => {
                let Some(step) = self.cut.as_ref().filter(|c| c.id == cut).map(|c| c.step) else {
                    return Vec::new();
                };
                self.with_cut(cut, step, |c, this| {
                    if c.step == Step::GroupHoldThaw {
                        // Cut already: thaw at once; the group settles what
                        // the cut is worth.
                        return this.thaw_now(c);
                    }
                    if c.group.is_none() || c.group_go_cut || c.group_abort.is_some() {
                        // Not a group cut, or past the point of no return:
                        // the group settles what this member cut.
                        return Vec::new();
                    }
                    c.group_abort = Some(why.clone());
                    match c.step {
                        Step::GroupHoldFreeze => this.abort_now(c, now),
                        Step::GroupHoldCut => {
                            if this.frozen_by_us(c) {
                                c.distrust = Some(why);
                                this.thaw_now(c)
                            } else {
                                this.abort_now(c, now)
                            }
                        }
                        // Acted on at the member's next step.
                        _ => Vec::new(),
                    }
                })
            }
            Input::Tick { now } => {
                let Some(at) = self.wake_at() else {
                    return Vec::new();
                };
                if now < at {
                    return Vec::new();
                }
                let Some(id) = self.cut.as_ref().map(|c| c.id) else {
                    return Vec::new();
                };
                let step = self.cut.as_ref().map(|c| c.step);
                if step == Some(Step::GroupHoldThaw) {
                    // Cut, and the deadline came: no member stays frozen
                    // past it, whatever the others do.
                    return self.with_cut(id, Step::GroupHoldThaw, |c, this| this.thaw_now(c));
                }
                self.with_cut(id, Step::GroupHoldCut, |c, this| {
                    c.distrust = Some(this.deadline_text());
                    this.thaw_now(c)
                })
            }
        }
    }

    /// When the shell must send [`Input::Tick`]: a group member held frozen
    /// thaws on its own once its transaction can no longer fit before the
    /// deadline.
    pub fn wake_at(&self) -> Option<Millis> {
        let c = self.cut.as_ref()?;
        if !self.frozen_by_us(c) {
            return None;
        }
        match c.step {
            Step::GroupHoldCut => Some(c.deadline?.saturating_sub(TRANSACTION_BUDGET_MS)),
            Step::GroupHoldThaw => c.deadline,
            _ => None,
        }
    }

    /// The group this cut serves, if any.
    pub fn cut_group(&self) -> Option<&str> {
        self.cut.as_ref().and_then(|c| c.group.as_deref())
    }

    /// This cut's freeze was sent and no thaw followed yet.
    fn frozen_by_us(&self, c: &Cut) -> bool {
        matches!(c.mode, Mode::Live { freeze: true }) && c.freeze_sent_at.is_some() && !c.thaw_done
    }

    /// Thaws the guest straight away (trusted frozen: no status read first).
    fn thaw_now(&mut self, c: &mut Cut) -> Vec<Command> {
        c.step = Step::Thawing;
        vec![Command::Thaw {
            cut: c.id,
            timeout: THAW_TIMEOUT_MS,
            only_if_frozen: !c.trusted,
        }]
    }

    /// The group failed before this member froze (or it is not frozen):
    /// every request fails, nothing is cut.
    fn abort_now(&mut self, c: &mut Cut, now: Millis) -> Vec<Command> {
        let why = c.group_abort.clone().unwrap_or_default();
        c.distrust = Some(why.clone());
        for r in c.requests.drain(..) {
            c.settled.push((r.snapshot, Outcome::Failed(why.clone())));
        }
        c.transacted = Some(TxResult::Rejected(why));
        self.finish(c, now)
    }

    /// Runs `f` on the cut if it is the one named and at the expected step;
    /// anything else is a stale or duplicate result and is ignored.
    fn with_cut(
        &mut self,
        id: CutId,
        step: Step,
        f: impl FnOnce(&mut Cut, &mut Self) -> Vec<Command>,
    ) -> Vec<Command> {
        let Some(mut c) = self.cut.take() else {
            return Vec::new();
        };
        if c.id != id || c.step != step {
            self.cut = Some(c);
            return Vec::new();
        }
        let out = f(&mut c, self);
        self.cut = Some(c);
        out
    }

    fn start(&mut self, access: Access, id: CutId, now: Millis) -> Vec<Command> {
        if self.cut.is_some() {
            return Vec::new();
        }
        // No QEMU runs: no guest is frozen. An intent kept for an
        // unconfirmed thaw is settled with the next commit.
        let owed_thaw = self.needs_thaw;
        if access == Access::Offline {
            self.needs_thaw = false;
        }
        if self.pending.is_empty() {
            if owed_thaw && access == Access::Offline {
                let commit = Command::Commit {
                    cut: id,
                    outcomes: Vec::new(),
                    took_cut: false,
                    freeze_window_ms: None,
                    keep_intent: false,
                    why_not_consistent: None,
                    full_freeze: None,
                };
                let mut cut = Cut::new(id, Vec::new(), Mode::Offline, Step::Committing);
                cut.commit = Some(commit.clone());
                self.cut = Some(cut);
                return vec![commit];
            }
            if self.needs_thaw && access == Access::Agent {
                // No guest may stay frozen: keep trying to thaw, cut or no cut.
                self.cut = Some(Cut::new(
                    id,
                    Vec::new(),
                    Mode::Live { freeze: true },
                    Step::ThawingPrevious,
                ));
                return vec![Command::Thaw {
                    cut: id,
                    timeout: THAW_TIMEOUT_MS,
                    only_if_frozen: true,
                }];
            }
            return Vec::new();
        }
        self.burst = false;
        // A group's requests are cut alone, one group at a time, so an
        // ordinary snapshot never waits at a group's barrier and a group
        // member's freeze is never shared with a cut the group does not own.
        let group = self.pending.iter().find_map(|r| r.group.clone());
        let (mut requests, rest): (Vec<Request>, Vec<Request>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|r| r.group == group);
        self.pending = rest;
        requests.sort();
        let mode = match &access {
            Access::Offline => Mode::Offline,
            Access::Agent => Mode::Live { freeze: true },
            Access::NoAgent(_) => Mode::Live { freeze: false },
        };
        let mut cut = Cut::new(id, requests, mode, Step::Preparing);
        if let Access::NoAgent(why) = &access {
            cut.distrust = Some(why.clone());
            let why = format!(
                "{why}, so the guest's filesystems cannot be frozen and the snapshot would not be consistent; fix the agent or set spec.requiredConsistency: false"
            );
            fail_required(&mut cut, &why);
        }
        if cut.requests.is_empty() {
            let out = self.finish(&mut cut, now);
            self.cut = Some(cut);
            return out;
        }
        let disks = cut_disks(&cut);
        cut.disks = disks.clone();
        self.cut = Some(cut);
        vec![Command::Prepare { cut: id, disks }]
    }

    fn prepared(
        &mut self,
        c: &mut Cut,
        failed: Vec<(String, String)>,
        now: Millis,
    ) -> Vec<Command> {
        // A disk that could not be prepared fails its own requests only.
        for (disk, why) in &failed {
            c.requests.retain(|r| {
                if &r.disk == disk {
                    c.settled.push((
                        r.snapshot.clone(),
                        Outcome::Failed(format!("preparing the snapshot failed: {why}")),
                    ));
                    false
                } else {
                    true
                }
            });
        }
        // Requests that came while the cut was being prepared join it when
        // every one of them has its disk's overlay ready: all or none, so
        // requests made together (a VM snapshot's disks) are never split
        // between two cuts. (A cut without an agent failed its required
        // requests at the start; its late requests take the next cut, which
        // does the same.)
        if c.mode != (Mode::Live { freeze: false })
            && c.group.is_none()
            && self.pending.iter().all(|r| r.group.is_none())
        {
            let ready: BTreeSet<&String> = c
                .disks
                .iter()
                .filter(|d| !failed.iter().any(|(f, _)| f == *d))
                .collect();
            if !self.pending.is_empty() && self.pending.iter().all(|r| ready.contains(&r.disk)) {
                c.requests.append(&mut self.pending);
                c.requests.sort();
                self.burst = false;
            }
        }
        if c.requests.is_empty() {
            c.transacted = Some(TxResult::Rejected("nothing left to cut".into()));
            return self.finish(c, now);
        }
        match c.mode {
            Mode::Offline | Mode::Live { freeze: false } => self.transact(c),
            Mode::Live { freeze: true } if self.needs_thaw => {
                c.step = Step::ThawingPrevious;
                vec![Command::Thaw {
                    cut: c.id,
                    timeout: THAW_TIMEOUT_MS,
                    only_if_frozen: true,
                }]
            }
            Mode::Live { freeze: true } => self.record_intent(c, now),
        }
    }

    fn transact(&mut self, c: &mut Cut) -> Vec<Command> {
        if c.group.is_some() && !c.group_go_cut {
            if c.group_abort.is_some() {
                if self.frozen_by_us(c) {
                    c.distrust = c.group_abort.clone();
                    return self.thaw_now(c);
                }
                let now = c.freeze_sent_at.unwrap_or(0);
                return self.abort_now(c, now);
            }
            c.step = Step::GroupHoldCut;
            return vec![Command::GroupReport {
                cut: c.id,
                report: GroupReport::ReadyToCut {
                    frozen: self.frozen_by_us(c) && c.trusted,
                },
            }];
        }
        c.step = Step::Transacting;
        vec![Command::Transact {
            cut: c.id,
            timeout: TRANSACTION_BUDGET_MS,
        }]
    }

    /// The intent goes to the store first; the freeze follows only once it
    /// is there, so a crash can never leave a frozen guest nobody knows of.
    /// The freeze's scope is decided here, over the requests the cut holds
    /// now: a cut whose disks carry no mounted filesystem freezes nothing
    /// (and needs no intent).
    fn record_intent(&mut self, c: &mut Cut, now: Millis) -> Vec<Command> {
        let scope = freeze_scope(&c.requests, c.mounts.as_ref());
        if scope == Scope::List(Vec::new()) {
            c.scope = Some(scope);
            c.nothing_to_freeze = true;
            c.mode = Mode::Live { freeze: false };
            return self.transact(c);
        }
        c.scope = Some(scope);
        if c.group.is_some() {
            if c.group_abort.is_some() {
                return self.abort_now(c, now);
            }
            if c.group_deadline.is_none() {
                // Held until every member is prepared and the group's
                // intent is stored.
                c.step = Step::GroupHoldFreeze;
                return vec![Command::GroupReport {
                    cut: c.id,
                    report: GroupReport::ReadyToFreeze,
                }];
            }
        }
        let deadline = self.deadline_for(c, now);
        c.deadline = Some(deadline);
        c.step = Step::Freezing;
        vec![Command::RecordIntent {
            cut: c.id,
            deadline,
        }]
    }

    fn intent_recorded(
        &mut self,
        c: &mut Cut,
        result: Result<(), IntentNotRecorded>,
        now: Millis,
    ) -> Vec<Command> {
        if c.freeze_sent_at.is_some() {
            return Vec::new();
        }
        if let Err(e) = result {
            return self.serve_without_freeze(
                c,
                format!("the freeze intent could not be stored ({e}), so the guest was not frozen"),
                now,
            );
        }
        if c.group_abort.is_some() {
            return self.abort_now(c, now);
        }
        // The deadline runs from the freeze, not from the intent write.
        let deadline = self.deadline_for(c, now);
        if deadline <= now {
            return self.serve_without_freeze(c, self.deadline_text(), now);
        }
        c.deadline = Some(deadline);
        c.freeze_sent_at = Some(now);
        // From here until a confirmed thaw the guest may be frozen.
        self.needs_thaw = true;
        let mountpoints = match &c.scope {
            Some(Scope::List(l)) => Some(l.clone()),
            _ => None,
        };
        vec![Command::Freeze {
            cut: c.id,
            timeout: deadline - now,
            mountpoints,
        }]
    }

    /// The VM's own deadline from `now`, or the group's if that comes first.
    fn deadline_for(&self, c: &Cut, now: Millis) -> Millis {
        let own = now + self.deadline_ms;
        c.group_deadline.map_or(own, |g| g.min(own))
    }

    /// Freezing is off the table: requests that require consistency fail
    /// with `why`; the others are cut crash-consistent, without a freeze.
    fn serve_without_freeze(&mut self, c: &mut Cut, why: String, now: Millis) -> Vec<Command> {
        c.distrust = Some(why.clone());
        fail_required(c, &why);
        c.mode = Mode::Live { freeze: false };
        c.nothing_to_freeze = false;
        if c.requests.is_empty() {
            c.transacted = Some(TxResult::Rejected(why));
            return self.finish(c, now);
        }
        self.transact(c)
    }

    fn previous_thawed(
        &mut self,
        c: &mut Cut,
        result: Result<u32, AgentFault>,
        now: Millis,
    ) -> Vec<Command> {
        if c.requests.is_empty() && c.settled.is_empty() {
            // A thaw-only cut.
            if result.is_ok() {
                self.needs_thaw = false;
            }
            let commit = Command::Commit {
                cut: c.id,
                outcomes: Vec::new(),
                took_cut: false,
                freeze_window_ms: None,
                keep_intent: self.needs_thaw,
                why_not_consistent: None,
                full_freeze: None,
            };
            c.step = Step::Committing;
            c.commit = Some(commit.clone());
            return vec![commit];
        }
        match result {
            Ok(_) => {
                self.needs_thaw = false;
                self.record_intent(c, now)
            }
            Err(f) => self.serve_without_freeze(
                c,
                format!("an earlier freeze could not be undone ({f})"),
                now,
            ),
        }
    }

    fn freeze_replied(
        &mut self,
        c: &mut Cut,
        result: Result<u32, AgentFault>,
        now: Millis,
    ) -> Vec<Command> {
        if c.freeze_sent_at.is_none() {
            return Vec::new();
        }
        let deadline = c.deadline.unwrap_or(now);
        match result {
            Ok(0) => c.distrust = Some("the guest agent froze no filesystems".into()),
            Ok(_) if c.group_abort.is_some() => c.distrust = c.group_abort.clone(),
            Ok(n) => {
                c.frozen_count = Some(n);
                if now >= deadline {
                    c.distrust = Some(self.deadline_text());
                } else {
                    c.step = Step::Confirming;
                    return vec![Command::QueryFreeze {
                        cut: c.id,
                        timeout: deadline - now,
                    }];
                }
            }
            Err(AgentFault::Timeout) => c.distrust = Some(self.deadline_text()),
            Err(f) => c.distrust = Some(format!("freezing failed: {f}")),
        }
        // Whatever happened, a freeze may have taken effect: thaw if frozen.
        c.step = Step::Thawing;
        vec![Command::Thaw {
            cut: c.id,
            timeout: THAW_TIMEOUT_MS,
            only_if_frozen: true,
        }]
    }

    fn deadline_text(&self) -> String {
        format!(
            "the freeze did not complete within the {} s deadline (spec.freezeDeadlineSeconds); the guest was thawed",
            self.deadline_ms / 1000
        )
    }

    fn status_replied(
        &mut self,
        c: &mut Cut,
        result: Result<bool, AgentFault>,
        now: Millis,
    ) -> Vec<Command> {
        let deadline = c.deadline.unwrap_or(now);
        match result {
            Ok(true) if c.group_abort.is_some() => c.distrust = c.group_abort.clone(),
            Ok(true) if now + TRANSACTION_BUDGET_MS <= deadline => {
                c.trusted = true;
                return self.transact(c);
            }
            Ok(true) => c.distrust = Some(self.deadline_text()),
            Ok(false) => {
                c.distrust = Some("the guest reported thawed right after the freeze".into())
            }
            Err(f) => c.distrust = Some(format!("the freeze could not be confirmed: {f}")),
        }
        c.step = Step::Thawing;
        vec![Command::Thaw {
            cut: c.id,
            timeout: THAW_TIMEOUT_MS,
            only_if_frozen: true,
        }]
    }

    fn thaw_replied(
        &mut self,
        c: &mut Cut,
        result: Result<u32, AgentFault>,
        now: Millis,
    ) -> Vec<Command> {
        c.thaw_done = true;
        c.window = c.freeze_sent_at.map(|t| now.saturating_sub(t));
        match result {
            Ok(m) => {
                self.needs_thaw = false;
                if c.trusted && c.frozen_count != Some(m) && c.distrust.is_none() {
                    c.distrust = Some(format!(
                        "froze {} filesystems but thawed {m}: something thawed the guest during the cut",
                        c.frozen_count.unwrap_or(0)
                    ));
                }
            }
            Err(f) => {
                // The guest may still be frozen: the next cut thaws first.
                self.needs_thaw = true;
                if c.distrust.is_none() {
                    c.distrust = Some(format!("the thaw was not confirmed: {f}"));
                }
            }
        }
        if c.recovered {
            return self.finish(c, now);
        }
        // An untrusted freeze cut nothing yet: requests that accept a
        // crash-consistent snapshot still get one, now that the guest runs.
        if c.group_abort.is_some() {
            return self.abort_now(c, now);
        }
        if c.transacted.is_none() && c.requests.iter().any(|r| !r.required) {
            let why = c.distrust.clone().unwrap_or_default();
            fail_required(c, &why);
            return self.transact(c);
        }
        self.after_transaction(c, now)
    }

    /// The transaction's reply (or its absence). While our freeze holds,
    /// a missing reply is looked up in QEMU's block graph *before* the
    /// thaw: a transaction QEMU had not run yet may still run after the
    /// thaw, and the guest's writes in between would land in the layer
    /// that becomes the snapshot. Only a switch seen while the guest is
    /// still frozen makes the cut consistent.
    fn transacted(&mut self, c: &mut Cut, result: TxResult, now: Millis) -> Vec<Command> {
        let unknown = matches!(result, TxResult::Unknown(_));
        c.transacted = Some(result);
        if !self.frozen_by_us(c) {
            return self.after_transaction(c, now);
        }
        if unknown && c.trusted {
            let deadline = c.deadline.unwrap_or(now);
            if now < deadline {
                c.step = Step::ObservingFrozen;
                return vec![Command::Observe {
                    cut: c.id,
                    timeout: deadline - now,
                    while_frozen: true,
                }];
            }
            c.distrust
                .get_or_insert_with(|| self.switch_unseen_text(false));
        }
        self.hold_or_thaw(c, now)
    }

    /// What QEMU's block graph said while the guest was still frozen. The
    /// read went to the monitor the transaction went to, and QMP answers
    /// a monitor's commands in order, so its answer means the transaction
    /// had ended: the overlays on top, it ran (inside the freeze); the old
    /// tops, it did not. No answer by the deadline: the transaction may
    /// still run after the thaw, so the cut is not consistent; it is
    /// looked up again after the thaw (and the journal settles the
    /// overlays whatever QEMU does later).
    fn observed_frozen(&mut self, c: &mut Cut, applied: Option<bool>, now: Millis) -> Vec<Command> {
        match applied {
            Some(true) => c.transacted = Some(TxResult::Applied),
            Some(false) => {
                c.transacted = Some(TxResult::Rejected(
                    "QEMU did not apply the transaction (its reply did not come; QEMU's block graph, read after it, shows the disks' previous layers on top)".into(),
                ))
            }
            None => {
                c.distrust
                    .get_or_insert_with(|| self.switch_unseen_text(true));
            }
        }
        self.hold_or_thaw(c, now)
    }

    /// Why a cut whose switch was not seen inside the freeze is not
    /// consistent; `read_failed`: a read of QEMU's block graph was tried
    /// (else no time was left for one).
    fn switch_unseen_text(&self, read_failed: bool) -> String {
        let why = if read_failed {
            "QEMU's block graph could not be read before"
        } else {
            "no time was left before"
        };
        format!(
            "QEMU did not answer the snapshot transaction within {} s and {why} the {} s freeze deadline (spec.freezeDeadlineSeconds), so the disks may have switched to the new layers after the guest was thawed; QEMU's monitor was busy or stuck (a longer freeze deadline leaves more time to wait for it)",
            TRANSACTION_BUDGET_MS / 1000,
            self.deadline_ms / 1000
        )
    }

    /// After the transaction, still frozen: a group member waits for every
    /// other member to cut (or its deadline); any other cut thaws first,
    /// whatever happened, so the guest's window ends before anything else
    /// is looked at.
    fn hold_or_thaw(&mut self, c: &mut Cut, now: Millis) -> Vec<Command> {
        if c.group.is_some() && c.group_abort.is_none() && c.deadline.is_some_and(|d| now < d) {
            c.step = Step::GroupHoldThaw;
            return vec![Command::GroupReport {
                cut: c.id,
                report: GroupReport::ReadyToThaw,
            }];
        }
        c.step = Step::Thawing;
        vec![Command::Thaw {
            cut: c.id,
            timeout: THAW_TIMEOUT_MS,
            only_if_frozen: !c.trusted,
        }]
    }

    /// A transaction whose reply never came is looked up in QEMU; nothing
    /// is decided on a guess.
    fn after_transaction(&mut self, c: &mut Cut, now: Millis) -> Vec<Command> {
        if let Some(TxResult::Unknown(_)) = c.transacted {
            c.step = Step::Observing;
            return vec![Command::Observe {
                cut: c.id,
                timeout: OBSERVE_TIMEOUT_MS,
                while_frozen: false,
            }];
        }
        self.finish(c, now)
    }

    fn finish(&mut self, c: &mut Cut, now: Millis) -> Vec<Command> {
        self.last_cut_end = Some(now);
        let mut outcomes = std::mem::take(&mut c.settled);
        let took_cut = matches!(c.transacted, Some(TxResult::Applied));
        if c.recovered {
            // What happened before the crash cannot be proven: take it again.
            for r in &c.requests {
                if r.group.is_some() {
                    // A group is taken as a whole or not at all: its members
                    // are never retaken one by one.
                    outcomes.push((
                        r.snapshot.clone(),
                        Outcome::Failed(
                            "hearthd stopped during the group's cut; the guest was thawed".into(),
                        ),
                    ));
                } else {
                    outcomes.push((r.snapshot.clone(), Outcome::Retry));
                    self.pending.push(r.clone());
                }
            }
        } else {
            for r in &c.requests {
                let outcome = match &c.transacted {
                    Some(TxResult::Rejected(e) | TxResult::Unknown(e)) => {
                        Outcome::Failed(format!("the snapshot could not be cut: {e}"))
                    }
                    None => Outcome::Failed(
                        c.distrust
                            .clone()
                            .unwrap_or_else(|| "the snapshot was not cut".into()),
                    ),
                    Some(TxResult::Applied) => {
                        let consistent = match c.mode {
                            Mode::Offline => true,
                            Mode::Live { freeze: false } => {
                                c.nothing_to_freeze && c.distrust.is_none()
                            }
                            Mode::Live { freeze: true } => c.trusted && c.distrust.is_none(),
                        };
                        if consistent {
                            Outcome::Ready { consistent: true }
                        } else if r.required {
                            Outcome::Failed(
                                c.distrust
                                    .clone()
                                    .unwrap_or_else(|| "the snapshot is not consistent".into()),
                            )
                        } else {
                            Outcome::Ready { consistent: false }
                        }
                    }
                };
                outcomes.push((r.snapshot.clone(), outcome));
            }
        }
        c.step = Step::Committing;
        let mut out = Vec::new();
        if !took_cut {
            out.push(Command::Discard { cut: c.id });
        }
        let commit = Command::Commit {
            cut: c.id,
            outcomes,
            took_cut,
            freeze_window_ms: c.window,
            keep_intent: self.needs_thaw,
            why_not_consistent: c.distrust.clone(),
            full_freeze: match &c.scope {
                Some(Scope::All { why }) => why.clone(),
                _ => None,
            },
        };
        c.commit = Some(commit.clone());
        out.push(commit);
        out
    }
}

/// The disks a cut touches, sorted, each once.
fn cut_disks(c: &Cut) -> Vec<String> {
    let mut disks: Vec<String> = c.requests.iter().map(|r| r.disk.clone()).collect();
    disks.sort();
    disks.dedup();
    disks
}

/// Settles every request that requires consistency as failed with `why`.
fn fail_required(c: &mut Cut, why: &str) {
    c.requests.retain(|r| {
        if r.required {
            c.settled
                .push((r.snapshot.clone(), Outcome::Failed(why.to_string())));
            false
        } else {
            true
        }
    });
}

#[cfg(test)]
mod tests;
