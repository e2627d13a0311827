//! `hearth completion SHELL`: the shell completion script, generated from the
//! command line's own definition (clap_complete), so it cannot drift from it.

use std::io::Write;

use clap::CommandFactory;
use clap_complete::Shell;

#[derive(Debug, clap::Args)]
#[command(
    about = "Print the shell completion script for bash, zsh, fish, elvish or powershell",
    after_help = "\
Examples:
  source <(hearth completion bash)                 # this bash session
  hearth completion bash > ~/.local/share/bash-completion/completions/hearth
  hearth completion zsh > \"${fpath[1]}/_hearth\"
  hearth completion fish > ~/.config/fish/completions/hearth.fish

The Debian package installs the bash, zsh and fish scripts already."
)]
pub struct Args {
    /// The shell to complete for.
    #[arg(value_name = "SHELL", value_enum)]
    pub shell: Shell,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let script = script(args.shell);
    let mut out = std::io::stdout().lock();
    out.write_all(&script)?;
    out.flush()?;
    Ok(())
}

/// The script, in memory: clap_complete panics on a failed write, and
/// `hearth completion bash | head` must not.
pub fn script(shell: Shell) -> Vec<u8> {
    let mut buf = Vec::new();
    clap_complete::generate(shell, &mut crate::Cli::command(), "hearth", &mut buf);
    buf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_script_names_every_command_and_not_the_hidden_one() {
        for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
            let text = String::from_utf8(script(shell)).expect("utf-8");
            for sub in crate::Cli::command().get_subcommands() {
                assert!(
                    text.contains(sub.get_name()),
                    "{shell}: {} is missing",
                    sub.get_name()
                );
            }
            assert!(
                !text.contains(crate::commands::manpages::NAME),
                "{shell}: offers the hidden manpages"
            );
        }
    }
}
