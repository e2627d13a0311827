//! `hearth manpages DIR` (hidden, for packaging): writes the man pages of
//! `hearth` and of every subcommand (`hearth.1`, `hearth-get.1`,
//! `hearth-snapshot-disk.1`, ...) with clap_mangen, from the command line's
//! own definition.

use std::path::PathBuf;

use anyhow::Context;
use clap::CommandFactory;

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

pub fn run(args: &Args) -> anyhow::Result<()> {
    if !args.dir.is_dir() {
        anyhow::bail!("manpages: {} is not a directory", args.dir.display());
    }
    clap_mangen::generate_to(crate::Cli::command(), &args.dir)
        .with_context(|| format!("manpages: cannot write into {}", args.dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_for_every_visible_command_and_none_for_the_hidden_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        run(&Args {
            dir: dir.path().to_path_buf(),
        })
        .expect("writes");
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
        let get = std::fs::read_to_string(dir.path().join("hearth-get.1")).expect("get");
        assert!(get.contains("wide"), "hearth-get.1 lacks its -o values");
    }
}
