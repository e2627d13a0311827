//! `hearth apply -f FILE`: send objects to hearthd; it creates or updates them.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::client::ApiClient;
use crate::manifest;
use crate::output::str_at;

#[derive(Debug, clap::Args)]
#[command(
    about = "Create or update objects from manifest files (YAML or JSON)",
    after_help = "\
Relative paths in a manifest (spec.boot.kernel, spec.boot.initrd,
spec.source.image) are resolved against the manifest file's directory,
or the current directory for stdin.

Examples:
  hearth apply -f demo.yaml
  hearth apply -f manifests/            # every *.yaml, *.yml, *.json in it
  cat demo.yaml | hearth apply -f -"
)]
pub struct Args {
    /// A manifest file, a directory of them (not recursive), or `-` for stdin.
    /// Repeat to apply several; all are sent together, all or nothing.
    #[arg(short = 'f', long = "filename", value_name = "FILE", required = true)]
    pub files: Vec<PathBuf>,
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let loaded = manifest::load(&args.files)?;
    if loaded.is_empty() {
        bail!("no objects to apply: the manifests hold no documents");
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
    let mut out = std::io::stdout().lock();
    out.write_all(render_results(&answer)?.as_bytes())?;
    Ok(())
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
}
