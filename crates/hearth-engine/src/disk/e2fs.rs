//! e2fsprogs on a disk exported as a file (`hearth_qemu::storage_daemon`):
//! `e2fsck`, `resize2fs` and `debugfs`, each in the program pool with its
//! output and time bounded. Used to prepare a new disk from a rootfs image
//! and to put a kernel image's modules into a VM's root disk.
//!
//! debugfs exits 0 whatever its commands did: a caller reads its stderr
//! ([`complaints`]) and reads back what it wrote.

use std::ffi::OsStr;
use std::path::Path;
use std::time::Duration;

use hearth_qemu::programs;

pub const CHECK_TIMEOUT: Duration = Duration::from_secs(600);
pub const RESIZE_TIMEOUT: Duration = Duration::from_secs(1800);
pub const DEBUGFS_TIMEOUT: Duration = Duration::from_secs(120);
/// A tree written or dumped in one debugfs run (a kernel's modules: a few
/// thousand files).
pub const DEBUGFS_TREE_TIMEOUT: Duration = Duration::from_secs(900);
const MAX_OUTPUT: usize = 64 * 1024;

/// A program that could not be run to its end.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("{0}")]
    Missing(#[from] hearth_qemu::tools::MissingTool),
    #[error("{tool}: {source}")]
    Run {
        tool: String,
        #[source]
        source: programs::RunError,
    },
}

/// What debugfs said about a request it could not answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DebugfsSaid(pub String);

/// What a path in a filesystem is, as `debugfs stat` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    Missing,
    Regular,
    Directory,
    Symlink,
    Other(String),
}

/// A path inside debugfs's double quotes (the caller made sure it holds
/// no quote and no control character: [`quotable`]).
pub fn quote(p: &str) -> String {
    format!("\"{p}\"")
}

/// Whether a debugfs command can name `text` inside double quotes.
pub fn quotable(text: &str) -> Result<(), char> {
    match text.chars().find(|c| *c == '"' || c.is_control()) {
        Some(c) => Err(c),
        None => Ok(()),
    }
}

/// The debugfs command that stats `path`.
pub fn stat_request(path: &str) -> String {
    format!("stat {}", quote(path))
}

/// What `debugfs -R 'stat PATH'` printed, read: its type, or missing.
pub fn parse_found(stdout: &str, stderr: &str) -> Result<Found, DebugfsSaid> {
    if let Some(line) = stdout.lines().find(|l| l.starts_with("Inode:")) {
        let t =
            field_text(line, "Type:").ok_or_else(|| DebugfsSaid(format!("no type in {line:?}")))?;
        return Ok(match t.as_str() {
            "regular" => Found::Regular,
            "directory" => Found::Directory,
            "symlink" => Found::Symlink,
            other => Found::Other(other.to_string()),
        });
    }
    if stderr.contains("File not found by ext2_lookup") {
        return Ok(Found::Missing);
    }
    Err(DebugfsSaid(complaints(stderr).join("; ")))
}

/// The lines of debugfs's stderr that complain (not its version banner).
pub fn complaints(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter(|l| !l.starts_with("debugfs ") && !l.trim().is_empty())
        .map(str::to_string)
        .collect()
}

/// What a file is, read back from `debugfs stat`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inode {
    pub found: Found,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
}

pub fn parse_inode(stdout: &str) -> Option<Inode> {
    let found = parse_found(stdout, "").ok()?;
    let all = stdout.lines().take(4).collect::<Vec<_>>().join("  ");
    let num = |key: &str| field_text(&all, key);
    Some(Inode {
        found,
        mode: u32::from_str_radix(&num("Mode:")?, 8).ok()?,
        uid: num("User:")?.parse().ok()?,
        gid: num("Group:")?.parse().ok()?,
        size: num("Size:")?.parse().ok()?,
    })
}

/// The text after `key` in a debugfs line, up to the next run of two
/// spaces (types such as `character special` hold one).
fn field_text(line: &str, key: &str) -> Option<String> {
    let at = line.find(key)? + key.len();
    let rest = line[at..].trim_start();
    let end = rest.find("  ").unwrap_or(rest.len());
    Some(rest[..end].trim().to_string())
}

/// What `e2fsck` found.
#[derive(Debug, Clone)]
pub struct Fsck {
    /// Exit 0, or 1 for `-p` (it fixed something harmless).
    pub passed: bool,
    /// Its exit status and the tail of what it printed.
    pub said: String,
}

/// `e2fsck FLAGS DEVICE`.
pub async fn e2fsck(device: &Path, flags: &str) -> Result<Fsck, ToolError> {
    let out = tool(
        "e2fsck",
        &[OsStr::new(flags), device.as_os_str()],
        None,
        CHECK_TIMEOUT,
        programs::Class::Copy,
    )
    .await?;
    let code = out.status.code();
    let passed = code == Some(0) || (flags == "-fp" && code == Some(1));
    let said = format!("{} {}", text(&out.stdout), text(&out.stderr));
    Ok(Fsck {
        passed,
        said: format!("exit {}: {}", out.status, tail(said.trim())),
    })
}

/// `debugfs ARGS DEVICE`, run in `dir` (the paths of a script's `write`
/// commands are relative to it), with `input` as its standard input.
pub async fn debugfs(
    device: &Path,
    dir: &Path,
    args: &[String],
    input: Option<&[u8]>,
    timeout: Duration,
) -> Result<programs::Finished, ToolError> {
    let mut all: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
    all.push(device.as_os_str());
    let mut command = tokio::process::Command::new(hearth_qemu::tools::find_binary("debugfs")?);
    command
        .args(&all)
        .current_dir(dir)
        .env("DEBUGFS_PAGER", "__none__");
    run(command, "debugfs", input, timeout, programs::Class::Quick).await
}

/// `debugfs -R 'stat PATH'` on `device` (read-only), as printed.
async fn stat_raw(device: &Path, dir: &Path, path: &str) -> Result<programs::Finished, ToolError> {
    let request = ["-R".to_string(), stat_request(path)];
    debugfs(device, dir, &request, None, DEBUGFS_TIMEOUT).await
}

/// Stats `path` in `device` (read-only).
pub async fn stat(
    device: &Path,
    dir: &Path,
    path: &str,
) -> Result<Result<Found, DebugfsSaid>, ToolError> {
    let out = stat_raw(device, dir, path).await?;
    Ok(parse_found(&text(&out.stdout), &text(&out.stderr)))
}

/// What a link in a filesystem points to: the `Fast link dest` debugfs
/// `stat` shows for a short target, else (a target in a block of its own)
/// the bytes `debugfs cat` prints.
pub async fn link_target(
    device: &Path,
    dir: &Path,
    path: &str,
) -> Result<Result<String, DebugfsSaid>, ToolError> {
    let out = stat_raw(device, dir, path).await?;
    if let Some(t) = parse_fast_link(&text(&out.stdout)) {
        return Ok(Ok(t));
    }
    let out = debugfs(
        device,
        dir,
        &["-R".into(), format!("cat {}", quote(path))],
        None,
        DEBUGFS_TIMEOUT,
    )
    .await?;
    let t = text(&out.stdout);
    Ok(if t.is_empty() || t.len() > 4096 {
        Err(DebugfsSaid(format!(
            "the link {path:?} reads as {} bytes: {}",
            t.len(),
            complaints(&text(&out.stderr)).join("; ")
        )))
    } else {
        Ok(t)
    })
}

/// The target in a `Fast link dest: "TARGET"` line of `debugfs stat`.
pub fn parse_fast_link(stdout: &str) -> Option<String> {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("Fast link dest: "))?;
    let t = line.trim_end().strip_prefix('"')?.strip_suffix('"')?;
    Some(t.to_string())
}

/// A path resolved inside a filesystem one component at a time, links
/// followed within it: an absolute target from the filesystem's root, a
/// `..` never above it. The shell looks up each [`Resolve::next`] path
/// and says whether it is a link ([`Resolve::link`]) or not
/// ([`Resolve::other`]); a missing component is kept as it is named.
#[derive(Debug, Clone)]
pub struct Resolve {
    done: Vec<String>,
    todo: std::collections::VecDeque<String>,
    pending: Option<String>,
    links: u32,
}

/// Links followed in one resolution at most (Linux's own bound).
pub const MAX_LINKS: u32 = 40;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("more than {MAX_LINKS} links on the way to {0:?}")]
    TooManyLinks(String),
    #[error("the link {0:?} is empty")]
    EmptyLink(String),
}

fn parts(path: &str) -> impl Iterator<Item = String> + '_ {
    path.split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .map(str::to_string)
}

impl Resolve {
    pub fn new(path: &str) -> Resolve {
        Resolve {
            done: Vec::new(),
            todo: parts(path).collect(),
            pending: None,
            links: 0,
        }
    }

    fn joined(parts: &[String]) -> String {
        format!("/{}", parts.join("/"))
    }

    /// The next path to look up, or None once the path is resolved.
    pub fn next(&mut self) -> Option<String> {
        while let Some(c) = self.todo.pop_front() {
            if c == ".." {
                self.done.pop();
                continue;
            }
            let mut at = self.done.clone();
            at.push(c.clone());
            self.pending = Some(c);
            return Some(Self::joined(&at));
        }
        None
    }

    /// The looked-up path is a link to `target`.
    pub fn link(&mut self, target: &str) -> Result<(), ResolveError> {
        let c = self.pending.take().expect("a lookup to answer");
        let at = {
            let mut a = self.done.clone();
            a.push(c);
            Self::joined(&a)
        };
        if target.is_empty() {
            return Err(ResolveError::EmptyLink(at));
        }
        self.links += 1;
        if self.links > MAX_LINKS {
            return Err(ResolveError::TooManyLinks(at));
        }
        if target.starts_with('/') {
            self.done.clear();
        }
        let mut front: std::collections::VecDeque<String> = parts(target).collect();
        front.extend(self.todo.drain(..));
        self.todo = front;
        Ok(())
    }

    /// The looked-up path is not a link (a directory, a file, missing).
    pub fn other(&mut self) {
        let c = self.pending.take().expect("a lookup to answer");
        self.done.push(c);
    }

    /// The resolved path (complete once [`Resolve::next`] gave None).
    pub fn path(&self) -> String {
        Self::joined(&self.done)
    }
}

/// Any e2fsprogs program by name.
pub async fn tool(
    name: &str,
    args: &[&OsStr],
    input: Option<&[u8]>,
    timeout: Duration,
    class: programs::Class,
) -> Result<programs::Finished, ToolError> {
    let mut command = tokio::process::Command::new(hearth_qemu::tools::find_binary(name)?);
    command.args(args);
    run(command, name, input, timeout, class).await
}

async fn run(
    command: tokio::process::Command,
    name: &str,
    input: Option<&[u8]>,
    timeout: Duration,
    class: programs::Class,
) -> Result<programs::Finished, ToolError> {
    let limits = programs::Limits {
        timeout,
        stdout: MAX_OUTPUT,
        stderr: MAX_OUTPUT,
    };
    programs::run(command, class, input, limits)
        .await
        .map_err(|source| ToolError::Run {
            tool: name.to_string(),
            source,
        })
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The last KiB of `s`.
pub fn tail(s: &str) -> &str {
    let mut start = s.len().saturating_sub(1024);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Resolves `path` over a filesystem given as its links.
    fn resolve(
        path: &str,
        links: &BTreeMap<&str, &str>,
    ) -> Result<(String, Vec<String>), ResolveError> {
        let mut r = Resolve::new(path);
        let mut asked = Vec::new();
        while let Some(p) = r.next() {
            asked.push(p.clone());
            match links.get(p.as_str()) {
                Some(t) => r.link(t)?,
                None => r.other(),
            }
        }
        Ok((r.path(), asked))
    }

    #[test]
    fn links_are_followed_inside_the_filesystem_only() {
        let links = BTreeMap::from([
            ("/lib", "usr/lib"),
            ("/abs", "/usr/lib"),
            ("/up", "../../../usr"),
            ("/a", "b"),
            ("/b", "a"),
            ("/empty", ""),
        ]);
        // Merged /usr: a relative link beside it.
        let (p, asked) = resolve("/lib/modules", &links).unwrap();
        assert_eq!(p, "/usr/lib/modules");
        assert_eq!(asked, ["/lib", "/usr", "/usr/lib", "/usr/lib/modules"]);
        assert_eq!(
            resolve("/abs/modules", &links).unwrap().0,
            "/usr/lib/modules"
        );
        // `..` stops at the root.
        assert_eq!(resolve("/up/x", &links).unwrap().0, "/usr/x");
        assert_eq!(resolve("/../../etc/./x/", &links).unwrap().0, "/etc/x");
        assert!(matches!(
            resolve("/a/x", &links),
            Err(ResolveError::TooManyLinks(_))
        ));
        assert_eq!(
            resolve("/empty/x", &links),
            Err(ResolveError::EmptyLink("/empty".into()))
        );
        assert_eq!(resolve("/", &links).unwrap().0, "/");
    }

    #[test]
    fn a_fast_link_line_is_read() {
        let out = "Inode: 12   Type: symlink    Mode:  0777\nFast link dest: \"usr/lib\"\n";
        assert_eq!(parse_fast_link(out).as_deref(), Some("usr/lib"));
        assert_eq!(parse_fast_link("Inode: 12   Type: symlink\n"), None);
    }
}
