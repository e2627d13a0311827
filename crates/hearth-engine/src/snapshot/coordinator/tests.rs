//! The coordinator against a simulated guest, agent and store: scripted
//! scenarios first, then property tests over random interleavings of
//! requests, agent replies (ok, error, timeout, late effect, "disabled while
//! frozen"), someone else thawing the guest, transaction results and daemon
//! crashes at every step. The invariants are checked after every step.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use proptest::prelude::*;

use super::*;
use crate::snapshot::overlays;

const DEADLINE: Millis = 10_000;

fn req(name: &str, disk: &str, required: bool) -> Request {
    Request {
        snapshot: name.into(),
        disk: disk.into(),
        required,
        whole_vm: false,
        group: None,
    }
}

/// Drives one happy cut by hand and checks each command.
#[test]
fn one_cut_freezes_once_cuts_all_disks_in_one_transaction_and_thaws() {
    let mut c = Coordinator::new(DEADLINE);
    for (n, d) in [("a1", "a"), ("a2", "a"), ("b1", "b")] {
        assert!(c.handle(Input::Requested(req(n, d, true))).is_empty());
    }
    let out = c.handle(Input::Start {
        access: Access::Agent,
        cut: 1,
        now: 0,
    });
    assert_eq!(
        out,
        vec![Command::Prepare {
            cut: 1,
            disks: vec!["a".into(), "b".into()]
        }]
    );
    let out = c.handle(Input::Prepared {
        cut: 1,
        failed: vec![],
        mounts: None,
        now: 5,
    });
    assert_eq!(
        out,
        vec![Command::RecordIntent {
            cut: 1,
            deadline: 5 + DEADLINE
        }]
    );
    // Arrives once the intent names the cut's snapshots: waits for the next one.
    c.handle(Input::Requested(req("late", "a", true)));
    let out = c.handle(Input::IntentRecorded {
        cut: 1,
        result: Ok(()),
        now: 6,
    });
    assert_eq!(
        out,
        vec![Command::Freeze {
            cut: 1,
            timeout: DEADLINE,
            mountpoints: None,
        }]
    );
    let out = c.handle(Input::FreezeReplied {
        cut: 1,
        result: Ok(2),
        now: 80,
    });
    assert!(matches!(out[..], [Command::QueryFreeze { cut: 1, .. }]));
    let out = c.handle(Input::StatusReplied {
        cut: 1,
        result: Ok(true),
        now: 85,
    });
    assert!(matches!(out[..], [Command::Transact { cut: 1, .. }]));
    let out = c.handle(Input::Transacted {
        cut: 1,
        result: TxResult::Applied,
        now: 95,
    });
    assert!(matches!(out[..], [Command::Thaw { cut: 1, .. }]));
    let out = c.handle(Input::ThawReplied {
        cut: 1,
        result: Ok(2),
        now: 100,
    });
    let Command::Commit {
        outcomes,
        took_cut,
        freeze_window_ms,
        ..
    } = &out[0]
    else {
        panic!("{out:?}")
    };
    assert!(took_cut);
    assert_eq!(*freeze_window_ms, Some(94));
    assert_eq!(outcomes.len(), 3);
    assert!(
        outcomes
            .iter()
            .all(|(_, o)| *o == Outcome::Ready { consistent: true })
    );
    c.handle(Input::Committed { cut: 1, ok: true });
    assert!(c.is_idle());
    assert_eq!(
        c.pending().len(),
        1,
        "the late request waits for the next cut"
    );
}

/// A lone request starts its cut at once; requests made while the cut is
/// being prepared join it when their disk's overlay is ready, and the rest
/// are gathered for the next cut.
#[test]
fn requests_made_while_a_cut_is_prepared_join_it_when_their_disk_is_ready() {
    let mut c = Coordinator::new(DEADLINE);
    c.handle(Input::Requested(req("first", "a", true)));
    assert!(!c.gather_first(0), "a lone request waits for nobody");
    let out = c.handle(Input::Start {
        access: Access::Agent,
        cut: 1,
        now: 0,
    });
    assert_eq!(
        out,
        vec![Command::Prepare {
            cut: 1,
            disks: vec!["a".into()]
        }]
    );
    // While the overlay of "a" is made: one more of "a".
    c.handle(Input::Requested(req("also-a", "a", true)));
    let out = c.handle(Input::Prepared {
        cut: 1,
        failed: vec![],
        mounts: None,
        now: 5,
    });
    assert!(matches!(out[..], [Command::RecordIntent { cut: 1, .. }]));
    let names: Vec<&str> = c
        .cut_requests()
        .iter()
        .map(|r| r.snapshot.as_str())
        .collect();
    assert_eq!(
        names,
        ["also-a", "first"],
        "the request of a prepared disk joins"
    );
    assert!(c.pending().is_empty());
    // Once the intent names the cut's snapshots, a request waits.
    c.handle(Input::Requested(req("on-b", "b", true)));
    let out = c.handle(Input::IntentRecorded {
        cut: 1,
        result: Ok(()),
        now: 6,
    });
    assert!(matches!(out[..], [Command::Freeze { cut: 1, .. }]));
    let out = freeze_cut_and_thaw(&mut c, 1, 1);
    let (outcomes, took_cut) = commit_of(&out);
    assert!(took_cut);
    assert_eq!(
        outcomes,
        vec![
            ("also-a".to_string(), Outcome::Ready { consistent: true }),
            ("first".to_string(), Outcome::Ready { consistent: true }),
        ]
    );
    c.handle(Input::Committed { cut: 1, ok: true });
    // "on-b" came during a cut: a burst is under way, so its stragglers
    // are gathered before the next cut starts.
    assert!(c.gather_first(200));
    assert!(c.gather_first(200 + BURST_WINDOW_MS), "came during the cut");
    let out = c.handle(Input::Start {
        access: Access::Agent,
        cut: 2,
        now: 200,
    });
    assert!(matches!(out[..], [Command::Prepare { cut: 2, .. }]));
    assert!(!c.gather_first(200));
}

/// A request right after a cut may be a straggler of its burst; one that
/// comes later is alone and starts at once.
#[test]
fn only_a_request_soon_after_a_cut_is_gathered() {
    let mut c = Coordinator::new(DEADLINE);
    c.handle(Input::Requested(req("a1", "a", true)));
    c.handle(Input::Start {
        access: Access::Agent,
        cut: 1,
        now: 0,
    });
    c.handle(Input::Prepared {
        cut: 1,
        failed: vec![],
        mounts: None,
        now: 5,
    });
    c.handle(Input::IntentRecorded {
        cut: 1,
        result: Ok(()),
        now: 6,
    });
    // The thaw reply at 40 decides the cut.
    freeze_cut_and_thaw(&mut c, 1, 1);
    c.handle(Input::Committed { cut: 1, ok: true });
    c.handle(Input::Requested(req("a2", "a", true)));
    assert!(c.gather_first(40 + BURST_WINDOW_MS - 1));
    assert!(!c.gather_first(40 + BURST_WINDOW_MS));
}

/// A disk whose overlay could not be made takes no late request either.
#[test]
fn a_late_request_of_a_disk_that_failed_to_prepare_waits_for_the_next_cut() {
    let mut c = Coordinator::new(DEADLINE);
    c.handle(Input::Requested(req("a1", "a", true)));
    c.handle(Input::Requested(req("b1", "b", true)));
    c.handle(Input::Start {
        access: Access::Agent,
        cut: 1,
        now: 0,
    });
    c.handle(Input::Requested(req("b2", "b", true)));
    let out = c.handle(Input::Prepared {
        cut: 1,
        failed: vec![("b".into(), "disk full".into())],
        mounts: None,
        now: 5,
    });
    assert!(matches!(out[..], [Command::RecordIntent { cut: 1, .. }]));
    assert_eq!(c.cut_requests(), &[req("a1", "a", true)][..]);
    assert_eq!(c.pending(), &[req("b2", "b", true)][..]);
}

/// A VM snapshot's disks arrive together while a cut of one of them is
/// prepared: none of them joins, so they are cut together, in the next cut.
#[test]
fn requests_made_together_are_never_split_between_two_cuts() {
    let mut c = Coordinator::new(DEADLINE);
    c.handle(Input::Requested(req("a1", "a", true)));
    c.handle(Input::Start {
        access: Access::Agent,
        cut: 1,
        now: 0,
    });
    for (n, d) in [("vm-a", "a"), ("vm-b", "b"), ("vm-c", "c")] {
        c.handle(Input::Requested(req(n, d, true)));
    }
    let out = c.handle(Input::Prepared {
        cut: 1,
        failed: vec![],
        mounts: None,
        now: 5,
    });
    assert!(matches!(out[..], [Command::RecordIntent { cut: 1, .. }]));
    assert_eq!(c.cut_requests(), &[req("a1", "a", true)][..]);
    assert_eq!(c.pending().len(), 3, "all three wait for the next cut");
}

/// Without an agent the late request is not slipped into a cut that
/// already failed its required requests: it takes the next one.
#[test]
fn a_cut_without_an_agent_takes_no_late_request() {
    let mut c = Coordinator::new(DEADLINE);
    c.handle(Input::Requested(req("a1", "a", false)));
    c.handle(Input::Start {
        access: Access::NoAgent("no agent".into()),
        cut: 1,
        now: 0,
    });
    c.handle(Input::Requested(req("a2", "a", true)));
    let out = c.handle(Input::Prepared {
        cut: 1,
        failed: vec![],
        mounts: None,
        now: 5,
    });
    assert!(matches!(out[..], [Command::Transact { cut: 1, .. }]));
    assert_eq!(c.cut_requests(), &[req("a1", "a", false)][..]);
    assert_eq!(c.pending(), &[req("a2", "a", true)][..]);
}

/// The frozen window of cut 1, from the freeze reply on: `frozen` file
/// systems frozen and confirmed, the transaction applied, `thawed` thawed.
/// Returns what the thaw reply leads to.
fn freeze_cut_and_thaw(c: &mut Coordinator, frozen: u32, thawed: u32) -> Vec<Command> {
    c.handle(Input::FreezeReplied {
        cut: 1,
        result: Ok(frozen),
        now: 10,
    });
    c.handle(Input::StatusReplied {
        cut: 1,
        result: Ok(true),
        now: 20,
    });
    c.handle(Input::Transacted {
        cut: 1,
        result: TxResult::Applied,
        now: 30,
    });
    c.handle(Input::ThawReplied {
        cut: 1,
        result: Ok(thawed),
        now: 40,
    })
}

#[test]
fn a_thaw_count_mismatch_is_not_consistent() {
    let mut c = freezing_cut(&[req("a1", "a", true), req("a2", "a", false)]);
    let out = freeze_cut_and_thaw(&mut c, 2, 0);
    let Command::Commit { outcomes, .. } = &out[0] else {
        panic!("{out:?}")
    };
    let map: BTreeMap<_, _> = outcomes.iter().cloned().collect();
    assert!(
        matches!(&map["a1"], Outcome::Failed(m) if m.contains("thawed 0")),
        "{map:?}"
    );
    assert_eq!(map["a2"], Outcome::Ready { consistent: false });
}

#[test]
fn no_agent_fails_required_and_cuts_the_rest_without_freezing() {
    let mut c = Coordinator::new(DEADLINE);
    c.handle(Input::Requested(req("must", "a", true)));
    c.handle(Input::Requested(req("may", "a", false)));
    let out = c.handle(Input::Start {
        access: Access::NoAgent("spec.guestAgent is false".into()),
        cut: 1,
        now: 0,
    });
    assert!(matches!(out[..], [Command::Prepare { .. }]));
    let out = c.handle(Input::Prepared {
        cut: 1,
        failed: vec![],
        mounts: None,
        now: 0,
    });
    assert!(
        matches!(out[..], [Command::Transact { .. }]),
        "no freeze: {out:?}"
    );
    let out = c.handle(Input::Transacted {
        cut: 1,
        result: TxResult::Applied,
        now: 5,
    });
    let Command::Commit { outcomes, .. } = &out[0] else {
        panic!("{out:?}")
    };
    let map: BTreeMap<_, _> = outcomes.iter().cloned().collect();
    assert!(matches!(&map["must"], Outcome::Failed(m) if m.contains("spec.guestAgent is false")));
    assert_eq!(map["may"], Outcome::Ready { consistent: false });
}

#[test]
fn a_freeze_timeout_thaws_and_never_claims_consistency() {
    let mut c = freezing_cut(&[req("a1", "a", true)]);
    let out = c.handle(Input::FreezeReplied {
        cut: 1,
        result: Err(AgentFault::Timeout),
        now: DEADLINE,
    });
    assert!(matches!(out[..], [Command::Thaw { .. }]));
    let out = c.handle(Input::ThawReplied {
        cut: 1,
        result: Ok(2),
        now: DEADLINE + 50,
    });
    assert!(
        matches!(out[..], [Command::Discard { .. }, Command::Commit { .. }]),
        "{out:?}"
    );
    let Command::Commit {
        outcomes, took_cut, ..
    } = &out[1]
    else {
        panic!()
    };
    assert!(!took_cut);
    assert!(matches!(&outcomes[0].1, Outcome::Failed(m) if m.contains("deadline")));
}

#[test]
fn restart_mid_cut_thaws_then_retries() {
    let durable = Durable {
        pending: vec![req("a1", "a", true), req("b1", "b", true)],
        intent: Some((7, vec![req("a1", "a", true)])),
    };
    let (mut c, out) = Coordinator::recover(DEADLINE, durable);
    assert_eq!(
        out,
        vec![Command::Thaw {
            cut: 7,
            timeout: THAW_TIMEOUT_MS,
            only_if_frozen: true,
        }]
    );
    let out = c.handle(Input::ThawReplied {
        cut: 7,
        result: Ok(1),
        now: 10,
    });
    let Command::Commit {
        outcomes, took_cut, ..
    } = out.last().cloned().unwrap()
    else {
        panic!()
    };
    assert!(!took_cut);
    assert_eq!(outcomes, vec![("a1".to_string(), Outcome::Retry)]);
    c.handle(Input::Committed { cut: 7, ok: true });
    let names: Vec<_> = c.pending().iter().map(|r| r.snapshot.clone()).collect();
    assert_eq!(names, vec!["b1".to_string(), "a1".to_string()]);
    // The next cut takes the id the shell gives it.
    let out = c.handle(Input::Start {
        access: Access::Agent,
        cut: 8,
        now: 20,
    });
    assert!(matches!(out[..], [Command::Prepare { cut: 8, .. }]));
}

/// A cut of `requests` (cut 1) whose intent is stored and whose freeze has
/// been sent: ready for `FreezeReplied`.
fn freezing_cut(requests: &[Request]) -> Coordinator {
    let mut c = Coordinator::new(DEADLINE);
    for r in requests {
        c.handle(Input::Requested(r.clone()));
    }
    c.handle(Input::Start {
        access: Access::Agent,
        cut: 1,
        now: 0,
    });
    c.handle(Input::Prepared {
        cut: 1,
        failed: vec![],
        mounts: None,
        now: 0,
    });
    c.handle(Input::IntentRecorded {
        cut: 1,
        result: Ok(()),
        now: 0,
    });
    c
}

/// Drives a cut up to its transaction: prepared, intent stored, frozen and
/// confirmed. Returns the coordinator, ready for `Transacted`.
fn frozen_cut(requests: &[Request]) -> Coordinator {
    let mut c = freezing_cut(requests);
    c.handle(Input::FreezeReplied {
        cut: 1,
        result: Ok(1),
        now: 10,
    });
    let out = c.handle(Input::StatusReplied {
        cut: 1,
        result: Ok(true),
        now: 20,
    });
    assert!(matches!(out[..], [Command::Transact { .. }]), "{out:?}");
    c
}

fn commit_of(out: &[Command]) -> (Vec<(String, Outcome)>, bool) {
    match out.last() {
        Some(Command::Commit {
            outcomes, took_cut, ..
        }) => (outcomes.clone(), *took_cut),
        other => panic!("expected a commit, got {other:?}"),
    }
}

/// The thaw that follows a cut whose freeze was confirmed: no status read
/// first.
fn direct_thaw() -> Vec<Command> {
    vec![Command::Thaw {
        cut: 1,
        timeout: THAW_TIMEOUT_MS,
        only_if_frozen: false,
    }]
}

#[test]
fn a_transaction_without_a_reply_is_looked_up_in_qemu_before_the_thaw() {
    for (applied, expect_taken) in [(Some(true), true), (Some(false), false)] {
        let mut c = frozen_cut(&[req("a1", "a", true)]);
        let out = c.handle(Input::Transacted {
            cut: 1,
            result: TxResult::Unknown("QMP command transaction got no reply".into()),
            now: 2_030,
        });
        // Still frozen: QEMU's block graph is read first, within what is
        // left of the deadline (the freeze was sent at 0).
        assert_eq!(
            out,
            vec![Command::Observe {
                cut: 1,
                timeout: DEADLINE - 2_030,
                while_frozen: true,
            }]
        );
        let out = c.handle(Input::Observed {
            cut: 1,
            applied,
            now: 4_000,
        });
        assert_eq!(out, direct_thaw());
        let out = c.handle(Input::ThawReplied {
            cut: 1,
            result: Ok(1),
            now: 4_010,
        });
        let (outcomes, took) = commit_of(&out);
        assert_eq!(took, expect_taken, "{applied:?}");
        if expect_taken {
            assert_eq!(outcomes[0].1, Outcome::Ready { consistent: true });
            assert!(!out.iter().any(|c| matches!(c, Command::Discard { .. })));
        } else {
            assert!(matches!(&outcomes[0].1, Outcome::Failed(_)), "{outcomes:?}");
            assert!(matches!(out[0], Command::Discard { .. }), "{out:?}");
        }
    }
}

/// A switch QEMU shows only after the thaw may have happened after it: the
/// cut is never consistent then, whether the block graph could not be read
/// in the freeze or the deadline left no time to read it.
#[test]
fn a_switch_seen_only_after_the_thaw_is_never_consistent() {
    for (required, no_time) in [(true, false), (false, false), (true, true), (false, true)] {
        let mut c = frozen_cut(&[req("a1", "a", required)]);
        let out = c.handle(Input::Transacted {
            cut: 1,
            result: TxResult::Unknown("QMP command transaction got no reply".into()),
            now: if no_time { DEADLINE } else { 2_030 },
        });
        if !no_time {
            assert!(
                matches!(
                    out[..],
                    [Command::Observe {
                        while_frozen: true,
                        ..
                    }]
                ),
                "{out:?}"
            );
            let out = c.handle(Input::Observed {
                cut: 1,
                applied: None,
                now: DEADLINE,
            });
            assert_eq!(out, direct_thaw());
        } else {
            assert_eq!(out, direct_thaw());
        }
        let out = c.handle(Input::ThawReplied {
            cut: 1,
            result: Ok(1),
            now: DEADLINE + 10,
        });
        assert_eq!(
            out,
            vec![Command::Observe {
                cut: 1,
                timeout: OBSERVE_TIMEOUT_MS,
                while_frozen: false,
            }]
        );
        let out = c.handle(Input::Observed {
            cut: 1,
            applied: Some(true),
            now: DEADLINE + 20,
        });
        let (outcomes, took) = commit_of(&out);
        assert!(took, "the overlays are the heads: the guest writes there");
        match &outcomes[0].1 {
            Outcome::Failed(why) if required => {
                assert!(why.contains("after the guest was thawed"), "{why}");
                assert!(why.contains("spec.freezeDeadlineSeconds"), "{why}");
            }
            Outcome::Ready { consistent: false } if !required => {}
            other => panic!("required {required}: {other:?}"),
        }
        // Not seen at all, even after the thaw: nothing is claimed, and the
        // journal settles the overlays by what QEMU shows.
        let mut c = frozen_cut(&[req("a1", "a", required)]);
        c.handle(Input::Transacted {
            cut: 1,
            result: TxResult::Unknown("timeout".into()),
            now: DEADLINE,
        });
        c.handle(Input::ThawReplied {
            cut: 1,
            result: Ok(1),
            now: DEADLINE + 10,
        });
        let out = c.handle(Input::Observed {
            cut: 1,
            applied: None,
            now: DEADLINE + 20,
        });
        let (outcomes, took) = commit_of(&out);
        assert!(!took);
        assert!(matches!(out[0], Command::Discard { .. }), "{out:?}");
        assert!(matches!(&outcomes[0].1, Outcome::Failed(_)), "{outcomes:?}");
    }
}

#[test]
fn an_intent_that_cannot_be_stored_stops_the_cut_before_any_freeze() {
    let mut c = Coordinator::new(DEADLINE);
    c.handle(Input::Requested(req("must", "a", true)));
    c.handle(Input::Requested(req("may", "a", false)));
    c.handle(Input::Start {
        access: Access::Agent,
        cut: 3,
        now: 0,
    });
    let out = c.handle(Input::Prepared {
        cut: 3,
        failed: vec![],
        mounts: None,
        now: 0,
    });
    assert!(matches!(out[..], [Command::RecordIntent { .. }]));
    let out = c.handle(Input::IntentRecorded {
        cut: 3,
        result: Err("database is locked".into()),
        now: 1,
    });
    assert!(
        !out.iter().any(|c| matches!(c, Command::Freeze { .. })),
        "never a freeze without a stored intent: {out:?}"
    );
    assert!(matches!(out[..], [Command::Transact { .. }]), "{out:?}");
    assert!(!c.needs_thaw());
    let out = c.handle(Input::Transacted {
        cut: 3,
        result: TxResult::Applied,
        now: 5,
    });
    let (outcomes, _) = commit_of(&out);
    let map: BTreeMap<_, _> = outcomes.into_iter().collect();
    assert!(
        matches!(&map["must"], Outcome::Failed(m) if m.contains("intent")),
        "{map:?}"
    );
    assert_eq!(map["may"], Outcome::Ready { consistent: false });
}

#[test]
fn a_commit_the_store_refuses_is_written_again_until_it_lands() {
    let mut c = frozen_cut(&[req("a1", "a", true)]);
    c.handle(Input::Transacted {
        cut: 1,
        result: TxResult::Applied,
        now: 30,
    });
    let out = c.handle(Input::ThawReplied {
        cut: 1,
        result: Ok(1),
        now: 40,
    });
    let first = out.last().cloned().expect("commit");
    for _ in 0..3 {
        let again = c.handle(Input::Committed { cut: 1, ok: false });
        assert_eq!(again, vec![first.clone()], "the same results, again");
        assert!(
            !c.is_idle(),
            "the cut is not over until its results are stored"
        );
    }
    assert!(c.handle(Input::Committed { cut: 1, ok: true }).is_empty());
    assert!(c.is_idle());
}

#[test]
fn one_disk_that_cannot_be_prepared_fails_only_its_own_requests() {
    let mut c = Coordinator::new(DEADLINE);
    c.handle(Input::Requested(req("a1", "a", true)));
    c.handle(Input::Requested(req("b1", "b", true)));
    c.handle(Input::Start {
        access: Access::Agent,
        cut: 1,
        now: 0,
    });
    let out = c.handle(Input::Prepared {
        cut: 1,
        failed: vec![("b".into(), "VirtualDisk \"b\" is not attached".into())],
        mounts: None,
        now: 0,
    });
    assert!(
        matches!(out[..], [Command::RecordIntent { .. }]),
        "a goes on: {out:?}"
    );
    c.handle(Input::IntentRecorded {
        cut: 1,
        result: Ok(()),
        now: 0,
    });
    let out = freeze_cut_and_thaw(&mut c, 1, 1);
    let (outcomes, took) = commit_of(&out);
    assert!(took);
    let map: BTreeMap<_, _> = outcomes.into_iter().collect();
    assert_eq!(map["a1"], Outcome::Ready { consistent: true });
    assert!(
        matches!(&map["b1"], Outcome::Failed(m) if m.contains("not attached")),
        "{map:?}"
    );
}

#[test]
fn a_thaw_after_an_unconfirmed_freeze_checks_that_the_guest_is_frozen() {
    let mut c = freezing_cut(&[req("a1", "a", true)]);
    let out = c.handle(Input::FreezeReplied {
        cut: 1,
        result: Err(AgentFault::Error("boom".into())),
        now: 10,
    });
    assert!(
        matches!(
            out[..],
            [Command::Thaw {
                only_if_frozen: true,
                ..
            }]
        ),
        "{out:?}"
    );
}

// ------------------------------------------------------------ what to freeze

/// Four disks: `/a` on a, `/b` on b, `/lv` spans c and d (LVM).
fn four_disks() -> Mounts {
    let mut m = Mounts::default();
    for (d, points) in [
        ("a", vec!["/a"]),
        ("b", vec!["/b"]),
        ("c", vec!["/lv"]),
        ("d", vec!["/lv"]),
        ("e", vec![]),
    ] {
        m.by_disk
            .insert(d.into(), points.into_iter().map(String::from).collect());
    }
    m
}

fn vm_req(name: &str, disk: &str) -> Request {
    Request {
        whole_vm: true,
        group: None,
        ..req(name, disk, true)
    }
}

fn list(points: &[&str]) -> Scope {
    Scope::List(points.iter().map(|p| p.to_string()).collect())
}

#[test]
fn a_disk_snapshot_freezes_only_the_filesystems_on_its_disk() {
    let m = Ok(four_disks());
    assert_eq!(
        freeze_scope(&[req("s", "a", true)], Some(&m)),
        list(&["/a"])
    );
    assert_eq!(
        freeze_scope(&[req("s", "b", true), req("t", "a", false)], Some(&m)),
        list(&["/a", "/b"])
    );
}

#[test]
fn a_filesystem_that_spans_disks_freezes_when_any_of_them_is_cut() {
    let m = Ok(four_disks());
    assert_eq!(
        freeze_scope(&[req("s", "d", true)], Some(&m)),
        list(&["/lv"])
    );
    assert_eq!(
        freeze_scope(&[req("s", "c", true), req("t", "d", true)], Some(&m)),
        list(&["/lv"])
    );
}

#[test]
fn a_vm_snapshot_or_a_cut_that_holds_one_freezes_everything() {
    let m = Ok(four_disks());
    assert_eq!(
        freeze_scope(&[vm_req("v-a", "a"), vm_req("v-b", "b")], Some(&m)),
        Scope::All { why: None }
    );
    // A disk snapshot sharing the cut with a VM snapshot: all.
    assert_eq!(
        freeze_scope(&[req("s", "c", true), vm_req("v-a", "a")], Some(&m)),
        Scope::All { why: None }
    );
}

#[test]
fn an_unmapped_or_unknown_filesystem_freezes_everything_and_says_why() {
    let mut m = four_disks();
    m.unmapped = vec!["/x".into()];
    let Scope::All { why: Some(why) } = freeze_scope(&[req("s", "a", true)], Some(&Ok(m))) else {
        panic!("an unmapped filesystem must freeze all");
    };
    assert_eq!(why, "filesystem /x could not be mapped to a disk");
    let Scope::All { why: Some(why) } =
        freeze_scope(&[req("s", "a", true)], Some(&Err("timeout".into())))
    else {
        panic!("an agent that cannot list must freeze all");
    };
    assert!(why.contains("timeout"), "{why}");
    assert!(matches!(
        freeze_scope(&[req("s", "a", true)], None),
        Scope::All { why: Some(_) }
    ));
    // A cut disk the map does not know.
    assert!(matches!(
        freeze_scope(&[req("s", "z", true)], Some(&Ok(four_disks()))),
        Scope::All { why: Some(_) }
    ));
}

/// Prepares cut 1 of `requests` with the four-disk map and returns what
/// follows the intent.
fn prepared_with_map(requests: &[Request], mounts: Mounts) -> (Coordinator, Vec<Command>) {
    let mut c = Coordinator::new(DEADLINE);
    for r in requests {
        c.handle(Input::Requested(r.clone()));
    }
    c.handle(Input::Start {
        access: Access::Agent,
        cut: 1,
        now: 0,
    });
    let out = c.handle(Input::Prepared {
        cut: 1,
        failed: vec![],
        mounts: Some(Ok(mounts)),
        now: 1,
    });
    (c, out)
}

#[test]
fn a_list_freeze_is_sent_with_its_mount_points_and_its_thaw_count_is_checked() {
    let (mut c, out) = prepared_with_map(&[req("s", "c", true)], four_disks());
    assert!(matches!(out[..], [Command::RecordIntent { cut: 1, .. }]));
    let out = c.handle(Input::IntentRecorded {
        cut: 1,
        result: Ok(()),
        now: 2,
    });
    assert_eq!(
        out,
        vec![Command::Freeze {
            cut: 1,
            timeout: DEADLINE,
            mountpoints: Some(vec!["/lv".into()]),
        }]
    );
    let out = freeze_cut_and_thaw(&mut c, 1, 1);
    let Some(Command::Commit {
        outcomes,
        full_freeze,
        ..
    }) = out.last()
    else {
        panic!("{out:?}");
    };
    assert_eq!(outcomes[0].1, Outcome::Ready { consistent: true });
    assert_eq!(*full_freeze, None);

    // The thaw reports more than the list froze: something else froze and
    // thawed the guest meanwhile.
    let (mut c, _) = prepared_with_map(&[req("s", "c", true)], four_disks());
    c.handle(Input::IntentRecorded {
        cut: 1,
        result: Ok(()),
        now: 2,
    });
    let out = freeze_cut_and_thaw(&mut c, 1, 2);
    let (outcomes, _) = commit_of(&out);
    assert!(
        matches!(&outcomes[0].1, Outcome::Failed(why) if why.contains("froze 1 filesystems but thawed 2")),
        "{outcomes:?}"
    );
}

#[test]
fn a_list_freeze_counts_filesystems_as_the_agent_does() {
    // The test guest binds /mnt/vda at /data, and qemu-ga freezes (and
    // counts) that filesystem once; it does not count one that cannot be
    // frozen (vfat) either. The thaw count is what is checked.
    let mut m = four_disks();
    m.by_disk
        .insert("a".into(), vec!["/a".into(), "/data".into()]);
    let (mut c, _) = prepared_with_map(&[req("s", "a", true)], m);
    let out = c.handle(Input::IntentRecorded {
        cut: 1,
        result: Ok(()),
        now: 2,
    });
    assert!(matches!(&out[..], [Command::Freeze { mountpoints: Some(l), .. }] if l.len() == 2));
    let out = freeze_cut_and_thaw(&mut c, 1, 1);
    let (outcomes, _) = commit_of(&out);
    assert_eq!(outcomes[0].1, Outcome::Ready { consistent: true });
}

#[test]
fn a_cut_whose_disks_carry_no_filesystem_freezes_nothing() {
    let (mut c, out) = prepared_with_map(&[req("s", "e", true)], four_disks());
    assert!(
        matches!(out[..], [Command::Transact { cut: 1, .. }]),
        "{out:?}"
    );
    assert!(!c.needs_thaw());
    let out = c.handle(Input::Transacted {
        cut: 1,
        result: TxResult::Applied,
        now: 3,
    });
    let (outcomes, took_cut) = commit_of(&out);
    assert!(took_cut);
    assert_eq!(outcomes[0].1, Outcome::Ready { consistent: true });
}

#[test]
fn an_unmapped_filesystem_freezes_all_and_the_commit_says_why() {
    let mut m = four_disks();
    m.unmapped = vec!["/x".into()];
    let (mut c, _) = prepared_with_map(&[req("s", "a", true)], m);
    let out = c.handle(Input::IntentRecorded {
        cut: 1,
        result: Ok(()),
        now: 2,
    });
    assert!(matches!(
        out[..],
        [Command::Freeze {
            mountpoints: None,
            ..
        }]
    ));
    let out = freeze_cut_and_thaw(&mut c, 2, 2);
    let Some(Command::Commit { full_freeze, .. }) = out.last() else {
        panic!("{out:?}");
    };
    assert_eq!(
        full_freeze.as_deref(),
        Some("filesystem /x could not be mapped to a disk")
    );
}

fn mounts_strategy() -> impl Strategy<Value = Mounts> {
    // Up to 5 disks, up to 6 filesystems, each on a random set of disks
    // (none: unmapped).
    proptest::collection::vec(proptest::collection::btree_set(0u8..5, 0..3), 0..6).prop_map(|fs| {
        let mut m = Mounts::default();
        for d in 0..5 {
            m.by_disk.insert(format!("d{d}"), Vec::new());
        }
        for (i, disks) in fs.iter().enumerate() {
            let point = format!("/fs{i}");
            if disks.is_empty() {
                m.unmapped.push(point.clone());
            }
            for d in disks {
                m.by_disk
                    .get_mut(&format!("d{d}"))
                    .expect("disk")
                    .push(point.clone());
            }
        }
        m
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Whatever the map and the cut: a VM snapshot in the cut freezes all;
    /// an unmapped filesystem freezes all with a reason; otherwise the list
    /// holds exactly the filesystems that lie on at least one cut disk.
    #[test]
    fn the_freeze_covers_every_filesystem_of_the_cut_and_no_other(
        m in mounts_strategy(),
        cut in proptest::collection::vec((0u8..5, any::<bool>(), any::<bool>()), 1..5),
    ) {
        let requests: Vec<Request> = cut
            .iter()
            .enumerate()
            .map(|(i, (d, vm, required))| Request {
                whole_vm: *vm,
                group: None,
                ..req(&format!("s{i}"), &format!("d{d}"), *required)
            })
            .collect();
        let scope = freeze_scope(&requests, Some(&Ok(m.clone())));
        if requests.iter().any(|r| r.whole_vm) {
            prop_assert_eq!(scope, Scope::All { why: None });
        } else if !m.unmapped.is_empty() {
            prop_assert!(matches!(scope, Scope::All { why: Some(_) }), "an unmapped filesystem must freeze all: {:?}", scope);
        } else {
            let expected: BTreeSet<String> = requests
                .iter()
                .flat_map(|r| m.by_disk[&r.disk].iter().cloned())
                .collect();
            prop_assert_eq!(scope, Scope::List(expected.into_iter().collect()));
        }
    }
}

// ------------------------------------------------------------ simulation

#[derive(Clone, Copy, Debug)]
enum Fault {
    Ok,
    Error,
    /// No reply within the timeout; the effect still happens, late.
    TimeoutLate,
    /// No reply and no effect.
    TimeoutLost,
    Disconnected,
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        6 => Just(Fault::Ok),
        1 => Just(Fault::Error),
        1 => Just(Fault::TimeoutLate),
        1 => Just(Fault::TimeoutLost),
        1 => Just(Fault::Disconnected),
    ]
}

#[derive(Clone, Debug)]
enum Action {
    /// A new snapshot request (disk index, required).
    Request(u8, bool),
    /// A VM snapshot: one request per disk, in one message.
    RequestAll(bool),
    /// Perform the next queued command with this behaviour and duration (fraction of its timeout, in 1/8).
    Perform(Fault, u8),
    /// Someone else thaws the guest.
    Interloper,
    /// hearthd is killed and restarted.
    Crash,
    /// QEMU exits (the guest powers off, or crashes) and stays stopped.
    QemuExit,
    /// The transaction QEMU still holds (its reply timed out) ends now:
    /// `true` it runs (if every overlay node it names still exists),
    /// `false` QEMU refuses it.
    LateTransaction(bool),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        2 => (0u8..3, any::<bool>()).prop_map(|(d, r)| Action::Request(d, r)),
        1 => any::<bool>().prop_map(Action::RequestAll),
        10 => (fault(), 0u8..10).prop_map(|(f, d)| Action::Perform(f, d)),
        1 => Just(Action::Interloper),
        1 => Just(Action::Crash),
        1 => Just(Action::QemuExit),
        2 => any::<bool>().prop_map(Action::LateTransaction),
    ]
}

/// One overlay in the shell's journal (`overlays.rs`).
#[derive(Clone, Debug)]
struct Row {
    cut: CutId,
    disk: String,
    layer: u64,
    /// A live cut's overlay (it has a QEMU node).
    live: bool,
}

/// The store's layer chains, QEMU's block graph and the journal between
/// them, as the shell keeps them; the settling rule is the shell's own
/// (`overlays::decide`).
#[derive(Default)]
struct Layers {
    next: u64,
    backing: BTreeMap<u64, Option<u64>>,
    /// The store's head of each disk.
    head: BTreeMap<String, u64>,
    /// The layer QEMU writes each disk to (while it runs).
    top: BTreeMap<String, u64>,
    /// The layer the guest wrote last: QEMU's top, or its last top once it
    /// exited.
    last_written: BTreeMap<String, u64>,
    rows: Vec<Row>,
    /// The actor's memory of each cut's overlays (lost in a crash).
    held: BTreeMap<CutId, Vec<(String, u64)>>,
    /// Whether each cut was live (a QEMU ran when it started).
    cut_live: BTreeMap<CutId, bool>,
}

impl Layers {
    fn new() -> Layers {
        let mut l = Layers::default();
        for d in 0..3 {
            let disk = format!("d{d}");
            l.next += 1;
            l.backing.insert(l.next, None);
            l.head.insert(disk.clone(), l.next);
            l.top.insert(disk.clone(), l.next);
            l.last_written.insert(disk, l.next);
        }
        l
    }

    fn chain(&self, mut layer: u64) -> Vec<u64> {
        let mut out = vec![layer];
        while let Some(Some(b)) = self.backing.get(&layer) {
            out.push(*b);
            layer = *b;
        }
        out
    }

    /// I7: the guest's last writes are in the disk's chain, or the journal
    /// still holds the overlay that has them.
    fn check_no_lost_write(&self) {
        for (disk, written) in &self.last_written {
            let in_chain = self.chain(self.head[disk]).contains(written);
            let journalled = self
                .rows
                .iter()
                .any(|r| r.disk == *disk && r.layer == *written);
            assert!(
                in_chain || journalled,
                "I7: {disk}'s last writes (layer {written}) are lost: head {} chain {:?}, journal {:?}",
                self.head[disk],
                self.chain(self.head[disk]),
                self.rows
            );
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Phase {
    Pending,
    Ready { consistent: bool, cut: CutId },
    Failed,
}

struct Sim {
    c: Coordinator,
    now: Millis,
    vm_running: bool,
    agent_present: bool,
    queue: VecDeque<Command>,
    // guest
    frozen: bool,
    /// The filesystems the guest has frozen (while `frozen`).
    frozen_fs: BTreeSet<String>,
    late_freeze: bool,
    /// What a late freeze freezes: `None` every filesystem.
    late_list: Option<Vec<String>>,
    /// How the guest's filesystems lie on the disks, and what the agent
    /// reports of them (see [`Sim::mounts`]).
    layout: u8,
    /// Our freeze made the guest frozen at this time and nothing thawed it since.
    frozen_by_us_since: Option<Millis>,
    freeze_sent_at: Option<Millis>,
    fault_since_freeze: bool,
    /// A freeze was sent and no thaw was confirmed since.
    unthawed_freeze: bool,
    /// Someone else thawed the guest since our last freeze.
    interloped: bool,
    /// Cuts whose transaction QEMU really ran (whatever the reply said).
    applied: std::collections::BTreeSet<CutId>,
    /// A transaction QEMU has not run yet although its reply timed out
    /// (QEMU's monitor was busy): its cut and the overlays it switches to.
    /// It runs late (at any later step, after the thaw, after an
    /// observation that did not wait for it), or never.
    late_tx: Option<(CutId, Vec<(String, u64)>)>,
    /// Cuts a freeze was sent for.
    frozen_cuts: BTreeSet<CutId>,
    /// Cuts whose freeze a thaw was sent for (whatever it did).
    thawed_cuts: BTreeSet<CutId>,
    /// Cuts whose switch the coordinator was told of (a transaction's
    /// reply, or an observation of QEMU's block graph) while our freeze
    /// held and before any thaw of it was sent.
    switch_seen_frozen: BTreeSet<CutId>,
    /// Every cut id the coordinator was given and used.
    used_cuts: std::collections::BTreeSet<CutId>,
    qemu_alive: bool,
    layers: Layers,
    // store
    intent: Option<(CutId, Vec<Request>)>,
    snaps: BTreeMap<String, (Request, Phase)>,
    /// Ground truth per cut: the transaction ran while our freeze held.
    truth: BTreeMap<CutId, bool>,
    next_id: u32,
    next_cut: CutId,
    /// Starts are the test's to make (the shell's gathering, by hand).
    hold: bool,
    /// Requests made together (a VM snapshot's).
    groups: Vec<Vec<String>>,
}

impl Sim {
    fn new(vm_running: bool, agent_present: bool) -> Self {
        Sim {
            c: Coordinator::new(DEADLINE),
            now: 0,
            vm_running,
            agent_present,
            queue: VecDeque::new(),
            frozen: false,
            frozen_fs: BTreeSet::new(),
            late_freeze: false,
            late_list: None,
            layout: 2,
            frozen_by_us_since: None,
            freeze_sent_at: None,
            fault_since_freeze: false,
            unthawed_freeze: false,
            interloped: false,
            applied: Default::default(),
            late_tx: None,
            frozen_cuts: BTreeSet::new(),
            thawed_cuts: BTreeSet::new(),
            switch_seen_frozen: BTreeSet::new(),
            used_cuts: Default::default(),
            qemu_alive: vm_running,
            layers: Layers::new(),
            intent: None,
            snaps: BTreeMap::new(),
            truth: BTreeMap::new(),
            next_id: 0,
            next_cut: 0,
            hold: false,
            groups: Vec::new(),
        }
    }

    fn access(&self) -> Access {
        match (self.vm_running, self.agent_present) {
            (false, _) => Access::Offline,
            (true, true) => Access::Agent,
            (true, false) => Access::NoAgent("no agent".into()),
        }
    }

    fn emit(&mut self, cmds: Vec<Command>) {
        for cmd in cmds {
            // I2: never a second freeze while one is outstanding, never a
            // thaw while a transaction is queued or running.
            if let Command::Freeze { .. } = cmd {
                assert!(
                    !self.unthawed_freeze,
                    "I2: a second freeze while one is outstanding"
                );
                assert!(
                    !self
                        .queue
                        .iter()
                        .any(|c| matches!(c, Command::Freeze { .. }))
                );
            }
            if let Command::Thaw { .. } = cmd {
                assert!(
                    !self
                        .queue
                        .iter()
                        .any(|c| matches!(c, Command::Transact { .. })),
                    "I2: a thaw while a cut is in progress"
                );
            }
            self.queue.push_back(cmd);
        }
    }

    fn kick(&mut self) {
        if !self.hold {
            self.start_now();
        }
    }

    /// The shell's start of a cut, when the coordinator is idle.
    fn start_now(&mut self) {
        if self.c.is_idle() && self.queue.is_empty() {
            let a = self.access();
            // The shell's durable counter: survives crashes.
            self.next_cut += 1;
            let cut = self.next_cut;
            let due = self.c.is_due(&a);
            let out = self.c.handle(Input::Start {
                access: a,
                cut,
                now: self.now,
            });
            assert_eq!(
                due,
                !out.is_empty(),
                "is_due says whether Start starts a cut"
            );
            self.layers.cut_live.insert(cut, self.qemu_alive);
            if !out.is_empty() {
                assert!(self.used_cuts.insert(cut), "a cut id was used twice: {cut}");
            }
            self.emit(out);
        }
    }

    fn apply_late_freeze(&mut self) {
        if self.late_freeze {
            self.late_freeze = false;
            if !self.frozen {
                let list = self.late_list.take();
                self.freeze_fs(list.as_deref());
                self.frozen_by_us_since = Some(self.now);
            }
        }
    }

    /// The guest's real filesystems: (mount point, the disks it lies on).
    /// `/s` spans two disks; `/x` lies on a device the VM does not have.
    fn real_fs(&self) -> Vec<(&'static str, Vec<&'static str>)> {
        match self.layout {
            // d0 and d2 carry no filesystem.
            4 => vec![("/b", vec!["d1"])],
            3 => vec![
                ("/a", vec!["d0"]),
                ("/b", vec!["d1"]),
                ("/s", vec!["d1", "d2"]),
                ("/x", vec![]),
            ],
            _ => vec![
                ("/a", vec!["d0"]),
                ("/b", vec!["d1"]),
                ("/s", vec!["d1", "d2"]),
            ],
        }
    }

    /// What the agent reports before a live cut's freeze: 0 nothing (it
    /// was not asked), 1 an error, else the real layout.
    fn mounts(&self) -> Option<Result<Mounts, MountsUnknown>> {
        match self.layout {
            0 => return None,
            1 => return Some(Err("guest-get-fsinfo: timeout".into())),
            _ => {}
        }
        let mut m = Mounts::default();
        for d in ["d0", "d1", "d2"] {
            m.by_disk.insert(d.into(), Vec::new());
        }
        for (point, disks) in self.real_fs() {
            if disks.is_empty() {
                m.unmapped.push(point.into());
            }
            for d in disks {
                m.by_disk.entry(d.into()).or_default().push(point.into());
            }
        }
        Some(Ok(m))
    }

    /// The guest freezes `list` (only the mount points it has), or all.
    fn freeze_fs(&mut self, list: Option<&[String]>) {
        self.frozen = true;
        self.frozen_fs = self
            .real_fs()
            .into_iter()
            .map(|(p, _)| p.to_string())
            .filter(|p| list.is_none_or(|l| l.contains(p)))
            .collect();
    }

    /// Every filesystem on the cut's disks is frozen right now (or there
    /// is none on them).
    fn cut_disks_frozen(&self, cut: CutId) -> bool {
        let disks: Vec<String> = self
            .layers
            .held
            .get(&cut)
            .map(|h| h.iter().map(|(d, _)| d.clone()).collect())
            .unwrap_or_default();
        self.disks_frozen(&disks)
    }

    /// Every filesystem on `disks` is frozen right now (or there is none
    /// on them).
    fn disks_frozen(&self, disks: &[String]) -> bool {
        self.real_fs()
            .into_iter()
            .filter(|(_, on)| on.iter().any(|d| disks.iter().any(|c| c == d)))
            .all(|(p, _)| self.frozen && self.frozen_fs.contains(p))
    }

    fn advance(&mut self, by: Millis) {
        self.now += by;
        self.check_i3();
    }

    /// I3, as the guest sees it: a freeze we sent never holds past the
    /// deadline plus one thaw, unless a thaw failed or the daemon crashed in
    /// between.
    fn check_i3(&self) {
        if let (true, Some(sent)) = (self.frozen, self.freeze_sent_at)
            && !self.fault_since_freeze
        {
            assert!(
                self.now.saturating_sub(sent) <= DEADLINE + THAW_TIMEOUT_MS,
                "I3: frozen for {} ms",
                self.now - sent
            );
        }
    }

    /// Settles the journal rows `which` picks, by the shell's rule, against
    /// what QEMU shows (`readable`: its block graph can be read).
    fn settle_rows(&mut self, which: impl Fn(&Row) -> bool, readable: bool) {
        let rows = std::mem::take(&mut self.layers.rows);
        for r in rows {
            if !which(&r) {
                self.layers.rows.push(r);
                continue;
            }
            let seen = if !self.qemu_alive {
                overlays::Seen::QemuGone
            } else if !readable {
                overlays::Seen::Unknown("query-block failed".into())
            } else if self.layers.top[&r.disk] == r.layer {
                overlays::Seen::InUse
            } else {
                overlays::Seen::NotInUse
            };
            match overlays::decide(r.live, true, seen) {
                overlays::Decision::Adopt => {
                    self.layers.head.insert(r.disk.clone(), r.layer);
                }
                overlays::Decision::Remove | overlays::Decision::DeleteNodeThenRemove => {
                    // I8: a file QEMU writes to is never removed.
                    assert!(
                        !(self.qemu_alive && self.layers.top[&r.disk] == r.layer),
                        "I8: removed the overlay QEMU writes {} to",
                        r.disk
                    );
                }
                overlays::Decision::Keep(_) => self.layers.rows.push(r),
            }
        }
    }

    /// QEMU runs (`run`) or refuses the transaction it still holds. It
    /// runs only if every overlay node it names still exists (the journal
    /// still has their rows: a settled, removed overlay's node is gone).
    fn late_transaction(&mut self, run: bool) {
        let Some((cut, overlays)) = self.late_tx.take() else {
            return;
        };
        let nodes_exist = overlays.iter().all(|(disk, layer)| {
            self.layers
                .rows
                .iter()
                .any(|r| r.disk == *disk && r.layer == *layer && r.live)
        });
        if !run || !self.qemu_alive || !nodes_exist {
            return;
        }
        let disks: Vec<String> = overlays.iter().map(|(d, _)| d.clone()).collect();
        let truth = self.disks_frozen(&disks);
        self.truth.insert(cut, truth);
        self.applied.insert(cut);
        for (disk, layer) in overlays {
            self.layers.top.insert(disk.clone(), layer);
            self.layers.last_written.insert(disk, layer);
        }
    }

    /// The coordinator is told that `cut` switched: noted if our freeze
    /// holds and no thaw of it was sent yet (I10).
    fn switch_told(&mut self, cut: CutId) {
        if self.frozen_by_us_since.is_some()
            && self.frozen_cuts.contains(&cut)
            && !self.thawed_cuts.contains(&cut)
        {
            self.switch_seen_frozen.insert(cut);
        }
    }

    fn qemu_exit(&mut self) {
        if !self.qemu_alive {
            return;
        }
        self.late_tx = None;
        self.qemu_alive = false;
        self.vm_running = false;
        // The guest is gone, frozen or not.
        self.frozen = false;
        self.late_freeze = false;
        self.frozen_by_us_since = None;
        self.freeze_sent_at = None;
        self.unthawed_freeze = false;
    }

    /// The checks after every step, then the shell's next start.
    fn after_step(&mut self) {
        self.check_i1();
        self.layers.check_no_lost_write();
        self.kick();
    }

    fn perform(&mut self, fault: Fault, eighths: u8) {
        let Some(cmd) = self.queue.pop_front() else {
            self.kick();
            return;
        };
        let dur = |t: Millis| (t * Millis::from(eighths) / 8).min(t);
        let agent_fault = |f: Fault| match f {
            Fault::Error => AgentFault::Error("boom".into()),
            Fault::Disconnected => AgentFault::Disconnected,
            _ => AgentFault::Timeout,
        };
        let input = match cmd {
            Command::Prepare { cut, disks } => {
                let live = self.layers.cut_live[&cut];
                // What earlier cuts left is settled first.
                self.settle_rows(|r| r.cut != cut, !matches!(fault, Fault::Error));
                let mut failed: Vec<(String, String)> = match fault {
                    // Every disk fails, or only the first one.
                    Fault::Error => disks
                        .iter()
                        .map(|d| (d.clone(), "disk full".into()))
                        .collect(),
                    Fault::Disconnected => vec![(disks[0].clone(), "detached".into())],
                    _ if live && !self.qemu_alive => disks
                        .iter()
                        .map(|d| (d.clone(), "QMP: connection closed".into()))
                        .collect(),
                    _ => Vec::new(),
                };
                for d in &disks {
                    if self.layers.rows.iter().any(|r| r.disk == *d)
                        && !failed.iter().any(|(f, _)| f == d)
                    {
                        failed.push((d.clone(), "an earlier overlay is not settled".into()));
                    }
                }
                for d in &disks {
                    if failed.iter().any(|(f, _)| f == d) {
                        continue;
                    }
                    // Recorded before the file and the node exist.
                    self.layers.next += 1;
                    let layer = self.layers.next;
                    self.layers.backing.insert(layer, Some(self.layers.head[d]));
                    self.layers.rows.push(Row {
                        cut,
                        disk: d.clone(),
                        layer,
                        live,
                    });
                    self.layers
                        .held
                        .entry(cut)
                        .or_default()
                        .push((d.clone(), layer));
                }
                Some(Input::Prepared {
                    cut,
                    failed,
                    mounts: if live && self.agent_present {
                        self.mounts()
                    } else {
                        None
                    },
                    now: self.now,
                })
            }
            Command::RecordIntent { cut, .. } => {
                let result = if matches!(fault, Fault::Error) {
                    Err("disk I/O error".into())
                } else {
                    let reqs = self.c.cut_requests().to_vec();
                    self.intent = Some((cut, reqs));
                    Ok(())
                };
                Some(Input::IntentRecorded {
                    cut,
                    result,
                    now: self.now,
                })
            }
            Command::Freeze {
                cut,
                timeout,
                mountpoints,
            } => {
                // I9: a cut with a VM snapshot freezes everything; a list
                // freeze is never empty and freezes only filesystems on
                // the cut's disks (a spanning one when any of its disks is).
                let reqs = self.c.cut_requests().to_vec();
                if reqs.iter().any(|r| r.whole_vm) {
                    assert_eq!(mountpoints, None, "I9: a VM snapshot's cut freezes all");
                }
                if let Some(list) = &mountpoints {
                    assert!(!list.is_empty(), "I9: an empty freeze list");
                    for p in list {
                        let on = self
                            .real_fs()
                            .into_iter()
                            .find(|(q, _)| q == p)
                            .map(|(_, on)| on)
                            .unwrap_or_default();
                        assert!(
                            on.iter().any(|d| reqs.iter().any(|r| r.disk == *d)),
                            "I9: {p} frozen, but it lies on no disk of the cut {reqs:?}"
                        );
                    }
                }
                // I5: the guest is frozen only with a durable intent for the cut.
                assert_eq!(
                    self.intent.as_ref().map(|(c, _)| *c),
                    Some(cut),
                    "I5: a freeze without a stored intent"
                );
                self.interloped = false;
                self.frozen_cuts.insert(cut);
                if !self.qemu_alive {
                    self.advance(dur(timeout));
                    let out = self.c.handle(Input::FreezeReplied {
                        cut,
                        result: Err(AgentFault::Disconnected),
                        now: self.now,
                    });
                    self.emit(out);
                    self.after_step();
                    return;
                }
                self.apply_late_freeze();
                self.freeze_sent_at = Some(self.now);
                self.fault_since_freeze = false;
                self.unthawed_freeze = true;
                let d = dur(timeout);
                let ok = matches!(fault, Fault::Ok) && d < timeout;
                let result = if ok {
                    self.advance(d);
                    if self.frozen {
                        Err(AgentFault::DisabledWhileFrozen)
                    } else {
                        self.freeze_fs(mountpoints.as_deref());
                        self.frozen_by_us_since = Some(self.now);
                        Ok(self.frozen_fs.len() as u32)
                    }
                } else {
                    match fault {
                        Fault::Ok | Fault::TimeoutLate => {
                            self.late_freeze = true;
                            self.late_list = mountpoints.clone();
                            self.advance(timeout);
                            Err(AgentFault::Timeout)
                        }
                        Fault::TimeoutLost => {
                            self.advance(timeout);
                            Err(AgentFault::Timeout)
                        }
                        f => {
                            self.advance(d);
                            Err(agent_fault(f))
                        }
                    }
                };
                Some(Input::FreezeReplied {
                    cut,
                    result,
                    now: self.now,
                })
            }
            Command::QueryFreeze { cut, timeout } => {
                self.apply_late_freeze();
                let d = dur(timeout);
                let result = match fault {
                    _ if !self.qemu_alive => {
                        self.advance(d);
                        Err(AgentFault::Disconnected)
                    }
                    Fault::Ok if d < timeout => {
                        self.advance(d);
                        Ok(self.frozen)
                    }
                    Fault::Ok | Fault::TimeoutLate | Fault::TimeoutLost => {
                        self.advance(timeout);
                        Err(AgentFault::Timeout)
                    }
                    f => {
                        self.advance(d);
                        Err(agent_fault(f))
                    }
                };
                Some(Input::StatusReplied {
                    cut,
                    result,
                    now: self.now,
                })
            }
            Command::Transact { cut, timeout } => {
                // QMP runs commands in order: one QEMU still holds ends
                // first.
                self.late_transaction(true);
                let d = dur(timeout).min(timeout);
                let live = self.layers.cut_live[&cut];
                // Consistent data needs the filesystems frozen when the
                // transaction runs (by us, or by someone else who froze
                // the guest again after thawing it under us).
                let truth = !live || self.cut_disks_frozen(cut);
                let result = match fault {
                    // QEMU is gone: QMP answers nothing.
                    _ if live && !self.qemu_alive => {
                        self.advance(d);
                        TxResult::Unknown("QMP connection closed".into())
                    }
                    Fault::Error => {
                        self.advance(d);
                        TxResult::Rejected("transaction failed".into())
                    }
                    // QEMU ran it; the reply was lost.
                    Fault::TimeoutLate if live => {
                        self.advance(timeout);
                        self.truth.insert(cut, truth);
                        self.applied.insert(cut);
                        TxResult::Unknown("timeout".into())
                    }
                    // QEMU's monitor is busy: the transaction waits in it
                    // and runs late, or never.
                    Fault::TimeoutLost if live => {
                        self.advance(timeout);
                        let overlays = self.layers.held.get(&cut).cloned().unwrap_or_default();
                        self.late_tx = Some((cut, overlays));
                        TxResult::Unknown("timeout".into())
                    }
                    // QEMU never got it.
                    Fault::Disconnected if live => {
                        self.advance(timeout);
                        TxResult::Unknown("timeout".into())
                    }
                    _ => {
                        self.advance(d);
                        self.truth.insert(cut, truth);
                        self.applied.insert(cut);
                        TxResult::Applied
                    }
                };
                if live && self.applied.contains(&cut) {
                    // Every disk of the cut switches at once.
                    for (disk, layer) in self.layers.held.get(&cut).cloned().unwrap_or_default() {
                        self.layers.top.insert(disk.clone(), layer);
                        self.layers.last_written.insert(disk, layer);
                    }
                }
                if result == TxResult::Applied {
                    self.switch_told(cut);
                }
                Some(Input::Transacted {
                    cut,
                    result,
                    now: self.now,
                })
            }
            Command::Observe { cut, timeout, .. } => {
                let d = dur(timeout);
                let applied = match fault {
                    _ if !self.qemu_alive => {
                        self.advance(d);
                        None
                    }
                    // QMP answers in order: a transaction QEMU still holds
                    // ends before `query-block` is answered.
                    Fault::Ok if d < timeout => {
                        self.late_transaction(true);
                        self.advance(d);
                        Some(self.applied.contains(&cut))
                    }
                    // No answer in time; the transaction runs as the wait
                    // ends.
                    Fault::TimeoutLate => {
                        self.advance(timeout);
                        self.late_transaction(true);
                        None
                    }
                    Fault::Ok | Fault::TimeoutLost => {
                        self.advance(timeout);
                        None
                    }
                    Fault::Error => {
                        self.advance(d);
                        None
                    }
                    // An answer that did not wait for the transaction (as
                    // if read on another monitor): it may still run after.
                    Fault::Disconnected => {
                        self.advance(d);
                        Some(self.applied.contains(&cut))
                    }
                };
                if applied == Some(true) {
                    self.switch_told(cut);
                }
                Some(Input::Observed {
                    cut,
                    applied,
                    now: self.now,
                })
            }
            Command::Thaw {
                cut,
                timeout,
                only_if_frozen,
            } => {
                if self.frozen_cuts.contains(&cut) {
                    self.thawed_cuts.insert(cut);
                }
                // I3 (the promise in docs/snapshots.md): the thaw of a
                // freeze we sent goes out by the deadline, so the guest is
                // frozen at most the deadline plus the thaw's own duration.
                if let Some(sent) = self.freeze_sent_at
                    && !self.fault_since_freeze
                {
                    assert!(
                        self.now - sent <= DEADLINE,
                        "I3: thaw sent {} ms after the freeze",
                        self.now - sent
                    );
                }
                if !self.qemu_alive {
                    // No process: nothing frozen.
                    let out = self.c.handle(Input::ThawReplied {
                        cut,
                        result: Ok(0),
                        now: self.now,
                    });
                    self.emit(out);
                    self.after_step();
                    return;
                }
                self.apply_late_freeze();
                let d = dur(timeout);
                let skip = only_if_frozen && !self.frozen;
                if matches!(fault, Fault::Ok) && d < timeout && !skip {
                    // I6: the guest's thaw hook runs only after a freeze,
                    // unless someone else thawed the guest behind our back.
                    assert!(
                        self.frozen || self.interloped,
                        "I6: a thaw of a guest that is not frozen"
                    );
                }
                let result = match fault {
                    Fault::Ok if d < timeout && skip => {
                        self.advance(d);
                        self.unthawed_freeze = false;
                        self.freeze_sent_at = None;
                        Ok(0)
                    }
                    Fault::Ok if d < timeout => {
                        self.advance(d);
                        let n = if self.frozen {
                            self.frozen_fs.len() as u32
                        } else {
                            0
                        };
                        self.frozen = false;
                        self.frozen_by_us_since = None;
                        self.freeze_sent_at = None;
                        self.unthawed_freeze = false;
                        Ok(n)
                    }
                    Fault::TimeoutLate => {
                        // The thaw happens, the reply is lost.
                        self.advance(timeout);
                        self.frozen = false;
                        self.frozen_by_us_since = None;
                        self.fault_since_freeze = true;
                        Err(AgentFault::Timeout)
                    }
                    Fault::Ok | Fault::TimeoutLost => {
                        self.advance(timeout);
                        self.fault_since_freeze = true;
                        Err(AgentFault::Timeout)
                    }
                    f => {
                        self.advance(d);
                        self.fault_since_freeze = true;
                        Err(agent_fault(f))
                    }
                };
                Some(Input::ThawReplied {
                    cut,
                    result,
                    now: self.now,
                })
            }
            Command::GroupReport { .. } => {
                unreachable!("this model makes no group requests (see group/tests.rs)")
            }
            Command::Discard { cut } => {
                self.layers.held.remove(&cut);
                self.settle_rows(|r| r.cut == cut, !matches!(fault, Fault::Error));
                None
            }
            Command::Commit {
                cut,
                outcomes,
                keep_intent,
                took_cut,
                ..
            } => {
                if matches!(fault, Fault::Error) {
                    // The store refused the write: nothing changed.
                    let out = self.c.handle(Input::Committed { cut, ok: false });
                    self.emit(out);
                    self.after_step();
                    return;
                }
                if took_cut {
                    // The overlays are the heads, in the same store write.
                    for (disk, layer) in self.layers.held.remove(&cut).unwrap_or_default() {
                        self.layers.head.insert(disk.clone(), layer);
                        self.layers
                            .rows
                            .retain(|r| !(r.cut == cut && r.disk == disk));
                    }
                }
                for (name, o) in outcomes {
                    let Some(entry) = self.snaps.get_mut(&name) else {
                        continue;
                    };
                    entry.1 = match o {
                        Outcome::Ready { consistent } => Phase::Ready { consistent, cut },
                        Outcome::Failed(_) => Phase::Failed,
                        Outcome::Retry => Phase::Pending,
                    };
                }
                if !keep_intent {
                    self.intent = None;
                }
                Some(Input::Committed { cut, ok: true })
            }
        };
        if let Some(input) = input {
            let out = self.c.handle(input);
            self.emit(out);
        }
        self.after_step();
    }

    /// I1: consistent only when the cut really happened under our freeze
    /// (or with the VM stopped).
    fn check_i1(&self) {
        for (name, (_, phase)) in &self.snaps {
            if let Phase::Ready {
                consistent: true,
                cut,
            } = phase
            {
                assert_eq!(
                    self.truth.get(cut),
                    Some(&true),
                    "I1: {name} marked consistent but its cut {cut} was not taken frozen"
                );
                // I10: a frozen cut is consistent only if its switch was
                // known (answered, or observed in QEMU's block graph) while
                // our freeze held, before its thaw.
                assert!(
                    !self.frozen_cuts.contains(cut) || self.switch_seen_frozen.contains(cut),
                    "I10: {name} marked consistent but cut {cut}'s switch was not seen before its thaw"
                );
            }
        }
    }

    /// A VM snapshot's disk snapshots, handed over together (the shell
    /// feeds one message's requests before anything else happens).
    fn request_all(&mut self, required: bool) {
        let mut group = Vec::new();
        for disk in 0..3 {
            self.next_id += 1;
            let r = Request {
                whole_vm: true,
                group: None,
                ..req(&format!("s{}", self.next_id), &format!("d{disk}"), required)
            };
            self.snaps
                .insert(r.snapshot.clone(), (r.clone(), Phase::Pending));
            group.push(r.snapshot.clone());
            self.c.handle(Input::Requested(r));
        }
        self.groups.push(group);
        self.kick();
    }

    fn request(&mut self, disk: u8, required: bool) {
        self.next_id += 1;
        let r = req(&format!("s{}", self.next_id), &format!("d{disk}"), required);
        self.snaps
            .insert(r.snapshot.clone(), (r.clone(), Phase::Pending));
        self.c.handle(Input::Requested(r));
        self.kick();
    }

    fn crash(&mut self) {
        // Everything in memory is lost; the store and the guest remain.
        self.queue.clear();
        self.layers.held.clear();
        self.fault_since_freeze = true;
        // The restarted actor settles the journal against QEMU first.
        self.settle_rows(|_| true, true);
        let pending: Vec<Request> = self
            .snaps
            .values()
            .filter(|(_, p)| *p == Phase::Pending)
            .map(|(r, _)| r.clone())
            .collect();
        let intent = self.intent.clone().map(|(cut, reqs)| {
            let open: Vec<Request> = reqs
                .into_iter()
                .filter(|r| {
                    self.snaps
                        .get(&r.snapshot)
                        .is_some_and(|(_, p)| *p == Phase::Pending)
                })
                .collect();
            (cut, open)
        });
        let durable = Durable { pending, intent };
        let (c, out) = Coordinator::recover(DEADLINE, durable);
        self.c = c;
        // A restart is not instant.
        self.advance(500);
        self.emit(out);
        self.kick();
    }

    /// Someone else thaws a frozen guest, or freezes a thawed one while no
    /// freeze of ours is outstanding. (A thaw *and* a re-freeze by a program
    /// inside the guest, both between our status read and our thaw, cannot
    /// be told apart from our own freeze through the agent's interface:
    /// docs/snapshots.md names that limit.)
    fn interloper(&mut self) {
        if self.frozen {
            self.frozen = false;
            self.frozen_by_us_since = None;
            self.interloped = true;
        } else if !self.unthawed_freeze {
            self.freeze_fs(None);
        }
    }

    /// Quiescence: a perfect agent, no crashes, until nothing is left to do.
    fn settle(&mut self) {
        for _ in 0..1000 {
            if self.c.is_idle()
                && self.queue.is_empty()
                && !self.c.has_pending()
                && !self.c.needs_thaw()
            {
                break;
            }
            self.perform(Fault::Ok, 1);
        }
        // I4: every request ended Ready or Failed; the guest is not frozen.
        for (name, (_, phase)) in &self.snaps {
            assert_ne!(*phase, Phase::Pending, "I4: {name} still pending");
        }
        if self.vm_running && self.agent_present {
            assert!(
                !self.frozen || !self.unthawed_freeze,
                "the guest stayed frozen"
            );
            assert!(!self.late_freeze || !self.frozen);
        }
        assert!(self.intent.is_none(), "an intent outlived its cut");
        // Requests made together are cut together: their Ready snapshots
        // all name one cut.
        for g in &self.groups {
            let cuts: BTreeSet<CutId> = g
                .iter()
                .filter_map(|n| match self.snaps.get(n) {
                    Some((_, Phase::Ready { cut, .. })) => Some(*cut),
                    _ => None,
                })
                .collect();
            assert!(cuts.len() <= 1, "a VM snapshot split between cuts {cuts:?}");
        }
        // The store and QEMU agree on every disk nothing is pending for.
        self.layers.check_no_lost_write();
        if self.qemu_alive {
            for (disk, top) in &self.layers.top {
                if !self.layers.rows.iter().any(|r| r.disk == *disk) {
                    assert_eq!(
                        self.layers.head[disk], *top,
                        "{disk}: the store's head is not what QEMU writes"
                    );
                }
            }
        }
    }
}

fn run(vm_running: bool, agent_present: bool, layout: u8, actions: Vec<Action>) {
    let mut sim = Sim::new(vm_running, agent_present);
    sim.layout = layout;
    for a in actions {
        match a {
            Action::Request(d, r) => sim.request(d, r),
            Action::RequestAll(r) => sim.request_all(r),
            Action::Perform(f, d) => sim.perform(f, d),
            Action::Interloper => sim.interloper(),
            Action::Crash => sim.crash(),
            Action::QemuExit => sim.qemu_exit(),
            Action::LateTransaction(run) => {
                sim.late_transaction(run);
                sim.after_step();
            }
        }
    }
    sim.settle();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_over_random_interleavings_with_an_agent(
        layout in 0u8..5,
        actions in proptest::collection::vec(action(), 0..80),
    ) {
        run(true, true, layout, actions);
    }

    #[test]
    fn invariants_hold_without_an_agent_and_when_stopped(
        running in any::<bool>(),
        actions in proptest::collection::vec(action(), 0..60),
    ) {
        run(running, false, 2, actions);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// A burst: the first request starts a cut at once, the others arrive
    /// at random points of it (`slots`: after how many of its commands).
    /// Those that come while it is prepared join it if their disk is in it;
    /// the rest are gathered (the shell waits while `gather_first`, and
    /// the burst's stragglers come meanwhile) and share the second cut. So
    /// at most two cuts and two freezes, and every snapshot consistent.
    #[test]
    fn a_burst_takes_at_most_two_cuts_whenever_its_requests_arrive(
        first_disk in 0u8..3,
        late in proptest::collection::vec((0u8..3, 0usize..12), 0..12),
    ) {
        let mut sim = Sim::new(true, true);
        sim.request(first_disk, true);
        sim.hold = true;
        let mut freezes = 0;
        let mut step = 0;
        let mut late = late;
        late.sort_by_key(|(_, slot)| *slot);
        let mut late = std::collections::VecDeque::from(late);
        loop {
            while late.front().is_some_and(|(_, slot)| *slot <= step) {
                let (disk, _) = late.pop_front().expect("a late request");
                // Arrive without kicking: the shell's gathering holds the
                // next start while a burst is under way.
                sim.next_id += 1;
                let r = req(&format!("s{}", sim.next_id), &format!("d{disk}"), true);
                sim.snaps.insert(r.snapshot.clone(), (r.clone(), Phase::Pending));
                sim.c.handle(Input::Requested(r));
            }
            if sim.queue.is_empty() {
                if late.is_empty() && !sim.c.has_pending() {
                    break;
                }
                if sim.c.gather_first(sim.now) && !late.is_empty() {
                    // Gathering: the stragglers come before the next cut.
                    step = usize::MAX;
                    continue;
                }
                sim.start_now();
                if sim.queue.is_empty() {
                    step = usize::MAX;
                    continue;
                }
            }
            if matches!(sim.queue.front(), Some(Command::Freeze { .. })) {
                freezes += 1;
            }
            sim.perform(Fault::Ok, 1);
            step = step.saturating_add(1);
        }
        let cuts: BTreeSet<CutId> = sim
            .snaps
            .values()
            .map(|(_, p)| match p {
                Phase::Ready { consistent: true, cut } => *cut,
                other => panic!("not consistent and Ready: {other:?}"),
            })
            .collect();
        prop_assert!(cuts.len() <= 2, "{} cuts", cuts.len());
        prop_assert_eq!(freezes, cuts.len());
    }
}

/// Many requests at once are served by one cut, with one freeze.
#[test]
fn a_burst_of_requests_is_one_cut() {
    let mut sim = Sim::new(true, true);
    let mut freezes = 0;
    for i in 0..10 {
        sim.snaps.insert(
            format!("x{i}"),
            (
                req(&format!("x{i}"), &format!("d{}", i % 2), true),
                Phase::Pending,
            ),
        );
        sim.c.handle(Input::Requested(req(
            &format!("x{i}"),
            &format!("d{}", i % 2),
            true,
        )));
    }
    sim.kick();
    while let Some(cmd) = sim.queue.front() {
        if matches!(cmd, Command::Freeze { .. }) {
            freezes += 1;
        }
        sim.perform(Fault::Ok, 1);
    }
    assert_eq!(freezes, 1);
    assert!(sim.snaps.values().all(|(_, p)| matches!(
        p,
        Phase::Ready {
            consistent: true,
            cut: 1
        }
    )));
}
