//! `hearth logs NAME [-f]`: the VM's serial console.

use std::io::Write;

use hearth_api::Kind;
use http_body_util::BodyExt;

use crate::client::ApiClient;

#[derive(Debug, clap::Args)]
#[command(
    about = "Print a VM's serial console log",
    after_help = "\
Examples:
  hearth logs demo
  hearth logs demo -f        # keep printing new output until Ctrl-C"
)]
pub struct Args {
    /// The VirtualMachine's name.
    #[arg(value_name = "NAME", value_parser = super::parse_name)]
    pub name: String,
    /// Keep the connection open and print new console output as it arrives.
    #[arg(short = 'f', long)]
    pub follow: bool,
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let mut path = format!(
        "{}/console",
        super::object_path(Kind::VirtualMachine, &args.name)
    );
    if args.follow {
        path.push_str("?follow=true");
    }
    let mut body = client.stream(&path).await?;
    let mut out = std::io::stdout().lock();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| anyhow::anyhow!("console stream from hearthd broke: {e}"))?;
        if let Ok(data) = frame.into_data() {
            out.write_all(&data)?;
            out.flush()?;
        }
    }
    Ok(())
}
