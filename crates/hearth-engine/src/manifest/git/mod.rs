//! A git repository as a source of desired state: a remote's branch (or
//! tag, or commit) fetched every `interval` or when asked, each commit read
//! whole from git's objects and handed to the same pure core as the
//! manifest directory ([`crate::manifest::core`]), with `git:NAME:PATH` as
//! the objects' owner.
//!
//! Never a delete because of the remote: a fetch that fails (unreachable,
//! refused, timed out, the repository or the ref gone), a commit without
//! the source's folder, or one with no manifest at all leaves the source
//! `Stale` with the reason and the last good commit, and the core is not
//! given anything new, so nothing changes until a good commit comes. A
//! rewritten history (a force push) is followed: the new commit is the
//! desired state, and the source says the history was rewritten.

pub mod objects;
pub mod repo;
#[cfg(test)]
mod test_git;
pub mod tree;

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use tokio::sync::Notify;

use super::apply::{Applier, owned_objects};
use super::core::{Command, Content, Core, CoreConfig, Listing};
use super::owner::SourceOwner;
use crate::engine::Engine;
use objects::Objects;
use repo::{APPLIED, CommitInfo, FETCHED, Repo};
use tree::TreeEntry;

/// One git source, as configured.
#[derive(Clone, Debug)]
pub struct GitConfig {
    /// Unique among the sources; in the objects' owner (`git:NAME:PATH`).
    pub name: String,
    pub url: String,
    /// A branch, a tag, `HEAD` or a full commit id.
    pub reference: String,
    /// The folder in the repository whose manifests (in every folder
    /// below it too) declare objects; "" for the whole repository.
    pub path: String,
    pub interval: Duration,
    pub fetch_timeout: Duration,
    /// The cache repository (a bare repository of hearthd's own).
    pub cache: PathBuf,
    pub max_file_size: u64,
    pub max_files: usize,
    pub delete_grace: Duration,
    /// When set, only commits signed by one of these keys are applied.
    pub signers: repo::Signers,
    pub auth: repo::Auth,
}

impl GitConfig {
    pub fn new(name: &str, url: &str, cache: PathBuf) -> GitConfig {
        GitConfig {
            name: name.to_string(),
            url: url.to_string(),
            reference: "HEAD".to_string(),
            path: String::new(),
            interval: Duration::from_secs(30),
            fetch_timeout: Duration::from_secs(120),
            cache,
            max_file_size: hearth_api::limits::MAX_MANIFEST_BYTES as u64,
            max_files: 10_000,
            // A commit is read whole: a file gone from it is gone, and the
            // next poll confirms it.
            delete_grace: Duration::ZERO,
            signers: repo::Signers::default(),
            auth: repo::Auth::default(),
        }
    }
}

/// Whether a source's name can be part of an owner string and a URL path.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
}

/// A source's state, as `GET /v1/sources` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum SourceState {
    /// Nothing fetched yet.
    Pending,
    /// The last fetch gave a good commit, and it is applied.
    Ready,
    /// The remote could not give a good commit: the last good one stands.
    Stale,
    /// The commit is applied but some of its objects are declared twice or
    /// refused.
    Conflict,
    /// The fetched commit is not signed by an allowed signer: the last
    /// verified one stands.
    Unverified,
}

/// Why a sync ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Trigger {
    Start,
    Interval,
    Refresh,
    Retry,
}

/// Something the source wants people to know (a history rewrite, a
/// commit that could not be used, a file not read).
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SourceEvent {
    pub at: DateTime<Utc>,
    pub reason: String,
    pub message: String,
}

const MAX_EVENTS: usize = 20;

struct State {
    core: Core,
    state: SourceState,
    reason: Option<String>,
    fetched: Option<CommitInfo>,
    applied: Option<CommitInfo>,
    last_fetch_at: Option<DateTime<Utc>>,
    last_applied_at: Option<DateTime<Utc>>,
    /// The last good commit's listing, given to the core again for its
    /// retries and delete confirmations while nothing new comes.
    listing: Option<Listing>,
    /// Parsed blobs of the last good commit, by blob id.
    parsed: HashMap<String, Content>,
    /// The sizes of the last commit's blobs, by blob id (an id's size
    /// never changes): only new blobs are asked for theirs.
    sizes: HashMap<String, u64>,
    ignored: Vec<(String, String)>,
    events: VecDeque<SourceEvent>,
    syncs: u64,
    failed_fetches: u64,
    last_sync: Option<SyncStats>,
    /// When the store's objects of this source were last read whole (at
    /// start: the core began from them).
    store_read_at: Option<std::time::Instant>,
}

/// More packs than this in a cache and it is repacked into one (git's own
/// `gc.autoPackLimit`).
const MAX_PACKS: usize = 50;

/// How often a new commit's apply first reads the source's objects from
/// the store again, as the directory's periodic re-list does.
const STORE_RESYNC: Duration = Duration::from_secs(30);

/// How the last sync went, for `GET /v1/sources` (and the benchmark).
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SyncStats {
    pub at: Option<DateTime<Utc>>,
    pub trigger: Option<Trigger>,
    /// `git fetch` (and the commit's lookup).
    pub fetch_us: u64,
    /// The tree listed, new blobs read and parsed.
    pub read_us: u64,
    /// The core's decision and the engine calls.
    pub apply_us: u64,
    pub total_us: u64,
    /// Manifest files in the commit, and blobs read (the ones not seen
    /// before).
    pub files: usize,
    pub blobs_read: usize,
    /// A new commit was applied.
    pub applied: bool,
}

/// A running git source.
pub struct GitSource {
    config: GitConfig,
    applier: Applier,
    state: Mutex<State>,
    /// The cache's objects, read through `git cat-file` kept running.
    objects: tokio::sync::Mutex<Objects>,
    /// One sync at a time.
    sync_lock: tokio::sync::Mutex<()>,
    refresh: Notify,
    /// Syncs begun, each numbered as it begins.
    started: std::sync::atomic::AtomicU64,
    /// The number of the last sync finished.
    done: tokio::sync::watch::Sender<u64>,
}

impl GitSource {
    /// Starts the source; its first fetch runs at once.
    pub fn start(engine: Arc<Engine>, config: GitConfig) -> Arc<GitSource> {
        let owner = SourceOwner::git(&config.name);
        let stored = owned_objects(&engine, &owner);
        let core = Core::new(
            CoreConfig {
                delete_grace: config.delete_grace,
                ..CoreConfig::default()
            },
            stored,
        );
        let source = Arc::new(GitSource {
            applier: Applier { engine, owner },
            state: Mutex::new(State {
                core,
                state: SourceState::Pending,
                reason: None,
                fetched: None,
                applied: None,
                last_fetch_at: None,
                last_applied_at: None,
                listing: None,
                parsed: HashMap::new(),
                sizes: HashMap::new(),
                ignored: Vec::new(),
                events: VecDeque::new(),
                syncs: 0,
                failed_fetches: 0,
                last_sync: None,
                store_read_at: Some(std::time::Instant::now()),
            }),
            objects: tokio::sync::Mutex::new(Objects::new(&config.cache)),
            sync_lock: tokio::sync::Mutex::new(()),
            refresh: Notify::new(),
            started: std::sync::atomic::AtomicU64::new(0),
            done: tokio::sync::watch::channel(0).0,
            config,
        });
        tracing::info!(source = %source.config.name, url = %hearth_api::redact::redact_credentials(&source.config.url), reference = %source.config.reference, "following a git source");
        let weak = Arc::downgrade(&source);
        tokio::spawn(async move { run(weak).await });
        source
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fetches now, and returns once a sync that began after the call has
    /// finished (or `wait` has passed).
    pub async fn refresh(&self, wait: Duration) {
        use std::sync::atomic::Ordering;
        let mut rx = self.done.subscribe();
        // A sync running now may have read the remote before the call; the
        // one this notice starts has a higher number.
        let target = self.started.load(Ordering::SeqCst) + 1;
        self.refresh.notify_one();
        let _ = tokio::time::timeout(wait, rx.wait_for(|n| *n >= target)).await;
    }

    /// What `GET /v1/sources` shows of this source.
    pub fn view(&self) -> Value {
        let st = self.lock();
        let core = st.core.view(std::time::Instant::now());
        serde_json::json!({
            "name": self.config.name,
            "kind": "git",
            "url": hearth_api::redact::redact_credentials(&self.config.url),
            "ref": self.config.reference,
            "path": self.config.path,
            "intervalSeconds": self.config.interval.as_secs(),
            "state": st.state,
            "reason": st.reason,
            "fetchedCommit": st.fetched,
            "appliedCommit": st.applied,
            "lastFetchAt": st.last_fetch_at,
            "lastAppliedAt": st.last_applied_at,
            "ignored": st.ignored.iter().map(|(p, w)| serde_json::json!({"path": p, "why": w})).collect::<Vec<_>>(),
            "events": st.events,
            "syncs": st.syncs,
            "lastSync": st.last_sync,
            "failedFetches": st.failed_fetches,
            "files": core.files,
            "problems": core.problems,
            "pendingDeletes": core.pending_deletes,
        })
    }

    /// Kept in the source's view and recorded as an event of the source
    /// (`hearth events`): each says what is wrong or unusual.
    fn event(&self, st: &mut State, reason: &str, message: String) {
        self.applier.engine.ctx().source_event(
            &self.config.name,
            hearth_api::EventType::Warning,
            reason,
            &message,
        );
        st.events.push_back(SourceEvent {
            at: Utc::now(),
            reason: reason.to_string(),
            message,
        });
        while st.events.len() > MAX_EVENTS {
            st.events.pop_front();
        }
    }

    /// Holds the source at its last good commit (Stale or Unverified):
    /// nothing is given to the core.
    fn hold(&self, state: SourceState, reason: String) {
        let mut st = self.lock();
        if st.state != state || st.reason.as_deref() != Some(reason.as_str()) {
            let last = st
                .applied
                .as_ref()
                .map(|c| format!("; the last good commit {} stands", short(&c.id)))
                .unwrap_or_else(|| "; nothing was applied yet".into());
            let tag = format!("{state:?}");
            self.event(&mut st, &tag, format!("{reason}{last}"));
        }
        st.state = state;
        st.reason = Some(reason);
    }

    /// One fetch, read and apply.
    async fn sync(self: &Arc<Self>, trigger: Trigger) {
        let _one = self.sync_lock.lock().await;
        let number = self
            .started
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        let started = std::time::Instant::now();
        let mut stats = SyncStats {
            at: Some(Utc::now()),
            trigger: Some(trigger),
            ..SyncStats::default()
        };
        let got = self.fetch_commit(trigger, &mut stats).await;
        if stats.fetch_us == 0 {
            // Nothing new, or held: the fetch was all of it.
            stats.fetch_us = started.elapsed().as_micros() as u64;
        }
        let applying = std::time::Instant::now();
        match got {
            Ok(Some(read)) => {
                stats.applied = true;
                let me = self.clone();
                let _ = tokio::task::spawn_blocking(move || me.apply(read)).await;
            }
            Ok(None) => {
                // Nothing new: the core's retries and confirmations run on
                // the last good listing.
                let me = self.clone();
                let _ = tokio::task::spawn_blocking(move || me.rescan()).await;
            }
            Err(Held(state, reason)) => self.hold(state, reason),
        }
        stats.apply_us = applying.elapsed().as_micros() as u64;
        stats.total_us = started.elapsed().as_micros() as u64;
        let mut st = self.lock();
        st.syncs += 1;
        st.last_sync = Some(stats);
        drop(st);
        self.done.send_replace(number);
    }

    /// Fetches and reads the commit, when it is not the one applied (or a
    /// start, which reads it again). Err: why the source is Stale.
    async fn fetch_commit(
        &self,
        trigger: Trigger,
        stats: &mut SyncStats,
    ) -> Result<Option<Read>, Held> {
        let fetch_started = std::time::Instant::now();
        let c = &self.config;
        let repo = Repo::open(&c.cache).await.map_err(stale)?;
        let fetched = repo
            .fetch(&c.url, &c.reference, &c.auth, c.fetch_timeout)
            .await;
        {
            let mut st = self.lock();
            st.last_fetch_at = Some(Utc::now());
            if fetched.is_err() {
                st.failed_fetches += 1;
            }
        }
        fetched.map_err(|e| {
            stale(format!(
                "fetching {} of {}: {e}",
                c.reference,
                hearth_api::redact::redact_credentials(&c.url)
            ))
        })?;
        let mut objects = self.objects.lock().await;
        let Some(info) = objects.describe(FETCHED).await.map_err(stale)? else {
            return Err(stale(format!(
                "the fetch of {} gave no commit",
                c.reference
            )));
        };
        let commit = info.id.clone();
        if c.signers.is_set() {
            match repo.verify(&commit, &c.signers).await.map_err(stale)? {
                Ok(_) => {}
                Err(why) => {
                    self.lock().fetched = Some(info);
                    return Err(Held(
                        SourceState::Unverified,
                        format!(
                            "commit {} is not signed by a key of {}: {why}",
                            short(&commit),
                            c.signers.files()
                        ),
                    ));
                }
            }
        }
        let (applied, has_listing) = {
            let mut st = self.lock();
            st.fetched = Some(info.clone());
            (
                st.applied.as_ref().map(|a| a.id.clone()),
                st.listing.is_some(),
            )
        };
        if applied.as_deref() == Some(commit.as_str()) && has_listing && trigger != Trigger::Start {
            let mut st = self.lock();
            if matches!(st.state, SourceState::Stale | SourceState::Unverified) {
                st.state = SourceState::Ready;
                st.reason = None;
            }
            return Ok(None);
        }
        // The last applied commit, from the cache: also after a restart.
        let previous = match applied {
            Some(a) => Some(a),
            None => objects
                .describe(APPLIED)
                .await
                .map_err(stale)?
                .map(|c| c.id),
        };
        let rewritten = match &previous {
            // One commit on top of the applied one (the usual push) needs
            // no `git merge-base`.
            Some(p) if p != &commit => {
                !info.parents.contains(p) && !repo.is_ancestor(p, &commit).await.unwrap_or(false)
            }
            _ => false,
        };
        stats.fetch_us = fetch_started.elapsed().as_micros() as u64;
        let read_started = std::time::Instant::now();
        let Commit {
            listing,
            parsed,
            ignored,
            files,
            blobs_read,
        } = self.read_commit(&mut objects, &commit).await?;
        stats.files = files;
        stats.blobs_read = blobs_read;
        stats.read_us = read_started.elapsed().as_micros() as u64;
        Ok(Some(Read {
            repo,
            info,
            listing,
            parsed,
            ignored,
            rewritten: rewritten.then(|| previous.unwrap_or_default()),
        }))
    }

    /// The manifests of `commit` under the source's folder, reading only
    /// what was not read before: the sizes of new blobs, then the new
    /// manifests' blobs. Err (Stale): the folder is missing, or holds no
    /// manifest.
    async fn read_commit(&self, objects: &mut Objects, commit: &str) -> Result<Commit, Held> {
        let c = &self.config;
        let max_listing = c.max_files.saturating_mul(512).max(1 << 20);
        let prefix = tree::folder_prefix(&c.path);
        let folder = prefix.trim_end_matches('/');
        let mut entries = objects
            .files(commit, folder, max_listing)
            .await
            .map_err(stale)?
            .unwrap_or_default();
        self.fill_sizes(objects, &mut entries).await?;
        let selected = tree::select(&entries, &prefix, c.max_file_size, c.max_files);
        if !selected.folder_exists {
            return Err(stale(format!(
                "commit {} has no folder {:?}",
                short(commit),
                c.path
            )));
        }
        if selected.manifests.is_empty() {
            return Err(stale(format!(
                "commit {} has no manifest under {:?} (a commit that empties the source is not taken as deleting everything: delete the objects through the files one by one)",
                short(commit),
                if c.path.is_empty() {
                    "/"
                } else {
                    c.path.as_str()
                }
            )));
        }
        // Only blobs not parsed before are read.
        let mut parsed = HashMap::new();
        let mut wanted = Vec::new();
        let mut asked = std::collections::HashSet::new();
        {
            let st = self.lock();
            for e in &selected.manifests {
                if parsed.contains_key(&e.oid) || !asked.insert(e.oid.as_str()) {
                    continue;
                }
                match st.parsed.get(&e.oid) {
                    Some(content) => {
                        parsed.insert(e.oid.clone(), content.clone());
                    }
                    None => wanted.push(e.oid.as_str()),
                }
            }
        }
        if !wanted.is_empty() {
            let blobs = objects
                .blobs(&wanted, c.max_file_size as usize)
                .await
                .map_err(stale)?;
            for (oid, b) in blobs {
                parsed.insert(oid, tree::content_of(&b));
            }
        }
        Ok(Commit {
            listing: tree::listing(&selected.manifests, &parsed),
            parsed,
            ignored: selected.ignored,
            files: selected.manifests.len(),
            blobs_read: wanted.len(),
        })
    }

    /// Each blob entry's size: known from an earlier commit (an id's size
    /// never changes), else asked of git. Only this commit's sizes are
    /// kept.
    async fn fill_sizes(
        &self,
        objects: &mut Objects,
        entries: &mut [TreeEntry],
    ) -> Result<(), Held> {
        let known = std::mem::take(&mut self.lock().sizes);
        let unknown: std::collections::BTreeSet<&str> = entries
            .iter()
            .filter(|e| e.kind == "blob" && !known.contains_key(&e.oid))
            .map(|e| e.oid.as_str())
            .collect();
        let unknown: Vec<&str> = unknown.into_iter().collect();
        let fresh = objects.sizes(&unknown).await.map_err(stale)?;
        let mut sizes = HashMap::new();
        for e in entries.iter_mut().filter(|e| e.kind == "blob") {
            e.size = known.get(&e.oid).or_else(|| fresh.get(&e.oid)).copied();
            if let Some(size) = e.size {
                sizes.insert(e.oid.clone(), size);
            }
        }
        self.lock().sizes = sizes;
        Ok(())
    }

    /// Hands a new commit to the core and carries out what it says.
    fn apply(&self, read: Read) {
        let Read {
            repo,
            info,
            listing,
            parsed,
            ignored,
            rewritten,
        } = read;
        // The store is read whole only now and then (the core keeps what it
        // applied): a commit costs what it changed, not what the source holds.
        let resync_due = self
            .lock()
            .store_read_at
            .is_none_or(|at| at.elapsed() >= STORE_RESYNC);
        let stored = resync_due.then(|| owned_objects(&self.applier.engine, &self.applier.owner));
        let mut st = self.lock();
        if let Some(old) = rewritten {
            self.event(
                &mut st,
                "HistoryRewritten",
                format!(
                    "the history was rewritten: {} is not a descendant of the last applied commit {}; following it",
                    short(&info.id),
                    short(&old)
                ),
            );
        }
        for (path, why) in &ignored {
            if !st.ignored.iter().any(|(p, w)| p == path && w == why) {
                self.event(&mut st, "FileIgnored", format!("{path}: {why}"));
            }
        }
        if let Some(stored) = stored {
            st.core.resync_store(stored);
            st.store_read_at = Some(std::time::Instant::now());
        }
        st.listing = Some(listing.clone());
        st.parsed = parsed;
        st.ignored = ignored;
        self.run_core(&mut st, listing);
        st.applied = Some(info.clone());
        st.last_applied_at = Some(Utc::now());
        st.reason = None;
        st.state = if !st.core.has_problems() {
            SourceState::Ready
        } else {
            SourceState::Conflict
        };
        drop(st);
        // Kept in the cache so a restart can tell a rewritten history.
        let handle = tokio::runtime::Handle::current();
        let moved = handle.block_on(async {
            let mut objects = self.objects.lock().await;
            objects.set_ref(APPLIED, &info.id).await
        });
        if let Err(e) = moved {
            tracing::warn!(source = %self.config.name, error = %e, "cannot record the applied commit in the cache");
        }
        // Each fetch leaves a pack: the cache is made one pack again now and
        // then, so lookups do not slow down with the commits followed.
        match handle.block_on(repo.repack_if_over(MAX_PACKS, self.config.fetch_timeout)) {
            Ok(true) => tracing::info!(source = %self.config.name, "repacked the cache"),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(source = %self.config.name, error = %e, "cannot repack the cache")
            }
        }
        tracing::info!(source = %self.config.name, commit = %info.id, "applied a commit");
    }

    /// The last good listing again, for the core's retries.
    fn rescan(&self) {
        let mut st = self.lock();
        if let Some(listing) = st.listing.clone() {
            self.run_core(&mut st, listing);
            if !matches!(st.state, SourceState::Stale | SourceState::Unverified) {
                st.state = if !st.core.has_problems() {
                    SourceState::Ready
                } else {
                    SourceState::Conflict
                };
            }
        }
    }

    fn run_core(&self, st: &mut State, listing: Listing) {
        let commands = st.core.scan(std::time::Instant::now(), listing);
        for c in &commands {
            let outcome = self.applier.execute(c);
            st.core.done(std::time::Instant::now(), c, &outcome);
            if let Command::Delete { key, .. } = c {
                tracing::info!(source = %self.config.name, kind = key.0.as_str(), name = key.1, "deleted: its file is gone from the commit");
            }
        }
        for r in st.core.reports() {
            self.applier.execute(&r);
        }
    }

    fn next_due(&self) -> Option<std::time::Instant> {
        self.lock().core.next_wake()
    }
}

/// Why a sync gives the core nothing new: the state the source is held in
/// and the reason.
struct Held(SourceState, String);

fn stale(e: impl std::fmt::Display) -> Held {
    Held(SourceState::Stale, e.to_string())
}

/// A commit read, not yet applied.
/// A commit's manifests, as read.
struct Commit {
    listing: Listing,
    parsed: HashMap<String, Content>,
    ignored: Vec<(String, String)>,
    /// Manifest files in the commit, and blobs read (the ones not parsed
    /// before).
    files: usize,
    blobs_read: usize,
}

struct Read {
    repo: Repo,
    info: CommitInfo,
    listing: Listing,
    parsed: HashMap<String, Content>,
    ignored: Vec<(String, String)>,
    /// The last applied commit, when the new one does not descend from it.
    rewritten: Option<String>,
}

fn short(id: &str) -> &str {
    &id[..id.len().min(12)]
}

async fn run(source: std::sync::Weak<GitSource>) {
    let mut trigger = Trigger::Start;
    loop {
        let Some(s) = source.upgrade() else { return };
        s.sync(trigger).await;
        let interval = s.config.interval;
        let due = s.next_due();
        let wake = tokio::time::Instant::now() + interval;
        let retry = due.map(tokio::time::Instant::from_std);
        let refresh = s.clone();
        drop(s);
        trigger = tokio::select! {
            _ = refresh.refresh.notified() => Trigger::Refresh,
            _ = tokio::time::sleep_until(wake) => Trigger::Interval,
            _ = async {
                match retry {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => Trigger::Retry,
        };
        drop(refresh);
    }
}

/// The git sources of a daemon, by name.
#[derive(Default)]
pub struct GitSources {
    pub sources: Vec<Arc<GitSource>>,
}

impl GitSources {
    pub fn find(&self, name: &str) -> Option<&Arc<GitSource>> {
        self.sources.iter().find(|s| s.name() == name)
    }
}
