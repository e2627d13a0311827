//! `hearth manpages DIR` (hidden, for packaging): writes the man pages of
//! `hearth` and of every subcommand (`hearth.1`, `hearth-get.1`,
//! `hearth-snapshot-disk.1`, ...) with clap_mangen, from the command line's
//! own definition.
//!
//! It is added to the command line in `main` rather than declared in `Cli`:
//! clap_complete's bash script would offer even a hidden subcommand.

use std::path::PathBuf;

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches};

pub const NAME: &str = "manpages";

#[derive(Debug, clap::Args)]
#[command(
    about = "Write the man pages of hearth and its subcommands into DIR (for packaging)",
    after_help = "\
Example:
  hearth manpages target/man && man -l target/man/hearth-get.1"
)]
pub struct Args {
    /// An existing directory; files of the same name are replaced.
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
}

/// The hidden subcommand, for `main` to add to `Cli`'s.
pub fn command() -> clap::Command {
    <Args as clap::Args>::augment_args(clap::Command::new(NAME)).hide(true)
}

pub fn run(matches: &clap::ArgMatches) -> anyhow::Result<()> {
    let args = Args::from_arg_matches(matches).map_err(|e| anyhow::anyhow!("{e}"))?;
    write(&args.dir)
}

fn write(dir: &std::path::Path) -> anyhow::Result<()> {
    if !dir.is_dir() {
        anyhow::bail!("manpages: {} is not a directory", dir.display());
    }
    clap_mangen::generate_to(crate::Cli::command(), dir)
        .with_context(|| format!("manpages: cannot write into {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hidden_command_parses_and_teaches() {
        let mut cli = crate::Cli::command().subcommand(command());
        let m = cli
            .try_get_matches_from_mut(["hearth", "manpages", "/tmp/man"])
            .expect("parses");
        let (name, m) = m.subcommand().expect("a subcommand");
        assert_eq!(name, NAME);
        let args = Args::from_arg_matches(m).expect("args");
        assert_eq!(args.dir, PathBuf::from("/tmp/man"));
        let sub = cli.find_subcommand(NAME).expect("added");
        assert!(sub.is_hide_set());
        assert!(sub.get_about().is_some());
        let help = cli.render_help().to_string();
        assert!(
            !help.contains(NAME),
            "--help lists the hidden command:\n{help}"
        );
    }

    #[test]
    fn a_page_for_every_visible_command_and_none_for_the_hidden_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(dir.path()).expect("writes");
        for page in [
            "hearth.1",
            "hearth-get.1",
            "hearth-completion.1",
            "hearth-snapshot.1",
            "hearth-snapshot-disk.1",
            "hearth-snapshot-vm.1",
        ] {
            let text = std::fs::read_to_string(dir.path().join(page)).expect(page);
            assert!(text.contains(".SH NAME"), "{page}: {text}");
        }
        assert!(!dir.path().join("hearth-manpages.1").exists());
        assert!(!dir.path().join("hearth-help.1").exists());
        let top = std::fs::read_to_string(dir.path().join("hearth.1")).expect("hearth.1");
        assert!(!top.contains(NAME), "hearth.1 lists the hidden command");
        let get = std::fs::read_to_string(dir.path().join("hearth-get.1")).expect("get");
        assert!(get.contains("wide"), "hearth-get.1 lacks its -o values");
    }

    #[test]
    fn a_missing_directory_is_named() {
        let e = write(std::path::Path::new("/nonexistent/man"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/man"), "{e}");
    }
}
