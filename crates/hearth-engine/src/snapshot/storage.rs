//! Snapshot storage: qcow2 layer chains.
//!
//! A disk is a chain of layers; its *head* is the writable top. A cut puts a
//! fresh overlay on top of the head: the old head becomes immutable and is the
//! snapshot's content (with everything below it). So:
//! - taking a snapshot costs one small file and one block-graph change, in
//!   time independent of the disk's size;
//! - restoring is one more overlay over the snapshot's layer, same cost;
//! - nothing ever writes into a layer once it is below a head, so deleting a
//!   snapshot cannot change any other snapshot or disk: it only drops a
//!   reference, and a layer file is removed once nothing reaches it any more
//!   (no head, no snapshot, no layer above it).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::store::{Store, StoreError, layers};

pub use crate::store::layers::{
    Layer, NewLayer, drop_head, drop_snapshot_layer_tx, head, head_tx, layer_base_tx,
    layer_source_image_tx, layer_tx, set_head_tx, set_layer_base_tx, set_layer_source_image_tx,
    set_snapshot_layer_tx, snapshot_layer,
};

pub fn layers_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("layers")
}

/// A fresh, never reused layer id and its file path.
pub fn allocate(store: &Store, state_dir: &Path, disk: &str) -> Result<NewLayer, StoreError> {
    store.with_tx(|tx| allocate_tx(tx, state_dir, disk))
}

/// `allocate` inside a caller's transaction.
pub fn allocate_tx(
    tx: &rusqlite::Transaction<'_>,
    state_dir: &Path,
    disk: &str,
) -> Result<NewLayer, StoreError> {
    let n = Store::next_counter_tx(tx, "layer")?;
    Ok(numbered(state_dir, n, disk))
}

/// Reserves `count` layer ids at once, in one commit: the counter moves
/// past all of them, so none is ever handed out again, used or not. For
/// many new disks at once (`numbered` makes the layers).
pub fn reserve(store: &Store, count: u64) -> Result<std::ops::RangeInclusive<u64>, StoreError> {
    layers::reserve_ids(store, count.max(1))
}

/// The layer of `disk` with counter value `n` (from `allocate` or
/// `reserve`).
pub fn numbered(state_dir: &Path, n: u64, disk: &str) -> NewLayer {
    let id = format!("{n:08}-{disk}");
    NewLayer {
        path: layers_dir(state_dir).join(format!("{id}.qcow2")),
        id,
    }
}

/// The disk each layer file belongs to (a layer id is `<counter>-<disk>`),
/// in order; `None` if any file is not a recorded layer.
pub fn disks_of_layer_files(
    store: &Store,
    files: &[PathBuf],
) -> Result<Option<Vec<String>>, StoreError> {
    store.with_tx(|tx| {
        let mut out = Vec::new();
        for f in files {
            let id = layers::id_of_file_tx(tx, f)?;
            match id.as_deref().and_then(|i| i.split_once('-')) {
                Some((_, disk)) => out.push(disk.to_string()),
                None => return Ok(None),
            }
        }
        Ok(Some(out))
    })
}

/// Removes every layer nothing reaches any more: not a head, not a
/// snapshot's layer, not below one of those. Returns the files removed.
/// Rows go first (one transaction), files after: a crash in between leaves
/// only unreferenced files behind, never a reference to a missing file.
/// An image file that was the base of a removed layer goes too once no
/// layer and no VirtualImage has it any more (`image::release_file`).
pub fn collect_garbage(store: &Store) -> Result<Vec<PathBuf>, StoreError> {
    collect(store, false)
}

/// [`collect_garbage`], but a file some process still has open (a QEMU
/// whose node of a merged layer could not be deleted) is only forgotten,
/// not unlinked: the start-up sweep removes it once nobody holds it.
/// Returns the files unlinked.
pub fn collect_garbage_unless_open(store: &Store) -> Result<Vec<PathBuf>, StoreError> {
    collect(store, true)
}

fn collect(store: &Store, keep_open: bool) -> Result<Vec<PathBuf>, StoreError> {
    let (doomed, bases) = layers::forget_unreachable(store)?;
    let open = if keep_open && !doomed.is_empty() {
        open_files()
    } else {
        BTreeSet::new()
    };
    let doomed: Vec<PathBuf> = doomed.into_iter().filter(|p| !open.contains(p)).collect();
    for p in &doomed {
        let _ = std::fs::remove_file(p);
    }
    let mut freed = doomed;
    for base in bases {
        if crate::image::release_file(store, &base)? {
            freed.push(base);
        }
    }
    Ok(freed)
}

/// Removes layer files a crash left behind: in the layers directory, not
/// recorded in the store, and not open by any process (a QEMU that switched
/// to a cut's overlay just before the daemon died still has it open; the
/// next cut adopts it). Run at start-up, before anything creates layers.
pub fn sweep_orphans(store: &Store, state_dir: &Path) -> Result<Vec<PathBuf>, StoreError> {
    let mut known = layers::paths(store)?;
    // A cut's overlay may hold the only copy of the guest's latest writes
    // (QEMU switched to it, then exited while no daemon ran): the journal
    // settles it, the sweep never touches it.
    known.extend(crate::store::journals::all_paths(store)?);
    let Ok(entries) = std::fs::read_dir(layers_dir(state_dir)) else {
        return Ok(Vec::new());
    };
    let candidates: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "qcow2") && !known.contains(p))
        .collect();
    if candidates.is_empty() {
        return Ok(Vec::new());
    }
    let open = open_files();
    let mut removed = Vec::new();
    for p in candidates {
        if !open.contains(&p) && std::fs::remove_file(&p).is_ok() {
            removed.push(p);
        }
    }
    Ok(removed)
}

/// Every file any process has open, from `/proc/*/fd`.
pub(crate) fn open_files() -> BTreeSet<PathBuf> {
    open_files_except(None)
}

/// Every file a process other than `except` has open, from `/proc/*/fd`.
pub(crate) fn open_files_except(except: Option<u32>) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return out;
    };
    for p in procs.flatten() {
        if !p
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        if except.is_some_and(|pid| p.file_name().to_string_lossy() == pid.to_string()) {
            continue;
        }
        if let Ok(fds) = std::fs::read_dir(p.path().join("fd")) {
            for fd in fds.flatten() {
                if let Ok(target) = std::fs::read_link(fd.path()) {
                    out.insert(target);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::layers::drop_snapshot_layer;

    fn layer(store: &Store, dir: &Path, disk: &str) -> NewLayer {
        let l = allocate(store, dir, disk).unwrap();
        std::fs::create_dir_all(l.path.parent().unwrap()).unwrap();
        std::fs::write(&l.path, disk).unwrap();
        l
    }

    #[test]
    fn layer_files_name_their_disks() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("db")).unwrap();
        let a = layer(&store, dir.path(), "data-a");
        let b = layer(&store, dir.path(), "b-2");
        store
            .with_tx(|tx| {
                set_head_tx(tx, "data-a", &a, None)?;
                set_head_tx(tx, "b-2", &b, None)
            })
            .unwrap();
        assert_eq!(
            disks_of_layer_files(&store, &[b.path.clone(), a.path.clone()]).unwrap(),
            Some(vec!["b-2".to_string(), "data-a".to_string()])
        );
        let stranger = dir.path().join("elsewhere.qcow2");
        assert_eq!(
            disks_of_layer_files(&store, &[a.path, stranger]).unwrap(),
            None
        );
    }

    #[test]
    fn orphans_are_swept_unless_recorded_or_open() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("db")).unwrap();
        let kept = layer(&store, dir.path(), "d");
        store
            .with_tx(|tx| set_head_tx(tx, "d", &kept, None))
            .unwrap();
        let orphan = layer(&store, dir.path(), "d");
        let in_use = layer(&store, dir.path(), "d");
        let _held = std::fs::File::open(&in_use.path).unwrap();
        let removed = sweep_orphans(&store, dir.path()).unwrap();
        assert_eq!(removed, vec![orphan.path.clone()]);
        assert!(kept.path.exists() && in_use.path.exists() && !orphan.path.exists());
    }

    #[test]
    fn deleting_a_mid_chain_snapshot_keeps_what_others_need_and_frees_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("db")).unwrap();
        // base <- s1 <- s2 <- head
        let base = layer(&store, dir.path(), "d");
        let s1 = layer(&store, dir.path(), "d");
        let s2 = layer(&store, dir.path(), "d");
        store
            .with_tx(|tx| {
                set_head_tx(tx, "d", &base, None)?;
                set_head_tx(tx, "d", &s1, Some(&base.id))?;
                set_snapshot_layer_tx(tx, "snap1", &base.id)?;
                set_head_tx(tx, "d", &s2, Some(&s1.id))?;
                set_snapshot_layer_tx(tx, "snap2", &s1.id)?;
                Ok(())
            })
            .unwrap();
        drop_snapshot_layer(&store, "snap1").unwrap();
        assert!(
            collect_garbage(&store).unwrap().is_empty(),
            "the chain still needs base"
        );
        // A restored disk from snap2 keeps s1 (and base) alive after the disk goes.
        let r = layer(&store, dir.path(), "r");
        store
            .with_tx(|tx| set_head_tx(tx, "r", &r, Some(&s1.id)))
            .unwrap();
        drop_head(&store, "d").unwrap();
        drop_snapshot_layer(&store, "snap2").unwrap();
        let freed = collect_garbage(&store).unwrap();
        assert_eq!(freed, vec![s2.path.clone()]);
        assert!(base.path.exists() && s1.path.exists() && r.path.exists());
        drop_head(&store, "r").unwrap();
        let mut freed = collect_garbage(&store).unwrap();
        freed.sort();
        assert_eq!(freed.len(), 3);
        assert!(!base.path.exists() && !s1.path.exists() && !r.path.exists());
    }

    #[test]
    fn a_merged_layer_still_held_open_is_forgotten_but_not_unlinked() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("db")).unwrap();
        // base <- a <- b <- head, then head rebased onto base: a and b go.
        let base = layer(&store, dir.path(), "d");
        let a = layer(&store, dir.path(), "d");
        let b = layer(&store, dir.path(), "d");
        let top = layer(&store, dir.path(), "d");
        store
            .with_tx(|tx| {
                set_head_tx(tx, "d", &base, None)?;
                set_head_tx(tx, "d", &a, Some(&base.id))?;
                set_head_tx(tx, "d", &b, Some(&a.id))?;
                set_head_tx(tx, "d", &top, Some(&b.id))?;
                crate::store::layers::set_backing_tx(tx, &top.id, &base.id)
            })
            .unwrap();
        let _held = std::fs::File::open(&b.path).unwrap();
        let freed = collect_garbage_unless_open(&store).unwrap();
        assert_eq!(freed, vec![a.path.clone()]);
        assert!(b.path.exists(), "a process still holds it");
        assert!(
            store.with_tx(|tx| layer_tx(tx, &b.id)).unwrap().is_none(),
            "its row is gone: the start-up sweep removes the file"
        );
        assert!(base.path.exists() && top.path.exists());
    }

    fn image_object(
        name: &str,
        status: serde_json::Value,
    ) -> (hearth_api::Object, serde_json::Value) {
        let obj = hearth_api::parse_documents(
            &format!("apiVersion: hearth.dev/v1alpha1\nkind: VirtualImage\nmetadata: {{name: {name}}}\nspec: {{source: {{file: /srv/x.qcow2}}}}\n"),
            "t",
        )
        .unwrap()
        .remove(0);
        (obj, status)
    }

    #[test]
    fn an_image_file_lives_while_an_image_or_a_layer_made_from_it_does() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("db")).unwrap();
        let images = dir.path().join("images");
        std::fs::create_dir_all(&images).unwrap();
        let hex = "ab".repeat(32);
        let file = images.join(format!("sha256-{hex}.qcow2"));
        std::fs::write(&file, b"image").unwrap();
        let (obj, status) = image_object(
            "base",
            serde_json::json!({"phase": "Ready", "path": file, "digest": format!("sha256:{hex}")}),
        );
        store.put_objects(&[obj]).unwrap();
        store
            .update_status::<serde_json::Value, _>(hearth_api::Kind::VirtualImage, "base", |s| {
                *s = status
            })
            .unwrap();
        // disk <- its head, made from the image; a snapshot keeps the bottom.
        let bottom = layer(&store, dir.path(), "d");
        let top = layer(&store, dir.path(), "d");
        store
            .with_tx(|tx| {
                set_head_tx(tx, "d", &bottom, None)?;
                set_layer_base_tx(tx, &bottom.id, &file)?;
                set_head_tx(tx, "d", &top, Some(&bottom.id))?;
                set_snapshot_layer_tx(tx, "s", &bottom.id)
            })
            .unwrap();
        assert!(
            !crate::image::release_file(&store, &file).unwrap(),
            "in use"
        );
        // The image object goes: the layers still need the file.
        store
            .remove(hearth_api::Kind::VirtualImage, "base")
            .unwrap();
        assert!(!crate::image::release_file(&store, &file).unwrap());
        drop_head(&store, "d").unwrap();
        let freed = collect_garbage(&store).unwrap();
        assert_eq!(
            freed,
            vec![top.path.clone()],
            "the snapshot keeps the bottom"
        );
        assert!(file.exists());
        drop_snapshot_layer(&store, "s").unwrap();
        let mut freed = collect_garbage(&store).unwrap();
        freed.sort();
        let mut want = vec![bottom.path.clone(), file.clone()];
        want.sort();
        assert_eq!(freed, want, "the last layer takes the image file with it");
        assert!(!file.exists());
    }

    #[test]
    fn only_image_store_files_are_ever_released() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("db")).unwrap();
        let users = dir.path().join("debian.qcow2");
        std::fs::write(&users, b"a user's base image").unwrap();
        let l = layer(&store, dir.path(), "d");
        store
            .with_tx(|tx| {
                set_head_tx(tx, "d", &l, None)?;
                set_layer_base_tx(tx, &l.id, &users)
            })
            .unwrap();
        drop_head(&store, "d").unwrap();
        collect_garbage(&store).unwrap();
        assert!(users.exists());
        assert!(!crate::image::release_file(&store, &users).unwrap());
    }
}
