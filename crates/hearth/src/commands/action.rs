//! `hearth start|stop|restart NAME`: change a VM's run intent.

use std::io::Write;

use hearth_api::Kind;
use serde_json::Value;

use crate::client::ApiClient;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Start,
    Stop,
    Restart,
}

impl Action {
    fn verb(self) -> &'static str {
        match self {
            Action::Start => "start",
            Action::Stop => "stop",
            Action::Restart => "restart",
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The VirtualMachine's name.
    #[arg(value_name = "NAME", value_parser = super::parse_name)]
    pub name: String,
}

pub async fn run(client: &ApiClient, action: Action, args: &Args) -> anyhow::Result<()> {
    let path = format!(
        "{}/{}",
        super::object_path(Kind::VirtualMachine, &args.name),
        action.verb()
    );
    let answer = client.post(&path, None).await?;
    let message = answer
        .get("message")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| format!("vm/{}: {} requested", args.name, action.verb()));
    writeln!(std::io::stdout().lock(), "{message}")?;
    Ok(())
}
