//! The core of a VirtualMachineSnapshotGroup: a pure state machine over its
//! members (state + input → state + commands).
//!
//! Each member VM keeps its own actor and freeze coordinator, which still
//! own all of its freeze and thaw traffic. A member's cut for the group is
//! held three times ([`super::coordinator::GroupReport`]): prepared, before
//! its intent and freeze; frozen, before its transaction; cut, before its
//! thaw. This core decides when every member may go on:
//!
//! 1. every member prepared (overlays made outside any window) → the group's
//!    intent is recorded, with the one deadline;
//! 2. then every member freezes (`GoFreeze`);
//! 3. once every member reported frozen (the barrier), and the transaction
//!    still fits before the deadline, every member cuts (`GoCut`);
//! 4. once every member has cut, all thaw (`GoThaw`); a member never stays
//!    frozen past the deadline waiting for that.
//!
//! With `required` set, anything that keeps one member from being frozen at
//! the common moment (no agent, a failed or late freeze, the deadline, the
//! intent write) fails the group: every member not yet cutting is told to
//! abort, and a member that may be frozen thaws at once. The group's outcome
//! comes only once every member's cut is settled.

use std::collections::BTreeMap;

use super::coordinator::{IntentNotRecorded, Millis, TRANSACTION_BUDGET_MS};

/// `metadata.managedBy` of a group's member VM snapshots, before the group's
/// name.
pub const MANAGED_BY_PREFIX: &str = "VirtualMachineSnapshotGroup/";

/// What a member says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Report {
    /// Prepared, held before its freeze.
    ReadyToFreeze,
    /// Held before its transaction; `frozen`: trusted frozen by its freeze.
    ReadyToCut { frozen: bool },
    /// Cut, and held frozen before its thaw.
    Cut,
    /// Its cut is settled (committed, or its snapshot failed before a cut).
    Finished {
        /// Every snapshot of the member is Ready.
        ready: bool,
        consistent: bool,
        why: Option<String>,
        window_ms: Option<Millis>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupInput {
    Report {
        vm: String,
        report: Report,
        now: Millis,
    },
    /// The group's intent was (or could not be) stored.
    IntentRecorded {
        result: Result<(), IntentNotRecorded>,
        now: Millis,
    },
    Tick {
        now: Millis,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupCommand {
    /// Store the group's intent; no member freezes before it is stored.
    RecordIntent {
        deadline: Millis,
    },
    GoFreeze {
        vm: String,
        deadline: Millis,
    },
    GoCut {
        vm: String,
    },
    GoThaw {
        vm: String,
    },
    Abort {
        vm: String,
        why: String,
    },
    /// Every member is settled: record the group's outcome (and, when it
    /// failed, fail every member snapshot with it).
    Finish(GroupOutcome),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupOutcome {
    Ready {
        consistent: bool,
        window_ms: Option<Millis>,
    },
    Failed(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Member {
    Preparing,
    AtFreeze,
    Freezing,
    AtCut {
        frozen: bool,
    },
    Cutting,
    /// Cut, held frozen until every member has cut.
    CutDone,
    /// Let thaw; its Finished is awaited.
    Thawing,
    /// Told to abort; its Finished is awaited.
    Aborting,
    Done {
        ready: bool,
        consistent: bool,
        why: Option<String>,
        window_ms: Option<Millis>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Members are preparing.
    Gathering,
    /// The intent write is out.
    Intent,
    /// Members freeze; waiting for every one at the barrier.
    Freezing,
    /// Members cut; held frozen until every member has.
    Cutting,
    /// Every member cut; members thaw.
    Thawing,
    /// Failed; waiting for every member to settle.
    Failing(String),
    Done,
}

#[derive(Clone, Debug)]
pub struct Group {
    required: bool,
    deadline_ms: Millis,
    members: BTreeMap<String, Member>,
    phase: Phase,
    deadline: Option<Millis>,
}

impl Group {
    /// `deadline_ms`: the group's one limit for its frozen time (the
    /// shortest of its members' `freezeDeadlineSeconds`).
    pub fn new(members: &[String], required: bool, deadline_ms: Millis) -> Group {
        Group {
            required,
            deadline_ms,
            members: members
                .iter()
                .map(|m| (m.clone(), Member::Preparing))
                .collect(),
            phase: Phase::Gathering,
            deadline: None,
        }
    }

    #[cfg(test)]
    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// When the shell must send a [`GroupInput::Tick`].
    /// (A group that does not require consistency has nothing to do when
    /// the budget runs out before every member is frozen: each member thaws
    /// by its own deadline and goes on crash-consistent.)
    pub fn wake_at(&self) -> Option<Millis> {
        match self.phase {
            Phase::Freezing if self.required => {
                Some(self.deadline?.saturating_sub(TRANSACTION_BUDGET_MS))
            }
            Phase::Cutting => self.deadline,
            _ => None,
        }
    }

    pub fn handle(&mut self, input: GroupInput) -> Vec<GroupCommand> {
        if self.phase == Phase::Done {
            return Vec::new();
        }
        let mut out = Vec::new();
        let now = match input {
            GroupInput::Report { vm, report, now } => {
                let Some(m) = self.members.get_mut(&vm) else {
                    return Vec::new();
                };
                if matches!(m, Member::Done { .. }) {
                    return Vec::new();
                }
                *m = match report {
                    Report::ReadyToFreeze => Member::AtFreeze,
                    Report::ReadyToCut { frozen } => Member::AtCut { frozen },
                    Report::Cut => Member::CutDone,
                    Report::Finished {
                        ready,
                        consistent,
                        why,
                        window_ms,
                    } => Member::Done {
                        ready,
                        consistent,
                        why,
                        window_ms,
                    },
                };
                // A member that reports again at its second barrier while
                // the group cuts (it thawed at its deadline and goes on
                // crash-consistent) is let cut again.
                if matches!(self.phase, Phase::Cutting | Phase::Thawing)
                    && matches!(m, Member::AtCut { .. })
                {
                    *m = Member::Cutting;
                    out.push(GroupCommand::GoCut { vm: vm.clone() });
                }
                // A member that cut while the group failed or thaws (it
                // was let cut before) thaws at once.
                if matches!(self.phase, Phase::Failing(_) | Phase::Thawing) && *m == Member::CutDone
                {
                    *m = Member::Thawing;
                    out.push(GroupCommand::GoThaw { vm: vm.clone() });
                }
                // A member held while the group is failing is let go at once.
                if let Phase::Failing(why) = &self.phase
                    && matches!(m, Member::AtFreeze | Member::AtCut { .. })
                {
                    *m = Member::Aborting;
                    out.push(GroupCommand::Abort {
                        vm,
                        why: why.clone(),
                    });
                }
                now
            }
            GroupInput::IntentRecorded { result, now } => {
                if self.phase != Phase::Intent {
                    return Vec::new();
                }
                match result {
                    Ok(()) => {
                        let deadline = self.deadline.unwrap_or(now);
                        self.phase = Phase::Freezing;
                        for (vm, m) in self.members.iter_mut() {
                            if *m == Member::AtFreeze {
                                *m = Member::Freezing;
                                out.push(GroupCommand::GoFreeze {
                                    vm: vm.clone(),
                                    deadline,
                                });
                            }
                        }
                    }
                    Err(e) => {
                        out.extend(self.fail(format!(
                            "the group's intent could not be stored ({e}), so no member was frozen"
                        )));
                    }
                }
                now
            }
            GroupInput::Tick { now } => now,
        };
        out.extend(self.advance(now));
        out
    }

    fn advance(&mut self, now: Millis) -> Vec<GroupCommand> {
        let mut out = Vec::new();
        // A member that settled without every snapshot Ready fails the
        // group; so does one that is not consistent when consistency is
        // required.
        if !matches!(self.phase, Phase::Failing(_) | Phase::Done) {
            let failed = self.members.iter().find_map(|(vm, m)| match m {
                Member::Done {
                    ready: false, why, ..
                } => Some(format!(
                    "member VirtualMachine {vm:?} failed: {}",
                    why.clone()
                        .unwrap_or_else(|| "its snapshot was not taken".into())
                )),
                Member::Done {
                    consistent: false, ..
                } if self.required => {
                    Some(format!("member VirtualMachine {vm:?} is not consistent"))
                }
                _ => None,
            });
            if let Some(why) = failed {
                out.extend(self.fail(why));
            }
        }
        let all = |f: &dyn Fn(&Member) -> bool| self.members.values().all(f);
        let done_ok = |m: &Member| matches!(m, Member::Done { ready: true, .. });
        match self.phase.clone() {
            Phase::Gathering => {
                if all(&|m| matches!(m, Member::AtFreeze | Member::AtCut { .. }) || done_ok(m)) {
                    if self.members.values().any(|m| *m == Member::AtFreeze) {
                        let deadline = now + self.deadline_ms;
                        self.deadline = Some(deadline);
                        self.phase = Phase::Intent;
                        out.push(GroupCommand::RecordIntent { deadline });
                    } else {
                        // Nobody needs a freeze (stopped, nothing mounted,
                        // or crash-consistent members): cut together.
                        out.extend(self.go_cut());
                    }
                }
            }
            Phase::Intent => {}
            Phase::Freezing => {
                let deadline = self.deadline.unwrap_or(now);
                let fits = now + TRANSACTION_BUDGET_MS <= deadline;
                let at_barrier = all(&|m| matches!(m, Member::AtCut { .. }) || done_ok(m));
                if at_barrier && (fits || !self.required) {
                    // Past the deadline without consistency required: the
                    // members thaw by their own deadline and cut
                    // crash-consistent.
                    out.extend(self.go_cut());
                } else if !fits && self.required {
                    out.extend(self.fail(format!(
                        "not every member was frozen within the group's {} s deadline (the shortest spec.freezeDeadlineSeconds of its VMs); every member was thawed",
                        self.deadline_ms / 1000
                    )));
                }
            }
            Phase::Cutting => {
                let deadline = self.deadline.unwrap_or(now);
                let cut = all(&|m| matches!(m, Member::CutDone | Member::Done { .. }));
                if cut || (self.deadline.is_some() && now >= deadline) {
                    // Every member has cut (or the deadline came: nobody
                    // stays frozen past it): all thaw.
                    self.phase = Phase::Thawing;
                    for (vm, m) in self.members.iter_mut() {
                        if *m == Member::CutDone {
                            *m = Member::Thawing;
                            out.push(GroupCommand::GoThaw { vm: vm.clone() });
                        }
                    }
                    out.extend(self.advance(now));
                }
            }
            Phase::Thawing => {
                if all(&|m| matches!(m, Member::Done { .. })) {
                    let consistent = self.members.values().all(|m| {
                        matches!(
                            m,
                            Member::Done {
                                consistent: true,
                                ..
                            }
                        )
                    });
                    let window_ms = self
                        .members
                        .values()
                        .filter_map(|m| match m {
                            Member::Done { window_ms, .. } => *window_ms,
                            _ => None,
                        })
                        .max();
                    self.phase = Phase::Done;
                    out.push(GroupCommand::Finish(GroupOutcome::Ready {
                        consistent,
                        window_ms,
                    }));
                }
            }
            Phase::Failing(why) => {
                if all(&|m| matches!(m, Member::Done { .. })) {
                    self.phase = Phase::Done;
                    out.push(GroupCommand::Finish(GroupOutcome::Failed(why)));
                }
            }
            Phase::Done => {}
        }
        out
    }

    fn go_cut(&mut self) -> Vec<GroupCommand> {
        self.phase = Phase::Cutting;
        let mut out = Vec::new();
        for (vm, m) in self.members.iter_mut() {
            if matches!(m, Member::AtCut { .. }) {
                *m = Member::Cutting;
                out.push(GroupCommand::GoCut { vm: vm.clone() });
            }
        }
        out
    }

    /// Every member that has not been let cut is told to abort at once: one
    /// held frozen thaws, one still freezing thaws when its freeze returns.
    fn fail(&mut self, why: String) -> Vec<GroupCommand> {
        self.phase = Phase::Failing(why.clone());
        let mut out = Vec::new();
        for (vm, m) in self.members.iter_mut() {
            if matches!(
                m,
                Member::Preparing | Member::AtFreeze | Member::Freezing | Member::AtCut { .. }
            ) {
                *m = Member::Aborting;
                out.push(GroupCommand::Abort {
                    vm: vm.clone(),
                    why: why.clone(),
                });
            } else if *m == Member::CutDone {
                // Cut already and held frozen: thaws at once.
                *m = Member::Thawing;
                out.push(GroupCommand::GoThaw { vm: vm.clone() });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
