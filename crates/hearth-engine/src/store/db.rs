//! The store's connections and its error: what every table group's file
//! builds on. A leaf of the store: it imports none of them.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};

use rusqlite::{Connection, OptionalExtension, params};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error")]
    Sqlite(#[from] rusqlite::Error),
    #[error("stored record is not valid JSON")]
    Json(#[from] serde_json::Error),
}

#[derive(Clone)]
pub struct Store {
    pub(super) conn: Arc<Mutex<Connection>>,
    /// A second connection, only for the API's reads: in WAL mode it reads
    /// the last commit while `conn` writes, so a `GET` never waits for a
    /// reconciler's transaction or its sync (docs/store.md "Concurrency").
    pub(super) reader: Arc<Mutex<Connection>>,
    /// The change log's last sequence number, sent after each commit that
    /// moved it: what wakes the watch streams (never polled).
    pub(super) head: Arc<tokio::sync::watch::Sender<u64>>,
}

/// The store's connection while one caller holds it. When the holder wrote
/// something and no transaction is left open, dropping it publishes the
/// change log's new head, still under the lock, so heads go out in commit
/// order and a watcher that read the log before the commit is always woken.
pub(super) struct Conn<'a> {
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
        match head_of(&self.conn) {
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

/// The last sequence number handed out; 0 before the first change.
pub(super) fn head_of(conn: &Connection) -> Result<u64, StoreError> {
    let seq: Option<i64> = conn
        .query_row(
            "SELECT seq FROM sqlite_sequence WHERE name = 'changes'",
            [],
            |r| r.get(0),
        )
        .optional()?;
    Ok(seq.unwrap_or(0).max(0) as u64)
}

impl Store {
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

    pub(super) fn conn(&self) -> Conn<'_> {
        // A panic while holding the lock cannot leave SQLite half-written (the
        // transaction rolls back), so a poisoned lock is still usable.
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        Conn {
            writes_before: conn.total_changes(),
            conn,
            head: &self.head,
        }
    }
}
