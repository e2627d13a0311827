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
//! atomic transaction over every disk in the cut, one thaw. Requests that
//! arrive during a cut wait for the next one.

use std::collections::BTreeSet;

pub type CutId = u64;
/// Milliseconds on a monotonic clock.
pub type Millis = u64;

/// Budget for the QMP transaction; it is only started if it can finish
/// before the deadline, so the guest is never frozen past the deadline.
pub const TRANSACTION_BUDGET_MS: Millis = 2_000;
/// Bound for one thaw attempt.
pub const THAW_TIMEOUT_MS: Millis = 5_000;

/// One disk snapshot to take.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Request {
    pub snapshot: String,
    pub disk: String,
    pub required: bool,
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

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    Requested(Request),
    /// The shell asks to start a cut if one is due; `access` is how the VM
    /// can be reached right now.
    Start {
        access: Access,
        now: Millis,
    },
    Prepared {
        cut: CutId,
        result: Result<(), String>,
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
        result: Result<(), String>,
        now: Millis,
    },
    ThawReplied {
        cut: CutId,
        result: Result<u32, AgentFault>,
        now: Millis,
    },
    /// The shell has executed a `Commit`.
    Committed {
        cut: CutId,
    },
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
    /// Store the freeze intent durably; done before `Freeze`.
    RecordIntent {
        cut: CutId,
        deadline: Millis,
    },
    Freeze {
        cut: CutId,
        timeout: Millis,
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
    Thaw {
        cut: CutId,
        timeout: Millis,
    },
    /// Drop what `Prepare` made; the cut did not happen.
    Discard {
        cut: CutId,
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
    Thawing,
    Committing,
}

#[derive(Clone, Debug)]
struct Cut {
    id: CutId,
    requests: Vec<Request>,
    /// Outcomes fixed before the cut (no agent and consistency required).
    settled: Vec<(String, Outcome)>,
    mode: Mode,
    step: Step,
    deadline: Option<Millis>,
    freeze_sent_at: Option<Millis>,
    frozen_count: Option<u32>,
    /// Frozen is believed: our freeze reply, then a status read saying frozen.
    trusted: bool,
    /// Why the cut is not consistent, once something made it so.
    distrust: Option<String>,
    thaw_done: bool,
    transacted: Option<Result<(), String>>,
    window: Option<Millis>,
    recovered: bool,
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
    next_cut: CutId,
    /// An earlier cut's thaw was never confirmed: the guest may be frozen.
    needs_thaw: bool,
}

impl Coordinator {
    pub fn new(deadline_ms: Millis, next_cut: CutId) -> Self {
        Coordinator {
            deadline_ms,
            pending: Vec::new(),
            cut: None,
            next_cut,
            needs_thaw: false,
        }
    }

    /// Rebuilds a coordinator after a daemon restart. A cut that was in its
    /// frozen window when the daemon died is settled first: thaw the guest
    /// (it may be frozen, and nobody else will), then put its requests back
    /// for a fresh cut, never claiming a consistency nobody can prove.
    pub fn recover(deadline_ms: Millis, next_cut: CutId, durable: Durable) -> (Self, Vec<Command>) {
        let mut c = Coordinator::new(deadline_ms, next_cut);
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
            c.next_cut = c.next_cut.max(id + 1);
            c.needs_thaw = true;
            c.cut = Some(Cut {
                id,
                requests,
                settled: Vec::new(),
                mode: Mode::Live { freeze: true },
                step: Step::Thawing,
                deadline: None,
                freeze_sent_at: None,
                frozen_count: None,
                trusted: false,
                distrust: Some("hearthd stopped during the cut".into()),
                thaw_done: false,
                transacted: None,
                window: None,
                recovered: true,
            });
            out.push(Command::Thaw {
                cut: id,
                timeout: THAW_TIMEOUT_MS,
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

    pub fn current_cut(&self) -> Option<(CutId, Step)> {
        self.cut.as_ref().map(|c| (c.id, c.step))
    }

    pub fn pending(&self) -> &[Request] {
        &self.pending
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
                }
                Vec::new()
            }
            Input::Start { access, now } => self.start(access, now),
            Input::Prepared { cut, result, now } => {
                self.with_cut(cut, Step::Preparing, |c, this| {
                    this.prepared(c, result, now)
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
                    c.transacted = Some(result);
                    if matches!(c.mode, Mode::Live { freeze: true })
                        && c.freeze_sent_at.is_some()
                        && !c.thaw_done
                    {
                        c.step = Step::Thawing;
                        vec![Command::Thaw {
                            cut: c.id,
                            timeout: THAW_TIMEOUT_MS,
                        }]
                    } else {
                        this.finish(c, now)
                    }
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
            Input::Committed { cut } => {
                if self
                    .cut
                    .as_ref()
                    .is_some_and(|c| c.id == cut && c.step == Step::Committing)
                {
                    self.cut = None;
                }
                Vec::new()
            }
        }
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

    fn start(&mut self, access: Access, now: Millis) -> Vec<Command> {
        if self.cut.is_some() {
            return Vec::new();
        }
        if self.pending.is_empty() {
            if self.needs_thaw && access == Access::Agent {
                // No guest may stay frozen: keep trying to thaw, cut or no cut.
                return self.thaw_only(now);
            }
            return Vec::new();
        }
        let id = self.next_cut;
        self.next_cut += 1;
        let mut requests = std::mem::take(&mut self.pending);
        requests.sort();
        let mut settled = Vec::new();
        let mode = match &access {
            Access::Offline => Mode::Offline,
            Access::Agent => Mode::Live { freeze: true },
            Access::NoAgent(why) => {
                requests.retain(|r| {
                    if r.required {
                        settled.push((
                            r.snapshot.clone(),
                            Outcome::Failed(format!(
                                "{why}, so the guest's filesystems cannot be frozen and the snapshot would not be consistent; fix the agent or set spec.requiredConsistency: false"
                            )),
                        ));
                        false
                    } else {
                        true
                    }
                });
                Mode::Live { freeze: false }
            }
        };
        let mut cut = Cut {
            id,
            requests,
            settled,
            mode,
            step: Step::Preparing,
            deadline: None,
            freeze_sent_at: None,
            frozen_count: None,
            trusted: false,
            distrust: match &access {
                Access::NoAgent(why) => Some(why.clone()),
                _ => None,
            },
            thaw_done: false,
            transacted: None,
            window: None,
            recovered: false,
        };
        if cut.requests.is_empty() {
            let out = self.finish(&mut cut, now);
            self.cut = Some(cut);
            return out;
        }
        let mut disks: Vec<String> = cut.requests.iter().map(|r| r.disk.clone()).collect();
        disks.sort();
        disks.dedup();
        self.cut = Some(cut);
        vec![Command::Prepare { cut: id, disks }]
    }

    fn thaw_only(&mut self, _now: Millis) -> Vec<Command> {
        let id = self.next_cut;
        self.next_cut += 1;
        self.cut = Some(Cut {
            id,
            requests: Vec::new(),
            settled: Vec::new(),
            mode: Mode::Live { freeze: true },
            step: Step::ThawingPrevious,
            deadline: None,
            freeze_sent_at: None,
            frozen_count: None,
            trusted: false,
            distrust: None,
            thaw_done: false,
            transacted: None,
            window: None,
            recovered: false,
        });
        vec![Command::Thaw {
            cut: id,
            timeout: THAW_TIMEOUT_MS,
        }]
    }

    fn prepared(&mut self, c: &mut Cut, result: Result<(), String>, now: Millis) -> Vec<Command> {
        if let Err(e) = result {
            c.distrust = Some(format!("preparing the snapshot files failed: {e}"));
            c.transacted = Some(Err(e));
            return self.finish(c, now);
        }
        match c.mode {
            Mode::Offline | Mode::Live { freeze: false } => {
                c.step = Step::Transacting;
                vec![Command::Transact {
                    cut: c.id,
                    timeout: TRANSACTION_BUDGET_MS,
                }]
            }
            Mode::Live { freeze: true } if self.needs_thaw => {
                c.step = Step::ThawingPrevious;
                vec![Command::Thaw {
                    cut: c.id,
                    timeout: THAW_TIMEOUT_MS,
                }]
            }
            Mode::Live { freeze: true } => self.freeze(c, now),
        }
    }

    fn freeze(&mut self, c: &mut Cut, now: Millis) -> Vec<Command> {
        let deadline = now + self.deadline_ms;
        c.deadline = Some(deadline);
        c.freeze_sent_at = Some(now);
        c.step = Step::Freezing;
        // From here until a confirmed thaw the guest may be frozen.
        self.needs_thaw = true;
        vec![
            Command::RecordIntent {
                cut: c.id,
                deadline,
            },
            Command::Freeze {
                cut: c.id,
                timeout: self.deadline_ms,
            },
        ]
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
            c.step = Step::Committing;
            return vec![Command::Commit {
                cut: c.id,
                outcomes: Vec::new(),
                took_cut: false,
                freeze_window_ms: None,
                keep_intent: self.needs_thaw,
                why_not_consistent: None,
            }];
        }
        match result {
            Ok(_) => {
                self.needs_thaw = false;
                self.freeze(c, now)
            }
            Err(f) => {
                // Freezing again is off the table; serve what needs no freeze.
                let why = format!("an earlier freeze could not be undone ({f})");
                c.distrust = Some(why.clone());
                c.requests.retain(|r| {
                    if r.required {
                        c.settled
                            .push((r.snapshot.clone(), Outcome::Failed(why.clone())));
                        false
                    } else {
                        true
                    }
                });
                c.mode = Mode::Live { freeze: false };
                if c.requests.is_empty() {
                    c.transacted = Some(Err(why));
                    return self.finish(c, now);
                }
                c.step = Step::Transacting;
                vec![Command::Transact {
                    cut: c.id,
                    timeout: TRANSACTION_BUDGET_MS,
                }]
            }
        }
    }

    fn freeze_replied(
        &mut self,
        c: &mut Cut,
        result: Result<u32, AgentFault>,
        now: Millis,
    ) -> Vec<Command> {
        let deadline = c.deadline.unwrap_or(now);
        match result {
            Ok(0) => c.distrust = Some("the guest agent froze no filesystems".into()),
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
        // Whatever happened, a freeze may have taken effect: thaw.
        c.step = Step::Thawing;
        vec![Command::Thaw {
            cut: c.id,
            timeout: THAW_TIMEOUT_MS,
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
            Ok(true) if now + TRANSACTION_BUDGET_MS <= deadline => {
                c.trusted = true;
                c.step = Step::Transacting;
                return vec![Command::Transact {
                    cut: c.id,
                    timeout: TRANSACTION_BUDGET_MS,
                }];
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
        if c.transacted.is_none() && c.requests.iter().any(|r| !r.required) {
            c.requests.retain(|r| {
                if r.required {
                    let why = c.distrust.clone().unwrap_or_default();
                    c.settled.push((r.snapshot.clone(), Outcome::Failed(why)));
                    false
                } else {
                    true
                }
            });
            c.step = Step::Transacting;
            return vec![Command::Transact {
                cut: c.id,
                timeout: TRANSACTION_BUDGET_MS,
            }];
        }
        self.finish(c, now)
    }

    fn finish(&mut self, c: &mut Cut, _now: Millis) -> Vec<Command> {
        let mut outcomes = std::mem::take(&mut c.settled);
        let took_cut = matches!(c.transacted, Some(Ok(())));
        if c.recovered {
            // What happened before the crash cannot be proven: take it again.
            for r in &c.requests {
                outcomes.push((r.snapshot.clone(), Outcome::Retry));
                self.pending.push(r.clone());
            }
        } else {
            for r in &c.requests {
                let outcome = match &c.transacted {
                    Some(Err(e)) => Outcome::Failed(format!("the snapshot could not be cut: {e}")),
                    None => Outcome::Failed(
                        c.distrust
                            .clone()
                            .unwrap_or_else(|| "the snapshot was not cut".into()),
                    ),
                    Some(Ok(())) => {
                        let consistent = match c.mode {
                            Mode::Offline => true,
                            Mode::Live { freeze: false } => false,
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
        out.push(Command::Commit {
            cut: c.id,
            outcomes,
            took_cut,
            freeze_window_ms: c.window,
            keep_intent: self.needs_thaw,
            why_not_consistent: c.distrust.clone(),
        });
        out
    }
}

#[cfg(test)]
mod tests;
