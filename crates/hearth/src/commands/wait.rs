//! `hearth wait KIND NAME --for CONDITION`: follow an object until a condition holds.

use std::fmt;
use std::time::Duration;

use hearth_api::Kind;

pub use super::watch::reason_and_message;
use super::watch::{Follow, Goal, Target, watch};
use crate::client::ApiClient;
use crate::progress::{self, Reporter};

/// Phases as hearth-api spells them (a test keeps these in step with the enums).
pub const VM_PHASES: [&str; 6] = [
    "Pending", "Starting", "Running", "Stopping", "Stopped", "Failed",
];
pub const DISK_PHASES: [&str; 3] = ["Pending", "Ready", "Failed"];
pub const IMAGE_PHASES: [&str; 4] = ["Pending", "Importing", "Ready", "Failed"];
pub const NETWORK_PHASES: [&str; 3] = ["Pending", "Ready", "Failed"];
/// Both snapshot kinds.
pub const SNAPSHOT_PHASES: [&str; 5] = ["Pending", "InProgress", "Ready", "Failed", "Terminating"];

#[derive(Debug, clap::Args)]
#[command(
    about = "Wait until an object reaches a phase, its guest agent connects, or it is gone",
    after_help = "\
CONDITION is one of:
  phase=PHASE   status.phase equals PHASE, any case; PHASE alone works too
                (VM: Pending, Starting, Running, Stopping, Stopped, Failed;
                disk: Pending, Ready, Failed; image: Pending, Importing,
                Ready, Failed; snapshot and vmsnapshot: Pending, InProgress,
                Ready, Failed, Terminating)
  agent         the VM's guest agent is connected (status.agentConnected)
  delete        the object no longer exists

Waiting for a phase other than Failed, or for the agent, stops early when the
object fails (with the VM's last error, or the snapshot's reason and message)
or, for a snapshot, when it is being deleted. An image is different: hearthd
retries a failed import, so the wait goes on, its line showing why the last
attempt failed, until the image is Ready or --timeout names that reason.
While an image imports, a terminal shows a progress bar (bytes, percent,
rate); elsewhere a line is printed at each tenth of the way. Exit status: 0
when the condition holds, 1 on failure or timeout.

Examples:
  hearth wait vm demo --for phase=Running
  hearth wait vm demo --for agent --timeout 5m
  hearth wait image debian-12 --for ready --timeout 15m
  hearth wait disk data --for delete --timeout 30s
  hearth wait snapshot data-20250101-120000 --for phase=Ready"
)]
pub struct Args {
    #[arg(value_name = "KIND", value_parser = super::parse_kind, help = super::KIND_HELP)]
    pub kind: Kind,
    /// The object's name.
    #[arg(value_name = "NAME", value_parser = super::parse_name)]
    pub name: String,
    /// phase=PHASE (or just PHASE: ready, running...), agent or delete.
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

/// `phase=PHASE`, a bare `PHASE` (`--for ready`), `agent` or `delete`.
pub fn parse_condition(s: &str) -> Result<WaitFor, String> {
    let bad = || format!("unknown condition {s:?} (use phase=PHASE or PHASE, agent or delete)");
    match s {
        "agent" => Ok(WaitFor::Agent),
        "delete" => Ok(WaitFor::Delete),
        _ => {
            let phase = s.strip_prefix("phase=").unwrap_or(s);
            if phase.is_empty() || !phase.chars().all(|c| c.is_ascii_alphabetic()) {
                return Err(bad());
            }
            Ok(WaitFor::Phase(phase.to_string()))
        }
    }
}

/// Checks the condition against the kind and spells the phase the way the
/// API does (`running` becomes `Running`).
pub fn check_condition(kind: Kind, cond: WaitFor) -> Result<WaitFor, String> {
    let phases: &[&str] = match kind {
        Kind::VirtualMachine => &VM_PHASES,
        Kind::VirtualDisk => &DISK_PHASES,
        Kind::VirtualImage => &IMAGE_PHASES,
        Kind::VirtualNetwork => &NETWORK_PHASES,
        Kind::VirtualDiskSnapshot
        | Kind::VirtualMachineSnapshot
        | Kind::VirtualMachineSnapshotGroup => &SNAPSHOT_PHASES,
        Kind::VirtualMachineSnapshotSchedule => &[],
        Kind::VirtualMachineBackup => &["Pending", "InProgress", "Ready", "Failed"],
    };
    if phases.is_empty() && matches!(cond, WaitFor::Phase(_)) {
        return Err(format!(
            "{kind} has no phase to wait for (its status says the last run and the next); --for delete works"
        ));
    }
    match cond {
        WaitFor::Phase(p) => phases
            .iter()
            .find(|known| known.eq_ignore_ascii_case(&p))
            .map(|known| WaitFor::Phase(known.to_string()))
            .ok_or_else(|| {
                let others = if kind == Kind::VirtualMachine {
                    "agent or delete"
                } else {
                    "delete"
                };
                format!(
                    "{kind} has no phase {p:?} (phases: {}; other conditions: {others})",
                    phases.join(", ")
                )
            }),
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

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let mut reporter = progress::for_this_process();
    run_with(client, args, Follow::Stream, reporter.as_mut()).await
}

pub async fn run_with(
    client: &ApiClient,
    args: &Args,
    follow: Follow,
    reporter: &mut dyn Reporter,
) -> anyhow::Result<()> {
    let cond = check_condition(args.kind, args.condition.clone()).map_err(anyhow::Error::msg)?;
    let target = Target {
        kind: args.kind,
        name: args.name.clone(),
        goal: Goal::Condition(cond),
    };
    watch(client, vec![target], args.timeout, follow, reporter).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::progress::Lines;
    use crate::test_server::{ScriptedServer, ok};
    use hyper::StatusCode;
    use serde_json::{Value, json};

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
        assert!(parse_condition("phase=Ready,x").is_err());
        assert!(parse_condition("").is_err());
        // A bare phase is the same as phase=PHASE: `--for ready`.
        assert_eq!(parse_condition("ready"), Ok(WaitFor::Phase("ready".into())));
        assert_eq!(
            check_condition(
                Kind::VirtualImage,
                parse_condition("ready").expect("parses")
            ),
            Ok(WaitFor::Phase("Ready".into()))
        );
        let err = check_condition(Kind::VirtualImage, WaitFor::Phase("Running".into()))
            .expect_err("images do not run");
        assert_eq!(
            err,
            "VirtualImage has no phase \"Running\" (phases: Pending, Importing, Ready, Failed; \
             other conditions: delete)"
        );

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
        for p in IMAGE_PHASES {
            serde_json::from_value::<hearth_api::ImagePhase>(json!(p)).expect(p);
        }
        for p in NETWORK_PHASES {
            serde_json::from_value::<hearth_api::NetworkPhase>(json!(p)).expect(p);
        }
        for p in [
            hearth_api::ImagePhase::Pending,
            hearth_api::ImagePhase::Importing,
            hearth_api::ImagePhase::Ready,
            hearth_api::ImagePhase::Failed,
        ] {
            assert!(IMAGE_PHASES.contains(&p.to_string().as_str()), "{p}");
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
        let (result, out) = waited(&client, &args, Duration::from_millis(1)).await;
        result.expect("Ready");
        assert_eq!(
            out,
            "snapshot/s: Pending\nsnapshot/s: InProgress\nsnapshot/s: Ready\n"
        );
        assert!(
            server
                .seen()
                .iter()
                .all(|s| s.path == "/v1/virtualdisksnapshots/s")
        );
    }

    /// A stream body: one JSON line each.
    fn ndjson(lines: &[Value]) -> String {
        lines.iter().map(|l| format!("{l}\n")).collect()
    }

    fn vm_line(seq: u64, type_: &str, phase: &str) -> Value {
        json!({"seq": seq, "type": type_, "kind": "VirtualMachine", "name": "demo",
               "object": {"metadata": {"name": "demo"}, "spec": {}, "status": {"phase": phase}}})
    }

    async fn streamed(client: &ApiClient, args: &Args) -> (anyhow::Result<()>, String) {
        let mut lines = Lines::new(Vec::new());
        let result = run_with(client, args, Follow::Stream, &mut lines).await;
        (
            result,
            String::from_utf8(lines.into_inner()).expect("utf-8"),
        )
    }

    #[tokio::test]
    async fn wait_follows_the_stream_and_never_polls() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::routes(
            dir.path(),
            vec![(
                "GET",
                "/v1/watch?kinds=virtualmachines&name=demo",
                vec![ok(&ndjson(&[
                    vm_line(4, "ADDED", "Pending"),
                    json!({"seq": 4, "type": "BOOKMARK"}),
                    vm_line(5, "MODIFIED", "Starting"),
                    json!({"seq": 6, "type": "EVENT", "kind": "VirtualMachine", "name": "demo",
                           "event": {"reason": "Started"}}),
                    vm_line(7, "MODIFIED", "Running"),
                ]))],
            )],
        );
        let client = ApiClient::new(&server.socket);
        let (result, out) = streamed(
            &client,
            &args(WaitFor::Phase("running".into()), Duration::from_secs(10)),
        )
        .await;
        result.expect("Running");
        assert_eq!(
            out,
            "vm/demo: Pending\nvm/demo: Starting\nvm/demo: Running\n"
        );
        assert_eq!(server.seen().len(), 1, "one stream, no polls");
    }

    #[tokio::test]
    async fn a_dropped_stream_is_resumed_from_its_last_seq() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::routes(
            dir.path(),
            vec![
                (
                    "GET",
                    "/v1/watch?kinds=virtualmachines&name=demo",
                    // The object does not exist yet; then hearthd goes away.
                    vec![ok(&ndjson(&[
                        json!({"seq": 9, "type": "BOOKMARK"}),
                        vm_line(10, "ADDED", "Pending"),
                    ]))],
                ),
                (
                    "GET",
                    "/v1/watch?kinds=virtualmachines&name=demo&since=10",
                    vec![
                        // Still restarting: tried again.
                        (StatusCode::SERVICE_UNAVAILABLE, "starting".into()),
                        ok(&ndjson(&[
                            vm_line(11, "MODIFIED", "Stopping"),
                            vm_line(12, "MODIFIED", "Stopped"),
                        ])),
                    ],
                ),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let (result, out) = streamed(
            &client,
            &args(WaitFor::Phase("Stopped".into()), Duration::from_secs(10)),
        )
        .await;
        result.expect("Stopped");
        assert_eq!(
            out,
            "\
vm/demo: not found
vm/demo: Pending
vm/demo: hearthd unreachable, retrying
vm/demo: Stopping
vm/demo: Stopped
"
        );
        let paths: Vec<String> = server.seen().into_iter().map(|s| s.path).collect();
        assert_eq!(
            paths,
            [
                "/v1/watch?kinds=virtualmachines&name=demo",
                "/v1/watch?kinds=virtualmachines&name=demo&since=10",
                "/v1/watch?kinds=virtualmachines&name=demo&since=10"
            ]
        );
    }

    #[tokio::test]
    async fn a_stream_wait_times_out_with_the_last_status() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::routes(
            dir.path(),
            vec![
                (
                    "GET",
                    "/v1/watch?kinds=virtualmachines&name=demo",
                    vec![ok(&ndjson(&[
                        vm_line(2, "ADDED", "Starting"),
                        json!({"seq": 2, "type": "BOOKMARK"}),
                    ]))],
                ),
                // hearthd does not come back in time.
                (
                    "GET",
                    "/v1/watch?kinds=virtualmachines&name=demo&since=2",
                    vec![(StatusCode::SERVICE_UNAVAILABLE, "down".into())],
                ),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let (result, out) = streamed(
            &client,
            &args(WaitFor::Phase("Running".into()), Duration::from_millis(400)),
        )
        .await;
        let err = result.expect_err("times out").to_string();
        assert_eq!(
            err,
            "timed out after 400ms waiting for vm/demo (phase=Running); last status: hearthd ended the stream"
        );
        assert!(out.starts_with("vm/demo: Starting\n"), "{out}");
    }

    /// Runs the wait with plain lines, as when stdout is not a terminal.
    async fn waited(
        client: &ApiClient,
        args: &Args,
        poll: Duration,
    ) -> (anyhow::Result<()>, String) {
        let mut lines = Lines::new(Vec::new());
        let result = run_with(client, args, Follow::Poll(poll), &mut lines).await;
        let out = String::from_utf8(lines.into_inner()).expect("utf-8");
        (result, out)
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
        let (result, out) = waited(
            &client,
            &args(WaitFor::Phase("running".into()), Duration::from_secs(10)),
            Duration::from_millis(5),
        )
        .await;
        result.expect("reaches Running");
        assert_eq!(
            out,
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
        let (result, out) = waited(
            &client,
            &args(WaitFor::Delete, Duration::from_secs(10)),
            Duration::from_millis(5),
        )
        .await;
        result.expect("deleted");
        assert_eq!(out, "vm/demo: Stopping\nvm/demo: deleted\n");
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
        let (result, _out) = waited(
            &client,
            &args(WaitFor::Agent, Duration::from_millis(30)),
            Duration::from_millis(5),
        )
        .await;
        let err = result.expect_err("times out");
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
        let (result, _out) = waited(
            &client,
            &args(WaitFor::Phase("Running".into()), Duration::from_secs(60)),
            Duration::from_millis(5),
        )
        .await;
        let err = result.expect_err("fails early");
        assert_eq!(
            err.to_string(),
            "vm/demo will not reach phase=Running: it is Failed: qemu exited with status 1"
        );
    }

    fn image_args(cond: &str, timeout: Duration) -> Args {
        Args {
            kind: Kind::VirtualImage,
            name: "debian-12".into(),
            condition: check_condition(
                Kind::VirtualImage,
                parse_condition(cond).expect("condition"),
            )
            .expect("an image condition"),
            timeout,
        }
    }

    fn image_answer(status: Value) -> (StatusCode, String) {
        ok(
            &json!({"kind": "VirtualImage", "metadata": {"name": "debian-12"},
                   "spec": {"source": {"http": {"url": "http://127.0.0.1:8080/d.qcow2",
                                                "sha256": "ab".repeat(32)}}},
                   "status": status})
            .to_string(),
        )
    }

    const MIB: u64 = 1 << 20;

    #[tokio::test]
    async fn waiting_for_an_image_shows_its_import_and_ends_when_ready() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![
                image_answer(json!({"phase": "Pending"})),
                image_answer(
                    json!({"phase": "Importing", "progress": "10%", "bytesDone": 10 * MIB,
                                    "bytesTotal": 100 * MIB, "bytesPerSecond": 5 * MIB}),
                ),
                image_answer(
                    json!({"phase": "Importing", "progress": "60%", "bytesDone": 60 * MIB,
                                    "bytesTotal": 100 * MIB, "bytesPerSecond": 25 * MIB}),
                ),
                image_answer(
                    json!({"phase": "Ready", "progress": "100%", "format": "qcow2",
                                    "size": 100 * MIB, "virtualSize": 2048 * MIB,
                                    "digest": format!("sha256:{}", "ab".repeat(32))}),
                ),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let (result, out) = waited(
            &client,
            &image_args("phase=ready", Duration::from_secs(10)),
            Duration::from_millis(1),
        )
        .await;
        result.expect("Ready");
        assert_eq!(
            out,
            "\
image/debian-12: Pending
image/debian-12: Importing 10% (10.0Mi of 100.0Mi, 5.0Mi/s)
image/debian-12: Importing 60% (60.0Mi of 100.0Mi, 25.0Mi/s)
image/debian-12: Ready (qcow2, 100.0Mi, virtual size 2.0Gi)
"
        );
        assert!(
            server
                .seen()
                .iter()
                .all(|s| s.method == "GET" && s.path == "/v1/virtualimages/debian-12")
        );
    }

    #[tokio::test]
    async fn a_failed_import_keeps_the_wait_going_and_shows_why() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![
                image_answer(json!({"phase": "Importing", "bytesDone": 0, "attempts": 1})),
                image_answer(
                    json!({"phase": "Failed", "attempts": 1, "reason": "HttpError",
                                    "message": "GET http://127.0.0.1:8080/d.qcow2: 503 Service Unavailable"}),
                ),
                image_answer(json!({"phase": "Importing", "bytesDone": 50 * MIB,
                                    "bytesTotal": 100 * MIB, "attempts": 2})),
                image_answer(json!({"phase": "Ready", "format": "raw", "attempts": 2})),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let (result, out) = waited(
            &client,
            &image_args("phase=Ready", Duration::from_secs(10)),
            Duration::from_millis(1),
        )
        .await;
        result.expect("Ready after a retry");
        assert_eq!(
            out,
            "\
image/debian-12: Importing 0B
image/debian-12: Failed (attempt 1): HttpError: GET http://127.0.0.1:8080/d.qcow2: 503 Service Unavailable; still waiting (hearthd retries the import)
image/debian-12: Importing 50% (50.0Mi of 100.0Mi)
image/debian-12: Ready (raw)
"
        );
    }

    #[tokio::test]
    async fn waiting_for_an_image_to_fail_ends_at_the_failure() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![image_answer(
                json!({"phase": "Failed", "reason": "ChecksumMismatch", "message": "got sha256:00"}),
            )],
        );
        let client = ApiClient::new(&server.socket);
        let (result, out) = waited(
            &client,
            &image_args("phase=failed", Duration::from_secs(10)),
            Duration::from_millis(1),
        )
        .await;
        result.expect("Failed is what was waited for");
        assert_eq!(
            out,
            "image/debian-12: Failed: ChecksumMismatch: got sha256:00\n"
        );
    }

    #[tokio::test]
    async fn an_image_wait_times_out_naming_the_last_failure() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![
                image_answer(
                    json!({"phase": "Failed", "attempts": 3, "reason": "HttpError",
                                    "message": "connection refused"}),
                ),
                // The retry clears the reason from the status; the timeout still names it.
                image_answer(json!({"phase": "Importing", "bytesDone": 0, "attempts": 4})),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let (result, out) = waited(
            &client,
            &image_args("phase=Ready", Duration::from_millis(60)),
            Duration::from_millis(5),
        )
        .await;
        let err = result.expect_err("times out");
        assert_eq!(
            err.to_string(),
            "timed out after 60ms waiting for image/debian-12 (phase=Ready); last status: \
             phase Importing, 0B, attempt 4, last failure: HttpError: connection refused"
        );
        assert!(
            out.starts_with("image/debian-12: Failed (attempt 3): HttpError: connection refused"),
            "{out}"
        );
    }

    #[tokio::test]
    async fn waiting_for_a_failed_image_to_go_says_no_more_than_its_state() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![
                image_answer(json!({"phase": "Failed", "reason": "HttpError"})),
                (StatusCode::NOT_FOUND, r#"{"error": "not found"}"#.into()),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let (result, out) = waited(
            &client,
            &image_args("delete", Duration::from_secs(10)),
            Duration::from_millis(1),
        )
        .await;
        result.expect("gone");
        assert_eq!(
            out,
            "image/debian-12: Failed: HttpError\nimage/debian-12: deleted\n"
        );
    }
}
