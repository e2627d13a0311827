//! `hearth restore vm VM --from VMSNAPSHOT`: roll a VM's disks back to a
//! VirtualMachineSnapshot; `hearth restore vmsnapshotgroup NAME`: roll every
//! member VM of a VirtualMachineSnapshotGroup back.

use std::io::Write;
use std::time::Duration;

use hearth_api::Kind;
use serde_json::json;

use super::object_path;
use super::wait::parse_duration;
use crate::client::{ApiClient, ApiError};
use crate::follow::{Follower, Update};
use crate::output::{str_at, u64_at};

/// The shortest client timeout for a restore.
const MIN_RESTORE_TIMEOUT: Duration = Duration::from_secs(600);

/// hearthd gives a VM `spec.stopTimeoutSeconds` plus this to stop before it
/// gives up on a restore; the client waits that long plus a margin.
const SERVER_STOP_SLACK: Duration = Duration::from_secs(60);
const CLIENT_MARGIN: Duration = Duration::from_secs(120);

/// hearth-api's default for `spec.stopTimeoutSeconds`.
const DEFAULT_STOP_TIMEOUT_SECONDS: u64 = 30;

#[derive(Debug, clap::Args)]
#[command(
    about = "Roll VMs back to their snapshots, or make a VM again from a backup",
    after_help = "\
A disk is restored by creating a new disk from a snapshot instead: apply a
VirtualDisk with `spec: {source: {snapshot: NAME}}` (no size; it has the
snapshot's) with `hearth apply -f`. See `hearth restore vm --help`.

Examples:
  hearth restore vm demo --from before-upgrade
  hearth restore vmsnapshotgroup app-and-db
  hearth restore backup /srv/backup/app --at 3 --as app-restored"
)]
pub struct Args {
    #[command(subcommand)]
    pub target: Target,
}

#[derive(Debug, clap::Subcommand)]
pub enum Target {
    /// Replace every disk of a VM with its content in a VirtualMachineSnapshot
    #[command(after_help = "\
The VM is stopped first (a guest shutdown, up to spec.stopTimeoutSeconds) and
started again afterwards if it was running. Each disk gets a fresh layer over
the snapshot's, so the time does not depend on the disks' size, and the
snapshot itself is kept: you can restore from it again. Whatever was written
to the disks since the snapshot is lost, unless you snapshot it first.

The snapshot must be Ready and of this VM, and the VM must still have the
disks it had then.

To get one disk back without touching the VM, create a new disk from a disk
snapshot and attach it where you need it:

  apiVersion: hearth.dev/v1alpha1
  kind: VirtualDisk
  metadata: {name: data-restored}
  spec: {source: {snapshot: pre-data}}

  hearth apply -f data-restored.yaml

Examples:
  hearth snapshot vm demo --name before-upgrade --wait
  hearth restore vm demo --from before-upgrade")]
    Vm(VmArgs),
    /// Roll every VM of a VirtualMachineSnapshotGroup back to its member snapshot
    #[command(
        visible_alias = "vmsnapshotgroups",
        visible_alias = "snapshotgroup",
        after_help = "\
The group must be Ready. Every member VM is restored from its member
VirtualMachineSnapshot (GROUP-VM), side by side, exactly as
`hearth restore vm VM --from GROUP-VM` does for one: stopped, its disks
rebuilt over the snapshot's layers, started again if it was running. The
group and each member are checked before any VM is stopped.

Example:
  hearth snapshot group app-and-db --vm app --vm db --wait
  hearth restore vmsnapshotgroup app-and-db"
    )]
    Vmsnapshotgroup(GroupArgs),
    /// Make a VM (and its disks) again from a point of a backup directory
    #[command(after_help = "\
Reads DIR/hearth-backup.json (DIR is a path on hearthd's host) and creates,
in one apply that only creates, a disk NAME-DISK for every disk of the point,
each from its backup file (`spec.source.backup`: hearthd checks every file of
the chain against the manifest's SHA-256, then copies the chain into the
disk's own first layer), and a VM NAME with the spec the backed-up VM had at
that point, on those disks. --no-vm makes the disks only. The VM's networks
and port forwards are the original's: when the original still runs, a
forwarded port is refused (make the disks only, or change the VM).

Examples:
  hearth restore backup /srv/backup/app --as app-restored --wait
  hearth restore backup /srv/backup/app --at 2 --as app-monday --no-vm")]
    Backup(BackupArgs),
}

#[derive(Debug, clap::Args)]
pub struct BackupArgs {
    /// The backup directory.
    #[arg(value_name = "DIR")]
    pub dir: std::path::PathBuf,
    /// The point to restore (1 for the first; `hearth get backups` shows
    /// each backup's point); the newest when left out.
    #[arg(long, value_name = "N")]
    pub at: Option<u32>,
    /// The new VM's name; its disks are NAME-DISK.
    #[arg(long = "as", value_name = "NAME", value_parser = super::parse_name)]
    pub name: String,
    /// Make the disks only.
    #[arg(long)]
    pub no_vm: bool,
    /// Wait until every disk is made (Ready: exit 0; Failed: exit 1), with
    /// the copy's progress on a terminal.
    #[arg(long)]
    pub wait: bool,
    /// With --wait: give up waiting after this long (the restore goes on).
    #[arg(long, value_name = "DURATION", default_value = "30m", value_parser = parse_duration, requires = "wait")]
    pub timeout: Duration,
}

#[derive(Debug, clap::Args)]
pub struct GroupArgs {
    /// The VirtualMachineSnapshotGroup (`hearth get vmsnapshotgroups`).
    #[arg(value_name = "NAME", value_parser = super::parse_name)]
    pub group: String,
    /// How long to wait for hearthd's answer (default: 10m, or longer when
    /// a member VM's stopTimeoutSeconds needs it).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub timeout: Option<Duration>,
}

#[derive(Debug, clap::Args)]
pub struct VmArgs {
    /// The VirtualMachine to roll back.
    #[arg(value_name = "VM", value_parser = super::parse_name)]
    pub vm: String,
    /// The VirtualMachineSnapshot to roll back to (`hearth get vmsnapshots`).
    #[arg(long = "from", value_name = "VMSNAPSHOT", value_parser = super::parse_name)]
    pub from: String,
    /// How long to wait for hearthd's answer (default: 10m, or longer when
    /// the VM's stopTimeoutSeconds needs it).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub timeout: Option<Duration>,
}

/// How long to wait for a restore of a VM whose `spec.stopTimeoutSeconds`
/// is `stop_timeout_seconds`: at least 10 minutes, and always longer than
/// hearthd itself waits for the VM to stop.
pub fn restore_timeout(stop_timeout_seconds: u64) -> Duration {
    let server = Duration::from_secs(stop_timeout_seconds) + SERVER_STOP_SLACK;
    MIN_RESTORE_TIMEOUT.max(server + CLIENT_MARGIN)
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match &args.target {
        Target::Vm(vm) => restore_vm(client, vm, &mut out).await,
        Target::Vmsnapshotgroup(g) => restore_group(client, g, &mut out).await,
        Target::Backup(b) => restore_backup(client, b, &mut out).await,
    }
}

/// The objects a restore of a backup point makes: one disk per file, and
/// the VM on them unless `no_vm`.
pub fn backup_objects(
    manifest: &serde_json::Value,
    dir: &std::path::Path,
    at: Option<u32>,
    name: &str,
    no_vm: bool,
) -> anyhow::Result<Vec<serde_json::Value>> {
    use anyhow::{Context as _, bail};
    let points = manifest["points"]
        .as_array()
        .context("the manifest lists no points")?;
    let point = match at {
        Some(n) => points
            .iter()
            .find(|p| p["point"] == n)
            .with_context(|| format!("the backup has no point {n}"))?,
        None => points.last().context("the backup has no point yet")?,
    };
    let n = point["point"]
        .as_u64()
        .context("a point without a number")?;
    let mut objects = Vec::new();
    let mut renamed = std::collections::BTreeMap::new();
    for f in point["files"].as_array().into_iter().flatten() {
        let disk = f["disk"].as_str().context("a file without a disk")?;
        let new = format!("{name}-{disk}");
        if let Err(why) = hearth_api::check_dns_label(&new) {
            bail!("the disk name {why}; use a shorter --as");
        }
        objects.push(json!({
            "apiVersion": hearth_api::API_VERSION,
            "kind": "VirtualDisk",
            "metadata": {"name": new},
            "spec": {"source": {"backup": {"from": dir, "disk": disk, "point": n}}},
        }));
        renamed.insert(disk.to_string(), new);
    }
    if !no_vm {
        let mut spec = point["virtualMachineSpec"].clone();
        if !spec.is_object() {
            bail!("point {n} does not hold the VM's spec; restore the disks with --no-vm");
        }
        for d in spec["disks"].as_array_mut().into_iter().flatten() {
            let old = d["virtualDiskName"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let new = renamed
                .get(&old)
                .with_context(|| format!("the VM's disk {old:?} is not in point {n}"))?;
            d["virtualDiskName"] = json!(new);
        }
        objects.push(json!({
            "apiVersion": hearth_api::API_VERSION,
            "kind": "VirtualMachine",
            "metadata": {"name": name},
            "spec": spec,
        }));
    }
    Ok(objects)
}

pub async fn restore_backup(
    client: &ApiClient,
    args: &BackupArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let dir = std::path::absolute(&args.dir)?;
    let path = dir.join("hearth-backup.json");
    let text = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let manifest: serde_json::Value =
        serde_json::from_slice(&text).with_context(|| format!("{}", path.display()))?;
    let objects = backup_objects(&manifest, &dir, args.at, &args.name, args.no_vm)?;
    let answer = client
        .post("/v1/apply?create=true", Some(&json!({ "items": objects })))
        .await?;
    out.write_all(super::apply::render_results(&answer)?.as_bytes())?;
    if args.wait {
        let disks: Vec<String> = objects
            .iter()
            .filter(|o| o["kind"] == "VirtualDisk")
            .filter_map(|o| str_at(o, &["metadata", "name"]).map(str::to_string))
            .collect();
        follow_disks(client, &disks, args.timeout, out).await?;
    }
    Ok(())
}

/// Follows the restored disks on hearthd's change stream until each is
/// Ready or one Failed: a line per disk when its phase changes, and (on a
/// terminal) one bar for the bytes copied into all of them. Asks in turn
/// (every 500 ms) when the stream cannot be opened.
async fn follow_disks(
    client: &ApiClient,
    disks: &[String],
    timeout: Duration,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut view = DisksView::new(disks);
    let path = format!("/v1/watch?kinds={}", Kind::VirtualDisk.plural());
    let opened = tokio::time::timeout_at(
        deadline,
        Follower::open(client, path, timeout, Box::new(std::io::stderr())),
    )
    .await;
    let mut follower = match opened {
        Err(_) => return Err(view.timed_out(timeout)),
        Ok(Ok(f)) => f,
        Ok(Err(ApiError::Unreachable { .. })) => loop {
            for d in disks {
                let obj = client.get(&object_path(Kind::VirtualDisk, d)).await?;
                view.seen(d, obj);
            }
            if view.show(out)? {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(view.timed_out(timeout));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        },
        Ok(Err(e)) => return Err(e.into()),
    };
    loop {
        let update = match tokio::time::timeout_at(deadline, follower.next()).await {
            Err(_) => return Err(view.timed_out(timeout)),
            Ok(update) => update?,
        };
        match update {
            Update::Synced { .. } => {
                for d in disks {
                    if let Some(obj) = follower.informer().get(Kind::VirtualDisk.as_str(), d) {
                        view.seen(d, obj.clone());
                    }
                }
            }
            Update::Object {
                kind, name, object, ..
            } if kind == Kind::VirtualDisk.as_str() => view.seen(&name, object),
            _ => continue,
        }
        if view.show(out)? {
            return Ok(());
        }
    }
}

/// The restored disks as last seen, and what `--wait` has shown of them.
struct DisksView {
    disks: Vec<String>,
    objects: std::collections::BTreeMap<String, serde_json::Value>,
    shown: std::collections::BTreeMap<String, String>,
    bar: Option<indicatif::ProgressBar>,
}

impl DisksView {
    fn new(disks: &[String]) -> DisksView {
        DisksView {
            disks: disks.to_vec(),
            objects: Default::default(),
            shown: Default::default(),
            bar: None,
        }
    }

    fn seen(&mut self, disk: &str, obj: serde_json::Value) {
        if self.disks.iter().any(|d| d == disk) {
            self.objects.insert(disk.to_string(), obj);
        }
    }

    fn phase(&self, disk: &str) -> &str {
        self.objects
            .get(disk)
            .and_then(|o| str_at(o, &["status", "phase"]))
            .unwrap_or("Pending")
    }

    /// Prints what changed; true once every disk is Ready, an error naming
    /// the first that Failed.
    fn show(&mut self, out: &mut impl Write) -> anyhow::Result<bool> {
        let (mut done, mut total) = (0, 0);
        for d in self.disks.clone() {
            let phase = self.phase(&d).to_string();
            if self.shown.get(&d) != Some(&phase) {
                match &self.bar {
                    Some(b) => b.suspend(|| writeln!(out, "disk/{d}: {phase}"))?,
                    None => writeln!(out, "disk/{d}: {phase}")?,
                }
                self.shown.insert(d.clone(), phase.clone());
            }
            if phase == "Failed" {
                let why = self
                    .objects
                    .get(&d)
                    .and_then(|o| str_at(o, &["status", "lastError"]))
                    .unwrap_or("?")
                    .to_string();
                self.clear();
                anyhow::bail!("disk/{d} failed: {why}");
            }
            let obj = self.objects.get(&d);
            let at = |field| obj.and_then(|o| u64_at(o, &["status", "restoreProgress", field]));
            done += at("bytesDone").unwrap_or(0);
            total += at("bytesTotal").unwrap_or(0);
        }
        if self.disks.iter().all(|d| self.phase(d) == "Ready") {
            self.clear();
            writeln!(out, "restored {} disk(s)", self.disks.len())?;
            return Ok(true);
        }
        if total > 0 && super::backup::watched() {
            let b = self
                .bar
                .get_or_insert_with(|| super::backup::copying(total));
            b.set_length(total);
            b.set_position(done);
        }
        Ok(false)
    }

    fn clear(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }

    fn timed_out(&self, timeout: Duration) -> anyhow::Error {
        let ready = self
            .disks
            .iter()
            .filter(|d| self.phase(d) == "Ready")
            .count();
        anyhow::anyhow!(
            "{ready} of {} disk(s) Ready after {timeout:?}; the restore goes on (see `hearth get disks`)",
            self.disks.len()
        )
    }
}

pub async fn restore_group(
    client: &ApiClient,
    args: &GroupArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let path = object_path(Kind::VirtualMachineSnapshotGroup, &args.group);
    let limit = match args.timeout {
        Some(t) => t,
        None => {
            // Members restore side by side: the slowest VM to stop decides.
            let group = client.get(&path).await?;
            let mut stop = DEFAULT_STOP_TIMEOUT_SECONDS;
            if let Some(vms) = group["spec"]["virtualMachineNames"].as_array() {
                for vm in vms.iter().filter_map(serde_json::Value::as_str) {
                    if let Ok(v) = client.get(&object_path(Kind::VirtualMachine, vm)).await {
                        stop = stop.max(
                            u64_at(&v, &["spec", "stopTimeoutSeconds"])
                                .unwrap_or(DEFAULT_STOP_TIMEOUT_SECONDS),
                        );
                    }
                }
            }
            restore_timeout(stop)
        }
    };
    let answer = client
        .post_slow(&format!("{path}/restore"), Some(&json!({})), limit)
        .await
        .map_err(|e| match e {
            ApiError::Timeout { .. } => anyhow::anyhow!(
                "{e}; the restore of vmsnapshotgroup/{} may still be going on: check `hearth describe vmsnapshotgroup {}`",
                args.group,
                args.group
            ),
            other => other.into(),
        })?;
    let message = str_at(&answer, &["message"])
        .map(str::to_string)
        .unwrap_or_else(|| format!("vmsnapshotgroup/{} restored", args.group));
    writeln!(out, "{message}")?;
    Ok(())
}

pub async fn restore_vm(
    client: &ApiClient,
    args: &VmArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let vm_path = object_path(Kind::VirtualMachine, &args.vm);
    let limit = match args.timeout {
        Some(t) => t,
        None => {
            // Also tells a mistyped VM apart before the long request.
            let vm = client.get(&vm_path).await?;
            restore_timeout(
                u64_at(&vm, &["spec", "stopTimeoutSeconds"])
                    .unwrap_or(DEFAULT_STOP_TIMEOUT_SECONDS),
            )
        }
    };
    let answer = client
        .post_slow(
            &format!("{vm_path}/restore"),
            Some(&json!({"from": args.from})),
            limit,
        )
        .await
        .map_err(|e| match e {
            ApiError::Timeout { .. } => anyhow::anyhow!(
                "{e}; the restore of vm/{} may still be going on: check `hearth describe vm {}`",
                args.vm,
                args.vm
            ),
            other => other.into(),
        })?;
    let message = str_at(&answer, &["message"])
        .map(str::to_string)
        .unwrap_or_else(|| format!("vm/{} restored from vmsnapshot/{}", args.vm, args.from));
    writeln!(out, "{message}")?;
    Ok(())
}

#[cfg(test)]
mod backup_tests {
    use super::*;

    #[test]
    fn a_point_becomes_disks_from_the_backup_and_the_vm_on_them() {
        let m = json!({"points": [
            {"point": 1, "files": [{"disk": "app-data"}], "virtualMachineSpec": {"disks": [{"virtualDiskName": "app-data"}], "cpus": 2}},
            {"point": 2, "files": [{"disk": "app-data"}], "virtualMachineSpec": {"disks": [{"virtualDiskName": "app-data"}], "cpus": 1}}
        ]});
        let dir = std::path::Path::new("/srv/b");
        let o = backup_objects(&m, dir, Some(1), "again", false).unwrap();
        assert_eq!(o.len(), 2);
        assert_eq!(o[0]["metadata"]["name"], "again-app-data");
        assert_eq!(
            o[0]["spec"]["source"]["backup"],
            json!({"from": "/srv/b", "disk": "app-data", "point": 1})
        );
        assert_eq!(
            o[1]["spec"]["disks"][0]["virtualDiskName"],
            "again-app-data"
        );
        assert_eq!(o[1]["spec"]["cpus"], 2);
        let newest = backup_objects(&m, dir, None, "again", true).unwrap();
        assert_eq!(newest.len(), 1);
        assert_eq!(newest[0]["spec"]["source"]["backup"]["point"], 2);
        assert!(backup_objects(&m, dir, Some(3), "again", true).is_err());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_server::{ScriptedServer, ok};
    use hyper::StatusCode;
    use serde_json::Value;

    #[test]
    fn the_wait_ends_when_every_disk_is_ready_and_names_the_first_that_failed() {
        let disks = ["a-root".to_string(), "a-data".to_string()];
        let disk = |phase: &str| json!({"status": {"phase": phase}});
        let mut view = DisksView::new(&disks);
        let mut out = Vec::new();
        assert!(!view.show(&mut out).unwrap());
        view.seen("a-root", disk("Ready"));
        view.seen("other", disk("Failed"));
        assert!(!view.show(&mut out).unwrap(), "a-data is not Ready yet");
        view.seen("a-data", disk("Ready"));
        assert!(view.show(&mut out).unwrap());
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "disk/a-root: Pending\ndisk/a-data: Pending\ndisk/a-root: Ready\n\
             disk/a-data: Ready\nrestored 2 disk(s)\n"
        );

        let mut view = DisksView::new(&disks);
        view.seen(
            "a-data",
            json!({"status": {"phase": "Failed", "lastError": "a file changed"}}),
        );
        let err = view.show(&mut Vec::new()).unwrap_err();
        assert_eq!(err.to_string(), "disk/a-data failed: a file changed");
    }

    fn args(timeout: Option<Duration>) -> VmArgs {
        VmArgs {
            vm: "demo".into(),
            from: "before-upgrade".into(),
            timeout,
        }
    }

    #[test]
    fn the_timeout_outlasts_the_servers_own_stop_limit() {
        assert_eq!(restore_timeout(30), Duration::from_secs(600));
        assert_eq!(restore_timeout(0), Duration::from_secs(600));
        // 3600 s to stop + 60 s hearthd's slack + 120 s ours.
        assert_eq!(restore_timeout(3600), Duration::from_secs(3780));
    }

    #[tokio::test]
    async fn restore_posts_from_and_prints_the_message() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![
                ok(r#"{"metadata": {"name": "demo"}, "spec": {"stopTimeoutSeconds": 30}}"#),
                ok(
                    r#"{"message": "VirtualMachine \"demo\": 2 disk(s) restored from VirtualMachineSnapshot \"before-upgrade\""}"#,
                ),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let mut out = Vec::new();
        restore_vm(&client, &args(None), &mut out)
            .await
            .expect("restored");
        assert_eq!(
            String::from_utf8_lossy(&out),
            "VirtualMachine \"demo\": 2 disk(s) restored from VirtualMachineSnapshot \"before-upgrade\"\n"
        );
        let seen = server.seen();
        assert_eq!(seen.len(), 2);
        assert_eq!(
            (seen[0].method.as_str(), seen[0].path.as_str()),
            ("GET", "/v1/virtualmachines/demo")
        );
        assert_eq!(
            (seen[1].method.as_str(), seen[1].path.as_str()),
            ("POST", "/v1/virtualmachines/demo/restore")
        );
        let body: Value = serde_json::from_slice(&seen[1].body).expect("JSON");
        assert_eq!(body, json!({"from": "before-upgrade"}));
    }

    #[tokio::test]
    async fn an_explicit_timeout_skips_the_lookup_and_errors_pass_through() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![(
                StatusCode::CONFLICT,
                r#"{"error": "VirtualMachineSnapshot \"before-upgrade\" is InProgress, not Ready"}"#
                    .to_string(),
            )],
        );
        let client = ApiClient::new(&server.socket);
        let err = restore_vm(
            &client,
            &args(Some(Duration::from_secs(5))),
            &mut Vec::new(),
        )
        .await
        .expect_err("409");
        assert_eq!(
            err.to_string(),
            "VirtualMachineSnapshot \"before-upgrade\" is InProgress, not Ready"
        );
        let seen = server.seen();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].path, "/v1/virtualmachines/demo/restore");
    }

    #[tokio::test]
    async fn a_restore_that_outlasts_the_timeout_says_it_may_still_be_going_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("silent.sock");
        // Accepts and never answers, like a daemon busy stopping the VM.
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        let client = ApiClient::new(&socket);
        let err = restore_vm(
            &client,
            &args(Some(Duration::from_millis(50))),
            &mut Vec::new(),
        )
        .await
        .expect_err("times out");
        let text = err.to_string();
        assert!(text.contains("did not answer within"), "{text}");
        assert!(
            text.ends_with(
                "the restore of vm/demo may still be going on: check `hearth describe vm demo`"
            ),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_missing_vm_fails_before_the_restore_request() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![(
                StatusCode::NOT_FOUND,
                r#"{"error": "VirtualMachine \"demo\" not found"}"#.to_string(),
            )],
        );
        let client = ApiClient::new(&server.socket);
        let err = restore_vm(&client, &args(None), &mut Vec::new())
            .await
            .expect_err("404");
        assert_eq!(err.to_string(), "VirtualMachine \"demo\" not found");
        assert_eq!(server.seen().len(), 1);
    }
}
