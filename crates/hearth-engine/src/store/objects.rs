//! The `objects` table: every object the user applied, with its status
//! and whether it is being deleted.

use hearth_api::{Kind, Object};
use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Store, StoreError};

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

/// An index of what VMs' specs name, kept by triggers on `objects` in the
/// transaction that writes the VM, so an apply or a reconcile finds a
/// disk's or a network's VMs by its name instead of reading every VM.
/// Rebuilt from the VMs at each open: a store of an older hearthd gets it,
/// and it can never drift.
struct Claims {
    /// The table, `(KEY, vm)`.
    table: &'static str,
    key: &'static str,
    /// The spec's array, and the field of each item that names the key.
    array: &'static str,
    field: &'static str,
}

/// Which VM names which disk (`spec.disks[].virtualDiskName`).
const DISK_CLAIMS: Claims = Claims {
    table: "disk_claims",
    key: "disk",
    array: "disks",
    field: "virtualDiskName",
};

/// Which VM has an interface on which network
/// (`spec.networks[].virtualNetworkName`).
const NETWORK_CLAIMS: Claims = Claims {
    table: "network_claims",
    key: "network",
    array: "networks",
    field: "virtualNetworkName",
};

impl Claims {
    fn sql(&self) -> String {
        let Claims {
            table,
            key,
            array,
            field,
        } = self;
        let claims_of_new = format!(
            "INSERT OR IGNORE INTO {table} ({key}, vm) \
             SELECT json_extract(value, '$.{field}'), NEW.name \
             FROM json_each(NEW.body, '$.spec.{array}') \
             WHERE json_extract(value, '$.{field}') IS NOT NULL;"
        );
        format!(
            r#"
CREATE TABLE IF NOT EXISTS {table} (
    {key} TEXT NOT NULL,
    vm TEXT NOT NULL,
    PRIMARY KEY ({key}, vm)
);
CREATE INDEX IF NOT EXISTS {table}_by_vm ON {table} (vm);
DROP TRIGGER IF EXISTS {table}_added;
DROP TRIGGER IF EXISTS {table}_modified;
DROP TRIGGER IF EXISTS {table}_deleted;
CREATE TRIGGER {table}_added AFTER INSERT ON objects
WHEN NEW.kind = 'VirtualMachine' BEGIN
    {claims_of_new}
END;
CREATE TRIGGER {table}_modified AFTER UPDATE OF body ON objects
WHEN NEW.kind = 'VirtualMachine' AND OLD.body IS NOT NEW.body BEGIN
    DELETE FROM {table} WHERE vm = OLD.name;
    {claims_of_new}
END;
CREATE TRIGGER {table}_deleted AFTER DELETE ON objects
WHEN OLD.kind = 'VirtualMachine' BEGIN
    DELETE FROM {table} WHERE vm = OLD.name;
END;
DELETE FROM {table};
INSERT OR IGNORE INTO {table} ({key}, vm)
SELECT json_extract(j.value, '$.{field}'), o.name
FROM objects o, json_each(o.body, '$.spec.{array}') j
WHERE o.kind = 'VirtualMachine' AND json_extract(j.value, '$.{field}') IS NOT NULL;
"#
        )
    }
}

/// The objects of a query of `body, status, deleting`, in its order.
fn stored_rows(
    stmt: &mut rusqlite::Statement<'_>,
    params: impl rusqlite::Params,
) -> Result<Vec<StoredObject>, StoreError> {
    let rows = stmt.query_map(params, |r| {
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

/// Creates the claim indexes and rebuilds them from the VMs, each in one
/// transaction.
pub(super) fn index_claims(conn: &Connection) -> Result<(), StoreError> {
    for claims in [DISK_CLAIMS, NETWORK_CLAIMS] {
        conn.execute_batch(&format!("BEGIN IMMEDIATE; {} COMMIT;", claims.sql()))?;
    }
    Ok(())
}

impl Store {
    /// The VMs whose spec names the disk `disk`, by name.
    pub fn disk_claimants(&self, disk: &str) -> Result<Vec<String>, StoreError> {
        Self::disk_claimants_tx(&self.conn(), disk)
    }

    /// `disk_claimants` inside a caller's transaction.
    pub fn disk_claimants_tx(conn: &Connection, disk: &str) -> Result<Vec<String>, StoreError> {
        let mut stmt =
            conn.prepare_cached("SELECT vm FROM disk_claims WHERE disk = ?1 ORDER BY vm")?;
        let rows = stmt.query_map(params![disk], |r| r.get::<_, String>(0))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// The VMs whose spec has an interface on `network`, by name.
    pub fn network_claimants(&self, network: &str) -> Result<Vec<String>, StoreError> {
        let conn = self.conn();
        let mut stmt =
            conn.prepare_cached("SELECT vm FROM network_claims WHERE network = ?1 ORDER BY vm")?;
        let rows = stmt.query_map(params![network], |r| r.get::<_, String>(0))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// The VMs whose spec has at least one interface, by name: the only
    /// ones whose spec claims a tap, an address, a MAC or a port.
    pub fn networked_vms(&self) -> Result<Vec<StoredObject>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(
            "SELECT body, status, deleting FROM objects o WHERE kind = 'VirtualMachine' \
             AND EXISTS (SELECT 1 FROM network_claims n WHERE n.vm = o.name) ORDER BY name",
        )?;
        stored_rows(&mut stmt, [])
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
        stored_rows(&mut stmt, params![kind.as_str()])
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

    /// Whether object `kind`/`name` exists, inside a caller's transaction.
    pub fn exists_tx(conn: &Connection, kind: Kind, name: &str) -> Result<bool, StoreError> {
        let n: i64 = conn.query_row(
            "SELECT COUNT(*) FROM objects WHERE kind = ?1 AND name = ?2",
            params![kind.as_str(), name],
            |r| r.get(0),
        )?;
        Ok(n > 0)
    }

    /// The status of object `kind`/`name` as stored, inside a caller's
    /// transaction; `None` when there is no such object.
    pub fn status_tx(
        conn: &Connection,
        kind: Kind,
        name: &str,
    ) -> Result<Option<Value>, StoreError> {
        let text: Option<String> = conn
            .query_row(
                "SELECT status FROM objects WHERE kind = ?1 AND name = ?2",
                params![kind.as_str(), name],
                |r| r.get(0),
            )
            .optional()?;
        Ok(text.map(|t| serde_json::from_str(&t)).transpose()?)
    }

    /// Writes a new object with its first status, inside a caller's
    /// transaction: an object made by hearthd itself (a group's or a VM
    /// snapshot's members). Fails when one of its name exists.
    pub fn create_with_status_tx(
        tx: &rusqlite::Transaction<'_>,
        object: &Object,
        status: &impl Serialize,
    ) -> Result<(), StoreError> {
        tx.execute(
            "INSERT INTO objects (kind, name, body, status) VALUES (?1, ?2, ?3, ?4)",
            params![
                object.kind().as_str(),
                object.name(),
                serde_json::to_string(object)?,
                serde_json::to_string(status)?
            ],
        )?;
        Ok(())
    }
}
