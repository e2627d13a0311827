//! `hearthd --generate WHAT` (hidden, for packaging): files made from the
//! command line's own definition, so they cannot drift from it: the man
//! page, the commented default configuration file and the shell completion
//! scripts (docs/packaging.md).
//!
//! The flag is added to the command line in `main` rather than declared in
//! `Args`: clap_complete's scripts would offer even a hidden flag, and it is
//! no configuration key.

use std::io::Write;

use clap::CommandFactory;
use clap_complete::Shell;

use crate::Args;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq)]
pub enum Generate {
    /// The man page, hearthd.8.
    Man,
    /// The default /etc/hearth/hearthd.toml: every key commented out, with
    /// its help and its default.
    Config,
    CompleteBash,
    CompleteZsh,
    CompleteFish,
}

pub const ID: &str = "generate";

/// `--generate WHAT`, hidden; no configuration file is read with it.
pub fn arg() -> clap::Arg {
    clap::Arg::new(ID)
        .long(ID)
        .value_name("WHAT")
        .value_parser(clap::builder::EnumValueParser::<Generate>::new())
        .help("Print a file generated from these definitions and exit (for packaging)")
        .hide(true)
}

/// Prints `what` on stdout.
pub fn print(what: Generate) -> anyhow::Result<()> {
    let bytes = render(what)?;
    let mut out = std::io::stdout().lock();
    out.write_all(&bytes)?;
    out.flush()?;
    Ok(())
}

/// The file, in memory (clap_complete panics on a failed write; a closed
/// stdout must be an error, not a panic).
pub fn render(what: Generate) -> anyhow::Result<Vec<u8>> {
    let mut buf = Vec::new();
    let mut complete = |shell: Shell| {
        clap_complete::generate(shell, &mut Args::command(), "hearthd", &mut buf);
    };
    match what {
        Generate::Man => {
            clap_mangen::Man::new(Args::command())
                .section("8")
                .render(&mut buf)?;
        }
        Generate::Config => return Ok(crate::config::render_defaults()?.into_bytes()),
        Generate::CompleteBash => complete(Shell::Bash),
        Generate::CompleteZsh => complete(Shell::Zsh),
        Generate::CompleteFish => complete(Shell::Fish),
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_man_page_is_section_8_and_documents_the_flags_but_not_generate() {
        let page = String::from_utf8(render(Generate::Man).expect("man")).expect("utf-8");
        assert!(page.contains(".TH hearthd 8"), "{page}");
        for flag in [
            "state\\-dir",
            "run\\-dir",
            "print\\-config",
            "HEARTH_CONFIG",
        ] {
            assert!(page.contains(flag), "hearthd.8 lacks {flag}");
        }
        assert!(
            !page.contains("generate"),
            "the hidden --generate is documented"
        );
    }

    #[test]
    fn generate_parses_beside_the_flags_and_is_hidden() {
        let mut cmd = Args::command().arg(arg());
        let m = cmd
            .try_get_matches_from_mut(["hearthd", "--generate", "complete-zsh"])
            .expect("parses");
        assert_eq!(m.get_one::<Generate>(ID), Some(&Generate::CompleteZsh));
        // The daemon's own arguments still come out of the same matches.
        <Args as clap::FromArgMatches>::from_arg_matches(&m).expect("args");
        assert!(!cmd.render_help().to_string().contains("--generate"));
        assert!(
            cmd.try_get_matches_from_mut(["hearthd", "--generate", "html"])
                .is_err()
        );
    }

    #[test]
    fn the_completions_offer_the_flags() {
        for what in [
            Generate::CompleteBash,
            Generate::CompleteZsh,
            Generate::CompleteFish,
        ] {
            let text = String::from_utf8(render(what).expect("script")).expect("utf-8");
            assert!(text.contains("state-dir"), "{what:?}");
            assert!(!text.contains("generate"), "{what:?} offers --generate");
        }
    }
}
