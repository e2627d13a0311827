//! The snapshot journals: what a cut or a merge records before it touches
//! a file or QEMU, so that whatever happens next is settled by observing,
//! never by guessing (docs/snapshots.md). `cut_overlays` and
//! `ahead_overlays` (one set of functions, by [`Journal`]),
//! `freeze_intents` and `compactions`.

use std::path::PathBuf;

use chrono::{DateTime, Utc};
use hearth_qemu::process::ProcessIdentity;
use rusqlite::{OptionalExtension, Row, Transaction, params};

use super::layers::{Layer, layer_tx};
use super::{Store, StoreError};

/// The two overlay journals. Their rows are alike: an overlay file over a
/// disk's head, under a key that never repeats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Journal {
    /// `cut_overlays`: the overlays of a cut, keyed by the cut's id (one
    /// per disk of the cut).
    Cut,
    /// `ahead_overlays`: overlays made ahead of the cut that will use them,
    /// keyed by the `ahead` counter (one per disk).
    Ahead,
}

impl Journal {
    fn table(self) -> &'static str {
        match self {
            Journal::Cut => "cut_overlays",
            Journal::Ahead => "ahead_overlays",
        }
    }

    /// The column of the row's key.
    fn key(self) -> &'static str {
        match self {
            Journal::Cut => "cut",
            Journal::Ahead => "id",
        }
    }
}

/// One recorded overlay of a cut.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overlay {
    pub cut: u64,
    pub target: String,
    pub disk: String,
    /// The layer id the overlay gets once adopted.
    pub layer: String,
    pub path: PathBuf,
    /// Its QEMU node name (live cuts only).
    pub node: Option<String>,
    /// The layer it lies over (the disk's head when the cut began).
    pub base: String,
}

/// An overlay made ahead of the cut that will use it: formatted over its
/// disk's head and added to the running QEMU as an unattached node, so a
/// request only has to freeze. Recorded in `ahead_overlays` before its file
/// or node exists; the intent of the cut that takes it moves it to
/// `cut_overlays` ([`claim_tx`]). Until then nobody has switched to it, so
/// a leftover one is always removed, never adopted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ahead {
    /// From the durable counter `ahead`: never repeats, names the node.
    pub id: u64,
    pub target: String,
    pub disk: String,
    pub layer: String,
    pub path: PathBuf,
    pub node: String,
    /// The disk's head it was made over.
    pub base: String,
}

/// A row of either overlay journal: its key is the cut's id in
/// `cut_overlays`, the `ahead` counter's value in `ahead_overlays`.
#[derive(Clone, Debug)]
pub struct Record {
    pub key: u64,
    pub target: String,
    pub disk: String,
    pub layer: String,
    pub path: PathBuf,
    pub node: Option<String>,
    pub base: String,
}

/// What one overlay journal holds: its rows, typed.
pub trait Entry: Sized {
    const JOURNAL: Journal;
    fn record(&self) -> Record;
    /// `None` for a row that breaks the journal's rules (an ahead overlay
    /// always has a node).
    fn from_record(r: Record) -> Option<Self>;
}

impl Entry for Overlay {
    const JOURNAL: Journal = Journal::Cut;
    fn record(&self) -> Record {
        Record {
            key: self.cut,
            target: self.target.clone(),
            disk: self.disk.clone(),
            layer: self.layer.clone(),
            path: self.path.clone(),
            node: self.node.clone(),
            base: self.base.clone(),
        }
    }
    fn from_record(r: Record) -> Option<Self> {
        Some(Overlay {
            cut: r.key,
            target: r.target,
            disk: r.disk,
            layer: r.layer,
            path: r.path,
            node: r.node,
            base: r.base,
        })
    }
}

impl Entry for Ahead {
    const JOURNAL: Journal = Journal::Ahead;
    fn record(&self) -> Record {
        Record {
            key: self.id,
            target: self.target.clone(),
            disk: self.disk.clone(),
            layer: self.layer.clone(),
            path: self.path.clone(),
            node: Some(self.node.clone()),
            base: self.base.clone(),
        }
    }
    fn from_record(r: Record) -> Option<Self> {
        Some(Ahead {
            id: r.key,
            target: r.target,
            disk: r.disk,
            layer: r.layer,
            path: r.path,
            node: r.node?,
            base: r.base,
        })
    }
}

/// Records `e` in its journal, in a caller's transaction, before its file
/// is created.
pub fn record_tx<E: Entry>(tx: &Transaction<'_>, e: &E) -> Result<(), StoreError> {
    let j = E::JOURNAL;
    let r = e.record();
    tx.execute(
        &format!(
            "INSERT INTO {} ({}, target, disk, layer, path, node, base)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            j.table(),
            j.key()
        ),
        params![
            r.key as i64,
            r.target,
            r.disk,
            r.layer,
            r.path.to_string_lossy(),
            r.node,
            r.base
        ],
    )?;
    Ok(())
}

/// Which rows of a journal to read.
#[derive(Clone, Copy, Debug)]
pub enum Of<'a> {
    All,
    Target(&'a str),
    Disk(&'a str),
}

/// The rows of `E`'s journal that `of` names, oldest key first.
pub fn select<E: Entry>(store: &Store, of: Of<'_>) -> Result<Vec<E>, StoreError> {
    let j = E::JOURNAL;
    let (cond, arg) = match of {
        Of::All => ("?1 = ?1", ""),
        Of::Target(t) => ("target = ?1", t),
        Of::Disk(d) => ("disk = ?1", d),
    };
    store.with_tx(|tx| {
        let mut stmt = tx.prepare(&format!(
            "SELECT {key}, target, disk, layer, path, node, base FROM {table} WHERE {cond} ORDER BY {key}",
            key = j.key(),
            table = j.table(),
        ))?;
        let rows = stmt.query_map(params![arg], |r: &Row<'_>| {
            Ok(Record {
                key: r.get::<_, i64>(0)? as u64,
                target: r.get(1)?,
                disk: r.get(2)?,
                layer: r.get(3)?,
                path: PathBuf::from(r.get::<_, String>(4)?),
                node: r.get(5)?,
                base: r.get(6)?,
            })
        })?;
        let rows = rows.collect::<Result<Vec<_>, _>>()?;
        Ok(rows.into_iter().filter_map(E::from_record).collect())
    })
}

/// Removes `e`'s record, in a caller's transaction; how many rows went
/// (0: it was gone already).
pub fn forget_tx<E: Entry>(tx: &Transaction<'_>, e: &E) -> Result<usize, StoreError> {
    let j = E::JOURNAL;
    let r = e.record();
    Ok(tx.execute(
        &format!(
            "DELETE FROM {} WHERE {} = ?1 AND disk = ?2",
            j.table(),
            j.key()
        ),
        params![r.key as i64, r.disk],
    )?)
}

/// Cut `cut` takes ahead overlay `a`: its record moves to the cut's
/// journal, in the caller's transaction. Fails when the record is gone.
pub fn claim_tx(tx: &Transaction<'_>, a: &Ahead, cut: u64) -> Result<Overlay, StoreError> {
    if forget_tx(tx, a)? != 1 {
        // Removed meanwhile: the cut must not switch to it.
        return Err(StoreError::Sqlite(rusqlite::Error::QueryReturnedNoRows));
    }
    let o = Overlay {
        cut,
        target: a.target.clone(),
        disk: a.disk.clone(),
        layer: a.layer.clone(),
        path: a.path.clone(),
        node: Some(a.node.clone()),
        base: a.base.clone(),
    };
    record_tx(tx, &o)?;
    Ok(o)
}

/// Every target with something left to settle: a freeze intent or a
/// journalled overlay.
pub fn unsettled_targets(store: &Store) -> Result<Vec<String>, StoreError> {
    store.with_tx(|tx| {
        let mut stmt = tx.prepare(
            "SELECT target FROM freeze_intents UNION SELECT target FROM cut_overlays
             UNION SELECT target FROM ahead_overlays",
        )?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        Ok(rows.filter_map(Result::ok).collect::<Vec<_>>())
    })
}

// ------------------------------------------------------------ freeze intents

/// Records that cut `cut` of `target` freezes (or may freeze) its guest
/// until `deadline`, for the snapshots `requests`, in a caller's
/// transaction; replaces the target's earlier intent.
pub fn record_freeze_tx(
    tx: &Transaction<'_>,
    target: &str,
    cut: u64,
    deadline: DateTime<Utc>,
    requests: &[String],
) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO freeze_intents (target, cut, deadline, requests) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT (target) DO UPDATE SET cut = excluded.cut, deadline = excluded.deadline, requests = excluded.requests",
        params![target, cut as i64, deadline.to_rfc3339(), serde_json::to_string(requests)?],
    )?;
    Ok(())
}

/// The freeze intent of `target`: its cut and the snapshots it was for.
pub fn freeze_of_tx(
    tx: &Transaction<'_>,
    target: &str,
) -> Result<Option<(u64, Vec<String>)>, StoreError> {
    let row: Option<(i64, String)> = tx
        .query_row(
            "SELECT cut, requests FROM freeze_intents WHERE target = ?1",
            params![target],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?;
    Ok(row.map(|(cut, reqs)| (cut as u64, serde_json::from_str(&reqs).unwrap_or_default())))
}

/// Removes the freeze intent of `target`, in a caller's transaction.
pub fn forget_freeze_tx(tx: &Transaction<'_>, target: &str) -> Result<(), StoreError> {
    tx.execute(
        "DELETE FROM freeze_intents WHERE target = ?1",
        params![target],
    )?;
    Ok(())
}

// ------------------------------------------------------------ compactions

/// A merge recorded before it starts.
#[derive(Clone, Debug)]
pub struct CompactionIntent {
    pub id: i64,
    pub target: String,
    pub disk: String,
    pub top: Layer,
    pub base: Layer,
    pub gone: Vec<Layer>,
    pub job: Option<String>,
    /// The QEMU an online merge runs in: only that process's cache can
    /// hold the job's unflushed metadata, so only it can be asked to flush.
    pub qemu: Option<ProcessIdentity>,
}

/// The QMP job id of merge `id`.
pub fn compaction_job(id: i64) -> String {
    format!("hc{id}")
}

/// `pid:start_ticks`, as the `qemu` column holds it.
fn format_identity(p: &ProcessIdentity) -> String {
    format!("{}:{}", p.pid, p.start_ticks)
}

fn parse_identity(s: &str) -> Option<ProcessIdentity> {
    let (pid, ticks) = s.split_once(':')?;
    Some(ProcessIdentity {
        pid: pid.parse().ok()?,
        start_ticks: ticks.parse().ok()?,
    })
}

/// Records a merge of `gone` (top-down) between `top` and `base` before
/// anything starts, under a never-repeating id; `qemu` is the process an
/// online merge runs in (`None`: offline).
pub fn record_compaction(
    store: &Store,
    target: &str,
    disk: &str,
    (top, base, gone): (&str, &str, &[String]),
    qemu: Option<&ProcessIdentity>,
) -> Result<i64, StoreError> {
    store.with_tx(|tx| {
        let id = Store::next_counter_tx(tx, "compaction")? as i64;
        tx.execute(
            "INSERT INTO compactions (id, target, disk, top, base, gone, job, qemu)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            params![
                id,
                target,
                disk,
                top,
                base,
                serde_json::to_string(gone).unwrap_or_default(),
                qemu.map(|_| compaction_job(id)),
                qemu.map(format_identity),
            ],
        )?;
        Ok(id)
    })
}

/// The recorded merges of a disk or of a target, oldest first.
pub fn compactions(store: &Store, of: Of<'_>) -> Result<Vec<CompactionIntent>, StoreError> {
    let (cond, arg) = match of {
        Of::All => ("?1 = ?1", ""),
        Of::Target(t) => ("target = ?1", t),
        Of::Disk(d) => ("disk = ?1", d),
    };
    store.with_tx(|tx| {
        let mut stmt = tx.prepare(&format!(
            "SELECT id, target, disk, top, base, gone, job, qemu FROM compactions WHERE {cond} ORDER BY id"
        ))?;
        let rows = stmt
            .query_map(params![arg], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, String>(4)?,
                    r.get::<_, String>(5)?,
                    r.get::<_, Option<String>>(6)?,
                    r.get::<_, Option<String>>(7)?,
                ))
            })?
            .collect::<Result<Vec<_>, _>>()?;
        let mut out = Vec::new();
        for (id, target, disk, top, base, gone, job, qemu) in rows {
            let gone: Vec<String> = serde_json::from_str(&gone).unwrap_or_default();
            let layer = |id: &str| -> Result<Layer, StoreError> {
                Ok(layer_tx(tx, id)?.unwrap_or(Layer {
                    id: id.to_string(),
                    path: PathBuf::new(),
                    backing: None,
                }))
            };
            out.push(CompactionIntent {
                id,
                target,
                disk,
                top: layer(&top)?,
                base: layer(&base)?,
                gone: gone.iter().map(|g| layer(g)).collect::<Result<_, _>>()?,
                job,
                qemu: qemu.as_deref().and_then(parse_identity),
            });
        }
        Ok(out)
    })
}

/// The targets with a recorded merge.
pub fn compaction_targets(store: &Store) -> Result<Vec<String>, StoreError> {
    store.with_tx(|tx| {
        let mut stmt = tx.prepare("SELECT DISTINCT target FROM compactions")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        Ok(rows.filter_map(Result::ok).collect())
    })
}

/// A finished merge: the top's backing is the base, in one transaction
/// with the intent's removal.
pub fn finish_compaction(store: &Store, i: &CompactionIntent) -> Result<(), StoreError> {
    store.with_tx(|tx| {
        super::layers::set_backing_tx(tx, &i.top.id, &i.base.id)?;
        forget_compaction_tx(tx, i.id)
    })
}

/// Removes the record of merge `id`.
pub fn forget_compaction(store: &Store, id: i64) -> Result<(), StoreError> {
    store.with_tx(|tx| forget_compaction_tx(tx, id))
}

fn forget_compaction_tx(tx: &Transaction<'_>, id: i64) -> Result<(), StoreError> {
    tx.execute("DELETE FROM compactions WHERE id = ?1", params![id])?;
    Ok(())
}

/// Every recorded overlay path, ahead ones too (the start-up sweep keeps
/// these files; their journals settle them).
pub fn all_paths(store: &Store) -> Result<Vec<PathBuf>, StoreError> {
    let mut paths: Vec<PathBuf> = select::<Overlay>(store, Of::All)?
        .into_iter()
        .map(|o| o.path)
        .collect();
    paths.extend(select::<Ahead>(store, Of::All)?.into_iter().map(|a| a.path));
    Ok(paths)
}
