//! The real `git` on a work repository, for the tests of this module.

use std::path::Path;

/// Runs `git -C work ARGS` as Ann Example, with a fixed committer date;
/// its trimmed stdout. Panics with git's stderr when it fails.
pub fn git(work: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(work)
        .args([
            "-c",
            "user.name=Ann Example",
            "-c",
            "user.email=ann@example.org",
        ])
        .args(args)
        .env("GIT_COMMITTER_DATE", "2026-12-07T10:11:12+01:00")
        .output()
        .expect("git (apt-get install git)");
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}
