//! `hearth label KIND NAME KEY=VALUE... KEY-...`: set or remove labels.

use std::collections::BTreeMap;
use std::io::Write;

use hearth_api::Kind;
use serde_json::{Value, json};

use super::{object_path, resource_ref};
use crate::client::ApiClient;

#[derive(Debug, clap::Args)]
#[command(
    about = "Set or remove labels of an object (its spec stays as it is)",
    after_help = "\
KEY=VALUE sets a label, KEY- removes it. Labels select VMs for a snapshot
schedule (spec.selector.matchLabels), and `hearth.dev/keep=true` pins a
snapshot: no schedule's retention ever deletes it. An object that comes from
the manifest directory or a git source takes its labels from there.

Examples:
  hearth label vm app tier=prod
  hearth label vmsnapshot nightly-app-202612060230 hearth.dev/keep=true
  hearth label vmsnapshot nightly-app-202612060230 hearth.dev/keep-"
)]
pub struct Args {
    #[arg(value_name = "KIND", value_parser = super::parse_kind, help = super::KIND_HELP)]
    pub kind: Kind,
    /// The object's name.
    #[arg(value_name = "NAME", value_parser = super::parse_name)]
    pub name: String,
    /// KEY=VALUE to set, KEY- to remove.
    #[arg(value_name = "LABEL", required = true, value_parser = parse_change)]
    pub changes: Vec<(String, Option<String>)>,
}

/// `KEY=VALUE` or `KEY-`; the key and value are checked by hearthd, which
/// names the one at fault.
fn parse_change(s: &str) -> Result<(String, Option<String>), String> {
    if let Some((k, v)) = s.split_once('=') {
        if k.is_empty() {
            return Err(format!("{s:?}: no key before '='"));
        }
        return Ok((k.to_string(), Some(v.to_string())));
    }
    if let Some(k) = s.strip_suffix('-').filter(|k| !k.is_empty()) {
        return Ok((k.to_string(), None));
    }
    Err(format!(
        "{s:?}: write KEY=VALUE to set a label or KEY- to remove it"
    ))
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    label(client, args, &mut std::io::stdout().lock()).await
}

pub async fn label(client: &ApiClient, args: &Args, out: &mut impl Write) -> anyhow::Result<()> {
    let labels: BTreeMap<&str, Option<&str>> = args
        .changes
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_deref()))
        .collect();
    let body = json!({"metadata": {"labels": labels}});
    let answer = client
        .patch(&object_path(args.kind, &args.name), &body)
        .await?;
    let now: Vec<String> = answer
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                .collect()
        })
        .unwrap_or_default();
    writeln!(
        out,
        "{} labeled ({})",
        resource_ref(args.kind.as_str(), &args.name),
        if now.is_empty() {
            "no labels".to_string()
        } else {
            now.join(", ")
        }
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_set_and_remove() {
        assert_eq!(
            parse_change("tier=prod"),
            Ok(("tier".into(), Some("prod".into())))
        );
        assert_eq!(parse_change("a=").unwrap().1.as_deref(), Some(""));
        assert_eq!(
            parse_change("hearth.dev/keep-"),
            Ok(("hearth.dev/keep".into(), None))
        );
        assert!(parse_change("tier").is_err());
        assert!(parse_change("=x").is_err());
        assert!(parse_change("-").is_err());
    }
}
