//! How a stop asks the guest to power off before QEMU is made to quit: a
//! pure plan (what to send when, given what the guest answered so far),
//! carried out by `stop` in `reconcile.rs`.
//!
//! A guest can be asked too early to act on it. A systemd guest hands both
//! requests to systemd-logind: qemu-ga's `guest-shutdown` runs `shutdown -h
//! -P +0`, which schedules the power-off through logind and fails while
//! logind does not run, and the ACPI power button is watched by logind
//! alone. Under TCG logind starts tens of seconds after the agent first
//! answers (docs/reconciler.md, "Stopping"). So one request is not enough:
//! the guest is asked again, round after round, until QEMU exits or the
//! grace period (`spec.stopTimeoutSeconds`) is over.
//!
//! A round asks the agent when it is connected, and presses the power button
//! when the agent was not asked or did not accept. An acceptance (qemu-ga
//! answered the resync and did not refuse: it sends nothing when its
//! shutdown command succeeded) is trusted once; a later round presses the
//! button too, since that acceptance did not lead to a power-off.

use std::time::Duration;

/// From the start of one round to the next when the last one was not accepted.
pub const ASK_AGAIN: Duration = Duration::from_secs(5);
/// What the guest gets to power off after the agent accepted before it is
/// asked again (a Debian guest under TCG takes 1–10 s from `guest-shutdown`
/// to QEMU's exit).
pub const ASK_AGAIN_AFTER_ACCEPT: Duration = Duration::from_secs(10);

/// One way of asking the guest to power off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Request {
    /// `guest-shutdown` (mode powerdown) through the guest agent.
    Agent,
    /// QMP `system_powerdown`: the ACPI power button.
    PowerButton,
}

/// What came of one request. (`NoAnswer` is one: the stop's log lines
/// print these names.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(clippy::enum_variant_names)]
pub enum Answer {
    /// The agent answered a resync and did not refuse `guest-shutdown`.
    Accepted,
    /// The agent refused: its shutdown command failed in the guest.
    Refused,
    /// The agent did not answer, or its channel was busy or gone.
    NoAnswer,
    /// QEMU took the button press.
    Pressed,
    /// QMP did not take it.
    NotPressed,
}

impl Answer {
    /// The answers `request` can get.
    #[cfg(test)]
    pub fn possible(request: Request) -> &'static [Answer] {
        match request {
            Request::Agent => &[Answer::Accepted, Answer::Refused, Answer::NoAnswer],
            Request::PowerButton => &[Answer::Pressed, Answer::NotPressed],
        }
    }
}

/// What the shell does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Send this request now, then `record` its answer.
    Send(Request),
    /// Wait for QEMU to exit until this time (counted from the stop's
    /// start), then ask again.
    WaitUntil(Duration),
    /// The grace period is over: QEMU is stopped without the guest.
    Force,
}

/// The state of one stop's asking.
#[derive(Clone, Debug)]
pub struct Plan {
    grace: Duration,
    /// When the next round starts.
    next_round: Duration,
    /// The power button is yet to be pressed in this round.
    press_now: bool,
    /// The agent accepted in an earlier round, and the guest still runs.
    accepted_before: bool,
    sent: Vec<(Request, Answer)>,
}

impl Plan {
    pub fn new(grace: Duration) -> Plan {
        Plan {
            grace,
            next_round: Duration::ZERO,
            press_now: false,
            accepted_before: false,
            sent: Vec::new(),
        }
    }

    /// What to do at `now` (time since the stop started), with the agent
    /// connected or not.
    pub fn next(&mut self, now: Duration, agent_connected: bool) -> Next {
        if now >= self.grace {
            return Next::Force;
        }
        if self.press_now {
            self.press_now = false;
            return Next::Send(Request::PowerButton);
        }
        if now >= self.next_round {
            // Counted from the request, so a slow answer never makes the
            // next round come sooner than this; `record` may put it later.
            self.next_round = now + ASK_AGAIN;
            return Next::Send(if agent_connected {
                Request::Agent
            } else {
                Request::PowerButton
            });
        }
        Next::WaitUntil(self.next_round.min(self.grace))
    }

    /// The answer to the request `next` said to send, at `now`.
    pub fn record(&mut self, now: Duration, request: Request, answer: Answer) {
        self.sent.push((request, answer));
        if request != Request::Agent {
            return;
        }
        match answer {
            Answer::Accepted => {
                self.press_now = self.accepted_before;
                self.accepted_before = true;
                self.next_round = self.next_round.max(now + ASK_AGAIN_AFTER_ACCEPT);
            }
            _ => self.press_now = true,
        }
    }

    /// How many requests got each answer, for the forced stop's event.
    pub fn summary(&self) -> String {
        let count = |r: Request, a: Answer| self.sent.iter().filter(|s| **s == (r, a)).count();
        let mut parts = Vec::new();
        let agent: Vec<String> = [
            (Answer::Accepted, "accepted"),
            (Answer::Refused, "refused"),
            (Answer::NoAnswer, "unanswered"),
        ]
        .into_iter()
        .filter_map(|(a, word)| match count(Request::Agent, a) {
            0 => None,
            n => Some(format!("{n} {word}")),
        })
        .collect();
        if !agent.is_empty() {
            parts.push(format!("guest-shutdown {}", agent.join(", ")));
        }
        let pressed = count(Request::PowerButton, Answer::Pressed);
        let not = count(Request::PowerButton, Answer::NotPressed);
        if pressed + not > 0 {
            let mut s = format!("power button pressed {pressed} times");
            if not > 0 {
                s.push_str(&format!(" ({not} more not taken by QEMU)"));
            }
            parts.push(s);
        }
        if parts.is_empty() {
            "nothing was sent".into()
        } else {
            parts.join("; ")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: Duration = Duration::from_millis(1);

    /// What the world does in one step of a scripted stop.
    #[derive(Clone, Copy, Debug)]
    struct Step {
        agent_connected: bool,
        /// Index into `Answer::possible` of the request sent.
        answer: usize,
        /// How long the request takes.
        took: Duration,
    }

    /// One request as the script saw it.
    #[derive(Clone, Copy, Debug)]
    struct Sent {
        at: Duration,
        took: Duration,
        request: Request,
        answer: Answer,
        /// Sent right after the previous request's answer, with no wait.
        back_to_back: bool,
    }

    /// A scripted stop in which QEMU never exits.
    #[derive(Debug)]
    struct Played {
        sent: Vec<Sent>,
        /// (from, until) of each wait.
        waits: Vec<(Duration, Duration)>,
        forced_at: Duration,
    }

    /// Plays a stop: every step is one call of `next`; the script repeats
    /// its last step.
    fn play(grace: Duration, script: &[Step]) -> Played {
        let mut plan = Plan::new(grace);
        let mut now = Duration::ZERO;
        let mut sent = Vec::new();
        let mut waits = Vec::new();
        let mut waited = true;
        for i in 0..10_000 {
            let step = script[i.min(script.len() - 1)];
            match plan.next(now, step.agent_connected) {
                Next::Send(request) => {
                    let answers = Answer::possible(request);
                    let answer = answers[step.answer % answers.len()];
                    sent.push(Sent {
                        at: now,
                        took: step.took,
                        request,
                        answer,
                        back_to_back: !waited && !sent.is_empty(),
                    });
                    now += step.took;
                    plan.record(now, request, answer);
                    waited = false;
                }
                Next::WaitUntil(t) => {
                    waits.push((now, t));
                    now = t;
                    waited = true;
                }
                Next::Force => {
                    return Played {
                        sent,
                        waits,
                        forced_at: now,
                    };
                }
            }
        }
        panic!("no forced stop after 10000 steps: {sent:?}");
    }

    /// Everything a plan must do, whatever the guest answers.
    fn check(grace: Duration, script: &[Step]) {
        let p = play(grace, script);
        let ctx = || format!("grace {grace:?}, script {script:?}:\n{p:#?}");
        // Forced at or after the deadline, never before; nothing sent at or
        // after it; every wait moves time forward and never past it.
        assert!(p.forced_at >= grace, "{}", ctx());
        assert!(p.sent.iter().all(|s| s.at < grace), "{}", ctx());
        assert!(
            p.waits.iter().all(|(from, to)| to > from && *to <= grace),
            "{}",
            ctx()
        );
        if grace.is_zero() {
            assert!(p.sent.is_empty(), "{}", ctx());
            return;
        }
        // The first request goes at once, to the agent if it is connected.
        let first = p.sent.first().expect("a request");
        let want = if script[0].agent_connected {
            Request::Agent
        } else {
            Request::PowerButton
        };
        assert!(first.at.is_zero() && first.request == want, "{}", ctx());

        let mut accepted_before = false;
        let mut last_round: Option<Duration> = None;
        let longest = script.iter().map(|s| s.took).max().unwrap_or_default();
        for (i, s) in p.sent.iter().enumerate() {
            let follow_up = i > 0
                && s.back_to_back
                && s.request == Request::PowerButton
                && p.sent[i - 1].request == Request::Agent;
            if !follow_up {
                // A new round: never sooner than ASK_AGAIN after the last,
                // and never later than the longest wait after it.
                if let Some(prev) = last_round {
                    assert!(s.at >= prev + ASK_AGAIN, "round at {:?}: {}", s.at, ctx());
                    assert!(
                        s.at <= prev + ASK_AGAIN_AFTER_ACCEPT + longest * 2,
                        "round at {:?}: {}",
                        s.at,
                        ctx()
                    );
                }
                last_round = Some(s.at);
            }
            if s.request == Request::Agent {
                // The button follows at once unless this is the agent's
                // first acceptance (or the deadline came first).
                let must_press = s.answer != Answer::Accepted || accepted_before;
                let pressed = p
                    .sent
                    .get(i + 1)
                    .is_some_and(|n| n.back_to_back && n.request == Request::PowerButton);
                if s.at + s.took < grace {
                    assert_eq!(pressed, must_press, "request {i}: {}", ctx());
                } else {
                    assert!(!pressed, "request {i}: {}", ctx());
                }
                accepted_before |= s.answer == Answer::Accepted;
            }
        }
        // The last round is not followed by silence up to the deadline.
        let last = last_round.unwrap_or_default();
        assert!(
            grace <= last + ASK_AGAIN_AFTER_ACCEPT + longest * 2,
            "nothing from {last:?} to the deadline: {}",
            ctx()
        );
    }

    /// Every combination of connected/answer over four rounds, with fixed
    /// request times (an acceptance waits out its reply window, a refusal
    /// comes at once), for deadlines around the round lengths.
    #[test]
    fn every_answer_sequence_over_four_rounds_keeps_the_rules() {
        let steps: Vec<Step> = [false, true]
            .into_iter()
            .flat_map(|agent_connected| {
                (0..3).map(move |answer| Step {
                    agent_connected,
                    answer,
                    took: Duration::from_millis(if answer == 0 { 3000 } else { 100 }),
                })
            })
            .collect();
        let mut n = 0;
        for grace in [0, 1, 4, 5, 12, 30, 60].map(Duration::from_secs) {
            for a in &steps {
                for b in &steps {
                    for c in &steps {
                        for d in &steps {
                            check(grace, &[*a, *b, *c, *d]);
                            n += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(n, 7 * 6 * 6 * 6 * 6);
    }

    fn step() -> impl Strategy<Value = Step> {
        (any::<bool>(), 0usize..6, 0u64..7000).prop_map(|(agent_connected, answer, ms)| Step {
            agent_connected,
            answer,
            took: Duration::from_millis(ms),
        })
    }

    proptest! {
        #[test]
        fn any_answers_and_timings_keep_the_rules(
            grace in 0u64..120_000,
            script in proptest::collection::vec(step(), 1..40),
        ) {
            check(Duration::from_millis(grace), &script);
        }
    }

    /// The case seen with the Debian image: the agent refuses while logind
    /// is not up, the button goes unanswered, and a later round is accepted.
    #[test]
    fn a_refusal_presses_the_button_and_the_agent_is_asked_again() {
        let mut plan = Plan::new(Duration::from_secs(60));
        let s = Duration::from_secs;
        assert_eq!(plan.next(s(0), true), Next::Send(Request::Agent));
        plan.record(s(0) + 400 * MS, Request::Agent, Answer::Refused);
        assert_eq!(
            plan.next(s(0) + 400 * MS, true),
            Next::Send(Request::PowerButton)
        );
        plan.record(s(0) + 410 * MS, Request::PowerButton, Answer::Pressed);
        assert_eq!(plan.next(s(0) + 410 * MS, true), Next::WaitUntil(s(5)));
        assert_eq!(plan.next(s(5), true), Next::Send(Request::Agent));
        plan.record(s(10), Request::Agent, Answer::Accepted);
        // Accepted once: no button, a longer wait.
        assert_eq!(plan.next(s(10), true), Next::WaitUntil(s(20)));
        // Still running 10 s later: ask again, and this time press too.
        assert_eq!(plan.next(s(20), true), Next::Send(Request::Agent));
        plan.record(s(23), Request::Agent, Answer::Accepted);
        assert_eq!(plan.next(s(23), false), Next::Send(Request::PowerButton));
        plan.record(s(23), Request::PowerButton, Answer::Pressed);
        assert_eq!(
            plan.summary(),
            "guest-shutdown 2 accepted, 1 refused; power button pressed 2 times"
        );
        assert_eq!(plan.next(s(60), true), Next::Force);
    }
}
