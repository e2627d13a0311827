//! One full re-list of the manifest directory: every candidate file, read
//! only if it changed since the last look.
//!
//! A file is re-read when its stamp (device, inode, size, mtime, ctime)
//! differs from the cached one. ctime is in the stamp because users cannot set
//! it (`cp -p` and `touch -d` can set mtime back). File-system timestamps are
//! coarse (a kernel tick), so a file changed within [`RACY_WINDOW`] of a read
//! may change again without its stamp changing: such a "racily clean" entry
//! (git's term) is re-read on the next scan. A re-read file whose bytes did
//! not change keeps its parse.
//!
//! hearthd only ever reads here: files are opened read-only and non-blocking,
//! at most `max_size + 1` bytes, and only once `stat` says they are regular
//! files. A candidate name that is something else (a FIFO, a socket, a
//! directory, a device, a symlink to one of them or to nothing) is listed as
//! an invalid file, never opened: a path that exists is never "gone".
//!
//! A file of up to [`INLINE_PARSE_BYTES`] is parsed by the scan itself:
//! within the [limits](hearth_api::limits) that takes milliseconds. A larger
//! one is parsed on a thread of its own ([`MAX_PARSES`] at most; the next
//! file starts as one frees up); the scan waits up to [`PARSE_WAIT`] for
//! them, and one not done by then is listed as [`Content::Parsing`]. Its
//! result is picked up by a later scan, which the `parsed` callback asks for.
//! So one slow file never holds up the others.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hearth_api::Object;

use super::core::{Content, Decl, FileId, FileScan, Listing};
use super::names::is_candidate;
use super::parse::{FileError, parse_manifest};

/// A cached read is trusted only if the file last changed at least this long
/// before the read began (covers the file-system clock's coarse tick).
pub const RACY_WINDOW: Duration = Duration::from_millis(100);

/// How many times a file that changes while it is read is read again.
const READ_ATTEMPTS: usize = 3;

/// Files up to this size are parsed by the scan itself: a manifest is a few
/// KiB, and 16 KiB within the limits parses in under 10 ms (50 ms in a debug
/// build), however it is written (`cargo bench -p hearth-api --bench
/// manifest_parse`).
pub const INLINE_PARSE_BYTES: usize = 16 << 10;

/// How long a scan waits for the parses it started on threads. A file at
/// the size limit can take a second or more (docs/limits.md).
pub const PARSE_WAIT: Duration = Duration::from_millis(200);

/// Parses running on threads at once. More large files wait for a free slot
/// (listed as still parsing), so a directory full of them costs two threads.
pub const MAX_PARSES: usize = 2;

/// A file's bytes to objects (the real parser, or a test's).
pub type ParseFn = dyn Fn(&[u8], &Path) -> Result<Vec<Object>, FileError> + Send + Sync;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(m: &std::fs::Metadata) -> Stamp {
        Stamp {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }

    fn id(&self) -> FileId {
        FileId {
            dev: self.dev,
            ino: self.ino,
        }
    }

    /// The later of mtime and ctime.
    fn changed_at(&self) -> SystemTime {
        let (s, ns) = self.mtime.max(self.ctime);
        if s < 0 {
            return UNIX_EPOCH;
        }
        UNIX_EPOCH + Duration::new(s as u64, ns.clamp(0, 999_999_999) as u32)
    }
}

struct Cached {
    /// The scan that last saw this file (entries not seen are dropped).
    seen: u64,
    stamp: Stamp,
    racy: bool,
    hash: u64,
    content: Content,
}

/// What one re-list did.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ScanStats {
    /// Candidate files in the directory.
    pub files: usize,
    /// Files whose bytes were read (changed stamp or racily clean).
    pub read: usize,
    /// Files whose bytes had changed and whose parse finished in this
    /// re-list (including parses an earlier re-list started).
    pub parsed: usize,
    /// Of those, files whose new bytes did not parse (the last good state
    /// is kept): each bad version of a file counts once.
    pub parse_errors: usize,
    /// Files listed as still parsing.
    pub parsing: usize,
}

/// One parse: a file name and the hash of its bytes.
type Job = (String, u64);

/// Parses that may outlast the scan that started them.
struct Parses {
    state: Mutex<ParsesState>,
    finished: Condvar,
    parse: Arc<ParseFn>,
    /// Asks for a scan: a parse no scan waits for any more has finished.
    parsed: Box<dyn Fn() + Send + Sync>,
}

#[derive(Default)]
struct ParsesState {
    /// Running parses; true once no scan waits for it.
    running: HashMap<Job, bool>,
    /// Finished parses not yet taken by a scan.
    done: HashMap<Job, Content>,
    /// A parse could not start for want of a slot: the next to finish asks
    /// for a scan, which starts it.
    starved: bool,
}

enum Started {
    Done(Content),
    Running,
    /// Already running for an earlier scan.
    Busy,
    /// No slot free: the bytes back, to start once one is.
    Full(Vec<u8>),
}

impl Parses {
    fn lock(&self) -> std::sync::MutexGuard<'_, ParsesState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The result for `job` if one is ready, else starts its parse if a
    /// slot is free.
    fn start(self: &Arc<Self>, job: &Job, bytes: Vec<u8>, dir: &Path) -> Started {
        let mut st = self.lock();
        if let Some(content) = st.done.remove(job) {
            return Started::Done(content);
        }
        if st.running.contains_key(job) {
            return Started::Busy;
        }
        if st.running.len() >= MAX_PARSES {
            return Started::Full(bytes);
        }
        st.running.insert(job.clone(), false);
        drop(st);
        let me = self.clone();
        let (thread_job, thread_dir) = (job.clone(), dir.to_path_buf());
        let bytes = Arc::new(bytes);
        let thread_bytes = bytes.clone();
        let spawned = std::thread::Builder::new()
            .name("manifest-parse".into())
            .spawn(move || me.run(thread_job, &thread_bytes, &thread_dir));
        match spawned {
            Ok(_) => Started::Running,
            Err(e) => {
                // Out of threads: correct, if slower, on this one.
                tracing::warn!(file = job.0, error = %e, "cannot start a parse thread; parsing in the re-list");
                self.lock().running.remove(job);
                Started::Done(self.inline(&bytes, dir))
            }
        }
    }

    fn run(&self, job: Job, bytes: &[u8], dir: &Path) {
        let content = parse_content(&*self.parse, bytes, dir);
        let wake = {
            let mut st = self.lock();
            let orphaned = st.running.remove(&job).unwrap_or(true);
            st.done.insert(job, content);
            orphaned || std::mem::take(&mut st.starved)
        };
        self.finished.notify_all();
        if wake {
            (self.parsed)();
        }
    }

    /// Waits until one of `started` has finished, a slot is free (if
    /// `want_slot`), or `deadline`.
    fn wait_change(&self, started: &[(usize, Job)], want_slot: bool, deadline: Instant) {
        let mut st = self.lock();
        loop {
            let finished = started.iter().any(|(_, j)| !st.running.contains_key(j));
            let slot = want_slot && st.running.len() < MAX_PARSES;
            let now = Instant::now();
            if finished || slot || now >= deadline {
                return;
            }
            st = self
                .finished
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Takes the results of those of `started` that have finished. With
    /// `give_up`, those still running are no longer waited for (their end
    /// asks for a scan), and with files `queued` for a slot, so does the end
    /// of any parse.
    fn collect(
        &self,
        started: &mut Vec<(usize, Job)>,
        give_up: bool,
        queued: bool,
    ) -> Vec<(usize, Content)> {
        let mut st = self.lock();
        let mut out = Vec::new();
        started.retain(|(index, job)| match st.done.remove(job) {
            Some(content) => {
                out.push((*index, content));
                false
            }
            None => true,
        });
        if give_up {
            for (_, job) in started.iter() {
                if let Some(orphaned) = st.running.get_mut(job) {
                    *orphaned = true;
                }
            }
            st.starved |= queued;
        }
        out
    }

    /// Parses on the calling thread.
    fn inline(&self, bytes: &[u8], dir: &Path) -> Content {
        parse_content(&*self.parse, bytes, dir)
    }

    /// Forgets finished parses no file is waiting for any more.
    fn retain(&self, wanted: &HashSet<Job>) {
        self.lock().done.retain(|j, _| wanted.contains(j));
    }
}

pub struct Scanner {
    dir: PathBuf,
    max_size: u64,
    cache: HashMap<String, Cached>,
    scans: u64,
    parses: Arc<Parses>,
    inline_bytes: usize,
    parse_wait: Duration,
}

impl Scanner {
    /// `parsed` is called (from a parse's thread) when a parse that
    /// outlasted its scan has finished: a new scan picks up its result.
    pub fn new(dir: PathBuf, max_size: u64, parsed: Box<dyn Fn() + Send + Sync>) -> Scanner {
        Scanner::with_parser(
            dir,
            max_size,
            parsed,
            Arc::new(parse_manifest),
            INLINE_PARSE_BYTES,
            PARSE_WAIT,
        )
    }

    fn with_parser(
        dir: PathBuf,
        max_size: u64,
        parsed: Box<dyn Fn() + Send + Sync>,
        parse: Arc<ParseFn>,
        inline_bytes: usize,
        parse_wait: Duration,
    ) -> Scanner {
        Scanner {
            dir,
            max_size,
            cache: HashMap::new(),
            scans: 0,
            parses: Arc::new(Parses {
                state: Mutex::new(ParsesState::default()),
                finished: Condvar::new(),
                parse,
                parsed,
            }),
            inline_bytes,
            parse_wait,
        }
    }

    /// Lists the directory and reads what changed.
    pub fn scan(&mut self) -> (Listing, ScanStats) {
        let started = SystemTime::now();
        let deadline = Instant::now() + self.parse_wait;
        self.scans += 1;
        let generation = self.scans;
        let mut stats = ScanStats::default();
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) => {
                // Unknown is not empty: keep the cache for when it is back.
                return (
                    Listing::Missing(format!("{}: {e}", self.dir.display())),
                    stats,
                );
            }
        };
        // Collected, sorted by name, then made a map in one pass (all paths
        // share the directory, so name order is path order).
        let mut files: Vec<(String, PathBuf, FileScan)> = Vec::new();
        // Parses this scan started, and files waiting for a slot, by index
        // in `files`.
        let mut started_parses: Vec<(usize, Job)> = Vec::new();
        let mut queued: VecDeque<(usize, Job, Vec<u8>)> = VecDeque::new();
        for entry in entries {
            let entry = match entry {
                Ok(e) => e,
                Err(e) => {
                    // The directory went away while being listed.
                    return (
                        Listing::Missing(format!("{}: {e}", self.dir.display())),
                        stats,
                    );
                }
            };
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                tracing::debug!(name = ?entry.file_name(), "skipping a file name that is not UTF-8");
                continue;
            };
            if !is_candidate(&name) {
                continue;
            }
            let path = self.dir.join(&name);
            let invalid = |id: Option<FileId>, message: String| FileScan {
                id,
                content: Content::Invalid(FileError::new(message)),
            };
            // Follows symlinks: `vm.yaml -> ..data/vm.yaml` is its target.
            let meta = match std::fs::metadata(&path) {
                Ok(m) => m,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    // Vanished since the listing: not there. A symlink to
                    // nothing is there, and cannot be used.
                    if let Ok(link) = std::fs::symlink_metadata(&path) {
                        let id = Stamp::of(&link).id();
                        let message = match std::fs::read_link(&path) {
                            Ok(target) => format!(
                                "a symbolic link to {}, which does not exist",
                                target.display()
                            ),
                            Err(_) => format!("cannot read: {e}"),
                        };
                        stats.files += 1;
                        files.push((name, path, invalid(Some(id), message)));
                    }
                    continue;
                }
                Err(e) => {
                    stats.files += 1;
                    files.push((name, path, invalid(None, format!("cannot read: {e}"))));
                    continue;
                }
            };
            if !meta.is_file() {
                // Never opened: a FIFO could block, a device could be
                // endless (/dev/zero) or act on being opened.
                stats.files += 1;
                let message = not_a_file(&path, &meta);
                files.push((name, path, invalid(Some(Stamp::of(&meta).id()), message)));
                continue;
            }
            stats.files += 1;
            let stamp = Stamp::of(&meta);
            if let Some(c) = self.cache.get_mut(&name)
                && c.stamp == stamp
                && !c.racy
                && c.content != Content::Parsing
            {
                c.seen = generation;
                let scan = FileScan {
                    id: Some(stamp.id()),
                    content: c.content.clone(),
                };
                files.push((name, path, scan));
                continue;
            }
            stats.read += 1;
            let (stamp, content, hash, stable) = match self.read(&path, stamp) {
                Got::Bytes(stamp, bytes) => {
                    let mut h = DefaultHasher::new();
                    bytes.hash(&mut h);
                    let hash = h.finish();
                    let content = match self.cache.get(&name) {
                        Some(c) if c.hash == hash && c.content != Content::Parsing => {
                            c.content.clone()
                        }
                        _ if bytes.len() <= self.inline_bytes => {
                            let content = self.parses.inline(&bytes, &self.dir);
                            count(&mut stats, &content);
                            content
                        }
                        _ => {
                            let job = (name.clone(), hash);
                            match self.parses.start(&job, bytes, &self.dir) {
                                Started::Done(content) => {
                                    count(&mut stats, &content);
                                    content
                                }
                                Started::Running => {
                                    started_parses.push((files.len(), job));
                                    Content::Parsing
                                }
                                Started::Busy => Content::Parsing,
                                Started::Full(bytes) => {
                                    queued.push_back((files.len(), job, bytes));
                                    Content::Parsing
                                }
                            }
                        }
                    };
                    (stamp, content, hash, true)
                }
                Got::TooLarge(stamp) => (
                    stamp,
                    Content::Invalid(FileError::new(format!(
                        "the file is {} bytes, more than the {} bytes a manifest may have; it is not read",
                        stamp.size, self.max_size
                    ))),
                    0,
                    true,
                ),
                Got::Changing(stamp) => (
                    stamp,
                    Content::Invalid(FileError::new("the file kept changing while it was read")),
                    0,
                    false,
                ),
                Got::NotAFile(stamp, message) => {
                    (stamp, Content::Invalid(FileError::new(message)), 0, false)
                }
                Got::Gone => continue,
                Got::Error(e) => (
                    stamp,
                    Content::Invalid(FileError::new(format!("cannot read: {e}"))),
                    0,
                    false,
                ),
            };
            let racy = !stable || stamp.changed_at() + RACY_WINDOW >= started;
            self.cache.insert(
                name.clone(),
                Cached {
                    seen: generation,
                    stamp,
                    racy,
                    hash,
                    content: content.clone(),
                },
            );
            let scan = FileScan {
                id: Some(stamp.id()),
                content,
            };
            files.push((name, path, scan));
        }
        // The parses this scan started, as far as they finish in time, and
        // the queued ones as slots free up.
        let mut landed: Vec<(usize, Content)> = Vec::new();
        while !started_parses.is_empty() || !queued.is_empty() {
            while let Some((index, job, bytes)) = queued.pop_front() {
                match self.parses.start(&job, bytes, &self.dir) {
                    Started::Done(content) => landed.push((index, content)),
                    Started::Running => started_parses.push((index, job)),
                    Started::Busy => {}
                    Started::Full(bytes) => {
                        queued.push_front((index, job, bytes));
                        break;
                    }
                }
            }
            let last = Instant::now() >= deadline;
            landed.extend(
                self.parses
                    .collect(&mut started_parses, last, !queued.is_empty()),
            );
            if last {
                break;
            }
            self.parses
                .wait_change(&started_parses, !queued.is_empty(), deadline);
        }
        for (index, content) in landed {
            count(&mut stats, &content);
            if let Some(c) = self.cache.get_mut(&files[index].0) {
                c.content = content.clone();
            }
            files[index].2.content = content;
        }
        self.cache.retain(|_, c| c.seen == generation);
        let wanted: HashSet<Job> = self
            .cache
            .iter()
            .filter(|(_, c)| c.content == Content::Parsing)
            .map(|(name, c)| (name.clone(), c.hash))
            .collect();
        stats.parsing = wanted.len();
        self.parses.retain(&wanted);
        files.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let files: BTreeMap<PathBuf, FileScan> = files
            .into_iter()
            .map(|(_, path, scan)| (path, scan))
            .collect();
        (Listing::Files(files), stats)
    }

    fn read(&self, path: &Path, stamp: Stamp) -> Got {
        if stamp.size > self.max_size {
            return Got::TooLarge(stamp);
        }
        let mut last = stamp;
        for _ in 0..READ_ATTEMPTS {
            // Non-blocking and no controlling terminal: should the path have
            // become a FIFO or a device since the stat, opening it neither
            // hangs nor changes anything; fstat then refuses it unread.
            let flags = rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::NOCTTY;
            let file = match std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(flags.bits() as i32)
                .open(path)
            {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Got::Gone,
                Err(e) => return Got::Error(e),
            };
            let before = match file.metadata() {
                Ok(m) if m.is_file() => Stamp::of(&m),
                Ok(m) => return Got::NotAFile(Stamp::of(&m), not_a_file(path, &m)),
                Err(e) => return Got::Error(e),
            };
            if before.size > self.max_size {
                return Got::TooLarge(before);
            }
            let mut bytes = Vec::with_capacity(before.size as usize + 1);
            if let Err(e) = (&file).take(self.max_size + 1).read_to_end(&mut bytes) {
                return Got::Error(e);
            }
            let after = match file.metadata() {
                Ok(m) => Stamp::of(&m),
                Err(e) => return Got::Error(e),
            };
            if bytes.len() as u64 > self.max_size {
                return Got::TooLarge(after);
            }
            if before == after && bytes.len() as u64 == after.size {
                return Got::Bytes(after, bytes);
            }
            last = after;
        }
        Got::Changing(last)
    }
}

fn parse_content(parse: &ParseFn, bytes: &[u8], dir: &Path) -> Content {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| parse(bytes, dir)));
    match result {
        Ok(Ok(objects)) => Content::Valid(objects.into_iter().map(Decl::new).collect()),
        Ok(Err(e)) => Content::Invalid(e),
        Err(_) => Content::Invalid(FileError::new("the parser failed on this file")),
    }
}

/// Counts a finished parse.
fn count(stats: &mut ScanStats, content: &Content) {
    stats.parsed += 1;
    if matches!(content, Content::Invalid(_)) {
        stats.parse_errors += 1;
    }
}

/// What a candidate that is not a regular file is, for its error.
fn not_a_file(path: &Path, meta: &std::fs::Metadata) -> String {
    let t = meta.file_type();
    let what = if t.is_dir() {
        "a directory (subdirectories are not read)"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    };
    match std::fs::read_link(path) {
        Ok(target) => format!(
            "a symbolic link to {}, {what}, not a regular file; it is not read",
            target.display()
        ),
        Err(_) => format!("{what}, not a regular file; it is not read"),
    }
}

enum Got {
    Bytes(Stamp, Vec<u8>),
    TooLarge(Stamp),
    Changing(Stamp),
    /// Became a FIFO, device or directory between the stat and the open.
    NotAFile(Stamp, String),
    Gone,
    Error(std::io::Error),
}

#[cfg(test)]
mod tests;
