//! The `git` program on a source's cache: a bare repository of hearthd's
//! own (`STATE/git/NAME.git`), never a checkout. Fetches go into it; files
//! are read from its objects (`objects.rs`, `git cat-file` kept running),
//! so no path in the repository ever names a file on the host and no link
//! is ever followed.
//! hearthd never commits, pushes or writes into the remote.
//!
//! Why the `git` program: it speaks every transport (https, ssh,
//! `file://`, `git://`) with the user's usual helpers, checks what it
//! fetches (`transfer.fsckObjects`), and runs outside the daemon's
//! address space, in the bounded program pool, with a timeout and killed
//! when dropped (docs/sources.md).

use std::path::{Path, PathBuf};
use std::time::Duration;

use hearth_qemu::programs;

/// Where fetched commits land in the cache.
pub const FETCHED: &str = "refs/hearth/fetched";
/// The last applied commit: kept so a rewritten history can be told, and
/// its objects are never pruned.
pub const APPLIED: &str = "refs/hearth/applied";

const QUICK: Duration = Duration::from_secs(60);
const MAX_SMALL_OUTPUT: usize = 1024 * 1024;

/// A `git` run that did not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum GitError {
    #[error("{0}")]
    Missing(#[from] hearth_qemu::tools::MissingTool),
    #[error("git {what}: {source}")]
    Run {
        what: String,
        #[source]
        source: programs::RunError,
    },
    #[error("git {what} failed ({status}): {said}")]
    Failed {
        what: String,
        status: std::process::ExitStatus,
        said: String,
    },
    #[error("git cat-file: {0}")]
    Objects(String),
    #[error("making the cache {path}: {source}")]
    Cache {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Whose signatures make a commit verified.
#[derive(Clone, Debug, Default)]
pub struct Signers {
    /// ssh keys, in ssh's `allowed_signers` format.
    pub allowed_signers: Option<PathBuf>,
    /// OpenPGP public keys (armored or binary).
    pub allowed_keys: Option<PathBuf>,
}

impl Signers {
    pub fn is_set(&self) -> bool {
        self.allowed_signers.is_some() || self.allowed_keys.is_some()
    }

    /// The files named in a reason.
    pub fn files(&self) -> String {
        [&self.allowed_signers, &self.allowed_keys]
            .into_iter()
            .flatten()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" or ")
    }
}

/// A source's cache repository.
#[derive(Clone, Debug)]
pub struct Repo {
    pub dir: PathBuf,
    /// Given to every git run: a fetch's credentials ([`Auth`]).
    env: Vec<(String, String)>,
}

/// How a fetch proves who it is: https with a user and a token read from
/// a file at each fetch (rotated tokens need no restart), ssh with a key
/// and a known_hosts file (a host not in it is refused).
#[derive(Clone, Debug, Default)]
pub struct Auth {
    pub username: Option<String>,
    pub token_file: Option<PathBuf>,
    pub ssh_key: Option<PathBuf>,
    pub known_hosts: Option<PathBuf>,
    /// https: the CAs (PEM) a server's certificate must chain to, in place
    /// of the system's bundle (a self-hosted server with a private CA).
    pub ca_file: Option<PathBuf>,
}

impl Auth {
    /// The environment of a fetch: credentials go by environment (only
    /// root reads another root process's), never on a command line.
    fn env(&self) -> Result<Vec<(String, String)>, GitError> {
        use base64::Engine as _;
        let mut config: Vec<(&str, String)> = Vec::new();
        if let Some(file) = &self.token_file {
            let token = std::fs::read_to_string(file).map_err(|source| GitError::Cache {
                path: file.clone(),
                source,
            })?;
            let user = self.username.as_deref().unwrap_or("git");
            let basic = base64::engine::general_purpose::STANDARD
                .encode(format!("{user}:{}", token.trim()));
            config.push(("http.extraHeader", format!("Authorization: Basic {basic}")));
        }
        if let Some(ca) = &self.ca_file {
            // Read by git at each fetch: a renewed CA needs no restart.
            config.push(("http.sslCAInfo", ca.display().to_string()));
        }
        let mut env = vec![("GIT_CONFIG_COUNT".to_string(), config.len().to_string())];
        for (i, (key, value)) in config.into_iter().enumerate() {
            env.push((format!("GIT_CONFIG_KEY_{i}"), key.to_string()));
            env.push((format!("GIT_CONFIG_VALUE_{i}"), value));
        }
        let quote = |p: &Path| format!("'{}'", p.display().to_string().replace('\'', "'\\''"));
        let mut ssh = String::from("ssh -o BatchMode=yes -o StrictHostKeyChecking=yes");
        if let Some(k) = &self.ssh_key {
            ssh.push_str(&format!(" -o IdentitiesOnly=yes -i {}", quote(k)));
        }
        if let Some(h) = &self.known_hosts {
            ssh.push_str(&format!(" -o UserKnownHostsFile={}", quote(h)));
        }
        env.push(("GIT_SSH_COMMAND".into(), ssh));
        Ok(env)
    }
}

/// What `git` is told on every run: no terminal prompt, no user or system
/// configuration, objects checked as they arrive.
pub(super) fn base_command(dir: &Path) -> Result<tokio::process::Command, GitError> {
    let mut c = tokio::process::Command::new(hearth_qemu::tools::find_binary("git")?);
    c.env_clear()
        .env(
            "PATH",
            std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()),
        )
        .env("HOME", dir)
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_ASKPASS", "/bin/false")
        .env("SSH_ASKPASS", "/bin/false")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("LC_ALL", "C")
        .arg("--git-dir")
        .arg(dir)
        .args(["-c", "transfer.fsckObjects=true"])
        .args(["-c", "fetch.fsckObjects=true"])
        .args(["-c", "core.hooksPath=/dev/null"])
        .args(["-c", "gc.auto=0"])
        // Nor a `git maintenance` run after each fetch: the cache is small
        // and hearthd's own.
        .args(["-c", "maintenance.auto=false"])
        .args(["-c", "protocol.file.allow=always"])
        .args(["-c", "http.lowSpeedLimit=1", "-c", "http.lowSpeedTime=30"]);
    // A git run outlives no hearthd: killed when the daemon dies, even by
    // SIGKILL (a fetch from a stalled remote would otherwise run on).
    // SAFETY: prctl is async-signal-safe and touches only the child.
    unsafe {
        c.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(c)
}

impl Repo {
    /// Opens (creating it the first time) the cache at `dir`.
    pub async fn open(dir: &Path) -> Result<Repo, GitError> {
        let repo = Repo {
            dir: dir.to_path_buf(),
            env: Vec::new(),
        };
        if !dir.join("HEAD").is_file() {
            // A half-made cache (a crash during init) is made again.
            let _ = std::fs::remove_dir_all(dir);
            std::fs::create_dir_all(dir).map_err(|source| GitError::Cache {
                path: dir.to_path_buf(),
                source,
            })?;
            repo.run(
                "init",
                &["init", "--bare", "--quiet"],
                None,
                QUICK,
                MAX_SMALL_OUTPUT,
            )
            .await?;
        }
        Ok(repo)
    }

    async fn run(
        &self,
        what: &str,
        args: &[&str],
        input: Option<&[u8]>,
        timeout: Duration,
        max_output: usize,
    ) -> Result<programs::Finished, GitError> {
        let mut c = base_command(&self.dir)?;
        c.envs(self.env.iter().map(|(k, v)| (k, v)));
        c.args(args);
        let limits = programs::Limits {
            timeout,
            stdout: max_output,
            stderr: 64 * 1024,
        };
        programs::run(c, programs::Class::Copy, input, limits)
            .await
            .map_err(|source| GitError::Run {
                what: what.to_string(),
                source,
            })
    }

    async fn ok(
        &self,
        what: &str,
        args: &[&str],
        input: Option<&[u8]>,
        timeout: Duration,
        max_output: usize,
    ) -> Result<Vec<u8>, GitError> {
        let out = self.run(what, args, input, timeout, max_output).await?;
        if !out.status.success() {
            return Err(GitError::Failed {
                what: what.to_string(),
                status: out.status,
                said: said(&out.stderr),
            });
        }
        Ok(out.stdout)
    }

    /// Removes what a git killed in the middle of a write left in the cache:
    /// lock files (a `refs/hearth/fetched.lock` fails every later fetch with
    /// "File exists", so the source would stay Stale for good) and
    /// half-written packs (`objects/pack/tmp_*`, and repack's `.tmp-*`; git
    /// sweeps them only in a `git gc`, which hearthd never runs). Called by
    /// [`Repo::fetch`], while no git writes the cache: a source's syncs take
    /// turns, and its readers write nothing. The paths removed.
    pub fn remove_leftovers(&self) -> Vec<PathBuf> {
        fn locks(dir: &Path, deep: bool, out: &mut Vec<PathBuf>) {
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                let path = e.path();
                match e.file_type() {
                    Ok(t) if t.is_dir() && deep => locks(&path, deep, out),
                    Ok(t) if t.is_file() && e.file_name().to_string_lossy().ends_with(".lock") => {
                        out.push(path)
                    }
                    _ => {}
                }
            }
        }
        let mut found = Vec::new();
        // HEAD, config, packed-refs, shallow; then every ref.
        locks(&self.dir, false, &mut found);
        locks(&self.dir.join("refs"), true, &mut found);
        let pack = self.dir.join("objects/pack");
        for e in std::fs::read_dir(&pack).into_iter().flatten().flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("tmp_") || name.starts_with(".tmp-") {
                found.push(e.path());
            }
        }
        found.retain(|path| match std::fs::remove_file(path) {
            Ok(()) => {
                tracing::warn!(path = %path.display(), "removed what a killed git left in the cache");
                true
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove what a killed git left in the cache");
                false
            }
        });
        found
    }

    /// Fetches `reference` (a branch, a tag, or `HEAD`) of `url` into
    /// [`FETCHED`], following a rewritten history (`+`). A commit id is
    /// fetched by asking for every branch and tag and then looking for it.
    pub async fn fetch(
        &self,
        url: &str,
        reference: &str,
        auth: &Auth,
        timeout: Duration,
    ) -> Result<(), GitError> {
        self.remove_leftovers();
        let with_auth = Repo {
            dir: self.dir.clone(),
            env: auth.env()?,
        };
        // A branch, a tag, HEAD or a full ref name, as git itself resolves
        // it (a branch before a tag of the same name).
        let refspec = if is_commit_id(reference) {
            "+refs/heads/*:refs/hearth/heads/*".to_string()
        } else {
            format!("+{reference}:{FETCHED}")
        };
        with_auth
            .ok(
                "fetch",
                &[
                    "fetch",
                    "--quiet",
                    "--no-tags",
                    "--no-write-fetch-head",
                    "--no-recurse-submodules",
                    "--",
                    url,
                    &refspec,
                ],
                None,
                timeout,
                MAX_SMALL_OUTPUT,
            )
            .await?;
        if is_commit_id(reference) {
            let _ = with_auth
                .ok(
                    "fetch",
                    &[
                        "fetch",
                        "--quiet",
                        "--no-write-fetch-head",
                        "--",
                        url,
                        "+refs/tags/*:refs/hearth/tags/*",
                    ],
                    None,
                    timeout,
                    MAX_SMALL_OUTPUT,
                )
                .await;
            self.ok(
                "update-ref",
                &["update-ref", FETCHED, &format!("{reference}^{{commit}}")],
                None,
                QUICK,
                MAX_SMALL_OUTPUT,
            )
            .await?;
        }
        Ok(())
    }

    /// Whether `older` is an ancestor of `newer` (a fast-forward), or the
    /// history was rewritten.
    pub async fn is_ancestor(&self, older: &str, newer: &str) -> Result<bool, GitError> {
        let out = self
            .run(
                "merge-base",
                &["merge-base", "--is-ancestor", older, newer],
                None,
                QUICK,
                MAX_SMALL_OUTPUT,
            )
            .await?;
        match out.status.code() {
            Some(0) => Ok(true),
            Some(1) => Ok(false),
            _ => Err(GitError::Failed {
                what: "merge-base".into(),
                status: out.status,
                said: said(&out.stderr),
            }),
        }
    }

    /// Whether `commit` carries a signature by an allowed key: an ssh
    /// signature by a key of `policy.allowed_signers` (the `ssh-keygen`
    /// format git reads from `gpg.ssh.allowedSignersFile`), or an OpenPGP
    /// one by a key of `policy.allowed_keys`. Ok(Err(why)) when it does not.
    pub async fn verify(
        &self,
        commit: &str,
        policy: &Signers,
    ) -> Result<Result<String, String>, GitError> {
        let mut args: Vec<String> = Vec::new();
        let mut env: Vec<(String, String)> = Vec::new();
        match &policy.allowed_signers {
            Some(f) => args.push(format!("gpg.ssh.allowedSignersFile={}", f.display())),
            // No ssh key is allowed: an empty list, never the user's.
            None => args.push("gpg.ssh.allowedSignersFile=/dev/null".into()),
        }
        // gpg reads only a keyring of hearthd's own holding exactly the
        // allowed keys, so a good signature is an allowed one; without
        // `allowed_keys` that keyring is empty.
        let home = self.keyring(policy.allowed_keys.as_deref()).await?;
        env.push(("GNUPGHOME".into(), home.display().to_string()));
        let mut full: Vec<&str> = Vec::new();
        for a in &args {
            full.extend(["-c", a.as_str()]);
        }
        full.extend(["verify-commit", "--raw", commit]);
        let with_keys = Repo {
            dir: self.dir.clone(),
            env,
        };
        let out = with_keys
            .run("verify-commit", &full, None, QUICK, MAX_SMALL_OUTPUT)
            .await?;
        let text = said(&out.stderr);
        Ok(if out.status.success() {
            Ok(text)
        } else if text.is_empty() {
            Err(format!(
                "it is not signed (git verify-commit: {})",
                out.status
            ))
        } else {
            Err(text)
        })
    }

    /// The gpg home holding the keys of `keys` (armored or binary), made
    /// again whenever the file's bytes change; an empty one for `None`.
    /// It lives beside the cache (`NAME.gnupg`), a directory of hearthd's
    /// own: made under a temporary name and renamed, so a crash leaves
    /// either the old keyring or the new one, and a leftover temporary is
    /// removed at the next build.
    async fn keyring(&self, keys: Option<&Path>) -> Result<PathBuf, GitError> {
        use sha2::Digest as _;
        let home = self.dir.with_extension("gnupg");
        let bytes = match keys {
            Some(k) => std::fs::read(k).map_err(|source| GitError::Cache {
                path: k.to_path_buf(),
                source,
            })?,
            None => Vec::new(),
        };
        let stamp = format!("{:x}", sha2::Sha256::digest(&bytes));
        let stamp_file = home.join("hearth-keys.sha256");
        if std::fs::read_to_string(&stamp_file).ok().as_deref() == Some(stamp.as_str()) {
            return Ok(home);
        }
        let cache_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| GitError::Cache { path, source }
        };
        let tmp = self.dir.with_extension("gnupg.new");
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(cache_err(&tmp))?;
        std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(cache_err(&tmp))?;
        if !bytes.is_empty() {
            let mut c = tokio::process::Command::new(hearth_qemu::tools::find_binary("gpg")?);
            c.env_clear()
                .env("LC_ALL", "C")
                .env("GNUPGHOME", &tmp)
                .args(["--batch", "--no-autostart", "--quiet", "--import"]);
            let limits = programs::Limits {
                timeout: QUICK,
                stdout: MAX_SMALL_OUTPUT,
                stderr: 64 * 1024,
            };
            let out = programs::run(c, programs::Class::Copy, Some(&bytes), limits)
                .await
                .map_err(|source| GitError::Run {
                    what: "gpg --import".into(),
                    source,
                })?;
            if !out.status.success() {
                return Err(GitError::Failed {
                    what: format!(
                        "gpg --import of {}",
                        keys.unwrap_or(Path::new("")).display()
                    ),
                    status: out.status,
                    said: said(&out.stderr),
                });
            }
        }
        std::fs::write(tmp.join("hearth-keys.sha256"), &stamp).map_err(cache_err(&tmp))?;
        let _ = std::fs::remove_dir_all(&home);
        std::fs::rename(&tmp, &home).map_err(cache_err(&home))?;
        Ok(home)
    }

    /// Repacks the cache into one pack once it holds more than
    /// `max_packs`: each fetch leaves a pack of its own, and a cache of
    /// thousands of packs makes every object lookup slower. What the refs
    /// reach is kept; what a rewritten history left behind goes. git
    /// writes the new pack whole before it removes the old ones, so a
    /// crash leaves one or the other, and a `cat-file` reader running
    /// meanwhile reads on.
    /// Whether it repacked.
    pub async fn repack_if_over(
        &self,
        max_packs: usize,
        timeout: Duration,
    ) -> Result<bool, GitError> {
        let packs = std::fs::read_dir(self.dir.join("objects/pack"))
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".pack"))
                    .count()
            })
            .unwrap_or(0);
        if packs <= max_packs {
            return Ok(false);
        }
        self.ok(
            "repack",
            &["repack", "-a", "-d", "-q"],
            None,
            timeout,
            MAX_SMALL_OUTPUT,
        )
        .await?;
        Ok(true)
    }
}

/// A commit as the API shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CommitInfo {
    pub id: String,
    /// Its parents' ids: a commit whose parent is the one applied is a
    /// fast-forward without asking `git merge-base`.
    #[serde(skip)]
    pub parents: Vec<String>,
    pub author: String,
    pub date: String,
    pub subject: String,
}

/// A full hexadecimal commit id (SHA-1 or SHA-256).
pub fn is_commit_id(s: &str) -> bool {
    (s.len() == 40 || s.len() == 64) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// What git said, its last lines, without credentials a URL may carry.
fn said(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    // git's advice after any failed transport says nothing; the line
    // before it (ssh's "Host key verification failed.") does.
    let advice = [
        "Please make sure you have the correct access rights",
        "and the repository exists.",
    ];
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| !l.trim().is_empty() && !advice.contains(&l.trim()))
        .collect();
    let tail = lines[lines.len().saturating_sub(3)..].join("; ");
    hearth_api::redact::redact_credentials(&tail).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn commit_ids_and_redaction() {
        assert!(is_commit_id(&"a".repeat(40)));
        assert!(!is_commit_id("main"));
        assert!(!is_commit_id(&"g".repeat(40)));
        assert_eq!(
            said(b"fatal: https://bob:tok@h:1/r.git not found; http://h/x"),
            "fatal: https://***@h:1/r.git not found; http://h/x"
        );
    }

    #[test]
    fn a_token_and_a_ca_file_are_git_settings_in_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "tok\n").unwrap();
        let auth = Auth {
            username: Some("deploy".into()),
            token_file: Some(token),
            ca_file: Some("/etc/ca.pem".into()),
            ..Auth::default()
        };
        let env: HashMap<String, String> = auth.env().unwrap().into_iter().collect();
        assert_eq!(env["GIT_CONFIG_COUNT"], "2");
        assert_eq!(env["GIT_CONFIG_KEY_0"], "http.extraHeader");
        // base64("deploy:tok")
        assert_eq!(
            env["GIT_CONFIG_VALUE_0"],
            "Authorization: Basic ZGVwbG95OnRvaw=="
        );
        assert_eq!(env["GIT_CONFIG_KEY_1"], "http.sslCAInfo");
        assert_eq!(env["GIT_CONFIG_VALUE_1"], "/etc/ca.pem");
        let none: HashMap<String, String> = Auth::default().env().unwrap().into_iter().collect();
        assert_eq!(none["GIT_CONFIG_COUNT"], "0");
        assert!(!none.contains_key("GIT_CONFIG_KEY_0"));
    }

    /// A work repository on branch main, an empty cache, and the work's URL.
    async fn work_and_cache(dir: &Path) -> (PathBuf, Repo, String) {
        let work = dir.join("work");
        std::fs::create_dir_all(&work).unwrap();
        super::super::test_git::git(&work, &["init", "-q", "-b", "main"]);
        let cache = Repo::open(&dir.join("cache.git")).await.unwrap();
        let url = format!("file://{}", work.display());
        (work, cache, url)
    }

    /// Through the real `git`: a ref lock and a half-written pack, each left
    /// by a git killed mid-write (SIGKILL after `prepare` of a ref
    /// transaction; during an `index-pack`), do not stop the next fetch,
    /// and are gone after it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn what_a_killed_git_left_in_the_cache_is_removed_by_the_next_fetch() {
        use std::io::Write as _;
        let dir = tempfile::tempdir().unwrap();
        let (work, cache, url) = work_and_cache(dir.path()).await;
        let git = |args: &[&str]| super::super::test_git::git(&work, args);
        let commit = |text: &str| {
            std::fs::write(work.join("a.yaml"), text).unwrap();
            git(&["add", "a.yaml"]);
            git(&["commit", "-q", "-m", text]);
            git(&["rev-parse", "HEAD"])
        };
        let first = commit("x: 1\n");
        cache
            .fetch(&url, "main", &Auth::default(), QUICK)
            .await
            .unwrap();
        let in_cache = |args: &[&str]| {
            std::process::Command::new("git")
                .arg("--git-dir")
                .arg(&cache.dir)
                .args(args)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap()
        };
        // Killed holding the lock of the fetched ref.
        let mut update = in_cache(&["update-ref", "--stdin"]);
        let mut stdin = update.stdin.take().unwrap();
        writeln!(stdin, "start\nupdate {FETCHED} {first}\nprepare").unwrap();
        let mut answers = std::io::BufReader::new(update.stdout.take().unwrap());
        let mut line = String::new();
        for _ in 0..2 {
            std::io::BufRead::read_line(&mut answers, &mut line).unwrap();
        }
        assert_eq!(line, "start: ok\nprepare: ok\n");
        update.kill().unwrap();
        update.wait().unwrap();
        // Killed with half a pack written.
        let mut index = in_cache(&["index-pack", "--stdin"]);
        let pack = std::process::Command::new("git")
            .arg("-C")
            .arg(&work)
            .args(["pack-objects", "--revs", "--stdout", "-q"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut pack = pack;
        writeln!(pack.stdin.take().unwrap(), "HEAD").unwrap();
        let pack = pack.wait_with_output().unwrap().stdout;
        index
            .stdin
            .take()
            .unwrap()
            .write_all(&pack[..pack.len() / 2])
            .unwrap();
        let tmp_pack = || {
            std::fs::read_dir(cache.dir.join("objects/pack"))
                .unwrap()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("tmp_"))
                .collect::<Vec<_>>()
        };
        let mut waited = 0;
        while tmp_pack().is_empty() && waited < 100 {
            std::thread::sleep(Duration::from_millis(20));
            waited += 1;
        }
        index.kill().unwrap();
        index.wait().unwrap();
        let lock = cache.dir.join("refs/hearth/fetched.lock");
        assert!(lock.is_file(), "git left no lock");
        assert_eq!(tmp_pack().len(), 1, "git left no half-written pack");
        // git alone fails on the lock.
        let second = commit("x: 2\n");
        let raw = std::process::Command::new("git")
            .arg("--git-dir")
            .arg(&cache.dir)
            .args(["-c", "protocol.file.allow=always", "fetch", "-q", &url])
            .arg(format!("+refs/heads/main:{FETCHED}"))
            .output()
            .unwrap();
        assert!(!raw.status.success());
        assert!(String::from_utf8_lossy(&raw.stderr).contains("File exists"));

        cache
            .fetch(&url, "main", &Auth::default(), QUICK)
            .await
            .unwrap();
        let fetched = std::process::Command::new("git")
            .arg("--git-dir")
            .arg(&cache.dir)
            .args(["rev-parse", FETCHED])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&fetched.stdout).trim(), second);
        assert!(!lock.exists());
        assert_eq!(tmp_pack(), Vec::<String>::new());
        // Nothing left: nothing removed.
        assert_eq!(cache.remove_leftovers(), Vec::<PathBuf>::new());
    }

    /// Through the real `git`: every fetch leaves a pack; past the bound
    /// they become one, and what the refs name is still there.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cache_of_many_packs_is_repacked_into_one() {
        let dir = tempfile::tempdir().unwrap();
        let (work, cache, url) = work_and_cache(dir.path()).await;
        let git = |args: &[&str]| super::super::test_git::git(&work, args);
        let packs = || {
            std::fs::read_dir(cache.dir.join("objects/pack"))
                .unwrap()
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".pack"))
                .count()
        };
        for i in 0..4 {
            std::fs::write(work.join("a.yaml"), format!("x: {i}\n")).unwrap();
            git(&["add", "a.yaml"]);
            git(&["commit", "-q", "-m", &format!("c{i}")]);
            cache
                .fetch(&url, "main", &Auth::default(), QUICK)
                .await
                .unwrap();
        }
        let before = packs();
        assert!(before >= 4, "{before} packs after 4 fetches");
        // A reader already running, its packs open, reads on after it.
        let mut objects = super::super::objects::Objects::new(&cache.dir);
        let head = objects.describe(FETCHED).await.unwrap().expect("a commit");
        assert_eq!(head.subject, "c3");
        assert!(!cache.repack_if_over(before, QUICK).await.unwrap());
        assert!(cache.repack_if_over(2, QUICK).await.unwrap());
        assert_eq!(packs(), 1);
        let files = objects.files(&head.id, "", 1 << 20).await.unwrap().unwrap();
        let blobs = objects.blobs(&[files[0].oid.as_str()], 100).await.unwrap();
        assert_eq!(blobs[&files[0].oid], b"x: 3\n");
    }
}
