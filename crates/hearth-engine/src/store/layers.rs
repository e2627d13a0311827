//! The layer tables: `layers` (qcow2 files, each over the one below),
//! `heads` (each disk's writable top), `snapshot_layers` (each snapshot's
//! content), and the files below a bottom layer that are not layers
//! (`layer_bases`, `layer_source_images`). What the layers mean, and when
//! one may go, is `snapshot::storage`'s; this file only reads and writes
//! the rows.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use rusqlite::{OptionalExtension, Transaction, params};

use super::{Store, StoreError};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layer {
    pub id: String,
    pub path: PathBuf,
    pub backing: Option<String>,
}

/// A layer made for a cut or a restore, not yet recorded.
#[derive(Clone, Debug)]
pub struct NewLayer {
    pub id: String,
    pub path: PathBuf,
}

/// Moves the `layer` counter past `count` more ids in one commit and
/// returns them.
pub fn reserve_ids(store: &Store, count: u64) -> Result<std::ops::RangeInclusive<u64>, StoreError> {
    store.with_tx(|tx| {
        tx.execute(
            "INSERT INTO counters (name, value) VALUES ('layer', ?1)
             ON CONFLICT (name) DO UPDATE SET value = value + ?1",
            params![count as i64],
        )?;
        let last: i64 =
            tx.query_row("SELECT value FROM counters WHERE name = 'layer'", [], |r| {
                r.get(0)
            })?;
        let last = last as u64;
        Ok(last + 1 - count..=last)
    })
}

/// The id of the layer whose file is `path`, if one is recorded.
pub fn id_of_file_tx(tx: &Transaction<'_>, path: &Path) -> Result<Option<String>, StoreError> {
    Ok(tx
        .query_row(
            "SELECT id FROM layers WHERE path = ?1",
            params![path.to_string_lossy()],
            |r| r.get(0),
        )
        .optional()?)
}

pub fn head(store: &Store, disk: &str) -> Result<Option<Layer>, StoreError> {
    store.with_tx(|tx| head_tx(tx, disk))
}

pub fn head_tx(tx: &Transaction<'_>, disk: &str) -> Result<Option<Layer>, StoreError> {
    let id: Option<String> = tx
        .query_row(
            "SELECT layer FROM heads WHERE disk = ?1",
            params![disk],
            |r| r.get(0),
        )
        .optional()?;
    match id {
        Some(id) => layer_tx(tx, &id),
        None => Ok(None),
    }
}

pub fn layer_tx(tx: &Transaction<'_>, id: &str) -> Result<Option<Layer>, StoreError> {
    Ok(tx
        .query_row(
            "SELECT id, path, backing FROM layers WHERE id = ?1",
            params![id],
            |r| {
                Ok(Layer {
                    id: r.get(0)?,
                    path: PathBuf::from(r.get::<_, String>(1)?),
                    backing: r.get(2)?,
                })
            },
        )
        .optional()?)
}

pub fn snapshot_layer(store: &Store, snapshot: &str) -> Result<Option<Layer>, StoreError> {
    store.with_tx(|tx| {
        let id: Option<String> = tx
            .query_row(
                "SELECT layer FROM snapshot_layers WHERE snapshot = ?1",
                params![snapshot],
                |r| r.get(0),
            )
            .optional()?;
        match id {
            Some(id) => layer_tx(tx, &id),
            None => Ok(None),
        }
    })
}

/// Every snapshot with its layer: (snapshot, layer id).
pub fn snapshot_layers(store: &Store) -> Result<Vec<(String, String)>, StoreError> {
    store.with_tx(|tx| {
        let mut stmt = tx.prepare("SELECT snapshot, layer FROM snapshot_layers")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
        Ok(rows.filter_map(Result::ok).collect::<Vec<_>>())
    })
}

/// Records `new` as a layer over `backing` and makes it `disk`'s head.
pub fn set_head_tx(
    tx: &Transaction<'_>,
    disk: &str,
    new: &NewLayer,
    backing: Option<&str>,
) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO layers (id, path, backing) VALUES (?1, ?2, ?3)",
        params![new.id, new.path.to_string_lossy(), backing],
    )?;
    tx.execute(
        "INSERT INTO heads (disk, layer) VALUES (?1, ?2)
         ON CONFLICT (disk) DO UPDATE SET layer = excluded.layer",
        params![disk, new.id],
    )?;
    Ok(())
}

/// Makes `backing` the layer below `layer` (a merge put its data there).
pub fn set_backing_tx(tx: &Transaction<'_>, layer: &str, backing: &str) -> Result<(), StoreError> {
    tx.execute(
        "UPDATE layers SET backing = ?1 WHERE id = ?2",
        params![backing, layer],
    )?;
    Ok(())
}

/// Records that `layer`'s backing file is the image file `path`, which is
/// not a layer: the image store keeps that file while the layer exists.
pub fn set_layer_base_tx(tx: &Transaction<'_>, layer: &str, path: &Path) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO layer_bases (layer, path) VALUES (?1, ?2)
         ON CONFLICT (layer) DO UPDATE SET path = excluded.path",
        params![layer, path.to_string_lossy()],
    )?;
    Ok(())
}

/// Whether any layer still has the image file `path` as its base (an
/// image's, or an administrator's `spec.source.image` file that happens to
/// be named like one).
pub fn base_in_use_tx(tx: &Transaction<'_>, path: &Path) -> Result<bool, StoreError> {
    let n: i64 = tx.query_row(
        "SELECT (SELECT COUNT(*) FROM layer_bases WHERE path = ?1)
              + (SELECT COUNT(*) FROM layer_source_images WHERE path = ?1)",
        params![path.to_string_lossy()],
        |r| r.get(0),
    )?;
    Ok(n > 0)
}

/// The image file recorded below `layer` (`layer_bases`), if any.
pub fn layer_base_tx(tx: &Transaction<'_>, layer: &str) -> Result<Option<PathBuf>, StoreError> {
    Ok(tx
        .query_row(
            "SELECT path FROM layer_bases WHERE layer = ?1",
            params![layer],
            |r| r.get::<_, String>(0),
        )
        .optional()?
        .map(PathBuf::from))
}

/// Records that `layer` was made over the administrator's base image
/// `path` (canonical), opened as `format`.
pub fn set_layer_source_image_tx(
    tx: &Transaction<'_>,
    layer: &str,
    path: &Path,
    format: &str,
) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO layer_source_images (layer, path, format) VALUES (?1, ?2, ?3)
         ON CONFLICT (layer) DO UPDATE SET path = excluded.path, format = excluded.format",
        params![layer, path.to_string_lossy(), format],
    )?;
    Ok(())
}

/// The base image (path, format) recorded below `layer` by
/// [`set_layer_source_image_tx`], if any.
pub fn layer_source_image_tx(
    tx: &Transaction<'_>,
    layer: &str,
) -> Result<Option<(PathBuf, String)>, StoreError> {
    Ok(tx
        .query_row(
            "SELECT path, format FROM layer_source_images WHERE layer = ?1",
            params![layer],
            |r| {
                Ok((
                    PathBuf::from(r.get::<_, String>(0)?),
                    r.get::<_, String>(1)?,
                ))
            },
        )
        .optional()?)
}

pub fn drop_head(store: &Store, disk: &str) -> Result<(), StoreError> {
    store.with_tx(|tx| {
        tx.execute("DELETE FROM heads WHERE disk = ?1", params![disk])?;
        Ok(())
    })
}

pub fn set_snapshot_layer_tx(
    tx: &Transaction<'_>,
    snapshot: &str,
    layer: &str,
) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO snapshot_layers (snapshot, layer) VALUES (?1, ?2)
         ON CONFLICT (snapshot) DO UPDATE SET layer = excluded.layer",
        params![snapshot, layer],
    )?;
    Ok(())
}

pub fn drop_snapshot_layer(store: &Store, snapshot: &str) -> Result<(), StoreError> {
    store.with_tx(|tx| drop_snapshot_layer_tx(tx, snapshot))
}

/// `drop_snapshot_layer` inside a caller's transaction.
pub fn drop_snapshot_layer_tx(tx: &Transaction<'_>, snapshot: &str) -> Result<(), StoreError> {
    tx.execute(
        "DELETE FROM snapshot_layers WHERE snapshot = ?1",
        params![snapshot],
    )?;
    Ok(())
}

/// The path of every recorded layer.
pub fn paths(store: &Store) -> Result<BTreeSet<PathBuf>, StoreError> {
    store.with_tx(|tx| {
        let mut stmt = tx.prepare("SELECT path FROM layers")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        Ok(rows.filter_map(Result::ok).map(PathBuf::from).collect())
    })
}

/// Which references keep a layer (and the chain below it) alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Roots {
    /// Heads, snapshots' layers and every layer of a recorded merge: what
    /// garbage collection keeps.
    Kept,
    /// [`Roots::Kept`], and the layers journalled overlays lie over: every
    /// direct reference, as compaction plans with them.
    Referenced,
}

/// Every layer with the layer below it (id, path, backing).
fn all_tx(tx: &Transaction<'_>) -> Result<BTreeMap<String, (PathBuf, Option<String>)>, StoreError> {
    let mut all = BTreeMap::new();
    let mut stmt = tx.prepare("SELECT id, path, backing FROM layers")?;
    let rows = stmt.query_map([], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, Option<String>>(2)?,
        ))
    })?;
    for row in rows {
        let (id, path, backing) = row?;
        all.insert(id, (PathBuf::from(path), backing));
    }
    Ok(all)
}

/// The layers `roots` names directly, in no particular order.
fn roots_tx(tx: &Transaction<'_>, roots: Roots) -> Result<Vec<String>, StoreError> {
    let mut sql = vec![
        "SELECT layer FROM heads",
        "SELECT layer FROM snapshot_layers",
    ];
    if roots == Roots::Referenced {
        sql.extend([
            "SELECT base FROM cut_overlays",
            "SELECT base FROM ahead_overlays",
        ]);
    }
    // A recorded merge keeps its layers until it is settled.
    sql.extend([
        "SELECT top FROM compactions",
        "SELECT base FROM compactions",
    ]);
    let mut out = Vec::new();
    for sql in sql {
        let mut stmt = tx.prepare(sql)?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        for r in rows {
            out.push(r?);
        }
    }
    // A merge in progress keeps its gone layers where they are too.
    let mut stmt = tx.prepare("SELECT gone FROM compactions")?;
    let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
    for r in rows {
        out.extend(serde_json::from_str::<Vec<String>>(&r?).unwrap_or_default());
    }
    Ok(out)
}

/// The layer graph in one read.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    /// Every layer with the layer below it.
    pub backing: BTreeMap<String, Option<String>>,
    /// The layers the [`Roots`] asked for name directly.
    pub roots: Vec<String>,
}

/// Every layer with its backing layer, and the layers `roots` names.
pub fn graph(store: &Store, roots: Roots) -> Result<Graph, StoreError> {
    store.with_tx(|tx| {
        let backing = all_tx(tx)?
            .into_iter()
            .map(|(id, (_, b))| (id, b))
            .collect();
        Ok(Graph {
            backing,
            roots: roots_tx(tx, roots)?,
        })
    })
}

/// Forgets every layer nothing reaches from the [`Roots::Kept`] roots, in
/// one transaction: their rows and those of the files below them. Returns
/// the layers' files and the image files that were below them (neither is
/// unlinked here).
pub fn forget_unreachable(store: &Store) -> Result<(Vec<PathBuf>, BTreeSet<PathBuf>), StoreError> {
    store.with_tx(|tx| {
        let all = all_tx(tx)?;
        let mut live = BTreeSet::new();
        for root in roots_tx(tx, Roots::Kept)? {
            let mut cur = Some(root);
            while let Some(id) = cur {
                if !live.insert(id.clone()) {
                    break;
                }
                cur = all.get(&id).and_then(|(_, b)| b.clone());
            }
        }
        let mut doomed = Vec::new();
        let mut bases = BTreeSet::new();
        for (id, (path, _)) in &all {
            if !live.contains(id) {
                bases.extend(layer_base_tx(tx, id)?);
                tx.execute("DELETE FROM layer_bases WHERE layer = ?1", params![id])?;
                tx.execute(
                    "DELETE FROM layer_source_images WHERE layer = ?1",
                    params![id],
                )?;
                tx.execute("DELETE FROM layers WHERE id = ?1", params![id])?;
                doomed.push(path.clone());
            }
        }
        Ok((doomed, bases))
    })
}
