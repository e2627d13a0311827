//! The VM lifecycle decision: observed state in, one next step out. Pure, so
//! every combination is tested; the async shell in `reconcile.rs` performs
//! the step and asks again until the VM settles.

/// What is known about the VM's QEMU process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Process {
    /// No runtime record: nothing runs.
    None,
    /// The recorded process is alive (same pid and start time).
    Alive,
    /// A runtime record exists but its process has exited.
    Gone,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Disks {
    Ready,
    /// A referenced disk is missing or not ready; the text says which.
    Waiting(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation {
    pub deleting: bool,
    pub want_running: bool,
    pub process: Process,
    /// The running process was started from a different spec.
    pub spec_changed: bool,
    pub restart_requested: bool,
    pub disks: Disks,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    Deleting,
    NotWanted,
    SpecChanged,
    RestartRequested,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Start QEMU. Only ever chosen when no process is recorded.
    Launch,
    /// Stop the running process (graceful, then forced), then decide again.
    Stop(StopReason),
    /// The recorded process has exited: record how, drop the record, decide again.
    Forget,
    /// Nothing runs and the object is being deleted: remove it.
    Remove,
    /// Wanted running but a disk is not there yet.
    WaitForDisks(String),
    /// Running as wanted.
    KeepRunning,
    /// Stopped as wanted.
    KeepStopped,
}

impl Step {
    /// Whether the shell must observe and decide again after this step.
    pub fn continues(&self) -> bool {
        matches!(self, Step::Stop(_) | Step::Forget)
    }
}

pub fn decide(o: &Observation) -> Step {
    match o.process {
        Process::Gone => Step::Forget,
        Process::Alive => {
            if o.deleting {
                Step::Stop(StopReason::Deleting)
            } else if !o.want_running {
                Step::Stop(StopReason::NotWanted)
            } else if o.spec_changed {
                Step::Stop(StopReason::SpecChanged)
            } else if o.restart_requested {
                Step::Stop(StopReason::RestartRequested)
            } else {
                Step::KeepRunning
            }
        }
        Process::None => {
            if o.deleting {
                Step::Remove
            } else if !o.want_running {
                Step::KeepStopped
            } else {
                match &o.disks {
                    Disks::Ready => Step::Launch,
                    Disks::Waiting(why) => Step::WaitForDisks(why.clone()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_observations() -> Vec<Observation> {
        let mut out = Vec::new();
        for deleting in [false, true] {
            for want_running in [false, true] {
                for process in [Process::None, Process::Alive, Process::Gone] {
                    for spec_changed in [false, true] {
                        for restart_requested in [false, true] {
                            for disks in [Disks::Ready, Disks::Waiting("disk \"d\"".into())] {
                                out.push(Observation {
                                    deleting,
                                    want_running,
                                    process,
                                    spec_changed,
                                    restart_requested,
                                    disks,
                                });
                            }
                        }
                    }
                }
            }
        }
        out
    }

    /// The shell's loop, played against a model of the world: a stop ends the
    /// process, a forget drops the record. Returns the steps taken.
    fn run_to_rest(mut o: Observation) -> Vec<Step> {
        let mut steps = Vec::new();
        for _ in 0..4 {
            let step = decide(&o);
            steps.push(step.clone());
            match step {
                Step::Stop(_) => {
                    o.process = Process::Gone;
                }
                Step::Forget => {
                    o.process = Process::None;
                    o.spec_changed = false;
                    o.restart_requested = false;
                }
                _ => return steps,
            }
        }
        panic!("no rest after 4 steps from {o:?}: {steps:?}");
    }

    #[test]
    fn never_launches_a_second_process() {
        for o in all_observations() {
            if o.process != Process::None {
                assert_ne!(decide(&o), Step::Launch, "{o:?}");
            }
        }
    }

    #[test]
    fn deleting_never_launches_and_ends_removed() {
        for o in all_observations().into_iter().filter(|o| o.deleting) {
            let steps = run_to_rest(o.clone());
            assert!(!steps.contains(&Step::Launch), "{o:?}: {steps:?}");
            assert_eq!(steps.last(), Some(&Step::Remove), "{o:?}: {steps:?}");
        }
    }

    #[test]
    fn every_observation_settles_within_three_steps_in_the_wanted_state() {
        for o in all_observations() {
            let steps = run_to_rest(o.clone());
            assert!(steps.len() <= 3, "{o:?}: {steps:?}");
            let last = steps.last().cloned();
            match (o.deleting, o.want_running, &o.disks) {
                (true, _, _) => assert_eq!(last, Some(Step::Remove)),
                (false, false, _) => assert_eq!(last, Some(Step::KeepStopped)),
                (false, true, Disks::Ready) => {
                    // Either it keeps the running process (nothing changed)
                    // or it ends by launching a fresh one.
                    assert!(
                        matches!(last, Some(Step::KeepRunning) | Some(Step::Launch)),
                        "{o:?}: {steps:?}"
                    )
                }
                (false, true, Disks::Waiting(_)) => assert!(
                    matches!(last, Some(Step::KeepRunning) | Some(Step::WaitForDisks(_))),
                    "{o:?}: {steps:?}"
                ),
            }
        }
    }

    #[test]
    fn an_unchanged_running_vm_is_left_alone() {
        let o = Observation {
            deleting: false,
            want_running: true,
            process: Process::Alive,
            spec_changed: false,
            restart_requested: false,
            // Even a disk that vanished from the store does not kill a running VM.
            disks: Disks::Waiting("x".into()),
        };
        assert_eq!(decide(&o), Step::KeepRunning);
    }

    #[test]
    fn a_spec_change_restarts_exactly_once() {
        let o = Observation {
            deleting: false,
            want_running: true,
            process: Process::Alive,
            spec_changed: true,
            restart_requested: false,
            disks: Disks::Ready,
        };
        assert_eq!(
            run_to_rest(o),
            vec![
                Step::Stop(StopReason::SpecChanged),
                Step::Forget,
                Step::Launch
            ]
        );
    }
}
