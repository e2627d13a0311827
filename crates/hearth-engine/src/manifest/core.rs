//! The manifest directory's logic, free of I/O: a full listing of the
//! directory in, commands for the engine out.
//!
//! ```text
//!   Listing ──scan()──▶ [Apply | Delete]  ──(engine)──▶ done()  ──▶ reports() ──▶ [Report]
//! ```
//!
//! Level-triggered: every scan is a complete picture of the directory, and
//! the commands are the difference between what it declares and what the
//! store holds (`applied`). No decision depends on which inotify events came
//! or in which order, so no event sequence (an editor's rename dance, a lost
//! event, an overflow) can make it do something the directory does not say.
//!
//! The rules, each tested below and by the property test in `tests.rs`:
//! - Identity is content, not path: an object is its (kind, name). A file
//!   renamed is the same declaration under another path: nothing restarts,
//!   the owner string follows the file.
//! - A file that cannot be used (empty, half written, binary, syntax error,
//!   unknown field, too large, not a regular file) declares nothing new and
//!   takes nothing away: the objects it last declared validly are *held* as
//!   they are. So does a file whose parse is still running.
//! - The same object declared by two sources is a conflict: it is neither
//!   changed nor deleted until one declaration goes.
//! - A delete needs the object absent from every scan for `delete_grace`,
//!   confirmed by a later scan; the core asks for that scan (`next_wake`).
//! - Engine refusals are retried with backoff; their errors are reported.
//! - A missing directory is "unknown", not "empty": nothing is deleted.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_api::{Kind, Object};

use super::parse::FileError;

/// An object's identity: kind and name, wherever it is declared.
pub type Key = (Kind, String);

/// A file's identity on disk (device, inode), to follow an invalid file
/// through a rename.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

/// One object as a file declares it.
#[derive(Clone, Debug, PartialEq)]
pub struct Decl {
    pub object: Object,
    /// The spec as canonical JSON: equal text, equal desired state.
    pub spec: String,
}

impl Decl {
    pub fn new(object: Object) -> Decl {
        let spec = object.spec_json().to_string();
        Decl { object, spec }
    }

    pub fn key(&self) -> Key {
        (self.object.kind(), self.object.name().to_string())
    }
}

/// What one file holds.
#[derive(Clone, Debug, PartialEq)]
pub enum Content {
    Valid(Arc<[Decl]>),
    Invalid(FileError),
    /// Its new bytes are still being parsed (a large file): not known yet.
    /// Held like an invalid file, and whatever was reported about its
    /// objects stands until the parse lands.
    Parsing,
}

impl Content {
    /// Invalid or still parsing: the file's last good declarations stand.
    fn holds(&self) -> bool {
        !matches!(self, Content::Valid(_))
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct FileScan {
    pub id: Option<FileId>,
    pub content: Content,
}

/// One full look at the directory.
#[derive(Clone, Debug)]
pub enum Listing {
    /// The directory is missing or unreadable: nothing can be concluded.
    Missing(String),
    /// Every candidate file, by absolute path.
    Files(BTreeMap<PathBuf, FileScan>),
}

/// An object the store holds with a `file:` owner.
#[derive(Clone, Debug)]
pub struct Stored {
    pub object: Object,
    pub owner: PathBuf,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Create or update these objects, owned by `file`, in one engine apply.
    Apply { file: PathBuf, decls: Vec<Decl> },
    /// Delete an object whose file is confirmed gone; `file` owned it.
    Delete { key: Key, file: PathBuf },
    /// Tell people about an object's problem, or that it is resolved (None).
    Report { key: Key, problem: Option<Problem> },
}

/// What keeps an object from following its file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    /// The file that declared it cannot be used now; the object is held.
    Invalid { file: PathBuf, error: String },
    /// Declared by several files (or by a file that cannot be read now and
    /// another one): nothing changes until one declaration remains.
    Conflict { files: Vec<PathBuf> },
    /// The engine refused the file's objects.
    ApplyFailed { file: PathBuf, error: String },
    /// The engine refused the delete (e.g. a disk still in use); retried.
    DeleteFailed { error: String },
}

/// How an engine call went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Done,
    /// Delete only: the object was already gone.
    NotFound,
    Refused(String),
}

#[derive(Clone, Copy, Debug)]
pub struct CoreConfig {
    /// How long an object must be absent from the directory before it is
    /// deleted (confirmed by a scan at least this much later).
    pub delete_grace: Duration,
    /// First retry of a refused apply or delete; doubles up to `retry_max`.
    pub retry_min: Duration,
    pub retry_max: Duration,
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            delete_grace: Duration::from_secs(2),
            retry_min: Duration::from_secs(1),
            retry_max: Duration::from_secs(30),
        }
    }
}

#[derive(Clone, Debug)]
struct FileEntry {
    id: Option<FileId>,
    content: Content,
    /// For an invalid file: the declarations it holds (its last good ones).
    held: Arc<[Decl]>,
}

impl FileEntry {
    /// What this file stands for: its declarations, or what it holds.
    fn last_good(&self) -> Arc<[Decl]> {
        match &self.content {
            Content::Valid(d) => d.clone(),
            Content::Invalid(_) | Content::Parsing => self.held.clone(),
        }
    }
}

/// Where one object is declared: usually exactly one place.
struct Sources<'a> {
    first: (&'a Path, &'a Decl, bool),
    more: Vec<(&'a Path, &'a Decl, bool)>,
}

/// What the store holds for an object we own.
#[derive(Clone, Debug)]
struct Applied {
    owner: PathBuf,
    decl: Decl,
}

impl Applied {
    fn is(&self, owner: &Path, decl: &Decl) -> bool {
        self.owner == owner && self.decl.spec == decl.spec
    }
}

#[derive(Clone, Debug)]
struct Failure {
    attempts: u32,
    retry_at: Instant,
    error: String,
    /// For applies: the batch that failed, so a changed file is tried at once.
    batch: Vec<(Key, String)>,
}

/// The directory as the core last saw it, for `GET /v1/sources`.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CoreView {
    pub directory_present: Option<bool>,
    pub missing_reason: Option<String>,
    pub files: Vec<FileView>,
    pub pending_deletes: Vec<PendingDeleteView>,
    pub problems: Vec<ProblemView>,
}

#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FileView {
    pub path: PathBuf,
    pub valid: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Its new bytes are still being parsed; its objects are held meanwhile.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub parsing: bool,
    /// Declared objects (or, for an invalid file, the ones it holds).
    pub objects: Vec<ObjectView>,
}

#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectView {
    pub kind: Kind,
    pub name: String,
    /// `Applied`, `Pending` (not applied yet), `Held`, `Conflict`, `ApplyFailed`.
    pub state: &'static str,
}

#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingDeleteView {
    pub kind: Kind,
    pub name: String,
    pub owner: PathBuf,
    pub absent_for_ms: u64,
}

#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProblemView {
    pub kind: Kind,
    pub name: String,
    pub reason: &'static str,
    pub message: String,
}

pub struct Core {
    config: CoreConfig,
    /// None until the first scan; false while the directory is missing.
    present: Option<bool>,
    missing_reason: Option<String>,
    files: BTreeMap<PathBuf, FileEntry>,
    /// File-owned objects as the store holds them (kept in step with every
    /// engine call, and reloaded from the store by `resync_store`).
    applied: BTreeMap<Key, Applied>,
    /// Objects in `applied` that no scan has seen since this instant.
    absent: BTreeMap<Key, Instant>,
    /// Objects whose problem comes from the directory itself (held, conflict).
    scan_problems: BTreeMap<Key, Problem>,
    apply_failures: BTreeMap<PathBuf, Failure>,
    delete_failures: BTreeMap<Key, Failure>,
    /// The last problem reported per object, so each is reported once.
    reported: BTreeMap<Key, Problem>,
}

impl Core {
    /// Starts from what the store holds: objects owned by manifest files.
    pub fn new(config: CoreConfig, stored: Vec<Stored>) -> Core {
        let mut core = Core {
            config,
            present: None,
            missing_reason: None,
            files: BTreeMap::new(),
            applied: BTreeMap::new(),
            absent: BTreeMap::new(),
            scan_problems: BTreeMap::new(),
            apply_failures: BTreeMap::new(),
            delete_failures: BTreeMap::new(),
            reported: BTreeMap::new(),
        };
        core.resync_store(stored);
        core
    }

    /// Replaces what the core believes the store holds with the store's own
    /// word (at start-up and on every periodic re-list), so a lost result can
    /// never leave the core and the store apart for good.
    pub fn resync_store(&mut self, stored: Vec<Stored>) {
        self.applied.clear();
        for s in stored {
            let decl = Decl::new(s.object);
            self.applied.insert(
                decl.key(),
                Applied {
                    owner: s.owner,
                    decl,
                },
            );
        }
        let applied = &self.applied;
        self.absent.retain(|k, _| applied.contains_key(k));
        self.delete_failures.retain(|k, _| applied.contains_key(k));
    }

    /// Takes in one full listing and says what to apply and delete. Feed each
    /// command's result to `done`, then call `reports`.
    pub fn scan(&mut self, now: Instant, listing: Listing) -> Vec<Command> {
        let files = match listing {
            Listing::Missing(why) => {
                // Unknown is not empty: delete nothing, and start any grace
                // period afresh once the directory is back.
                self.present = Some(false);
                self.missing_reason = Some(why);
                self.absent.clear();
                return Vec::new();
            }
            Listing::Files(files) => files,
        };
        self.present = Some(true);
        self.missing_reason = None;

        // 1. Each file's entry; an invalid file holds its last good objects:
        //    those of the same path, else of a vanished file with the same
        //    inode (renamed while broken), else what the store says this path
        //    owns (a file already broken when this daemon starts).
        let mut previous = std::mem::take(&mut self.files);
        let needs_history = files
            .iter()
            .any(|(p, f)| f.content.holds() && !previous.contains_key(p));
        let mut vanished: HashMap<FileId, Arc<[Decl]>> = HashMap::new();
        if needs_history {
            for (path, entry) in &previous {
                if !files.contains_key(path)
                    && let Some(id) = entry.id
                {
                    vanished.insert(id, entry.last_good());
                }
            }
        }
        let nothing: Arc<[Decl]> = Arc::from(Vec::new());
        // Collected from sorted input: no per-insert path comparisons.
        let entries: Vec<(PathBuf, FileEntry)> = files
            .into_iter()
            .map(|(path, scan)| {
                let held = match &scan.content {
                    Content::Valid(_) => nothing.clone(),
                    Content::Invalid(_) | Content::Parsing => match previous.remove(&path) {
                        Some(prev) => prev.last_good(),
                        None => scan
                            .id
                            .and_then(|id| vanished.get(&id).cloned())
                            .unwrap_or_else(|| self.owned_by(&path)),
                    },
                };
                let entry = FileEntry {
                    id: scan.id,
                    content: scan.content,
                    held,
                };
                (path, entry)
            })
            .collect();
        self.files = entries.into_iter().collect();

        // 2. Every source of every object (borrowed: nothing is copied for
        //    the thousand files that did not change).
        let mut sources: BTreeMap<(Kind, &str), Sources<'_>> = BTreeMap::new();
        for (path, entry) in &self.files {
            let (decls, valid) = match &entry.content {
                Content::Valid(d) => (d, true),
                Content::Invalid(_) | Content::Parsing => (&entry.held, false),
            };
            for d in decls.iter() {
                let source = (path.as_path(), d, valid);
                match sources.entry((d.object.kind(), d.object.name())) {
                    std::collections::btree_map::Entry::Vacant(v) => {
                        v.insert(Sources {
                            first: source,
                            more: Vec::new(),
                        });
                    }
                    std::collections::btree_map::Entry::Occupied(mut o) => {
                        o.get_mut().more.push(source)
                    }
                }
            }
        }

        // 3. Decide per object: a merge of the declared objects with the
        //    applied ones, both sorted by (kind, name).
        let mut to_apply: BTreeMap<PathBuf, Vec<Decl>> = BTreeMap::new();
        let mut problems = BTreeMap::new();
        let mut deletes = Vec::new();
        let grace = self.config.delete_grace;
        let mut absent_now: Vec<Key> = Vec::new();
        let mut applied = self.applied.iter().peekable();
        let mut declared = sources.iter().peekable();
        loop {
            let next_applied = applied.peek().map(|(k, _)| (k.0, k.1.as_str()));
            let next_declared = declared.peek().map(|(k, _)| **k);
            match (next_applied, next_declared) {
                (None, None) => break,
                // Applied, declared nowhere: absent.
                (Some(a), d) if d.is_none_or(|d| a < d) => {
                    let (key, app) = applied.next().expect("peeked");
                    absent_now.push(key.clone());
                    let since = *self.absent.entry(key.clone()).or_insert(now);
                    let waiting = self
                        .delete_failures
                        .get(key)
                        .is_some_and(|f| now < f.retry_at);
                    if now.saturating_duration_since(since) >= grace && !waiting {
                        deletes.push(Command::Delete {
                            key: key.clone(),
                            file: app.owner.clone(),
                        });
                    }
                }
                (a, Some(d)) => {
                    let (_, srcs) = declared.next().expect("peeked");
                    let current = if a == Some(d) {
                        applied.next().map(|(_, app)| app)
                    } else {
                        None
                    };
                    let owned = || (d.0, d.1.to_string());
                    match (srcs.first, srcs.more.is_empty()) {
                        ((path, decl, true), true) => {
                            if !current.is_some_and(|a| a.is(path, decl)) {
                                to_apply
                                    .entry(path.to_path_buf())
                                    .or_default()
                                    .push(decl.clone());
                            }
                        }
                        ((path, _, false), true) => {
                            match self.files.get(path).map(|e| &e.content) {
                                // Not known yet: the last verdict stands.
                                Some(Content::Parsing) => {
                                    if let Some(p) = self.scan_problems.get(&owned()) {
                                        problems.insert(owned(), p.clone());
                                    }
                                }
                                content => {
                                    let error = match content {
                                        Some(Content::Invalid(e)) => e.to_string(),
                                        _ => String::new(),
                                    };
                                    problems.insert(
                                        owned(),
                                        Problem::Invalid {
                                            file: path.to_path_buf(),
                                            error,
                                        },
                                    );
                                }
                            }
                        }
                        (first, false) => {
                            let files: BTreeSet<PathBuf> = std::iter::once(first)
                                .chain(srcs.more.iter().copied())
                                .map(|(p, _, _)| p.to_path_buf())
                                .collect();
                            problems.insert(
                                owned(),
                                Problem::Conflict {
                                    files: files.into_iter().collect(),
                                },
                            );
                        }
                    }
                }
                (Some(_), None) => unreachable!("covered by the absent arm"),
            }
        }
        // Whatever is declared (or held) again is no longer absent.
        if self.absent.len() != absent_now.len() {
            let now_absent: BTreeSet<&Key> = absent_now.iter().collect();
            self.absent.retain(|k, _| now_absent.contains(k));
        }
        self.scan_problems = problems;
        // A delete that is no longer wanted forgets its failures.
        let absent = &self.absent;
        self.delete_failures.retain(|k, _| absent.contains_key(k));

        // 4. Applies, except a batch refused before and not due for a retry.
        //    A refusal is forgotten once its file has nothing left to apply.
        //    A file still parsing keeps its refusal: nothing is resolved yet.
        let files = &self.files;
        self.apply_failures.retain(|p, _| {
            to_apply.contains_key(p)
                || files
                    .get(p)
                    .is_some_and(|e| matches!(e.content, Content::Parsing))
        });
        let mut commands = Vec::new();
        for (file, decls) in to_apply {
            if let Some(f) = self.apply_failures.get(&file)
                && now < f.retry_at
                && f.batch == batch_of(&decls)
            {
                continue;
            }
            commands.push(Command::Apply { file, decls });
        }
        // Deletes last, users before what they use (kinds in declaration order).
        commands.extend(deletes);
        commands
    }

    /// Records how an engine call went.
    pub fn done(&mut self, now: Instant, command: &Command, outcome: &Outcome) {
        match (command, outcome) {
            (Command::Apply { file, decls }, Outcome::Done | Outcome::NotFound) => {
                for d in decls {
                    self.applied.insert(
                        d.key(),
                        Applied {
                            owner: file.clone(),
                            decl: d.clone(),
                        },
                    );
                }
                self.apply_failures.remove(file);
            }
            (Command::Apply { file, decls }, Outcome::Refused(error)) => {
                let batch = batch_of(decls);
                let attempts = match self.apply_failures.get(file) {
                    Some(f) if f.batch == batch => f.attempts + 1,
                    _ => 1,
                };
                let retry_at = now + self.backoff(attempts);
                self.apply_failures.insert(
                    file.clone(),
                    Failure {
                        attempts,
                        retry_at,
                        error: error.clone(),
                        batch,
                    },
                );
            }
            (Command::Delete { key, .. }, Outcome::Done | Outcome::NotFound) => {
                self.applied.remove(key);
                self.absent.remove(key);
                self.delete_failures.remove(key);
                self.reported.remove(key);
            }
            (Command::Delete { key, .. }, Outcome::Refused(error)) => {
                let attempts = self.delete_failures.get(key).map_or(0, |f| f.attempts) + 1;
                let retry_at = now + self.backoff(attempts);
                self.delete_failures.insert(
                    key.clone(),
                    Failure {
                        attempts,
                        retry_at,
                        error: error.clone(),
                        batch: Vec::new(),
                    },
                );
            }
            (Command::Report { .. }, _) => {}
        }
    }

    /// Problems that appeared, changed or went away since the last report.
    pub fn reports(&mut self) -> Vec<Command> {
        let current = self.current_problems();
        let mut out = Vec::new();
        for (key, problem) in &current {
            if self.reported.get(key) != Some(problem) {
                out.push(Command::Report {
                    key: key.clone(),
                    problem: Some(problem.clone()),
                });
            }
        }
        let gone: Vec<Key> = self
            .reported
            .keys()
            .filter(|k| !current.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            // An object no longer declared anywhere has nothing to resolve
            // (it is about to be deleted, or never existed).
            if self.declared_anywhere(&key) {
                out.push(Command::Report {
                    key: key.clone(),
                    problem: None,
                });
            }
        }
        self.reported = current;
        out
    }

    fn current_problems(&self) -> BTreeMap<Key, Problem> {
        let mut out = self.scan_problems.clone();
        for (file, f) in &self.apply_failures {
            for (key, _) in &f.batch {
                out.entry(key.clone())
                    .or_insert_with(|| Problem::ApplyFailed {
                        file: file.clone(),
                        error: f.error.clone(),
                    });
            }
        }
        for (key, f) in &self.delete_failures {
            out.entry(key.clone())
                .or_insert_with(|| Problem::DeleteFailed {
                    error: f.error.clone(),
                });
        }
        out
    }

    /// Whether any object has a problem (the view's `problems` is not
    /// empty), without building the view: a git source asks at every
    /// commit, and the view copies every file's declarations.
    pub fn has_problems(&self) -> bool {
        !self.scan_problems.is_empty()
            || self.apply_failures.values().any(|f| !f.batch.is_empty())
            || !self.delete_failures.is_empty()
    }

    /// When the shell must scan again even if nothing changes: to confirm an
    /// absence, or to retry a refused call.
    pub fn next_wake(&self) -> Option<Instant> {
        let confirms = self.absent.iter().map(|(key, since)| {
            let due = *since + self.config.delete_grace;
            match self.delete_failures.get(key) {
                Some(f) => due.max(f.retry_at),
                None => due,
            }
        });
        let retries = self.apply_failures.values().map(|f| f.retry_at);
        confirms.chain(retries).min()
    }

    /// Whether anything is left to do without a change in the directory.
    #[cfg(test)]
    pub fn is_quiet(&self) -> bool {
        self.next_wake().is_none()
    }

    /// Whether a file declares (or holds) the object now.
    fn declared_anywhere(&self, key: &Key) -> bool {
        self.files.values().any(|e| {
            e.last_good()
                .iter()
                .any(|d| d.object.kind() == key.0 && d.object.name() == key.1)
        })
    }

    /// The objects the store holds from `path`.
    fn owned_by(&self, path: &Path) -> Arc<[Decl]> {
        self.applied
            .values()
            .filter(|a| a.owner == path)
            .map(|a| a.decl.clone())
            .collect()
    }

    fn backoff(&self, attempts: u32) -> Duration {
        let factor = 1u32 << attempts.saturating_sub(1).min(16);
        (self.config.retry_min * factor).min(self.config.retry_max)
    }

    /// The directory as last seen, for the API.
    pub fn view(&self, now: Instant) -> CoreView {
        let problems = self.current_problems();
        let files = self
            .files
            .iter()
            .map(|(path, entry)| {
                let (valid, error, decls) = match &entry.content {
                    Content::Valid(d) => (true, None, d.clone()),
                    Content::Invalid(e) => (false, Some(e.to_string()), entry.held.clone()),
                    Content::Parsing => (false, None, entry.held.clone()),
                };
                let objects = decls
                    .iter()
                    .map(|d| {
                        let key = d.key();
                        let state = match problems.get(&key) {
                            Some(Problem::Invalid { .. }) => "Held",
                            Some(Problem::Conflict { .. }) => "Conflict",
                            Some(Problem::ApplyFailed { .. }) => "ApplyFailed",
                            _ if matches!(entry.content, Content::Parsing) => "Held",
                            _ if self.applied.get(&key).is_some_and(|a| a.is(path, d)) => "Applied",
                            _ => "Pending",
                        };
                        ObjectView {
                            kind: key.0,
                            name: key.1,
                            state,
                        }
                    })
                    .collect();
                FileView {
                    path: path.clone(),
                    valid,
                    error,
                    parsing: matches!(entry.content, Content::Parsing),
                    objects,
                }
            })
            .collect();
        let pending_deletes = self
            .absent
            .iter()
            .filter_map(|(key, since)| {
                let a = self.applied.get(key)?;
                Some(PendingDeleteView {
                    kind: key.0,
                    name: key.1.clone(),
                    owner: a.owner.clone(),
                    absent_for_ms: now.saturating_duration_since(*since).as_millis() as u64,
                })
            })
            .collect();
        let problems = problems
            .into_iter()
            .map(|(key, p)| ProblemView {
                kind: key.0,
                name: key.1,
                reason: p.reason(),
                message: p.message(),
            })
            .collect();
        CoreView {
            directory_present: self.present,
            missing_reason: self.missing_reason.clone(),
            files,
            pending_deletes,
            problems,
        }
    }
}

fn batch_of(decls: &[Decl]) -> Vec<(Key, String)> {
    decls.iter().map(|d| (d.key(), d.spec.clone())).collect()
}

impl Problem {
    /// The condition/event reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Problem::Invalid { .. } => "ManifestInvalid",
            Problem::Conflict { .. } => "ManifestConflict",
            Problem::ApplyFailed { .. } => "ManifestApplyFailed",
            Problem::DeleteFailed { .. } => "ManifestDeleteFailed",
        }
    }

    /// A sentence a person can act on.
    pub fn message(&self) -> String {
        match self {
            Problem::Invalid { file, error } => format!(
                "{}: {error}; keeping the last good state until the file is fixed",
                file.display()
            ),
            Problem::Conflict { files } => {
                let list: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
                format!(
                    "declared in several manifest files ({}); nothing changes until only one declares it",
                    list.join(", ")
                )
            }
            Problem::ApplyFailed { file, error } => format!(
                "{}: refused: {error}; keeping the last good state, retrying",
                file.display()
            ),
            Problem::DeleteFailed { error } => {
                format!("its manifest file is gone but it cannot be deleted yet: {error}; retrying")
            }
        }
    }
}

#[cfg(test)]
mod tests;
