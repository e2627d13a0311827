//! `hearth`: the command line for hearthd. It only speaks hearthd's HTTP API
//! on a unix socket; see docs/cli.md.

mod client;
mod commands;
mod follow;
mod manifest;
mod output;
mod progress;
#[cfg(test)]
mod test_server;

use std::io;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::client::{ApiClient, DEFAULT_SOCKET};
use crate::commands::{
    action, apply, backup, completion, console, convert, cp, delete, describe, events, exec,
    export, get, label, logs, manpages, restore, run, snapshot, sources, ssh, wait,
};

#[derive(Debug, Parser)]
#[command(
    name = "hearth",
    version,
    about = "Drive hearthd, the declarative VM manager, through its API socket",
    after_help = "\
Getting started:
  hearthd &                                   # the daemon (as root)
  hearth apply -f demo.yaml
  hearth wait vm demo --for agent
  hearth get vms
  hearth get vms -w                           # follow changes
  hearth snapshot vm demo --wait

Exit status: 0 on success, 1 on any error (the message starts with `error:`),
2 for a command line clap could not parse."
)]
struct Cli {
    /// hearthd's API socket.
    #[arg(
        long,
        global = true,
        env = "HEARTH_SOCKET",
        value_name = "PATH",
        default_value = DEFAULT_SOCKET
    )]
    socket: PathBuf,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    Apply(apply::Args),
    Get(get::Args),
    Describe(describe::Args),
    /// Start a VM (sets its run intent; for runPolicy Manual)
    #[command(after_help = "Example:\n  hearth start demo")]
    Start(action::Args),
    /// Stop a VM: guest shutdown, then force after spec.stopTimeoutSeconds
    #[command(after_help = "Example:\n  hearth stop demo")]
    Stop(action::Args),
    /// Restart a VM
    #[command(after_help = "Example:\n  hearth restart demo")]
    Restart(action::Args),
    Delete(delete::Args),
    Label(label::Args),
    Logs(logs::Args),
    Console(console::Args),
    Events(events::Args),
    Wait(wait::Args),
    Snapshot(snapshot::Args),
    Backup(backup::Args),
    Restore(restore::Args),
    Ssh(ssh::Args),
    Exec(exec::Args),
    Cp(cp::Args),
    Export(export::Args),
    Run(run::Args),
    Convert(convert::Args),
    Sources(sources::Args),
    Completion(completion::Args),
}

async fn dispatch(cli: Cli) -> anyhow::Result<()> {
    let client = ApiClient::new(cli.socket);
    match &cli.command {
        Command::Apply(a) => apply::run(&client, a).await,
        Command::Get(a) => get::run(&client, a).await,
        Command::Describe(a) => describe::run(&client, a).await,
        Command::Start(a) => action::run(&client, action::Action::Start, a).await,
        Command::Stop(a) => action::run(&client, action::Action::Stop, a).await,
        Command::Restart(a) => action::run(&client, action::Action::Restart, a).await,
        Command::Delete(a) => delete::run(&client, a).await,
        Command::Label(a) => label::run(&client, a).await,
        Command::Logs(a) => logs::run(&client, a).await,
        Command::Console(a) => console::run(&client, a).await,
        Command::Events(a) => events::run(&client, a).await,
        Command::Wait(a) => wait::run(&client, a).await,
        Command::Snapshot(a) => snapshot::run(&client, a).await,
        Command::Backup(a) => backup::run(&client, a).await,
        Command::Restore(a) => restore::run(&client, a).await,
        Command::Ssh(a) => ssh::run(&client, a).await,
        Command::Exec(a) => exec::run(&client, a).await,
        Command::Cp(a) => cp::run(&client, a).await,
        Command::Export(a) => export::run(&client, a).await,
        Command::Run(a) => run::run(&client, a).await,
        Command::Convert(a) => convert::run(a),
        Command::Sources(a) => sources::run(&client, a).await,
        Command::Completion(a) => completion::run(a),
    }
}

/// `hearth get sources` is `hearth sources`: sources are not an object
/// kind, but `get` is where people look for them.
fn sources_alias(args: impl Iterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let mut all: Vec<std::ffi::OsString> = args.collect();
    if let Some(i) = all.iter().position(|a| a == "get")
        && all
            .get(i + 1)
            .is_some_and(|k| k == "sources" || k == "source")
        && all[..i]
            .iter()
            .skip(1)
            .all(|a| a.to_string_lossy().starts_with('-') || a.to_string_lossy().contains('/'))
    {
        all.splice(i..i + 2, [std::ffi::OsString::from("sources")]);
    }
    all
}

fn main() -> ExitCode {
    // `hearth manpages DIR` is not part of `Cli`: hidden from --help, and
    // absent from the completion scripts and the man pages it writes.
    let matches = Cli::command()
        .subcommand(manpages::command())
        .get_matches_from(sources_alias(std::env::args_os()));
    if let Some((manpages::NAME, m)) = matches.subcommand() {
        return report(manpages::run(m));
    }
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    report(runtime.block_on(dispatch(cli)))
}

/// The exit status for a command's result, with the error on stderr.
fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // `hearth get vms | head`: the reader left; that is not our error.
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => match e.downcast::<exec::Exit>() {
            // `hearth exec` ends with the guest program's status.
            Ok(exit) => {
                if let Some(message) = &exit.message {
                    eprintln!("error: {message}");
                }
                ExitCode::from(exit.code)
            }
            Err(e) => {
                // A URL's credentials, quoted back from a manifest, are
                // not shown (docs/http-api.md, "Credentials in URLs").
                let text = format!("{e:#}");
                eprintln!("error: {}", hearth_api::redact::redact_credentials(&text));
                ExitCode::FAILURE
            }
        },
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<io::Error>()
            .is_some_and(|io| io.kind() == io::ErrorKind::BrokenPipe)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_command_teaches_with_an_about_and_an_example() {
        fn check(cmd: &clap::Command, path: &str) {
            for sub in cmd.get_subcommands() {
                let name = format!("{path} {}", sub.get_name());
                assert!(sub.get_about().is_some(), "{name} has no about");
                let after = sub
                    .get_after_help()
                    .map(|s| s.to_string())
                    .unwrap_or_default();
                assert!(
                    after.contains(&name),
                    "{name}'s help has no example: {after:?}"
                );
                check(sub, &name);
            }
        }
        let cli = Cli::command();
        check(&cli, "hearth");
        // The nested commands are checked too, not only the top level.
        let snapshot = cli.find_subcommand("snapshot").expect("snapshot command");
        assert!(snapshot.find_subcommand("disk").is_some());
        assert!(snapshot.find_subcommand("vm").is_some());
    }

    #[test]
    fn socket_flag_and_kinds_parse() {
        let cli = Cli::try_parse_from([
            "hearth",
            "--socket",
            "/tmp/h.sock",
            "get",
            "vms",
            "-o",
            "wide",
        ])
        .expect("parses");
        assert_eq!(cli.socket, PathBuf::from("/tmp/h.sock"));
        assert!(
            matches!(cli.command, Command::Get(ref g) if g.kind == hearth_api::Kind::VirtualMachine && g.output == get::Format::Wide)
        );
        let cli = Cli::try_parse_from([
            "hearth",
            "wait",
            "vm",
            "demo",
            "--for",
            "phase=Running",
            "--timeout",
            "2m",
        ])
        .expect("parses");
        assert!(
            matches!(cli.command, Command::Wait(ref w) if w.timeout == std::time::Duration::from_secs(120))
        );
        assert!(Cli::try_parse_from(["hearth", "get", "pods"]).is_err());
        assert!(Cli::try_parse_from(["hearth", "delete", "vm", "Bad_Name"]).is_err());
        assert!(Cli::try_parse_from(["hearth", "apply"]).is_err());
    }

    #[test]
    fn snapshot_kinds_parse_everywhere_a_kind_is_taken() {
        for (words, kind) in [
            (["get", "snapshots"], hearth_api::Kind::VirtualDiskSnapshot),
            (
                ["get", "vmsnapshots"],
                hearth_api::Kind::VirtualMachineSnapshot,
            ),
        ] {
            let cli = Cli::try_parse_from(["hearth"].into_iter().chain(words)).expect("parses");
            assert!(matches!(cli.command, Command::Get(ref g) if g.kind == kind));
        }
        let cli = Cli::try_parse_from(["hearth", "describe", "vmsnapshot", "pre"]).expect("parses");
        assert!(
            matches!(cli.command, Command::Describe(ref d) if d.kind == hearth_api::Kind::VirtualMachineSnapshot)
        );
        let cli = Cli::try_parse_from(["hearth", "delete", "snapshot", "a", "b"]).expect("parses");
        assert!(
            matches!(cli.command, Command::Delete(ref d) if d.kind == hearth_api::Kind::VirtualDiskSnapshot && d.names.len() == 2)
        );
        let cli = Cli::try_parse_from(["hearth", "wait", "snapshot", "s", "--for", "phase=ready"])
            .expect("parses");
        assert!(matches!(cli.command, Command::Wait(_)));
        let cli = Cli::try_parse_from(["hearth", "restore", "vm", "demo", "--from", "pre"])
            .expect("parses");
        assert!(matches!(cli.command, Command::Restore(_)));
        assert!(Cli::try_parse_from(["hearth", "restore", "vm", "demo"]).is_err());
        assert!(Cli::try_parse_from(["hearth", "snapshot", "disk"]).is_err());
    }

    #[test]
    fn image_commands_and_apply_wait_parse() {
        let cli = Cli::try_parse_from(["hearth", "get", "images", "-o", "wide"]).expect("parses");
        assert!(
            matches!(cli.command, Command::Get(ref g) if g.kind == hearth_api::Kind::VirtualImage)
        );
        let cli = Cli::try_parse_from(["hearth", "wait", "image", "debian-12", "--for", "ready"])
            .expect("parses");
        assert!(
            matches!(cli.command, Command::Wait(ref w) if w.kind == hearth_api::Kind::VirtualImage
                && w.condition == commands::wait::WaitFor::Phase("ready".into()))
        );
        let cli = Cli::try_parse_from([
            "hearth",
            "apply",
            "-f",
            "web.yaml",
            "--wait",
            "--timeout",
            "20m",
        ])
        .expect("parses");
        assert!(
            matches!(cli.command, Command::Apply(ref a) if a.wait && a.timeout == std::time::Duration::from_secs(1200))
        );
        let cli =
            Cli::try_parse_from(["hearth", "apply", "-f", "web.yaml", "--wait"]).expect("parses");
        assert!(
            matches!(cli.command, Command::Apply(ref a) if a.timeout == std::time::Duration::from_secs(600))
        );
        // --timeout means nothing without --wait.
        assert!(
            Cli::try_parse_from(["hearth", "apply", "-f", "web.yaml", "--timeout", "1m"]).is_err()
        );
        assert!(Cli::try_parse_from(["hearth", "delete", "vi", "debian-12"]).is_ok());
    }

    #[test]
    fn apply_help_teaches_an_http_image_with_its_sha256() {
        let mut cli = Cli::command();
        let apply = cli.find_subcommand_mut("apply").expect("apply");
        let help = apply.render_long_help().to_string();
        for needle in [
            "kind: VirtualImage",
            "sha256:",
            "sha256sum debian-12.qcow2",
            "virtualImage: debian-12",
            "--wait",
        ] {
            assert!(
                help.contains(needle),
                "apply --help lacks {needle:?}:\n{help}"
            );
        }
    }
}
