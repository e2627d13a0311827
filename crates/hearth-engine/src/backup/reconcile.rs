//! A VirtualMachineBackup from request to a committed point: a checkpoint
//! VM snapshot (the consistent cut: one freeze, one thaw), then each disk
//! copied from the checkpoint's layers into the target, then the manifest
//! written (the commit), then retention in the target and the older
//! checkpoints deleted, and only then the status Ready. A crash anywhere
//! before the manifest leaves files no manifest lists (removed by the next
//! backup of the directory) and a backup still InProgress, which the
//! restarted daemon copies again; after it, the backup is found in the
//! manifest, and what follows the commit is done again (each step finds
//! what is done already) before its status is written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use chrono::Utc;
use hearth_api::{
    BackupFile, BackupKind, BackupPhase, BackupStatus, EventType, Kind, Object, ObjectMeta,
    SnapshotPhase, SnapshotStatus, VirtualMachineBackup, VirtualMachineSnapshot,
    VirtualMachineSnapshotSpec, labels,
};

use super::choose::{self, Choice, DiskNow, Previous};
use super::copy;
use super::target::{self, Manifest, Point};
use crate::context::{Action, Context, ReconcileError};
use crate::snapshot::storage;
use crate::store::Store;

/// `metadata.managedBy` of a backup's checkpoint snapshot.
pub const MANAGED_BY_PREFIX: &str = "VirtualMachineBackup/";
const POLL: std::time::Duration = std::time::Duration::from_secs(1);

fn status_of(v: &serde_json::Value) -> BackupStatus {
    serde_json::from_value(v.clone()).unwrap_or_default()
}

fn set_status(ctx: &Context, name: &str, f: impl FnOnce(&mut BackupStatus)) {
    if let Err(e) = ctx.store.update_status(Kind::VirtualMachineBackup, name, f) {
        tracing::warn!(backup = name, error = %e, "cannot write status");
    }
}

fn fail(ctx: &Context, name: &str, reason: &str, message: &str) {
    set_status(ctx, name, |s| {
        s.phase = BackupPhase::Failed;
        s.reason = Some(reason.to_string());
        s.message = Some(message.to_string());
    });
    crate::schedule::run_settled(ctx, Kind::VirtualMachineBackup, name);
    ctx.event(
        Kind::VirtualMachineBackup,
        name,
        EventType::Warning,
        reason,
        message,
    );
}

fn checkpoint_name(backup: &str) -> String {
    format!("{backup}-cp")
}

pub async fn reconcile(ctx: &Arc<Context>, name: &str) -> Result<Action, ReconcileError> {
    let Some(stored) = ctx.store.get(Kind::VirtualMachineBackup, name)? else {
        return Ok(Action::Done);
    };
    let Object::VirtualMachineBackup(backup) = &stored.object else {
        return Ok(Action::Done);
    };
    let status = status_of(&stored.status);
    if stored.deleting {
        return delete(ctx, backup, &status);
    }
    match status.phase {
        BackupPhase::Pending => request_cut(ctx, backup),
        BackupPhase::InProgress => copy_when_cut(ctx, backup, &status).await,
        BackupPhase::Ready | BackupPhase::Failed | BackupPhase::Terminating => Ok(Action::Done),
    }
}

/// The backup goes; the files in the target stay (they are data). Its
/// checkpoint goes too unless it is the newest point's (the next
/// incremental starts from it).
fn delete(
    ctx: &Arc<Context>,
    backup: &VirtualMachineBackup,
    status: &BackupStatus,
) -> Result<Action, ReconcileError> {
    let name = &backup.metadata.name;
    if let Some(cp) = &status.checkpoint {
        let newest = target::read(&backup.spec.to, &backup.spec.virtual_machine_name)
            .ok()
            .and_then(|m| m.points.last().map(|p| p.checkpoint.clone()));
        if newest.as_deref() != Some(cp.as_str())
            && ctx.store.mark_deleting(Kind::VirtualMachineSnapshot, cp)?
        {
            ctx.wake(Kind::VirtualMachineSnapshot, cp);
        }
    }
    ctx.store.remove(Kind::VirtualMachineBackup, name)?;
    ctx.event(
        Kind::VirtualMachineBackup,
        name,
        EventType::Normal,
        "Deleted",
        "the backup object is gone; its files in the target stay",
    );
    Ok(Action::Done)
}

/// One backup of a target at a time: another one InProgress for the same
/// directory (by its real path: a link to it is the same directory) makes
/// this one wait.
fn target_busy(ctx: &Context, backup: &VirtualMachineBackup) -> Result<bool, ReconcileError> {
    let mine = target::real_path(&backup.spec.to);
    Ok(ctx
        .store
        .list(Kind::VirtualMachineBackup)?
        .iter()
        .any(|o| match &o.object {
            Object::VirtualMachineBackup(b) => {
                b.metadata.name != backup.metadata.name
                    && status_of(&o.status).phase == BackupPhase::InProgress
                    && target::real_path(&b.spec.to) == mine
            }
            _ => false,
        }))
}

fn request_cut(
    ctx: &Arc<Context>,
    backup: &VirtualMachineBackup,
) -> Result<Action, ReconcileError> {
    let name = backup.metadata.name.as_str();
    let vm = &backup.spec.virtual_machine_name;
    if ctx.store.get(Kind::VirtualMachine, vm)?.is_none() {
        fail(
            ctx,
            name,
            "VirtualMachineNotFound",
            &format!("VirtualMachine {vm:?} does not exist"),
        );
        return Ok(Action::Done);
    }
    if target_busy(ctx, backup)? {
        return Ok(Action::RequeueAfter(POLL * 2));
    }
    let cp = checkpoint_name(name);
    if let Err(why) = hearth_api::check_dns_label(&cp) {
        fail(
            ctx,
            name,
            "NameTooLong",
            &format!("the checkpoint snapshot name {why}; use a shorter backup name"),
        );
        return Ok(Action::Done);
    }
    if ctx.store.get(Kind::VirtualMachineSnapshot, &cp)?.is_some() {
        fail(
            ctx,
            name,
            "NameTaken",
            &format!("a VirtualMachineSnapshot named {cp:?} already exists"),
        );
        return Ok(Action::Done);
    }
    let snapshot = Object::VirtualMachineSnapshot(VirtualMachineSnapshot {
        api_version: hearth_api::API_VERSION.into(),
        kind: Kind::VirtualMachineSnapshot.as_str().into(),
        metadata: ObjectMeta {
            name: cp.clone(),
            creation_timestamp: Some(Utc::now()),
            generation: 1,
            managed_by: Some(format!("{MANAGED_BY_PREFIX}{name}")),
            labels: BTreeMap::from([(labels::BACKUP.to_string(), name.to_string())]),
            ..ObjectMeta::default()
        },
        spec: VirtualMachineSnapshotSpec {
            virtual_machine_name: vm.clone(),
            required_consistency: backup.spec.required_consistency,
        },
        status: None,
    });
    // The checkpoint and the status naming it in one transaction.
    ctx.store.with_tx(|tx| {
        Store::create_with_status_tx(tx, &snapshot, &SnapshotStatus::default())?;
        Store::update_status_tx::<BackupStatus, _>(tx, Kind::VirtualMachineBackup, name, |s| {
            s.phase = BackupPhase::InProgress;
            s.checkpoint = Some(cp.clone());
        })?;
        Ok(())
    })?;
    ctx.wake(Kind::VirtualMachineSnapshot, &cp);
    ctx.event(
        Kind::VirtualMachineBackup,
        name,
        EventType::Normal,
        "CutRequested",
        &format!("checkpoint VM snapshot {cp:?} requested"),
    );
    Ok(Action::RequeueAfter(POLL))
}

async fn copy_when_cut(
    ctx: &Arc<Context>,
    backup: &VirtualMachineBackup,
    status: &BackupStatus,
) -> Result<Action, ReconcileError> {
    let name = backup.metadata.name.as_str();
    let Some(cp) = status.checkpoint.clone() else {
        fail(ctx, name, "NoCheckpoint", "the backup names no checkpoint");
        return Ok(Action::Done);
    };
    let Some(cp_obj) = ctx.store.get(Kind::VirtualMachineSnapshot, &cp)? else {
        fail(
            ctx,
            name,
            "CheckpointGone",
            &format!("the checkpoint VM snapshot {cp:?} was deleted before the copy"),
        );
        return Ok(Action::Done);
    };
    let cp_status: SnapshotStatus =
        serde_json::from_value(cp_obj.status.clone()).unwrap_or_default();
    match cp_status.phase {
        SnapshotPhase::Ready => {}
        SnapshotPhase::Failed => {
            let why = format!(
                "the cut failed: {}: {}",
                cp_status.reason.as_deref().unwrap_or("?"),
                cp_status.message.as_deref().unwrap_or("")
            );
            fail(ctx, name, "CutFailed", &why);
            if ctx.store.mark_deleting(Kind::VirtualMachineSnapshot, &cp)? {
                ctx.wake(Kind::VirtualMachineSnapshot, &cp);
            }
            return Ok(Action::Done);
        }
        _ => return Ok(Action::RequeueAfter(POLL)),
    }
    let dir = backup.spec.to.clone();
    let vm = backup.spec.virtual_machine_name.clone();
    let manifest = match prepare_target(&dir, &vm) {
        Ok(m) => m,
        Err(e) => {
            fail(ctx, name, "TargetUnusable", &e.to_string());
            return Ok(Action::Done);
        }
    };
    // Committed before a crash: what follows the commit may not have been
    // done, and the status was not written.
    if let Some(p) = manifest.points.iter().find(|p| p.backup == name) {
        after_commit(ctx, backup, manifest.clone(), &cp).await?;
        finish(ctx, backup, &manifest, p);
        return Ok(Action::Done);
    }
    match write_point(ctx, backup, &cp, &cp_status, manifest).await {
        Ok(()) => Ok(Action::Done),
        Err(why) => {
            // Nothing of it is in the target; its checkpoint starts nothing.
            fail(ctx, name, "CopyFailed", &why);
            if ctx.store.mark_deleting(Kind::VirtualMachineSnapshot, &cp)? {
                ctx.wake(Kind::VirtualMachineSnapshot, &cp);
            }
            Ok(Action::Done)
        }
    }
}

fn prepare_target(dir: &Path, vm: &str) -> Result<Manifest, target::TargetError> {
    std::fs::create_dir_all(dir).map_err(super::io("making", dir))?;
    let m = target::read(dir, vm)?;
    for p in target::recover(dir, &m)? {
        tracing::info!(file = %p.display(), "finished a merge a crash stopped");
    }
    for p in target::sweep(dir, &m)? {
        tracing::info!(file = %p.display(), "removed a file no backup point lists");
    }
    Ok(m)
}

/// Disk name → its disk snapshot in VM snapshot `vm_snapshot`.
fn disk_snapshots(
    ctx: &Context,
    status: &SnapshotStatus,
) -> Result<BTreeMap<String, String>, ReconcileError> {
    let mut out = BTreeMap::new();
    for ds in &status.virtual_disk_snapshot_names {
        if let Some(o) = ctx.store.get(Kind::VirtualDiskSnapshot, ds)?
            && let Object::VirtualDiskSnapshot(s) = &o.object
        {
            out.insert(s.spec.virtual_disk_name.clone(), ds.clone());
        }
    }
    Ok(out)
}

async fn write_point(
    ctx: &Arc<Context>,
    backup: &VirtualMachineBackup,
    cp: &str,
    cp_status: &SnapshotStatus,
    mut manifest: Manifest,
) -> Result<(), String> {
    let name = backup.metadata.name.as_str();
    let dir = &backup.spec.to;
    let started = Instant::now();
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let now_disks = disk_snapshots(ctx, cp_status).map_err(|x| e(&x))?;
    // Pinned while read: no delete or merge collects a layer under the copy.
    let mut pins = Vec::new();
    for ds in now_disks.values() {
        pins.push(ctx.exports.of(ds).read_owned().await);
    }
    let previous = manifest.points.last().cloned();
    let prev_disks = match &previous {
        Some(p) => match ctx
            .store
            .get(Kind::VirtualMachineSnapshot, &p.checkpoint)
            .map_err(|x| e(&x))?
        {
            Some(o) if !o.deleting => {
                let st: SnapshotStatus =
                    serde_json::from_value(o.status.clone()).unwrap_or_default();
                Some(disk_snapshots(ctx, &st).map_err(|x| e(&x))?)
            }
            _ => None,
        },
        None => None,
    };
    let mut now = Vec::new();
    let mut layers = BTreeMap::new();
    for (disk, ds) in &now_disks {
        let layer = storage::snapshot_layer(&ctx.store, ds)
            .map_err(|x| e(&x))?
            .ok_or_else(|| format!("disk snapshot {ds:?} has no layer"))?;
        let (chain, virtual_size) = chain_of(&layer.path).await.map_err(|x| e(&x))?;
        let previous_layer = match prev_disks.as_ref().and_then(|m| m.get(disk)) {
            Some(prev_ds) => storage::snapshot_layer(&ctx.store, prev_ds)
                .map_err(|x| e(&x))?
                .map(|l| target::real_path(&l.path)),
            None => None,
        };
        now.push(DiskNow {
            name: disk.clone(),
            virtual_size,
            chain,
            previous_layer,
        });
        layers.insert(disk.clone(), layer.path.clone());
    }
    let incrementals_since_full = manifest
        .points
        .iter()
        .rev()
        .take_while(|p| p.kind == BackupKind::Incremental)
        .count() as u32;
    let prev = previous.as_ref().map(|p| Previous {
        incrementals_since_full,
        backup: p.backup.clone(),
        checkpoint: p.checkpoint.clone(),
        checkpoint_exists: prev_disks.is_some(),
        disks: p
            .files
            .iter()
            .map(|f| (f.disk.clone(), f.virtual_size))
            .collect(),
    });
    let choice = choose::choose(
        backup.spec.mode,
        backup.spec.full_every,
        prev.as_ref(),
        &now,
    );
    let point = previous.as_ref().map(|p| p.point + 1).unwrap_or(1);
    // Every disk's extents first: the total the progress counts toward.
    let mut plans = Vec::new();
    for d in &now {
        let over = match &choice {
            Choice::Full { .. } => None,
            Choice::Incremental { depth } => {
                let prev_file = previous
                    .as_ref()
                    .and_then(|p| p.file_of(&d.name))
                    .and_then(|f| Path::new(&f.file).file_name())
                    .map(|n| n.to_string_lossy().into_owned())
                    .ok_or_else(|| {
                        format!("the previous point has no file of disk {:?}", d.name)
                    })?;
                Some(copy::Over {
                    depth: depth[&d.name],
                    chain: d.chain.clone(),
                    file: prev_file,
                })
            }
        };
        let layer = &layers[&d.name];
        let plan = match over {
            Some(over) => copy::plan_incremental(layer, d.virtual_size, over).await,
            None => copy::plan(layer, None).await,
        };
        plans.push(plan.map_err(|x| e(&x))?);
    }
    let total: u64 = plans.iter().map(|p| p.bytes).sum();
    let done = copy::Progress::default();
    let ticker = {
        let (ctx, name, done) = (ctx.clone(), name.to_string(), done.clone());
        tokio::spawn(async move {
            loop {
                let bytes_done = done.load(std::sync::atomic::Ordering::Relaxed);
                set_status(&ctx, &name, |s| {
                    s.progress = Some(hearth_api::BackupProgress {
                        bytes_done,
                        bytes_total: total,
                    })
                });
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        })
    };
    let ticker = AbortOnDrop(Some(ticker));
    let mut files = Vec::new();
    let mut partials = Vec::new();
    let mut bytes_read = 0;
    let mut bytes_written = 0;
    for (d, plan) in now.iter().zip(plans) {
        let rel = target::file_name(&d.name, point);
        let final_path = dir.join(&rel);
        let partial = dir.join(format!("{rel}.partial"));
        let folder = final_path.parent().unwrap_or(dir);
        std::fs::create_dir_all(folder).map_err(|x| e(&super::io("making", folder)(x)))?;
        let _ = std::fs::remove_file(&partial);
        let written = copy::write(plan, &partial, done.clone(), true).await;
        let (written, sha256) = match written {
            Ok(w) => {
                let sha = w.sha256.clone().unwrap_or_default();
                (w, sha)
            }
            Err(x) => {
                let _ = std::fs::remove_file(&partial);
                for p in &partials {
                    let _ = std::fs::remove_file(p);
                }
                return Err(format!("disk {:?}: {x}", d.name));
            }
        };
        bytes_read += written.bytes_read;
        bytes_written += written.size;
        partials.push(partial.clone());
        files.push((
            partial,
            final_path,
            BackupFile {
                disk: d.name.clone(),
                file: rel,
                sha256,
                size: written.size,
                virtual_size: d.virtual_size,
            },
        ));
    }
    ticker.stop().await;
    drop(pins);
    // Every file in place and synced, then the manifest: the commit.
    for (partial, final_path, _) in &files {
        std::fs::rename(partial, final_path).map_err(|x| e(&super::io("renaming", partial)(x)))?;
        target::sync_dir(final_path.parent().unwrap_or(dir)).map_err(|x| e(&x))?;
    }
    let kind = match choice {
        Choice::Full { .. } => BackupKind::Full,
        Choice::Incremental { .. } => BackupKind::Incremental,
    };
    let reason_full = match &choice {
        Choice::Full { reason } => reason.clone(),
        _ => None,
    };
    let p = Point {
        point,
        backup: name.to_string(),
        kind,
        cut_time: cp_status.cut_time,
        checkpoint: cp.to_string(),
        files: files.into_iter().map(|(_, _, f)| f).collect(),
        virtual_machine_spec: cp_status.virtual_machine_spec.clone(),
        reason_full,
        copy: Some(target::CopyCounts {
            bytes_read,
            bytes_written,
            duration_ms: started.elapsed().as_millis() as u64,
        }),
    };
    manifest.points.push(p.clone());
    target::commit(dir, &manifest).map_err(|x| e(&x))?;
    after_commit(ctx, backup, manifest.clone(), cp)
        .await
        .map_err(|x| e(&x))?;
    finish(ctx, backup, &manifest, &p);
    Ok(())
}

/// What follows the commit of the point whose checkpoint is `cp`, before
/// the backup is Ready (so a crash in between is finished by the next
/// start, which finds the point committed): retention in the target (older
/// points merged into the oldest kept one), then the checkpoints of the
/// older points deleted, since only the newest one starts anything.
async fn after_commit(
    ctx: &Context,
    backup: &VirtualMachineBackup,
    manifest: Manifest,
    cp: &str,
) -> Result<(), ReconcileError> {
    let name = backup.metadata.name.as_str();
    let dir = &backup.spec.to;
    if let Some(keep) = backup.spec.keep {
        let before = manifest.points.len();
        match target::keep_newest(dir, manifest, keep).await {
            Ok(kept) if kept.points.len() < before => ctx.event(
                Kind::VirtualMachineBackup,
                name,
                EventType::Normal,
                "Pruned",
                &format!(
                    "kept the newest {} point(s) of {}; point {} is now full",
                    kept.points.len(),
                    dir.display(),
                    kept.points.first().map(|p| p.point).unwrap_or(0)
                ),
            ),
            Ok(_) => {}
            Err(why) => ctx.event(
                Kind::VirtualMachineBackup,
                name,
                EventType::Warning,
                "PruneFailed",
                &format!("the older points stay: {why}"),
            ),
        }
    }
    // Every other backup of the directory is an older point (one backup of
    // a directory runs at a time); a point merged away has no backup left
    // in the manifest to name its checkpoint, so the objects are asked.
    let mine = target::real_path(dir);
    for o in ctx.store.list(Kind::VirtualMachineBackup)? {
        if let Object::VirtualMachineBackup(b) = &o.object
            && b.metadata.name != name
            && target::real_path(&b.spec.to) == mine
            && let Some(older) = status_of(&o.status).checkpoint
            && ctx
                .store
                .get(Kind::VirtualMachineSnapshot, &older)?
                .is_some()
        {
            drop_checkpoint(ctx, &older, cp)?;
        }
    }
    Ok(())
}

/// Deletes an older point's checkpoint snapshot (never `current`'s).
fn drop_checkpoint(ctx: &Context, older: &str, current: &str) -> Result<(), ReconcileError> {
    if older != current
        && ctx
            .store
            .mark_deleting(Kind::VirtualMachineSnapshot, older)?
    {
        ctx.wake(Kind::VirtualMachineSnapshot, older);
    }
    Ok(())
}

/// Stops a task when dropped (on every way out of the copy), or when
/// stopped, then waits until it has (so it writes nothing after).
struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl AbortOnDrop {
    async fn stop(mut self) {
        if let Some(t) = self.0.take() {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(t) = &self.0 {
            t.abort();
        }
    }
}

/// `layer` and every layer below it (canonical, top first), and its size:
/// from the images' headers, or `qemu-img info` when hearth does not read
/// one of them itself.
async fn chain_of(layer: &Path) -> Result<(Vec<PathBuf>, u64), hearth_qemu::img::ImgError> {
    let top = layer.to_path_buf();
    let read = tokio::task::spawn_blocking(move || hearth_qemu::qcow2::Chain::read(&top)).await;
    match read {
        Ok(Ok(chain)) => {
            let size = chain.first().map_or(0, |l| l.virtual_size);
            return Ok((chain.into_iter().map(|l| l.path).collect(), size));
        }
        Ok(Err(why)) => {
            tracing::info!(layer = %layer.display(), %why, "reading the chain with qemu-img")
        }
        Err(why) => tracing::warn!(layer = %layer.display(), %why, "the chain's read failed"),
    }
    let infos = hearth_qemu::img::backing_chain(layer).await?;
    let size = infos.first().map_or(0, |i| i.virtual_size);
    let chain = infos
        .iter()
        .map(|i| target::real_path(Path::new(&i.filename)))
        .collect();
    Ok((chain, size))
}

fn finish(ctx: &Context, backup: &VirtualMachineBackup, manifest: &Manifest, p: &Point) {
    let name = backup.metadata.name.as_str();
    let base = manifest
        .points
        .iter()
        .rev()
        .find(|q| q.point < p.point)
        .filter(|_| p.kind == BackupKind::Incremental)
        .map(|q| q.backup.clone());
    set_status(ctx, name, |s| {
        s.phase = BackupPhase::Ready;
        s.kind = Some(p.kind);
        s.point = Some(p.point);
        s.base = base.clone();
        if p.reason_full.is_some() {
            s.reason_full = p.reason_full.clone();
        }
        s.cut_time = p.cut_time;
        s.files = p.files.clone();
        s.progress = None;
        if let Some(c) = p.copy {
            s.bytes_read = Some(c.bytes_read);
            s.bytes_written = Some(c.bytes_written);
            s.duration_ms = Some(c.duration_ms);
        }
        s.reason = None;
        s.message = None;
    });
    let what = match (p.kind, &p.reason_full) {
        (BackupKind::Full, Some(r)) => format!("full ({r})"),
        (BackupKind::Full, None) => "full".to_string(),
        (BackupKind::Incremental, _) => format!(
            "incremental over {}",
            base.as_deref().unwrap_or("the previous point")
        ),
    };
    ctx.event(
        Kind::VirtualMachineBackup,
        name,
        EventType::Normal,
        "Ready",
        &format!(
            "point {} in {}: {what}; {} file(s)",
            p.point,
            backup.spec.to.display(),
            p.files.len()
        ),
    );
    crate::schedule::run_settled(ctx, Kind::VirtualMachineBackup, name);
}
