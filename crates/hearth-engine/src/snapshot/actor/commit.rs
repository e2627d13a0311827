//! What a cut leaves in the store: its snapshots shown InProgress, its
//! results written durably at the end, and, at start, the settling of a cut
//! the previous daemon did not finish. Kept apart from the loop and the QEMU
//! steps, as the store side of a cut.

use std::collections::HashMap;
use std::sync::Arc;

use chrono::Utc;
use hearth_api::{EventType, Kind, Object, SnapshotPhase, SnapshotStatus};

use super::cut::{CutContext, Prepared, frozen_on, live_of};
use super::target::{deadline_of, event_subject, request_of, target_of, vm_event};
use crate::context::Context;
use crate::snapshot::coordinator::{
    Command, Coordinator, CutId, Durable, Millis, Outcome, Request,
};
use crate::snapshot::overlays::{self, Ahead, Settled};
use crate::snapshot::storage;
use crate::store::{Store, StoreError, journals};

/// Shows the cut's snapshots InProgress, in a store transaction of the
/// caller's (the intent's, for a cut with a freeze).
pub(super) fn mark_in_progress_tx(
    tx: &rusqlite::Transaction<'_>,
    names: &[String],
    cut: CutId,
) -> Result<(), StoreError> {
    for n in names {
        Store::update_status_tx::<SnapshotStatus, _>(tx, Kind::VirtualDiskSnapshot, n, |s| {
            s.phase = SnapshotPhase::InProgress;
            s.cut_id = Some(cut);
        })?;
    }
    Ok(())
}

/// Rebuilds the coordinator from the store: unsettled snapshots, the intent
/// of a cut the previous daemon did not finish, and the overlays it made,
/// settled against what QEMU really uses.
pub(super) async fn recover(
    ctx: &Arc<Context>,
    target: &str,
) -> Result<(Coordinator, Vec<Command>), StoreError> {
    // Overlays made ahead by an earlier daemon: nobody switched to them,
    // and nothing here vouches for them any more. Removed whether QEMU runs
    // or not (its node first, when it runs).
    let aheads = overlays::of_target::<Ahead>(&ctx.store, target)?;
    if !aheads.is_empty() {
        let live = live_of(ctx, target).await;
        for a in &aheads {
            if let Err(why) = overlays::remove_ahead(&ctx.store, live.as_deref(), a).await {
                tracing::warn!(target, disk = %a.disk, node = %a.node, error = %why, "an ahead overlay is left for later");
            }
        }
    }
    let overlays = overlays::of_target(&ctx.store, target)?;
    if !overlays.is_empty() {
        let live = live_of(ctx, target).await;
        for (o, s) in overlays::settle(&ctx.store, live.as_deref(), &overlays).await {
            vm_event(
                ctx,
                target,
                EventType::Normal,
                "OverlaySettled",
                &format!(
                    "cut {}: overlay of VirtualDisk {:?} {}",
                    o.cut,
                    o.disk,
                    match s {
                        Settled::Adopted => "is in use: it is the disk's head now".to_string(),
                        Settled::Removed => "was not in use: removed".to_string(),
                        Settled::Unresolved(why) => format!("left for later: {why}"),
                    }
                ),
            );
        }
    }
    let deadline_ms = deadline_of(ctx, target);
    let mut pending = Vec::new();
    for s in ctx.store.list(Kind::VirtualDiskSnapshot)? {
        let Object::VirtualDiskSnapshot(snap) = &s.object else {
            continue;
        };
        let status: SnapshotStatus = serde_json::from_value(s.status.clone()).unwrap_or_default();
        if !matches!(
            status.phase,
            SnapshotPhase::Pending | SnapshotPhase::InProgress
        ) {
            continue;
        }
        if target_of(ctx, &snap.spec.virtual_disk_name)? != target {
            continue;
        }
        pending.push(request_of(&ctx.store, snap));
    }
    let intent: Option<(CutId, Vec<Request>)> = ctx.store.with_tx(|tx| {
        Ok(journals::freeze_of_tx(tx, target)?.map(|(cut, names)| {
            let open: Vec<Request> = pending
                .iter()
                .filter(|r| names.contains(&r.snapshot))
                .cloned()
                .collect();
            (cut as CutId, open)
        }))
    })?;
    if let Some((cut, _)) = &intent
        && let Some(vm) = target.strip_prefix("vm/")
    {
        ctx.event(
                Kind::VirtualMachine,
                vm,
                EventType::Warning,
                "RecoveringCut",
                &format!("hearthd restarted during snapshot cut {cut}: thawing the guest if it is frozen, then settling its snapshots"),
            );
    }
    Ok(Coordinator::recover(
        deadline_ms,
        Durable { pending, intent },
    ))
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn commit(
    ctx: &Arc<Context>,
    target: &str,
    held: &mut CutContext,
    core: &Coordinator,
    cut: CutId,
    outcomes: &[(String, Outcome)],
    took_cut: bool,
    freeze_window_ms: Option<Millis>,
    keep_intent: bool,
    why_not_consistent: Option<String>,
    full_freeze: Option<String>,
) -> bool {
    let disk_of: HashMap<String, String> = core
        .cut_requests()
        .iter()
        .map(|r| (r.snapshot.clone(), r.disk.clone()))
        .collect();
    let cut_time = held.freeze_started.unwrap_or_else(Utc::now);
    let prepared: HashMap<String, &Prepared> =
        held.prepared.iter().map(|p| (p.disk.clone(), p)).collect();
    // Results, new heads and the intent: one store transaction.
    let r = ctx.store.with_tx(|tx| {
        if took_cut {
            // QEMU answered that it switched every disk: the overlays are
            // the heads now (and their journal records go).
            for p in prepared.values() {
                overlays::adopt_tx(tx, &p.overlay)?;
            }
        }
        for (name, outcome) in outcomes {
            let exists = Store::exists_tx(tx, Kind::VirtualDiskSnapshot, name)?;
            if !exists {
                continue;
            }
            let layer = disk_of.get(name).and_then(|d| prepared.get(d));
            if let (Outcome::Ready { .. }, Some(p)) = (outcome, layer) {
                storage::set_snapshot_layer_tx(tx, name, &p.old_head.id)?;
            }
            // The snapshot layer's space on the host (what `qemu-img info`
            // calls actual-size), read from the file, not by a process.
            let size = layer.and_then(|p| {
                std::fs::metadata(&p.old_head.path)
                    .ok()
                    .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
            });
            Store::update_status_tx::<SnapshotStatus, _>(
                tx,
                Kind::VirtualDiskSnapshot,
                name,
                |s| {
                    s.cut_id = Some(cut);
                    match outcome {
                        Outcome::Ready { consistent } => {
                            s.phase = SnapshotPhase::Ready;
                            s.consistent = Some(*consistent);
                            s.cut_time = Some(cut_time);
                            s.freeze_window_ms = freeze_window_ms;
                            s.capacity = layer.map(|p| p.capacity);
                            s.size = size;
                            if *consistent {
                                s.reason = None;
                                s.message = None;
                                let frozen = frozen_on(held, layer);
                                if let Some((reason, message)) = &frozen.1 {
                                    s.reason = Some(reason.to_string());
                                    s.message = Some(message.clone());
                                }
                                // (An agent that could not list the
                                // filesystems says so already.)
                                if let Some(why) = full_freeze
                                    .as_ref()
                                    .filter(|_| !matches!(held.mounts, Some(Err(_))))
                                {
                                    // A cut of some disks froze everything.
                                    let full =
                                        format!("every filesystem of the guest was frozen: {why}");
                                    s.message = Some(match s.message.take() {
                                        Some(m) => format!("{m}; {full}"),
                                        None => full,
                                    });
                                    s.reason.get_or_insert_with(|| "FullFreeze".into());
                                }
                                s.frozen_mount_points = frozen.0;
                            } else {
                                s.reason = Some("NotConsistent".into());
                                s.message = why_not_consistent.clone();
                            }
                        }
                        Outcome::Failed(why) => {
                            s.phase = SnapshotPhase::Failed;
                            s.consistent = None;
                            s.freeze_window_ms = freeze_window_ms;
                            s.reason = Some("NotConsistent".into());
                            s.message = Some(why.clone());
                        }
                        Outcome::Retry => {
                            s.phase = SnapshotPhase::Pending;
                            s.message =
                                Some("hearthd restarted during the cut; taking it again".into());
                        }
                    }
                },
            )?;
        }
        if !keep_intent {
            journals::forget_freeze_tx(tx, target)?;
        }
        if let Some((time, message)) = &held.thawed {
            let (kind, name) = event_subject(target);
            Store::record_event_tx(tx, *time, kind, name, EventType::Normal, "Thawed", message)?;
        }
        Ok(())
    });
    if let Err(e) = r {
        tracing::error!(target, cut, error = %e, "cannot record the cut's results; retrying");
        return false;
    }
    held.thawed = None;
    if took_cut {
        // Each disk's status reads its new head's file (allocated bytes).
        for disk in prepared.keys() {
            ctx.wake(Kind::VirtualDisk, disk);
        }
    }
    // Observed as soon as the store has the results (what a reader sees).
    for (name, outcome) in outcomes {
        if !matches!(outcome, Outcome::Retry) {
            crate::metrics::snapshot_settled(
                ctx,
                Kind::VirtualDiskSnapshot,
                name,
                matches!(outcome, Outcome::Ready { .. }),
                freeze_window_ms,
            );
        }
    }
    let ready = outcomes
        .iter()
        .filter(|(_, o)| matches!(o, Outcome::Ready { .. }))
        .count();
    let failed = outcomes
        .iter()
        .filter(|(_, o)| matches!(o, Outcome::Failed(_)))
        .count();
    if !outcomes.is_empty() {
        vm_event(
            ctx,
            target,
            if failed > 0 {
                EventType::Warning
            } else {
                EventType::Normal
            },
            "SnapshotCut",
            &format!(
                "cut {cut}: {ready} ready, {failed} failed{}{}",
                freeze_window_ms
                    .map(|w| format!(", frozen window {w} ms"))
                    .unwrap_or_default(),
                if took_cut { "" } else { ", no cut taken" }
            ),
        );
    }
    for (name, outcome) in outcomes {
        let (t, reason, msg) = match outcome {
            Outcome::Ready { consistent } => (
                EventType::Normal,
                "Ready",
                format!("taken in cut {cut}, consistent: {consistent}"),
            ),
            Outcome::Failed(why) => (EventType::Warning, "Failed", why.clone()),
            Outcome::Retry => (
                EventType::Warning,
                "Retrying",
                "hearthd restarted during the cut; taking it again".to_string(),
            ),
        };
        ctx.event(Kind::VirtualDiskSnapshot, name, t, reason, &msg);
        ctx.wake(Kind::VirtualDiskSnapshot, name);
    }
    // VM snapshots aggregate their disk snapshots: the ones this cut's
    // belong to are woken, not every VM snapshot there is.
    let names: Vec<&str> = outcomes.iter().map(|(n, _)| n.as_str()).collect();
    for parent in vm_snapshots_of(&ctx.store, &names) {
        ctx.wake(Kind::VirtualMachineSnapshot, &parent);
    }
    held.prepared.clear();
    held.guards.clear();
    true
}

/// The VM snapshots the disk snapshots `names` were requested by (their
/// `status.virtualMachineSnapshotName`), each once.
fn vm_snapshots_of(
    store: &crate::store::Store,
    names: &[&str],
) -> std::collections::BTreeSet<String> {
    names
        .iter()
        .filter_map(|n| store.get(Kind::VirtualDiskSnapshot, n).ok().flatten())
        .filter_map(|s| {
            serde_json::from_value::<SnapshotStatus>(s.status)
                .ok()?
                .virtual_machine_snapshot_name
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_api::{API_VERSION, ObjectMeta, VirtualDiskSnapshot, VirtualDiskSnapshotSpec};

    #[test]
    fn a_cut_wakes_the_vm_snapshots_of_its_disk_snapshots_only() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = Context::for_test(dir.path());
        let snap = |name: &str, parent: Option<&str>| {
            let object = Object::VirtualDiskSnapshot(VirtualDiskSnapshot {
                api_version: API_VERSION.into(),
                kind: Kind::VirtualDiskSnapshot.as_str().into(),
                metadata: ObjectMeta {
                    name: name.into(),
                    generation: 1,
                    ..ObjectMeta::default()
                },
                spec: VirtualDiskSnapshotSpec {
                    virtual_disk_name: "d".into(),
                    required_consistency: true,
                },
                status: None,
            });
            let status = SnapshotStatus {
                virtual_machine_snapshot_name: parent.map(str::to_string),
                ..SnapshotStatus::default()
            };
            ctx.store
                .with_tx(|tx| crate::store::Store::create_with_status_tx(tx, &object, &status))
                .unwrap();
        };
        // Many VM snapshots exist; the cut holds two disk snapshots of one
        // and a disk snapshot of its own.
        for i in 0..50 {
            snap(&format!("old-{i}-d"), Some(&format!("old-{i}")));
        }
        snap("new-a", Some("new"));
        snap("new-b", Some("new"));
        snap("alone", None);
        let woken = vm_snapshots_of(&ctx.store, &["new-a", "new-b", "alone", "gone"]);
        assert_eq!(woken.into_iter().collect::<Vec<_>>(), ["new"]);
    }
}
