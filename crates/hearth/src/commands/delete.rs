//! `hearth delete KIND NAME...`: remove objects created through the API.

use std::io::Write;

use anyhow::bail;
use hearth_api::Kind;

use super::{object_path, resource_ref};
use crate::client::ApiClient;

#[derive(Debug, clap::Args)]
#[command(
    about = "Delete objects; a VM is stopped first, a disk must not be in use",
    after_help = "\
Objects that come from the manifest directory cannot be deleted here:
remove their file instead.

Examples:
  hearth delete vm demo
  hearth delete disk data scratch"
)]
pub struct Args {
    /// vm or disk.
    #[arg(value_name = "KIND", value_parser = super::parse_kind)]
    pub kind: Kind,
    /// One or more names; each is deleted on its own, so one failure does not stop the rest.
    #[arg(value_name = "NAME", required = true, value_parser = super::parse_name)]
    pub names: Vec<String>,
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    // One name: its error is the error. Several: report each, go on, sum up.
    if let [name] = args.names.as_slice() {
        return delete_one(client, args.kind, name).await;
    }
    let mut failed = 0usize;
    for name in &args.names {
        if let Err(e) = delete_one(client, args.kind, name).await {
            failed += 1;
            eprintln!("error: {e:#}");
        }
    }
    if failed > 0 {
        bail!("{failed} of {} deletions failed", args.names.len());
    }
    Ok(())
}

async fn delete_one(client: &ApiClient, kind: Kind, name: &str) -> anyhow::Result<()> {
    client.delete(&object_path(kind, name)).await?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{} deleted", resource_ref(kind.as_str(), name))?;
    Ok(())
}
