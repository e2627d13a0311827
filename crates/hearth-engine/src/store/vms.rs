//! What hearthd keeps about each VM besides its object: the runtime
//! record of its QEMU, its run intent and the launches not settled yet.

use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};

use super::{Store, StoreError};
use crate::runtime::{LaunchMarker, RuntimeRecord};

/// Run intent set by `hearth start|stop|restart`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunIntent {
    /// None: follow the run policy's default.
    pub want_running: Option<bool>,
    /// Bumped by `restart`; the VM restarts when its runtime record lags.
    pub restart_nonce: u64,
}

impl Store {
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
}
