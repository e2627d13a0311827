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

    pub fn dir(&self) -> &Path {
        &self.dir
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
mod tests {
    use super::*;

    fn vm(name: &str, mem: u32) -> String {
        format!(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: {name}}}\nspec: {{memory: {mem}Mi, boot: {{kernel: /k}}}}\n"
        )
    }

    fn files(l: &Listing) -> &BTreeMap<PathBuf, FileScan> {
        match l {
            Listing::Files(f) => f,
            Listing::Missing(why) => panic!("missing: {why}"),
        }
    }

    fn scanner(dir: PathBuf, max_size: u64) -> Scanner {
        Scanner::new(dir, max_size, Box::new(|| {}))
    }

    /// Makes every cached entry old enough to be trusted.
    fn age(s: &mut Scanner) {
        for c in s.cache.values_mut() {
            c.racy = false;
        }
    }

    #[test]
    fn candidates_only_and_symlinks_followed_through_dot_dirs() {
        let d = tempfile::tempdir().expect("tmp");
        let dir = d.path();
        std::fs::write(dir.join("a.yaml"), vm("a", 256)).expect("w");
        std::fs::write(dir.join("a.yaml~"), vm("old", 256)).expect("w");
        std::fs::write(dir.join(".a.yaml.swp"), b"\x00swap").expect("w");
        std::fs::create_dir(dir.join("sub.yaml")).expect("mkdir");
        // ConfigMap layout: b.yaml -> ..data/b.yaml, ..data -> ..2024_01
        std::fs::create_dir(dir.join("..2024_01")).expect("mkdir");
        std::fs::write(dir.join("..2024_01/b.yaml"), vm("b", 256)).expect("w");
        std::os::unix::fs::symlink("..2024_01", dir.join("..data")).expect("ln");
        std::os::unix::fs::symlink("..data/b.yaml", dir.join("b.yaml")).expect("ln");
        std::os::unix::fs::symlink("..data/none.yaml", dir.join("dangling.yaml")).expect("ln");
        let mut s = scanner(dir.to_path_buf(), 1 << 20);
        let (l, stats) = s.scan();
        let f = files(&l);
        let names: Vec<_> = f
            .keys()
            .map(|p| p.file_name().unwrap().to_owned())
            .collect();
        // The directory and the dangling link are there, and unusable.
        assert_eq!(names, vec!["a.yaml", "b.yaml", "dangling.yaml", "sub.yaml"]);
        for name in ["a.yaml", "b.yaml"] {
            assert!(matches!(f[&dir.join(name)].content, Content::Valid(_)));
        }
        for name in ["dangling.yaml", "sub.yaml"] {
            assert!(matches!(f[&dir.join(name)].content, Content::Invalid(_)));
        }
        assert_eq!(stats.files, 4);
    }

    #[test]
    fn unchanged_files_are_not_read_again_and_changed_ones_are() {
        let d = tempfile::tempdir().expect("tmp");
        for i in 0..20 {
            std::fs::write(
                d.path().join(format!("f{i}.yaml")),
                vm(&format!("v{i}"), 256),
            )
            .expect("w");
        }
        let mut s = scanner(d.path().to_path_buf(), 1 << 20);
        let (_, stats) = s.scan();
        assert_eq!((stats.files, stats.read, stats.parsed), (20, 20, 20));
        age(&mut s);
        let (_, stats) = s.scan();
        assert_eq!((stats.read, stats.parsed), (0, 0));
        std::fs::write(d.path().join("f3.yaml"), vm("v3", 512)).expect("w");
        let (l, stats) = s.scan();
        assert_eq!((stats.read, stats.parsed), (1, 1));
        let Content::Valid(d3) = &files(&l)[&d.path().join("f3.yaml")].content else {
            panic!("invalid")
        };
        assert!(d3[0].spec.contains("512"), "{}", d3[0].spec);
    }

    #[test]
    fn each_bad_version_of_a_file_is_one_parse_error() {
        let d = tempfile::tempdir().expect("tmp");
        let f = d.path().join("a.yaml");
        std::fs::write(&f, "kind: [unclosed").expect("w");
        std::fs::write(d.path().join("ok.yaml"), vm("ok", 256)).expect("w");
        let mut s = scanner(d.path().to_path_buf(), 1 << 20);
        let (_, stats) = s.scan();
        assert_eq!((stats.parsed, stats.parse_errors), (2, 1));
        // The same bad bytes read again are not parsed again.
        age(&mut s);
        std::fs::write(&f, "kind: [unclosed").expect("w");
        let (_, stats) = s.scan();
        assert_eq!(stats.parse_errors, 0);
        std::fs::write(&f, "kind: {still bad").expect("w");
        let (_, stats) = s.scan();
        assert_eq!(stats.parse_errors, 1);
        std::fs::write(&f, vm("a", 256)).expect("w");
        let (_, stats) = s.scan();
        assert_eq!((stats.parsed, stats.parse_errors), (1, 0));
    }

    #[test]
    fn a_racily_clean_file_is_read_again_and_same_bytes_keep_their_parse() {
        let d = tempfile::tempdir().expect("tmp");
        std::fs::write(d.path().join("a.yaml"), vm("a", 256)).expect("w");
        let mut s = scanner(d.path().to_path_buf(), 1 << 20);
        s.scan();
        // Just written: racy, so read again, but the bytes are the same.
        let (_, stats) = s.scan();
        assert_eq!((stats.read, stats.parsed), (1, 0));
    }

    #[test]
    fn too_large_empty_and_garbage_files_are_invalid_not_absent() {
        let d = tempfile::tempdir().expect("tmp");
        std::fs::write(d.path().join("big.yaml"), vec![b'a'; 2000]).expect("w");
        std::fs::write(d.path().join("empty.yaml"), b"").expect("w");
        std::fs::write(d.path().join("bin.yaml"), [0xffu8, 0, 1, 2]).expect("w");
        let mut s = scanner(d.path().to_path_buf(), 1000);
        let (l, _) = s.scan();
        let f = files(&l);
        assert_eq!(f.len(), 3);
        for (p, scan) in f {
            assert!(
                matches!(scan.content, Content::Invalid(_)),
                "{}",
                p.display()
            );
        }
        let Content::Invalid(e) = &f[&d.path().join("big.yaml")].content else {
            unreachable!()
        };
        assert!(e.message.contains("2000 bytes"), "{e}");
    }

    fn error_of<'a>(l: &'a Listing, path: &Path) -> &'a FileError {
        match &files(l)[path].content {
            Content::Invalid(e) => e,
            other => panic!("{}: {other:?}", path.display()),
        }
    }

    #[test]
    fn what_is_not_a_regular_file_is_listed_invalid_and_never_read() {
        let d = tempfile::tempdir().expect("tmp");
        let dir = d.path();
        let fifo = dir.join("fifo.yaml");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .expect("mkfifo");
        let _socket =
            std::os::unix::net::UnixListener::bind(dir.join("socket.yaml")).expect("bind");
        std::os::unix::fs::symlink("/dev/zero", dir.join("zero.yaml")).expect("ln");
        std::os::unix::fs::symlink("/", dir.join("root.yaml")).expect("ln");
        std::fs::create_dir(dir.join("dir.yaml")).expect("mkdir");
        std::os::unix::fs::symlink("nowhere.yaml", dir.join("dangling.yaml")).expect("ln");
        std::os::unix::fs::symlink("loop.yaml", dir.join("loop.yaml")).expect("ln");
        let mut s = scanner(dir.to_path_buf(), 1000);
        let (l, stats) = s.scan();
        assert_eq!((stats.files, stats.read), (7, 0), "none of them is read");
        for (name, expected) in [
            ("fifo.yaml", "a FIFO, not a regular file"),
            ("socket.yaml", "a socket, not a regular file"),
            (
                "zero.yaml",
                "a symbolic link to /dev/zero, a character device, not a regular file",
            ),
            ("root.yaml", "a symbolic link to /, a directory"),
            ("dir.yaml", "a directory (subdirectories are not read)"),
            (
                "dangling.yaml",
                "a symbolic link to nowhere.yaml, which does not exist",
            ),
            ("loop.yaml", "cannot read: "),
        ] {
            let e = error_of(&l, &dir.join(name));
            assert!(e.message.starts_with(expected), "{name}: {e}");
        }
        // The FIFO was not opened: a writer would find no reader.
        let w = rustix::fs::open(
            &fifo,
            rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::NONBLOCK,
            rustix::fs::Mode::empty(),
        );
        assert_eq!(w.err(), Some(rustix::io::Errno::NXIO));
        // Replaced by a regular file again: read as usual.
        std::fs::remove_file(&fifo).expect("rm");
        std::fs::write(&fifo, vm("f", 256)).expect("w");
        let (l, _) = s.scan();
        assert!(matches!(files(&l)[&fifo].content, Content::Valid(_)));
    }

    /// A parser that blocks on files containing `slow` until released, and
    /// counts how often it ran on them.
    #[derive(Default)]
    struct Gate {
        open: Mutex<bool>,
        opened: Condvar,
        slow_parses: std::sync::atomic::AtomicUsize,
    }

    impl Gate {
        fn parser(self: &Arc<Self>) -> Arc<ParseFn> {
            let gate = self.clone();
            Arc::new(move |bytes: &[u8], dir: &Path| {
                if bytes.windows(4).any(|w| w == b"slow") {
                    gate.slow_parses
                        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let mut open = gate.open.lock().expect("gate");
                    while !*open {
                        open = gate.opened.wait(open).expect("gate");
                    }
                }
                parse_manifest(bytes, dir)
            })
        }

        fn release(&self) {
            *self.open.lock().expect("gate") = true;
            self.opened.notify_all();
        }

        fn slow_parses(&self) -> usize {
            self.slow_parses.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    fn gated_scanner(
        dir: &Path,
        gate: &Arc<Gate>,
    ) -> (Scanner, Arc<std::sync::atomic::AtomicUsize>) {
        let wakes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let w = wakes.clone();
        let s = Scanner::with_parser(
            dir.to_path_buf(),
            1 << 20,
            Box::new(move || {
                w.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }),
            gate.parser(),
            // Every file on a thread of its own.
            0,
            // Long enough for any ungated parse, even on a loaded machine.
            Duration::from_secs(1),
        );
        (s, wakes)
    }

    fn wait_for(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "{what}: not after 10 s");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_slow_parse_holds_up_neither_the_scan_nor_the_other_files() {
        let d = tempfile::tempdir().expect("tmp");
        let slow = d.path().join("slow.yaml");
        let fast = d.path().join("fast.yaml");
        std::fs::write(&slow, format!("{}# slow\n", vm("s", 256))).expect("w");
        std::fs::write(&fast, vm("f", 256)).expect("w");
        let gate = Arc::new(Gate::default());
        let (mut s, wakes) = gated_scanner(d.path(), &gate);

        let started = Instant::now();
        let (l, stats) = s.scan();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert!(matches!(files(&l)[&fast].content, Content::Valid(_)));
        assert_eq!(files(&l)[&slow].content, Content::Parsing);
        assert_eq!((stats.parsed, stats.parsing), (1, 1));

        // Still running: listed as parsing again, not parsed a second time.
        let (l, stats) = s.scan();
        assert_eq!(files(&l)[&slow].content, Content::Parsing);
        assert_eq!(stats.parsing, 1);
        assert_eq!(gate.slow_parses(), 1);
        assert_eq!(wakes.load(std::sync::atomic::Ordering::SeqCst), 0);

        // Done: it asks for a scan, which takes the result.
        gate.release();
        wait_for("the wake", || {
            wakes.load(std::sync::atomic::Ordering::SeqCst) == 1
        });
        let (l, stats) = s.scan();
        let Content::Valid(decls) = &files(&l)[&slow].content else {
            panic!("{:?}", files(&l)[&slow])
        };
        assert_eq!(decls[0].object.name(), "s");
        assert_eq!((stats.parsed, stats.parse_errors, stats.parsing), (1, 0, 0));
        assert_eq!(gate.slow_parses(), 1);
    }

    #[test]
    fn a_file_changed_while_its_parse_runs_takes_the_new_bytes() {
        let d = tempfile::tempdir().expect("tmp");
        let f = d.path().join("a.yaml");
        std::fs::write(&f, format!("{}# slow\n", vm("a", 256))).expect("w");
        let gate = Arc::new(Gate::default());
        let (mut s, _) = gated_scanner(d.path(), &gate);
        assert_eq!(files(&s.scan().0)[&f].content, Content::Parsing);
        std::fs::write(&f, vm("a", 512)).expect("w");
        let (l, _) = s.scan();
        let Content::Valid(decls) = &files(&l)[&f].content else {
            panic!("{:?}", files(&l)[&f])
        };
        assert!(decls[0].spec.contains("512"), "{}", decls[0].spec);
        // The old parse ends later; its result is for bytes no longer there.
        gate.release();
        wait_for("the old parse", || s.parses.lock().running.is_empty());
        let (l, _) = s.scan();
        let Content::Valid(decls) = &files(&l)[&f].content else {
            panic!("{:?}", files(&l)[&f])
        };
        assert!(decls[0].spec.contains("512"), "{}", decls[0].spec);
        assert!(
            s.parses.lock().done.is_empty(),
            "the stale result is dropped"
        );
    }

    #[test]
    fn parses_beyond_the_limit_wait_for_a_free_slot() {
        let d = tempfile::tempdir().expect("tmp");
        let paths: Vec<PathBuf> = (0..MAX_PARSES + 1)
            .map(|i| d.path().join(format!("s{i}.yaml")))
            .collect();
        for (i, p) in paths.iter().enumerate() {
            std::fs::write(p, format!("{}# slow\n", vm(&format!("s{i}"), 256))).expect("w");
        }
        let gate = Arc::new(Gate::default());
        let (mut s, wakes) = gated_scanner(d.path(), &gate);
        let (l, stats) = s.scan();
        assert_eq!(stats.parsing, MAX_PARSES + 1);
        assert!(files(&l).values().all(|f| f.content == Content::Parsing));
        assert_eq!(gate.slow_parses(), MAX_PARSES, "one waits for a slot");
        gate.release();
        wait_for("the wake", || {
            wakes.load(std::sync::atomic::Ordering::SeqCst) >= 1
        });
        // The finished ones are taken, the waiting one starts (and, the
        // gate open, ends within the scan's wait).
        let (l, _) = s.scan();
        assert!(
            files(&l)
                .values()
                .all(|f| matches!(f.content, Content::Valid(_))),
            "{:?}",
            files(&l)
        );
        assert_eq!(gate.slow_parses(), MAX_PARSES + 1);
    }

    #[test]
    fn files_waiting_for_a_slot_start_as_slots_free_up_within_the_scan() {
        let d = tempfile::tempdir().expect("tmp");
        for i in 0..10 {
            std::fs::write(
                d.path().join(format!("f{i}.yaml")),
                vm(&format!("v{i}"), 256),
            )
            .expect("w");
        }
        // Every file on a thread, two at a time, and time enough for all.
        let mut s = Scanner::with_parser(
            d.path().to_path_buf(),
            1 << 20,
            Box::new(|| {}),
            Arc::new(parse_manifest),
            0,
            Duration::from_secs(10),
        );
        let (l, stats) = s.scan();
        assert_eq!((stats.parsed, stats.parsing), (10, 0));
        assert!(
            files(&l)
                .values()
                .all(|f| matches!(f.content, Content::Valid(_)))
        );
    }

    #[test]
    fn a_missing_directory_is_missing_not_empty() {
        let d = tempfile::tempdir().expect("tmp");
        let mut s = scanner(d.path().join("nope"), 1000);
        assert!(matches!(s.scan().0, Listing::Missing(_)));
    }
}
