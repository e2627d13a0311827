//! One resync of every disk: the store read in a few queries, only the
//! disks it contradicts woken, the allocated bytes of a bounded number of
//! disks at rest refreshed round robin (docs/reconciler.md "Disks").

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

use hearth_api::{DiskPhase, Kind, VirtualDiskStatus};
use rusqlite::params;

use super::files::allocated_bytes;
use super::plan::{Shape, around, children_of};
use super::{AtRest, QuietPass, REFRESHES_PER_RESYNC};
use crate::context::Context;
use crate::snapshot::compaction;
use crate::store::{Store, StoreError};

/// A pass over the disks that finds the store unwritten since the last one,
/// which found every disk at rest, reads nothing; every this many resyncs
/// one reads everything anyway.
const FULL_PASS_EVERY: u32 = 6;

/// A disk as one resync reads it from the store.
struct Row {
    name: String,
    deleting: bool,
    generation: u64,
    status: VirtualDiskStatus,
}

/// Everything one resync of the disks reads: a few queries, whatever the
/// number of disks.
struct View {
    disks: Vec<Row>,
    /// Each disk's head: its layer id and file.
    heads: HashMap<String, (String, PathBuf)>,
    /// The VM that uses each disk, as `Context::vms_using_disk` puts first.
    users: HashMap<String, String>,
    /// Disks with a recorded merge.
    compacting: HashSet<String>,
}

impl View {
    fn read(store: &Store) -> Result<View, StoreError> {
        let (disks, heads, running, listed, compacting) = store.with_tx(|tx| {
            let mut stmt = tx.prepare(
                "SELECT name, deleting, json_extract(body, '$.metadata.generation'), status
                 FROM objects WHERE kind = ?1 ORDER BY name",
            )?;
            let disks = stmt
                .query_map(params![Kind::VirtualDisk.as_str()], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, bool>(1)?,
                        r.get::<_, Option<i64>>(2)?,
                        r.get::<_, String>(3)?,
                    ))
                })?
                .collect::<Result<Vec<_>, _>>()?;
            let mut stmt = tx.prepare(
                "SELECT h.disk, l.id, l.path FROM heads h JOIN layers l ON l.id = h.layer",
            )?;
            let heads = stmt
                .query_map([], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        (
                            r.get::<_, String>(1)?,
                            PathBuf::from(r.get::<_, String>(2)?),
                        ),
                    ))
                })?
                .collect::<Result<HashMap<_, _>, _>>()?;
            let mut stmt = tx.prepare("SELECT record FROM runtime ORDER BY vm")?;
            let running = stmt
                .query_map([], |r| r.get::<_, String>(0))?
                .collect::<Result<Vec<_>, _>>()?;
            // Each VM's disks in spec order, VMs by name: read by SQLite,
            // not by parsing every VM here.
            let mut stmt = tx.prepare(
                "SELECT o.name, json_extract(d.value, '$.virtualDiskName')
                 FROM objects o, json_each(o.body, '$.spec.disks') d
                 WHERE o.kind = ?1 ORDER BY o.name, d.key",
            )?;
            let listed = stmt
                .query_map(params![Kind::VirtualMachine.as_str()], |r| {
                    Ok((r.get::<_, String>(0)?, r.get::<_, Option<String>>(1)?))
                })?
                .collect::<Result<Vec<_>, _>>()?;
            let mut stmt = tx.prepare("SELECT DISTINCT disk FROM compactions")?;
            let compacting = stmt
                .query_map([], |r| r.get::<_, String>(0))?
                .collect::<Result<HashSet<_>, _>>()?;
            Ok((disks, heads, running, listed, compacting))
        })?;
        let disks = disks
            .into_iter()
            .map(|(name, deleting, generation, status)| Row {
                name,
                deleting,
                generation: generation.and_then(|g| u64::try_from(g).ok()).unwrap_or(0),
                status: serde_json::from_str::<Option<VirtualDiskStatus>>(&status)
                    .ok()
                    .flatten()
                    .unwrap_or_default(),
            })
            .collect();
        // First the VMs whose running QEMU has the disk, then those whose
        // spec lists it.
        let mut users: HashMap<String, String> = HashMap::new();
        for text in running {
            let Ok(record) = serde_json::from_str::<crate::runtime::RuntimeRecord>(&text) else {
                continue;
            };
            if hearth_qemu::process::is_alive(&record.process) {
                for d in &record.disk_names {
                    users.entry(d.clone()).or_insert_with(|| record.vm.clone());
                }
            }
        }
        for (vm, disk) in listed {
            if let Some(disk) = disk {
                users.entry(disk).or_insert(vm);
            }
        }
        Ok(View {
            disks,
            heads,
            users,
            compacting,
        })
    }
}

/// One resync of every disk (docs/reconciler.md "Disks"): returns the disks
/// to reconcile, those whose status the store contradicts (or that are not
/// Ready, or being deleted). A disk at rest costs its share of a few
/// queries and nothing else: its compaction plan is made again only if its
/// chain changed since the last one (its actor is asked again while that
/// plan has merges left), and the files of at most
/// [`REFRESHES_PER_RESYNC`] disks are looked at (`stat`).
pub fn resync(ctx: &Arc<Context>) -> Result<Vec<String>, StoreError> {
    let started = std::time::Instant::now();
    // Every write goes through the store's writing connection, which
    // counts them: unwritten since a pass that found every disk at rest,
    // the store would say the same again. (A QEMU that dies unnoticed is
    // found by its VM's own resync, which writes.)
    let writes = ctx.store.writes();
    {
        let mut quiet = ctx.disks.quiet.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(q) = quiet.as_mut()
            && q.writes == writes
            && q.skipped + 1 < FULL_PASS_EVERY
        {
            q.skipped += 1;
            refresh(ctx, &q.at_rest);
            return Ok(Vec::new());
        }
        *quiet = None;
    }
    let view = View::read(&ctx.store)?;
    let chains = compaction::chains(&ctx.store)?;
    let children = children_of(&chains);
    let mut wake = Vec::new();
    let mut at_rest: Vec<AtRest> = Vec::new();
    let mut to_compact = Vec::new();
    {
        let mut planned = ctx.disks.planned.lock().unwrap_or_else(|p| p.into_inner());
        let names: HashSet<&str> = view.disks.iter().map(|d| d.name.as_str()).collect();
        planned.retain(|d, _| names.contains(d.as_str()));
        for d in &view.disks {
            let Some((head, path)) = view.heads.get(&d.name) else {
                wake.push(d.name.clone());
                continue;
            };
            let sub = around(&chains, &children, head);
            let s = &d.status;
            let contradicted = d.deleting
                || s.phase != DiskPhase::Ready
                || s.path.as_deref() != Some(path.as_path())
                || s.observed_generation != d.generation
                || s.last_error.is_some()
                || s.attached_to.as_ref() != view.users.get(&d.name)
                || s.chain_length != u32::try_from(sub.chain(head).len()).ok();
            if contradicted {
                wake.push(d.name.clone());
                continue;
            }
            let shape = Shape::of(&sub, head);
            let work = match planned.get(&d.name) {
                Some((seen, work)) if *seen == shape => *work,
                _ => {
                    let work = !compaction::plan(&sub, head).is_empty()
                        || view.compacting.contains(&d.name);
                    planned.insert(d.name.clone(), (shape, work));
                    work
                }
            };
            // Merges left to do are asked for again each resync, as before
            // the plan was remembered: the actor may have yielded to a stop
            // or a start, or waits out a failed merge.
            if work {
                to_compact.push(d.name.clone());
            }
            at_rest.push((d.name.clone(), path.clone(), s.allocated));
        }
    }
    let compacting = to_compact.len();
    for d in to_compact {
        ctx.snapshots.compact(ctx, &d);
    }
    refresh(ctx, &at_rest);
    if wake.is_empty() && compacting == 0 {
        *ctx.disks.quiet.lock().unwrap_or_else(|p| p.into_inner()) = Some(QuietPass {
            writes,
            at_rest,
            skipped: 0,
        });
    }
    tracing::debug!(
        disks = view.disks.len(),
        woken = wake.len(),
        compacting,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "disks resynced"
    );
    Ok(wake)
}

/// Reads the allocated bytes of the next [`REFRESHES_PER_RESYNC`] disks at
/// rest (by name, after the last one read) from their heads' files, and
/// writes those that changed.
fn refresh(ctx: &Context, at_rest: &[AtRest]) {
    if at_rest.is_empty() {
        return;
    }
    let mut up_to = ctx
        .disks
        .refreshed_up_to
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let start = up_to.as_deref().map_or(0, |last| {
        at_rest.partition_point(|(n, _, _)| n.as_str() <= last)
    });
    for k in 0..at_rest.len().min(REFRESHES_PER_RESYNC) {
        let (name, path, allocated) = &at_rest[(start + k) % at_rest.len()];
        let allocated = *allocated;
        if let Ok(meta) = std::fs::metadata(path) {
            let now = allocated_bytes(&meta);
            if allocated != Some(now) {
                ctx.set_disk_status(name, |s| {
                    // Unless the head changed meanwhile.
                    if s.path.as_deref() == Some(path.as_path()) {
                        s.allocated = Some(now);
                    }
                });
            }
        }
        *up_to = Some(name.to_string());
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use hearth_api::Object;

    use super::*;
    use crate::disk::reconcile;
    use crate::snapshot::storage;

    fn context(dir: &Path) -> Arc<Context> {
        Context::for_test(dir)
    }

    fn disk_object(name: &str) -> Object {
        hearth_api::parse_documents(
            &format!("apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {{name: {name}}}\nspec: {{size: 1Mi, source: {{blank: {{}}}}}}\n"),
            "t",
        )
        .unwrap()
        .remove(0)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resync_wakes_only_the_disks_the_store_contradicts() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let names = ["at-rest", "moved", "new", "going", "vm-disk"];
        ctx.store
            .put_objects(&names.iter().map(|n| disk_object(n)).collect::<Vec<_>>())
            .unwrap();
        let vm = hearth_api::parse_documents(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {name: web}\nspec: {runPolicy: AlwaysOff, disks: [{virtualDiskName: vm-disk}]}\n",
            "t",
        )
        .unwrap();
        ctx.store.put_objects(&vm).unwrap();
        // Real reconciles make them Ready, except the one never made.
        for n in ["at-rest", "moved", "going", "vm-disk"] {
            reconcile(&ctx, n).await.unwrap();
        }
        let status = |n: &str| -> VirtualDiskStatus {
            serde_json::from_value(ctx.store.get(Kind::VirtualDisk, n).unwrap().unwrap().status)
                .unwrap()
        };
        assert_eq!(status("vm-disk").attached_to.as_deref(), Some("web"));
        // A head that moved behind the status's back (as a lost hint would
        // leave it), and a deletion.
        let elsewhere = storage::numbered(&ctx.config.state_dir, 999, "moved");
        ctx.store
            .with_tx(|tx| storage::set_head_tx(tx, "moved", &elsewhere, None))
            .unwrap();
        ctx.store.mark_deleting(Kind::VirtualDisk, "going").unwrap();
        let mut woken = resync(&ctx).unwrap();
        woken.sort();
        assert_eq!(woken, ["going", "moved", "new"]);
        // Put right, they are at rest; passes that find the store unwritten
        // since then say so without reading it.
        ctx.store.put_objects(&[disk_object("new2")]).unwrap();
        for n in ["going", "moved", "new"] {
            ctx.store
                .with_tx(|tx| {
                    tx.execute("DELETE FROM heads WHERE disk = ?1", [n])?;
                    tx.execute(
                        "DELETE FROM objects WHERE kind = 'VirtualDisk' AND name = ?1",
                        [n],
                    )?;
                    Ok(())
                })
                .unwrap();
        }
        reconcile(&ctx, "new2").await.unwrap();
        assert!(resync(&ctx).unwrap().is_empty());
        assert!(resync(&ctx).unwrap().is_empty());
        ctx.store.mark_deleting(Kind::VirtualDisk, "new2").unwrap();
        assert_eq!(
            resync(&ctx).unwrap(),
            ["new2"],
            "a write is seen at the next pass"
        );
        assert_eq!(status("at-rest").phase, DiskPhase::Ready);
        // The VM lets go of its disk: the status now contradicts the store.
        ctx.store.remove(Kind::VirtualMachine, "web").unwrap();
        assert!(resync(&ctx).unwrap().contains(&"vm-disk".to_string()));
    }
}
