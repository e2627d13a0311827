//! `hearth sources`: the sources of desired state (the manifest directory,
//! each git repository) and their state; `hearth sources refresh NAME`
//! fetches a git source now. `hearth get sources` is the same list.

use chrono::{DateTime, Utc};
use clap::Subcommand;
use serde_json::Value;

use crate::client::ApiClient;
use crate::output::{Table, human_age};

#[derive(Debug, clap::Args)]
#[command(
    about = "List the sources of desired state, or fetch a git source now",
    after_help = "Examples:\n  \
  hearth sources                  # NAME KIND STATE REF APPLIED FETCHED REASON\n  \
  hearth get sources              # the same\n  \
  hearth sources -o json          # everything GET /v1/sources says\n  \
  hearth sources refresh prod     # fetch and apply the git source prod now (from a webhook or CI)\n\n\
A git source is configured in hearthd (--git URL, or [[git]] tables in\n\
/etc/hearth/hearthd.toml; docs/sources.md). STATE: Pending (nothing fetched\n\
yet), Ready, Stale (the remote gave no good commit: REASON says why, and the\n\
APPLIED commit stands: nothing is deleted because of the remote), Conflict\n\
(an object is declared twice or refused: `hearth describe` names it)."
)]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<SourcesCommand>,
    /// Output format of the list.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Table)]
    pub output: Format,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum SourcesCommand {
    /// The sources and their state (the default)
    #[command(after_help = "Example:\n  hearth sources list")]
    List,
    /// Fetch a git source now and wait for its apply
    #[command(after_help = "Example:\n  hearth sources refresh prod")]
    Refresh {
        /// The git source's name (hearthd --git-name, or a [[git]] table's name)
        #[arg(value_name = "NAME")]
        name: String,
    },
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    match &args.command {
        None | Some(SourcesCommand::List) => {
            let v = client.get("/v1/sources").await?;
            match args.output {
                Format::Json => println!("{}", serde_json::to_string_pretty(&v["sources"])?),
                Format::Table => print!("{}", table(&v, Utc::now()).render()),
            }
            Ok(())
        }
        Some(SourcesCommand::Refresh { name }) => {
            let path = format!("/v1/sources/{name}/refresh");
            let v = client
                .post_slow(&path, None, std::time::Duration::from_secs(150))
                .await?;
            println!("{}", summary(&v));
            if v["state"] == "Stale" {
                anyhow::bail!("source {name:?} is Stale");
            }
            Ok(())
        }
    }
}

fn short(v: &Value) -> String {
    v["id"]
        .as_str()
        .map(|s| s.chars().take(12).collect())
        .unwrap_or_else(|| "-".to_string())
}

fn when(v: &Value, now: DateTime<Utc>) -> String {
    v.as_str()
        .and_then(|t| t.parse::<DateTime<Utc>>().ok())
        .map(|t| format!("{} ago", human_age(t, now)))
        .unwrap_or_else(|| "-".to_string())
}

/// One line about a git source after a refresh.
pub fn summary(v: &Value) -> String {
    let name = v["name"].as_str().unwrap_or("?");
    let state = v["state"].as_str().unwrap_or("?");
    let applied = &v["appliedCommit"];
    let mut line = format!("source {name}: {state}");
    if applied.is_object() {
        line.push_str(&format!(
            ", applied {} ({})",
            short(applied),
            applied["subject"].as_str().unwrap_or("")
        ));
    }
    if let Some(r) = v["reason"].as_str() {
        line.push_str(&format!("; {r}"));
    }
    line
}

/// The table of `GET /v1/sources`' `sources`.
pub fn table(v: &Value, now: DateTime<Utc>) -> Table {
    let mut t = Table::new(&[
        "NAME", "KIND", "URL", "REF", "STATE", "APPLIED", "FETCHED", "REASON",
    ]);
    for s in v["sources"].as_array().into_iter().flatten() {
        let text = |k: &str| s[k].as_str().unwrap_or("-").to_string();
        let (url, reference) = match s["kind"].as_str() {
            Some("git") => (text("url"), text("ref")),
            _ => (text("path"), "-".to_string()),
        };
        t.push(vec![
            text("name"),
            text("kind"),
            url,
            reference,
            text("state"),
            if s["appliedCommit"].is_object() {
                short(&s["appliedCommit"])
            } else {
                "-".into()
            },
            when(&s["lastFetchAt"], now),
            s["reason"].as_str().unwrap_or("").to_string(),
        ]);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_table_shows_each_source_and_why_it_is_stale() {
        let now = Utc::now();
        let v = json!({"sources": [
            {"name": "directory", "kind": "directory", "path": "/etc/hearth/manifests", "state": "Ready"},
            {"name": "prod", "kind": "git", "url": "https://h/r.git", "ref": "main", "state": "Stale",
             "appliedCommit": {"id": "0123456789abcdef0123", "subject": "cpus 2"},
             "lastFetchAt": (now - chrono::Duration::seconds(5)).to_rfc3339(),
             "reason": "fetching main: unreachable"}
        ]});
        let out = table(&v, now).render();
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("NAME"), "{out}");
        assert!(
            lines[1].starts_with("directory") && lines[1].contains("/etc/hearth/manifests"),
            "{out}"
        );
        assert!(
            lines[2].contains("0123456789ab") && lines[2].contains("Stale"),
            "{out}"
        );
        assert!(
            lines[2].contains("5s ago") && lines[2].ends_with("fetching main: unreachable"),
            "{out}"
        );
        assert_eq!(
            summary(&v["sources"][1]),
            "source prod: Stale, applied 0123456789ab (cpus 2); fetching main: unreachable"
        );
    }
}
