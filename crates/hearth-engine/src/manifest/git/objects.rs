//! A source's cache read through `git cat-file` kept running: one
//! `--batch` (objects) and one `--batch-check` (sizes) per source, asked
//! over their pipes, so reading a commit starts no process; and its
//! applied ref moved by a `git update-ref --stdin` kept running, one
//! transaction per commit. Each answer is
//! git's, from the cache as it is at that moment: git reads the ref again
//! at every request and looks for new packs when an object is not found,
//! so what a fetch added is seen (`objects_added_by_a_fetch_are_seen`).
//!
//! The processes are `git` with the cache's usual settings and
//! `PR_SET_PDEATHSIG`, started from the programs' lasting thread: they die
//! with hearthd. Any failure (a timeout, an answer that cannot be read, an
//! object over its bound) drops them, killed and reaped, and the next read
//! starts them again: a hostile repository costs a restart, never a
//! desynchronised pipe.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout};

use super::repo::{CommitInfo, GitError, base_command, is_commit_id};
use super::tree::{self, TreeEntry};

/// How long one answer may take.
const ANSWER: Duration = Duration::from_secs(60);
/// A commit object larger than this is not one hearth reads.
const MAX_COMMIT: usize = 1 << 20;

/// One object as `cat-file --batch` gives it.
struct Object {
    oid: String,
    kind: String,
    bytes: Vec<u8>,
}

/// One `git` kept running and its pipes.
struct Pipe {
    _child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Pipe {
    async fn start(dir: &Path, args: &[&str]) -> Result<Pipe, GitError> {
        let mut c = base_command(dir)?;
        c.args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = hearth_qemu::programs::spawn_lasting(c)
            .await
            .map_err(|e| broken(format!("starting git {}: {e}", args.join(" "))))?;
        let stdin = child.stdin.take().ok_or_else(|| broken("no stdin"))?;
        let stdout = child.stdout.take().ok_or_else(|| broken("no stdout"))?;
        Ok(Pipe {
            _child: child,
            stdin,
            stdout: BufReader::new(stdout),
        })
    }
}

/// One header line: `OID TYPE SIZE`, or `NAME missing` (None).
async fn header(
    stdout: &mut BufReader<ChildStdout>,
) -> Result<Option<(String, String, usize)>, GitError> {
    let mut line = Vec::new();
    stdout
        .take(1024)
        .read_until(b'\n', &mut line)
        .await
        .map_err(|e| broken(format!("reading: {e}")))?;
    if line.last() != Some(&b'\n') {
        return Err(broken("it stopped answering"));
    }
    let text = String::from_utf8_lossy(&line[..line.len() - 1]).into_owned();
    let f: Vec<&str> = text.split(' ').collect();
    match f.as_slice() {
        [.., "missing"] | [.., "ambiguous"] => Ok(None),
        [oid, kind, size] if is_commit_id(oid) => Ok(Some((
            oid.to_string(),
            kind.to_string(),
            size.parse()
                .map_err(|_| broken(format!("an answer {text:?}")))?,
        ))),
        _ => Err(broken(format!("an answer {text:?}"))),
    }
}

/// The pipe in `slot`, started if it is not running.
async fn open<'a>(
    slot: &'a mut Option<Pipe>,
    dir: &Path,
    args: &[&str],
) -> Result<&'a mut Pipe, GitError> {
    if slot.is_none() {
        *slot = Some(Pipe::start(dir, args).await?);
    }
    Ok(slot.as_mut().expect("just started"))
}

/// Writes one request whole.
async fn send(stdin: &mut ChildStdin, input: &[u8]) -> Result<(), GitError> {
    let written = async {
        stdin.write_all(input).await?;
        stdin.flush().await
    };
    written.await.map_err(|e| broken(format!("writing: {e}")))
}

/// An answer, or why there is none; a pipe that gave none is dropped
/// (killed and reaped), and the next use starts it again.
fn settle<T>(
    pipe: &mut Option<Pipe>,
    answered: Result<Result<T, GitError>, tokio::time::error::Elapsed>,
) -> Result<T, GitError> {
    let failed = match answered {
        Ok(Ok(out)) => return Ok(out),
        Ok(Err(e)) => e,
        Err(_) => broken(format!("no answer within {ANSWER:?}")),
    };
    *pipe = None;
    Err(failed)
}

fn broken(why: impl std::fmt::Display) -> GitError {
    GitError::Objects(why.to_string())
}

/// Names one object per line: nothing that could split a request.
fn request(names: &[&str]) -> Result<Vec<u8>, GitError> {
    let mut input = Vec::new();
    for n in names {
        if n.is_empty() || n.contains(['\n', '\0']) {
            return Err(broken(format!("a bad object name {n:?}")));
        }
        input.extend_from_slice(n.as_bytes());
        input.push(b'\n');
    }
    Ok(input)
}

/// The objects of one source's cache, read through `git cat-file`.
pub struct Objects {
    dir: PathBuf,
    batch: Option<Pipe>,
    check: Option<Pipe>,
    refs: Option<Pipe>,
}

impl Objects {
    pub fn new(dir: &Path) -> Objects {
        Objects {
            dir: dir.to_path_buf(),
            batch: None,
            check: None,
            refs: None,
        }
    }

    /// The objects `names`, each None when the cache does not have it.
    /// Each must be at most `max` bytes; a larger one is an error (and the
    /// process is dropped rather than read through it).
    async fn read(&mut self, names: &[&str], max: usize) -> Result<Vec<Option<Object>>, GitError> {
        let input = request(names)?;
        let Pipe { stdin, stdout, .. } =
            open(&mut self.batch, &self.dir, &["cat-file", "--batch"]).await?;
        let answers = async {
            let write = send(stdin, &input);
            let read = async {
                let mut out = Vec::with_capacity(names.len());
                for name in names {
                    let Some((oid, kind, size)) = header(stdout).await? else {
                        out.push(None);
                        continue;
                    };
                    if size > max {
                        return Err(broken(format!(
                            "{name} is {size} bytes, over the bound of {max}"
                        )));
                    }
                    let mut bytes = vec![0; size + 1];
                    stdout
                        .read_exact(&mut bytes)
                        .await
                        .map_err(|e| broken(format!("reading {name}: {e}")))?;
                    if bytes.pop() != Some(b'\n') {
                        return Err(broken(format!("{name} does not end where git said")));
                    }
                    out.push(Some(Object { oid, kind, bytes }));
                }
                Ok(out)
            };
            let (written, read) = tokio::join!(write, read);
            written?;
            read
        };
        let answered = tokio::time::timeout(ANSWER, answers).await;
        settle(&mut self.batch, answered)
    }

    async fn read_one(&mut self, name: &str, max: usize) -> Result<Option<Object>, GitError> {
        Ok(self.read(&[name], max).await?.pop().flatten())
    }

    /// The commit `reference` names (peeled), as the API shows it; None
    /// when the ref does not exist or names no commit.
    pub async fn describe(&mut self, reference: &str) -> Result<Option<CommitInfo>, GitError> {
        let Some(o) = self
            .read_one(&format!("{reference}^{{commit}}"), MAX_COMMIT)
            .await?
        else {
            return Ok(None);
        };
        if o.kind != "commit" {
            return Ok(None);
        }
        Ok(Some(tree::parse_commit(&o.oid, &o.bytes).map_err(broken)?))
    }

    /// The files under `folder` ("" for the whole tree) of `commit`, in
    /// `git ls-tree -r` order, paths from the root, sizes not filled in;
    /// None when the commit has no such folder. The trees read may add up
    /// to `budget` bytes (else an error).
    pub async fn files(
        &mut self,
        commit: &str,
        folder: &str,
        budget: usize,
    ) -> Result<Option<Vec<TreeEntry>>, GitError> {
        // Each read is bounded by what is left, so the sum stays in budget.
        let mut left = budget;
        let missing = || broken(format!("a tree of commit {commit} is missing"));
        let Some(root) = self.read_one(&format!("{commit}^{{tree}}"), left).await? else {
            return Err(broken(format!("commit {commit} has no tree")));
        };
        left -= root.bytes.len();
        let mut here = root;
        let mut prefix = String::new();
        for part in folder.split('/').filter(|p| !p.is_empty()) {
            let entries = tree::parse_tree(&here.oid, &here.bytes).map_err(broken)?;
            let Some(sub) = entries.into_iter().find(|e| e.name == part && e.is_tree()) else {
                return Ok(None);
            };
            here = self.read_one(&sub.oid, left).await?.ok_or_else(missing)?;
            left -= here.bytes.len();
            prefix.push_str(part);
            prefix.push('/');
        }
        let mut out = Vec::new();
        let mut stack = vec![(
            prefix,
            tree::parse_tree(&here.oid, &here.bytes)
                .map_err(broken)?
                .into_iter(),
        )];
        while let Some((prefix, entries)) = stack.last_mut() {
            let Some(e) = entries.next() else {
                stack.pop();
                continue;
            };
            let path = format!("{prefix}{}", e.name);
            if !e.is_tree() {
                out.push(e.listed(path));
                continue;
            }
            let sub = self.read_one(&e.oid, left).await?.ok_or_else(missing)?;
            left -= sub.bytes.len();
            let entries = tree::parse_tree(&sub.oid, &sub.bytes).map_err(broken)?;
            stack.push((format!("{path}/"), entries.into_iter()));
        }
        Ok(Some(out))
    }

    /// The sizes of the objects `oids` (`cat-file --batch-check`); one the
    /// cache does not have is an error.
    pub async fn sizes(&mut self, oids: &[&str]) -> Result<HashMap<String, u64>, GitError> {
        if oids.is_empty() {
            return Ok(HashMap::new());
        }
        let input = request(oids)?;
        let Pipe { stdin, stdout, .. } =
            open(&mut self.check, &self.dir, &["cat-file", "--batch-check"]).await?;
        let answers = async {
            let write = send(stdin, &input);
            let read = async {
                let mut out = HashMap::new();
                for oid in oids {
                    let (_, _, size) = header(stdout)
                        .await?
                        .ok_or_else(|| broken(format!("{oid} is missing")))?;
                    out.insert(oid.to_string(), size as u64);
                }
                Ok(out)
            };
            let (written, read) = tokio::join!(write, read);
            written?;
            read
        };
        let answered = tokio::time::timeout(ANSWER, answers).await;
        settle(&mut self.check, answered)
    }

    /// Points `name` at `commit`, in one transaction of `git update-ref
    /// --stdin` (git writes the ref under its lock, then renames it).
    pub async fn set_ref(&mut self, name: &str, commit: &str) -> Result<(), GitError> {
        if !is_commit_id(commit) || name.is_empty() || name.contains([' ', '\n', '\0']) {
            return Err(broken(format!("a bad ref update {name:?} {commit:?}")));
        }
        let Pipe { stdin, stdout, .. } =
            open(&mut self.refs, &self.dir, &["update-ref", "--stdin"]).await?;
        let input = format!("start\nupdate {name} {commit}\ncommit\n");
        let answers = async {
            send(stdin, input.as_bytes()).await?;
            for want in ["start: ok", "commit: ok"] {
                let mut line = Vec::new();
                stdout
                    .take(1024)
                    .read_until(b'\n', &mut line)
                    .await
                    .map_err(|e| broken(format!("reading: {e}")))?;
                if line.strip_suffix(b"\n") != Some(want.as_bytes()) {
                    return Err(broken(format!(
                        "git update-ref answered {:?} for {name}",
                        String::from_utf8_lossy(&line)
                    )));
                }
            }
            Ok(())
        };
        let answered = tokio::time::timeout(ANSWER, answers).await;
        settle(&mut self.refs, answered)
    }

    /// The blobs `oids`, each at most `max` bytes.
    pub async fn blobs(
        &mut self,
        oids: &[&str],
        max: usize,
    ) -> Result<HashMap<String, Vec<u8>>, GitError> {
        let mut out = HashMap::new();
        for (oid, o) in oids.iter().zip(self.read(oids, max).await?) {
            match o {
                Some(o) if o.kind == "blob" => {
                    out.insert(oid.to_string(), o.bytes);
                }
                Some(o) => return Err(broken(format!("{oid} is a {}, not a blob", o.kind))),
                None => return Err(broken(format!("{oid} is missing"))),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::super::repo::{APPLIED, Auth, FETCHED, Repo};
    use super::super::test_git::git;
    use super::*;

    /// Through the real `git`, one `Objects` across fetches: each fetch's
    /// commit, trees and blobs are seen by the processes already running,
    /// a ref that does not exist is None, and an object over its bound is
    /// an error after which the next read works.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn objects_added_by_a_fetch_are_seen() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("work");
        std::fs::create_dir_all(work.join("vms/deep")).unwrap();
        git(&work, &["init", "-q", "-b", "main"]);
        std::fs::write(work.join("vms/a.yaml"), "x: 1\n").unwrap();
        std::fs::write(work.join("vms/deep/b.yaml"), "y: 1\n").unwrap();
        std::fs::write(work.join("README"), "r\n").unwrap();
        git(&work, &["add", "-A"]);
        git(&work, &["commit", "-q", "-m", "first line\n\nbody"]);
        let first = git(&work, &["rev-parse", "HEAD"]);
        let cache = Repo::open(&dir.path().join("cache.git")).await.unwrap();
        let url = format!("file://{}", work.display());
        let auth = Auth::default();
        let fetch = || cache.fetch(&url, "main", &auth, ANSWER);
        fetch().await.unwrap();
        let mut o = Objects::new(&cache.dir);
        let info = o.describe(FETCHED).await.unwrap().expect("a commit");
        assert_eq!(info.id, first);
        assert_eq!(info.author, "Ann Example");
        assert_eq!(info.date, "2026-12-07T10:11:12+01:00");
        assert_eq!(info.subject, "first line");
        assert!(info.parents.is_empty());
        assert_eq!(o.describe(APPLIED).await.unwrap(), None);
        let files = o.files(&first, "vms", 1 << 20).await.unwrap().unwrap();
        let paths: Vec<&str> = files.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["vms/a.yaml", "vms/deep/b.yaml"]);
        assert_eq!(o.files(&first, "nowhere", 1 << 20).await.unwrap(), None);
        let all = o.files(&first, "", 1 << 20).await.unwrap().unwrap();
        assert_eq!(all.len(), 3);
        assert!(o.files(&first, "", 10).await.is_err());

        // The next commit, fetched while both processes run.
        std::fs::write(work.join("vms/a.yaml"), "x: 22\n").unwrap();
        git(&work, &["commit", "-q", "-am", "second"]);
        fetch().await.unwrap();
        let next = o.describe(FETCHED).await.unwrap().expect("a commit");
        assert_eq!(next.parents, [first]);
        let files = o.files(&next.id, "vms/", 1 << 20).await.unwrap().unwrap();
        let a = files.iter().find(|e| e.path == "vms/a.yaml").unwrap();
        let sizes = o.sizes(&[a.oid.as_str()]).await.unwrap();
        assert_eq!(sizes[&a.oid], 6);
        // Over the bound: an error, and the process is started again.
        assert!(o.blobs(&[a.oid.as_str()], 5).await.is_err());
        let blobs = o.blobs(&[a.oid.as_str()], 6).await.unwrap();
        assert_eq!(blobs[&a.oid], b"x: 22\n");
        assert!(o.sizes(&[&"0".repeat(40)]).await.is_err());
        // The applied ref, moved twice by one update-ref, read back.
        o.set_ref(APPLIED, &info.id).await.unwrap();
        assert_eq!(o.describe(APPLIED).await.unwrap().unwrap().id, info.id);
        o.set_ref(APPLIED, &next.id).await.unwrap();
        assert_eq!(o.describe(APPLIED).await.unwrap().unwrap().id, next.id);
        assert!(o.set_ref(APPLIED, "not-a-commit").await.is_err());
        // A commit the cache does not have: refused, and the next works.
        assert!(o.set_ref(APPLIED, &"1".repeat(40)).await.is_err());
        o.set_ref(APPLIED, &info.id).await.unwrap();
        assert_eq!(o.describe(APPLIED).await.unwrap().unwrap().id, info.id);
        assert!(o.blobs(&["bad\nname"], 6).await.is_err());
    }
}
