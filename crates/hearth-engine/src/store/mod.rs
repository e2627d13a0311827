//! The embedded store: one SQLite database file in the state directory.
//!
//! SQLite in WAL mode with `synchronous=FULL`: every write is one transaction,
//! so a crash at any point leaves either the old or the new object, never half
//! of one. Objects, status, runtime records and events all live here so that a
//! restarted daemon knows everything it had started.
//!
//! Every object write and every event also appends to a change log, in the
//! same transaction, under a durable sequence number (`changes.rs`): the
//! watch stream's resume point (docs/store.md "Change log").

mod changes;
mod db;
mod events;
pub mod journals;
pub mod layers;
mod networks;
mod objects;
#[cfg(test)]
mod tests;
mod vms;

pub use changes::{CHANGE_HISTORY, ChangePage, StoredChange, WatchSnapshot};
pub use db::{Store, StoreError};
pub use networks::StoredLease;
pub use objects::StoredObject;
pub use vms::RunIntent;

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use hearth_api::{Event, Kind};
use rusqlite::{Connection, params};

const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS objects (
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    body TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'null',
    deleting INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (kind, name)
);
CREATE TABLE IF NOT EXISTS runtime (
    vm TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS intents (
    vm TEXT PRIMARY KEY,
    intent TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    type TEXT NOT NULL,
    reason TEXT NOT NULL,
    message TEXT NOT NULL,
    -- Its change-log sequence number; NULL for events recorded before the
    -- change log existed (added to older databases by `changes::migrate`).
    seq INTEGER,
    -- The life of the object it is about: the object's creationTimestamp
    -- when it was recorded, or (the object gone, or not made yet) the life
    -- of the object's event before it. A new object of a deleted one's
    -- name starts a new life, so its events are not the old one's.
    life TEXT
);
CREATE INDEX IF NOT EXISTS events_by_object ON events (kind, name, id);
-- Disk image layers: qcow2 files, each backed by the one below it.
CREATE TABLE IF NOT EXISTS layers (
    id TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    backing TEXT
);
-- The file below a layer that is not a layer itself: the VirtualImage file
-- a disk was made from (its bottom layer's backing file). It keeps that file
-- in the image store for as long as the layer exists (docs/images.md).
CREATE TABLE IF NOT EXISTS layer_bases (
    layer TEXT PRIMARY KEY,
    path TEXT NOT NULL
);
-- The file below a layer made from `spec.source.image`: an administrator's
-- base image under an image root (canonical path, and the format it was
-- opened with). Never the image store's to remove; every start checks that
-- the chain still ends in exactly this file (docs/images.md).
CREATE TABLE IF NOT EXISTS layer_source_images (
    layer TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    format TEXT NOT NULL
);
-- The writable top layer of each disk.
CREATE TABLE IF NOT EXISTS heads (
    disk TEXT PRIMARY KEY,
    layer TEXT NOT NULL
);
-- The immutable layer whose chain is a snapshot's content.
CREATE TABLE IF NOT EXISTS snapshot_layers (
    snapshot TEXT PRIMARY KEY,
    layer TEXT NOT NULL
);
-- A cut that froze (or may have frozen) a guest and was not settled yet.
CREATE TABLE IF NOT EXISTS freeze_intents (
    target TEXT PRIMARY KEY,
    cut INTEGER NOT NULL,
    deadline TEXT NOT NULL,
    requests TEXT NOT NULL
);
-- An overlay of a cut, recorded before its file or its QEMU node exists and
-- settled by observing QEMU: adopted as the disk's head when QEMU writes to
-- it (or may have, when QEMU is gone), removed when QEMU does not use it.
CREATE TABLE IF NOT EXISTS cut_overlays (
    cut INTEGER NOT NULL,
    target TEXT NOT NULL,
    disk TEXT NOT NULL,
    layer TEXT NOT NULL,
    path TEXT NOT NULL,
    node TEXT,
    base TEXT NOT NULL,
    PRIMARY KEY (cut, disk)
);
-- A merge of layers nobody needs any more into the layer above them
-- (docs/snapshots.md, "Compaction"), recorded before its job or qemu-img
-- starts and settled by reading the top layer's header: `gone` (a JSON
-- list, top-down) are the layers merged, `job` the QMP job of an online one
-- and `qemu` (`pid:start_ticks`) the QEMU it runs in.
CREATE TABLE IF NOT EXISTS compactions (
    id INTEGER PRIMARY KEY,
    target TEXT NOT NULL,
    disk TEXT NOT NULL,
    top TEXT NOT NULL,
    base TEXT NOT NULL,
    gone TEXT NOT NULL,
    job TEXT,
    qemu TEXT
);
-- An overlay made ahead of the cut that will use it (one per disk at most),
-- recorded before its file or its QEMU node exists. While it is here nobody
-- has switched to it: the intent of the cut that uses it moves it into
-- cut_overlays in the same write. So a row left here by a crash or a stop
-- is removed (node, then record, then file), never adopted.
CREATE TABLE IF NOT EXISTS ahead_overlays (
    disk TEXT PRIMARY KEY,
    id INTEGER NOT NULL,
    target TEXT NOT NULL,
    layer TEXT NOT NULL,
    path TEXT NOT NULL,
    node TEXT NOT NULL,
    base TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
-- A QEMU launch, recorded before the spawn and deleted in the transaction
-- that writes the runtime record; one left over is settled at start-up.
-- One address per VM interface on a VirtualNetwork: kept across VM and
-- daemon restarts, removed only with the VM, the interface or the network
-- (docs/networking.md). One holder per address, one address per holder.
CREATE TABLE IF NOT EXISTS leases (
    network TEXT NOT NULL,
    vm TEXT NOT NULL,
    interface INTEGER NOT NULL,
    ip TEXT NOT NULL,
    mac TEXT NOT NULL,
    PRIMARY KEY (network, vm, interface),
    UNIQUE (network, ip)
);
CREATE TABLE IF NOT EXISTS launches (
    id INTEGER PRIMARY KEY,
    vm TEXT NOT NULL,
    marker TEXT NOT NULL
);
-- Every change to `objects` (written by the triggers in changes.rs) and
-- every event, in order: the watch stream's history. `seq` never repeats
-- (AUTOINCREMENT), even after the oldest rows are trimmed.
CREATE TABLE IF NOT EXISTS changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    type TEXT NOT NULL,
    body TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'null',
    deleting INTEGER NOT NULL DEFAULT 0
);
"#;

/// Columns added to tables after they first shipped: a store written by an
/// older hearthd gets them (NULL in its existing rows).
const ADDED_COLUMNS: &[(&str, &str, &str)] = &[("compactions", "qemu", "TEXT")];

fn add_missing_columns(conn: &Connection) -> Result<(), StoreError> {
    for (table, column, ty) in ADDED_COLUMNS {
        let present: bool = conn.query_row(
            "SELECT COUNT(*) > 0 FROM pragma_table_info(?1) WHERE name = ?2",
            params![table, column],
            |r| r.get(0),
        )?;
        if !present {
            conn.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN {column} {ty}"))?;
        }
    }
    Ok(())
}

fn migrate_event_lives(conn: &Connection) -> Result<(), StoreError> {
    let has_life: bool = conn.query_row(
        "SELECT COUNT(*) > 0 FROM pragma_table_info('events') WHERE name = 'life'",
        [],
        |r| r.get(0),
    )?;
    if !has_life {
        conn.execute_batch(
            "BEGIN IMMEDIATE;
             ALTER TABLE events ADD COLUMN life TEXT;
             UPDATE events SET life = (SELECT json_extract(o.body, '$.metadata.creationTimestamp')
               FROM objects o WHERE o.kind = events.kind AND o.name = events.name);
             COMMIT;",
        )?;
    }
    Ok(())
}

impl Store {
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        Self::open_with_history(path, CHANGE_HISTORY)
    }

    /// `open`, keeping the newest `history` changes (at least 1) in the
    /// change log.
    pub fn open_with_history(path: &Path, history: u64) -> Result<Store, StoreError> {
        let mut conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.execute_batch(SCHEMA)?;
        add_missing_columns(&conn)?;
        changes::migrate(&mut conn, history)?;
        migrate_event_lives(&conn)?;
        objects::index_claims(&conn)?;
        let head = db::head_of(&conn)?;
        let reader = Connection::open(path)?;
        reader.busy_timeout(std::time::Duration::from_secs(5))?;
        reader.pragma_update(None, "query_only", true)?;
        Ok(Store {
            conn: Arc::new(Mutex::new(conn)),
            reader: Arc::new(Mutex::new(reader)),
            head: Arc::new(tokio::sync::watch::channel(head).0),
        })
    }

    /// The reading connection ([`Store::reader`]'s): it never waits for a
    /// write.
    pub fn reader(&self) -> Reader<'_> {
        Reader {
            conn: self.reader.lock().unwrap_or_else(|p| p.into_inner()),
        }
    }
}

/// Reads on the store's second connection: what the last commit left,
/// without waiting for a writer.
pub struct Reader<'a> {
    conn: MutexGuard<'a, Connection>,
}

impl Reader<'_> {
    pub fn get(&self, kind: Kind, name: &str) -> Result<Option<StoredObject>, StoreError> {
        Store::get_tx(&self.conn, kind, name)
    }

    pub fn list(&self, kind: Kind) -> Result<Vec<StoredObject>, StoreError> {
        Store::list_tx(&self.conn, kind)
    }

    pub fn events(
        &self,
        kind: Option<Kind>,
        name: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        Store::events_tx(&self.conn, kind, name, limit)
    }
}
