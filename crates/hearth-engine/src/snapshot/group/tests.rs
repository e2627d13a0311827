//! The group core driving real member coordinators against simulated
//! guests: scripted scenarios, then property tests over random
//! interleavings of member replies, agent faults (errors, timeouts, replies
//! lost after their effect), slow freezes, time, store failures and daemon
//! crashes at every step. Invariants are checked after every step.

use std::collections::VecDeque;

use proptest::prelude::*;

use super::*;
use crate::snapshot::coordinator::{
    self as co, Access, AgentFault, Command, Coordinator, Durable, Input, Mounts, Outcome, Request,
    TxResult,
};

const DEADLINE: Millis = 10_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Agent {
    Present,
    Missing,
    Stopped,
}

/// One member VM: its coordinator, the commands its actor has yet to run,
/// the group's messages not yet delivered, and its guest.
struct Vm {
    name: String,
    core: Coordinator,
    queue: VecDeque<Command>,
    inbox: VecDeque<Input>,
    agent: Agent,
    frozen: bool,
    frozen_since: Option<Millis>,
    freezes: u32,
    thaws: u32,
    /// Durable: this VM's freeze intent (cut and its requests).
    intent: Option<(u64, Vec<Request>)>,
    /// Durable: the member's snapshot outcome, once committed.
    outcome: Option<Outcome>,
    request: Request,
    started: bool,
    /// Its transaction ran.
    cut_done: bool,
    /// A thaw of it failed (retried every second by the shell).
    thaw_failed: bool,
}

struct Sim {
    required: bool,
    now: Millis,
    vms: Vec<Vm>,
    /// `None` once the daemon crashed: the group's run is gone, and every
    /// member report is answered with an abort.
    group: Option<Group>,
    group_queue: VecDeque<GroupCommand>,
    /// Durable: the group's intent.
    group_intent: bool,
    group_outcome: Option<GroupOutcome>,
    counter: u64,
    crashed: bool,
    /// The deadline the group gave its members, to check I3.
    deadline: Option<Millis>,
    log: Vec<String>,
}

fn request(vm: &str, required: bool) -> Request {
    Request {
        snapshot: format!("g-{vm}-disk"),
        disk: format!("{vm}-disk"),
        required,
        whole_vm: true,
        group: Some("g".into()),
    }
}

impl Sim {
    fn new(agents: &[Agent], required: bool) -> Sim {
        let vms: Vec<Vm> = agents
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let name = format!("vm{i}");
                let mut core = Coordinator::new(DEADLINE);
                let request = request(&name, required);
                core.handle(Input::Requested(request.clone()));
                Vm {
                    name,
                    core,
                    queue: VecDeque::new(),
                    inbox: VecDeque::new(),
                    agent: *a,
                    frozen: false,
                    frozen_since: None,
                    freezes: 0,
                    thaws: 0,
                    intent: None,
                    outcome: None,
                    request,
                    started: false,
                    cut_done: false,
                    thaw_failed: false,
                }
            })
            .collect();
        let names: Vec<String> = vms.iter().map(|v| v.name.clone()).collect();
        Sim {
            required,
            now: 0,
            vms,
            group: Some(Group::new(&names, required, DEADLINE)),
            group_queue: VecDeque::new(),
            group_intent: false,
            group_outcome: None,
            counter: 0,
            crashed: false,
            deadline: None,
            log: Vec::new(),
        }
    }

    fn access(v: &Vm) -> Access {
        match v.agent {
            Agent::Present => Access::Agent,
            Agent::Missing => Access::NoAgent("spec.guestAgent is false".into()),
            Agent::Stopped => Access::Offline,
        }
    }

    fn mounts(v: &Vm) -> Option<Result<Mounts, crate::snapshot::coordinator::MountsUnknown>> {
        (v.agent == Agent::Present).then(|| {
            Ok(Mounts {
                by_disk: [(v.request.disk.clone(), vec!["/data".to_string()])].into(),
                unmapped: vec![],
            })
        })
    }

    fn tell_group(&mut self, input: GroupInput) {
        match self.group.as_mut() {
            Some(g) => {
                let out = g.handle(input);
                self.group_queue.extend(out);
            }
            None => {
                // No group runs (the daemon restarted): a member that asks
                // is told to abort.
                if let GroupInput::Report { vm, report, .. } = input
                    && !matches!(report, Report::Finished { .. })
                {
                    let i = self.vms.iter().position(|v| v.name == vm).unwrap();
                    if let Some((cut, _)) = self.vms[i].core.current_cut() {
                        self.vms[i].inbox.push_back(Input::GroupAbort {
                            cut,
                            why: "the group's run ended".into(),
                            now: self.now,
                        });
                    }
                }
            }
        }
    }

    fn feed(&mut self, i: usize, input: Input) {
        let out = self.vms[i].core.handle(input);
        self.vms[i].queue.extend(out);
    }

    /// The actor of member `i` runs its next command (starting a cut first
    /// if it is idle with work); `fault` picks the agent's behaviour.
    fn step_member(&mut self, i: usize, fault: u8, took: Millis) {
        if self.vms[i].queue.is_empty() {
            let v = &mut self.vms[i];
            if v.core.is_idle() && (v.core.has_pending() || v.core.needs_thaw()) {
                let access = Sim::access(v);
                if v.core.is_due(&access) {
                    self.counter += 1;
                    let cut = self.counter;
                    v.started = true;
                    let out = v.core.handle(Input::Start {
                        access,
                        cut,
                        now: self.now,
                    });
                    v.queue.extend(out);
                }
            }
            return;
        }
        let cmd = self.vms[i].queue.pop_front().unwrap();
        self.log
            .push(format!("{}: {cmd:?} fault {fault}", self.vms[i].name));
        let agent_fault = match fault % 8 {
            0..=4 => None,
            5 => Some((AgentFault::Error("boom".into()), false)),
            6 => Some((AgentFault::Timeout, true)),
            _ => Some((AgentFault::Timeout, false)),
        };
        match cmd {
            Command::Prepare { cut, .. } => {
                let failed = if fault == 7 {
                    vec![(self.vms[i].request.disk.clone(), "no space".into())]
                } else {
                    vec![]
                };
                let mounts = Sim::mounts(&self.vms[i]);
                self.advance(took % 50);
                self.feed(
                    i,
                    Input::Prepared {
                        cut,
                        failed,
                        mounts,
                        now: self.now,
                    },
                );
            }
            Command::RecordIntent { cut, .. } => {
                let ok = fault != 7;
                if ok {
                    let reqs = self.vms[i].core.cut_requests().to_vec();
                    self.vms[i].intent = Some((cut, reqs));
                }
                self.feed(
                    i,
                    Input::IntentRecorded {
                        cut,
                        result: if ok { Ok(()) } else { Err("disk full".into()) },
                        now: self.now,
                    },
                );
            }
            Command::Freeze { cut, timeout, .. } => {
                assert!(
                    self.group_intent || self.crashed,
                    "I5: a member froze before the group's intent was stored\n{:#?}",
                    self.log
                );
                assert!(
                    self.vms[i].intent.is_some(),
                    "a freeze without the VM's intent"
                );
                // A slow freeze hook: the freeze takes `took` ms.
                let slow = took > timeout;
                let result = match &agent_fault {
                    _ if slow => {
                        self.advance(timeout);
                        self.freeze(i);
                        Err(AgentFault::Timeout)
                    }
                    None => {
                        self.advance(took);
                        self.freeze(i);
                        Ok(1)
                    }
                    Some((f, effect)) => {
                        if *effect {
                            self.freeze(i);
                        }
                        Err(f.clone())
                    }
                };
                self.feed(
                    i,
                    Input::FreezeReplied {
                        cut,
                        result,
                        now: self.now,
                    },
                );
            }
            Command::QueryFreeze { cut, .. } => {
                let result = match agent_fault {
                    None => Ok(self.vms[i].frozen),
                    Some((f, _)) => Err(f),
                };
                self.feed(
                    i,
                    Input::StatusReplied {
                        cut,
                        result,
                        now: self.now,
                    },
                );
            }
            Command::Transact { cut, .. } => {
                // I1: with consistency required, a member cuts only while it
                // is frozen and while every other member is frozen too or
                // has already cut while frozen: all cuts show one instant.
                if self.required && self.vms[i].agent != Agent::Stopped {
                    for v in &self.vms {
                        assert!(
                            v.frozen
                                || v.agent == Agent::Stopped
                                || (v.cut_done && v.name != self.vms[i].name),
                            "I1: {} cut while {} is not frozen\n{:#?}",
                            self.vms[i].name,
                            v.name,
                            self.log
                        );
                    }
                }
                let result = match fault % 8 {
                    6 => TxResult::Rejected("refused".into()),
                    // QEMU ran it; the reply was lost.
                    5 => TxResult::Unknown("timeout".into()),
                    _ => TxResult::Applied,
                };
                if result != TxResult::Rejected("refused".into()) {
                    self.vms[i].cut_done = true;
                }
                self.feed(
                    i,
                    Input::Transacted {
                        cut,
                        result,
                        now: self.now,
                    },
                );
            }
            Command::Observe { cut, .. } => {
                // QEMU's block graph: the switch, if the transaction ran.
                let applied = Some(self.vms[i].cut_done);
                self.feed(
                    i,
                    Input::Observed {
                        cut,
                        applied,
                        now: self.now,
                    },
                )
            }
            Command::Thaw {
                cut,
                only_if_frozen,
                ..
            } => {
                // G2: with consistency required, a member that has cut
                // thaws only once every member has cut, unless the deadline
                // came or the group failed.
                if self.required && self.vms[i].cut_done && self.vms[i].frozen {
                    let failing = match &self.group {
                        Some(g) => matches!(g.phase(), Phase::Failing(_)),
                        None => true,
                    };
                    let late = self.deadline.is_some_and(|d| self.now >= d);
                    for v in &self.vms {
                        assert!(
                            v.cut_done || v.agent == Agent::Stopped || failing || late,
                            "G2: {} thaws before {} has cut\n{:#?}",
                            self.vms[i].name,
                            v.name,
                            self.log
                        );
                    }
                }
                let result = match agent_fault {
                    Some((f, effect)) => {
                        if effect {
                            self.thaw(i);
                        }
                        self.vms[i].thaw_failed = true;
                        Err(f)
                    }
                    None => {
                        if only_if_frozen && !self.vms[i].frozen {
                            Ok(0)
                        } else {
                            assert!(self.vms[i].frozen, "I6: a thaw hook ran on a thawed guest");
                            self.thaw(i);
                            Ok(1)
                        }
                    }
                };
                self.feed(
                    i,
                    Input::ThawReplied {
                        cut,
                        result,
                        now: self.now,
                    },
                );
            }
            Command::Discard { .. } => {}
            Command::GroupReport { report, .. } => {
                let report = match report {
                    co::GroupReport::ReadyToFreeze => Report::ReadyToFreeze,
                    co::GroupReport::ReadyToCut { frozen } => Report::ReadyToCut { frozen },
                    co::GroupReport::ReadyToThaw => Report::Cut,
                };
                let vm = self.vms[i].name.clone();
                let now = self.now;
                self.tell_group(GroupInput::Report { vm, report, now });
            }
            Command::Commit {
                cut,
                outcomes,
                keep_intent,
                freeze_window_ms,
                why_not_consistent,
                ..
            } => {
                // I8: a cut ends (an aborted one too) only after its guest
                // was thawed: an abort thaws at once, it never leaves the
                // thaw to a later retry.
                assert!(
                    !self.vms[i].frozen || self.vms[i].thaw_failed,
                    "I8: {} commits its cut while frozen\n{:#?}",
                    self.vms[i].name,
                    self.log
                );
                let ok = fault != 7;
                let group_cut = self.vms[i].core.cut_group().is_some();
                if ok {
                    if !keep_intent {
                        self.vms[i].intent = None;
                    }
                    for (name, o) in &outcomes {
                        if *name == self.vms[i].request.snapshot && !matches!(o, Outcome::Retry) {
                            self.vms[i].outcome = Some(o.clone());
                        }
                    }
                }
                self.feed(i, Input::Committed { cut, ok });
                if ok && group_cut {
                    let (ready, consistent, why) = match self.vms[i].outcome.clone() {
                        Some(Outcome::Ready { consistent }) => (true, consistent, None),
                        Some(Outcome::Failed(w)) => (false, false, Some(w)),
                        _ => (false, false, why_not_consistent),
                    };
                    let vm = self.vms[i].name.clone();
                    let now = self.now;
                    self.tell_group(GroupInput::Report {
                        vm,
                        report: Report::Finished {
                            ready,
                            consistent,
                            why,
                            window_ms: freeze_window_ms,
                        },
                        now,
                    });
                }
            }
        }
    }

    fn freeze(&mut self, i: usize) {
        let now = self.now;
        let v = &mut self.vms[i];
        if !v.frozen {
            v.frozen = true;
            v.frozen_since = Some(now);
            v.freezes += 1;
        }
    }

    fn thaw(&mut self, i: usize) {
        let v = &mut self.vms[i];
        if v.frozen {
            v.frozen = false;
            v.frozen_since = None;
            v.thaws += 1;
        }
    }

    fn step_group(&mut self, fault: u8) {
        let Some(cmd) = self.group_queue.pop_front() else {
            return;
        };
        self.log.push(format!("group: {cmd:?}"));
        let to = |s: &Sim, vm: &str| s.vms.iter().position(|v| v.name == vm).unwrap();
        match cmd {
            GroupCommand::RecordIntent { deadline } => {
                let ok = fault % 8 != 7;
                if ok {
                    self.group_intent = true;
                    self.deadline = Some(deadline);
                }
                let now = self.now;
                self.tell_group(GroupInput::IntentRecorded {
                    result: if ok { Ok(()) } else { Err("disk full".into()) },
                    now,
                });
            }
            GroupCommand::GoFreeze { vm, deadline } => {
                let i = to(self, &vm);
                if let Some((cut, _)) = self.vms[i].core.current_cut() {
                    let now = self.now;
                    self.vms[i]
                        .inbox
                        .push_back(Input::GroupGoFreeze { cut, deadline, now });
                }
            }
            GroupCommand::GoCut { vm } => {
                let i = to(self, &vm);
                if let Some((cut, _)) = self.vms[i].core.current_cut() {
                    let now = self.now;
                    self.vms[i].inbox.push_back(Input::GroupGoCut { cut, now });
                }
            }
            GroupCommand::GoThaw { vm } => {
                let i = to(self, &vm);
                if let Some((cut, _)) = self.vms[i].core.current_cut() {
                    self.vms[i].inbox.push_back(Input::GroupGoThaw { cut });
                }
            }
            GroupCommand::Abort { vm, why } => {
                let i = to(self, &vm);
                if let Some((cut, _)) = self.vms[i].core.current_cut() {
                    let now = self.now;
                    self.vms[i]
                        .inbox
                        .push_back(Input::GroupAbort { cut, why, now });
                }
            }
            GroupCommand::Finish(o) => {
                self.group_intent = false;
                self.group_outcome = Some(o);
            }
        }
    }

    /// A message from the group reaches member `i`'s actor (its `now` is
    /// the time of delivery, as the actor stamps it).
    fn deliver(&mut self, i: usize) {
        if let Some(mut m) = self.vms[i].inbox.pop_front() {
            let now = self.now;
            match &mut m {
                Input::GroupGoFreeze { now: n, .. }
                | Input::GroupGoCut { now: n, .. }
                | Input::GroupAbort { now: n, .. } => *n = now,
                _ => {}
            }
            self.feed(i, m);
        }
    }

    fn advance(&mut self, by: Millis) {
        self.now += by;
        let now = self.now;
        for i in 0..self.vms.len() {
            self.feed(i, Input::Tick { now });
        }
        if let Some(g) = self.group.as_mut() {
            let out = g.handle(GroupInput::Tick { now });
            self.group_queue.extend(out);
        }
        self.check_i3();
    }

    /// I3: no member is left frozen past the group's deadline: a member
    /// frozen past it is busy with a command (each bounded by its timeout in
    /// the shell) that leads to its thaw, never idle at a barrier, unless a
    /// thaw failed (then it is retried) or the daemon crashed.
    fn check_i3(&self) {
        if self.crashed {
            return;
        }
        if let Some(d) = self.deadline {
            for v in &self.vms {
                if v.frozen && self.now > d && !v.thaw_failed {
                    assert!(
                        v.queue
                            .iter()
                            .any(|c| !matches!(c, Command::GroupReport { .. })),
                        "I3: {} idle and frozen at {} past the deadline {d} (cut {:?}, wake at {:?}, queue {:?})\n{:#?}",
                        v.name,
                        self.now,
                        v.core.current_cut(),
                        v.core.wake_at(),
                        v.queue,
                        self.log
                    );
                }
            }
        }
    }

    /// The daemon dies: nothing in memory survives. Members come back from
    /// their durable state; the group's run is gone, so the restarted daemon
    /// fails the group (after its members are thawed).
    fn crash(&mut self) {
        self.log.push("CRASH".into());
        self.crashed = true;
        self.group = None;
        self.group_queue.clear();
        for v in &mut self.vms {
            let pending = if v.outcome.is_none() {
                vec![v.request.clone()]
            } else {
                vec![]
            };
            let (core, out) = Coordinator::recover(
                DEADLINE,
                Durable {
                    // As the shell rebuilds it: the intent's requests that
                    // are not settled yet.
                    intent: v
                        .intent
                        .clone()
                        .map(|(cut, r)| (cut, if pending.is_empty() { vec![] } else { r })),
                    pending,
                },
            );
            v.core = core;
            v.queue = out.into();
            v.inbox.clear();
        }
        if self.group_outcome.is_none() {
            self.group_outcome = Some(GroupOutcome::Failed("hearthd restarted".into()));
            self.group_intent = false;
        }
    }

    fn busy(&self) -> bool {
        !self.group_queue.is_empty()
            || self.vms.iter().any(|v| {
                !v.queue.is_empty()
                    || !v.inbox.is_empty()
                    || !v.core.is_idle()
                    || v.core.has_pending()
                    || v.core.needs_thaw()
            })
    }

    /// Runs everything to rest without faults.
    fn settle(&mut self) {
        for _ in 0..10_000 {
            if !self.busy() {
                break;
            }
            for i in 0..self.vms.len() {
                self.deliver(i);
                self.step_member(i, 0, 20);
            }
            self.step_group(0);
            if self.busy()
                && self
                    .vms
                    .iter()
                    .all(|v| v.queue.is_empty() && v.inbox.is_empty())
            {
                self.advance(100);
            }
        }
        assert!(!self.busy(), "did not settle\n{:#?}", self.log);
    }

    fn check_final(&self) {
        for v in &self.vms {
            assert!(
                !v.frozen,
                "I4: {} still frozen at rest\n{:#?}",
                v.name, self.log
            );
            assert_eq!(v.freezes, v.thaws, "I4: {} freezes and thaws", v.name);
            assert!(v.intent.is_none(), "I4: {} intent left", v.name);
            assert!(v.outcome.is_some(), "I4: {} snapshot unsettled", v.name);
        }
        let outcome = self
            .group_outcome
            .clone()
            .unwrap_or_else(|| panic!("I4: the group never ended\n{:#?}", self.log));
        assert!(!self.group_intent, "the group's intent is left");
        match outcome {
            GroupOutcome::Ready { consistent, .. } => {
                for v in &self.vms {
                    let Some(Outcome::Ready { consistent: c }) = &v.outcome else {
                        panic!("I7: the group is Ready but {} is {:?}", v.name, v.outcome);
                    };
                    if self.required {
                        assert!(
                            *c,
                            "I7: a required group Ready with {} not consistent",
                            v.name
                        );
                    }
                }
                if self.required {
                    assert!(consistent);
                }
            }
            // The shell fails every member snapshot of a failed group with
            // the group's reason; nothing more to check in the model.
            GroupOutcome::Failed(_) => {}
        }
    }
}

#[test]
fn two_members_freeze_together_then_cut_then_thaw() {
    let mut s = Sim::new(&[Agent::Present, Agent::Present], true);
    s.settle();
    s.check_final();
    assert!(matches!(
        s.group_outcome,
        Some(GroupOutcome::Ready {
            consistent: true,
            ..
        })
    ));
    for v in &s.vms {
        assert_eq!((v.freezes, v.thaws), (1, 1));
    }
}

#[test]
fn a_member_without_an_agent_fails_a_required_group_and_nobody_freezes() {
    let mut s = Sim::new(&[Agent::Present, Agent::Missing], true);
    s.settle();
    s.check_final();
    let Some(GroupOutcome::Failed(why)) = &s.group_outcome else {
        panic!("{:?}", s.group_outcome)
    };
    assert!(why.contains("vm1"), "{why}");
    assert!(why.contains("spec.guestAgent is false"), "{why}");
    // vm0 was held before its freeze and let go without one.
    assert_eq!(s.vms[0].freezes, 0);
    assert!(matches!(s.vms[0].outcome, Some(Outcome::Failed(_))));
}

#[test]
fn without_required_consistency_a_member_without_an_agent_is_cut_crash_consistent() {
    let mut s = Sim::new(&[Agent::Present, Agent::Missing], false);
    s.settle();
    s.check_final();
    assert_eq!(
        s.group_outcome,
        Some(GroupOutcome::Ready {
            consistent: false,
            window_ms: s.group_outcome.as_ref().and_then(|o| match o {
                GroupOutcome::Ready { window_ms, .. } => *window_ms,
                _ => None,
            })
        })
    );
    assert_eq!(s.vms[0].outcome, Some(Outcome::Ready { consistent: true }));
    assert_eq!(s.vms[1].outcome, Some(Outcome::Ready { consistent: false }));
}

#[test]
fn a_freeze_that_outlasts_the_deadline_thaws_every_member_at_once() {
    let mut s = Sim::new(&[Agent::Present, Agent::Present], true);
    // Bring both to their freeze.
    for _ in 0..40 {
        for i in 0..2 {
            if !matches!(s.vms[i].queue.front(), Some(Command::Freeze { .. })) {
                s.deliver(i);
                s.step_member(i, 0, 10);
            }
        }
        s.step_group(0);
    }
    assert!(matches!(
        s.vms[0].queue.front(),
        Some(Command::Freeze { .. })
    ));
    // vm0 freezes quickly and waits at the barrier; vm1's hook takes longer
    // than the whole deadline.
    s.step_member(0, 0, 50);
    s.step_member(0, 0, 1);
    assert!(matches!(
        s.vms[0].queue.front(),
        Some(Command::GroupReport { .. })
    ));
    s.step_member(0, 0, 1);
    assert!(s.vms[0].frozen);
    s.step_member(1, 0, DEADLINE * 2);
    // The group's deadline passed: vm0 was told to abort (or thawed on its
    // own at its deadline), and thaws.
    s.settle();
    s.check_final();
    let Some(GroupOutcome::Failed(why)) = &s.group_outcome else {
        panic!("{:?}", s.group_outcome)
    };
    assert!(why.contains("deadline"), "{why}");
    for v in &s.vms {
        assert_eq!((v.freezes, v.thaws), (1, 1), "{}", v.name);
        assert!(matches!(v.outcome, Some(Outcome::Failed(_))));
    }
}

#[test]
fn a_crash_while_both_are_frozen_thaws_both_and_fails_the_group() {
    let mut s = Sim::new(&[Agent::Present, Agent::Present], true);
    for _ in 0..100 {
        for i in 0..2 {
            s.deliver(i);
            s.step_member(i, 0, 10);
        }
        s.step_group(0);
        if s.vms.iter().all(|v| v.frozen) {
            break;
        }
    }
    assert!(s.vms.iter().all(|v| v.frozen));
    s.crash();
    s.settle();
    s.check_final();
    assert!(matches!(s.group_outcome, Some(GroupOutcome::Failed(_))));
    for v in &s.vms {
        assert!(
            matches!(v.outcome, Some(Outcome::Failed(_))),
            "{:?}",
            v.outcome
        );
    }
}

/// A member's coordinator by hand: a group's requests are cut alone, held
/// at both barriers, and an ordinary request made meanwhile neither joins
/// the group's cut nor thaws the guest: it takes the next cut.
#[test]
fn a_member_cut_holds_only_the_group_and_an_ordinary_request_waits_for_the_next_cut() {
    let mut c = Coordinator::new(DEADLINE);
    let ordinary = Request {
        snapshot: "nightly".into(),
        disk: "vm0-disk".into(),
        required: true,
        whole_vm: false,
        group: None,
    };
    c.handle(Input::Requested(request("vm0", true)));
    c.handle(Input::Requested(ordinary.clone()));
    let out = c.handle(Input::Start {
        access: Access::Agent,
        cut: 1,
        now: 0,
    });
    assert!(
        matches!(out[..], [Command::Prepare { cut: 1, .. }]),
        "{out:?}"
    );
    assert_eq!(c.cut_requests(), [request("vm0", true)]);
    assert_eq!(c.pending(), std::slice::from_ref(&ordinary));
    let mounts = Some(Ok(Mounts {
        by_disk: [("vm0-disk".to_string(), vec!["/data".to_string()])].into(),
        unmapped: vec![],
    }));
    let out = c.handle(Input::Prepared {
        cut: 1,
        failed: vec![],
        mounts,
        now: 10,
    });
    assert_eq!(
        out,
        vec![Command::GroupReport {
            cut: 1,
            report: co::GroupReport::ReadyToFreeze
        }]
    );
    // Held: the ordinary request did not join, and nothing runs until the
    // group answers.
    assert_eq!(c.cut_requests().len(), 1);
    assert!(c.handle(Input::Tick { now: 500 }).is_empty());
    let out = c.handle(Input::GroupGoFreeze {
        cut: 1,
        deadline: 3_000,
        now: 20,
    });
    assert!(
        matches!(
            out[..],
            [Command::RecordIntent {
                cut: 1,
                deadline: 3_000
            }]
        ),
        "{out:?}"
    );
    let out = c.handle(Input::IntentRecorded {
        cut: 1,
        result: Ok(()),
        now: 25,
    });
    // The group's deadline, not the VM's 10 s, bounds the freeze.
    assert!(
        matches!(out[..], [Command::Freeze { timeout: 2_975, .. }]),
        "{out:?}"
    );
    c.handle(Input::FreezeReplied {
        cut: 1,
        result: Ok(1),
        now: 80,
    });
    let out = c.handle(Input::StatusReplied {
        cut: 1,
        result: Ok(true),
        now: 90,
    });
    assert_eq!(
        out,
        vec![Command::GroupReport {
            cut: 1,
            report: co::GroupReport::ReadyToCut { frozen: true }
        }]
    );
    // Held frozen: it wakes by its deadline on its own.
    assert_eq!(c.wake_at(), Some(1_000));
    assert!(c.handle(Input::Tick { now: 999 }).is_empty());
    let out = c.handle(Input::GroupGoCut { cut: 1, now: 120 });
    assert!(
        matches!(out[..], [Command::Transact { cut: 1, .. }]),
        "{out:?}"
    );
    let out = c.handle(Input::Transacted {
        cut: 1,
        result: TxResult::Applied,
        now: 130,
    });
    // Cut, and still frozen until every member has cut.
    assert_eq!(
        out,
        vec![Command::GroupReport {
            cut: 1,
            report: co::GroupReport::ReadyToThaw
        }]
    );
    assert_eq!(c.wake_at(), Some(3_000));
    let out = c.handle(Input::GroupGoThaw { cut: 1 });
    assert!(matches!(out[..], [Command::Thaw { cut: 1, .. }]), "{out:?}");
    let out = c.handle(Input::ThawReplied {
        cut: 1,
        result: Ok(1),
        now: 170,
    });
    let Some(Command::Commit { outcomes, .. }) = out.last() else {
        panic!("{out:?}")
    };
    assert_eq!(
        outcomes[..],
        [(
            "g-vm0-disk".to_string(),
            Outcome::Ready { consistent: true }
        )]
    );
    c.handle(Input::Committed { cut: 1, ok: true });
    // The ordinary request takes the next cut, with a freeze of its own.
    let out = c.handle(Input::Start {
        access: Access::Agent,
        cut: 2,
        now: 200,
    });
    assert!(
        matches!(out[..], [Command::Prepare { cut: 2, .. }]),
        "{out:?}"
    );
    assert_eq!(c.cut_requests(), [ordinary]);
}

/// A member held frozen past its deadline thaws by itself, even if the
/// group never answers.
#[test]
fn a_member_held_frozen_thaws_at_its_deadline_without_the_group() {
    let mut s = Sim::new(&[Agent::Present, Agent::Present], true);
    for _ in 0..100 {
        for i in 0..2 {
            s.deliver(i);
            s.step_member(i, 0, 10);
        }
        s.step_group(0);
        if s.vms[0].frozen
            && matches!(
                s.vms[0].core.current_cut(),
                Some((_, co::Step::GroupHoldCut))
            )
        {
            break;
        }
    }
    assert!(s.vms[0].frozen);
    // The group's run is gone (no answer ever comes); time passes.
    s.group = None;
    s.group_queue.clear();
    s.vms[0].inbox.clear();
    let at = s.vms[0].core.wake_at().expect("a deadline to wake at");
    s.advance(at - s.now);
    assert!(
        s.vms[0]
            .queue
            .iter()
            .any(|c| matches!(c, Command::Thaw { .. })),
        "{:?}",
        s.vms[0].queue
    );
    while s.vms[0].frozen && !s.vms[0].queue.is_empty() {
        s.step_member(0, 0, 10);
    }
    assert!(!s.vms[0].frozen);
}

/// The group core alone: the intent comes once every member is prepared,
/// with the one deadline; only a group that requires consistency has
/// something to do when the transaction's budget runs out.
#[test]
fn the_intent_waits_for_every_member_and_only_a_required_group_wakes_at_its_budget() {
    for required in [true, false] {
        let vms = ["a".to_string(), "b".to_string()];
        let mut g = Group::new(&vms, required, DEADLINE);
        let out = g.handle(GroupInput::Report {
            vm: "a".into(),
            report: Report::ReadyToFreeze,
            now: 5,
        });
        assert!(out.is_empty(), "{out:?}");
        let out = g.handle(GroupInput::Report {
            vm: "b".into(),
            report: Report::ReadyToFreeze,
            now: 7,
        });
        assert_eq!(
            out,
            vec![GroupCommand::RecordIntent {
                deadline: 7 + DEADLINE
            }]
        );
        let out = g.handle(GroupInput::IntentRecorded {
            result: Ok(()),
            now: 9,
        });
        assert_eq!(out.len(), 2, "{out:?}");
        assert!(out.iter().all(|c| matches!(
            c,
            GroupCommand::GoFreeze { deadline, .. } if *deadline == 7 + DEADLINE
        )));
        assert_eq!(
            g.wake_at(),
            required.then_some(7 + DEADLINE - co::TRANSACTION_BUDGET_MS)
        );
    }
}

#[derive(Clone, Debug)]
enum Action {
    Member { vm: u8, fault: u8, took: u16 },
    Deliver { vm: u8 },
    Group { fault: u8 },
    Advance { by: u16 },
    Crash,
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        8 => (any::<u8>(), any::<u8>(), 0u16..3000).prop_map(|(vm, fault, took)| Action::Member { vm, fault, took }),
        4 => any::<u8>().prop_map(|vm| Action::Deliver { vm }),
        4 => any::<u8>().prop_map(|fault| Action::Group { fault }),
        2 => (0u16..6000).prop_map(|by| Action::Advance { by }),
        1 => Just(Action::Crash),
    ]
}

fn agent() -> impl Strategy<Value = Agent> {
    prop_oneof![6 => Just(Agent::Present), 1 => Just(Agent::Missing), 1 => Just(Agent::Stopped)]
}

fn run(agents: Vec<Agent>, required: bool, actions: Vec<Action>) {
    let mut s = Sim::new(&agents, required);
    let n = s.vms.len();
    for a in actions {
        match a {
            Action::Member { vm, fault, took } => {
                s.step_member(vm as usize % n, fault, u64::from(took) * 4)
            }
            Action::Deliver { vm } => s.deliver(vm as usize % n),
            Action::Group { fault } => s.step_group(fault),
            Action::Advance { by } => s.advance(u64::from(by)),
            Action::Crash => s.crash(),
        }
        s.check_i3();
    }
    s.settle();
    s.check_final();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn group_invariants_hold_over_random_interleavings(
        agents in prop::collection::vec(agent(), 2..4),
        required in any::<bool>(),
        actions in prop::collection::vec(action(), 0..120),
    ) {
        run(agents, required, actions);
    }

    #[test]
    fn a_required_group_of_agents_is_ready_and_consistent_without_faults(
        n in 2usize..5,
        order in prop::collection::vec((any::<u8>(), any::<bool>()), 0..200),
    ) {
        let mut s = Sim::new(&vec![Agent::Present; n], true);
        for (vm, deliver) in order {
            let i = vm as usize % n;
            if deliver { s.deliver(i) } else { s.step_member(i, 0, 30) }
            s.step_group(0);
        }
        s.settle();
        s.check_final();
        let ready = matches!(s.group_outcome, Some(GroupOutcome::Ready { consistent: true, .. }));
        prop_assert!(ready, "{:?}", s.group_outcome);
    }
}
