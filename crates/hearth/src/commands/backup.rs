//! `hearth backup vm VM --to DIR`: a VirtualMachineBackup (docs/backup.md).

use std::io::Write;
use std::time::Duration;

use anyhow::bail;
use chrono::Utc;
use hearth_api::{API_VERSION, Kind, WatchType, object_from_value};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{Value, json};

use super::wait::parse_duration;
use super::{object_path, short_ref};
use crate::client::{ApiClient, ApiError};
use crate::follow::{Follower, Update};
use crate::output::{human_bytes, str_at, u64_at};

#[derive(Debug, clap::Args)]
#[command(
    about = "Back up every disk of a VM into a directory: full the first time, then only what changed",
    after_help = "\
Each backup is a consistent cut of the VM (the guest's filesystems frozen
once, as for `hearth snapshot vm`), read from the cut's own layers and
written into DIR as DISK/NNNN.qcow2 (each incremental one backed by the one
before, by a relative name, so DIR can be moved) with hearth-backup.json
listing every point, its files' SHA-256 and the VM's spec. A backup is
incremental when the previous one's cut can be trusted; otherwise it is full
and `hearth describe backup NAME` says why (reasonFull).

Examples:
  hearth backup vm app --to /srv/backup/app --wait
  hearth backup vm app --to /srv/backup/app --full --wait
  hearth get backups
  hearth backup verify /srv/backup/app   # every file against the manifest"
)]
pub struct Args {
    #[command(subcommand)]
    pub target: Target,
}

#[derive(Debug, clap::Subcommand)]
pub enum Target {
    /// Back up a VirtualMachine's disks.
    #[command(
        after_help = "Examples:\n  hearth backup vm app --to /srv/backup/app --wait\n  hearth backup vm app --to /srv/backup/app --full --name app-weekly"
    )]
    Vm(VmArgs),
    /// Check every file of a backup target against its manifest: there, of
    /// its length and SHA-256, chained to the point before it. Writes
    /// nothing.
    #[command(after_help = "\
hearthd reads DIR (a path on its host) and reports each file as it checks
it, then which points a restore could not make: a damaged file takes with it
every later point of its disk up to the next full one. Files no point names
(what a crash left, `.partial` and `.merged`) are listed; the next backup
into DIR settles them.

Exit status: 0 when every point checked can be restored, 1 otherwise.

Examples:
  hearth backup verify /srv/backup/app
  hearth backup verify /srv/backup/app --at 3   # points 1 to 3 only")]
    Verify(VerifyArgs),
}

#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// The target directory (the `--to` of its backups).
    #[arg(value_name = "DIR")]
    pub dir: std::path::PathBuf,
    /// Check the points up to N only (what a restore `--at N` reads).
    #[arg(long, value_name = "N")]
    pub at: Option<u32>,
}

#[derive(Debug, clap::Args)]
pub struct VmArgs {
    /// The VirtualMachine whose disks are backed up.
    #[arg(value_name = "VM", value_parser = super::parse_name)]
    pub vm: String,
    /// The target directory (absolute, or relative to here); one VM per
    /// directory.
    #[arg(long, value_name = "DIR")]
    pub to: std::path::PathBuf,
    /// A full backup even when an incremental one could be made.
    #[arg(long)]
    pub full: bool,
    /// After the backup, keep the newest N points in DIR: the older ones
    /// are merged into the oldest kept point (which becomes full), without
    /// reading the VM.
    #[arg(long, value_name = "N")]
    pub keep: Option<u32>,
    /// Make every Nth point full (a restore then reads at most N files).
    #[arg(long, value_name = "N")]
    pub full_every: Option<u32>,
    /// The backup's name (default: VM-YYYYMMDD-HHMMSS, UTC).
    #[arg(long, value_name = "NAME", value_parser = super::parse_name)]
    pub name: Option<String>,
    /// Back up even when the guest cannot be frozen (the cut is then not
    /// application-consistent).
    #[arg(long)]
    pub no_require_consistency: bool,
    /// Wait until the backup is Ready (exit 0) or Failed (exit 1), printing
    /// each phase it goes through.
    #[arg(long)]
    pub wait: bool,
    /// With --wait: give up waiting after this long (the backup goes on).
    #[arg(long, value_name = "DURATION", default_value = "30m", value_parser = parse_duration, requires = "wait")]
    pub timeout: Duration,
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let a = match &args.target {
        Target::Vm(a) => a,
        Target::Verify(v) => return verify(client, v, &mut std::io::stdout().lock()).await,
    };
    let mut out = std::io::stdout().lock();
    let to = std::path::absolute(&a.to)?;
    let name = a
        .name
        .clone()
        .unwrap_or_else(|| super::snapshot::default_name(&a.vm, Utc::now()));
    let object = json!({
        "apiVersion": API_VERSION,
        "kind": "VirtualMachineBackup",
        "metadata": {"name": name},
        "spec": {
            "virtualMachineName": a.vm,
            "to": to,
            "mode": if a.full { "Full" } else { "Auto" },
            "requiredConsistency": !a.no_require_consistency,
        },
    });
    let mut object = object;
    if let Some(k) = a.keep {
        object["spec"]["keep"] = json!(k);
    }
    if let Some(n) = a.full_every {
        object["spec"]["fullEvery"] = json!(n);
    }
    object_from_value(object.clone(), "the backup").map_err(anyhow::Error::msg)?;
    let new = super::New {
        kind: Kind::VirtualMachineBackup,
        name: &name,
        made_up_name: a.name.is_none(),
        noun: "backup",
    };
    super::create_only(client, &new, object, &mut out).await?;
    if a.wait {
        let last = follow(client, &name, a.timeout, &mut out).await?;
        writeln!(out, "{}", summary(&name, &last))?;
        if str_at(&last, &["status", "phase"]) == Some("Failed") {
            bail!("{}", summary(&name, &last));
        }
    }
    Ok(())
}

/// Follows the backup on hearthd's change stream until it is Ready or
/// Failed: a line per phase, the copy's bar on a terminal. Asks in turn
/// (every 500 ms) when the stream cannot be opened (hearthd restarting).
async fn follow(
    client: &ApiClient,
    name: &str,
    timeout: Duration,
    out: &mut impl Write,
) -> anyhow::Result<Value> {
    let who = short_ref(Kind::VirtualMachineBackup, name);
    let kind = Kind::VirtualMachineBackup;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut view = View::default();
    let still = |view: &View| {
        anyhow::anyhow!(
            "{who} is still {} after {timeout:?}; it goes on (see `hearth get backups`)",
            view.phase.as_deref().unwrap_or("Pending")
        )
    };
    let path = format!("/v1/watch?kinds={}&name={name}", kind.plural());
    let opened = tokio::time::timeout_at(
        deadline,
        Follower::open(client, path, timeout, Box::new(std::io::stderr())),
    )
    .await;
    let mut follower = match opened {
        Err(_) => return Err(still(&view)),
        Ok(Ok(f)) => f,
        Ok(Err(ApiError::Unreachable { .. })) => loop {
            let obj = client.get(&object_path(kind, name)).await?;
            if let Some(last) = view.show(&who, &obj, out)? {
                return Ok(last);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(still(&view));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        },
        Ok(Err(e)) => return Err(e.into()),
    };
    loop {
        let update = match tokio::time::timeout_at(deadline, follower.next()).await {
            Err(_) => return Err(still(&view)),
            Ok(update) => update?,
        };
        let seen = match update {
            Update::Synced { .. } => follower.informer().get(kind.as_str(), name).cloned(),
            Update::Object {
                type_,
                kind: k,
                name: n,
                object,
                ..
            } if k == kind.as_str() && n == name => {
                if type_ == WatchType::Deleted {
                    view.clear();
                    bail!("{who} was deleted before it was Ready");
                }
                Some(object)
            }
            _ => continue,
        };
        if let Some(obj) = seen
            && let Some(last) = view.show(&who, &obj, out)?
        {
            return Ok(last);
        }
    }
}

/// What `--wait` has shown: the last phase, and the bar while copying.
#[derive(Default)]
struct View {
    phase: Option<String>,
    bar: Option<ProgressBar>,
}

impl View {
    /// Shows `obj`'s phase when it changed and its progress; the object
    /// back when it is Ready or Failed.
    fn show(
        &mut self,
        who: &str,
        obj: &Value,
        out: &mut impl Write,
    ) -> anyhow::Result<Option<Value>> {
        let phase = str_at(obj, &["status", "phase"]).map(str::to_string);
        if phase.is_some() && phase != self.phase {
            self.clear();
            writeln!(out, "{who}: {}", phase.as_deref().unwrap_or(""))?;
            self.phase = phase.clone();
        }
        if let (Some(done), Some(total)) = (
            u64_at(obj, &["status", "progress", "bytesDone"]),
            u64_at(obj, &["status", "progress", "bytesTotal"]),
        ) && watched()
        {
            let b = self.bar.get_or_insert_with(|| copying(total));
            b.set_length(total);
            b.set_position(done);
        }
        if matches!(phase.as_deref(), Some("Ready" | "Failed")) {
            self.clear();
            return Ok(Some(obj.clone()));
        }
        Ok(None)
    }

    fn clear(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}

pub(super) fn watched() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("TERM").is_none_or(|t| t != "dumb")
}

/// Bytes copied on hearthd of the bytes to copy (on a terminal only).
pub(super) fn copying(total: u64) -> ProgressBar {
    bytes_bar(total, "copying")
}

/// A bar of `total` bytes on stderr, named by `what`.
fn bytes_bar(total: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{what} {{wide_bar}} {{binary_bytes}}/{{binary_total_bytes}} {{binary_bytes_per_sec}} {{eta}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// `backup/NAME: Ready, Incremental point 3, 1.1Mi written in 2.3s`
pub fn summary(name: &str, obj: &Value) -> String {
    let who = short_ref(Kind::VirtualMachineBackup, name);
    match str_at(obj, &["status", "phase"]) {
        Some("Failed") => format!(
            "{who} failed: {}: {}",
            str_at(obj, &["status", "reason"]).unwrap_or("?"),
            str_at(obj, &["status", "message"]).unwrap_or("")
        ),
        phase => {
            let mut s = format!(
                "{who}: {}, {} point {}",
                phase.unwrap_or("?"),
                str_at(obj, &["status", "kind"]).unwrap_or("?"),
                u64_at(obj, &["status", "point"]).unwrap_or(0)
            );
            if let Some(b) = u64_at(obj, &["status", "bytesWritten"]) {
                s.push_str(&format!(", {} written", human_bytes(b)));
            }
            if let Some(ms) = u64_at(obj, &["status", "durationMs"]) {
                s.push_str(&format!(" in {:.1}s", ms as f64 / 1000.0));
            }
            if let Some(r) = str_at(obj, &["status", "reasonFull"]) {
                s.push_str(&format!(" (full: {r})"));
            }
            s
        }
    }
}

/// `hearth backup verify DIR`: hearthd's check, a line per file as it comes,
/// then what a restore could and could not make.
pub async fn verify(
    client: &ApiClient,
    args: &VerifyArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let dir = std::path::absolute(&args.dir)?;
    let dir_text = dir
        .to_str()
        .ok_or_else(|| anyhow::anyhow!("{} is not valid UTF-8", dir.display()))?;
    let mut path = format!(
        "/v1/backups/verify?dir={}",
        crate::client::query_escape(dir_text)
    );
    if let Some(n) = args.at {
        path.push_str(&format!("&at={n}"));
    }
    let mut lines = client.lines(&path).await?;
    writeln!(
        out,
        "{:<6} {:<20} {:<28} {:>10}  RESULT",
        "POINT", "DISK", "FILE", "SIZE"
    )?;
    let mut summary = None;
    // Bytes hashed of all, on a terminal; the lines go above it.
    let mut bar: Option<ProgressBar> = None;
    let mut done = 0u64;
    while let Some(line) = lines.next_line().await? {
        let v: Value = serde_json::from_slice(&line)
            .map_err(|e| anyhow::anyhow!("hearthd sent a line that is not JSON: {e}"))?;
        if let Some(bytes) = v.get("plan").and_then(|p| u64_at(p, &["bytes"])) {
            if watched() {
                bar = Some(bytes_bar(bytes, "checking"));
            }
        } else if let Some(n) = v.get("progress").and_then(|p| u64_at(p, &["bytesDone"])) {
            if let Some(b) = &bar {
                b.set_position(n);
            }
        } else if let Some(f) = v.get("file") {
            let result = match str_at(f, &["problem"]) {
                Some(p) => format!("DAMAGED: {p}"),
                None => "ok".to_string(),
            };
            let size = u64_at(f, &["size"]).unwrap_or(0);
            let text = format!(
                "{:<6} {:<20} {:<28} {:>10}  {result}",
                u64_at(f, &["point"]).unwrap_or(0),
                str_at(f, &["disk"]).unwrap_or_default(),
                str_at(f, &["file"]).unwrap_or_default(),
                human_bytes(size),
            );
            done += size;
            match &bar {
                Some(b) => {
                    b.set_position(done);
                    b.suspend(|| writeln!(out, "{text}").and_then(|()| out.flush()))?;
                }
                None => {
                    writeln!(out, "{text}")?;
                    out.flush()?;
                }
            }
        } else if let Some(s) = v.get("summary") {
            summary = Some(s.clone());
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let Some(s) = summary else {
        bail!("hearthd ended the check before its summary (was it restarted?)");
    };
    verdict(&dir, &s, out)
}

/// The summary's lines; an error when a point checked cannot be restored.
fn verdict(dir: &std::path::Path, s: &Value, out: &mut impl Write) -> anyhow::Result<()> {
    let list = |key: &str| -> Vec<String> {
        s[key]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string))
            .collect()
    };
    for stray in list("strays") {
        writeln!(
            out,
            "not part of the backup: {stray} (left by a crash or put there; the next backup into the directory settles .partial and .merged files)"
        )?;
    }
    let points = u64_at(s, &["points"]).unwrap_or(0);
    let files = u64_at(s, &["files"]).unwrap_or(0);
    let bytes = human_bytes(u64_at(s, &["bytes"]).unwrap_or(0));
    let bad = list("unrestorablePoints");
    if bad.is_empty() {
        writeln!(
            out,
            "{}: {points} point(s), {files} file(s), {bytes}: every point can be restored",
            dir.display()
        )?;
        return Ok(());
    }
    bail!(
        "{}: {} damaged file(s) of {files}; point(s) {} cannot be restored (a later full point, if any, can)",
        dir.display(),
        u64_at(s, &["damagedFiles"]).unwrap_or(0),
        bad.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_server::{ScriptedServer, ok};

    #[tokio::test]
    async fn verify_prints_a_line_per_file_and_names_the_points_it_cannot_restore() {
        let dir = tempfile::tempdir().unwrap();
        let lines = [
            json!({"plan": {"files": 2, "bytes": 3145728}}),
            json!({"progress": {"bytesDone": 1048576}}),
            json!({"file": {"point": 1, "disk": "data", "file": "data/0001.qcow2", "size": 2097152,
                "problem": "SHA-256 aa, the manifest says bb (its bytes changed)"}}),
            json!({"file": {"point": 2, "disk": "data", "file": "data/0002.qcow2", "size": 1048576}}),
            json!({"summary": {"points": 2, "files": 2, "bytes": 3145728, "damagedFiles": 1,
                "unrestorablePoints": [1, 2], "strays": ["data/0003.qcow2.partial"]}}),
        ]
        .iter()
        .map(|l| format!("{l}\n"))
        .collect::<String>();
        let server = ScriptedServer::routes(
            dir.path(),
            vec![(
                "GET",
                "/v1/backups/verify?dir=/srv/b%20x&at=2",
                vec![ok(&lines)],
            )],
        );
        let client = ApiClient::new(&server.socket);
        let args = VerifyArgs {
            dir: "/srv/b x".into(),
            at: Some(2),
        };
        let mut out = Vec::new();
        let err = verify(&client, &args, &mut out).await.unwrap_err();
        let text = String::from_utf8(out).unwrap();
        let rows: Vec<&str> = text.lines().collect();
        assert!(rows[0].starts_with("POINT  DISK"), "{text}");
        assert!(
            rows[1].contains("data/0001.qcow2")
                && rows[1].contains("2.0Mi")
                && rows[1]
                    .ends_with("DAMAGED: SHA-256 aa, the manifest says bb (its bytes changed)"),
            "{text}"
        );
        assert!(
            rows[2].contains("data/0002.qcow2") && rows[2].ends_with("  ok"),
            "{text}"
        );
        assert!(
            rows[3].starts_with("not part of the backup: data/0003.qcow2.partial"),
            "{text}"
        );
        assert_eq!(
            err.to_string(),
            "/srv/b x: 1 damaged file(s) of 2; point(s) 1, 2 cannot be restored (a later full point, if any, can)"
        );
    }

    #[tokio::test]
    async fn verify_without_a_summary_is_an_error_not_a_pass() {
        let dir = tempfile::tempdir().unwrap();
        let lines = format!("{}\n", json!({"plan": {"files": 1, "bytes": 1}}));
        let server = ScriptedServer::routes(
            dir.path(),
            vec![("GET", "/v1/backups/verify?dir=/b", vec![ok(&lines)])],
        );
        let client = ApiClient::new(&server.socket);
        let args = VerifyArgs {
            dir: "/b".into(),
            at: None,
        };
        let err = verify(&client, &args, &mut Vec::new()).await.unwrap_err();
        assert!(err.to_string().contains("before its summary"), "{err}");
    }

    #[test]
    fn the_summary_says_kind_point_size_time_and_why_full() {
        let obj = json!({"status": {"phase": "Ready", "kind": "Full", "point": 2,
            "bytesWritten": 2202009, "durationMs": 2300,
            "reasonFull": "disk \"root\" was resized since backup \"a\""}});
        assert_eq!(
            summary("b", &obj),
            "backup/b: Ready, Full point 2, 2.1Mi written in 2.3s (full: disk \"root\" was resized since backup \"a\")"
        );
        let failed =
            json!({"status": {"phase": "Failed", "reason": "CopyFailed", "message": "no space"}});
        assert_eq!(
            summary("b", &failed),
            "backup/b failed: CopyFailed: no space"
        );
    }

    fn parse(args: &[&str]) -> Args {
        use clap::Parser;
        #[derive(Debug, clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let argv = std::iter::once("backup").chain(args.iter().copied());
        Cli::try_parse_from(argv).expect("parses").args
    }

    #[tokio::test]
    async fn a_name_taken_in_the_same_second_says_to_pass_a_name() {
        use crate::test_server::ScriptedServer;
        use hyper::StatusCode;
        let conflict = || {
            (
                StatusCode::CONFLICT,
                r#"{"error": "VirtualMachineBackup exists already"}"#.to_string(),
            )
        };
        let in_progress = || {
            crate::test_server::ok(
                r#"{"metadata": {"name": "b"}, "status": {"phase": "InProgress"}}"#,
            )
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            [conflict(), in_progress(), conflict(), in_progress()].into(),
        );
        let client = ApiClient::new(&server.socket);
        let err = run(&client, &parse(&["vm", "app", "--to", "/srv/b"]))
            .await
            .expect_err("taken");
        let text = err.to_string();
        assert!(
            text.starts_with("backup/app-") && text.contains("(it is InProgress)"),
            "{text}"
        );
        assert!(
            text.ends_with("no new backup was taken (another backup was started in the same second; pass --name)"),
            "{text}"
        );

        let err = run(
            &client,
            &parse(&["vm", "app", "--to", "/srv/b", "--name", "b"]),
        )
        .await
        .expect_err("taken");
        assert!(
            err.to_string()
                .ends_with("(pick another --name, or delete it first)"),
            "{err}"
        );
        let seen = server.seen();
        assert_eq!(seen[0].path, "/v1/apply?create=true");
    }
}
