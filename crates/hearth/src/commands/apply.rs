//! `hearth apply -f FILE [--wait]`: send objects to hearthd; it creates or
//! updates them. With `--wait`, follow every applied object until it has
//! settled (see [`Goal::Settled`]).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use hearth_api::Kind;
use serde_json::{Value, json};

use super::wait::parse_duration;
use super::watch::{Follow, Goal, Target, watch};
use crate::client::ApiClient;
use crate::manifest;
use crate::output::str_at;
use crate::progress::{self, Reporter};

#[derive(Debug, clap::Args)]
#[command(
    about = "Create or update objects from manifest files (YAML or JSON)",
    after_help = "\
Relative paths in a manifest (spec.boot.kernel, spec.boot.initrd,
spec.source.image of a disk, spec.source.file of an image) are resolved
against the manifest file's directory, or the current directory for stdin.

An image downloaded over HTTP names the SHA-256 of the file the URL serves;
hearthd refuses to use a download that does not match. Compute it with
`sha256sum debian-12.qcow2` (the 64 hex digits before the file name) on a
copy you trust:

  apiVersion: hearth.dev/v1alpha1
  kind: VirtualImage
  metadata: {name: debian-12}
  spec:
    source:
      http:
        url: http://127.0.0.1:8080/debian-12.qcow2
        sha256: 0f3a...64 hex digits...9c1e
  ---
  apiVersion: hearth.dev/v1alpha1
  kind: VirtualDisk
  metadata: {name: web-root}
  spec: {size: 8Gi, source: {virtualImage: debian-12}}

A local file works too: `source: {file: images/debian-12.qcow2}`.

With --wait, apply then follows every object it applied until it has
settled: images and disks Ready, snapshots Ready, VMs Running (Stopped for
runPolicy AlwaysOff; either for Manual). An image import shows a progress
bar with bytes and rate on a terminal, and plain lines otherwise (pipes, CI).
A Failed disk, VM or snapshot ends the wait with its reason (exit 1); a
Failed image import is retried by hearthd, so the wait goes on, showing why,
until --timeout.

Examples:
  hearth apply -f demo.yaml
  hearth apply -f manifests/            # every *.yaml, *.yml, *.json in it
  cat demo.yaml | hearth apply -f -
  hearth apply -f web.yaml --wait --timeout 20m"
)]
pub struct Args {
    /// A manifest file, a directory of them (not recursive), or `-` for stdin.
    /// Repeat to apply several; all are sent together, all or nothing.
    #[arg(short = 'f', long = "filename", value_name = "FILE", required = true)]
    pub files: Vec<PathBuf>,
    /// After applying, wait until every applied object has settled (images
    /// and disks Ready, VMs where their run policy leads, snapshots Ready).
    #[arg(long)]
    pub wait: bool,
    /// With --wait: give up after this long (90s, 10m, 1h30m). The objects
    /// stay applied; hearthd goes on with them.
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "10m",
        value_parser = parse_duration,
        requires = "wait"
    )]
    pub timeout: Duration,
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let mut reporter = progress::for_this_process();
    let mut out = std::io::stdout();
    run_with(client, args, Follow::Stream, &mut out, reporter.as_mut()).await
}

pub async fn run_with(
    client: &ApiClient,
    args: &Args,
    follow: Follow,
    out: &mut impl Write,
    reporter: &mut dyn Reporter,
) -> anyhow::Result<()> {
    let loaded = manifest::load(&args.files)?;
    if loaded.is_empty() {
        bail!("no objects to apply: the manifests hold no documents");
    }
    // A field of another tool's manifest that hearth does not honour is
    // said here, as well as kept on the object (docs/ignite.md).
    for l in &loaded {
        for (vm, field, message) in super::convert::warnings(std::slice::from_ref(&l.object)) {
            eprintln!(
                "warning: {}: Ignite VM {vm:?}: {field}: {message}",
                l.origin
            );
        }
    }
    let items = loaded
        .into_iter()
        .map(|mut l| {
            l.object.strip_server_fields();
            serde_json::to_value(&l.object)
                .with_context(|| format!("{}: encoding {}", l.origin, l.object.display_name()))
        })
        .collect::<anyhow::Result<Vec<Value>>>()?;
    let answer = client
        .post("/v1/apply", Some(&json!({ "items": items })))
        .await?;
    out.write_all(render_results(&answer)?.as_bytes())?;
    out.flush()?;
    if !args.wait {
        return Ok(());
    }
    let targets = settle_targets(&answer)?;
    watch(client, targets, args.timeout, follow, reporter).await
}

/// What `--wait` follows: every object of the answer, in its order.
pub fn settle_targets(answer: &Value) -> anyhow::Result<Vec<Target>> {
    let Some(results) = answer.get("results").and_then(Value::as_array) else {
        bail!("hearthd's apply answer has no \"results\" list: {answer}");
    };
    results
        .iter()
        .map(|r| {
            let kind_text = str_at(r, &["kind"]).unwrap_or("");
            let kind = Kind::from_user(kind_text).with_context(|| {
                format!("hearthd's apply answer has a result of unknown kind {kind_text:?}: {r}")
            })?;
            let name = str_at(r, &["name"]).with_context(|| {
                format!("hearthd's apply answer has a result without a name: {r}")
            })?;
            // It goes into a request path.
            hearth_api::check_dns_label(name).map_err(|why| {
                anyhow::anyhow!("hearthd's apply answer names an object {name:?}: {why}")
            })?;
            Ok(Target {
                kind,
                name: name.to_string(),
                goal: Goal::Settled {
                    configured: str_at(r, &["action"]) == Some("configured"),
                },
            })
        })
        .collect()
}

/// `virtualmachine/demo created`, one line per result, in the server's order.
pub fn render_results(answer: &Value) -> anyhow::Result<String> {
    let Some(results) = answer.get("results").and_then(Value::as_array) else {
        bail!("hearthd's apply answer has no \"results\" list: {answer}");
    };
    let mut text = String::new();
    for r in results {
        let kind = str_at(r, &["kind"]).unwrap_or("?");
        let name = str_at(r, &["name"]).unwrap_or("?");
        let action = str_at(r, &["action"]).unwrap_or("?");
        text.push_str(&format!("{} {action}\n", super::resource_ref(kind, name)));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::progress::Lines;
    use crate::test_server::{ScriptedServer, ok};
    use hyper::StatusCode;

    const MIB: u64 = 1 << 20;
    const IMAGE: &str = "/v1/virtualimages/debian-12";
    const DISK: &str = "/v1/virtualdisks/web-root";
    const VM: &str = "/v1/virtualmachines/web";

    fn manifest(dir: &std::path::Path) -> PathBuf {
        let path = dir.join("web.yaml");
        let sha = "ab".repeat(32);
        std::fs::write(
            &path,
            format!(
                "\
apiVersion: hearth.dev/v1alpha1
kind: VirtualImage
metadata: {{name: debian-12}}
spec:
  source:
    http: {{url: \"http://127.0.0.1:8080/debian-12.qcow2\", sha256: \"{sha}\"}}
---
apiVersion: hearth.dev/v1alpha1
kind: VirtualDisk
metadata: {{name: web-root}}
spec: {{size: 8Gi, source: {{virtualImage: debian-12}}}}
---
apiVersion: hearth.dev/v1alpha1
kind: VirtualMachine
metadata: {{name: web}}
spec:
  runPolicy: AlwaysOn
  disks: [{{virtualDiskName: web-root}}]
"
            ),
        )
        .expect("write manifest");
        path
    }

    fn applied(actions: [&str; 3]) -> (StatusCode, String) {
        ok(&json!({"results": [
            {"kind": "VirtualImage", "name": "debian-12", "action": actions[0]},
            {"kind": "VirtualDisk", "name": "web-root", "action": actions[1]},
            {"kind": "VirtualMachine", "name": "web", "action": actions[2]},
        ]})
        .to_string())
    }

    fn object(kind: &str, name: &str, generation: u64, status: Value) -> (StatusCode, String) {
        ok(
            &json!({"kind": kind, "metadata": {"name": name, "generation": generation},
                   "spec": {"runPolicy": "AlwaysOn"}, "status": status})
            .to_string(),
        )
    }

    fn image(status: Value) -> (StatusCode, String) {
        object("VirtualImage", "debian-12", 1, status)
    }

    fn disk(phase: &str) -> (StatusCode, String) {
        object("VirtualDisk", "web-root", 1, json!({"phase": phase}))
    }

    fn vm(status: Value) -> (StatusCode, String) {
        object("VirtualMachine", "web", 1, status)
    }

    fn args(dir: &std::path::Path, wait: bool, timeout: Duration) -> Args {
        Args {
            files: vec![manifest(dir)],
            wait,
            timeout,
        }
    }

    /// Applies with plain progress lines (stdout not a terminal); returns
    /// the result and everything printed, results first.
    async fn apply(server: &ScriptedServer, args: &Args) -> (anyhow::Result<()>, String) {
        let client = ApiClient::new(&server.socket);
        let mut out = Vec::new();
        let mut lines = Lines::new(Vec::new());
        let result = run_with(
            &client,
            args,
            Follow::Poll(Duration::from_millis(1)),
            &mut out,
            &mut lines,
        )
        .await;
        out.extend(lines.into_inner());
        (result, String::from_utf8(out).expect("utf-8"))
    }

    #[test]
    fn results_print_kubectl_style() {
        let answer = json!({"results": [
            {"kind": "VirtualDisk", "name": "data", "action": "unchanged"},
            {"kind": "VirtualMachine", "name": "demo", "action": "created"},
        ]});
        assert_eq!(
            render_results(&answer).expect("renders"),
            "virtualdisk/data unchanged\nvirtualmachine/demo created\n"
        );
        assert!(render_results(&json!({"oops": 1})).is_err());
    }

    #[test]
    fn every_applied_object_is_waited_for_and_odd_answers_are_refused() {
        let answer = json!({"results": [
            {"kind": "VirtualImage", "name": "debian-12", "action": "created"},
            {"kind": "VirtualMachine", "name": "web", "action": "configured"},
        ]});
        let targets = settle_targets(&answer).expect("targets");
        assert_eq!(
            targets
                .iter()
                .map(|t| (t.kind, t.name.as_str(), t.goal.clone()))
                .collect::<Vec<_>>(),
            [
                (
                    Kind::VirtualImage,
                    "debian-12",
                    Goal::Settled { configured: false }
                ),
                (
                    Kind::VirtualMachine,
                    "web",
                    Goal::Settled { configured: true }
                ),
            ]
        );
        for bad in [
            json!({"results": [{"kind": "Pod", "name": "x", "action": "created"}]}),
            json!({"results": [{"kind": "VirtualDisk", "name": "../../x", "action": "created"}]}),
            json!({"results": [{"kind": "VirtualDisk", "action": "created"}]}),
        ] {
            assert!(settle_targets(&bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn without_wait_nothing_is_polled() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::routes(
            dir.path(),
            vec![("POST", "/v1/apply", vec![applied(["created"; 3])])],
        );
        let (result, out) = apply(&server, &args(dir.path(), false, Duration::ZERO)).await;
        result.expect("applied");
        assert_eq!(
            out,
            "virtualimage/debian-12 created\nvirtualdisk/web-root created\nvirtualmachine/web created\n"
        );
        assert_eq!(server.seen().len(), 1);
    }

    #[tokio::test]
    async fn apply_wait_follows_the_import_then_the_disk_then_the_vm() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::routes(
            dir.path(),
            vec![
                ("POST", "/v1/apply", vec![applied(["created"; 3])]),
                (
                    "GET",
                    IMAGE,
                    vec![
                        image(json!({"phase": "Pending"})),
                        image(
                            json!({"phase": "Importing", "progress": "10%", "bytesDone": 10 * MIB,
                                     "bytesTotal": 100 * MIB, "bytesPerSecond": 4 * MIB}),
                        ),
                        image(
                            json!({"phase": "Importing", "progress": "60%", "bytesDone": 60 * MIB,
                                     "bytesTotal": 100 * MIB, "bytesPerSecond": 8 * MIB}),
                        ),
                        image(
                            json!({"phase": "Ready", "progress": "100%", "format": "qcow2",
                                     "size": 100 * MIB, "virtualSize": 2048 * MIB}),
                        ),
                    ],
                ),
                (
                    "GET",
                    DISK,
                    vec![
                        disk("Pending"),
                        disk("Pending"),
                        disk("Pending"),
                        disk("Pending"),
                        disk("Ready"),
                    ],
                ),
                (
                    "GET",
                    VM,
                    vec![
                        // Not yet reconciled: no status at all.
                        object("VirtualMachine", "web", 1, Value::Null),
                        vm(json!({"phase": "Pending"})),
                        vm(json!({"phase": "Pending"})),
                        vm(json!({"phase": "Pending"})),
                        vm(json!({"phase": "Pending"})),
                        vm(json!({"phase": "Starting"})),
                        vm(json!({"phase": "Running", "observedGeneration": 1})),
                    ],
                ),
            ],
        );
        let (result, out) = apply(&server, &args(dir.path(), true, Duration::from_secs(10))).await;
        result.expect("settled");
        assert_eq!(
            out,
            "\
virtualimage/debian-12 created
virtualdisk/web-root created
virtualmachine/web created
image/debian-12: Pending
disk/web-root: Pending
vm/web: no status yet
image/debian-12: Importing 10% (10.0Mi of 100.0Mi, 4.0Mi/s)
vm/web: Pending
image/debian-12: Importing 60% (60.0Mi of 100.0Mi, 8.0Mi/s)
image/debian-12: Ready (qcow2, 100.0Mi, virtual size 2.0Gi)
disk/web-root: Ready
vm/web: Starting
vm/web: Running
"
        );
        // Settled objects are not read again.
        let reads = |path: &str| server.seen().iter().filter(|s| s.path == path).count();
        assert_eq!((reads(IMAGE), reads(DISK), reads(VM)), (4, 5, 7));
    }

    #[tokio::test]
    async fn apply_wait_follows_all_its_objects_on_one_stream() {
        let dir = tempfile::tempdir().expect("tempdir");
        let line = |seq: u64, type_: &str, kind: &str, name: &str, status: Value| {
            json!({"seq": seq, "type": type_, "kind": kind, "name": name,
                   "object": {"kind": kind, "metadata": {"name": name, "generation": 1},
                              "spec": {"runPolicy": "AlwaysOn"}, "status": status}})
        };
        let lines = [
            line(
                7,
                "ADDED",
                "VirtualImage",
                "debian-12",
                json!({"phase": "Pending"}),
            ),
            line(
                7,
                "ADDED",
                "VirtualDisk",
                "web-root",
                json!({"phase": "Pending"}),
            ),
            line(
                7,
                "ADDED",
                "VirtualMachine",
                "web",
                json!({"phase": "Pending"}),
            ),
            // Another object of a watched kind: not ours, not shown.
            line(
                7,
                "ADDED",
                "VirtualDisk",
                "other",
                json!({"phase": "Failed"}),
            ),
            json!({"seq": 7, "type": "BOOKMARK"}),
            line(
                8,
                "MODIFIED",
                "VirtualImage",
                "debian-12",
                json!({"phase": "Ready"}),
            ),
            line(
                9,
                "MODIFIED",
                "VirtualDisk",
                "web-root",
                json!({"phase": "Ready"}),
            ),
            line(
                10,
                "MODIFIED",
                "VirtualMachine",
                "web",
                json!({"phase": "Running", "observedGeneration": 1}),
            ),
        ];
        let server = ScriptedServer::routes(
            dir.path(),
            vec![
                ("POST", "/v1/apply", vec![applied(["created"; 3])]),
                (
                    "GET",
                    "/v1/watch?kinds=virtualimages,virtualdisks,virtualmachines",
                    vec![ok(&lines
                        .iter()
                        .map(|l| format!("{l}\n"))
                        .collect::<String>())],
                ),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let mut out = Vec::new();
        let mut progress = Lines::new(Vec::new());
        run_with(
            &client,
            &args(dir.path(), true, Duration::from_secs(10)),
            Follow::Stream,
            &mut out,
            &mut progress,
        )
        .await
        .expect("settled");
        assert_eq!(
            String::from_utf8(progress.into_inner()).expect("utf-8"),
            "\
image/debian-12: Pending
disk/web-root: Pending
vm/web: Pending
image/debian-12: Ready
disk/web-root: Ready
vm/web: Running
"
        );
        assert_eq!(server.seen().len(), 2, "the apply and one stream");
    }

    #[tokio::test]
    async fn a_failed_import_is_retried_while_the_wait_shows_why() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::routes(
            dir.path(),
            vec![
                ("POST", "/v1/apply", vec![applied(["created"; 3])]),
                (
                    "GET",
                    IMAGE,
                    vec![
                        image(
                            json!({"phase": "Failed", "attempts": 1, "reason": "ChecksumMismatch",
                                     "message": "the download's sha256 is 00ff..., the spec says abab..."}),
                        ),
                        image(json!({"phase": "Importing", "attempts": 2, "bytesDone": 0,
                                     "bytesTotal": 100 * MIB})),
                        image(json!({"phase": "Ready", "attempts": 2})),
                    ],
                ),
                (
                    "GET",
                    DISK,
                    vec![disk("Pending"), disk("Pending"), disk("Ready")],
                ),
                (
                    "GET",
                    VM,
                    vec![
                        vm(json!({"phase": "Pending"})),
                        vm(json!({"phase": "Pending"})),
                        vm(json!({"phase": "Running", "observedGeneration": 1})),
                    ],
                ),
            ],
        );
        let (result, out) = apply(&server, &args(dir.path(), true, Duration::from_secs(10))).await;
        result.expect("settled after the retry");
        assert!(
            out.contains(
                "image/debian-12: Failed (attempt 1): ChecksumMismatch: the download's sha256 is 00ff..., \
                 the spec says abab...; still waiting (hearthd retries the import)\n\
                 disk/web-root: Pending\n\
                 vm/web: Pending\n\
                 image/debian-12: Importing 0% (0B of 100.0Mi)\n\
                 image/debian-12: Ready\n"
            ),
            "{out}"
        );
    }

    #[tokio::test]
    async fn a_failed_disk_ends_the_wait_naming_it_and_its_reason() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::routes(
            dir.path(),
            vec![
                (
                    "POST",
                    "/v1/apply",
                    vec![applied(["unchanged", "created", "created"])],
                ),
                ("GET", IMAGE, vec![image(json!({"phase": "Ready"}))]),
                (
                    "GET",
                    DISK,
                    vec![
                        disk("Pending"),
                        object(
                            "VirtualDisk",
                            "web-root",
                            1,
                            json!({"phase": "Failed",
                            "lastError": "spec.size: 8Gi is smaller than VirtualImage \"debian-12\"'s virtual size 10.0Gi"}),
                        ),
                    ],
                ),
                ("GET", VM, vec![vm(json!({"phase": "Pending"}))]),
            ],
        );
        let (result, out) = apply(&server, &args(dir.path(), true, Duration::from_secs(10))).await;
        let err = result.expect_err("the disk failed");
        assert_eq!(
            err.to_string(),
            "disk/web-root will not be Ready: it is Failed: spec.size: 8Gi is smaller than \
             VirtualImage \"debian-12\"'s virtual size 10.0Gi"
        );
        assert!(out.ends_with("disk/web-root: Failed\n"), "{out}");
    }

    #[tokio::test]
    async fn a_timeout_names_every_object_still_waited_for_and_its_last_failure() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::routes(
            dir.path(),
            vec![
                (
                    "POST",
                    "/v1/apply",
                    vec![applied(["created", "created", "configured"])],
                ),
                (
                    "GET",
                    IMAGE,
                    vec![image(
                        json!({"phase": "Failed", "attempts": 5, "reason": "HttpError",
                                      "message": "connection refused"}),
                    )],
                ),
                ("GET", DISK, vec![disk("Pending")]),
                (
                    "GET",
                    VM,
                    // The failure is the previous spec's: not this apply's.
                    vec![object(
                        "VirtualMachine",
                        "web",
                        2,
                        json!({"phase": "Failed",
                        "observedGeneration": 1, "lastError": "kernel /old/vmlinuz not found"}),
                    )],
                ),
            ],
        );
        let (result, out) =
            apply(&server, &args(dir.path(), true, Duration::from_millis(50))).await;
        let err = result.expect_err("times out");
        assert_eq!(
            err.to_string(),
            "timed out after 50ms waiting for 3 of 3 objects: \
             image/debian-12 (Ready; last status: phase Failed, attempt 5, HttpError: connection refused); \
             disk/web-root (Ready; last status: phase Pending); \
             vm/web (Running; last status: phase Failed, last error: kernel /old/vmlinuz not found)"
        );
        assert!(out.contains("vm/web: Failed; still waiting\n"), "{out}");
    }
}
