//! The steps of a cut: what the coordinator does as each result comes in.

use super::*;

impl Coordinator {
    /// This cut's freeze was sent and no thaw followed yet.
    pub(super) fn frozen_by_us(&self, c: &Cut) -> bool {
        matches!(c.mode, Mode::Live { freeze: true }) && c.freeze_sent_at.is_some() && !c.thaw_done
    }

    /// Thaws the guest straight away (trusted frozen: no status read first).
    pub(super) fn thaw_now(&mut self, c: &mut Cut) -> Vec<Command> {
        c.step = Step::Thawing;
        vec![Command::Thaw {
            cut: c.id,
            timeout: THAW_TIMEOUT_MS,
            only_if_frozen: !c.trusted,
        }]
    }

    /// The group failed before this member froze (or it is not frozen):
    /// every request fails, nothing is cut.
    pub(super) fn abort_now(&mut self, c: &mut Cut, now: Millis) -> Vec<Command> {
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
    pub(super) fn with_cut(
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

    pub(super) fn start(&mut self, access: Access, id: CutId, now: Millis) -> Vec<Command> {
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

    pub(super) fn prepared(
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

    pub(super) fn transact(&mut self, c: &mut Cut) -> Vec<Command> {
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
    pub(super) fn record_intent(&mut self, c: &mut Cut, now: Millis) -> Vec<Command> {
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

    pub(super) fn intent_recorded(
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
    pub(super) fn deadline_for(&self, c: &Cut, now: Millis) -> Millis {
        let own = now + self.deadline_ms;
        c.group_deadline.map_or(own, |g| g.min(own))
    }

    /// Freezing is off the table: requests that require consistency fail
    /// with `why`; the others are cut crash-consistent, without a freeze.
    pub(super) fn serve_without_freeze(
        &mut self,
        c: &mut Cut,
        why: String,
        now: Millis,
    ) -> Vec<Command> {
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

    pub(super) fn previous_thawed(
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

    pub(super) fn freeze_replied(
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

    pub(super) fn deadline_text(&self) -> String {
        format!(
            "the freeze did not complete within the {} s deadline (spec.freezeDeadlineSeconds); the guest was thawed",
            self.deadline_ms / 1000
        )
    }

    pub(super) fn status_replied(
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

    pub(super) fn thaw_replied(
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
    pub(super) fn transacted(
        &mut self,
        c: &mut Cut,
        result: TxResult,
        now: Millis,
    ) -> Vec<Command> {
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
    pub(super) fn observed_frozen(
        &mut self,
        c: &mut Cut,
        applied: Option<bool>,
        now: Millis,
    ) -> Vec<Command> {
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
    pub(super) fn switch_unseen_text(&self, read_failed: bool) -> String {
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
    pub(super) fn hold_or_thaw(&mut self, c: &mut Cut, now: Millis) -> Vec<Command> {
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
    pub(super) fn after_transaction(&mut self, c: &mut Cut, now: Millis) -> Vec<Command> {
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

    pub(super) fn finish(&mut self, c: &mut Cut, now: Millis) -> Vec<Command> {
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
pub(super) fn cut_disks(c: &Cut) -> Vec<String> {
    let mut disks: Vec<String> = c.requests.iter().map(|r| r.disk.clone()).collect();
    disks.sort();
    disks.dedup();
    disks
}

/// Settles every request that requires consistency as failed with `why`.
pub(super) fn fail_required(c: &mut Cut, why: &str) {
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
