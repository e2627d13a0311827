//! The journal of cut overlays: every overlay a cut makes is recorded in
//! the store *before* its file or its QEMU node exists, under names that
//! never repeat (the cut id comes from a durable counter). Whatever happens
//! next (a crash, a timeout, a reply that never came), a recorded overlay is
//! later *settled* by looking at QEMU, never by guessing:
//!
//! - QEMU runs and the disk's device writes to the overlay: it is the disk's
//!   new head (adopted);
//! - QEMU runs and does not use it: its node is deleted (`blockdev-del`,
//!   which QEMU refuses for a node in use) and only then the file unlinked;
//! - QEMU is gone: a live overlay is adopted all the same. It holds either
//!   nothing (the switch never happened, so it reads exactly like the layer
//!   below) or the writes made after the switch; adopting loses neither. An
//!   offline overlay (no node) was never written by anyone and is removed;
//! - QEMU runs but cannot be asked: the record stays, nothing is unlinked,
//!   and a later settle decides.

use std::path::PathBuf;

use hearth_api::{Kind, VirtualDiskStatus};
use hearth_qemu::qmp::QmpError;
use serde_json::{Value, json};

use crate::store::journals::{self, Of};
use crate::store::layers::{NewLayer, set_head_tx};
use crate::store::{Store, StoreError};
use crate::vm::live::LiveVm;

const QMP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Why an overlay could not be read, removed or settled.
#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("forgetting the ahead overlay: {0}")]
    ForgetAhead(#[source] StoreError),
    #[error("no QMP connection to the VM")]
    NoQmp,
    /// A QMP command failed (named as QEMU knows it).
    #[error("{command}: {source}")]
    Qmp {
        command: &'static str,
        source: QmpError,
    },
    #[error("removing node {node}: {source}")]
    RemoveNode { node: String, source: QmpError },
    #[error("QEMU has no node {0}")]
    NoNode(String),
    #[error("the overlay {} of snapshot cut {cut} of VirtualDisk {disk:?} is not settled: {why}", path.display())]
    Unsettled {
        path: PathBuf,
        cut: u64,
        disk: String,
        why: String,
    },
}

impl OverlayError {
    fn qmp(command: &'static str) -> impl FnOnce(QmpError) -> OverlayError {
        move |source| OverlayError::Qmp { command, source }
    }
}

/// The snapshot actor still reports its errors as text.
impl From<OverlayError> for String {
    fn from(e: OverlayError) -> String {
        e.to_string()
    }
}

pub use crate::store::journals::{Ahead, Entry, Overlay, claim_tx, record_tx};

/// The overlays of `E`'s journal that a target's actor made.
pub fn of_target<E: Entry>(store: &Store, target: &str) -> Result<Vec<E>, StoreError> {
    journals::select(store, Of::Target(target))
}

/// The overlays of `E`'s journal over `disk` (an ahead one: one at most).
pub fn of_disk<E: Entry>(store: &Store, disk: &str) -> Result<Vec<E>, StoreError> {
    journals::select(store, Of::Disk(disk))
}

/// The QEMU node name of ahead overlay `id` on device `index`; never the
/// name of a cut's own overlay (`h{cut}d{index}`).
pub fn ahead_node(id: u64, index: usize) -> String {
    format!("a{id}d{index}")
}

/// Why ahead overlay `a` cannot serve a cut of its disk now, if it cannot:
/// the rule, pure. `head`: the disk's recorded head; `node_size`: the
/// virtual size of the node QEMU has under `a.node` (`None`: QEMU has no
/// such node, e.g. the VM was restarted since); `capacity`: the device's
/// size now.
pub fn unusable(a: &Ahead, head: &str, node_size: Option<u64>, capacity: u64) -> Option<String> {
    match node_size {
        _ if a.base != head => Some(format!(
            "it lies over layer {}, and the disk's head is {head} now",
            a.base
        )),
        None => Some(format!("the running QEMU has no node {}", a.node)),
        Some(n) if n != capacity => Some(format!("it is {n} bytes and the disk {capacity} now")),
        Some(_) => None,
    }
}

/// Removes ahead overlay `a`: its QEMU node first when a QEMU of its VM
/// runs (a node QEMU does not know counts as deleted), then its record,
/// then its file. With QEMU running and the node not deletable, nothing
/// else is touched and the reason comes back.
pub async fn remove_ahead(
    store: &Store,
    live: Option<&LiveVm>,
    a: &Ahead,
) -> Result<(), OverlayError> {
    if let Some(l) = live {
        delete_node(l, &a.node, &a.path).await?;
    }
    forget_ahead(store, a)
}

/// [`remove_ahead`] when no QEMU has its node: the record, then the file
/// (a crash in between leaves an unrecorded file nothing has open, which
/// the start-up sweep removes).
pub fn forget_ahead(store: &Store, a: &Ahead) -> Result<(), OverlayError> {
    store
        .with_tx(|tx| journals::forget_tx(tx, a).map(drop))
        .map_err(OverlayError::ForgetAhead)?;
    let _ = std::fs::remove_file(&a.path);
    tracing::info!(disk = %a.disk, node = %a.node, path = %a.path.display(), "removed an ahead overlay");
    Ok(())
}

/// Makes `o` its disk's head, in a store transaction of the caller's.
pub fn adopt_tx(tx: &rusqlite::Transaction<'_>, o: &Overlay) -> Result<(), StoreError> {
    let new = NewLayer {
        id: o.layer.clone(),
        path: o.path.clone(),
    };
    set_head_tx(tx, &o.disk, &new, Some(&o.base))?;
    let path = o.path.clone();
    Store::update_status_tx::<VirtualDiskStatus, _>(tx, Kind::VirtualDisk, &o.disk, |s| {
        s.path = Some(path);
        // One more layer to read through, right with the switch.
        s.chain_length = s.chain_length.map(|n| n + 1);
    })?;
    journals::forget_tx(tx, o)?;
    Ok(())
}

/// What a settle did with one overlay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settled {
    Adopted,
    Removed,
    /// QEMU could not be asked: the record stays.
    Unresolved(String),
}

/// QEMU's view of one device: the node it writes to.
pub struct Graph {
    /// `query-block`'s answer.
    block: Value,
}

impl Graph {
    pub async fn read(live: &LiveVm) -> Result<Graph, OverlayError> {
        Self::read_within(live, QMP_TIMEOUT).await
    }

    /// [`Graph::read`], waiting at most `timeout` for QEMU's answer.
    pub async fn read_within(
        live: &LiveVm,
        timeout: std::time::Duration,
    ) -> Result<Graph, OverlayError> {
        let qmp = live.qmp.as_ref().ok_or(OverlayError::NoQmp)?;
        Self::query(qmp, timeout).await
    }

    /// [`Graph::read_within`] on any monitor.
    pub async fn query<M: hearth_qemu::seam::Monitor>(
        qmp: &M,
        timeout: std::time::Duration,
    ) -> Result<Graph, OverlayError> {
        let block = qmp
            .query_block(timeout)
            .await
            .map_err(OverlayError::qmp("query-block"))?;
        Ok(Graph { block })
    }

    /// The `inserted` image of device number `index`.
    pub fn device(&self, index: usize) -> Option<&Value> {
        let device = hearth_qemu::cmdline::disk_device_id(index);
        self.block
            .as_array()?
            .iter()
            .find(|b| {
                b.get("qdev").and_then(Value::as_str).is_some_and(|q| {
                    q == device || q.ends_with(&format!("/{device}/virtio-backend"))
                }) || b.get("device").and_then(Value::as_str) == Some(device.as_str())
            })?
            .get("inserted")
    }

    /// The node device number `index` writes to.
    pub fn top_node(&self, index: usize) -> Option<&str> {
        self.device(index)?.get("node-name")?.as_str()
    }
}

/// The device index of `disk` in the running QEMU: from what the process
/// was started with, never from the current spec (which may have changed).
pub fn device_index(live: &LiveVm, disk: &str) -> Option<usize> {
    live.record.disk_names.iter().position(|d| d == disk)
}

/// Settles `overlays` against `live` (the running QEMU of their VM) or,
/// with `None`, knowing that no QEMU uses them.
pub async fn settle(
    store: &Store,
    live: Option<&LiveVm>,
    overlays: &[Overlay],
) -> Vec<(Overlay, Settled)> {
    let mut out = Vec::new();
    let graph = match live {
        Some(l) => Some(Graph::read(l).await),
        None => None,
    };
    for o in overlays {
        let seen = match (&graph, live) {
            (None, _) | (_, None) => Seen::QemuGone,
            (Some(Err(e)), _) => Seen::Unknown(e.to_string()),
            (Some(Ok(g)), Some(l)) => {
                let top = device_index(l, &o.disk).and_then(|i| g.top_node(i));
                if top.is_some() && top == o.node.as_deref() {
                    Seen::InUse
                } else {
                    Seen::NotInUse
                }
            }
        };
        // With QEMU gone a live overlay is adopted only as a whole image:
        // QEMU formats it (`blockdev-create`) after hearthd made the empty
        // file, and a file left empty or half-formatted by a crash in
        // between was never switched to.
        let file = match (&seen, o.node.is_some()) {
            (Seen::QemuGone, true) => complete_overlay(&o.path).await,
            _ => o.path.exists(),
        };
        let settled = match decide(o.node.is_some(), file, seen) {
            Decision::Adopt => adopt(store, o),
            Decision::Remove => remove(store, o),
            Decision::DeleteNodeThenRemove => match (live, &o.node) {
                (Some(l), Some(node)) => delete_node(l, node, &o.path).await.map_or_else(
                    |e| Settled::Unresolved(e.to_string()),
                    |()| remove(store, o),
                ),
                _ => remove(store, o),
            },
            Decision::Keep(why) => Settled::Unresolved(why),
        };
        if !matches!(settled, Settled::Removed) || o.node.is_some() {
            tracing::info!(cut = o.cut, disk = %o.disk, path = %o.path.display(), ?settled, "settled a cut overlay");
        }
        out.push((o.clone(), settled));
    }
    out
}

/// The overlay file is a complete qcow2 image: its header names its
/// backing file, the last thing formatting writes.
async fn complete_overlay(path: &std::path::Path) -> bool {
    if !path.exists() {
        return false;
    }
    match hearth_qemu::img::info(path).await {
        Ok(i) => i.format == "qcow2" && i.backing_filename.is_some() && !i.corrupt,
        Err(_) => false,
    }
}

/// What QEMU shows of one overlay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seen {
    /// The disk's device writes to the overlay's node.
    InUse,
    /// QEMU runs and the device writes elsewhere.
    NotInUse,
    /// No QEMU of the VM runs.
    QemuGone,
    /// QEMU runs but its block graph could not be read.
    Unknown(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// The overlay is the disk's head.
    Adopt,
    /// Nobody uses or ever wrote it: forget it, unlink the file.
    Remove,
    /// Delete its QEMU node first (QEMU refuses for a node in use), then
    /// remove it.
    DeleteNodeThenRemove,
    /// Decide later; touch nothing.
    Keep(String),
}

/// The settling rule, pure (the freeze coordinator's model uses it too).
/// `live`: the overlay has a QEMU node (a live cut's); `file`: its file
/// exists.
pub fn decide(live: bool, file: bool, seen: Seen) -> Decision {
    match (live, seen) {
        // An offline overlay is only ever used through the store's commit.
        (false, _) => Decision::Remove,
        (true, Seen::InUse) => Decision::Adopt,
        (true, Seen::NotInUse) => Decision::DeleteNodeThenRemove,
        // No QEMU: empty (the switch never ran) or holding the writes made
        // after it; adopting keeps both right.
        (true, Seen::QemuGone) if file => Decision::Adopt,
        (true, Seen::QemuGone) => Decision::Remove,
        (true, Seen::Unknown(why)) => Decision::Keep(why),
    }
}

fn adopt(store: &Store, o: &Overlay) -> Settled {
    match store.with_tx(|tx| adopt_tx(tx, o)) {
        Ok(()) => Settled::Adopted,
        Err(e) => Settled::Unresolved(format!("recording the adopted overlay: {e}")),
    }
}

/// Forgets the record, then unlinks the file: a crash in between leaves an
/// unrecorded file that nothing has open, which the start-up sweep removes.
fn remove(store: &Store, o: &Overlay) -> Settled {
    let r = store.with_tx(|tx| journals::forget_tx(tx, o));
    match r {
        Ok(_) => {
            let _ = std::fs::remove_file(&o.path);
            Settled::Removed
        }
        Err(e) => Settled::Unresolved(format!("forgetting the overlay: {e}")),
    }
}

/// The QEMU `file` node under a live overlay's qcow2 node `node`: added on
/// its own (the overlay is formatted on it), so it is deleted on its own.
pub fn file_node(node: &str) -> String {
    format!("{node}f")
}

/// The `file` node under format node `node`, by hearth's node names: a
/// launch's top `disk<i>` (`file-<i>`), its backing layers `back-<i>-<d>`
/// (`file-<i>-<d>`), a cut overlay `h<cut>d<i>` (`h<cut>d<i>f`) and one
/// made ahead `a<id>d<i>` (`a<id>d<i>f`).
pub fn file_child(node: &str) -> Option<String> {
    use hearth_qemu::cmdline::{backing_node_names, file_node_name};
    if let Some(rest) = node.strip_prefix("back-") {
        let (i, d) = rest.split_once('-')?;
        return Some(backing_node_names(i.parse().ok()?, d.parse().ok()?).1);
    }
    if let Some(i) = node.strip_prefix("disk") {
        return Some(file_node_name(i.parse().ok()?));
    }
    if (node.starts_with('h') || node.starts_with('a')) && !node.ends_with('f') {
        return Some(file_node(node));
    }
    None
}

/// One node of QEMU's block graph (`query-named-block-nodes`).
#[derive(Clone, Debug)]
pub struct NodeInfo {
    pub node: String,
    pub driver: String,
    /// The file it reads, resolved through the fd sets.
    pub file: String,
    /// Its virtual size, as QEMU reports it.
    pub size: Option<u64>,
    /// Whether QEMU has it open read-only.
    pub read_only: bool,
}

/// Every named node with the file it reads. A format node whose backing was
/// given explicitly reports a `json:{...}` filename holding its whole chain,
/// which QEMU cuts off at 4 KiB (about 45 layers) so it no longer parses:
/// such a node's file is read from its `file` node ([`file_child`]).
pub async fn named_nodes(qmp: &hearth_qemu::qmp::QmpClient) -> Result<Vec<NodeInfo>, OverlayError> {
    let fdsets = hearth_qemu::qmp::fdsets(qmp, QMP_TIMEOUT)
        .await
        .map_err(OverlayError::qmp("query-fdsets"))?;
    let nodes = qmp
        .execute(
            "query-named-block-nodes",
            Some(json!({"flat": true})),
            QMP_TIMEOUT,
        )
        .await
        .map_err(OverlayError::qmp("query-named-block-nodes"))?;
    let mut out: Vec<NodeInfo> = nodes
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| {
            Some(NodeInfo {
                node: n.get("node-name")?.as_str()?.to_string(),
                driver: n.get("drv")?.as_str()?.to_string(),
                file: hearth_qemu::qmp::resolve_filename(n.get("file")?.as_str()?, &fdsets),
                size: n.pointer("/image/virtual-size").and_then(Value::as_u64),
                read_only: n.get("ro").and_then(Value::as_bool).unwrap_or(false),
            })
        })
        .collect();
    let by_name: std::collections::HashMap<String, String> = out
        .iter()
        .map(|n| (n.node.clone(), n.file.clone()))
        .collect();
    for n in &mut out {
        if n.file.starts_with("json:")
            && let Some(f) = file_child(&n.node).and_then(|c| by_name.get(&c))
        {
            n.file = f.clone();
        }
    }
    Ok(out)
}

/// The file format node `node` reads (see [`named_nodes`]).
pub async fn node_file(
    qmp: &hearth_qemu::qmp::QmpClient,
    node: &str,
) -> Result<String, OverlayError> {
    named_nodes(qmp)
        .await?
        .into_iter()
        .find(|n| n.node == node)
        .map(|n| n.file)
        .ok_or_else(|| OverlayError::NoNode(node.to_string()))
}

/// The id of the `blockdev-create` job that formats overlay node `node`.
pub fn create_job(node: &str) -> String {
    format!("{node}-create")
}

/// Deletes an overlay's nodes QEMU does not use: the qcow2 node, then the
/// file node under it with the fd set its file came in. QEMU refuses to
/// delete a node that has users, so this can never pull a disk out from
/// under the guest. A node QEMU does not know (never added) counts as
/// deleted.
async fn delete_node(
    live: &LiveVm,
    node: &str,
    path: &std::path::Path,
) -> Result<(), OverlayError> {
    let qmp = live.qmp.as_ref().ok_or(OverlayError::NoQmp)?;
    delete_nodes(qmp, node, path).await
}

/// [`delete_node`] on any monitor.
pub(crate) async fn delete_nodes<M: hearth_qemu::seam::Monitor>(
    qmp: &M,
    node: &str,
    path: &std::path::Path,
) -> Result<(), OverlayError> {
    // A formatting job that a crash left concluded but not dismissed holds
    // nothing, but would stay listed in QEMU: dismiss it (best effort; QEMU
    // refuses for a job that still runs, and then the file node is in use
    // and its deletion below is refused too, so a later settle decides).
    let _ = qmp.job_dismiss(&create_job(node), QMP_TIMEOUT).await;
    hearth_qemu::qmp::remove_node(qmp, node, None, QMP_TIMEOUT)
        .await
        .map_err(|source| OverlayError::RemoveNode {
            node: node.to_string(),
            source,
        })?;
    hearth_qemu::qmp::remove_node(qmp, &file_node(node), Some(path), QMP_TIMEOUT)
        .await
        .map_err(|source| OverlayError::RemoveNode {
            node: file_node(node),
            source,
        })
}

/// Settles every overlay of `disks` when no QEMU of theirs runs: before a
/// VM is launched (so it boots from the real head), restored or deleted.
pub async fn settle_offline(store: &Store, disks: &[String]) -> Result<(), OverlayError> {
    for disk in disks {
        // An ahead overlay nobody switched to: no QEMU, nothing to keep.
        if let Some(a) = of_disk::<Ahead>(store, disk)?.pop() {
            remove_ahead(store, None, &a).await?;
        }
        let overlays = of_disk::<Overlay>(store, disk)?;
        for (o, s) in settle(store, None, &overlays).await {
            if let Settled::Unresolved(why) = s {
                return Err(OverlayError::Unsettled {
                    path: o.path,
                    cut: o.cut,
                    disk: o.disk,
                    why,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::storage::{allocate, head, set_head_tx, sweep_orphans};

    /// The ahead overlay of `disk`, if one is recorded.
    fn ahead_of_disk(store: &Store, disk: &str) -> Result<Option<Ahead>, StoreError> {
        Ok(of_disk::<Ahead>(store, disk)?.pop())
    }

    /// A store with disk `d` whose head is a real file, and a recorded
    /// overlay of cut 7 over it (`live`: with a QEMU node name).
    fn setup(dir: &std::path::Path, live: bool, create: bool) -> (Store, Overlay) {
        let store = Store::open(&dir.join("db")).unwrap();
        let base = allocate(&store, dir, "d").unwrap();
        std::fs::create_dir_all(base.path.parent().unwrap()).unwrap();
        std::fs::write(&base.path, "base").unwrap();
        store
            .with_tx(|tx| set_head_tx(tx, "d", &base, None))
            .unwrap();
        let new = allocate(&store, dir, "d").unwrap();
        let o = Overlay {
            cut: 7,
            target: "vm/v".into(),
            disk: "d".into(),
            layer: new.id,
            path: new.path,
            node: live.then(|| "h7d0".to_string()),
            base: base.id,
        };
        store.with_tx(|tx| record_tx(tx, &o)).unwrap();
        if create {
            // A real overlay, as QEMU formats it, over the head.
            let out = std::process::Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2", "-u", "-F", "qcow2", "-b"])
                .arg(&base.path)
                .arg(&o.path)
                .arg("64M")
                .output()
                .expect("qemu-img (apt-get install qemu-utils)");
            assert!(out.status.success(), "{out:?}");
        }
        (store, o)
    }

    #[tokio::test]
    async fn an_overlay_file_qemu_never_formatted_is_removed_when_qemu_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let (store, o) = setup(dir.path(), true, false);
        // hearthd made the empty file, then died before QEMU formatted it,
        // and QEMU exited: nobody ever switched to it.
        std::fs::write(&o.path, "").unwrap();
        let before = head(&store, "d").unwrap().unwrap();
        let settled = settle(&store, None, std::slice::from_ref(&o)).await;
        assert_eq!(settled[0].1, Settled::Removed);
        assert_eq!(head(&store, "d").unwrap().unwrap(), before);
        assert!(!o.path.exists(), "the empty file is unlinked");
        assert!(of_disk::<Overlay>(&store, "d").unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_switched_overlay_whose_qemu_exited_is_kept_by_the_sweep_and_becomes_the_head() {
        let dir = tempfile::tempdir().unwrap();
        let (store, o) = setup(dir.path(), true, true);
        // The daemon died after the switch, QEMU exited meanwhile: the
        // start-up sweep must not take the only copy of the latest writes.
        let swept = sweep_orphans(&store, dir.path()).unwrap();
        assert!(swept.is_empty(), "{swept:?}");
        assert!(o.path.exists());
        let settled = settle(&store, None, std::slice::from_ref(&o)).await;
        assert_eq!(settled[0].1, Settled::Adopted);
        let h = head(&store, "d").unwrap().unwrap();
        assert_eq!(
            (h.id, h.path, h.backing),
            (o.layer.clone(), o.path.clone(), Some(o.base.clone()))
        );
        assert!(
            of_disk::<Overlay>(&store, "d").unwrap().is_empty(),
            "the record is settled"
        );
    }

    #[tokio::test]
    async fn an_offline_overlay_that_was_never_committed_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let (store, o) = setup(dir.path(), false, true);
        let before = head(&store, "d").unwrap().unwrap();
        settle_offline(&store, &["d".to_string()]).await.unwrap();
        assert!(!o.path.exists());
        assert_eq!(head(&store, "d").unwrap().unwrap(), before);
        assert!(of_disk::<Overlay>(&store, "d").unwrap().is_empty());
    }

    /// An ahead overlay of disk `d` over its head (as in `setup`), its file
    /// made when `create`.
    fn ahead(store: &Store, dir: &std::path::Path, create: bool) -> Ahead {
        let h = head(store, "d").unwrap().unwrap();
        let a = store
            .with_tx(|tx| {
                let id = Store::next_counter_tx(tx, "ahead")?;
                let new = crate::snapshot::storage::allocate_tx(tx, dir, "d")?;
                let a = Ahead {
                    id,
                    target: "vm/v".into(),
                    disk: "d".into(),
                    layer: new.id,
                    path: new.path,
                    node: ahead_node(id, 0),
                    base: h.id.clone(),
                };
                record_tx(tx, &a)?;
                Ok(a)
            })
            .unwrap();
        if create {
            std::fs::write(&a.path, "formatted").unwrap();
        }
        a
    }

    #[test]
    fn an_ahead_overlay_serves_only_over_the_head_in_this_qemu_at_the_devices_size() {
        let a = Ahead {
            id: 3,
            target: "vm/v".into(),
            disk: "d".into(),
            layer: "00000009-d".into(),
            path: "/l/00000009-d.qcow2".into(),
            node: ahead_node(3, 0),
            base: "00000008-d".into(),
        };
        assert_eq!(unusable(&a, "00000008-d", Some(64 << 20), 64 << 20), None);
        // A cut, a restore or a rollback moved the head.
        let why = unusable(&a, "00000010-d", Some(64 << 20), 64 << 20).unwrap();
        assert!(why.contains("head is 00000010-d"), "{why}");
        // The VM restarted: the new QEMU has no such node.
        let why = unusable(&a, "00000008-d", None, 64 << 20).unwrap();
        assert!(why.contains("no node a3d0"), "{why}");
        // The disk was resized.
        let why = unusable(&a, "00000008-d", Some(64 << 20), 128 << 20).unwrap();
        assert!(why.contains("134217728"), "{why}");
        // Node names never meet a cut's own (h{cut}d{index}).
        assert_ne!(ahead_node(3, 0), "h3d0");
    }

    #[tokio::test]
    async fn an_ahead_overlay_is_removed_offline_never_adopted() {
        let dir = tempfile::tempdir().unwrap();
        let (store, o) = setup(dir.path(), true, true);
        // The cut overlay of `setup` is settled as before (adopted: QEMU
        // may have switched to it); the ahead one over the new head is not.
        settle(&store, None, std::slice::from_ref(&o)).await;
        let a = ahead(&store, dir.path(), true);
        assert!(
            journals::all_paths(&store).unwrap().contains(&a.path),
            "the sweep keeps it"
        );
        let before = head(&store, "d").unwrap().unwrap();
        settle_offline(&store, &["d".to_string()]).await.unwrap();
        assert_eq!(head(&store, "d").unwrap().unwrap(), before);
        assert!(!a.path.exists(), "its file is unlinked");
        assert_eq!(ahead_of_disk(&store, "d").unwrap(), None);
    }

    #[tokio::test]
    async fn a_claimed_ahead_overlay_is_the_cuts_and_cannot_be_claimed_twice() {
        let dir = tempfile::tempdir().unwrap();
        let (store, o) = setup(dir.path(), true, true);
        settle(&store, None, std::slice::from_ref(&o)).await;
        let a = ahead(&store, dir.path(), true);
        let claimed = store.with_tx(|tx| claim_tx(tx, &a, 12)).unwrap();
        assert_eq!(
            (claimed.cut, claimed.node.as_deref(), &claimed.base),
            (12, Some(a.node.as_str()), &a.base)
        );
        assert_eq!(ahead_of_disk(&store, "d").unwrap(), None);
        assert_eq!(of_disk::<Overlay>(&store, "d").unwrap(), vec![claimed]);
        // Settled from now on as any cut's overlay; a removed (or already
        // claimed) ahead record is never claimed.
        assert!(store.with_tx(|tx| claim_tx(tx, &a, 13)).is_err());
        assert_eq!(
            of_disk::<Overlay>(&store, "d").unwrap().len(),
            1,
            "the failed claim wrote nothing"
        );
    }

    #[tokio::test]
    async fn a_recorded_overlay_whose_file_was_never_made_is_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let (store, o) = setup(dir.path(), true, false);
        let before = head(&store, "d").unwrap().unwrap();
        let settled = settle(&store, None, std::slice::from_ref(&o)).await;
        assert_eq!(settled[0].1, Settled::Removed);
        assert_eq!(head(&store, "d").unwrap().unwrap(), before);
    }

    #[test]
    fn every_format_node_hearth_names_has_its_file_node() {
        assert_eq!(file_child("disk0").as_deref(), Some("file-0"));
        assert_eq!(file_child("back-1-12").as_deref(), Some("file-1-12"));
        assert_eq!(file_child("h42d3").as_deref(), Some("h42d3f"));
        assert_eq!(
            file_child(&ahead_node(7, 1)).as_deref(),
            Some(file_node(&ahead_node(7, 1)).as_str())
        );
        assert_eq!(file_child("h42d3f"), None, "a file node has no file child");
        assert_eq!(file_child("seed"), None);
    }
}
