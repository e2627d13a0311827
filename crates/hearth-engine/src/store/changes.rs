//! The change log: every change to an object and every event, in commit
//! order, under a sequence number that never repeats.
//!
//! Object changes are written by SQLite triggers on `objects`, so every
//! write path (the store's own methods and the few reconcilers that write
//! rows in their own transactions) is logged in the transaction that makes
//! the change, and none can forget to. Events are logged by `record_event`
//! in the transaction that stores the event. The log keeps the newest
//! `history` rows (a trigger trims it on each insert); the sequence itself is
//! AUTOINCREMENT, so a trimmed number is never handed out again.

use chrono::{DateTime, Utc};
use hearth_api::{Event, EventType, Kind, WatchType};
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use super::db::head_of;
use super::{Store, StoreError, StoredObject};

/// Changes kept in the log by default. Older ones are trimmed; a watcher
/// that asks to resume from before them gets a full re-list instead
/// (docs/http-api.md "Watching").
pub const CHANGE_HISTORY: u64 = 10_000;

/// One row of the change log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredChange {
    pub seq: u64,
    pub kind: String,
    pub name: String,
    /// ADDED, MODIFIED, DELETED or EVENT.
    pub type_: WatchType,
    /// The object without its status (a DELETED change: its last state),
    /// or the event, as JSON.
    pub body: String,
    /// The object's status JSON (`null` for events).
    pub status: String,
    pub deleting: bool,
}

/// The changes after some sequence number, and what the log holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChangePage {
    /// The oldest change still kept (None: the log is empty).
    pub oldest: Option<u64>,
    /// The last sequence number handed out (0: none yet).
    pub head: u64,
    pub changes: Vec<StoredChange>,
}

/// The current state for a watch's initial list, read under one lock with
/// the sequence number it is the state at.
#[derive(Clone, Debug)]
pub struct WatchSnapshot {
    pub head: u64,
    pub objects: Vec<StoredObject>,
    /// The newest events, oldest first, with their sequence numbers (None
    /// for events recorded before the change log existed).
    pub events: Vec<(Option<u64>, Event)>,
}

/// The triggers that log object changes and trim the log, as SQLite keeps
/// their text (so an existing one is replaced only when it differs).
fn triggers(history: u64) -> Vec<(&'static str, String)> {
    let log = |type_: &str, row: &str| {
        format!(
            "INSERT INTO changes (kind, name, type, body, status, deleting) \
             VALUES ({row}.kind, {row}.name, '{type_}', {row}.body, {row}.status, {row}.deleting);"
        )
    };
    vec![
        (
            "changes_object_added",
            format!(
                "CREATE TRIGGER changes_object_added AFTER INSERT ON objects BEGIN {} END",
                log("ADDED", "NEW")
            ),
        ),
        // An UPDATE that writes the same text (a status rewritten as it was)
        // is not a change.
        (
            "changes_object_modified",
            format!(
                "CREATE TRIGGER changes_object_modified AFTER UPDATE ON objects \
                 WHEN OLD.body IS NOT NEW.body OR OLD.status IS NOT NEW.status \
                 OR OLD.deleting IS NOT NEW.deleting BEGIN {} END",
                log("MODIFIED", "NEW")
            ),
        ),
        (
            "changes_object_deleted",
            format!(
                "CREATE TRIGGER changes_object_deleted AFTER DELETE ON objects BEGIN {} END",
                log("DELETED", "OLD")
            ),
        ),
        (
            "changes_trim",
            format!(
                "CREATE TRIGGER changes_trim AFTER INSERT ON changes BEGIN \
                 DELETE FROM changes WHERE seq <= NEW.seq - {history}; END"
            ),
        ),
    ]
}

/// Brings a database of any earlier version up to this one, in one
/// transaction: the `events.seq` column (the tables are created by the
/// schema's `CREATE ... IF NOT EXISTS`), the triggers as this version
/// writes them, and the log trimmed to `history`.
pub(super) fn migrate(conn: &mut Connection, history: u64) -> Result<(), StoreError> {
    let history = history.max(1);
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let has_seq: bool = tx.query_row(
        "SELECT COUNT(*) > 0 FROM pragma_table_info('events') WHERE name = 'seq'",
        [],
        |r| r.get(0),
    )?;
    if !has_seq {
        tx.execute_batch("ALTER TABLE events ADD COLUMN seq INTEGER")?;
    }
    for (name, sql) in triggers(history) {
        let current: Option<String> = tx
            .query_row(
                "SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = ?1",
                params![name],
                |r| r.get(0),
            )
            .optional()?;
        if current.as_deref() != Some(sql.as_str()) {
            tx.execute_batch(&format!("DROP TRIGGER IF EXISTS {name}; {sql};"))?;
        }
    }
    let head = head_of(&tx)?;
    tx.execute(
        "DELETE FROM changes WHERE seq <= ?1",
        params![head.saturating_sub(history) as i64],
    )?;
    tx.commit()?;
    Ok(())
}

/// Appends an event to the log inside the caller's transaction; its
/// sequence number.
pub(super) fn log_event_tx(tx: &Connection, event: &Event) -> Result<u64, StoreError> {
    tx.execute(
        "INSERT INTO changes (kind, name, type, body) VALUES (?1, ?2, 'EVENT', ?3)",
        params![event.kind, event.name, serde_json::to_string(event)?],
    )?;
    Ok(tx.last_insert_rowid() as u64)
}

fn type_of(text: &str) -> WatchType {
    match text {
        "ADDED" => WatchType::Added,
        "MODIFIED" => WatchType::Modified,
        "DELETED" => WatchType::Deleted,
        "EVENT" => WatchType::Event,
        _ => WatchType::Unknown,
    }
}

impl Store {
    /// The last sequence number handed out (0 before the first change).
    pub fn head(&self) -> u64 {
        *self.head.borrow()
    }

    /// The head, sent after every commit that moves it. A receiver that
    /// marks the current value seen before it reads the log never misses a
    /// change: a later commit always wakes it.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.head.subscribe()
    }

    /// Up to `limit` changes after `since`, oldest first, and the log's
    /// bounds, read together.
    pub fn changes_after(&self, since: u64, limit: usize) -> Result<ChangePage, StoreError> {
        let conn = self.conn();
        let oldest: Option<i64> =
            conn.query_row("SELECT min(seq) FROM changes", [], |r| r.get(0))?;
        let head = head_of(&conn)?;
        let mut stmt = conn.prepare(
            "SELECT seq, kind, name, type, body, status, deleting FROM changes
             WHERE seq > ?1 ORDER BY seq LIMIT ?2",
        )?;
        let rows = stmt.query_map(
            params![
                i64::try_from(since).unwrap_or(i64::MAX),
                i64::try_from(limit).unwrap_or(i64::MAX)
            ],
            |r| {
                Ok(StoredChange {
                    seq: r.get::<_, i64>(0)? as u64,
                    kind: r.get(1)?,
                    name: r.get(2)?,
                    type_: type_of(&r.get::<_, String>(3)?),
                    body: r.get(4)?,
                    status: r.get(5)?,
                    deleting: r.get(6)?,
                })
            },
        )?;
        let changes = rows.collect::<Result<Vec<_>, _>>()?;
        Ok(ChangePage {
            oldest: oldest.map(|o| o as u64),
            head,
            changes,
        })
    }

    /// The objects of `kinds` (all kinds when empty and `!sources`; only
    /// `name` when given; none when `!objects`) and the newest `events`
    /// events about them (and about sources of manifests with `sources`,
    /// or when nothing is named), at one sequence number.
    pub fn watch_snapshot(
        &self,
        kinds: &[Kind],
        sources: bool,
        name: Option<&str>,
        objects: bool,
        events: usize,
    ) -> Result<WatchSnapshot, StoreError> {
        let conn = self.conn();
        let head = head_of(&conn)?;
        let all = Kind::ALL;
        let every = kinds.is_empty() && !sources;
        let kinds = if every { &all[..] } else { kinds };
        let mut found = Vec::new();
        if objects {
            for kind in kinds {
                match name {
                    Some(name) => found.extend(Self::get_tx(&conn, *kind, name)?),
                    None => found.extend(Self::list_tx(&conn, *kind)?),
                }
            }
        }
        let mut recent = Vec::new();
        if events > 0 {
            let kind_list = (!every).then(|| {
                let mut names: Vec<&str> = kinds.iter().map(|k| k.as_str()).collect();
                if sources {
                    names.push(hearth_api::SOURCE_EVENT_KIND);
                }
                serde_json::Value::from(names).to_string()
            });
            // With a name, the events of each object's current life only
            // (as `Store::events`).
            let mut stmt = conn.prepare(&format!(
                "SELECT e.seq, e.time, e.kind, e.name, e.type, e.reason, e.message FROM events e
                 WHERE (?1 IS NULL OR e.kind IN (SELECT value FROM json_each(?1)))
                   AND (?2 IS NULL OR (e.name = ?2 AND e.life IS {}))
                 ORDER BY e.id DESC LIMIT ?3",
                CURRENT_LIFE
            ))?;
            let rows = stmt.query_map(
                params![kind_list, name, i64::try_from(events).unwrap_or(i64::MAX)],
                |r| {
                    Ok((
                        r.get::<_, Option<i64>>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, String>(3)?,
                        r.get::<_, String>(4)?,
                        r.get::<_, String>(5)?,
                        r.get::<_, String>(6)?,
                    ))
                },
            )?;
            for row in rows {
                let (seq, time, kind, name, type_, reason, message) = row?;
                recent.push((
                    seq.map(|s| s as u64),
                    event_from_row(time, kind, name, &type_, reason, message),
                ));
            }
            recent.reverse();
        }
        Ok(WatchSnapshot {
            head,
            objects: found,
            events: recent,
        })
    }
}

/// The life of the object `e.kind`/`e.name` now (SQL, for a row `e` of
/// `events`): the object's creationTimestamp, or when it is gone the life
/// of its newest event.
pub(super) const CURRENT_LIFE: &str = "COALESCE(
    (SELECT json_extract(o.body, '$.metadata.creationTimestamp') FROM objects o
      WHERE o.kind = e.kind AND o.name = e.name),
    (SELECT l.life FROM events l WHERE l.kind = e.kind AND l.name = e.name
      ORDER BY l.id DESC LIMIT 1))";

/// An `events` row as the API shows it.
pub(super) fn event_from_row(
    time: String,
    kind: String,
    name: String,
    type_: &str,
    reason: String,
    message: String,
) -> Event {
    Event {
        time: DateTime::parse_from_rfc3339(&time)
            .map(|t| t.with_timezone(&Utc))
            .unwrap_or_default(),
        kind,
        name,
        type_: if type_ == "Warning" {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_api::{EventType, Object, VirtualDiskStatus, parse_documents};

    fn disk(name: &str, size: &str) -> Object {
        parse_documents(
            &format!("apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {{name: {name}}}\nspec: {{size: {size}, source: {{blank: {{}}}}}}\n"),
            "t",
        )
        .unwrap()
        .remove(0)
    }

    fn types(page: &ChangePage) -> Vec<(u64, WatchType, &str)> {
        page.changes
            .iter()
            .map(|c| (c.seq, c.type_, c.name.as_str()))
            .collect()
    }

    #[test]
    fn every_object_write_is_logged_in_order_with_a_growing_seq() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("db")).unwrap();
        assert_eq!(s.head(), 0);
        s.put_objects(&[disk("a", "1Gi"), disk("b", "1Gi")])
            .unwrap();
        // An upsert of an existing row is a modification, not an addition.
        s.put_objects(&[disk("a", "2Gi")]).unwrap();
        s.update_status::<VirtualDiskStatus, _>(Kind::VirtualDisk, "a", |st| {
            st.path = Some("/x".into())
        })
        .unwrap();
        // Writing what is already there changes nothing and logs nothing.
        s.update_status::<VirtualDiskStatus, _>(Kind::VirtualDisk, "a", |_| {})
            .unwrap();
        s.put_objects(&[disk("a", "2Gi")]).unwrap();
        s.mark_deleting(Kind::VirtualDisk, "a").unwrap();
        s.record_event(Kind::VirtualDisk, "a", EventType::Normal, "Deleting", "bye")
            .unwrap();
        // A row a reconciler deletes with its own SQL is logged too.
        s.with_tx(|tx| {
            tx.execute(
                "DELETE FROM objects WHERE kind = 'VirtualDisk' AND name = 'a'",
                [],
            )?;
            Ok(())
        })
        .unwrap();
        let page = s.changes_after(0, 100).unwrap();
        assert_eq!(
            types(&page),
            vec![
                (1, WatchType::Added, "a"),
                (2, WatchType::Added, "b"),
                (3, WatchType::Modified, "a"),
                (4, WatchType::Modified, "a"),
                (5, WatchType::Modified, "a"),
                (6, WatchType::Event, "a"),
                (7, WatchType::Deleted, "a"),
            ]
        );
        assert_eq!((page.oldest, page.head), (Some(1), 7));
        assert_eq!(s.head(), 7, "the head is published after each commit");
        let spec_change = &page.changes[2];
        assert!(spec_change.body.contains("2Gi"), "{spec_change:?}");
        assert!(page.changes[3].status.contains("/x"));
        assert!(page.changes[4].deleting);
        // The deletion carries the object's last state.
        let deleted = &page.changes[6];
        assert!(deleted.body.contains("2Gi") && deleted.status.contains("/x"));
        assert!(deleted.deleting);
        let event: Event = serde_json::from_str(&page.changes[5].body).unwrap();
        assert_eq!(
            (event.reason.as_str(), event.message.as_str()),
            ("Deleting", "bye")
        );
        // Paging: after 5, at most 1.
        assert_eq!(
            types(&s.changes_after(5, 1).unwrap()),
            vec![(6, WatchType::Event, "a")]
        );
        assert!(s.changes_after(7, 10).unwrap().changes.is_empty());
    }

    #[test]
    fn a_failed_transaction_logs_nothing_and_hands_out_no_seq() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("db")).unwrap();
        s.put_objects(&[disk("a", "1Gi")]).unwrap();
        let mut rx = s.subscribe();
        rx.borrow_and_update();
        let r: Result<(), StoreError> = s.with_tx(|tx| {
            Store::update_status_tx::<VirtualDiskStatus, _>(tx, Kind::VirtualDisk, "a", |st| {
                st.path = Some("/y".into())
            })?;
            Err(StoreError::Sqlite(rusqlite::Error::InvalidQuery))
        });
        assert!(r.is_err());
        assert_eq!(s.head(), 1);
        assert!(
            !rx.has_changed().unwrap(),
            "no wake for a rolled-back write"
        );
        s.put_objects(&[disk("b", "1Gi")]).unwrap();
        assert!(rx.has_changed().unwrap());
        assert_eq!(
            *rx.borrow_and_update(),
            2,
            "the rolled-back seq was not used"
        );
    }

    #[test]
    fn the_log_keeps_the_newest_changes_and_never_reuses_a_trimmed_seq() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        {
            let s = Store::open_with_history(&path, 3).unwrap();
            for i in 0..5 {
                s.put_objects(&[disk(&format!("d{i}"), "1Gi")]).unwrap();
            }
            let page = s.changes_after(0, 100).unwrap();
            assert_eq!((page.oldest, page.head), (Some(3), 5));
            assert_eq!(
                page.changes.iter().map(|c| c.seq).collect::<Vec<_>>(),
                [3, 4, 5]
            );
        }
        // Reopened with a smaller bound: trimmed at once; the sequence goes on.
        let s = Store::open_with_history(&path, 1).unwrap();
        assert_eq!(s.head(), 5);
        let page = s.changes_after(0, 100).unwrap();
        assert_eq!((page.oldest, page.head), (Some(5), 5));
        s.remove(Kind::VirtualDisk, "d4").unwrap();
        let page = s.changes_after(0, 100).unwrap();
        assert_eq!(types(&page), vec![(6, WatchType::Deleted, "d4")]);
    }

    #[test]
    fn the_seq_survives_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        {
            let s = Store::open(&path).unwrap();
            s.put_objects(&[disk("a", "1Gi")]).unwrap();
            s.record_event(Kind::VirtualDisk, "a", EventType::Normal, "R", "m")
                .unwrap();
        }
        let s = Store::open(&path).unwrap();
        assert_eq!(s.head(), 2);
        s.remove(Kind::VirtualDisk, "a").unwrap();
        assert_eq!(
            types(&s.changes_after(2, 10).unwrap()),
            vec![(3, WatchType::Deleted, "a")]
        );
    }

    #[test]
    fn a_sources_events_are_in_the_log_and_picked_by_the_sources_filter() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("db")).unwrap();
        s.put_objects(&[disk("git", "1Gi")]).unwrap();
        s.record_event(
            Kind::VirtualDisk,
            "git",
            EventType::Normal,
            "Created",
            "disk",
        )
        .unwrap();
        s.record_source_event("git", EventType::Warning, "Stale", "fetching main: refused")
            .unwrap();
        let page = s.changes_after(0, 10).unwrap();
        assert_eq!(page.changes.last().unwrap().kind, "Source");
        let messages = |snap: WatchSnapshot| -> Vec<String> {
            snap.events
                .into_iter()
                .map(|(_, e)| format!("{}/{}", e.kind, e.message))
                .collect()
        };
        // Everything: the object's event and the source's.
        let all = s.watch_snapshot(&[], false, None, false, 10).unwrap();
        assert_eq!(
            messages(all),
            ["VirtualDisk/disk", "Source/fetching main: refused"]
        );
        // The sources alone, by name: not the disk of the same name.
        let sources = s.watch_snapshot(&[], true, Some("git"), true, 10).unwrap();
        assert!(sources.objects.is_empty());
        assert_eq!(messages(sources), ["Source/fetching main: refused"]);
        // A kind alone: not the sources'.
        let disks = s
            .watch_snapshot(&[Kind::VirtualDisk], false, Some("git"), false, 10)
            .unwrap();
        assert_eq!(messages(disks), ["VirtualDisk/disk"]);
        assert_eq!(s.events(None, Some("git"), 10).unwrap().len(), 2);
    }

    #[test]
    fn a_snapshot_is_the_state_at_its_seq_with_the_newest_events() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("db")).unwrap();
        s.put_objects(&[disk("a", "1Gi"), disk("b", "1Gi")])
            .unwrap();
        for i in 0..4 {
            s.record_event(
                Kind::VirtualDisk,
                "a",
                EventType::Normal,
                "R",
                &i.to_string(),
            )
            .unwrap();
        }
        s.record_event(Kind::VirtualMachine, "a", EventType::Warning, "R", "vm")
            .unwrap();
        let snap = s
            .watch_snapshot(&[Kind::VirtualDisk], false, None, true, 2)
            .unwrap();
        assert_eq!(snap.head, 7);
        assert_eq!(snap.objects.len(), 2);
        let events: Vec<(Option<u64>, &str)> = snap
            .events
            .iter()
            .map(|(seq, e)| (*seq, e.message.as_str()))
            .collect();
        assert_eq!(events, vec![(Some(5), "2"), (Some(6), "3")]);
        let snap = s.watch_snapshot(&[], false, Some("a"), false, 10).unwrap();
        assert!(snap.objects.is_empty());
        assert_eq!(snap.events.len(), 5);
        assert_eq!(snap.events[4].1.message, "vm");
        let snap = s
            .watch_snapshot(&[Kind::VirtualDisk], false, Some("b"), true, 10)
            .unwrap();
        assert_eq!(snap.objects.len(), 1);
        assert!(snap.events.is_empty());
    }

    /// The schema of the release before the change log, with data in it.
    const OLD_SCHEMA: &str = r#"
CREATE TABLE objects (kind TEXT NOT NULL, name TEXT NOT NULL, body TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'null', deleting INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (kind, name));
CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, time TEXT NOT NULL,
    kind TEXT NOT NULL, name TEXT NOT NULL, type TEXT NOT NULL, reason TEXT NOT NULL,
    message TEXT NOT NULL);
CREATE INDEX events_by_object ON events (kind, name, id);
INSERT INTO events (time, kind, name, type, reason, message)
    VALUES ('2025-01-01T00:00:00+00:00', 'VirtualDisk', 'old', 'Normal', 'Created', 'before');
"#;

    #[test]
    fn a_database_from_before_the_change_log_opens_and_logs_from_then_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(OLD_SCHEMA).unwrap();
            let body = serde_json::to_string(&disk("old", "1Gi")).unwrap();
            conn.execute(
                "INSERT INTO objects (kind, name, body) VALUES ('VirtualDisk', 'old', ?1)",
                params![body],
            )
            .unwrap();
        }
        let s = Store::open(&path).unwrap();
        assert_eq!(s.head(), 0, "nothing was logged before");
        assert_eq!(s.list(Kind::VirtualDisk).unwrap().len(), 1);
        s.record_event(
            Kind::VirtualDisk,
            "old",
            EventType::Normal,
            "Updated",
            "after",
        )
        .unwrap();
        s.update_status::<VirtualDiskStatus, _>(Kind::VirtualDisk, "old", |st| {
            st.path = Some("/p".into())
        })
        .unwrap();
        let page = s.changes_after(0, 10).unwrap();
        assert_eq!(
            types(&page),
            vec![
                (1, WatchType::Event, "old"),
                (2, WatchType::Modified, "old")
            ]
        );
        // The old event is still there, without a seq; the new one has its own.
        let snap = s.watch_snapshot(&[], false, None, false, 10).unwrap();
        let seqs: Vec<Option<u64>> = snap.events.iter().map(|(seq, _)| *seq).collect();
        assert_eq!(seqs, vec![None, Some(1)]);
        assert_eq!(s.events(None, None, 10).unwrap()[0].message, "before");
        // Opening again changes nothing.
        drop(s);
        let s = Store::open(&path).unwrap();
        assert_eq!(s.head(), 2);
        assert_eq!(s.changes_after(0, 10).unwrap().changes.len(), 2);
    }
}
