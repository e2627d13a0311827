//! The change stream behind `GET /v1/watch`: an initial list (or a replay
//! from a sequence number), then every change as it is committed, then
//! bookmarks while nothing happens.
//!
//! The store's change log is the only source, for the replay and for live
//! delivery alike: a commit only wakes the stream (the store publishes its
//! new head), and the stream reads what follows its last sequence number.
//! So a slow reader never loses a change in a full channel; if it falls so
//! far behind that the log was trimmed past it, it gets a re-list, exactly
//! as a client resuming from too old a `since` does. The decisions are the
//! pure functions [`resume`] and [`Filter::matches`]; [`Watch`] is the thin
//! shell around them and the store.

use std::collections::VecDeque;
use std::time::Duration;

use hearth_api::{Event, Kind, WatchLine, WatchType};
use serde_json::Value;

use crate::store::{Store, StoreError, StoredChange, StoredObject};

/// Changes read from the log at a time.
const PAGE: usize = 256;

/// What a stream shows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Filter {
    /// Only these kinds; every kind (and the sources' events) when empty
    /// and `sources` is false.
    pub kinds: Vec<Kind>,
    /// The events of sources of manifests (kind `Source`), beside `kinds`.
    pub sources: bool,
    /// Only objects (and events about objects) of this name.
    pub name: Option<String>,
    /// Object changes (ADDED, MODIFIED, DELETED).
    pub objects: bool,
    /// Events.
    pub events: bool,
}

impl Filter {
    /// Whether a change of `type_` to `kind`/`name` belongs in the stream.
    pub fn matches(&self, kind: &str, name: &str, type_: WatchType) -> bool {
        let wanted = match type_ {
            WatchType::Added | WatchType::Modified | WatchType::Deleted => self.objects,
            WatchType::Event => self.events,
            // Not changes of an object: never read from the log.
            WatchType::Bookmark | WatchType::Relist | WatchType::Unknown => false,
        };
        let every = self.kinds.is_empty() && !self.sources;
        wanted
            && (every
                || self.kinds.iter().any(|k| k.as_str() == kind)
                || (self.sources && kind == hearth_api::SOURCE_EVENT_KIND))
            && self.name.as_deref().is_none_or(|n| n == name)
    }
}

/// Where a stream that asks to go on from a sequence number starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Start {
    /// Every change after it is still in the log: replay them.
    Replay,
    /// It cannot go on from there; the text says why. The stream sends
    /// RELIST and the whole current state.
    Relist(String),
}

/// Decides whether the log can replay everything after `since`, given its
/// oldest kept change and its head.
pub fn resume(since: u64, oldest: Option<u64>, head: u64) -> Start {
    if since > head {
        return Start::Relist(format!(
            "seq {since} is ahead of this store's last change ({head}): it is from another \
             or an older copy of the database"
        ));
    }
    if since == head {
        return Start::Replay;
    }
    match oldest {
        // The next change is the oldest kept, or later.
        Some(oldest) if since.saturating_add(1) >= oldest => Start::Replay,
        Some(oldest) => Start::Relist(format!(
            "seq {since} is older than the kept history (the oldest change kept is {oldest})"
        )),
        None => Start::Relist(format!(
            "seq {since} is older than the kept history (none is kept)"
        )),
    }
}

/// How a stream is asked for.
#[derive(Clone, Debug)]
pub struct Options {
    /// Go on after this sequence number; None: start with the current state.
    pub since: Option<u64>,
    /// The newest events to put in an initial list (when the filter shows events).
    pub initial_events: usize,
    /// A bookmark is sent after this long without a line.
    pub heartbeat: Duration,
}

/// One client's stream.
pub struct Watch {
    store: Store,
    filter: Filter,
    options: Options,
    heads: tokio::sync::watch::Receiver<u64>,
    /// The last change read from the log (delivered or filtered out).
    last: u64,
    /// Lines ready to go.
    queue: VecDeque<WatchLine>,
    /// The initial list or replay has ended with a bookmark.
    synced: bool,
    last_sent: tokio::time::Instant,
}

impl Watch {
    /// Starts a stream: with no `since`, the current state first.
    pub fn start(store: &Store, filter: Filter, options: Options) -> Result<Watch, StoreError> {
        let mut w = Watch {
            store: store.clone(),
            heads: store.subscribe(),
            last: options.since.unwrap_or(0),
            filter,
            options,
            queue: VecDeque::new(),
            synced: false,
            last_sent: tokio::time::Instant::now(),
        };
        if w.options.since.is_none() {
            w.relist(None)?;
        }
        Ok(w)
    }

    /// The current state, as ADDED (and EVENT) lines at one sequence
    /// number, closed by a bookmark; RELIST first when it replaces what the
    /// client had.
    fn relist(&mut self, why: Option<String>) -> Result<(), StoreError> {
        let events = if self.filter.events {
            self.options.initial_events
        } else {
            0
        };
        let snap = self.store.watch_snapshot(
            &self.filter.kinds,
            self.filter.sources,
            self.filter.name.as_deref(),
            self.filter.objects,
            events,
        )?;
        self.queue.clear();
        if let Some(why) = why {
            self.queue.push_back(WatchLine::relist(snap.head, why));
        }
        for o in &snap.objects {
            self.queue.push_back(added(snap.head, o));
        }
        for (seq, e) in snap.events {
            self.queue
                .push_back(WatchLine::event(seq.unwrap_or(snap.head), e));
        }
        self.queue.push_back(WatchLine::bookmark(snap.head));
        self.last = snap.head;
        self.synced = true;
        Ok(())
    }

    /// The next line; waits for a change or the heartbeat. None when the
    /// store is gone (the daemon is stopping).
    pub async fn next(&mut self) -> Result<Option<WatchLine>, StoreError> {
        loop {
            if let Some(line) = self.queue.pop_front() {
                self.last_sent = tokio::time::Instant::now();
                return Ok(Some(line));
            }
            // Seen before reading: a commit after the read wakes us.
            self.heads.borrow_and_update();
            let page = self.store.changes_after(self.last, PAGE)?;
            if let Start::Relist(why) = resume(self.last, page.oldest, page.head) {
                self.relist(Some(why))?;
                continue;
            }
            if let Some(last) = page.changes.last() {
                self.last = last.seq;
                for c in &page.changes {
                    if self.filter.matches(&c.kind, &c.name, c.type_)
                        && let Some(line) = line_of(c)
                    {
                        self.queue.push_back(line);
                    }
                }
                continue;
            }
            if !self.synced {
                self.synced = true;
                self.queue.push_back(WatchLine::bookmark(self.last));
                continue;
            }
            let beat = self.last_sent + self.options.heartbeat;
            tokio::select! {
                changed = self.heads.changed() => {
                    if changed.is_err() {
                        return Ok(None);
                    }
                }
                _ = tokio::time::sleep_until(beat) => {
                    self.queue.push_back(WatchLine::bookmark(self.last));
                }
            }
        }
    }
}

fn added(seq: u64, o: &StoredObject) -> WatchLine {
    WatchLine::object(
        seq,
        WatchType::Added,
        o.object.kind().as_str(),
        o.object.name(),
        o.to_json(),
        o.deleting,
    )
}

/// A change as a line; None for a row this version cannot read (it is
/// skipped, and its seq still counts as read).
pub fn line_of(c: &StoredChange) -> Option<WatchLine> {
    match c.type_ {
        WatchType::Added | WatchType::Modified | WatchType::Deleted => {
            let mut object: Value = match serde_json::from_str(&c.body) {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(seq = c.seq, error = %e, "skipping an unreadable change");
                    return None;
                }
            };
            let status: Value = serde_json::from_str(&c.status).unwrap_or(Value::Null);
            if let Value::Object(map) = &mut object
                && !status.is_null()
            {
                map.insert("status".into(), status);
            }
            Some(WatchLine::object(
                c.seq, c.type_, &c.kind, &c.name, object, c.deleting,
            ))
        }
        WatchType::Event => match serde_json::from_str::<Event>(&c.body) {
            Ok(e) => Some(WatchLine::event(c.seq, e)),
            Err(e) => {
                tracing::warn!(seq = c.seq, error = %e, "skipping an unreadable event");
                None
            }
        },
        WatchType::Bookmark | WatchType::Relist | WatchType::Unknown => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_api::{EventType, Object, VirtualDiskStatus, parse_documents};

    #[test]
    fn resuming_replays_only_when_every_later_change_is_kept() {
        // Nothing logged yet.
        assert_eq!(resume(0, None, 0), Start::Replay);
        // Up to date.
        assert_eq!(resume(9, Some(5), 9), Start::Replay);
        // The next change (6) is the oldest kept.
        assert_eq!(resume(5, Some(6), 9), Start::Replay);
        assert_eq!(resume(6, Some(6), 9), Start::Replay);
        // 6 was trimmed: a gap the replay cannot fill.
        let Start::Relist(why) = resume(5, Some(7), 9) else {
            panic!("a gap must re-list")
        };
        assert_eq!(
            why,
            "seq 5 is older than the kept history (the oldest change kept is 7)"
        );
        assert!(matches!(resume(0, Some(2), 9), Start::Relist(_)));
        // From the very start, when nothing was ever trimmed.
        assert_eq!(resume(0, Some(1), 9), Start::Replay);
        // A seq this store never handed out.
        let Start::Relist(why) = resume(12, Some(1), 9) else {
            panic!("a seq from the future must re-list")
        };
        assert!(
            why.contains("ahead of this store's last change (9)"),
            "{why}"
        );
        assert!(matches!(resume(3, None, 9), Start::Relist(_)));
        assert!(matches!(resume(u64::MAX, Some(1), 9), Start::Relist(_)));
    }

    #[test]
    fn filters_pick_kinds_names_objects_and_events() {
        let all = Filter {
            objects: true,
            events: true,
            ..Filter::default()
        };
        for t in [
            WatchType::Added,
            WatchType::Modified,
            WatchType::Deleted,
            WatchType::Event,
        ] {
            assert!(all.matches("VirtualDisk", "a", t), "{t:?}");
        }
        for t in [WatchType::Bookmark, WatchType::Relist, WatchType::Unknown] {
            assert!(!all.matches("VirtualDisk", "a", t), "{t:?}");
        }
        let vm_web_events = Filter {
            kinds: vec![Kind::VirtualMachine],
            name: Some("web".into()),
            events: true,
            ..Filter::default()
        };
        assert!(vm_web_events.matches("VirtualMachine", "web", WatchType::Event));
        assert!(!vm_web_events.matches("VirtualMachine", "web", WatchType::Modified));
        assert!(!vm_web_events.matches("VirtualMachine", "db", WatchType::Event));
        assert!(!vm_web_events.matches("VirtualDisk", "web", WatchType::Event));
        let disks_and_vms = Filter {
            kinds: vec![Kind::VirtualDisk, Kind::VirtualMachine],
            objects: true,
            ..Filter::default()
        };
        assert!(disks_and_vms.matches("VirtualMachine", "x", WatchType::Deleted));
        assert!(!disks_and_vms.matches("VirtualImage", "x", WatchType::Added));
        assert!(!disks_and_vms.matches("VirtualDisk", "x", WatchType::Event));
        assert!(!disks_and_vms.matches("Source", "git", WatchType::Event));
        assert!(all.matches("Source", "git", WatchType::Event));
        let sources = Filter {
            sources: true,
            name: Some("git".into()),
            events: true,
            ..Filter::default()
        };
        assert!(sources.matches("Source", "git", WatchType::Event));
        assert!(!sources.matches("Source", "lab", WatchType::Event));
        assert!(!sources.matches("VirtualDisk", "git", WatchType::Event));
    }

    fn disk(name: &str) -> Object {
        parse_documents(
            &format!("apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {{name: {name}}}\nspec: {{size: 1Gi, source: {{blank: {{}}}}}}\n"),
            "t",
        )
        .unwrap()
        .remove(0)
    }

    fn options(since: Option<u64>) -> Options {
        Options {
            since,
            initial_events: 10,
            heartbeat: Duration::from_secs(30),
        }
    }

    fn disks_only() -> Filter {
        Filter {
            kinds: vec![Kind::VirtualDisk],
            objects: true,
            ..Filter::default()
        }
    }

    async fn next(w: &mut Watch) -> WatchLine {
        tokio::time::timeout(Duration::from_secs(5), w.next())
            .await
            .expect("a line in time")
            .expect("store")
            .expect("open")
    }

    fn summary(l: &WatchLine) -> (u64, WatchType, Option<&str>) {
        (l.seq, l.type_, l.name.as_deref())
    }

    #[tokio::test]
    async fn a_stream_lists_then_follows_commits_then_beats() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("db")).unwrap();
        s.put_objects(&[disk("a")]).unwrap();
        s.record_event(Kind::VirtualDisk, "a", EventType::Normal, "Created", "x")
            .unwrap();
        let mut w = Watch::start(
            &s,
            Filter {
                events: true,
                ..disks_only()
            },
            Options {
                heartbeat: Duration::from_millis(50),
                ..options(None)
            },
        )
        .unwrap();
        let first = next(&mut w).await;
        assert_eq!(summary(&first), (2, WatchType::Added, Some("a")));
        assert_eq!(first.object.as_ref().unwrap()["metadata"]["name"], "a");
        let event = next(&mut w).await;
        assert_eq!(summary(&event), (2, WatchType::Event, Some("a")));
        assert_eq!(event.event.unwrap().reason, "Created");
        assert_eq!(summary(&next(&mut w).await), (2, WatchType::Bookmark, None));
        // A change committed from another task wakes the stream.
        let writer = s.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            writer
                .update_status::<VirtualDiskStatus, _>(Kind::VirtualDisk, "a", |st| {
                    st.path = Some("/p".into())
                })
                .unwrap();
        });
        let modified = next(&mut w).await;
        assert_eq!(summary(&modified), (3, WatchType::Modified, Some("a")));
        assert_eq!(modified.object.unwrap()["status"]["path"], "/p");
        // Then, idle: a bookmark at the last seq.
        assert_eq!(summary(&next(&mut w).await), (3, WatchType::Bookmark, None));
    }

    #[tokio::test]
    async fn a_resumed_stream_gets_what_it_missed_once_and_only_its_kinds() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("db")).unwrap();
        s.put_objects(&[disk("a")]).unwrap(); // 1
        s.put_objects(&[disk("b")]).unwrap(); // 2
        s.record_event(Kind::VirtualDisk, "b", EventType::Normal, "R", "m")
            .unwrap(); // 3, an event: not in an objects-only stream
        s.remove(Kind::VirtualDisk, "a").unwrap(); // 4
        let mut w = Watch::start(&s, disks_only(), options(Some(1))).unwrap();
        assert_eq!(
            summary(&next(&mut w).await),
            (2, WatchType::Added, Some("b"))
        );
        assert_eq!(
            summary(&next(&mut w).await),
            (4, WatchType::Deleted, Some("a"))
        );
        assert_eq!(summary(&next(&mut w).await), (4, WatchType::Bookmark, None));
        // Up to date: nothing but the bookmark.
        let mut w = Watch::start(&s, disks_only(), options(Some(4))).unwrap();
        assert_eq!(summary(&next(&mut w).await), (4, WatchType::Bookmark, None));
    }

    #[tokio::test]
    async fn resuming_from_before_the_history_relists() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open_with_history(&dir.path().join("db"), 2).unwrap();
        for n in ["a", "b", "c"] {
            s.put_objects(&[disk(n)]).unwrap();
        }
        s.remove(Kind::VirtualDisk, "b").unwrap(); // 4; kept: 3, 4
        let mut w = Watch::start(&s, disks_only(), options(Some(1))).unwrap();
        let relist = next(&mut w).await;
        assert_eq!(summary(&relist), (4, WatchType::Relist, None));
        assert!(
            relist
                .message
                .unwrap()
                .contains("older than the kept history")
        );
        assert_eq!(
            summary(&next(&mut w).await),
            (4, WatchType::Added, Some("a"))
        );
        assert_eq!(
            summary(&next(&mut w).await),
            (4, WatchType::Added, Some("c"))
        );
        assert_eq!(summary(&next(&mut w).await), (4, WatchType::Bookmark, None));
        // One that can still resume does.
        let mut w = Watch::start(&s, disks_only(), options(Some(2))).unwrap();
        assert_eq!(
            summary(&next(&mut w).await),
            (3, WatchType::Added, Some("c"))
        );
    }

    #[tokio::test]
    async fn a_reader_left_behind_by_the_trim_relists_instead_of_skipping() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open_with_history(&dir.path().join("db"), 2).unwrap();
        s.put_objects(&[disk("a")]).unwrap();
        let mut w = Watch::start(&s, disks_only(), options(None)).unwrap();
        assert_eq!(
            summary(&next(&mut w).await),
            (1, WatchType::Added, Some("a"))
        );
        assert_eq!(summary(&next(&mut w).await), (1, WatchType::Bookmark, None));
        // Three changes while it does not read: 2 is trimmed.
        for n in ["b", "c", "d"] {
            s.put_objects(&[disk(n)]).unwrap();
        }
        assert_eq!(summary(&next(&mut w).await), (4, WatchType::Relist, None));
        let names: Vec<String> = [
            next(&mut w).await,
            next(&mut w).await,
            next(&mut w).await,
            next(&mut w).await,
        ]
        .iter()
        .map(|l| l.name.clone().unwrap_or_default())
        .collect();
        assert_eq!(names, ["a", "b", "c", "d"]);
        assert_eq!(summary(&next(&mut w).await), (4, WatchType::Bookmark, None));
    }
}
