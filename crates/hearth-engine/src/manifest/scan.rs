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
//! hearthd only ever reads here: files are opened read-only and non-blocking
//! (a FIFO named `x.yaml` cannot hang the scan), at most `max_size + 1` bytes.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::core::{Content, Decl, FileId, FileScan, Listing};
use super::names::is_candidate;
use super::parse::{FileError, parse_manifest};

/// A cached read is trusted only if the file last changed at least this long
/// before the read began (covers the file-system clock's coarse tick).
pub const RACY_WINDOW: Duration = Duration::from_millis(100);

/// How many times a file that changes while it is read is read again.
const READ_ATTEMPTS: usize = 3;

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
    /// Files whose bytes had changed and were parsed.
    pub parsed: usize,
    /// Of those, files whose new bytes did not parse (the last good state
    /// is kept): each bad version of a file counts once.
    pub parse_errors: usize,
}

pub struct Scanner {
    dir: PathBuf,
    max_size: u64,
    cache: HashMap<String, Cached>,
    scans: u64,
}

impl Scanner {
    pub fn new(dir: PathBuf, max_size: u64) -> Scanner {
        Scanner {
            dir,
            max_size,
            cache: HashMap::new(),
            scans: 0,
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Lists the directory and reads what changed.
    pub fn scan(&mut self) -> (Listing, ScanStats) {
        let started = SystemTime::now();
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
            // Follows symlinks: `vm.yaml -> ..data/vm.yaml` is its target.
            let meta = match std::fs::metadata(&path) {
                Ok(m) => m,
                // Vanished since the listing, or a dangling symlink: not there.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    stats.files += 1;
                    files.push((
                        name,
                        path,
                        FileScan {
                            id: None,
                            content: Content::Invalid(FileError::new(format!("cannot read: {e}"))),
                        },
                    ));
                    continue;
                }
            };
            if !meta.is_file() {
                continue; // a directory or a device named like a manifest
            }
            stats.files += 1;
            let stamp = Stamp::of(&meta);
            if let Some(c) = self.cache.get_mut(&name)
                && c.stamp == stamp
                && !c.racy
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
                        Some(c) if c.hash == hash => c.content.clone(),
                        _ => {
                            stats.parsed += 1;
                            match parse_manifest(&bytes, &self.dir) {
                                Ok(objects) => Content::Valid(
                                    objects.into_iter().map(Decl::new).collect::<Arc<[Decl]>>(),
                                ),
                                Err(e) => {
                                    stats.parse_errors += 1;
                                    Content::Invalid(e)
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
        self.cache.retain(|_, c| c.seen == generation);
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
            let file = match std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
                .open(path)
            {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Got::Gone,
                Err(e) => return Got::Error(e),
            };
            let before = match file.metadata() {
                Ok(m) if m.is_file() => Stamp::of(&m),
                Ok(_) => return Got::Gone,
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

enum Got {
    Bytes(Stamp, Vec<u8>),
    TooLarge(Stamp),
    Changing(Stamp),
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
        let mut s = Scanner::new(dir.to_path_buf(), 1 << 20);
        let (l, stats) = s.scan();
        let f = files(&l);
        let names: Vec<_> = f
            .keys()
            .map(|p| p.file_name().unwrap().to_owned())
            .collect();
        assert_eq!(names, vec!["a.yaml", "b.yaml"]);
        assert!(f.values().all(|s| matches!(s.content, Content::Valid(_))));
        assert_eq!(stats.files, 2);
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
        let mut s = Scanner::new(d.path().to_path_buf(), 1 << 20);
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
        let mut s = Scanner::new(d.path().to_path_buf(), 1 << 20);
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
        let mut s = Scanner::new(d.path().to_path_buf(), 1 << 20);
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
        let mut s = Scanner::new(d.path().to_path_buf(), 1000);
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

    #[test]
    fn a_fifo_named_like_a_manifest_does_not_hang_the_scan() {
        let d = tempfile::tempdir().expect("tmp");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            d.path().join("fifo.yaml"),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .expect("mkfifo");
        let mut s = Scanner::new(d.path().to_path_buf(), 1000);
        let (l, _) = s.scan();
        assert!(files(&l).is_empty());
    }

    #[test]
    fn a_missing_directory_is_missing_not_empty() {
        let d = tempfile::tempdir().expect("tmp");
        let mut s = Scanner::new(d.path().join("nope"), 1000);
        assert!(matches!(s.scan().0, Listing::Missing(_)));
    }
}
