//! `hearth logs NAME [-f | --previous]`: the VM's serial console.

use std::io::Write;

use hearth_api::Kind;
use http_body_util::BodyExt;

use crate::client::ApiClient;

#[derive(Debug, clap::Args)]
#[command(
    about = "Print a VM's serial console log",
    after_help = "\
The log holds what the guest wrote to its serial port since its QEMU
started. When QEMU starts again (a restart, a crash under runPolicy Always,
a start after a stop), the log it leaves is kept as the previous one:
`--previous` prints it, for example the last words of a guest that crashed.

Examples:
  hearth logs demo
  hearth logs demo -f          # keep printing new output until Ctrl-C
  hearth logs demo --previous  # the console of the start before this one"
)]
pub struct Args {
    /// The VirtualMachine's name.
    #[arg(value_name = "NAME", value_parser = super::parse_name)]
    pub name: String,
    /// Keep the connection open and print new console output as it arrives
    /// (when the VM starts again, the new start's output follows).
    #[arg(short = 'f', long, conflicts_with = "previous")]
    pub follow: bool,
    /// Print the console of the VM's previous start (kept from its second
    /// start on) instead of the current one.
    #[arg(short = 'p', long)]
    pub previous: bool,
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let mut path = format!(
        "{}/console",
        super::object_path(Kind::VirtualMachine, &args.name)
    );
    if args.follow {
        path.push_str("?follow=true");
    } else if args.previous {
        path.push_str("?previous=true");
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
