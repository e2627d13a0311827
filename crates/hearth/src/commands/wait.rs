//! `hearth wait KIND NAME --for CONDITION`: poll until a condition holds.

use std::fmt;
use std::io::Write;
use std::time::Duration;

use anyhow::bail;
use hearth_api::Kind;
use serde_json::Value;

use super::{object_path, short_ref};
use crate::client::{ApiClient, ApiError};
use crate::output::{at, str_at};

const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// Phases as hearth-api spells them (a test keeps these in step with the enums).
pub const VM_PHASES: [&str; 6] = [
    "Pending", "Starting", "Running", "Stopping", "Stopped", "Failed",
];
pub const DISK_PHASES: [&str; 3] = ["Pending", "Ready", "Failed"];
pub const IMAGE_PHASES: [&str; 4] = ["Pending", "Importing", "Ready", "Failed"];
/// Both snapshot kinds.
pub const SNAPSHOT_PHASES: [&str; 5] = ["Pending", "InProgress", "Ready", "Failed", "Terminating"];

#[derive(Debug, clap::Args)]
#[command(
    about = "Wait until an object reaches a phase, its guest agent connects, or it is gone",
    after_help = "\
CONDITION is one of:
  phase=PHASE   status.phase equals PHASE (VM: Pending, Starting, Running,
                Stopping, Stopped, Failed; disk: Pending, Ready, Failed;
                snapshot and vmsnapshot: Pending, InProgress, Ready, Failed,
                Terminating)
  agent         the VM's guest agent is connected (status.agentConnected)
  delete        the object no longer exists

Waiting for a phase other than Failed, or for the agent, stops early when the
object fails (with the VM's last error, or the snapshot's reason and message)
or, for a snapshot, when it is being deleted. Exit status: 0 when the
condition holds, 1 on failure or timeout.

Examples:
  hearth wait vm demo --for phase=Running
  hearth wait vm demo --for agent --timeout 5m
  hearth wait disk data --for delete --timeout 30s
  hearth wait snapshot data-20250101-120000 --for phase=Ready"
)]
pub struct Args {
    /// vm, disk, snapshot (a disk snapshot) or vmsnapshot.
    #[arg(value_name = "KIND", value_parser = super::parse_kind)]
    pub kind: Kind,
    #[arg(value_name = "NAME", value_parser = super::parse_name)]
    pub name: String,
    /// phase=PHASE, agent or delete.
    #[arg(long = "for", value_name = "CONDITION", value_parser = parse_condition)]
    pub condition: WaitFor,
    /// Give up after this long: 90s, 2m, 1h, 500ms, 1m30s.
    #[arg(long, value_name = "DURATION", default_value = "120s", value_parser = parse_duration)]
    pub timeout: Duration,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WaitFor {
    /// As the user typed it; checked against the kind's phases before polling.
    Phase(String),
    Agent,
    Delete,
}

impl fmt::Display for WaitFor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitFor::Phase(p) => write!(f, "phase={p}"),
            WaitFor::Agent => f.write_str("agent"),
            WaitFor::Delete => f.write_str("delete"),
        }
    }
}

pub fn parse_condition(s: &str) -> Result<WaitFor, String> {
    match s {
        "agent" => Ok(WaitFor::Agent),
        "delete" => Ok(WaitFor::Delete),
        _ => match s.strip_prefix("phase=") {
            Some(p) if !p.is_empty() => Ok(WaitFor::Phase(p.to_string())),
            _ => Err(format!(
                "unknown condition {s:?} (use phase=PHASE, agent or delete)"
            )),
        },
    }
}

/// Checks the condition against the kind and spells the phase the way the
/// API does (`running` becomes `Running`).
pub fn check_condition(kind: Kind, cond: WaitFor) -> Result<WaitFor, String> {
    let phases: &[&str] = match kind {
        Kind::VirtualMachine => &VM_PHASES,
        Kind::VirtualDisk => &DISK_PHASES,
        Kind::VirtualImage => &IMAGE_PHASES,
        Kind::VirtualDiskSnapshot | Kind::VirtualMachineSnapshot => &SNAPSHOT_PHASES,
    };
    match cond {
        WaitFor::Phase(p) => phases
            .iter()
            .find(|known| known.eq_ignore_ascii_case(&p))
            .map(|known| WaitFor::Phase(known.to_string()))
            .ok_or_else(|| format!("{kind} has no phase {p:?} (one of: {})", phases.join(", "))),
        WaitFor::Agent if kind != Kind::VirtualMachine => {
            Err(format!("--for agent applies to VMs only, not to {kind}"))
        }
        other => Ok(other),
    }
}

/// `90s`, `2m`, `1h`, `500ms`, `1m30s`; a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let err = || format!("invalid duration {s:?} (write for example 90s, 2m, 1h or 1m30s)");
    let t = s.trim();
    if t.is_empty() {
        return Err(err());
    }
    if t.bytes().all(|b| b.is_ascii_digit()) {
        return t.parse().map(Duration::from_secs).map_err(|_| err());
    }
    let mut total = Duration::ZERO;
    let mut rest = t;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits == 0 {
            return Err(err());
        }
        let number: u64 = rest[..digits].parse().map_err(|_| err())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let part = match &rest[..unit_len] {
            "ms" => Duration::from_millis(number),
            "s" => Duration::from_secs(number),
            "m" => number
                .checked_mul(60)
                .map(Duration::from_secs)
                .ok_or_else(err)?,
            "h" => number
                .checked_mul(3600)
                .map(Duration::from_secs)
                .ok_or_else(err)?,
            _ => return Err(err()),
        };
        rest = &rest[unit_len..];
        total = total.checked_add(part).ok_or_else(err)?;
    }
    Ok(total)
}

/// What one poll found.
#[derive(Clone, Debug)]
pub enum Observation {
    Present(Value),
    Absent,
    /// hearthd could not be reached this time (restarting?); keep trying.
    Unreachable(String),
}

impl Observation {
    /// The progress state: the phase, or why there is none.
    fn state(&self) -> String {
        match self {
            Observation::Present(obj) => str_at(obj, &["status", "phase"])
                .unwrap_or("no status yet")
                .to_string(),
            Observation::Absent => "not found".to_string(),
            Observation::Unreachable(_) => "hearthd unreachable, retrying".to_string(),
        }
    }

    /// The last status, for a timeout message.
    fn summary(&self) -> String {
        match self {
            Observation::Absent => "not found".to_string(),
            Observation::Unreachable(why) => why.clone(),
            Observation::Present(obj) => {
                let mut parts = vec![format!("phase {}", self.state())];
                if at(obj, &["status", "agentConnected"]).is_some() {
                    let connected = at(obj, &["status", "agentConnected"]).and_then(Value::as_bool);
                    parts.push(
                        if connected == Some(true) {
                            "agent connected"
                        } else {
                            "agent not connected"
                        }
                        .to_string(),
                    );
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
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Met,
    Waiting,
    /// It will not get there by itself; the text says why.
    Failed(String),
}

/// Decides one poll. Pure, so every case is tested without a daemon.
pub fn judge(cond: &WaitFor, obs: &Observation) -> Verdict {
    let obj = match (cond, obs) {
        (WaitFor::Delete, Observation::Absent) => return Verdict::Met,
        (WaitFor::Delete, _) => return Verdict::Waiting,
        (_, Observation::Present(obj)) => obj,
        (_, _) => return Verdict::Waiting,
    };
    let phase = str_at(obj, &["status", "phase"]);
    let failed = || {
        // VMs and disks say why in lastError, snapshots in reason and message.
        let why = str_at(obj, &["status", "lastError"])
            .map(str::to_string)
            .or_else(|| reason_and_message(obj))
            .unwrap_or_else(|| "no error recorded".to_string());
        Verdict::Failed(format!("it is Failed: {why}"))
    };
    match cond {
        WaitFor::Phase(want) if phase == Some(want.as_str()) => Verdict::Met,
        WaitFor::Phase(_) if phase == Some("Failed") => failed(),
        // A snapshot being deleted only goes on to be gone.
        WaitFor::Phase(_) if phase == Some("Terminating") => {
            Verdict::Failed("it is being deleted".to_string())
        }
        WaitFor::Phase(_) => Verdict::Waiting,
        WaitFor::Agent => {
            if at(obj, &["status", "agentConnected"]).and_then(Value::as_bool) == Some(true) {
                Verdict::Met
            } else if phase == Some("Failed") {
                failed()
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

/// A snapshot's `reason: message`, or whichever of them is set.
pub fn reason_and_message(obj: &Value) -> Option<String> {
    let reason = str_at(obj, &["status", "reason"]).filter(|s| !s.is_empty());
    let message = str_at(obj, &["status", "message"]).filter(|s| !s.is_empty());
    match (reason, message) {
        (Some(r), Some(m)) => Some(format!("{r}: {m}")),
        (Some(one), None) | (None, Some(one)) => Some(one.to_string()),
        (None, None) => None,
    }
}

async fn observe(client: &ApiClient, path: &str) -> Result<Observation, ApiError> {
    match client.get(path).await {
        Ok(obj) => Ok(Observation::Present(obj)),
        Err(e) if e.is_not_found() => Ok(Observation::Absent),
        Err(e @ ApiError::Unreachable { .. }) => Ok(Observation::Unreachable(e.to_string())),
        Err(e) => Err(e),
    }
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    run_with(client, args, POLL_INTERVAL, &mut out).await
}

pub async fn run_with(
    client: &ApiClient,
    args: &Args,
    poll: Duration,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let cond = check_condition(args.kind, args.condition.clone()).map_err(anyhow::Error::msg)?;
    let who = short_ref(args.kind, &args.name);
    let path = object_path(args.kind, &args.name);
    let deadline = tokio::time::Instant::now() + args.timeout;
    let mut shown: Option<String> = None;
    loop {
        let obs = observe(client, &path).await?;
        let verdict = judge(&cond, &obs);
        let state = match (&verdict, &obs) {
            (Verdict::Met, Observation::Absent) => "deleted".to_string(),
            _ => obs.state(),
        };
        if shown.as_ref() != Some(&state) {
            writeln!(out, "{who}: {state}")?;
            shown = Some(state);
        }
        match verdict {
            Verdict::Met => {
                if cond == WaitFor::Agent {
                    writeln!(out, "{who}: agent connected")?;
                }
                return Ok(());
            }
            Verdict::Failed(why) => bail!("{who} will not reach {cond}: {why}"),
            Verdict::Waiting => {}
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            bail!(
                "timed out after {:?} waiting for {who} ({cond}); last status: {}",
                args.timeout,
                obs.summary()
            );
        }
        tokio::time::sleep(poll.min(deadline - now)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_server::{ScriptedServer, ok};
    use hyper::StatusCode;
    use serde_json::json;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("45"), Ok(Duration::from_secs(45)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        for bad in [
            "",
            "s",
            "1x",
            "1.5m",
            "-3s",
            "m5",
            "99999999999999999999h",
            "5 m",
        ] {
            let err = parse_duration(bad).expect_err(bad);
            assert!(err.contains("invalid duration"), "{err}");
        }
    }

    #[test]
    fn conditions_parse_and_phases_are_checked_per_kind() {
        assert_eq!(parse_condition("agent"), Ok(WaitFor::Agent));
        assert_eq!(parse_condition("delete"), Ok(WaitFor::Delete));
        assert_eq!(
            parse_condition("phase=running"),
            Ok(WaitFor::Phase("running".into()))
        );
        assert!(parse_condition("phase=").is_err());
        assert!(parse_condition("ready").is_err());

        assert_eq!(
            check_condition(Kind::VirtualMachine, WaitFor::Phase("running".into())),
            Ok(WaitFor::Phase("Running".into()))
        );
        let err = check_condition(Kind::VirtualDisk, WaitFor::Phase("Running".into()))
            .expect_err("disks do not run");
        assert!(err.contains("Pending, Ready, Failed"), "{err}");
        assert!(check_condition(Kind::VirtualDisk, WaitFor::Agent).is_err());
        assert_eq!(
            check_condition(
                Kind::VirtualDiskSnapshot,
                WaitFor::Phase("inprogress".into())
            ),
            Ok(WaitFor::Phase("InProgress".into()))
        );
        assert_eq!(
            check_condition(Kind::VirtualMachineSnapshot, WaitFor::Phase("ready".into())),
            Ok(WaitFor::Phase("Ready".into()))
        );
        assert!(
            check_condition(Kind::VirtualDiskSnapshot, WaitFor::Phase("Running".into())).is_err()
        );
        assert!(check_condition(Kind::VirtualMachineSnapshot, WaitFor::Agent).is_err());
    }

    #[test]
    fn phase_lists_match_the_api_enums() {
        for p in VM_PHASES {
            serde_json::from_value::<hearth_api::VmPhase>(json!(p)).expect(p);
        }
        for p in DISK_PHASES {
            serde_json::from_value::<hearth_api::DiskPhase>(json!(p)).expect(p);
        }
        for p in SNAPSHOT_PHASES {
            serde_json::from_value::<hearth_api::SnapshotPhase>(json!(p)).expect(p);
        }
        // And every phase of the enums is listed (the Debug form is the API's).
        for p in [
            hearth_api::SnapshotPhase::Pending,
            hearth_api::SnapshotPhase::InProgress,
            hearth_api::SnapshotPhase::Ready,
            hearth_api::SnapshotPhase::Failed,
            hearth_api::SnapshotPhase::Terminating,
        ] {
            assert!(SNAPSHOT_PHASES.contains(&p.to_string().as_str()), "{p}");
        }
    }

    fn vm(status: Value) -> Observation {
        Observation::Present(
            json!({"metadata": {"name": "demo"}, "spec": {"guestAgent": true}, "status": status}),
        )
    }

    #[test]
    fn judging_each_poll() {
        let running = WaitFor::Phase("Running".into());
        assert_eq!(
            judge(&running, &vm(json!({"phase": "Running"}))),
            Verdict::Met
        );
        assert_eq!(
            judge(&running, &vm(json!({"phase": "Starting"}))),
            Verdict::Waiting
        );
        assert_eq!(judge(&running, &Observation::Absent), Verdict::Waiting);
        assert_eq!(
            judge(
                &running,
                &vm(json!({"phase": "Failed", "lastError": "kernel /k not found"}))
            ),
            Verdict::Failed("it is Failed: kernel /k not found".into())
        );
        // Waiting for Failed itself is allowed.
        let failed = WaitFor::Phase("Failed".into());
        assert_eq!(
            judge(&failed, &vm(json!({"phase": "Failed"}))),
            Verdict::Met
        );

        assert_eq!(
            judge(
                &WaitFor::Agent,
                &vm(json!({"phase": "Running", "agentConnected": true}))
            ),
            Verdict::Met
        );
        assert_eq!(
            judge(
                &WaitFor::Agent,
                &vm(json!({"phase": "Running", "agentConnected": false}))
            ),
            Verdict::Waiting
        );
        assert!(matches!(
            judge(&WaitFor::Agent, &vm(json!({"phase": "Failed"}))),
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
            judge(&WaitFor::Delete, &vm(json!({"phase": "Stopping"}))),
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
        let snap = |status: Value| Observation::Present(json!({"spec": {}, "status": status}));
        assert_eq!(
            judge(&ready, &snap(json!({"phase": "InProgress", "cutId": 2}))),
            Verdict::Waiting
        );
        assert_eq!(
            judge(&ready, &snap(json!({"phase": "Ready"}))),
            Verdict::Met
        );
        assert_eq!(
            judge(
                &ready,
                &snap(
                    json!({"phase": "Failed", "reason": "FreezeFailed", "message": "fsfreeze: EBUSY"})
                )
            ),
            Verdict::Failed("it is Failed: FreezeFailed: fsfreeze: EBUSY".into())
        );
        assert_eq!(
            judge(&ready, &snap(json!({"phase": "Terminating"}))),
            Verdict::Failed("it is being deleted".into())
        );
        assert_eq!(
            judge(&WaitFor::Delete, &snap(json!({"phase": "Terminating"}))),
            Verdict::Waiting
        );
    }

    #[tokio::test]
    async fn wait_for_a_snapshot_polls_its_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let answer = |status: Value| {
            ok(&json!({"metadata": {"name": "s"}, "spec": {}, "status": status}).to_string())
        };
        let server = ScriptedServer::start(
            dir.path(),
            vec![
                answer(json!({"phase": "Pending"})),
                answer(json!({"phase": "InProgress"})),
                answer(json!({"phase": "Ready", "consistent": true})),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let args = Args {
            kind: Kind::VirtualDiskSnapshot,
            name: "s".into(),
            condition: WaitFor::Phase("ready".into()),
            timeout: Duration::from_secs(10),
        };
        let mut out = Vec::new();
        run_with(&client, &args, Duration::from_millis(1), &mut out)
            .await
            .expect("Ready");
        assert_eq!(
            String::from_utf8_lossy(&out),
            "snapshot/s: Pending\nsnapshot/s: InProgress\nsnapshot/s: Ready\n"
        );
        assert!(
            server
                .seen()
                .iter()
                .all(|s| s.path == "/v1/virtualdisksnapshots/s")
        );
    }

    fn args(cond: WaitFor, timeout: Duration) -> Args {
        Args {
            kind: Kind::VirtualMachine,
            name: "demo".into(),
            condition: cond,
            timeout,
        }
    }

    fn vm_answer(phase: &str) -> (StatusCode, String) {
        ok(
            &json!({"metadata": {"name": "demo"}, "spec": {}, "status": {"phase": phase}})
                .to_string(),
        )
    }

    #[tokio::test]
    async fn wait_prints_each_phase_change_once_and_returns_when_running() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![
                vm_answer("Pending"),
                vm_answer("Starting"),
                vm_answer("Starting"),
                vm_answer("Running"),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let mut out = Vec::new();
        run_with(
            &client,
            &args(WaitFor::Phase("running".into()), Duration::from_secs(10)),
            Duration::from_millis(5),
            &mut out,
        )
        .await
        .expect("reaches Running");
        assert_eq!(
            String::from_utf8_lossy(&out),
            "vm/demo: Pending\nvm/demo: Starting\nvm/demo: Running\n"
        );
        let seen = server.seen();
        assert_eq!(seen.len(), 4);
        assert!(
            seen.iter()
                .all(|s| s.path == "/v1/virtualmachines/demo" && s.method == "GET")
        );
    }

    #[tokio::test]
    async fn wait_for_delete_ends_on_404() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![
                vm_answer("Stopping"),
                (StatusCode::NOT_FOUND, r#"{"error": "not found"}"#.into()),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let mut out = Vec::new();
        run_with(
            &client,
            &args(WaitFor::Delete, Duration::from_secs(10)),
            Duration::from_millis(5),
            &mut out,
        )
        .await
        .expect("deleted");
        assert_eq!(
            String::from_utf8_lossy(&out),
            "vm/demo: Stopping\nvm/demo: deleted\n"
        );
    }

    #[tokio::test]
    async fn wait_times_out_with_the_last_status() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![ok(&json!({"metadata": {"name": "demo"}, "spec": {},
                             "status": {"phase": "Starting", "agentConnected": false}})
            .to_string())],
        );
        let client = ApiClient::new(&server.socket);
        let mut out = Vec::new();
        let err = run_with(
            &client,
            &args(WaitFor::Agent, Duration::from_millis(30)),
            Duration::from_millis(5),
            &mut out,
        )
        .await
        .expect_err("times out");
        assert_eq!(
            err.to_string(),
            "timed out after 30ms waiting for vm/demo (agent); last status: phase Starting, agent not connected"
        );
    }

    #[tokio::test]
    async fn wait_fails_early_when_the_vm_failed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![ok(&json!({"metadata": {"name": "demo"}, "spec": {},
                             "status": {"phase": "Failed", "lastError": "qemu exited with status 1"}}).to_string())],
        );
        let client = ApiClient::new(&server.socket);
        let mut out = Vec::new();
        let err = run_with(
            &client,
            &args(WaitFor::Phase("Running".into()), Duration::from_secs(60)),
            Duration::from_millis(5),
            &mut out,
        )
        .await
        .expect_err("fails early");
        assert_eq!(
            err.to_string(),
            "vm/demo will not reach phase=Running: it is Failed: qemu exited with status 1"
        );
    }
}
