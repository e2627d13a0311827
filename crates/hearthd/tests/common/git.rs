//! Git repositories for the tests and benchmarks of git sources: the
//! `git` program with a fixed identity, a bare remote with a clone to
//! commit in, and a `git` ahead in hearthd's PATH that misbehaves on cue.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs git in `dir` with a fixed identity and no user configuration.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_AUTHOR_NAME", "hearth test")
        .env("GIT_AUTHOR_EMAIL", "test@hearth.invalid")
        .env("GIT_COMMITTER_NAME", "hearth test")
        .env("GIT_COMMITTER_EMAIL", "test@hearth.invalid")
        .output()
        .expect("git (apt-get install git)");
    assert!(
        out.status.success(),
        "git {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A bare repository (the remote) and a clone to commit in.
pub struct Remote {
    _dir: tempfile::TempDir,
    pub root: PathBuf,
    pub bare: PathBuf,
    pub work: PathBuf,
}

impl Remote {
    pub fn new() -> Remote {
        let dir = tempfile::Builder::new()
            .prefix("hearth-git-")
            .tempdir()
            .unwrap();
        let root = dir.path().to_path_buf();
        let bare = root.join("remote.git");
        let work = root.join("work");
        std::fs::create_dir_all(&work).unwrap();
        git(
            &root,
            &["init", "--quiet", "--bare", "-b", "main", "remote.git"],
        );
        git(&work, &["init", "--quiet", "-b", "main"]);
        git(&work, &["remote", "add", "origin", bare.to_str().unwrap()]);
        Remote {
            _dir: dir,
            root,
            bare,
            work,
        }
    }

    /// Writes (Some) or removes (None) files, commits, pushes; the commit.
    pub fn commit(&self, files: &[(&str, Option<&str>)], message: &str) -> String {
        self.commit_signed(files, message, None)
    }

    /// [`Remote::commit`], signed with the ssh key `key` when given.
    pub fn commit_signed(
        &self,
        files: &[(&str, Option<&str>)],
        message: &str,
        key: Option<&Path>,
    ) -> String {
        for (path, text) in files {
            let p = self.work.join(path);
            match text {
                Some(t) => {
                    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                    std::fs::write(&p, t).unwrap();
                }
                None => {
                    let _ = std::fs::remove_file(&p);
                }
            }
        }
        git(&self.work, &["add", "-A"]);
        let signing = key.map(|k| format!("user.signingkey={}", k.display()));
        let mut args = vec!["commit", "--quiet", "--allow-empty", "-m", message];
        if let Some(s) = &signing {
            args.splice(0..0, ["-c", "gpg.format=ssh", "-c", s.as_str()]);
            args.push("-S");
        }
        git(&self.work, &args);
        git(
            &self.work,
            &["push", "--quiet", "--force", "origin", "HEAD:main"],
        );
        git(&self.work, &["rev-parse", "HEAD"])
    }

    /// Moves the branch to `commit`, as a force push does.
    pub fn force_push(&self, commit: &str) {
        git(&self.work, &["reset", "--quiet", "--hard", commit]);
        git(
            &self.work,
            &["push", "--quiet", "--force", "origin", "HEAD:main"],
        );
    }

    pub fn url(&self) -> String {
        format!("file://{}", self.bare.display())
    }
}

/// A directory holding a `git` that runs `script` (a POSIX shell body; the
/// real git is `$REAL`), to put ahead in hearthd's PATH; the PATH to give it.
pub fn git_wrapper(dir: &Path, script: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let real = String::from_utf8(
        Command::new("sh")
            .args(["-c", "command -v git"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap()
    .trim()
    .to_string();
    std::fs::write(bin.join("git"), format!("#!/bin/sh\nREAL={real}\n{script}")).unwrap();
    std::fs::set_permissions(bin.join("git"), std::fs::Permissions::from_mode(0o755)).unwrap();
    format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}
