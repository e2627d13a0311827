//! The freeze coordinator of one VM: a pure state machine.
//!
//! Inputs are requests and the results of the commands it asked for; outputs
//! are commands. The async shell (`actor/`) performs the commands one at a
//! time, in order, with the timeouts given here, and feeds each result back.
//! Because one coordinator owns all freeze/thaw traffic of its VM and its
//! commands run strictly in sequence, two freezes, or a thaw during a cut,
//! cannot happen by construction; the property tests in `tests.rs` check it anyway,
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

use std::collections::BTreeSet;

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

mod steps;
mod types;

pub use types::*;

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

    #[cfg(test)]
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
}

#[cfg(test)]
mod tests;
