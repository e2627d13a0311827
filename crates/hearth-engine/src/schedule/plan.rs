//! What a snapshot schedule does now: which slot to run or skip, which of
//! its snapshots retention deletes, when to look again. Pure: the shell
//! (`reconcile.rs`) reads the store and the clock, and carries out the plan.
//!
//! Which slots have run is decided from the runs themselves (each carries
//! the slot it was made for) as well as from `status.lastScheduleTime`, so
//! a crash between making a run's snapshots and writing the status never
//! makes a slot run twice.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

/// Where a schedule's slots fall.
pub trait Calendar {
    /// The first slot strictly after `t`.
    fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>>;
    /// The last slot at or before `t`.
    fn latest_at_or_before(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>>;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunState {
    /// Its cut has not finished.
    Active,
    Ready {
        cut: DateTime<Utc>,
    },
    Failed,
}

/// One run's object: a VM snapshot (per VM) or a snapshot group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    pub name: String,
    /// Retention counts within a bucket: the VM's name for per-VM runs,
    /// one bucket for group runs.
    pub bucket: String,
    pub slot: DateTime<Utc>,
    pub state: RunState,
    /// `hearth.dev/keep: "true"`: never deleted, not counted.
    pub pinned: bool,
    /// A disk made from it, or an export or a restore reading it: not
    /// deleted now (retention tries again later).
    pub in_use: bool,
}

#[derive(Clone, Debug)]
pub struct Inputs<'a, C: Calendar> {
    pub now: DateTime<Utc>,
    pub calendar: &'a C,
    /// No slot at or before the schedule's creation runs.
    pub created: DateTime<Utc>,
    /// `status.lastScheduleTime`.
    pub last_slot: Option<DateTime<Utc>>,
    pub suspend: bool,
    pub deadline: Option<Duration>,
    pub keep: Option<u32>,
    pub max_age: Option<Duration>,
    /// The schedule's runs, those being deleted left out.
    pub runs: &'a [Run],
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Slot {
    /// Make this slot's run now.
    Run(DateTime<Utc>),
    /// This slot passes without a run, for this reason.
    Skip(DateTime<Utc>, String),
    /// Due, but the previous run is still going: look again soon.
    Wait(DateTime<Utc>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub slot: Option<Slot>,
    /// Runs retention deletes now, oldest first.
    pub delete: Vec<String>,
    /// The next slot after the ones handled here.
    pub next: Option<DateTime<Utc>>,
    /// When retention must look at the runs again with no slot due: a run
    /// it keeps turns older than `maxAge`, or one in use blocked a delete
    /// (`status.nextRetentionTime`, which the idle check reads).
    pub retention_at: Option<DateTime<Utc>>,
    pub wake_in: Duration,
}

/// What the schedule's own row says: enough to know that nothing is due
/// without reading its runs.
#[derive(Clone, Debug)]
pub struct Glance {
    pub now: DateTime<Utc>,
    pub created: DateTime<Utc>,
    /// `status.lastScheduleTime`.
    pub last_slot: Option<DateTime<Utc>>,
    /// `status.active` is not empty.
    pub running: bool,
    /// The status was made from the spec as it is now.
    pub spec_seen: bool,
    /// `status.nextRetentionTime`.
    pub retention_at: Option<DateTime<Utc>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Idle {
    pub next: Option<DateTime<Utc>>,
    pub wake_in: Duration,
}

/// `Some` when the schedule has nothing to do now, decided from its row
/// alone: no slot after the last handled one is due, no run is going, the
/// spec is the one the status was made from, and retention has nothing
/// timed. Then [`plan`] over its runs would run, skip and delete nothing
/// (property-tested), so the shell reads no runs.
pub fn idle<C: Calendar>(calendar: &C, g: &Glance) -> Option<Idle> {
    let anchor = anchor(g.created, g.last_slot);
    let due = calendar
        .latest_at_or_before(g.now)
        .is_some_and(|s| s > anchor);
    let retention_due = g.retention_at.is_some_and(|t| t <= g.now);
    if due || g.running || !g.spec_seen || retention_due {
        return None;
    }
    let next = calendar.next_after(g.now.max(anchor));
    Some(Idle {
        next,
        wake_in: idle_wake(g.now, next, g.retention_at),
    })
}

/// The latest slot handled (none at or before the schedule's creation runs).
fn anchor(created: DateTime<Utc>, handled: Option<DateTime<Utc>>) -> DateTime<Utc> {
    handled.unwrap_or(created).max(created)
}

/// Until the next slot or the next retention time, at most [`IDLE_WAKE`].
fn idle_wake(
    now: DateTime<Utc>,
    next: Option<DateTime<Utc>>,
    retention_at: Option<DateTime<Utc>>,
) -> Duration {
    [next, retention_at]
        .into_iter()
        .flatten()
        .filter_map(|t| (t - now).to_std().ok())
        .fold(IDLE_WAKE, Duration::min)
        .max(Duration::from_millis(100))
}

/// How soon retention tries again a delete a run in use blocked.
pub const BLOCKED_RETRY: Duration = Duration::from_secs(10);

/// How often a schedule with nothing to do reads the clock again: a wall
/// clock set forward is noticed within this, whatever the monotonic timer
/// says.
pub const IDLE_WAKE: Duration = Duration::from_secs(30);
/// How often a schedule with a run going looks at it.
pub const ACTIVE_WAKE: Duration = Duration::from_secs(2);

pub fn plan<C: Calendar>(i: &Inputs<'_, C>) -> Plan {
    let ran = i.runs.iter().map(|r| r.slot).max();
    // The latest slot already handled: by the status, or by a run that
    // exists (its status write may have been lost).
    let handled = [i.last_slot, ran].into_iter().flatten().max();
    let anchor = anchor(i.created, handled);
    let active = i.runs.iter().any(|r| r.state == RunState::Active);
    let due = i
        .calendar
        .latest_at_or_before(i.now)
        .filter(|s| *s > anchor);
    let late = |s: DateTime<Utc>| {
        let by = (i.now - s).to_std().unwrap_or_default();
        i.deadline.filter(|d| by > *d).map(|d| (by, d))
    };
    let slot = due.map(|s| {
        if i.suspend {
            Slot::Skip(s, "the schedule is suspended".into())
        } else if let Some((by, d)) = late(s) {
            let why = if active {
                "the previous run was still going"
            } else {
                "it could not start in time (hearthd down, or its clock set forward)"
            };
            Slot::Skip(
                s,
                format!(
                    "{why}: {}s after the slot, past startingDeadlineSeconds {}",
                    by.as_secs(),
                    d.as_secs()
                ),
            )
        } else if active {
            Slot::Wait(s)
        } else {
            Slot::Run(s)
        }
    });
    let after = match &slot {
        Some(Slot::Run(s)) | Some(Slot::Skip(s, _)) => (*s).max(i.now),
        _ => i.now.max(anchor),
    };
    let next = i.calendar.next_after(after);
    let delete = retention(i);
    let blocked = deletable(i).len() > delete.len();
    let retention_at = if blocked {
        Some(i.now + BLOCKED_RETRY)
    } else {
        aging(i, &delete)
    };
    let wake_in = if active || matches!(slot, Some(Slot::Wait(_))) {
        ACTIVE_WAKE
    } else {
        idle_wake(i.now, next, retention_at)
    };
    Plan {
        slot,
        delete,
        next,
        retention_at,
        wake_in,
    }
}

/// The first moment after now that a good run left turns older than
/// `maxAge` (the newest good one of its bucket included: one extra look).
fn aging<C: Calendar>(i: &Inputs<'_, C>, deleted: &[String]) -> Option<DateTime<Utc>> {
    let age = chrono::TimeDelta::from_std(i.max_age?).ok()?;
    i.runs
        .iter()
        .filter(|r| !r.pinned && !deleted.contains(&r.name))
        .filter_map(|r| match r.state {
            RunState::Ready { cut } => cut.checked_add_signed(age),
            _ => None,
        })
        .filter(|t| *t > i.now)
        .min()
}

/// What retention would delete, in-use runs included.
fn deletable<'a, C: Calendar>(i: &Inputs<'a, C>) -> Vec<&'a Run> {
    let mut buckets: BTreeMap<&str, Vec<&Run>> = BTreeMap::new();
    for r in i.runs.iter().filter(|r| !r.pinned) {
        buckets.entry(&r.bucket).or_default().push(r);
    }
    let mut out = Vec::new();
    for runs in buckets.values_mut() {
        // Newest first.
        runs.sort_by(|a, b| b.slot.cmp(&a.slot).then_with(|| a.name.cmp(&b.name)));
        let newest_terminal = runs
            .iter()
            .filter(|r| r.state != RunState::Active)
            .map(|r| r.slot)
            .max();
        let mut ready_seen = 0u32;
        for r in runs.iter() {
            let doomed = match r.state {
                RunState::Active => false,
                RunState::Ready { cut } => {
                    ready_seen += 1;
                    let past_keep = i.keep.is_some_and(|k| ready_seen > k);
                    // The newest good snapshot is never aged away: a
                    // schedule that stopped succeeding keeps its last
                    // good point.
                    let too_old = ready_seen > 1
                        && i.max_age
                            .is_some_and(|a| (i.now - cut).to_std().is_ok_and(|age| age >= a));
                    past_keep || too_old
                }
                // A failure is shown until a later run ends.
                RunState::Failed => newest_terminal.is_some_and(|n| n > r.slot),
            };
            if doomed {
                out.push(*r);
            }
        }
    }
    out.sort_by(|a, b| a.slot.cmp(&b.slot).then_with(|| a.name.cmp(&b.name)));
    out
}

fn retention<C: Calendar>(i: &Inputs<'_, C>) -> Vec<String> {
    if i.keep.is_none()
        && i.max_age.is_none()
        && !i.runs.iter().any(|r| r.state == RunState::Failed)
    {
        return Vec::new();
    }
    deletable(i)
        .into_iter()
        .filter(|r| !r.in_use)
        .map(|r| r.name.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use proptest::prelude::*;

    /// Every `every` seconds from the epoch.
    struct Every(i64);

    impl Calendar for Every {
        fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
            let s = t.timestamp().div_euclid(self.0) * self.0 + self.0;
            Utc.timestamp_opt(s, 0).single()
        }
        fn latest_at_or_before(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
            let s = t.timestamp().div_euclid(self.0) * self.0;
            Utc.timestamp_opt(s, 0).single()
        }
    }

    fn at(secs: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_800_000_000 + secs, 0).unwrap()
    }

    fn inputs<'a>(cal: &'a Every, now: i64, runs: &'a [Run]) -> Inputs<'a, Every> {
        Inputs {
            now: at(now),
            calendar: cal,
            created: at(0),
            last_slot: None,
            suspend: false,
            deadline: None,
            keep: None,
            max_age: None,
            runs,
        }
    }

    fn ready(name: &str, bucket: &str, slot: i64) -> Run {
        Run {
            name: name.into(),
            bucket: bucket.into(),
            slot: at(slot),
            state: RunState::Ready { cut: at(slot + 1) },
            pinned: false,
            in_use: false,
        }
    }

    #[test]
    fn nothing_before_the_first_slot_after_creation() {
        let cal = Every(60);
        // 1_800_000_000 is a multiple of 60: created exactly on a slot.
        let p = plan(&inputs(&cal, 30, &[]));
        assert_eq!(p.slot, None);
        assert_eq!(p.next, Some(at(60)));
        assert_eq!(p.wake_in, Duration::from_secs(30));
        let p = plan(&inputs(&cal, 61, &[]));
        assert_eq!(p.slot, Some(Slot::Run(at(60))));
        assert_eq!(p.next, Some(at(120)));
    }

    #[test]
    fn slots_missed_while_down_run_once_or_are_skipped_past_the_deadline() {
        let cal = Every(60);
        let mut i = inputs(&cal, 250, &[]);
        i.last_slot = Some(at(60));
        assert_eq!(plan(&i).slot, Some(Slot::Run(at(240))));
        i.deadline = Some(Duration::from_secs(5));
        match plan(&i).slot {
            Some(Slot::Skip(s, why)) => {
                assert_eq!(s, at(240));
                assert!(why.contains("startingDeadlineSeconds 5"), "{why}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_run_that_exists_counts_as_its_slot_handled_even_without_the_status() {
        let cal = Every(60);
        let runs = [ready("s-1", "vm", 60)];
        let p = plan(&inputs(&cal, 70, &runs));
        assert_eq!(p.slot, None);
        assert_eq!(p.next, Some(at(120)));
    }

    #[test]
    fn an_active_run_makes_the_next_slot_wait_then_run() {
        let cal = Every(60);
        let mut active = ready("s-1", "vm", 60);
        active.state = RunState::Active;
        let runs = [active];
        let p = plan(&inputs(&cal, 125, &runs));
        assert_eq!(p.slot, Some(Slot::Wait(at(120))));
        assert_eq!(p.wake_in, ACTIVE_WAKE);
    }

    #[test]
    fn a_clock_set_back_does_not_run_a_slot_again() {
        let cal = Every(60);
        let runs = [ready("s-2", "vm", 120)];
        let mut i = inputs(&cal, 65, &runs);
        i.last_slot = Some(at(120));
        let p = plan(&i);
        assert_eq!(p.slot, None);
        assert_eq!(p.next, Some(at(180)));
    }

    #[test]
    fn suspended_slots_pass_without_a_run() {
        let cal = Every(60);
        let mut i = inputs(&cal, 61, &[]);
        i.suspend = true;
        assert!(matches!(plan(&i).slot, Some(Slot::Skip(_, _))));
    }

    #[test]
    fn keep_counts_per_vm_and_spares_pinned_and_in_use_runs() {
        let cal = Every(60);
        let mut runs = vec![
            ready("a-1", "a", 60),
            ready("a-2", "a", 120),
            ready("a-3", "a", 180),
            ready("a-4", "a", 240),
            ready("b-1", "b", 60),
            ready("b-4", "b", 240),
        ];
        let mut pinned = ready("a-0", "a", 0);
        pinned.pinned = true;
        runs.push(pinned);
        let mut i = inputs(&cal, 250, &runs);
        i.last_slot = Some(at(240));
        i.keep = Some(2);
        assert_eq!(plan(&i).delete, ["a-1", "a-2"]);
        runs[0].in_use = true;
        let mut i = inputs(&cal, 250, &runs);
        i.last_slot = Some(at(240));
        i.keep = Some(2);
        let p = plan(&i);
        assert_eq!(p.delete, ["a-2"]);
        assert!(p.wake_in <= Duration::from_secs(10));
    }

    #[test]
    fn max_age_never_takes_the_newest_good_snapshot() {
        let cal = Every(60);
        let runs = [ready("a-1", "a", 60), ready("a-2", "a", 120)];
        let mut i = inputs(&cal, 100_000, &runs);
        i.last_slot = Some(at(100_000));
        i.max_age = Some(Duration::from_secs(3600));
        assert_eq!(plan(&i).delete, ["a-1"]);
    }

    #[test]
    fn a_failure_stays_until_a_later_run_ends() {
        let cal = Every(60);
        let mut failed = ready("a-1", "a", 60);
        failed.state = RunState::Failed;
        let runs = vec![failed.clone()];
        assert!(plan(&inputs(&cal, 70, &runs)).delete.is_empty());
        let runs = vec![failed, ready("a-2", "a", 120)];
        assert_eq!(plan(&inputs(&cal, 130, &runs)).delete, ["a-1"]);
    }

    /// A small world: the clock moves (forward, far forward, back), hearthd
    /// restarts (the status write of a run may be lost), runs finish late.
    #[derive(Clone, Debug)]
    enum Step {
        Tick(i64),
        Jump(i64),
        Restart { lose_status: bool },
        Finish { fail: bool },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (1i64..90).prop_map(Step::Tick),
            1 => (-400i64..400).prop_map(Step::Jump),
            1 => any::<bool>().prop_map(|lose_status| Step::Restart { lose_status }),
            2 => any::<bool>().prop_map(|fail| Step::Finish { fail }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn no_slot_runs_twice_none_runs_early_and_retention_holds(
            steps in proptest::collection::vec(step(), 1..80),
            keep in 1u32..4,
            deadline in proptest::option::of(1u64..200),
            max_age in proptest::option::of(30u64..600),
        ) {
            let cal = Every(60);
            let mut now = 10i64;
            let mut last_slot: Option<DateTime<Utc>> = None;
            // The rest of the status the shell's idle check reads.
            let mut status_active = false;
            let mut retention_at: Option<DateTime<Utc>> = None;
            let mut runs: Vec<Run> = Vec::new();
            let mut started: Vec<(DateTime<Utc>, i64)> = Vec::new();
            let mut pending_status: Option<DateTime<Utc>> = None;
            for s in steps {
                // A run's status write lands now, unless hearthd dies first.
                let lost = matches!(s, Step::Restart { lose_status: true });
                if let Some(p) = pending_status.take().filter(|_| !lost) {
                    last_slot = Some(p);
                    status_active = true;
                }
                match s {
                    Step::Tick(d) => now += d,
                    Step::Jump(d) => now = (now + d).max(0),
                    Step::Restart { .. } => {}
                    Step::Finish { fail } => {
                        for r in runs.iter_mut().filter(|r| r.state == RunState::Active) {
                            r.state = if fail {
                                RunState::Failed
                            } else {
                                RunState::Ready { cut: at(now) }
                            };
                        }
                    }
                }
                let mut i = inputs(&cal, now, &runs);
                i.last_slot = last_slot;
                i.keep = Some(keep);
                i.deadline = deadline.map(Duration::from_secs);
                i.max_age = max_age.map(Duration::from_secs);
                // The shell first looks at the row alone: when that says
                // idle, the full plan must have nothing to do either.
                let glance = Glance {
                    now: at(now),
                    created: at(0),
                    last_slot,
                    running: status_active,
                    spec_seen: true,
                    retention_at,
                };
                if idle(&cal, &glance).is_some() {
                    let p = plan(&i);
                    prop_assert!(
                        matches!(p.slot, None | Some(Slot::Wait(_))) && p.delete.is_empty(),
                        "idle at {now}, but the plan is {p:?}"
                    );
                    continue;
                }
                let p = plan(&i);
                retention_at = p.retention_at;
                // Retention: never an active or pinned run, and what is left
                // of each bucket's good runs is at most `keep`.
                for d in &p.delete {
                    let r = runs.iter().find(|r| &r.name == d).unwrap();
                    prop_assert!(r.state != RunState::Active);
                }
                runs.retain(|r| !p.delete.contains(&r.name));
                status_active = runs.iter().any(|r| r.state == RunState::Active);
                let good = runs.iter().filter(|r| matches!(r.state, RunState::Ready { .. })).count();
                prop_assert!(good as u32 <= keep, "{good} good runs kept, keep {keep}");
                match p.slot {
                    Some(Slot::Run(slot)) => {
                        prop_assert!(slot <= at(now), "slot {slot} ran early at {}", at(now));
                        prop_assert!(
                            started.iter().all(|(s, _)| *s < slot),
                            "slot {slot} after {started:?}"
                        );
                        if let Some(d) = deadline {
                            prop_assert!((at(now) - slot).num_seconds() <= d as i64);
                        }
                        started.push((slot, now));
                        runs.push(Run {
                            name: format!("r-{}", slot.timestamp()),
                            bucket: "vm".into(),
                            slot,
                            state: RunState::Active,
                            pinned: false,
                            in_use: false,
                        });
                        // The status lands at the next step, unless a
                        // restart loses it first.
                        pending_status = Some(slot);
                    }
                    Some(Slot::Skip(slot, _)) => {
                        prop_assert!(started.iter().all(|(s, _)| *s < slot));
                        last_slot = Some(slot);
                    }
                    Some(Slot::Wait(_)) => {
                        prop_assert!(runs.iter().any(|r| r.state == RunState::Active));
                    }
                    None => {}
                }
                if let Some(n) = p.next {
                    prop_assert!(n > at(now));
                }
                prop_assert!(p.wake_in <= IDLE_WAKE && p.wake_in > Duration::ZERO);
            }
        }

        /// The clock moving forward in small steps with no deadline and
        /// runs that finish before the next slot: every slot runs once.
        #[test]
        fn with_a_steady_clock_every_slot_runs(ticks in proptest::collection::vec(1i64..30, 1..200)) {
            let cal = Every(60);
            let mut now = 1i64;
            let mut runs: Vec<Run> = Vec::new();
            let mut last_slot = None;
            for d in ticks {
                now += d;
                for r in runs.iter_mut() {
                    r.state = RunState::Ready { cut: r.slot };
                }
                let mut i = inputs(&cal, now, &runs);
                i.last_slot = last_slot;
                if let Some(Slot::Run(s)) = plan(&i).slot {
                    runs.push(ready(&format!("r-{}", s.timestamp()), "vm", 0));
                    runs.last_mut().unwrap().slot = s;
                    runs.last_mut().unwrap().state = RunState::Active;
                    last_slot = Some(s);
                }
            }
            let slots: Vec<i64> = runs.iter().map(|r| (r.slot - at(0)).num_seconds()).collect();
            let expected: Vec<i64> = (1..=now / 60).map(|k| k * 60).collect();
            prop_assert_eq!(slots, expected);
        }
    }
}
