//! Git repositories for the tests and benchmarks of git sources: the
//! `git` program with a fixed identity, a bare remote with a clone to
//! commit in, and a `git` ahead in hearthd's PATH that misbehaves on cue.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs git in `dir` with a fixed identity and no user configuration.
pub fn git(dir: &Path, args: &[&str]) -> String {
    git_env(dir, args, &[])
}

/// [`git`] with extra environment variables.
pub fn git_env(dir: &Path, args: &[&str], env: &[(&str, &Path)]) -> String {
    let out = Command::new("git")
        .args(args)
        .envs(env.iter().copied())
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

/// How a test commit is signed.
#[derive(Clone, Copy)]
pub enum Signing<'a> {
    /// With this ssh private key.
    Ssh(&'a Path),
    /// With the OpenPGP key `key` (a fingerprint) of the gpg home `home`.
    OpenPgp { home: &'a Path, key: &'a str },
}

/// An OpenPGP signing key without a passphrase, in a gpg home of its own.
/// Signing starts a gpg-agent for that home: dropped, the agent is stopped.
pub struct PgpKey {
    pub home: PathBuf,
    pub fingerprint: String,
    /// The armored public key.
    pub public: String,
}

impl PgpKey {
    /// A new key named `name` under `dir`.
    pub fn new(dir: &Path, name: &str) -> PgpKey {
        use std::os::unix::fs::PermissionsExt;
        let home = dir.join(format!("{name}.gnupg"));
        std::fs::create_dir_all(&home).unwrap();
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700)).unwrap();
        let mut key = PgpKey {
            home,
            fingerprint: String::new(),
            public: String::new(),
        };
        let uid = format!("{name} <{name}@hearth.invalid>");
        key.gpg(&[
            "--passphrase",
            "",
            "--quick-gen-key",
            &uid,
            "ed25519",
            "sign",
            "never",
        ]);
        key.fingerprint = key
            .gpg(&["--with-colons", "--list-keys", &uid])
            .lines()
            .find_map(|l| {
                l.strip_prefix("fpr:")
                    .map(|r| r.trim_matches(':').to_string())
            })
            .expect("a fingerprint");
        key.public = key.gpg(&["--export", "--armor", &key.fingerprint.clone()]);
        key
    }

    fn gpg(&self, args: &[&str]) -> String {
        let out = Command::new("gpg")
            .env("GNUPGHOME", &self.home)
            .args(["--batch", "--quiet"])
            .args(args)
            .output()
            .expect("gpg (apt-get install gnupg)");
        assert!(
            out.status.success(),
            "gpg {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn signing(&self) -> Signing<'_> {
        Signing::OpenPgp {
            home: &self.home,
            key: &self.fingerprint,
        }
    }
}

impl Drop for PgpKey {
    fn drop(&mut self) {
        let _ = Command::new("gpgconf")
            .env("GNUPGHOME", &self.home)
            .args(["--kill", "all"])
            .output();
    }
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
        self.commit_as(files, message, key.map(Signing::Ssh))
    }

    /// [`Remote::commit`], signed as `signing` says when given.
    pub fn commit_as(
        &self,
        files: &[(&str, Option<&str>)],
        message: &str,
        signing: Option<Signing<'_>>,
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
        let mut args = vec!["commit", "--quiet", "--allow-empty", "-m", message];
        let mut env = Vec::new();
        let key;
        match signing {
            None => {}
            Some(Signing::Ssh(k)) => {
                key = format!("user.signingkey={}", k.display());
                args.splice(0..0, ["-c", "gpg.format=ssh", "-c", key.as_str()]);
                args.push("-S");
            }
            Some(Signing::OpenPgp { home, key: id }) => {
                key = format!("user.signingkey={id}");
                args.splice(0..0, ["-c", "gpg.format=openpgp", "-c", key.as_str()]);
                args.push("-S");
                env.push(("GNUPGHOME", home));
            }
        }
        git_env(&self.work, &args, &env);
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
