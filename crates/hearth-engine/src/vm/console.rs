//! The console logs' bound: a guest can write to its serial port without
//! end, and QEMU appends every byte to `serial.log` (it has no size limit
//! of its own). Once a log holds more than the bound on disk, its oldest
//! part is punched out (`FALLOC_FL_PUNCH_HOLE`): QEMU goes on writing at
//! its offset, the file keeps its length, and only the newest half of the
//! bound stays allocated. Readers skip the hole (`SEEK_DATA`, see
//! [`data_from`]). QEMU's own `qemu.log` is held to the same bound: every
//! launch appends to it, and QEMU prints there what some devices warn about
//! the guest.
//!
//! Cost follows output, not VMs: one inotify watch per log (added when a
//! QEMU is launched or adopted, gone with the file), and a thread that
//! sleeps in `read` until a log is written, then looks at the logs written
//! since, at most once a second. A log that is not written costs nothing.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask, Watches};

/// How often, at most, a written log is looked at: what a guest writes in
/// this time may pass the bound before it is trimmed.
const SETTLE: Duration = Duration::from_secs(1);
/// Punched ranges end on this boundary (a filesystem block).
const BLOCK: u64 = 4096;

/// Bytes of `file` on disk.
fn allocated(m: &std::fs::Metadata) -> u64 {
    m.blocks() * 512
}

/// Frees all but the newest `max / 2` bytes of the log at `path` once more
/// than `max` are allocated; the length and the offsets stay. Returns the
/// bytes freed (0 when under the bound). `identity` (device, inode), when
/// given, must be the file's: a log moved aside and replaced is not the one
/// the caller meant.
pub fn trim(path: &Path, max: u64, identity: Option<(u64, u64)>) -> std::io::Result<u64> {
    let file = std::fs::OpenOptions::new().write(true).open(path)?;
    let m = file.metadata()?;
    if identity.is_some_and(|id| id != (m.dev(), m.ino())) || allocated(&m) <= max {
        return Ok(0);
    }
    let keep = (max / 2).max(BLOCK);
    let end = m.len().saturating_sub(keep) / BLOCK * BLOCK;
    if end == 0 {
        return Ok(0);
    }
    rustix::fs::fallocate(
        &file,
        rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
        0,
        end,
    )?;
    let after = file.metadata()?;
    Ok(allocated(&m).saturating_sub(allocated(&after)))
}

/// Where the log's bytes at or after `offset` start: `offset` itself, or the
/// end of a hole [`trim`] punched (the bytes in it were dropped). `None`
/// when there is nothing to read from `offset` on.
pub fn data_from(file: &impl std::os::fd::AsFd, offset: u64) -> Option<u64> {
    match rustix::fs::seek(file, rustix::fs::SeekFrom::Data(offset)) {
        Ok(at) => Some(at),
        // ENXIO: only a hole (or nothing) from `offset` to the end.
        Err(rustix::io::Errno::NXIO) => None,
        // A filesystem that cannot say: read from where the caller is.
        Err(_) => Some(offset),
    }
}

/// A watched log: its path and the file it was when the watch was added.
#[derive(Clone, Debug)]
struct Watched {
    path: PathBuf,
    identity: (u64, u64),
}

/// The bound kept on every running VM's console log.
pub struct Consoles {
    max: u64,
    inner: Mutex<Option<Keeper>>,
}

struct Keeper {
    watches: Watches,
    logs: Arc<Mutex<HashMap<WatchDescriptor, Watched>>>,
}

impl Consoles {
    /// `max` bytes allocated per log at most (0: no bound).
    pub fn new(max: u64) -> Consoles {
        Consoles {
            max,
            inner: Mutex::new(None),
        }
    }

    /// Keeps the log at `path` (written by a QEMU just launched or adopted)
    /// under the bound, and trims it once now. The first call starts the
    /// watching thread. Failures cost only the bound, and are logged.
    pub fn watch(&self, path: &Path) {
        if self.max == 0 {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.is_none() {
            match start(self.max) {
                Ok(k) => *inner = Some(k),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot watch the console logs; they are not bounded");
                    return;
                }
            }
        }
        let Some(keeper) = inner.as_mut() else { return };
        let Ok(m) = std::fs::metadata(path) else {
            return;
        };
        let identity = (m.dev(), m.ino());
        match keeper.watches.add(path, WatchMask::MODIFY) {
            Ok(wd) => {
                keeper
                    .logs
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(
                        wd,
                        Watched {
                            path: path.to_path_buf(),
                            identity,
                        },
                    );
            }
            Err(e) => {
                tracing::warn!(log = %path.display(), error = %e, "cannot watch a console log; it is not bounded")
            }
        }
        trim_logged(path, self.max, Some(identity));
    }
}

fn trim_logged(path: &Path, max: u64, identity: Option<(u64, u64)>) {
    match trim(path, max, identity) {
        Ok(0) => {}
        Ok(freed) => tracing::debug!(log = %path.display(), freed, "console log trimmed"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(log = %path.display(), error = %e, "cannot trim a console log"),
    }
}

fn start(max: u64) -> std::io::Result<Keeper> {
    let inotify = Inotify::init()?;
    let watches = inotify.watches();
    let logs: Arc<Mutex<HashMap<WatchDescriptor, Watched>>> = Arc::default();
    let seen = logs.clone();
    std::thread::Builder::new()
        .name("console-logs".into())
        .spawn(move || run(inotify, seen, max))?;
    Ok(Keeper { watches, logs })
}

/// Sleeps until a watched log is written, trims what was written, waits
/// [`SETTLE`] (writes meanwhile queue up as one event per log), again.
fn run(mut inotify: Inotify, logs: Arc<Mutex<HashMap<WatchDescriptor, Watched>>>, max: u64) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let events = match inotify.read_events_blocking(&mut buffer) {
            Ok(events) => events,
            Err(e) => {
                tracing::warn!(error = %e, "console logs: inotify read failed; they are no longer bounded");
                return;
            }
        };
        let mut written: BTreeMap<PathBuf, (u64, u64)> = BTreeMap::new();
        let mut all = false;
        {
            let mut map = logs.lock().unwrap_or_else(|p| p.into_inner());
            for e in events {
                if e.mask.contains(EventMask::Q_OVERFLOW) {
                    all = true;
                } else if e.mask.contains(EventMask::IGNORED) {
                    // The file is gone (moved aside and replaced, or the
                    // VM deleted): so is its watch.
                    map.remove(&e.wd);
                } else if let Some(w) = map.get(&e.wd) {
                    written.insert(w.path.clone(), w.identity);
                }
            }
            if all {
                for w in map.values() {
                    written.insert(w.path.clone(), w.identity);
                }
            }
        }
        for (path, identity) in written {
            trim_logged(&path, max, Some(identity));
        }
        std::thread::sleep(SETTLE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    fn lines(from: usize, bytes: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut i = from;
        while out.len() < bytes {
            writeln!(out, "line {i:08} of the console").unwrap();
            i += 1;
        }
        out
    }

    #[test]
    fn a_log_past_the_bound_keeps_its_newest_half_at_the_same_offsets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serial.log");
        let text = lines(0, 3 << 20);
        std::fs::write(&path, &text).unwrap();
        assert_eq!(trim(&path, 4 << 20, None).unwrap(), 0, "under the bound");
        let freed = trim(&path, 1 << 20, None).unwrap();
        let m = std::fs::metadata(&path).unwrap();
        assert_eq!(m.len(), text.len() as u64, "the length stays");
        assert!(allocated(&m) <= 1 << 20, "{} bytes on disk", allocated(&m));
        assert!(freed >= 2 << 20, "freed {freed}");
        let file = std::fs::File::open(&path).unwrap();
        let start = data_from(&file, 0).expect("data after the hole");
        assert!(start > 0 && start.is_multiple_of(BLOCK), "{start}");
        assert!(text.len() as u64 - start >= 512 << 10, "{start}");
        let mut kept = vec![0u8; text.len() - start as usize];
        file.read_exact_at(&mut kept, start).unwrap();
        assert_eq!(kept, text[start as usize..], "the newest bytes as written");
        // Another file at the path: not trimmed for the old one.
        std::fs::write(dir.path().join("other"), &text).unwrap();
        let old = (m.dev(), m.ino());
        std::fs::rename(dir.path().join("other"), &path).unwrap();
        assert_eq!(trim(&path, 1 << 20, Some(old)).unwrap(), 0);
    }

    #[test]
    fn a_watched_log_is_trimmed_while_it_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serial.log");
        let mut log = std::fs::File::create(&path).unwrap();
        let consoles = Consoles::new(256 << 10);
        consoles.watch(&path);
        let mut written = 0;
        for round in 0..12 {
            let chunk = lines(round * 10_000, 128 << 10);
            log.write_all(&chunk).unwrap();
            written += chunk.len() as u64;
            std::thread::sleep(Duration::from_millis(200));
        }
        let bounded = hearth_test_support::eventually(Duration::from_secs(10), || {
            allocated(&std::fs::metadata(&path).unwrap()) <= 256 << 10
        });
        let m = std::fs::metadata(&path).unwrap();
        assert!(bounded, "{} bytes on disk of {written}", allocated(&m));
        assert_eq!(m.len(), written);
        // The last line written is whole, where it was written.
        let file = std::fs::File::open(&path).unwrap();
        let tail = lines(11 * 10_000, 128 << 10);
        let mut read = vec![0u8; tail.len()];
        file.read_exact_at(&mut read, written - tail.len() as u64)
            .unwrap();
        assert_eq!(read, tail);
    }
}
