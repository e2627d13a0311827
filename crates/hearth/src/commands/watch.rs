//! Following objects until they get where they should: the core of `hearth
//! wait` and `hearth apply --wait`.
//!
//! The objects are followed on hearthd's change stream ([`Follow::Stream`]:
//! every change is judged as it is committed, nothing is polled), or, in
//! tests, polled ([`Follow::Poll`], `GET /v1/KIND/NAME`). Either way a pure [`Goal::judge`] decides whether each observation is
//! there, still on its way, or will not get there, and a [`Reporter`] shows
//! how it goes. The judging is pure so every case is tested without a daemon.

use std::time::Duration;

use anyhow::bail;
use hearth_api::{Kind, WatchType};
use serde_json::Value;

#[cfg(test)]
use super::object_path;
use super::short_ref;
use super::wait::WaitFor;
use crate::client::{ApiClient, ApiError};
use crate::follow::{Follower, Update};
use crate::output::{at, human_bytes, str_at, u64_at};
use crate::progress::{Reporter, Transfer, View};

/// What one poll found.
#[derive(Clone, Debug)]
pub enum Observation {
    Present(Value),
    Absent,
    /// hearthd could not be reached this time (restarting?); keep trying.
    Unreachable(String),
}

impl Observation {
    fn phase(&self) -> Option<&str> {
        match self {
            Observation::Present(obj) => str_at(obj, &["status", "phase"]),
            _ => None,
        }
    }

    /// The progress state: the phase, or why there is none.
    pub fn state(&self) -> String {
        match self {
            Observation::Present(_) => self.phase().unwrap_or("no status yet").to_string(),
            Observation::Absent => "not found".to_string(),
            Observation::Unreachable(_) => "hearthd unreachable, retrying".to_string(),
        }
    }

    /// The last status, for a timeout message.
    pub fn summary(&self) -> String {
        let obj = match self {
            Observation::Absent => return "not found".to_string(),
            Observation::Unreachable(why) => return why.clone(),
            Observation::Present(obj) => obj,
        };
        let mut parts = vec![format!("phase {}", self.state())];
        if let Some(connected) = at(obj, &["status", "agentConnected"]) {
            parts.push(
                if connected.as_bool() == Some(true) {
                    "agent connected"
                } else {
                    "agent not connected"
                }
                .to_string(),
            );
        }
        if let Some(t) = transfer_of(obj) {
            match t.percent() {
                Some(p) => parts.push(format!("{p}% ({})", t.describe())),
                None => parts.push(t.describe()),
            }
        } else if let Some(p) = str_at(obj, &["status", "progress"])
            && self.phase() != Some("Ready")
        {
            parts.push(p.to_string());
        }
        if let Some(n) = u64_at(obj, &["status", "attempts"]) {
            parts.push(format!("attempt {n}"));
        }
        if let Some(e) = str_at(obj, &["status", "lastError"]) {
            parts.push(format!("last error: {e}"));
        }
        if let Some(why) = reason_and_message(obj) {
            parts.push(why);
        }
        parts.join(", ")
    }
}

#[cfg(test)]
async fn observe(client: &ApiClient, path: &str) -> Result<Observation, ApiError> {
    match client.get(path).await {
        Ok(obj) => Ok(Observation::Present(obj)),
        Err(e) if e.is_not_found() => Ok(Observation::Absent),
        Err(e @ ApiError::Unreachable { .. }) => Ok(Observation::Unreachable(e.to_string())),
        Err(e) => Err(e),
    }
}

/// A status's `reason: message`, or whichever of them is set.
pub fn reason_and_message(obj: &Value) -> Option<String> {
    let reason = str_at(obj, &["status", "reason"]).filter(|s| !s.is_empty());
    let message = str_at(obj, &["status", "message"]).filter(|s| !s.is_empty());
    match (reason, message) {
        (Some(r), Some(m)) => Some(format!("{r}: {m}")),
        (Some(one), None) | (None, Some(one)) => Some(one.to_string()),
        (None, None) => None,
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Met,
    Waiting,
    /// It will not get there by itself; the text says why.
    Failed(String),
}

/// What is waited for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Goal {
    /// `hearth wait --for CONDITION` (already checked against the kind).
    Condition(WaitFor),
    /// `hearth apply --wait`: the object has settled where its spec leads:
    /// an image or a disk Ready, a snapshot Ready, a VM Running when its run
    /// policy wants it running (Stopped when AlwaysOff; either for Manual).
    /// `configured`: the apply changed its spec, so a status it had before
    /// may be about the old spec.
    Settled { configured: bool },
}

impl Goal {
    /// For messages: `phase=Ready`, `agent`, or what settled means for this object.
    pub fn describe(&self, kind: Kind, obs: &Observation) -> String {
        match self {
            Goal::Condition(cond) => cond.to_string(),
            Goal::Settled { .. } => match kind {
                Kind::VirtualMachine => match run_policy(obs) {
                    "AlwaysOff" => "Stopped",
                    "Manual" => "Running or Stopped",
                    _ => "Running",
                }
                .to_string(),
                _ => "Ready".to_string(),
            },
        }
    }

    /// Decides one poll.
    pub fn judge(&self, kind: Kind, obs: &Observation) -> Verdict {
        match self {
            Goal::Condition(cond) => judge_condition(kind, cond, obs),
            Goal::Settled { configured } => judge_settled(kind, *configured, obs),
        }
    }
}

fn failed_because(obj: &Value) -> Verdict {
    // VMs and disks say why in lastError; snapshots and images in reason and message.
    let why = str_at(obj, &["status", "lastError"])
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .or_else(|| reason_and_message(obj))
        .unwrap_or_else(|| "no error recorded".to_string());
    Verdict::Failed(format!("it is Failed: {why}"))
}

/// `hearth wait`. A Failed VM, disk or snapshot will not get anywhere by
/// itself; a Failed image is imported again by hearthd, so the wait goes on.
pub fn judge_condition(kind: Kind, cond: &WaitFor, obs: &Observation) -> Verdict {
    let obj = match (cond, obs) {
        (WaitFor::Delete, Observation::Absent) => return Verdict::Met,
        (WaitFor::Delete, _) => return Verdict::Waiting,
        (_, Observation::Present(obj)) => obj,
        (_, _) => return Verdict::Waiting,
    };
    let phase = str_at(obj, &["status", "phase"]);
    match cond {
        WaitFor::Phase(want) if phase == Some(want.as_str()) => Verdict::Met,
        WaitFor::Phase(_) if phase == Some("Failed") && kind == Kind::VirtualImage => {
            Verdict::Waiting
        }
        WaitFor::Phase(_) if phase == Some("Failed") => failed_because(obj),
        // A snapshot being deleted only goes on to be gone.
        WaitFor::Phase(_) if phase == Some("Terminating") => {
            Verdict::Failed("it is being deleted".to_string())
        }
        WaitFor::Phase(_) => Verdict::Waiting,
        WaitFor::Agent => {
            if at(obj, &["status", "agentConnected"]).and_then(Value::as_bool) == Some(true) {
                Verdict::Met
            } else if phase == Some("Failed") {
                failed_because(obj)
            } else if at(obj, &["spec", "guestAgent"]).and_then(Value::as_bool) == Some(false) {
                Verdict::Failed(
                    "its spec.guestAgent is false, so no agent will connect".to_string(),
                )
            } else {
                Verdict::Waiting
            }
        }
        WaitFor::Delete => Verdict::Waiting,
    }
}

fn run_policy(obs: &Observation) -> &str {
    match obs {
        Observation::Present(obj) => str_at(obj, &["spec", "runPolicy"]).unwrap_or("AlwaysOn"),
        _ => "AlwaysOn",
    }
}

/// `hearth apply --wait`.
pub fn judge_settled(kind: Kind, configured: bool, obs: &Observation) -> Verdict {
    let Observation::Present(obj) = obs else {
        // Just applied: absent only until the read sees it (or someone deleted it).
        return Verdict::Waiting;
    };
    let phase = str_at(obj, &["status", "phase"]);
    match kind {
        Kind::VirtualImage => match phase {
            Some("Ready") => Verdict::Met,
            // Failed imports are retried by hearthd; the reason is shown meanwhile.
            _ => Verdict::Waiting,
        },
        Kind::VirtualDisk | Kind::VirtualNetwork => match phase {
            Some("Ready") => Verdict::Met,
            Some("Failed") => failed_because(obj),
            _ => Verdict::Waiting,
        },
        Kind::VirtualDiskSnapshot
        | Kind::VirtualMachineSnapshot
        | Kind::VirtualMachineSnapshotGroup => match phase {
            Some("Ready") => Verdict::Met,
            Some("Failed") => failed_because(obj),
            Some("Terminating") => Verdict::Failed("it is being deleted".to_string()),
            _ => Verdict::Waiting,
        },
        Kind::VirtualMachineBackup => match phase {
            Some("Ready") => Verdict::Met,
            Some("Failed") => failed_because(obj),
            _ => Verdict::Waiting,
        },
        // Settled once hearthd has read it (its runs come on the calendar).
        Kind::VirtualMachineSnapshotSchedule => {
            let generation = u64_at(obj, &["metadata", "generation"]);
            let observed = u64_at(obj, &["status", "observedGeneration"]);
            match (generation, observed) {
                (Some(g), Some(o)) if o >= g => Verdict::Met,
                _ => Verdict::Waiting,
            }
        }
        Kind::VirtualMachine => {
            // hearthd records the generation it acted on when the VM runs or
            // stays stopped; before that, the phase may be the old spec's.
            let generation = u64_at(obj, &["metadata", "generation"]);
            let observed = u64_at(obj, &["status", "observedGeneration"]);
            let current = match (generation, observed) {
                (Some(g), Some(o)) => o >= g,
                _ => true,
            };
            let settled = match run_policy(obs) {
                "AlwaysOff" => phase == Some("Stopped"),
                "Manual" => matches!(phase, Some("Running" | "Stopped")),
                _ => phase == Some("Running"),
            };
            match phase {
                // A failure recorded before this apply changed the spec is
                // not this spec's failure: wait for hearthd to try it.
                Some("Failed") if current || !configured => failed_because(obj),
                _ if settled && current => Verdict::Met,
                _ => Verdict::Waiting,
            }
        }
    }
}

fn transfer_of(obj: &Value) -> Option<Transfer> {
    if str_at(obj, &["status", "phase"]) != Some("Importing") {
        return None;
    }
    Some(Transfer {
        done: u64_at(obj, &["status", "bytesDone"])?,
        total: u64_at(obj, &["status", "bytesTotal"]),
        rate: u64_at(obj, &["status", "bytesPerSecond"]),
    })
}

/// `42%` as a number.
fn parse_percent(s: &str) -> Option<u64> {
    s.trim()
        .strip_suffix('%')
        .and_then(|n| n.trim().parse::<f64>().ok())
        .filter(|p| p.is_finite() && *p >= 0.0)
        .map(|p| p.min(100.0) as u64)
}

/// How one object looks on its progress line.
pub fn view_of(kind: Kind, obs: &Observation) -> View {
    match (kind, obs) {
        (Kind::VirtualImage, Observation::Present(obj))
            if str_at(obj, &["status", "phase"]).is_some() =>
        {
            image_view(obj)
        }
        _ => View::state(obs.state()),
    }
}

/// `Importing 42% (12.0Mi of 28.6Mi, 3.1Mi/s)`, `Failed (attempt 2): HttpError: ...`,
/// `Ready (qcow2, 512.0Mi, virtual size 2.0Gi)`.
fn image_view(obj: &Value) -> View {
    let phase = str_at(obj, &["status", "phase"]).unwrap_or("no status yet");
    let why = reason_and_message(obj);
    let attempts = u64_at(obj, &["status", "attempts"]);
    let key = format!(
        "{phase}|{}|{}",
        why.as_deref().unwrap_or(""),
        attempts.unwrap_or(0)
    );
    let transfer = transfer_of(obj);
    let percent = transfer.and_then(|t| t.percent()).or_else(|| {
        str_at(obj, &["status", "progress"])
            .filter(|_| phase == "Importing")
            .and_then(parse_percent)
    });
    let text = match phase {
        "Importing" => {
            let mut text = "Importing".to_string();
            match (percent, transfer) {
                (Some(p), Some(t)) => text.push_str(&format!(" {p}% ({})", t.describe())),
                (None, Some(t)) => text.push_str(&format!(" {}", t.describe())),
                (_, None) => {
                    if let Some(p) = str_at(obj, &["status", "progress"]) {
                        text.push_str(&format!(" {p}"));
                    }
                }
            }
            text
        }
        "Failed" => {
            let mut text = "Failed".to_string();
            if let Some(n) = attempts {
                text.push_str(&format!(" (attempt {n})"));
            }
            text.push_str(": ");
            text.push_str(why.as_deref().unwrap_or("no reason recorded"));
            text
        }
        "Ready" => {
            let details: Vec<String> = [
                str_at(obj, &["status", "format"]).map(str::to_string),
                u64_at(obj, &["status", "size"]).map(human_bytes),
                u64_at(obj, &["status", "virtualSize"])
                    .map(|v| format!("virtual size {}", human_bytes(v))),
            ]
            .into_iter()
            .flatten()
            .collect();
            if details.is_empty() {
                "Ready".to_string()
            } else {
                format!("Ready ({})", details.join(", "))
            }
        }
        other => other.to_string(),
    };
    View {
        text,
        key,
        percent,
        transfer,
    }
}

/// One object to wait for.
#[derive(Clone, Debug)]
pub struct Target {
    pub kind: Kind,
    pub name: String,
    pub goal: Goal,
}

struct Watched {
    target: Target,
    who: String,
    #[cfg(test)]
    path: String,
    last: Observation,
    /// The last failure seen, kept when a retry clears it from the status.
    last_failure: Option<String>,
    done: bool,
}

/// How the objects are followed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Follow {
    /// hearthd's change stream (`GET /v1/watch`): each change is judged
    /// as it is committed, nothing is polled.
    Stream,
    /// Read every object each interval (the judging, tested without a
    /// stream).
    #[cfg(test)]
    Poll(Duration),
}

/// Follows every target until each meets its goal (Ok), one will not (its
/// error), or `timeout` passes (an error naming every target still waited
/// for, with its last status and last failure).
pub async fn watch(
    client: &ApiClient,
    targets: Vec<Target>,
    timeout: Duration,
    follow: Follow,
    reporter: &mut dyn Reporter,
) -> anyhow::Result<()> {
    let total = targets.len();
    let mut watched: Vec<Watched> = targets
        .into_iter()
        .map(|target| Watched {
            who: short_ref(target.kind, &target.name),
            #[cfg(test)]
            path: object_path(target.kind, &target.name),
            target,
            last: Observation::Absent,
            last_failure: None,
            done: false,
        })
        .collect();
    let deadline = tokio::time::Instant::now() + timeout;
    match follow {
        Follow::Stream => {
            match follow_stream(client, &mut watched, timeout, deadline, reporter).await? {
                Followed::Done => Ok(()),
                Followed::TimedOut => {
                    reporter.abandon()?;
                    Err(timed_out(&watched, total, timeout))
                }
            }
        }
        #[cfg(test)]
        Follow::Poll(every) => poll(client, &mut watched, timeout, deadline, every, reporter).await,
    }
}

/// Reads every target each `every` until all are done.
#[cfg(test)]
async fn poll(
    client: &ApiClient,
    watched: &mut [Watched],
    timeout: Duration,
    deadline: tokio::time::Instant,
    every: Duration,
    reporter: &mut dyn Reporter,
) -> anyhow::Result<()> {
    loop {
        for w in watched.iter_mut().filter(|w| !w.done) {
            let obs = observe(client, &w.path).await?;
            settle(w, obs, reporter)?;
        }
        if watched.iter().all(|w| w.done) {
            return Ok(());
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            reporter.abandon()?;
            return Err(timed_out(watched, watched.len(), timeout));
        }
        tokio::time::sleep(every.min(deadline - now)).await;
    }
}

/// How following the stream ended, when it did not fail.
enum Followed {
    Done,
    TimedOut,
}

/// The stream's path for these targets: their kinds, and the name when
/// there is one target.
fn stream_path(watched: &[Watched]) -> String {
    let mut kinds: Vec<&str> = Vec::new();
    for w in watched {
        let plural = w.target.kind.plural();
        if !kinds.contains(&plural) {
            kinds.push(plural);
        }
    }
    let mut path = format!("/v1/watch?kinds={}", kinds.join(","));
    if let [one] = watched {
        path.push_str(&format!("&name={}", one.target.name));
    }
    path
}

/// Judges every target on the stream's state each time it is complete and
/// each time one of them changes.
async fn follow_stream(
    client: &ApiClient,
    watched: &mut [Watched],
    timeout: Duration,
    deadline: tokio::time::Instant,
    reporter: &mut dyn Reporter,
) -> anyhow::Result<Followed> {
    let path = stream_path(watched);
    // hearthd may be starting (or restarting): keep trying, as polling does.
    let mut pause = Duration::from_millis(100);
    let mut follower = loop {
        let opened = tokio::time::timeout_at(
            deadline,
            Follower::open(client, path.clone(), timeout, Box::new(std::io::stderr())),
        )
        .await;
        match opened {
            Err(_) => return Ok(Followed::TimedOut),
            Ok(Ok(f)) => break f,
            Ok(Err(e @ ApiError::Unreachable { .. })) => {
                let why = e.to_string();
                for w in watched.iter_mut() {
                    settle(w, Observation::Unreachable(why.clone()), reporter)?;
                }
                if tokio::time::Instant::now() + pause >= deadline {
                    return Ok(Followed::TimedOut);
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            Ok(Err(e)) => return Err(e.into()),
        }
    };
    loop {
        let update = match tokio::time::timeout_at(deadline, follower.next()).await {
            Err(_) => return Ok(Followed::TimedOut),
            Ok(update) => update?,
        };
        match update {
            Update::Synced { .. } => {
                for w in watched.iter_mut().filter(|w| !w.done) {
                    let obs = match follower
                        .informer()
                        .get(w.target.kind.as_str(), &w.target.name)
                    {
                        Some(obj) => Observation::Present(obj.clone()),
                        None => Observation::Absent,
                    };
                    settle(w, obs, reporter)?;
                }
            }
            Update::Object {
                type_,
                kind,
                name,
                object,
                ..
            } => {
                let Some(w) = watched
                    .iter_mut()
                    .find(|w| !w.done && w.target.kind.as_str() == kind && w.target.name == name)
                else {
                    continue;
                };
                let obs = if type_ == WatchType::Deleted {
                    Observation::Absent
                } else {
                    Observation::Present(object)
                };
                settle(w, obs, reporter)?;
            }
            Update::Lost(why) => {
                for w in watched.iter_mut().filter(|w| !w.done) {
                    settle(w, Observation::Unreachable(why.clone()), reporter)?;
                }
            }
            Update::Event { .. } | Update::Relisted(_) => {}
        }
        if watched.iter().all(|w| w.done) {
            return Ok(Followed::Done);
        }
    }
}

/// Judges one observation of a target: shows it, and marks the target done
/// or fails the wait.
fn settle(w: &mut Watched, obs: Observation, reporter: &mut dyn Reporter) -> anyhow::Result<()> {
    if w.done {
        return Ok(());
    }
    let verdict = w.target.goal.judge(w.target.kind, &obs);
    let mut view = match (&verdict, &obs) {
        (Verdict::Met, Observation::Absent) => View::state("deleted"),
        _ => view_of(w.target.kind, &obs),
    };
    if let Observation::Present(obj) = &obs
        && obs.phase() == Some("Failed")
    {
        w.last_failure = reason_and_message(obj)
            .or_else(|| str_at(obj, &["status", "lastError"]).map(str::to_string));
        let deleting = w.target.goal == Goal::Condition(WaitFor::Delete);
        if verdict == Verdict::Waiting && !deleting {
            view.text.push_str("; still waiting");
            if w.target.kind == Kind::VirtualImage {
                view.text.push_str(" (hearthd retries the import)");
            }
        }
    }
    reporter.observe(&w.who, &view, tokio::time::Instant::now())?;
    match verdict {
        Verdict::Met => {
            let note =
                (w.target.goal == Goal::Condition(WaitFor::Agent)).then_some("agent connected");
            reporter.done(&w.who, note)?;
            w.done = true;
        }
        Verdict::Failed(why) => {
            reporter.failed(&w.who)?;
            reporter.abandon()?;
            let goal = w.target.goal.describe(w.target.kind, &obs);
            match &w.target.goal {
                Goal::Condition(_) => bail!("{} will not reach {goal}: {why}", w.who),
                Goal::Settled { .. } => bail!("{} will not be {goal}: {why}", w.who),
            }
        }
        Verdict::Waiting => {}
    }
    w.last = obs;
    Ok(())
}

/// The timeout's error: every target still waited for, with its last
/// status and last failure.
fn timed_out(watched: &[Watched], total: usize, timeout: Duration) -> anyhow::Error {
    let pending: Vec<&Watched> = watched.iter().filter(|w| !w.done).collect();
    let describe = |w: &Watched| {
        let mut status = w.last.summary();
        if let Some(f) = &w.last_failure
            && !status.contains(f.as_str())
        {
            status.push_str(&format!(", last failure: {f}"));
        }
        let goal = w.target.goal.describe(w.target.kind, &w.last);
        (w.who.clone(), goal, status)
    };
    if let ([one], 1) = (pending.as_slice(), total) {
        let (who, goal, status) = describe(one);
        return anyhow::anyhow!(
            "timed out after {timeout:?} waiting for {who} ({goal}); last status: {status}"
        );
    }
    let list = pending
        .iter()
        .map(|w| {
            let (who, goal, status) = describe(w);
            format!("{who} ({goal}; last status: {status})")
        })
        .collect::<Vec<_>>()
        .join("; ");
    anyhow::anyhow!(
        "timed out after {timeout:?} waiting for {} of {total} objects: {list}",
        pending.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn present(status: Value) -> Observation {
        Observation::Present(
            json!({"metadata": {"name": "x"}, "spec": {"guestAgent": true}, "status": status}),
        )
    }

    fn vm(policy: &str, generation: u64, status: Value) -> Observation {
        Observation::Present(
            json!({"metadata": {"name": "web", "generation": generation},
                                    "spec": {"runPolicy": policy}, "status": status}),
        )
    }

    #[test]
    fn judging_each_poll() {
        let running = WaitFor::Phase("Running".into());
        let judge =
            |cond: &WaitFor, obs: &Observation| judge_condition(Kind::VirtualMachine, cond, obs);
        assert_eq!(
            judge(&running, &present(json!({"phase": "Running"}))),
            Verdict::Met
        );
        assert_eq!(
            judge(&running, &present(json!({"phase": "Starting"}))),
            Verdict::Waiting
        );
        assert_eq!(judge(&running, &Observation::Absent), Verdict::Waiting);
        assert_eq!(
            judge(
                &running,
                &present(json!({"phase": "Failed", "lastError": "kernel /k not found"}))
            ),
            Verdict::Failed("it is Failed: kernel /k not found".into())
        );
        // Waiting for Failed itself is allowed.
        let failed = WaitFor::Phase("Failed".into());
        assert_eq!(
            judge(&failed, &present(json!({"phase": "Failed"}))),
            Verdict::Met
        );
        assert_eq!(
            judge(
                &WaitFor::Agent,
                &present(json!({"phase": "Running", "agentConnected": true}))
            ),
            Verdict::Met
        );
        assert_eq!(
            judge(
                &WaitFor::Agent,
                &present(json!({"phase": "Running", "agentConnected": false}))
            ),
            Verdict::Waiting
        );
        assert!(matches!(
            judge(&WaitFor::Agent, &present(json!({"phase": "Failed"}))),
            Verdict::Failed(_)
        ));
        let no_agent = Observation::Present(
            json!({"spec": {"guestAgent": false}, "status": {"phase": "Running"}}),
        );
        assert!(matches!(
            judge(&WaitFor::Agent, &no_agent),
            Verdict::Failed(_)
        ));
        assert_eq!(judge(&WaitFor::Delete, &Observation::Absent), Verdict::Met);
        assert_eq!(
            judge(&WaitFor::Delete, &present(json!({"phase": "Stopping"}))),
            Verdict::Waiting
        );
        assert_eq!(
            judge(&WaitFor::Delete, &Observation::Unreachable("down".into())),
            Verdict::Waiting
        );
    }

    #[test]
    fn judging_a_snapshot() {
        let ready = WaitFor::Phase("Ready".into());
        let judge = |obs: &Observation| judge_condition(Kind::VirtualDiskSnapshot, &ready, obs);
        assert_eq!(
            judge(&present(json!({"phase": "InProgress", "cutId": 2}))),
            Verdict::Waiting
        );
        assert_eq!(judge(&present(json!({"phase": "Ready"}))), Verdict::Met);
        assert_eq!(
            judge(&present(
                json!({"phase": "Failed", "reason": "FreezeFailed", "message": "fsfreeze: EBUSY"})
            )),
            Verdict::Failed("it is Failed: FreezeFailed: fsfreeze: EBUSY".into())
        );
        assert_eq!(
            judge(&present(json!({"phase": "Terminating"}))),
            Verdict::Failed("it is being deleted".into())
        );
        assert_eq!(
            judge_condition(
                Kind::VirtualDiskSnapshot,
                &WaitFor::Delete,
                &present(json!({"phase": "Terminating"}))
            ),
            Verdict::Waiting
        );
    }

    #[test]
    fn a_failed_image_is_waited_on_while_hearthd_retries_it() {
        let failed = present(
            json!({"phase": "Failed", "reason": "HttpError", "message": "503", "attempts": 2}),
        );
        assert_eq!(
            judge_condition(Kind::VirtualImage, &WaitFor::Phase("Ready".into()), &failed),
            Verdict::Waiting
        );
        assert_eq!(
            judge_condition(
                Kind::VirtualImage,
                &WaitFor::Phase("Failed".into()),
                &failed
            ),
            Verdict::Met
        );
        assert_eq!(
            judge_settled(Kind::VirtualImage, false, &failed),
            Verdict::Waiting
        );
        assert_eq!(
            judge_settled(
                Kind::VirtualImage,
                false,
                &present(json!({"phase": "Ready"}))
            ),
            Verdict::Met
        );
    }

    #[test]
    fn settled_disks_and_snapshots_are_ready_and_their_failures_end_the_wait() {
        for kind in [
            Kind::VirtualDisk,
            Kind::VirtualDiskSnapshot,
            Kind::VirtualMachineSnapshot,
        ] {
            assert_eq!(
                judge_settled(kind, false, &present(json!({"phase": "Ready"}))),
                Verdict::Met,
                "{kind}"
            );
            assert_eq!(
                judge_settled(kind, false, &present(json!({"phase": "Pending"}))),
                Verdict::Waiting,
                "{kind}"
            );
            assert_eq!(
                judge_settled(kind, false, &Observation::Absent),
                Verdict::Waiting
            );
        }
        assert_eq!(
            judge_settled(
                Kind::VirtualDisk,
                false,
                &present(json!({"phase": "Failed", "lastError": "VirtualImage \"x\" not found"}))
            ),
            Verdict::Failed("it is Failed: VirtualImage \"x\" not found".into())
        );
        assert_eq!(
            judge_settled(
                Kind::VirtualMachineSnapshot,
                false,
                &present(json!({"phase": "Failed", "reason": "NoGuestAgent"}))
            ),
            Verdict::Failed("it is Failed: NoGuestAgent".into())
        );
    }

    #[test]
    fn a_settled_vm_is_where_its_run_policy_leads_for_the_current_spec() {
        let judge =
            |configured, obs: &Observation| judge_settled(Kind::VirtualMachine, configured, obs);
        let running = json!({"phase": "Running", "observedGeneration": 2});
        let stopped = json!({"phase": "Stopped", "observedGeneration": 2});
        assert_eq!(
            judge(false, &vm("AlwaysOn", 2, running.clone())),
            Verdict::Met
        );
        assert_eq!(
            judge(false, &vm("AlwaysOn", 2, stopped.clone())),
            Verdict::Waiting
        );
        assert_eq!(
            judge(false, &vm("AlwaysOff", 2, stopped.clone())),
            Verdict::Met
        );
        assert_eq!(
            judge(false, &vm("AlwaysOff", 2, running.clone())),
            Verdict::Waiting
        );
        assert_eq!(judge(false, &vm("Manual", 2, stopped)), Verdict::Met);
        assert_eq!(judge(false, &vm("Manual", 2, running)), Verdict::Met);
        // Running the previous spec: hearthd has yet to restart it.
        assert_eq!(
            judge(
                true,
                &vm(
                    "AlwaysOn",
                    3,
                    json!({"phase": "Running", "observedGeneration": 2})
                )
            ),
            Verdict::Waiting
        );
        // A failure of the previous spec is not this one's...
        let old_failure =
            json!({"phase": "Failed", "observedGeneration": 2, "lastError": "kernel /old missing"});
        assert_eq!(
            judge(true, &vm("AlwaysOn", 3, old_failure.clone())),
            Verdict::Waiting
        );
        // ...but without a spec change it is.
        assert_eq!(
            judge(false, &vm("AlwaysOn", 3, old_failure)),
            Verdict::Failed("it is Failed: kernel /old missing".into())
        );
        assert_eq!(
            judge(
                true,
                &vm(
                    "AlwaysOn",
                    3,
                    json!({"phase": "Failed", "observedGeneration": 3, "lastError": "boom"})
                )
            ),
            Verdict::Failed("it is Failed: boom".into())
        );
        // No status yet, or a daemon that reports no generation.
        assert_eq!(
            judge(false, &vm("AlwaysOn", 1, json!(null))),
            Verdict::Waiting
        );
        assert_eq!(
            judge(
                false,
                &Observation::Present(
                    json!({"metadata": {"name": "a"}, "spec": {}, "status": {"phase": "Running"}})
                )
            ),
            Verdict::Met
        );
        assert_eq!(
            Goal::Settled { configured: false }
                .describe(Kind::VirtualMachine, &vm("Manual", 1, json!({}))),
            "Running or Stopped"
        );
    }

    #[test]
    fn image_lines_show_progress_failures_and_what_is_ready() {
        let view = |status: Value| view_of(Kind::VirtualImage, &present(status));
        assert_eq!(view(json!({"phase": "Pending"})).text, "Pending");
        let importing = view(json!({"phase": "Importing", "progress": "42%",
                                    "bytesDone": 12u64 << 20, "bytesTotal": 28u64 << 20,
                                    "bytesPerSecond": 3u64 << 20}));
        assert_eq!(importing.text, "Importing 42% (12.0Mi of 28.0Mi, 3.0Mi/s)");
        assert_eq!(importing.percent, Some(42));
        assert_eq!(
            importing.transfer.map(|t| (t.done, t.total)),
            Some((12 << 20, Some(28 << 20)))
        );
        // Size unknown (no Content-Length): bytes so far, no percentage.
        let unknown = view(json!({"phase": "Importing", "bytesDone": 4096}));
        assert_eq!(unknown.text, "Importing 4.0Ki");
        assert_eq!(unknown.percent, None);
        // Only the progress string: shown as is, and its number counts.
        let only = view(json!({"phase": "Importing", "progress": "61%"}));
        assert_eq!(only.text, "Importing 61%");
        assert_eq!(only.percent, Some(61));
        let failed = view(
            json!({"phase": "Failed", "attempts": 2, "reason": "ChecksumMismatch",
                                 "message": "got sha256:00ff, want sha256:abcd"}),
        );
        assert_eq!(
            failed.text,
            "Failed (attempt 2): ChecksumMismatch: got sha256:00ff, want sha256:abcd"
        );
        let ready = view(
            json!({"phase": "Ready", "progress": "100%", "format": "qcow2",
                                "size": 512u64 << 20, "virtualSize": 2u64 << 30}),
        );
        assert_eq!(ready.text, "Ready (qcow2, 512.0Mi, virtual size 2.0Gi)");
        // Progress does not change the key; a new attempt does.
        assert_eq!(
            view(json!({"phase": "Importing", "bytesDone": 1})).key,
            view(json!({"phase": "Importing", "bytesDone": 2})).key
        );
        assert_ne!(
            view(json!({"phase": "Failed", "attempts": 1, "reason": "HttpError"})).key,
            view(json!({"phase": "Failed", "attempts": 2, "reason": "HttpError"})).key
        );
        assert_eq!(
            view_of(Kind::VirtualImage, &present(json!({}))).text,
            "no status yet"
        );
    }

    #[test]
    fn summaries_name_progress_attempts_and_reasons() {
        let obs = present(json!({"phase": "Importing", "bytesDone": 5u64 << 20,
                                 "bytesTotal": 10u64 << 20, "attempts": 3}));
        assert_eq!(
            obs.summary(),
            "phase Importing, 50% (5.0Mi of 10.0Mi), attempt 3"
        );
        let vm = present(json!({"phase": "Starting", "agentConnected": false}));
        assert_eq!(vm.summary(), "phase Starting, agent not connected");
        assert_eq!(parse_percent("42%"), Some(42));
        assert_eq!(parse_percent(" 99.5 %"), Some(99));
        assert_eq!(parse_percent("-3%"), None);
        assert_eq!(parse_percent("12.0Mi"), None);
    }
}
