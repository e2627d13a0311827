//! The async shell around the core: inotify, debounce, re-lists, engine calls.
//!
//! inotify events are hints only: each one (on a name that can matter) moves
//! a debounce deadline; when the directory has been quiet for `quiet`, or
//! `max_delay` after the first hint of a burst, the whole directory is
//! re-listed and handed to the core. A re-list also runs at start-up, every
//! `resync`, right away on an inotify queue overflow or a lost watch (the
//! directory removed, moved or unmounted), and whenever the core asks for one
//! (to confirm an absence before a delete, or to retry a refused call).
//!
//! The re-list itself (reading files, the core, the engine calls) runs on a
//! blocking thread, one at a time. The scan (listing, reading, parsing) holds
//! only the scanner's lock; the core's state, which `GET /v1/sources` reads,
//! is locked only for the core's decision and the engine calls, so a slow
//! scan never holds up the API. A parse that outlasts its scan
//! (`scan::PARSE_WAIT`) wakes a re-list of its own when it is done.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask};
use serde::Serialize;
use serde_json::Value;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::apply::{Applier, owned_objects};
use super::core::{Command, Core, CoreConfig, FileId};
pub use super::counters::{ManifestCounters, Reason};
use super::names::wakes_relist;
use super::owner::SourceOwner;
use super::scan::{ScanStats, Scanner};
use crate::engine::Engine;

#[derive(Clone, Debug)]
pub struct ManifestConfig {
    pub dir: PathBuf,
    /// Re-list once no relevant event came for this long.
    pub quiet: Duration,
    /// ...but at the latest this long after the first event of a burst.
    pub max_delay: Duration,
    /// Full re-list (and store resync) even without events.
    pub resync: Duration,
    /// An object's file must be absent this long, confirmed by a later
    /// re-list, before the object is deleted.
    pub delete_grace: Duration,
    /// Larger files are an error and are not read.
    pub max_file_size: u64,
    /// While the directory is missing or unwatched, look again this often.
    pub missing_poll: Duration,
}

impl ManifestConfig {
    pub fn new(dir: PathBuf) -> ManifestConfig {
        ManifestConfig {
            dir,
            quiet: Duration::from_millis(100),
            max_delay: Duration::from_secs(1),
            resync: Duration::from_secs(30),
            delete_grace: Duration::from_secs(2),
            max_file_size: hearth_api::limits::MAX_MANIFEST_BYTES as u64,
            missing_poll: Duration::from_secs(1),
        }
    }
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct RelistStats {
    at: DateTime<Utc>,
    reason: Reason,
    /// Wall time of the re-list proper: listing the directory, reading and
    /// parsing what changed, and the core's decision.
    relist_us: u64,
    /// CPU time of the same, on the thread that ran it.
    relist_cpu_us: u64,
    /// Wall and CPU time of everything, engine calls (store writes) included.
    duration_us: u64,
    cpu_us: u64,
    #[serde(flatten)]
    scan: ScanStats,
    applies: usize,
    deletes: usize,
}

struct State {
    core: Core,
    /// Finished re-lists by reason.
    relists: BTreeMap<Reason, u64>,
    last: Option<RelistStats>,
}

/// The manifest directory as a source of desired state.
pub struct ManifestSource {
    config: ManifestConfig,
    applier: Applier,
    state: Mutex<State>,
    /// Held for a whole re-list: one at a time, numbered in order.
    scanner: Mutex<Scanner>,
    /// Re-lists begun, counted before the directory is listed: one that
    /// finishes as number N+1 after this read N began after the read.
    relists_started: AtomicU64,
    /// A parse that outlasted its re-list is done.
    parsed: Arc<Notify>,
    watching: AtomicBool,
    counters: Mutex<ManifestCounters>,
}

impl ManifestSource {
    /// Starts watching; the first re-list runs at once.
    pub fn start(engine: Arc<Engine>, config: ManifestConfig) -> Arc<ManifestSource> {
        let core_config = CoreConfig {
            delete_grace: config.delete_grace,
            ..CoreConfig::default()
        };
        let stored = owned_objects(&engine, &SourceOwner::directory());
        let parsed = Arc::new(Notify::new());
        let wake = parsed.clone();
        let scanner = Scanner::new(
            config.dir.clone(),
            config.max_file_size,
            Box::new(move || wake.notify_one()),
        );
        let source = Arc::new(ManifestSource {
            state: Mutex::new(State {
                core: Core::new(core_config, stored),
                relists: BTreeMap::new(),
                last: None,
            }),
            scanner: Mutex::new(scanner),
            relists_started: AtomicU64::new(0),
            parsed,
            config,
            applier: Applier {
                engine,
                owner: SourceOwner::directory(),
            },
            watching: AtomicBool::new(false),
            counters: Mutex::new(ManifestCounters::default()),
        });
        tracing::info!(dir = %source.config.dir.display(), "watching the manifest directory");
        let weak = Arc::downgrade(&source);
        tokio::spawn(async move { run(weak).await });
        source
    }

    pub fn dir(&self) -> &Path {
        &self.config.dir
    }

    /// Re-lists by reason and parse errors so far, for `GET /metrics`.
    pub fn counters(&self) -> ManifestCounters {
        self.counters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What `GET /v1/sources` shows: every file, what it declares and in what
    /// state, pending deletes, problems, and how the re-lists went.
    pub fn view(&self) -> Value {
        let st = self.lock();
        let core = st.core.view(std::time::Instant::now());
        let mut v = serde_json::to_value(&core).unwrap_or(Value::Null);
        if let Value::Object(map) = &mut v {
            map.insert(
                "directory".into(),
                Value::from(self.config.dir.display().to_string()),
            );
            map.insert(
                "watching".into(),
                Value::from(self.watching.load(Ordering::SeqCst)),
            );
            map.insert(
                "settings".into(),
                serde_json::json!({
                    "quietMs": self.config.quiet.as_millis() as u64,
                    "maxDelayMs": self.config.max_delay.as_millis() as u64,
                    "resyncSeconds": self.config.resync.as_secs(),
                    "deleteGraceMs": self.config.delete_grace.as_millis() as u64,
                    "maxFileBytes": self.config.max_file_size,
                }),
            );
            map.insert(
                "relists".into(),
                serde_json::to_value(&st.relists).unwrap_or(Value::Null),
            );
            map.insert(
                "relistsStarted".into(),
                Value::from(self.relists_started.load(Ordering::SeqCst)),
            );
            map.insert(
                "lastRelist".into(),
                serde_json::to_value(&st.last).unwrap_or(Value::Null),
            );
        }
        v
    }

    /// One full re-list, on the calling (blocking) thread.
    fn relist(&self, reason: Reason) {
        let wall = std::time::Instant::now();
        let cpu = thread_cpu();
        let mut scanner = self.scanner.lock().unwrap_or_else(|p| p.into_inner());
        self.relists_started.fetch_add(1, Ordering::SeqCst);
        let stored = matches!(
            reason,
            Reason::Start | Reason::Periodic | Reason::Overflow | Reason::WatchLost
        )
        .then(|| owned_objects(&self.applier.engine, &self.applier.owner));
        let (listing, scan) = scanner.scan();
        let mut st = self.lock();
        if let Some(stored) = stored {
            st.core.resync_store(stored);
        }
        let now = std::time::Instant::now();
        let commands = st.core.scan(now, listing);
        let relist_us = wall.elapsed().as_micros() as u64;
        let relist_cpu_us = thread_cpu().saturating_sub(cpu).as_micros() as u64;
        let (mut applies, mut deletes) = (0, 0);
        for c in &commands {
            match c {
                Command::Apply { .. } => applies += 1,
                Command::Delete { .. } => deletes += 1,
                Command::Report { .. } => {}
            }
            let outcome = self.applier.execute(c);
            st.core.done(std::time::Instant::now(), c, &outcome);
        }
        for r in st.core.reports() {
            self.applier.execute(&r);
        }
        *st.relists.entry(reason).or_insert(0) += 1;
        {
            let mut c = self.counters.lock().unwrap_or_else(|p| p.into_inner());
            *c.relists.entry(reason).or_insert(0) += 1;
            c.parse_errors += scan.parse_errors as u64;
        }
        let stats = RelistStats {
            at: Utc::now(),
            reason,
            relist_us,
            relist_cpu_us,
            duration_us: wall.elapsed().as_micros() as u64,
            cpu_us: thread_cpu().saturating_sub(cpu).as_micros() as u64,
            scan,
            applies,
            deletes,
        };
        tracing::debug!(?stats, "re-listed the manifest directory");
        st.last = Some(stats);
    }

    fn next_due(&self) -> Option<std::time::Instant> {
        self.lock().core.next_wake()
    }
}

fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        t.tv_sec.max(0) as u64,
        t.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

/// The inotify side: one watch on the directory itself.
struct Watcher {
    fd: Option<AsyncFd<Inotify>>,
    watch: Option<(WatchDescriptor, FileId)>,
    buffer: Vec<u8>,
}

/// What a batch of inotify events means.
#[derive(Default)]
struct Hints {
    relevant: bool,
    overflow: bool,
    lost: bool,
}

impl Watcher {
    fn new() -> Watcher {
        let registered = Inotify::init().and_then(|inotify| {
            // SAFETY: the inotify descriptor is owned by the `Inotify` moved
            // into the `AsyncFd`, so it stays open until the `AsyncFd` (and
            // with it the registration) is dropped; nothing else closes it.
            unsafe { AsyncFd::register(inotify) }.map_err(std::io::Error::from)
        });
        let fd = match registered {
            Ok(fd) => Some(fd),
            Err(e) => {
                // Still correct without it: the periodic re-list remains.
                tracing::warn!(error = %e, "cannot use inotify; the manifest directory is only re-listed periodically");
                None
            }
        };
        Watcher {
            fd,
            watch: None,
            buffer: vec![0; 64 * 1024],
        }
    }

    /// Makes sure the watch is on the directory that is there now (it may
    /// have been removed and created again). Returns whether it is.
    fn ensure(&mut self, dir: &Path) -> bool {
        let Some(fd) = &self.fd else { return false };
        let current = std::fs::metadata(dir).ok().filter(|m| m.is_dir()).map(|m| {
            use std::os::unix::fs::MetadataExt;
            FileId {
                dev: m.dev(),
                ino: m.ino(),
            }
        });
        match (&self.watch, current) {
            (Some((_, id)), Some(now)) if *id == now => return true,
            (Some((wd, _)), _) => {
                let _ = fd.get_ref().watches().remove(wd.clone());
                self.watch = None;
            }
            (None, _) => {}
        }
        let Some(id) = current else { return false };
        let mask = WatchMask::CREATE
            | WatchMask::MODIFY
            | WatchMask::CLOSE_WRITE
            | WatchMask::ATTRIB
            | WatchMask::MOVED_FROM
            | WatchMask::MOVED_TO
            | WatchMask::DELETE
            | WatchMask::DELETE_SELF
            | WatchMask::MOVE_SELF
            | WatchMask::ONLYDIR;
        match fd.get_ref().watches().add(dir, mask) {
            Ok(wd) => {
                self.watch = Some((wd, id));
                true
            }
            Err(e) => {
                tracing::debug!(dir = %dir.display(), error = %e, "cannot watch the manifest directory yet");
                false
            }
        }
    }

    /// Reads every queued event without waiting.
    fn drain(&mut self) -> Hints {
        let mut hints = Hints::default();
        let Some(fd) = self.fd.as_mut() else {
            return hints;
        };
        // Until WouldBlock: nothing more queued.
        while let Ok(events) = fd.get_mut().read_events(&mut self.buffer) {
            for e in events {
                classify(&mut hints, &self.watch, &e.wd, e.mask, e.name);
            }
        }
        if hints.lost
            && let Some((wd, _)) = self.watch.take()
        {
            let _ = fd.get_ref().watches().remove(wd);
        }
        hints
    }

    /// Waits until events are queued, then reads them.
    async fn next(&mut self) -> Hints {
        let Some(fd) = self.fd.as_mut() else {
            return std::future::pending().await;
        };
        match fd.readable_mut().await {
            Ok(mut guard) => guard.clear_ready(),
            Err(_) => return std::future::pending().await,
        }
        self.drain()
    }
}

fn classify(
    hints: &mut Hints,
    watch: &Option<(WatchDescriptor, FileId)>,
    wd: &WatchDescriptor,
    mask: EventMask,
    name: Option<&std::ffi::OsStr>,
) {
    if mask.contains(EventMask::Q_OVERFLOW) {
        hints.overflow = true;
        return;
    }
    let ours = watch.as_ref().is_some_and(|(w, _)| w == wd);
    if !ours {
        return; // a watch we already dropped
    }
    if mask.intersects(
        EventMask::IGNORED | EventMask::DELETE_SELF | EventMask::MOVE_SELF | EventMask::UNMOUNT,
    ) {
        hints.lost = true;
        return;
    }
    match name.and_then(|n| n.to_str()) {
        Some(n) => hints.relevant |= wakes_relist(n),
        None => hints.relevant = true,
    }
}

async fn run(source: std::sync::Weak<ManifestSource>) {
    let Some(parsed) = source.upgrade().map(|s| s.parsed.clone()) else {
        return;
    };
    let mut watcher = Watcher::new();
    let mut due: Option<Reason> = Some(Reason::Start);
    // First and latest relevant event of the current burst.
    let mut burst: Option<(Instant, Instant)> = None;
    let mut next_periodic = Instant::now();
    loop {
        let Some(src) = source.upgrade() else { return };
        if let Some(reason) = due.take() {
            // Watch first, then list: a change after the listing is an event.
            watcher.ensure(&src.config.dir);
            if watcher.drain().lost {
                watcher.ensure(&src.config.dir);
            }
            src.watching
                .store(watcher.watch.is_some(), Ordering::SeqCst);
            let s = src.clone();
            if let Err(e) = tokio::task::spawn_blocking(move || s.relist(reason)).await {
                tracing::error!(error = %e, "manifest re-list failed");
            }
            burst = None;
            next_periodic = Instant::now() + src.config.resync;
        }

        let now = Instant::now();
        let mut deadline = next_periodic;
        let mut why = Reason::Periodic;
        if let Some((first, last)) = burst {
            let d = (last + src.config.quiet).min(first + src.config.max_delay);
            if d < deadline {
                (deadline, why) = (d, Reason::Event);
            }
        }
        if let Some(w) = src.next_due() {
            let d = Instant::from_std(w);
            if d < deadline {
                (deadline, why) = (d, Reason::Due);
            }
        }
        if watcher.watch.is_none() {
            let d = now + src.config.missing_poll;
            if d < deadline {
                (deadline, why) = (d, Reason::Missing);
            }
        }
        drop(src);

        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => due = Some(why),
            _ = parsed.notified() => due = Some(Reason::Parsed),
            hints = watcher.next() => {
                let now = Instant::now();
                if hints.overflow {
                    tracing::warn!("inotify queue overflow: re-listing the manifest directory");
                    due = Some(Reason::Overflow);
                } else if hints.lost {
                    tracing::warn!("lost the watch on the manifest directory: re-listing");
                    due = Some(Reason::WatchLost);
                } else if hints.relevant {
                    burst = Some(match burst {
                        Some((first, _)) => (first, now),
                        None => (now, now),
                    });
                }
            }
        }
    }
}
