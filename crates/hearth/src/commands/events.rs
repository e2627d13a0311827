//! `hearth events [-w] [--for KIND[/NAME]] [-o json]`: what hearthd recorded
//! about objects, and with `-w` each new event as it is recorded.
//!
//! Both forms read the change stream (`GET /v1/watch?objects=false&events=true`):
//! its initial list is the newest events, so without `-w` the command stops
//! at the list's end, and with it goes on from exactly there.

use std::io::Write;

use chrono::{DateTime, Utc};
use hearth_api::Kind;
use serde_json::Value;

use super::short_ref;
use crate::client::ApiClient;
use crate::follow::{Follower, RECONNECT_FOR, Update};
use crate::output::{Table, at, cell, human_age, str_at, time_at};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// AGE TYPE REASON OBJECT MESSAGE.
    #[default]
    Table,
    /// One JSON object per line: the event and its `seq`.
    Json,
}

/// `--for vm/demo`, or `--for vm` for every VM; `--for source/NAME` for a
/// source of manifests (a git repository).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subject {
    /// None: the sources of manifests, which are not objects.
    pub kind: Option<Kind>,
    pub name: Option<String>,
}

pub fn parse_subject(s: &str) -> Result<Subject, String> {
    let (kind, name) = match s.split_once('/') {
        Some((k, n)) => (k, Some(n)),
        None => (s, None),
    };
    let kind = match kind {
        "source" | "sources" => None,
        k => Some(super::parse_kind(k)?),
    };
    let name = name.map(super::parse_name).transpose()?;
    Ok(Subject { kind, name })
}

#[derive(Debug, clap::Args)]
#[command(
    about = "List the events hearthd recorded, or follow them as they happen",
    after_help = "\
Events say what hearthd did and why: a VM started, a disk was created, a
snapshot's cut was consistent or not, an import failed and will be retried.
The newest 200 are kept per object. With -w the list is followed: each new
event is printed once, as it is recorded, until interrupted; when hearthd
restarts, the watch reconnects and goes on from the last event shown (a
note on stderr says so).

Examples:
  hearth events
  hearth events --for vm/demo
  hearth events -w --for snapshot
  hearth events --for source/prod
  hearth events -w -o json"
)]
pub struct Args {
    /// After the list, print each new event as it is recorded.
    #[arg(short = 'w', long)]
    pub watch: bool,
    /// Only events about this object (vm/demo, disk/data, snapshot/s1), or
    /// about every object of a kind (vm); source/NAME for a git source's
    /// own (Stale, Unverified, HistoryRewritten, FileIgnored).
    #[arg(long = "for", value_name = "KIND[/NAME]", value_parser = parse_subject)]
    pub subject: Option<Subject>,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Table)]
    pub output: Format,
    /// How many of the newest events to list first.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    events(
        client,
        args,
        &mut std::io::stdout(),
        Box::new(std::io::stderr()),
    )
    .await
}

/// The stream's path for these arguments.
pub fn path_of(args: &Args) -> String {
    let mut path = format!("/v1/watch?objects=false&events=true&limit={}", args.limit);
    if let Some(s) = &args.subject {
        let kinds = s.kind.map_or("sources", |k| k.plural());
        path.push_str(&format!("&kinds={kinds}"));
        if let Some(name) = &s.name {
            path.push_str(&format!("&name={name}"));
        }
    }
    path
}

pub async fn events(
    client: &ApiClient,
    args: &Args,
    out: &mut impl Write,
    notes: Box<dyn Write + Send>,
) -> anyhow::Result<()> {
    let mut follower = match Follower::open(client, path_of(args), RECONNECT_FOR, notes).await {
        Ok(f) => f,
        Err(e) => return Err(e.into()),
    };
    let mut listed: Vec<(u64, Value)> = Vec::new();
    // The table's column widths, once its header is printed.
    let mut widths: Option<Vec<usize>> = None;
    let mut synced = false;
    loop {
        match follower.next().await? {
            Update::Event { seq, event } if !synced => listed.push((seq, event)),
            Update::Event { seq, event } => {
                write_events(args.output, &[(seq, event)], Utc::now(), &mut widths, out)?;
            }
            Update::Synced { first: true, .. } => {
                synced = true;
                if listed.is_empty() {
                    if !args.watch {
                        eprintln!("No events found.");
                        return Ok(());
                    }
                } else {
                    write_events(args.output, &listed, Utc::now(), &mut widths, out)?;
                    listed.clear();
                }
                if !args.watch {
                    return Ok(());
                }
            }
            Update::Synced { .. }
            | Update::Object { .. }
            | Update::Relisted(_)
            | Update::Lost(_) => {}
        }
        out.flush()?;
    }
}

/// `vm/demo` for a kind this CLI knows, else `kind/name` as sent.
fn object_of(event: &Value) -> String {
    let kind = str_at(event, &["kind"]).unwrap_or("?");
    let name = str_at(event, &["name"]).unwrap_or("?");
    match Kind::from_user(kind) {
        Some(k) => short_ref(k, name),
        None => format!("{}/{name}", kind.to_ascii_lowercase()),
    }
}

/// Prints events: table rows (the header once) or JSON lines.
pub fn write_events(
    format: Format,
    events: &[(u64, Value)],
    now: DateTime<Utc>,
    widths: &mut Option<Vec<usize>>,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    match format {
        Format::Json => {
            for (seq, event) in events {
                let mut line = serde_json::Map::new();
                line.insert("seq".into(), Value::from(*seq));
                if let Value::Object(fields) = event {
                    line.extend(fields.iter().map(|(k, v)| (k.clone(), v.clone())));
                }
                writeln!(out, "{}", Value::Object(line))?;
            }
        }
        Format::Table => {
            let mut table = Table::new(&["AGE", "TYPE", "REASON", "OBJECT", "MESSAGE"]);
            for (_, e) in events {
                table.push(vec![
                    time_at(e, &["time"])
                        .map(|t| human_age(t, now))
                        .unwrap_or_else(|| "-".to_string()),
                    cell(at(e, &["type"])),
                    cell(at(e, &["reason"])),
                    object_of(e),
                    cell(at(e, &["message"])),
                ]);
            }
            match widths {
                Some(w) => out.write_all(table.render_rows(w).as_bytes())?,
                None => {
                    out.write_all(table.render().as_bytes())?;
                    *widths = Some(table.widths());
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_server::{ScriptedServer, ok};
    use serde_json::json;

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2025-01-01T12:00:00Z")
            .expect("time")
            .with_timezone(&Utc)
    }

    fn event(minutes_ago: i64, reason: &str, kind: &str, name: &str, message: &str) -> Value {
        json!({"time": (now() - chrono::Duration::minutes(minutes_ago)).to_rfc3339(),
               "kind": kind, "name": name, "type": "Normal", "reason": reason, "message": message})
    }

    #[test]
    fn subjects_are_a_kind_and_maybe_a_name() {
        assert_eq!(
            parse_subject("vm/demo"),
            Ok(Subject {
                kind: Some(Kind::VirtualMachine),
                name: Some("demo".into())
            })
        );
        assert_eq!(
            parse_subject("snapshots"),
            Ok(Subject {
                kind: Some(Kind::VirtualDiskSnapshot),
                name: None
            })
        );
        assert_eq!(
            parse_subject("source/prod"),
            Ok(Subject {
                kind: None,
                name: Some("prod".into())
            })
        );
        assert!(parse_subject("pod/x").is_err());
        assert!(parse_subject("vm/Bad_Name").is_err());
        assert!(parse_subject("vm/a/b").is_err());
        let args = Args {
            watch: true,
            subject: parse_subject("vm/demo").ok(),
            output: Format::Table,
            limit: 20,
        };
        assert_eq!(
            path_of(&args),
            "/v1/watch?objects=false&events=true&limit=20&kinds=virtualmachines&name=demo"
        );
        let args = Args {
            subject: parse_subject("source/prod").ok(),
            ..args
        };
        assert_eq!(
            path_of(&args),
            "/v1/watch?objects=false&events=true&limit=20&kinds=sources&name=prod"
        );
    }

    #[test]
    fn a_table_then_rows_under_it_or_json_lines_with_their_seq() {
        let mut widths = None;
        let mut out = Vec::new();
        write_events(
            Format::Table,
            &[
                (
                    3,
                    event(3, "Created", "VirtualDisk", "data", "blank qcow2 created"),
                ),
                (
                    4,
                    event(1, "Started", "VirtualMachine", "demo", "qemu pid 42"),
                ),
            ],
            now(),
            &mut widths,
            &mut out,
        )
        .expect("table");
        write_events(
            Format::Table,
            &[(
                5,
                event(0, "Stopped", "VirtualMachine", "demo", "by request"),
            )],
            now(),
            &mut widths,
            &mut out,
        )
        .expect("row");
        assert_eq!(
            String::from_utf8(out).expect("utf-8"),
            "\
AGE   TYPE     REASON    OBJECT      MESSAGE
3m    Normal   Created   disk/data   blank qcow2 created
1m    Normal   Started   vm/demo     qemu pid 42
0s    Normal   Stopped   vm/demo     by request
"
        );
        let mut out = Vec::new();
        write_events(
            Format::Json,
            &[(7, event(0, "Started", "VirtualMachine", "demo", "x"))],
            now(),
            &mut None,
            &mut out,
        )
        .expect("json");
        let line: Value = serde_json::from_slice(&out).expect("one JSON line");
        assert_eq!(line["seq"], 7);
        assert_eq!(line["reason"], "Started");
        assert_eq!(out.iter().filter(|b| **b == b'\n').count(), 1);
    }

    #[tokio::test]
    async fn without_watch_the_list_ends_at_its_bookmark() {
        let dir = tempfile::tempdir().expect("tempdir");
        let body = [
            json!({"seq": 2, "type": "EVENT", "kind": "VirtualDisk", "name": "data",
                   "event": event(2, "Created", "VirtualDisk", "data", "made")}),
            json!({"seq": 2, "type": "BOOKMARK"}),
            // Never read: the command has returned.
            json!({"seq": 3, "type": "EVENT", "kind": "VirtualDisk", "name": "data",
                   "event": event(0, "Deleted", "VirtualDisk", "data", "gone")}),
        ]
        .iter()
        .map(|l| format!("{l}\n"))
        .collect::<String>();
        let server = ScriptedServer::start(dir.path(), vec![ok(&body)]);
        let args = Args {
            watch: false,
            subject: None,
            output: Format::Json,
            limit: 100,
        };
        let mut out = Vec::new();
        events(
            &ApiClient::new(&server.socket),
            &args,
            &mut out,
            Box::new(std::io::sink()),
        )
        .await
        .expect("events");
        let text = String::from_utf8(out).expect("utf-8");
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(text.contains("\"made\""), "{text}");
        assert_eq!(
            server.seen()[0].path,
            "/v1/watch?objects=false&events=true&limit=100"
        );
    }
}
