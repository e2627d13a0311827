//! `hearth snapshot disk|vm|group NAME`: take a snapshot now, optionally
//! waiting until hearthd reports it Ready or Failed.
//!
//! A snapshot is an ordinary object: this command builds one
//! VirtualDiskSnapshot, VirtualMachineSnapshot or VirtualMachineSnapshotGroup
//! and sends it through
//! `POST /v1/apply?create=true`: what `hearth apply` of the same manifest
//! does, except that an existing object is refused instead of updated.

use std::io::Write;
use std::time::Duration;

use anyhow::bail;
use chrono::{DateTime, Utc};
use hearth_api::{API_VERSION, Kind, object_from_value};
use serde_json::{Value, json};

use super::wait::{parse_duration, reason_and_message};
use super::{object_path, short_ref};
use crate::client::{ApiClient, ApiError};
use crate::follow::{Follower, Update};
use crate::output::{at, human_bytes, str_at, u64_at};
use hearth_api::WatchType;

/// How often the snapshot is read while hearthd is out of reach.
const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// `-20250101-120000`: what a default name adds after the source's name.
const STAMP_LEN: usize = 16;

/// The longest object name (a DNS label).
const MAX_NAME: usize = 63;

#[derive(Debug, clap::Args)]
#[command(
    about = "Take a snapshot of a disk, of all disks of a VM, or of several VMs at one moment",
    after_help = "\
A snapshot of a running VM is application-consistent when the guest agent
freezes the guest's filesystems around the cut; a stopped VM needs no freeze.
By default a snapshot that cannot be consistent fails; with
--no-require-consistency it is taken anyway and marked consistent: false.

Examples:
  hearth snapshot disk data --wait
  hearth snapshot vm demo --name before-upgrade --wait --timeout 5m
  hearth get snapshots"
)]
pub struct Args {
    #[command(subcommand)]
    pub target: Target,
}

#[derive(Debug, clap::Subcommand)]
pub enum Target {
    /// Snapshot one disk (a VirtualDiskSnapshot)
    #[command(after_help = "\
The snapshot is named DISK-YYYYMMDD-HHMMSS (UTC) unless --name is given. To
read it back, create a new disk from it (instant, whatever the disk's size):

  apiVersion: hearth.dev/v1alpha1
  kind: VirtualDisk
  metadata: {name: data-restored}
  spec: {source: {snapshot: data-20250101-120000}}

and `hearth apply -f` that file.

Examples:
  hearth snapshot disk data
  hearth snapshot disk data --name data-nightly --wait
  hearth snapshot disk scratch --no-require-consistency --wait --timeout 30s")]
    Disk(DiskArgs),
    /// Snapshot every disk of a VM at one moment (a VirtualMachineSnapshot)
    #[command(after_help = "\
All disks of the VM are cut together, inside one guest freeze, so they agree
with each other. The snapshot is named VM-YYYYMMDD-HHMMSS (UTC) unless
--name is given; each disk gets its own VirtualDiskSnapshot, listed in the
summary. Roll the whole VM back with `hearth restore vm VM --from NAME`.

Examples:
  hearth snapshot vm demo --wait
  hearth snapshot vm demo --name before-upgrade --wait --timeout 5m")]
    Vm(VmArgs),
    /// Snapshot several VMs at one moment (a VirtualMachineSnapshotGroup)
    #[command(after_help = "\
Every VM of the group is frozen, then every VM's disks are cut, then all are
thawed: the filesystems of all members are frozen at one common moment, under
one deadline (the shortest spec.freezeDeadlineSeconds of the VMs). Each VM
gets a VirtualMachineSnapshot named GROUP-VM, owned by the group (deleting
the group deletes them). If one VM cannot be frozen (no agent, a freeze that
fails or outlasts the deadline), the whole group fails and every VM is thawed
at once, unless --no-require-consistency is given (then the group is Ready
with consistent: false). Roll every VM back with
`hearth restore vmsnapshotgroup NAME`.

Examples:
  hearth snapshot group app-and-db --vm app --vm db --wait
  hearth get vmsnapshotgroups
  hearth restore vmsnapshotgroup app-and-db")]
    Group(GroupArgs),
}

#[derive(Debug, clap::Args)]
pub struct GroupArgs {
    /// The group's name; its member snapshots are named NAME-VM.
    #[arg(value_name = "NAME", value_parser = super::parse_name)]
    pub group: String,
    /// A member VirtualMachine (give --vm once per VM, at least once).
    #[arg(long = "vm", value_name = "VM", required = true, value_parser = super::parse_name)]
    pub vms: Vec<String>,
    /// Take the group even when a member cannot be frozen; it is then marked
    /// consistent: false.
    #[arg(long)]
    pub no_require_consistency: bool,
    /// Wait until the group is Ready (exit 0) or Failed (exit 1), printing
    /// each phase it goes through.
    #[arg(long)]
    pub wait: bool,
    /// With --wait: give up after this long (90s, 2m, 1m30s). The group
    /// itself goes on; see it with `hearth get vmsnapshotgroups`.
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "120s",
        value_parser = parse_duration,
        requires = "wait"
    )]
    pub timeout: Duration,
}

#[derive(Debug, clap::Args)]
pub struct DiskArgs {
    /// The VirtualDisk to snapshot.
    #[arg(value_name = "DISK", value_parser = super::parse_name)]
    pub disk: String,
    #[command(flatten)]
    pub options: Options,
}

#[derive(Debug, clap::Args)]
pub struct VmArgs {
    /// The VirtualMachine whose disks to snapshot.
    #[arg(value_name = "VM", value_parser = super::parse_name)]
    pub vm: String,
    #[command(flatten)]
    pub options: Options,
}

#[derive(Debug, clap::Args)]
pub struct Options {
    /// The snapshot's name (default: SOURCE-YYYYMMDD-HHMMSS, UTC).
    #[arg(long, value_name = "NAME", value_parser = super::parse_name)]
    pub name: Option<String>,
    /// Take the snapshot even when the guest cannot be frozen (no agent,
    /// freeze failed or too slow); it is then marked consistent: false.
    #[arg(long)]
    pub no_require_consistency: bool,
    /// Wait until the snapshot is Ready (exit 0) or Failed (exit 1), printing
    /// each phase it goes through.
    #[arg(long)]
    pub wait: bool,
    /// With --wait: give up after this long (90s, 2m, 1m30s). The snapshot
    /// itself goes on; see it with `hearth get snapshots`.
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "120s",
        value_parser = parse_duration,
        requires = "wait"
    )]
    pub timeout: Duration,
}

/// One snapshot request, resolved from the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub kind: Kind,
    pub name: String,
    /// The disk or VM; for a group, its VMs joined with `,` (a name never
    /// holds one).
    pub source: String,
    pub required_consistency: bool,
    /// The name was made up here, not given with --name.
    pub default_name: bool,
}

impl Request {
    pub fn new(target: &Target, now: DateTime<Utc>) -> Request {
        let (kind, source, options) = match target {
            Target::Disk(a) => (Kind::VirtualDiskSnapshot, &a.disk, &a.options),
            Target::Vm(a) => (Kind::VirtualMachineSnapshot, &a.vm, &a.options),
            Target::Group(g) => {
                return Request {
                    kind: Kind::VirtualMachineSnapshotGroup,
                    name: g.group.clone(),
                    source: g.vms.join(","),
                    required_consistency: !g.no_require_consistency,
                    default_name: false,
                };
            }
        };
        Request {
            kind,
            name: options
                .name
                .clone()
                .unwrap_or_else(|| default_name(source, now)),
            source: source.clone(),
            required_consistency: !options.no_require_consistency,
            default_name: options.name.is_none(),
        }
    }

    /// The object as `POST /v1/apply` takes it.
    pub fn object(&self) -> Value {
        if self.kind == Kind::VirtualMachineSnapshotGroup {
            let vms: Vec<&str> = self.source.split(',').collect();
            return json!({
                "apiVersion": API_VERSION,
                "kind": self.kind.as_str(),
                "metadata": {"name": self.name},
                "spec": {"virtualMachineNames": vms, "requiredConsistency": self.required_consistency},
            });
        }
        let source_field = match self.kind {
            Kind::VirtualMachineSnapshot => "virtualMachineName",
            _ => "virtualDiskName",
        };
        json!({
            "apiVersion": API_VERSION,
            "kind": self.kind.as_str(),
            "metadata": {"name": self.name},
            "spec": {source_field: self.source, "requiredConsistency": self.required_consistency},
        })
    }
}

/// `SOURCE-YYYYMMDD-HHMMSS` in UTC. The source part is cut short when the
/// whole would exceed 63 characters, so the result is always a DNS label.
pub fn default_name(source: &str, now: DateTime<Utc>) -> String {
    let keep = source
        .char_indices()
        .nth(MAX_NAME - STAMP_LEN)
        .map_or(source.len(), |(i, _)| i);
    // A cut may leave a trailing '-', and `data--2025...` reads as a typo.
    let head = source[..keep].trim_end_matches('-');
    format!("{head}-{}", now.format("%Y%m%d-%H%M%S"))
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let request = Request::new(&args.target, Utc::now());
    let (wait, timeout) = match &args.target {
        Target::Disk(a) => (a.options.wait, a.options.timeout),
        Target::Vm(a) => (a.options.wait, a.options.timeout),
        Target::Group(g) => (g.wait, g.timeout),
    };
    let mut out = std::io::stdout().lock();
    create(client, &request, &mut out).await?;
    if wait {
        let last = follow_until_final(client, &request, timeout, &mut out).await?;
        writeln!(out, "{}", summary(request.kind, &request.name, &last))?;
    }
    Ok(())
}

/// Sends the snapshot and prints `virtualdisksnapshot/NAME created`.
///
/// A snapshot command takes a new snapshot or fails: it never re-applies over
/// an existing object of the same name, which would at best do nothing and at
/// worst point an old snapshot's spec somewhere else.
pub async fn create(
    client: &ApiClient,
    request: &Request,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let object = request.object();
    // The same checks hearthd makes, so a bad request fails before it is sent.
    object_from_value(object.clone(), "the snapshot").map_err(anyhow::Error::msg)?;
    let new = super::New {
        kind: request.kind,
        name: &request.name,
        made_up_name: request.default_name,
        noun: "snapshot",
    };
    super::create_only(client, &new, object, out).await
}

/// The progress state of one poll: `InProgress (cut 3)`; `None` until
/// hearthd has given the snapshot a phase (the moment after it is created).
fn progress(obj: &Value) -> Option<String> {
    let phase = str_at(obj, &["status", "phase"])?;
    Some(match u64_at(obj, &["status", "cutId"]) {
        Some(cut) => format!("{phase} (cut {cut})"),
        None => phase.to_string(),
    })
}

/// Where one look at the snapshot leaves the wait.
enum Judged {
    /// Ready: the object.
    Ready(Value),
    /// It will never be Ready, and why.
    Never(String),
    /// Still on its way: the progress state (`InProgress (cut 3)`).
    Going(String),
}

fn judge(who: &str, obj: Option<Value>) -> Judged {
    let Some(obj) = obj else {
        return Judged::Never(format!("{who} was deleted before it became Ready"));
    };
    match str_at(&obj, &["status", "phase"]) {
        Some("Ready") => return Judged::Ready(obj),
        Some("Failed") => {
            let why = reason_and_message(&obj).unwrap_or_else(|| "no reason recorded".to_string());
            return Judged::Never(format!("{who} failed: {why}"));
        }
        Some("Terminating") => {
            return Judged::Never(format!(
                "{who} is being deleted, so it will not become Ready"
            ));
        }
        _ => {}
    }
    Judged::Going(progress(&obj).unwrap_or_else(|| "no status yet".to_string()))
}

/// Progress lines, each state once.
struct Shown(Option<String>);

impl Shown {
    fn show(&mut self, who: &str, state: &str, out: &mut impl Write) -> std::io::Result<()> {
        // "no status yet" is the moment after creation, not worth a line.
        if state != "no status yet" && self.0.as_deref() != Some(state) {
            writeln!(out, "{who}: {state}")?;
            self.0 = Some(state.to_string());
        }
        Ok(())
    }
}

fn timed_out(request: &Request, timeout: Duration, last: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "timed out after {timeout:?} waiting for {} to be Ready; last phase: {last} \
         (the snapshot goes on: see `hearth get {} {}`)",
        short_ref(request.kind, &request.name),
        get_kind(request.kind),
        request.name
    )
}

/// Follows the snapshot on hearthd's change stream until it is Ready
/// (returning it) or will never be: the answer comes the moment hearthd
/// stores it, with no polling delay. A hearthd that cannot be reached
/// (restarting) is asked for the snapshot in turn. Prints a progress line each time the phase or the cut
/// changes; Ready and Failed are left to the caller's summary or error.
pub async fn follow_until_final(
    client: &ApiClient,
    request: &Request,
    timeout: Duration,
    out: &mut impl Write,
) -> anyhow::Result<Value> {
    let who = short_ref(request.kind, &request.name);
    let deadline = tokio::time::Instant::now() + timeout;
    let path = format!(
        "/v1/watch?kinds={}&name={}",
        request.kind.plural(),
        request.name
    );
    let opened = tokio::time::timeout_at(
        deadline,
        Follower::open(client, path, timeout, Box::new(std::io::stderr())),
    )
    .await;
    let mut follower = match opened {
        Err(_) => return Err(timed_out(request, timeout, "no status yet")),
        Ok(Ok(f)) => f,
        Ok(Err(ApiError::Unreachable { .. })) => {
            // hearthd restarting: ask it in turn.
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            return wait_until_final(client, request, left, POLL_INTERVAL, out).await;
        }
        Ok(Err(e)) => return Err(e.into()),
    };
    let mut shown = Shown(None);
    let mut last = "no status yet".to_string();
    loop {
        let update = match tokio::time::timeout_at(deadline, follower.next()).await {
            Err(_) => return Err(timed_out(request, timeout, &last)),
            Ok(update) => update?,
        };
        let seen = match update {
            Update::Synced { .. } => follower
                .informer()
                .get(request.kind.as_str(), &request.name)
                .cloned(),
            Update::Object {
                type_,
                kind,
                name,
                object,
                ..
            } if kind == request.kind.as_str() && name == request.name => {
                (type_ != WatchType::Deleted).then_some(object)
            }
            _ => continue,
        };
        match judge(&who, seen) {
            Judged::Ready(obj) => return Ok(obj),
            Judged::Never(why) => bail!("{why}"),
            Judged::Going(state) => {
                shown.show(&who, &state, out)?;
                last = state;
            }
        }
    }
}

/// Polls until the snapshot is Ready (returning it) or will never be, for a
/// hearthd that was out of reach when the stream was opened.
pub async fn wait_until_final(
    client: &ApiClient,
    request: &Request,
    timeout: Duration,
    poll: Duration,
    out: &mut impl Write,
) -> anyhow::Result<Value> {
    let who = short_ref(request.kind, &request.name);
    let path = object_path(request.kind, &request.name);
    let deadline = tokio::time::Instant::now() + timeout;
    let mut shown = Shown(None);
    let mut last = "no status yet".to_string();
    loop {
        let seen = match client.get(&path).await {
            Ok(obj) => Some(Some(obj)),
            Err(e) if e.is_not_found() => Some(None),
            // hearthd restarting: the snapshot survives it, keep watching.
            Err(e @ ApiError::Unreachable { .. }) => {
                last = e.to_string();
                None
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(seen) = seen {
            match judge(&who, seen) {
                Judged::Ready(obj) => return Ok(obj),
                Judged::Never(why) => bail!("{why}"),
                Judged::Going(state) => {
                    shown.show(&who, &state, out)?;
                    last = state;
                }
            }
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(timed_out(request, timeout, &last));
        }
        tokio::time::sleep(poll.min(deadline - now)).await;
    }
}

/// The KIND to type for `hearth get`.
fn get_kind(kind: Kind) -> &'static str {
    match kind {
        Kind::VirtualMachineSnapshot => "vmsnapshot",
        Kind::VirtualMachineSnapshotGroup => "vmsnapshotgroup",
        _ => "snapshot",
    }
}

/// The line printed once a snapshot is Ready:
/// `snapshot/NAME: Ready, consistent: true, freeze window 84 ms, size 1.2Mi`.
pub fn summary(kind: Kind, name: &str, obj: &Value) -> String {
    let mut parts = vec![str_at(obj, &["status", "phase"]).unwrap_or("-").to_string()];
    let consistent = match at(obj, &["status", "consistent"]).and_then(Value::as_bool) {
        Some(true) => "consistent: true".to_string(),
        // Say why: that is what the user will want to fix.
        Some(false) => match reason_and_message(obj) {
            Some(why) => format!("consistent: false ({why})"),
            None => "consistent: false".to_string(),
        },
        None => "consistent: unknown".to_string(),
    };
    parts.push(consistent);
    parts.push(match u64_at(obj, &["status", "freezeWindowMs"]) {
        Some(ms) => format!("freeze window {ms} ms"),
        None => "no freeze".to_string(),
    });
    if let Some(size) = u64_at(obj, &["status", "size"]) {
        parts.push(format!("size {}", human_bytes(size)));
    }
    if kind == Kind::VirtualMachineSnapshot {
        let disks: Vec<&str> = at(obj, &["status", "virtualDiskSnapshotNames"])
            .and_then(Value::as_array)
            .map(|names| names.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        parts.push(if disks.is_empty() {
            "disk snapshots: none".to_string()
        } else {
            format!("disk snapshots: {}", disks.join(", "))
        });
    }
    if kind == Kind::VirtualMachineSnapshotGroup {
        let members: Vec<&str> = at(obj, &["status", "virtualMachineSnapshotNames"])
            .and_then(Value::as_array)
            .map(|names| names.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        parts.push(format!("VM snapshots: {}", members.join(", ")));
    }
    format!("{}: {}", short_ref(kind, name), parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_server::{ScriptedServer, ok};
    use hyper::StatusCode;

    fn at_noon() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2025-03-04T05:06:07Z")
            .expect("time")
            .with_timezone(&Utc)
    }

    fn not_found() -> (StatusCode, String) {
        (
            StatusCode::NOT_FOUND,
            r#"{"error": "not found"}"#.to_string(),
        )
    }

    fn conflict() -> (StatusCode, String) {
        (
            StatusCode::CONFLICT,
            r#"{"error": "VirtualDiskSnapshot \"data-20250304-050607\" already exists; an apply with create=true only creates"}"#.to_string(),
        )
    }

    fn created(kind: &str, name: &str) -> (StatusCode, String) {
        ok(&json!({"results": [{"kind": kind, "name": name, "action": "created"}]}).to_string())
    }

    fn snap(status: Value) -> (StatusCode, String) {
        ok(&json!({"metadata": {"name": "s"}, "spec": {}, "status": status}).to_string())
    }

    /// The one object of an apply body.
    fn sent_object(body: &[u8]) -> Value {
        let v: Value = serde_json::from_slice(body).expect("apply body is JSON");
        assert_eq!(v["items"].as_array().map(Vec::len), Some(1), "{v}");
        v["items"][0].clone()
    }

    fn disk_request(name: &str) -> Request {
        Request {
            kind: Kind::VirtualDiskSnapshot,
            name: name.to_string(),
            source: "data".to_string(),
            required_consistency: true,
            default_name: false,
        }
    }

    #[test]
    fn default_name_is_source_and_utc_time() {
        assert_eq!(default_name("data", at_noon()), "data-20250304-050607");
        let local = DateTime::parse_from_rfc3339("2025-03-04T07:06:07+02:00")
            .expect("time")
            .with_timezone(&Utc);
        assert_eq!(default_name("data", local), "data-20250304-050607");
    }

    #[test]
    fn default_name_of_a_long_source_stays_a_dns_label() {
        let longest = "a".repeat(63);
        let name = default_name(&longest, at_noon());
        assert_eq!(name.len(), 63);
        assert_eq!(name, format!("{}-20250304-050607", "a".repeat(47)));
        hearth_api::check_dns_label(&name).expect("a DNS label");

        // A cut right after a '-' must not leave `--` or a trailing '-'.
        let dashed = format!("{}-{}", "b".repeat(46), "c".repeat(16));
        let name = default_name(&dashed, at_noon());
        assert_eq!(name, format!("{}-20250304-050607", "b".repeat(46)));
        hearth_api::check_dns_label(&name).expect("a DNS label");

        // One that just fits is left whole.
        let fits = "d".repeat(47);
        assert_eq!(
            default_name(&fits, at_noon()),
            format!("{fits}-20250304-050607")
        );
    }

    #[test]
    fn snapshot_group_takes_its_vms_and_sends_one_group() {
        use clap::Parser;
        #[derive(Debug, clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let cli = Cli::try_parse_from(["x", "group", "pair", "--vm", "app", "--vm", "db"])
            .expect("parses");
        let r = Request::new(&cli.args.target, at_noon());
        assert_eq!(r.kind, Kind::VirtualMachineSnapshotGroup);
        assert_eq!(r.name, "pair");
        assert_eq!(
            r.object(),
            json!({"apiVersion": API_VERSION, "kind": "VirtualMachineSnapshotGroup",
                   "metadata": {"name": "pair"},
                   "spec": {"virtualMachineNames": ["app", "db"], "requiredConsistency": true}})
        );
        object_from_value(r.object(), "the group").expect("a valid group");
        // At least one --vm; a name is required.
        assert!(Cli::try_parse_from(["x", "group", "pair"]).is_err());
        assert!(Cli::try_parse_from(["x", "group", "--vm", "app"]).is_err());
        let cli = Cli::try_parse_from([
            "x",
            "group",
            "pair",
            "--vm",
            "app",
            "--no-require-consistency",
            "--wait",
            "--timeout",
            "30s",
        ])
        .expect("parses");
        let r = Request::new(&cli.args.target, at_noon());
        assert!(!r.required_consistency);
        let Target::Group(g) = &cli.args.target else {
            panic!()
        };
        assert!(g.wait);
        assert_eq!(g.timeout, Duration::from_secs(30));
    }

    #[test]
    fn the_command_line_becomes_one_request() {
        use clap::Parser;
        #[derive(Debug, clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let cli = Cli::try_parse_from(["x", "disk", "data"]).expect("parses");
        let r = Request::new(&cli.args.target, at_noon());
        assert_eq!(
            r,
            Request {
                kind: Kind::VirtualDiskSnapshot,
                name: "data-20250304-050607".into(),
                source: "data".into(),
                required_consistency: true,
                default_name: true,
            }
        );
        let cli = Cli::try_parse_from([
            "x",
            "vm",
            "demo",
            "--name",
            "pre",
            "--no-require-consistency",
            "--wait",
            "--timeout",
            "5m",
        ])
        .expect("parses");
        let Target::Vm(vm) = &cli.args.target else {
            panic!("a vm target: {cli:?}");
        };
        assert!(vm.options.wait);
        assert_eq!(vm.options.timeout, Duration::from_secs(300));
        let r = Request::new(&cli.args.target, at_noon());
        assert_eq!(r.kind, Kind::VirtualMachineSnapshot);
        assert_eq!(r.name, "pre");
        assert!(!r.required_consistency);
        assert!(!r.default_name);

        // --timeout means nothing without --wait; a bad --name never leaves.
        assert!(Cli::try_parse_from(["x", "disk", "data", "--timeout", "5m"]).is_err());
        assert!(Cli::try_parse_from(["x", "disk", "data", "--name", "Bad_Name"]).is_err());
    }

    #[test]
    fn the_objects_are_valid_snapshots() {
        let disk = disk_request("data-1").object();
        assert_eq!(
            disk,
            json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDiskSnapshot",
                   "metadata": {"name": "data-1"},
                   "spec": {"virtualDiskName": "data", "requiredConsistency": true}})
        );
        object_from_value(disk, "t").expect("valid");
        let vm = Request {
            kind: Kind::VirtualMachineSnapshot,
            name: "pre".into(),
            source: "demo".into(),
            required_consistency: false,
            default_name: false,
        }
        .object();
        assert_eq!(
            vm["spec"],
            json!({"virtualMachineName": "demo", "requiredConsistency": false})
        );
        object_from_value(vm, "t").expect("valid");
    }

    #[tokio::test]
    async fn create_is_one_apply_that_only_creates() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server =
            ScriptedServer::start(dir.path(), vec![created("VirtualDiskSnapshot", "data-1")]);
        let client = ApiClient::new(&server.socket);
        let mut out = Vec::new();
        create(&client, &disk_request("data-1"), &mut out)
            .await
            .expect("created");
        assert_eq!(
            String::from_utf8_lossy(&out),
            "virtualdisksnapshot/data-1 created\n"
        );
        let seen = server.seen();
        assert_eq!(seen.len(), 1);
        assert_eq!(
            (seen[0].method.as_str(), seen[0].path.as_str()),
            ("POST", "/v1/apply?create=true")
        );
        assert_eq!(sent_object(&seen[0].body), disk_request("data-1").object());
    }

    #[tokio::test]
    async fn create_vm_snapshot_posts_a_virtual_machine_snapshot() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server =
            ScriptedServer::start(dir.path(), vec![created("VirtualMachineSnapshot", "pre")]);
        let client = ApiClient::new(&server.socket);
        let request = Request {
            kind: Kind::VirtualMachineSnapshot,
            name: "pre".into(),
            source: "demo".into(),
            required_consistency: true,
            default_name: false,
        };
        let mut out = Vec::new();
        create(&client, &request, &mut out).await.expect("created");
        assert_eq!(
            String::from_utf8_lossy(&out),
            "virtualmachinesnapshot/pre created\n"
        );
        let seen = server.seen();
        assert_eq!(seen[0].path, "/v1/apply?create=true");
        let sent = sent_object(&seen[0].body);
        assert_eq!(sent["kind"], "VirtualMachineSnapshot");
        assert_eq!(sent["spec"]["virtualMachineName"], "demo");
    }

    #[tokio::test]
    async fn an_existing_name_is_refused_without_applying() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![conflict(), snap(json!({"phase": "Ready"}))],
        );
        let client = ApiClient::new(&server.socket);
        let mut request = disk_request("data-20250304-050607");
        request.default_name = true;
        let err = create(&client, &request, &mut Vec::new())
            .await
            .expect_err("taken");
        assert_eq!(
            err.to_string(),
            "snapshot/data-20250304-050607 already exists (it is Ready); no new snapshot was taken \
             (another snapshot was started in the same second; pass --name)"
        );
        let seen = server.seen();
        assert_eq!(
            (seen[0].method.as_str(), seen[0].path.as_str()),
            ("POST", "/v1/apply?create=true"),
            "one apply that only creates, refused"
        );
    }

    #[tokio::test]
    async fn losing_a_race_for_the_name_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![ok(
                r#"{"results": [{"kind": "VirtualDiskSnapshot", "name": "x", "action": "unchanged"}]}"#,
            )],
        );
        let client = ApiClient::new(&server.socket);
        let mut out = Vec::new();
        let err = create(&client, &disk_request("x"), &mut out)
            .await
            .expect_err("not created");
        assert!(
            err.to_string()
                .starts_with("snapshot/x already exists; no new snapshot was taken"),
            "{err}"
        );
        assert_eq!(
            String::from_utf8_lossy(&out),
            "virtualdisksnapshot/x unchanged\n"
        );
    }

    #[tokio::test]
    async fn waiting_prints_each_phase_and_cut_once_and_returns_ready() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![
                ok(r#"{"metadata": {"name": "s"}, "spec": {}}"#),
                snap(json!({"phase": "Pending"})),
                snap(json!({"phase": "Pending"})),
                snap(json!({"phase": "InProgress", "cutId": 3})),
                snap(json!({"phase": "InProgress", "cutId": 3})),
                snap(
                    json!({"phase": "Ready", "cutId": 3, "consistent": true, "freezeWindowMs": 84}),
                ),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let mut out = Vec::new();
        let last = wait_until_final(
            &client,
            &disk_request("s"),
            Duration::from_secs(10),
            Duration::from_millis(1),
            &mut out,
        )
        .await
        .expect("Ready");
        assert_eq!(
            String::from_utf8_lossy(&out),
            "snapshot/s: Pending\nsnapshot/s: InProgress (cut 3)\n"
        );
        assert_eq!(last["status"]["freezeWindowMs"], 84);
        let seen = server.seen();
        assert_eq!(seen.len(), 6);
        assert!(
            seen.iter()
                .all(|s| s.method == "GET" && s.path == "/v1/virtualdisksnapshots/s")
        );
    }

    /// One line of the change stream about snapshot `s`.
    fn stream_line(seq: u64, type_: &str, status: Value) -> String {
        json!({"seq": seq, "type": type_, "kind": "VirtualDiskSnapshot", "name": "s",
               "object": {"metadata": {"name": "s"}, "spec": {}, "status": status}})
        .to_string()
    }

    #[tokio::test]
    async fn the_wait_follows_the_change_stream_and_never_polls() {
        let dir = tempfile::tempdir().expect("tempdir");
        let lines = [
            stream_line(5, "ADDED", json!({"phase": "Pending"})),
            json!({"seq": 5, "type": "BOOKMARK"}).to_string(),
            stream_line(6, "MODIFIED", json!({"phase": "InProgress", "cutId": 3})),
            stream_line(7, "MODIFIED", json!({"phase": "InProgress", "cutId": 3})),
            stream_line(
                8,
                "MODIFIED",
                json!({"phase": "Ready", "cutId": 3, "consistent": true, "freezeWindowMs": 84}),
            ),
        ];
        let server = ScriptedServer::routes(
            dir.path(),
            vec![(
                "GET",
                "/v1/watch?kinds=virtualdisksnapshots&name=s",
                vec![ok(&(lines.join("\n") + "\n"))],
            )],
        );
        let client = ApiClient::new(&server.socket);
        let mut out = Vec::new();
        let last = follow_until_final(
            &client,
            &disk_request("s"),
            Duration::from_secs(10),
            &mut out,
        )
        .await
        .expect("Ready");
        assert_eq!(
            String::from_utf8_lossy(&out),
            "snapshot/s: Pending\nsnapshot/s: InProgress (cut 3)\n"
        );
        assert_eq!(last["status"]["freezeWindowMs"], 84);
        let seen: Vec<String> = server.seen().iter().map(|s| s.path.clone()).collect();
        assert_eq!(seen, ["/v1/watch?kinds=virtualdisksnapshots&name=s"]);
    }

    #[tokio::test]
    async fn a_snapshot_failed_or_deleted_on_the_stream_ends_the_wait() {
        let dir = tempfile::tempdir().expect("tempdir");
        let failed = [
            stream_line(2, "ADDED", json!({"phase": "InProgress", "cutId": 1})),
            json!({"seq": 2, "type": "BOOKMARK"}).to_string(),
            stream_line(
                3,
                "MODIFIED",
                json!({"phase": "Failed", "reason": "NotConsistent", "message": "no agent"}),
            ),
        ];
        let server = ScriptedServer::routes(
            dir.path(),
            vec![(
                "GET",
                "/v1/watch?kinds=virtualdisksnapshots&name=s",
                vec![ok(&(failed.join("\n") + "\n"))],
            )],
        );
        let client = ApiClient::new(&server.socket);
        let err = follow_until_final(
            &client,
            &disk_request("s"),
            Duration::from_secs(10),
            &mut Vec::new(),
        )
        .await
        .expect_err("Failed");
        assert_eq!(
            err.to_string(),
            "snapshot/s failed: NotConsistent: no agent"
        );

        let dir = tempfile::tempdir().expect("tempdir");
        // Deleted before the stream opened: the first list lacks it.
        let server = ScriptedServer::routes(
            dir.path(),
            vec![(
                "GET",
                "/v1/watch?kinds=virtualdisksnapshots&name=s",
                vec![ok(
                    &(json!({"seq": 9, "type": "BOOKMARK"}).to_string() + "\n")
                )],
            )],
        );
        let client = ApiClient::new(&server.socket);
        let err = follow_until_final(
            &client,
            &disk_request("s"),
            Duration::from_secs(10),
            &mut Vec::new(),
        )
        .await
        .expect_err("gone");
        assert_eq!(
            err.to_string(),
            "snapshot/s was deleted before it became Ready"
        );
    }

    #[tokio::test]
    async fn a_failed_snapshot_ends_the_wait_with_its_reason() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![
                snap(json!({"phase": "InProgress", "cutId": 1})),
                snap(json!({"phase": "Failed", "reason": "AgentUnavailable",
                            "message": "the guest agent of VirtualMachine \"demo\" is not connected"})),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let mut out = Vec::new();
        let err = wait_until_final(
            &client,
            &disk_request("s"),
            Duration::from_secs(10),
            Duration::from_millis(1),
            &mut out,
        )
        .await
        .expect_err("Failed");
        assert_eq!(
            err.to_string(),
            "snapshot/s failed: AgentUnavailable: the guest agent of VirtualMachine \"demo\" is not connected"
        );
        assert_eq!(
            String::from_utf8_lossy(&out),
            "snapshot/s: InProgress (cut 1)\n"
        );
    }

    #[tokio::test]
    async fn the_wait_times_out_with_the_last_phase() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![snap(json!({"phase": "InProgress", "cutId": 7}))],
        );
        let client = ApiClient::new(&server.socket);
        let err = wait_until_final(
            &client,
            &disk_request("s"),
            Duration::from_millis(30),
            Duration::from_millis(5),
            &mut Vec::new(),
        )
        .await
        .expect_err("times out");
        assert_eq!(
            err.to_string(),
            "timed out after 30ms waiting for snapshot/s to be Ready; last phase: InProgress (cut 7) \
             (the snapshot goes on: see `hearth get snapshot s`)"
        );
    }

    #[tokio::test]
    async fn deletion_during_the_wait_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![snap(json!({"phase": "Terminating"})), not_found()],
        );
        let client = ApiClient::new(&server.socket);
        let err = wait_until_final(
            &client,
            &disk_request("s"),
            Duration::from_secs(10),
            Duration::from_millis(1),
            &mut Vec::new(),
        )
        .await
        .expect_err("Terminating");
        assert_eq!(
            err.to_string(),
            "snapshot/s is being deleted, so it will not become Ready"
        );
        let err = wait_until_final(
            &client,
            &disk_request("s"),
            Duration::from_secs(10),
            Duration::from_millis(1),
            &mut Vec::new(),
        )
        .await
        .expect_err("gone");
        assert_eq!(
            err.to_string(),
            "snapshot/s was deleted before it became Ready"
        );
    }

    #[test]
    fn summary_of_a_consistent_disk_snapshot() {
        let obj = json!({"status": {"phase": "Ready", "consistent": true, "freezeWindowMs": 84,
                                    "size": 1258291, "cutId": 3}});
        assert_eq!(
            summary(Kind::VirtualDiskSnapshot, "data-1", &obj),
            "snapshot/data-1: Ready, consistent: true, freeze window 84 ms, size 1.2Mi"
        );
    }

    #[test]
    fn summary_says_why_a_snapshot_is_not_consistent_and_when_nothing_froze() {
        let obj = json!({"status": {"phase": "Ready", "consistent": false,
                                    "reason": "NoGuestAgent", "message": "spec.guestAgent is false"}});
        assert_eq!(
            summary(Kind::VirtualDiskSnapshot, "s", &obj),
            "snapshot/s: Ready, consistent: false (NoGuestAgent: spec.guestAgent is false), no freeze"
        );
        let stopped = json!({"status": {"phase": "Ready", "consistent": true, "size": 0}});
        assert_eq!(
            summary(Kind::VirtualDiskSnapshot, "s", &stopped),
            "snapshot/s: Ready, consistent: true, no freeze, size 0B"
        );
    }

    #[test]
    fn summary_of_a_vm_snapshot_lists_its_disk_snapshots() {
        let obj = json!({"status": {"phase": "Ready", "consistent": true, "freezeWindowMs": 12,
                                    "virtualDiskSnapshotNames": ["pre-root", "pre-data"]}});
        assert_eq!(
            summary(Kind::VirtualMachineSnapshot, "pre", &obj),
            "vmsnapshot/pre: Ready, consistent: true, freeze window 12 ms, disk snapshots: pre-root, pre-data"
        );
        let none = json!({"status": {"phase": "Ready", "consistent": true}});
        assert!(
            summary(Kind::VirtualMachineSnapshot, "pre", &none).ends_with("disk snapshots: none")
        );
    }
}
