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

pub use changes::{CHANGE_HISTORY, ChangePage, StoredChange, WatchSnapshot};

use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use chrono::{DateTime, Utc};
use hearth_api::{Event, EventType, Kind, Object};
use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::runtime::{LaunchMarker, RuntimeRecord};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error")]
    Sqlite(#[from] rusqlite::Error),
    #[error("stored record is not valid JSON")]
    Json(#[from] serde_json::Error),
}

/// One stored object: the user's object (without status) plus what hearthd
/// keeps about it.
#[derive(Clone, Debug)]
pub struct StoredObject {
    pub object: Object,
    pub status: Value,
    pub deleting: bool,
}

impl StoredObject {
    /// The object with its status and server metadata, as the API shows it.
    pub fn to_json(&self) -> Value {
        let mut v = serde_json::to_value(&self.object).unwrap_or(Value::Null);
        if let Value::Object(map) = &mut v
            && !self.status.is_null()
        {
            map.insert("status".into(), self.status.clone());
        }
        v
    }
}

/// Run intent set by `hearth start|stop|restart`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunIntent {
    /// None: follow the run policy's default.
    pub want_running: Option<bool>,
    /// Bumped by `restart`; the VM restarts when its runtime record lags.
    pub restart_nonce: u64,
}

#[derive(Clone)]
pub struct Store {
    conn: Arc<Mutex<Connection>>,
    /// A second connection, only for the API's reads: in WAL mode it reads
    /// the last commit while `conn` writes, so a `GET` never waits for a
    /// reconciler's transaction or its sync (docs/store.md "Concurrency").
    reader: Arc<Mutex<Connection>>,
    /// The change log's last sequence number, sent after each commit that
    /// moved it: what wakes the watch streams (never polled).
    head: Arc<tokio::sync::watch::Sender<u64>>,
}

/// The store's connection while one caller holds it. When the holder wrote
/// something and no transaction is left open, dropping it publishes the
/// change log's new head, still under the lock, so heads go out in commit
/// order and a watcher that read the log before the commit is always woken.
struct Conn<'a> {
    conn: MutexGuard<'a, Connection>,
    writes_before: u64,
    head: &'a tokio::sync::watch::Sender<u64>,
}

impl Deref for Conn<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        &self.conn
    }
}

impl DerefMut for Conn<'_> {
    fn deref_mut(&mut self) -> &mut Connection {
        &mut self.conn
    }
}

impl Drop for Conn<'_> {
    fn drop(&mut self) {
        if self.conn.total_changes() == self.writes_before || !self.conn.is_autocommit() {
            return;
        }
        match changes::head_of(&self.conn) {
            Ok(seq) => {
                self.head.send_if_modified(|h| {
                    let moved = seq > *h;
                    if moved {
                        *h = seq;
                    }
                    moved
                });
            }
            Err(e) => tracing::warn!(error = %e, "cannot read the change log's head"),
        }
    }
}

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

/// One stored lease: the address of interface `interface` (its index in
/// the VM's `spec.networks`) of `vm` on `network`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StoredLease {
    pub network: String,
    pub vm: String,
    pub interface: u32,
    pub ip: std::net::Ipv4Addr,
    pub mac: String,
}

/// Events kept per object; older ones are dropped.
const EVENTS_PER_OBJECT: i64 = 200;

/// The life of the object `e.kind`/`e.name` now (SQL, for a row `e` of
/// `events`): the object's creationTimestamp, or when it is gone the life
/// of its newest event.
const CURRENT_LIFE: &str = "COALESCE(
    (SELECT json_extract(o.body, '$.metadata.creationTimestamp') FROM objects o
      WHERE o.kind = e.kind AND o.name = e.name),
    (SELECT l.life FROM events l WHERE l.kind = e.kind AND l.name = e.name
      ORDER BY l.id DESC LIMIT 1))";

/// Adds `events.life` to a database from before it: every event then
/// belongs to the current object of its name, as all of them were shown.
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
        let head = changes::head_of(&conn)?;
        let reader = Connection::open(path)?;
        reader.busy_timeout(std::time::Duration::from_secs(5))?;
        reader.pragma_update(None, "query_only", true)?;
        Ok(Store {
            conn: Arc::new(Mutex::new(conn)),
            reader: Arc::new(Mutex::new(reader)),
            head: Arc::new(tokio::sync::watch::channel(head).0),
        })
    }

    /// Runs `f` in one store transaction: all of it or none of it.
    pub fn with_tx<T>(
        &self,
        f: impl FnOnce(&rusqlite::Transaction<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let out = f(&tx)?;
        tx.commit()?;
        Ok(out)
    }

    /// Bumps and returns a named durable counter.
    pub fn next_counter(&self, name: &str) -> Result<u64, StoreError> {
        self.with_tx(|tx| Self::next_counter_tx(tx, name))
    }

    /// `next_counter` inside a caller's transaction.
    pub fn next_counter_tx(tx: &rusqlite::Transaction<'_>, name: &str) -> Result<u64, StoreError> {
        tx.execute(
            "INSERT INTO counters (name, value) VALUES (?1, 1)
             ON CONFLICT (name) DO UPDATE SET value = value + 1",
            params![name],
        )?;
        let v: i64 = tx.query_row(
            "SELECT value FROM counters WHERE name = ?1",
            params![name],
            |r| r.get(0),
        )?;
        Ok(v as u64)
    }

    /// A named durable counter's value (0 when it was never bumped).
    pub fn counter(&self, name: &str) -> Result<u64, StoreError> {
        let conn = self.conn();
        let v: Option<i64> = conn
            .query_row(
                "SELECT value FROM counters WHERE name = ?1",
                params![name],
                |r| r.get(0),
            )
            .optional()?;
        Ok(v.unwrap_or(0) as u64)
    }

    /// How many rows the store's writes have changed since it was opened:
    /// unchanged, nothing was written (every write goes through the one
    /// writing connection).
    pub fn writes(&self) -> u64 {
        self.conn().total_changes()
    }

    /// The reading connection ([`Store::reader`]'s): it never waits for a
    /// write.
    pub fn reader(&self) -> Reader<'_> {
        Reader {
            conn: self.reader.lock().unwrap_or_else(|p| p.into_inner()),
        }
    }

    fn conn(&self) -> Conn<'_> {
        // A panic while holding the lock cannot leave SQLite half-written (the
        // transaction rolls back), so a poisoned lock is still usable.
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        Conn {
            writes_before: conn.total_changes(),
            conn,
            head: &self.head,
        }
    }

    // ------------------------------------------------------------ leases

    /// Every lease, ordered by network, VM and interface.
    pub fn leases(&self) -> Result<Vec<StoredLease>, StoreError> {
        Self::leases_tx(&self.conn(), None)
    }

    /// The leases on one network.
    pub fn leases_of_network(&self, network: &str) -> Result<Vec<StoredLease>, StoreError> {
        Self::leases_tx(&self.conn(), Some(network))
    }

    pub fn leases_tx(
        conn: &Connection,
        network: Option<&str>,
    ) -> Result<Vec<StoredLease>, StoreError> {
        let mut stmt = conn.prepare(
            "SELECT network, vm, interface, ip, mac FROM leases
             WHERE ?1 IS NULL OR network = ?1 ORDER BY network, vm, interface",
        )?;
        let rows = stmt.query_map(params![network], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, String>(4)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (network, vm, interface, ip, mac) = row?;
            // Written by hearthd only; a row that does not read is skipped
            // (and replaced the next time its VM's leases are written).
            let (Ok(interface), Ok(ip)) = (u32::try_from(interface), ip.parse()) else {
                tracing::warn!(network, vm, ip, "skipping an unreadable lease");
                continue;
            };
            out.push(StoredLease {
                network,
                vm,
                interface,
                ip,
                mac,
            });
        }
        Ok(out)
    }

    /// Makes `leases` the whole set of `vm`'s leases, in one transaction:
    /// its other leases are released. The table's keys refuse a second
    /// holder of one address, so a bug above cannot store one.
    pub fn set_vm_leases(&self, vm: &str, leases: &[StoredLease]) -> Result<(), StoreError> {
        self.with_tx(|tx| Self::set_vm_leases_tx(tx, vm, leases))
    }

    pub fn set_vm_leases_tx(
        tx: &Connection,
        vm: &str,
        leases: &[StoredLease],
    ) -> Result<(), StoreError> {
        tx.execute("DELETE FROM leases WHERE vm = ?1", params![vm])?;
        for l in leases {
            tx.execute(
                "INSERT INTO leases (network, vm, interface, ip, mac) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![
                    l.network,
                    vm,
                    i64::from(l.interface),
                    l.ip.to_string(),
                    l.mac
                ],
            )?;
        }
        Ok(())
    }

    /// Makes `leases` the whole set of leases on `network`, inside the
    /// caller's transaction.
    pub fn set_network_leases_tx(
        tx: &Connection,
        network: &str,
        leases: &[StoredLease],
    ) -> Result<(), StoreError> {
        Self::release_network_leases_tx(tx, network)?;
        for l in leases {
            tx.execute(
                "INSERT INTO leases (network, vm, interface, ip, mac) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![
                    network,
                    l.vm,
                    i64::from(l.interface),
                    l.ip.to_string(),
                    l.mac
                ],
            )?;
        }
        Ok(())
    }

    /// Releases every lease of a VM (it is deleted).
    pub fn release_vm_leases_tx(tx: &Connection, vm: &str) -> Result<(), StoreError> {
        tx.execute("DELETE FROM leases WHERE vm = ?1", params![vm])?;
        Ok(())
    }

    /// Releases every lease on a network (it is deleted).
    pub fn release_network_leases_tx(tx: &Connection, network: &str) -> Result<(), StoreError> {
        tx.execute("DELETE FROM leases WHERE network = ?1", params![network])?;
        Ok(())
    }

    pub fn get(&self, kind: Kind, name: &str) -> Result<Option<StoredObject>, StoreError> {
        Self::get_tx(&self.conn(), kind, name)
    }

    /// `get` inside a caller's transaction.
    pub fn get_tx(
        conn: &Connection,
        kind: Kind,
        name: &str,
    ) -> Result<Option<StoredObject>, StoreError> {
        let row: Option<(String, String, bool)> = conn
            .query_row(
                "SELECT body, status, deleting FROM objects WHERE kind = ?1 AND name = ?2",
                params![kind.as_str(), name],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()?;
        row.map(|(body, status, deleting)| {
            Ok(StoredObject {
                object: serde_json::from_str(&body)?,
                status: serde_json::from_str(&status)?,
                deleting,
            })
        })
        .transpose()
    }

    pub fn list(&self, kind: Kind) -> Result<Vec<StoredObject>, StoreError> {
        Self::list_tx(&self.conn(), kind)
    }

    /// `list` inside a caller's transaction (a `Transaction` derefs to the
    /// connection).
    pub fn list_tx(conn: &Connection, kind: Kind) -> Result<Vec<StoredObject>, StoreError> {
        let mut stmt = conn
            .prepare("SELECT body, status, deleting FROM objects WHERE kind = ?1 ORDER BY name")?;
        let rows = stmt.query_map(params![kind.as_str()], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, bool>(2)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (body, status, deleting) = row?;
            out.push(StoredObject {
                object: serde_json::from_str(&body)?,
                status: serde_json::from_str(&status)?,
                deleting,
            });
        }
        Ok(out)
    }

    /// Writes a batch of objects in one transaction: all or nothing.
    /// Status is kept for objects that already exist.
    pub fn put_objects(&self, objects: &[Object]) -> Result<(), StoreError> {
        self.with_tx(|tx| Self::put_objects_tx(tx, objects))
    }

    /// `put_objects` inside a caller's transaction.
    pub fn put_objects_tx(
        tx: &rusqlite::Transaction<'_>,
        objects: &[Object],
    ) -> Result<(), StoreError> {
        for o in objects {
            let body = serde_json::to_string(o)?;
            tx.execute(
                "INSERT INTO objects (kind, name, body) VALUES (?1, ?2, ?3)
                 ON CONFLICT (kind, name) DO UPDATE SET body = excluded.body",
                params![o.kind().as_str(), o.name(), body],
            )?;
        }
        Ok(())
    }

    pub fn mark_deleting(&self, kind: Kind, name: &str) -> Result<bool, StoreError> {
        let n = self.conn().execute(
            "UPDATE objects SET deleting = 1 WHERE kind = ?1 AND name = ?2",
            params![kind.as_str(), name],
        )?;
        Ok(n > 0)
    }

    /// Removes an object and everything kept about it, in one transaction.
    pub fn remove(&self, kind: Kind, name: &str) -> Result<(), StoreError> {
        self.with_tx(|tx| Self::remove_tx(tx, kind, name))
    }

    /// `remove` inside a caller's transaction.
    pub fn remove_tx(
        tx: &rusqlite::Transaction<'_>,
        kind: Kind,
        name: &str,
    ) -> Result<(), StoreError> {
        tx.execute(
            "DELETE FROM objects WHERE kind = ?1 AND name = ?2",
            params![kind.as_str(), name],
        )?;
        if kind == Kind::VirtualMachine {
            tx.execute("DELETE FROM runtime WHERE vm = ?1", params![name])?;
            tx.execute("DELETE FROM intents WHERE vm = ?1", params![name])?;
            // A deleted VM's addresses are free again.
            Self::release_vm_leases_tx(tx, name)?;
        }
        if kind == Kind::VirtualNetwork {
            Self::release_network_leases_tx(tx, name)?;
        }
        Ok(())
    }

    /// Read-modify-write of an object's status in one transaction, so the
    /// reconciler and the VM monitor never overwrite each other's fields.
    pub fn update_status<T, F>(&self, kind: Kind, name: &str, f: F) -> Result<Option<T>, StoreError>
    where
        T: Serialize + for<'de> Deserialize<'de> + Default,
        F: FnOnce(&mut T),
    {
        self.with_tx(|tx| Self::update_status_tx(tx, kind, name, f))
    }

    /// `update_status` inside a caller's transaction.
    pub fn update_status_tx<T, F>(
        tx: &rusqlite::Transaction<'_>,
        kind: Kind,
        name: &str,
        f: F,
    ) -> Result<Option<T>, StoreError>
    where
        T: Serialize + for<'de> Deserialize<'de> + Default,
        F: FnOnce(&mut T),
    {
        let current: Option<String> = tx
            .query_row(
                "SELECT status FROM objects WHERE kind = ?1 AND name = ?2",
                params![kind.as_str(), name],
                |r| r.get(0),
            )
            .optional()?;
        let Some(current) = current else {
            return Ok(None);
        };
        let value: Value = serde_json::from_str(&current)?;
        let mut status: T = if value.is_null() {
            T::default()
        } else {
            serde_json::from_value(value).unwrap_or_default()
        };
        f(&mut status);
        // Shown to anyone who reads the object: no URL's credentials.
        let text = serde_json::to_string(&status)?;
        let text = hearth_api::redact::redact_credentials(&text);
        // An unchanged status is not written again: nothing to sync (every
        // resync of a VM at rest comes here).
        if *text != *current {
            tx.execute(
                "UPDATE objects SET status = ?3 WHERE kind = ?1 AND name = ?2",
                params![kind.as_str(), name, &*text],
            )?;
        }
        Ok(Some(status))
    }

    pub fn runtime(&self, vm: &str) -> Result<Option<RuntimeRecord>, StoreError> {
        let rec: Option<String> = self
            .conn()
            .query_row(
                "SELECT record FROM runtime WHERE vm = ?1",
                params![vm],
                |r| r.get(0),
            )
            .optional()?;
        Ok(rec.map(|r| serde_json::from_str(&r)).transpose()?)
    }

    pub fn runtimes(&self) -> Result<Vec<RuntimeRecord>, StoreError> {
        Self::runtimes_tx(&self.conn())
    }

    pub fn runtimes_tx(conn: &Connection) -> Result<Vec<RuntimeRecord>, StoreError> {
        let mut stmt = conn.prepare("SELECT record FROM runtime ORDER BY vm")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(serde_json::from_str(&r?)?);
        }
        Ok(out)
    }

    pub fn put_runtime(&self, rec: &RuntimeRecord) -> Result<(), StoreError> {
        self.conn().execute(
            "INSERT INTO runtime (vm, record) VALUES (?1, ?2)
             ON CONFLICT (vm) DO UPDATE SET record = excluded.record",
            params![rec.vm, serde_json::to_string(rec)?],
        )?;
        Ok(())
    }

    pub fn clear_runtime(&self, vm: &str) -> Result<(), StoreError> {
        self.conn()
            .execute("DELETE FROM runtime WHERE vm = ?1", params![vm])?;
        Ok(())
    }

    /// Records a launch before its QEMU is spawned.
    pub fn put_launch(&self, marker: &LaunchMarker) -> Result<(), StoreError> {
        self.conn().execute(
            "INSERT INTO launches (id, vm, marker) VALUES (?1, ?2, ?3)",
            params![marker.id as i64, marker.vm, serde_json::to_string(marker)?],
        )?;
        Ok(())
    }

    /// Launches not settled yet, oldest first; of one VM, or of all.
    pub fn launches(&self, vm: Option<&str>) -> Result<Vec<LaunchMarker>, StoreError> {
        Self::launches_tx(&self.conn(), vm)
    }

    pub fn launches_tx(
        conn: &Connection,
        vm: Option<&str>,
    ) -> Result<Vec<LaunchMarker>, StoreError> {
        let mut stmt =
            conn.prepare("SELECT marker FROM launches WHERE (?1 IS NULL OR vm = ?1) ORDER BY id")?;
        let rows = stmt.query_map(params![vm], |r| r.get::<_, String>(0))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(serde_json::from_str(&r?)?);
        }
        Ok(out)
    }

    /// Drops a launch marker whose QEMU is known not to run.
    pub fn drop_launch(&self, id: u64) -> Result<(), StoreError> {
        self.conn()
            .execute("DELETE FROM launches WHERE id = ?1", params![id as i64])?;
        Ok(())
    }

    /// Writes the runtime record of a launched QEMU and drops its launch
    /// marker, in one transaction: the process is always known by one or
    /// the other.
    pub fn record_launch(&self, launch: u64, rec: &RuntimeRecord) -> Result<(), StoreError> {
        self.with_tx(|tx| {
            tx.execute(
                "INSERT INTO runtime (vm, record) VALUES (?1, ?2)
                 ON CONFLICT (vm) DO UPDATE SET record = excluded.record",
                params![rec.vm, serde_json::to_string(rec)?],
            )?;
            tx.execute("DELETE FROM launches WHERE id = ?1", params![launch as i64])?;
            Ok(())
        })
    }

    pub fn intent(&self, vm: &str) -> Result<RunIntent, StoreError> {
        let rec: Option<String> = self
            .conn()
            .query_row(
                "SELECT intent FROM intents WHERE vm = ?1",
                params![vm],
                |r| r.get(0),
            )
            .optional()?;
        Ok(rec
            .map(|r| serde_json::from_str(&r))
            .transpose()?
            .unwrap_or_default())
    }

    pub fn update_intent(
        &self,
        vm: &str,
        f: impl FnOnce(&mut RunIntent),
    ) -> Result<RunIntent, StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let rec: Option<String> = tx
            .query_row(
                "SELECT intent FROM intents WHERE vm = ?1",
                params![vm],
                |r| r.get(0),
            )
            .optional()?;
        let mut intent: RunIntent = rec
            .map(|r| serde_json::from_str(&r))
            .transpose()?
            .unwrap_or_default();
        f(&mut intent);
        tx.execute(
            "INSERT INTO intents (vm, intent) VALUES (?1, ?2)
             ON CONFLICT (vm) DO UPDATE SET intent = excluded.intent",
            params![vm, serde_json::to_string(&intent)?],
        )?;
        tx.commit()?;
        Ok(intent)
    }

    pub fn record_event(
        &self,
        kind: Kind,
        name: &str,
        type_: EventType,
        reason: &str,
        message: &str,
    ) -> Result<(), StoreError> {
        self.with_tx(|tx| Self::record_event_tx(tx, Utc::now(), kind, name, type_, reason, message))
    }

    /// `record_event` inside a caller's transaction, with the time the
    /// event happened (so a write that joins a later transaction keeps it).
    pub fn record_event_tx(
        tx: &rusqlite::Transaction<'_>,
        time: DateTime<Utc>,
        kind: Kind,
        name: &str,
        type_: EventType,
        reason: &str,
        message: &str,
    ) -> Result<(), StoreError> {
        let type_text = match type_ {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        };
        // Shown to anyone who reads events: no URL's credentials.
        let message = &*hearth_api::redact::redact_credentials(message);
        let event = Event {
            time,
            kind: kind.as_str().to_string(),
            name: name.to_string(),
            type_,
            reason: reason.to_string(),
            message: message.to_string(),
        };
        let seq = changes::log_event_tx(tx, &event)?;
        tx.execute(
            &format!(
                "INSERT INTO events (time, kind, name, type, reason, message, seq, life)
                 SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, {CURRENT_LIFE}
                 FROM (SELECT ?2 AS kind, ?3 AS name) e"
            ),
            params![
                event.time.to_rfc3339(),
                kind.as_str(),
                name,
                type_text,
                reason,
                message,
                seq as i64
            ],
        )?;
        tx.execute(
            "DELETE FROM events WHERE kind = ?1 AND name = ?2 AND id <= (
                SELECT id FROM events WHERE kind = ?1 AND name = ?2 ORDER BY id DESC LIMIT 1 OFFSET ?3)",
            params![kind.as_str(), name, EVENTS_PER_OBJECT],
        )?;
        Ok(())
    }

    /// Events oldest first; the newest `limit` of them. With a name, only
    /// those of the current life of each object of that name (the one that
    /// exists, or the last one to have).
    pub fn events(
        &self,
        kind: Option<Kind>,
        name: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        Self::events_tx(&self.conn(), kind, name, limit)
    }

    /// `events` on a given connection.
    fn events_tx(
        conn: &Connection,
        kind: Option<Kind>,
        name: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        let mut stmt = conn.prepare(&format!(
            "SELECT e.time, e.kind, e.name, e.type, e.reason, e.message FROM events e
             WHERE (?1 IS NULL OR e.kind = ?1)
               AND (?2 IS NULL OR (e.name = ?2 AND e.life IS {CURRENT_LIFE}))
             ORDER BY e.id DESC LIMIT ?3"
        ))?;
        let rows = stmt.query_map(params![kind.map(|k| k.as_str()), name, limit as i64], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, String>(4)?,
                r.get::<_, String>(5)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (time, kind, name, type_, reason, message) = row?;
            out.push(event_from_row(time, kind, name, &type_, reason, message));
        }
        out.reverse();
        Ok(out)
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

/// An `events` row as the API shows it.
fn event_from_row(
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
    use hearth_api::{VirtualMachineStatus, VmPhase, parse_documents};

    fn disk(name: &str) -> Object {
        parse_documents(
            &format!("apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {{name: {name}}}\nspec: {{size: 1Gi, source: {{blank: {{}}}}}}\n"),
            "t",
        )
        .unwrap()
        .remove(0)
    }

    fn created(name: &str, at: &str) -> Object {
        let mut d = disk(name);
        d.metadata_mut().creation_timestamp = Some(at.parse().unwrap());
        d
    }

    fn reasons(s: &Store, name: Option<&str>) -> Vec<String> {
        s.events(Some(Kind::VirtualDisk), name, 100)
            .unwrap()
            .into_iter()
            .map(|e| e.reason)
            .collect()
    }

    #[test]
    fn events_belong_to_the_life_of_their_object() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("t.db")).unwrap();
        let ev = |reason: &str| {
            s.record_event(Kind::VirtualDisk, "d", EventType::Normal, reason, "m")
                .unwrap()
        };
        ev("BeforeAnyLife");
        s.put_objects(&[created("d", "2026-01-01T00:00:00.000000001Z")])
            .unwrap();
        ev("Created");
        ev("Ready");
        s.remove(Kind::VirtualDisk, "d").unwrap();
        // Recorded once the object is gone: still its life's.
        ev("Deleted");
        assert_eq!(reasons(&s, Some("d")), ["Created", "Ready", "Deleted"]);
        s.put_objects(&[created("d", "2026-01-01T00:00:05Z")])
            .unwrap();
        ev("Created");
        assert_eq!(reasons(&s, Some("d")), ["Created"]);
        // Without a name, every event of every life.
        assert_eq!(
            reasons(&s, None),
            ["BeforeAnyLife", "Created", "Ready", "Deleted", "Created"]
        );
        // The watch's initial list agrees.
        let snap = s
            .watch_snapshot(&[Kind::VirtualDisk], Some("d"), false, 100)
            .unwrap();
        let got: Vec<&str> = snap.events.iter().map(|(_, e)| e.reason.as_str()).collect();
        assert_eq!(got, ["Created"]);
    }

    #[test]
    fn an_older_database_gets_lives_for_the_events_of_its_objects() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        {
            let s = Store::open(&path).unwrap();
            s.put_objects(&[created("d", "2026-01-01T00:00:00Z")])
                .unwrap();
            s.record_event(Kind::VirtualDisk, "d", EventType::Normal, "Old", "m")
                .unwrap();
            s.record_event(Kind::VirtualDisk, "gone", EventType::Normal, "Old", "m")
                .unwrap();
        }
        // As a database from before the column.
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch(
            "CREATE TABLE before AS SELECT id, time, kind, name, type, reason, message, seq FROM events;
             DROP TABLE events;
             ALTER TABLE before RENAME TO events;",
        )
        .unwrap();
        drop(conn);
        let s = Store::open(&path).unwrap();
        assert_eq!(reasons(&s, Some("d")), ["Old"]);
        assert_eq!(reasons(&s, Some("gone")), ["Old"]);
    }

    #[test]
    fn credentials_in_event_messages_and_status_are_not_stored() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("t.db")).unwrap();
        s.put_objects(&[created("d", "2026-01-01T00:00:00Z")])
            .unwrap();
        s.record_event(
            Kind::VirtualDisk,
            "d",
            EventType::Warning,
            "Failed",
            "GET https://u:secret@h/x: 404",
        )
        .unwrap();
        s.update_status(Kind::VirtualDisk, "d", |st: &mut Value| {
            *st = serde_json::json!({"message": "GET https://u:secret@h/x: 404"});
        })
        .unwrap();
        let conn = s.conn();
        let dump: String = conn
            .query_row(
                "SELECT (SELECT group_concat(message) FROM events) || (SELECT group_concat(status) FROM objects) || (SELECT group_concat(body) FROM changes)",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert!(!dump.contains("secret"), "{dump}");
        assert!(dump.contains("https://***@h/x"), "{dump}");
    }

    fn lease(network: &str, vm: &str, interface: u32, ip: &str) -> StoredLease {
        StoredLease {
            network: network.into(),
            vm: vm.into(),
            interface,
            ip: ip.parse().unwrap(),
            mac: format!("02:00:00:00:00:0{interface}"),
        }
    }

    #[test]
    fn leases_survive_reopen_and_go_with_their_vm_or_network() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hearth.db");
        {
            let s = Store::open(&path).unwrap();
            s.set_vm_leases(
                "web",
                &[
                    lease("lan", "web", 0, "10.77.0.10"),
                    lease("lab", "web", 1, "10.78.0.10"),
                ],
            )
            .unwrap();
            s.set_vm_leases("db", &[lease("lan", "db", 0, "10.77.0.11")])
                .unwrap();
        }
        let s = Store::open(&path).unwrap();
        assert_eq!(s.leases().unwrap().len(), 3);
        assert_eq!(
            s.leases_of_network("lan").unwrap(),
            vec![
                lease("lan", "db", 0, "10.77.0.11"),
                lease("lan", "web", 0, "10.77.0.10")
            ]
        );
        // Rewriting a VM's set drops what it no longer has.
        s.set_vm_leases("web", &[lease("lan", "web", 0, "10.77.0.10")])
            .unwrap();
        assert!(s.leases_of_network("lab").unwrap().is_empty());
        // A second holder of one address is refused by the table itself,
        // and the failed write changes nothing.
        let taken = s.set_vm_leases("mail", &[lease("lan", "mail", 0, "10.77.0.10")]);
        assert!(taken.is_err());
        assert_eq!(s.leases().unwrap().len(), 2);
        // Removing the VM releases its leases; removing the network, the rest.
        s.remove(Kind::VirtualMachine, "web").unwrap();
        assert_eq!(
            s.leases().unwrap(),
            vec![lease("lan", "db", 0, "10.77.0.11")]
        );
        s.remove(Kind::VirtualNetwork, "lan").unwrap();
        assert!(s.leases().unwrap().is_empty());
    }

    #[test]
    fn objects_survive_reopen_and_status_is_kept_across_updates() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hearth.db");
        {
            let s = Store::open(&path).unwrap();
            s.put_objects(&[disk("a"), disk("b")]).unwrap();
            s.update_status::<VirtualMachineStatus, _>(Kind::VirtualDisk, "a", |st| {
                st.phase = VmPhase::Running
            })
            .unwrap();
            s.put_objects(&[disk("a")]).unwrap();
        }
        let s = Store::open(&path).unwrap();
        let all = s.list(Kind::VirtualDisk).unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].status["phase"], "Running");
        s.remove(Kind::VirtualDisk, "a").unwrap();
        assert!(s.get(Kind::VirtualDisk, "a").unwrap().is_none());
    }

    #[test]
    fn update_status_of_missing_object_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("db")).unwrap();
        let r = s
            .update_status::<VirtualMachineStatus, _>(Kind::VirtualMachine, "nope", |_| {})
            .unwrap();
        assert!(r.is_none());
    }

    #[test]
    fn events_are_bounded_per_object_and_come_oldest_first() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("db")).unwrap();
        for i in 0..(EVENTS_PER_OBJECT + 10) {
            s.record_event(
                Kind::VirtualMachine,
                "a",
                EventType::Normal,
                "R",
                &i.to_string(),
            )
            .unwrap();
        }
        s.record_event(Kind::VirtualMachine, "b", EventType::Warning, "R", "other")
            .unwrap();
        let ev = s
            .events(Some(Kind::VirtualMachine), Some("a"), 1000)
            .unwrap();
        assert_eq!(ev.len() as i64, EVENTS_PER_OBJECT);
        assert_eq!(
            ev.last().unwrap().message,
            (EVENTS_PER_OBJECT + 9).to_string()
        );
        let last3 = s.events(Some(Kind::VirtualMachine), Some("a"), 3).unwrap();
        assert_eq!(last3[0].message, (EVENTS_PER_OBJECT + 7).to_string());
    }

    #[test]
    fn intents_and_runtime_records_are_removed_with_the_vm() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("db")).unwrap();
        s.update_intent("vm1", |i| i.want_running = Some(false))
            .unwrap();
        assert_eq!(s.intent("vm1").unwrap().want_running, Some(false));
        s.remove(Kind::VirtualMachine, "vm1").unwrap();
        assert_eq!(s.intent("vm1").unwrap(), RunIntent::default());
    }

    #[test]
    fn a_launch_marker_is_replaced_by_its_runtime_record_in_one_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let record = RuntimeRecord {
            vm: "vm1".into(),
            process: hearth_qemu::ProcessIdentity {
                pid: 0,
                start_ticks: 0,
            },
            qmp_socket: "/run/q.sock".into(),
            agent_socket: None,
            serial_log: "/run/serial.log".into(),
            accel: hearth_qemu::Accel::Tcg,
            started_at: Utc::now(),
            spec_fingerprint: "f".into(),
            restart_nonce: 0,
            disks: Vec::new(),
            disk_names: Vec::new(),
            networks: None,
        };
        let created_at = Utc::now();
        let marker = |id: u64, vm: &str| LaunchMarker {
            id,
            vm: vm.into(),
            pidfile: format!("/run/launch-{id}.pid").into(),
            boot_id: "b".into(),
            not_before_ticks: 1,
            created_at,
            record: RuntimeRecord {
                vm: vm.into(),
                ..record.clone()
            },
        };
        {
            let s = Store::open(&path).unwrap();
            let a = s.next_counter("launch").unwrap();
            let b = s.next_counter("launch").unwrap();
            assert_ne!(a, b);
            s.put_launch(&marker(a, "vm1")).unwrap();
            s.put_launch(&marker(b, "vm2")).unwrap();
            assert!(s.put_launch(&marker(a, "vm1")).is_err(), "ids never repeat");
        }
        // Durable across a reopen, as after a crash.
        let s = Store::open(&path).unwrap();
        assert_eq!(s.launches(None).unwrap().len(), 2);
        let mine = s.launches(Some("vm1")).unwrap();
        assert_eq!(mine, vec![marker(mine[0].id, "vm1")]);
        let running = RuntimeRecord {
            process: hearth_qemu::ProcessIdentity {
                pid: 42,
                start_ticks: 7,
            },
            ..record.clone()
        };
        s.record_launch(mine[0].id, &running).unwrap();
        assert!(s.launches(Some("vm1")).unwrap().is_empty());
        assert_eq!(s.runtime("vm1").unwrap(), Some(running));
        let other = s.launches(Some("vm2")).unwrap();
        s.drop_launch(other[0].id).unwrap();
        assert!(s.launches(None).unwrap().is_empty());
        assert_eq!(s.runtime("vm2").unwrap(), None);
    }

    #[test]
    fn a_read_never_waits_for_a_write_in_progress() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("hearth.db")).unwrap();
        s.put_objects(&[disk("d1")]).unwrap();
        let (held_tx, held) = std::sync::mpsc::channel();
        let (release_tx, release) = std::sync::mpsc::channel::<()>();
        let writer = {
            let s = s.clone();
            std::thread::spawn(move || {
                s.with_tx(|tx| {
                    Store::put_objects_tx(tx, &[disk("d2")])?;
                    held_tx.send(()).unwrap();
                    // The write stays open, holding the writer's lock, until
                    // the read below has answered.
                    let _ = release.recv_timeout(std::time::Duration::from_secs(30));
                    Ok(())
                })
                .unwrap()
            })
        };
        held.recv().unwrap();
        let (read_tx, read) = std::sync::mpsc::channel();
        let reading = {
            let s = s.clone();
            std::thread::spawn(move || {
                let r = s.reader();
                let names: Vec<String> = r
                    .list(Kind::VirtualDisk)
                    .unwrap()
                    .iter()
                    .map(|o| o.object.name().to_string())
                    .collect();
                read_tx
                    .send((names, r.get(Kind::VirtualDisk, "d1").unwrap().is_some()))
                    .unwrap();
            })
        };
        let answer = read.recv_timeout(std::time::Duration::from_secs(10));
        release_tx.send(()).unwrap();
        writer.join().unwrap();
        reading.join().unwrap();
        // The last commit, not the write in progress.
        assert_eq!(
            answer.expect("the read waited for the write"),
            (vec!["d1".to_string()], true)
        );
        // And once that commits, the reader sees it.
        assert!(s.reader().get(Kind::VirtualDisk, "d2").unwrap().is_some());
    }

    #[test]
    fn an_unchanged_status_is_not_written_again() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("hearth.db")).unwrap();
        s.put_objects(&[disk("d1")]).unwrap();
        let set = |phase: hearth_api::DiskPhase| {
            s.update_status(
                Kind::VirtualDisk,
                "d1",
                |st: &mut hearth_api::VirtualDiskStatus| st.phase = phase,
            )
            .unwrap()
        };
        set(hearth_api::DiskPhase::Ready);
        let writes = s.conn().total_changes();
        set(hearth_api::DiskPhase::Ready);
        assert_eq!(
            s.conn().total_changes(),
            writes,
            "the same status was written again"
        );
        set(hearth_api::DiskPhase::Failed);
        assert!(
            s.conn().total_changes() > writes,
            "a changed status is written"
        );
    }
}
