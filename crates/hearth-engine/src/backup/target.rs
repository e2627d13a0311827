//! The target directory of a VM's backups: `DISK/NNNN.qcow2` files (each
//! incremental one backed by the one before, by a relative name, so the
//! directory can move) and `hearth-backup.json`, the manifest. The manifest
//! is the commit point: a file it does not list is not a backup, and the
//! next backup removes it (a crash mid-copy leaves one).

use super::{io, sha256_of};
use std::io::Write;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use hearth_api::{BackupFile, BackupKind, VirtualMachineSpec};
use serde::{Deserialize, Serialize};

pub const MANIFEST: &str = "hearth-backup.json";
pub(crate) const VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub version: u32,
    pub virtual_machine_name: String,
    pub points: Vec<Point>,
}

/// One backup: every disk's file at one cut.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Point {
    pub point: u32,
    pub backup: String,
    pub kind: BackupKind,
    pub cut_time: Option<DateTime<Utc>>,
    /// The VM snapshot of the cut, while it exists the start of the next
    /// incremental.
    pub checkpoint: String,
    pub files: Vec<BackupFile>,
    /// The VM as it was, for a restore to make it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_spec: Option<Box<VirtualMachineSpec>>,
    /// Why a full point is full when an incremental was asked for: kept
    /// here, beside the commit, so a backup whose status a crash did not
    /// let hearthd write still says why after the restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason_full: Option<String>,
    /// What the copy read and wrote, for the same reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy: Option<CopyCounts>,
}

/// A point's copy, as its backup's status reports it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CopyCounts {
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub duration_ms: u64,
}

impl Point {
    pub fn file_of(&self, disk: &str) -> Option<&BackupFile> {
        self.files.iter().find(|f| f.disk == disk)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error(transparent)]
    File(#[from] super::FileError),
    #[error("{}: not a backup manifest hearth can read: {reason}", path.display())]
    BadManifest { path: PathBuf, reason: String },
    #[error("{} holds the backups of VirtualMachine {other:?}; one VM per directory", dir.display())]
    OtherVm { dir: PathBuf, other: String },
}

/// The manifest of `dir`, or an empty one for `vm` when there is none yet.
pub fn read(dir: &Path, vm: &str) -> Result<Manifest, TargetError> {
    if !dir.join(MANIFEST).exists() {
        return Ok(Manifest {
            version: VERSION,
            virtual_machine_name: vm.to_string(),
            points: Vec::new(),
        });
    }
    let m = read_existing(dir)?;
    if m.virtual_machine_name != vm {
        return Err(TargetError::OtherVm {
            dir: dir.to_path_buf(),
            other: m.virtual_machine_name,
        });
    }
    Ok(m)
}

/// The manifest of `dir`, which must be there, in a version this hearth reads.
pub fn read_existing(dir: &Path) -> Result<Manifest, TargetError> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read(&path).map_err(io("reading", &path))?;
    let m: Manifest = serde_json::from_slice(&text).map_err(|e| TargetError::BadManifest {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    if m.version != VERSION {
        return Err(TargetError::BadManifest {
            path,
            reason: format!("version {} (this hearth reads {VERSION})", m.version),
        });
    }
    Ok(m)
}

/// Writes the manifest durably: a temporary file, fsynced, renamed over
/// the old one, the directory fsynced. A crash leaves the old manifest or
/// the new one, never a mix.
pub fn commit(dir: &Path, m: &Manifest) -> Result<(), TargetError> {
    let path = dir.join(MANIFEST);
    let tmp = dir.join(format!("{MANIFEST}.tmp"));
    let text = serde_json::to_vec_pretty(m).map_err(|e| TargetError::BadManifest {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    {
        let mut f = std::fs::File::create(&tmp).map_err(io("creating", &tmp))?;
        f.write_all(&text).map_err(io("writing", &tmp))?;
        f.sync_all().map_err(io("syncing", &tmp))?;
    }
    std::fs::rename(&tmp, &path).map_err(io("renaming", &tmp))?;
    sync_dir(dir)
}

/// `path` with every link resolved, as far as it exists: the part that
/// does not exist yet (a directory a backup will make) is kept as written
/// below the resolved part.
pub fn real_path(path: &Path) -> PathBuf {
    let mut rest = Vec::new();
    let mut at = path;
    loop {
        if let Ok(real) = std::fs::canonicalize(at) {
            return rest.iter().rev().fold(real, |p, name| p.join(name));
        }
        match (at.parent(), at.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                at = parent;
            }
            _ => return path.to_path_buf(),
        }
    }
}

pub fn sync_dir(dir: &Path) -> Result<(), TargetError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing", dir))?;
    Ok(())
}

/// The files a point of one disk reads: its own, then each point's below
/// it down to a full one, with the SHA-256 the manifest gives each.
pub struct PointFiles {
    /// The point's own file (top of the chain).
    pub file: PathBuf,
    digests: Vec<(PathBuf, String)>,
}

/// The files of `disk` at `point` (the newest when `None`) of the backup in
/// `dir`, once the chain qemu-img follows from the point's file is exactly
/// those files, down to the full point below it. Their bytes are checked by
/// [`PointFiles::verify`], which may run while they are read.
pub async fn point_files(dir: &Path, disk: &str, point: Option<u32>) -> Result<PointFiles, String> {
    let m = read_existing(dir).map_err(|e| e.to_string())?;
    // A merge a crash stopped is finished (or forgotten) first.
    recover(dir, &m).map_err(|e| e.to_string())?;
    let n = match point {
        Some(n) => n,
        None => m
            .points
            .last()
            .map(|p| p.point)
            .ok_or("the backup has no point")?,
    };
    let index = m
        .points
        .iter()
        .position(|p| p.point == n)
        .ok_or_else(|| format!("the backup has no point {n}"))?;
    let mut digests = Vec::new();
    for p in m.points[..=index].iter().rev() {
        let f = p
            .file_of(disk)
            .ok_or_else(|| format!("point {} has no disk {disk:?}", p.point))?;
        digests.push((dir.join(&f.file), f.sha256.clone()));
        if p.kind == BackupKind::Full {
            break;
        }
    }
    let file = digests[0].0.clone();
    let chain = hearth_qemu::img::backing_chain(&file)
        .await
        .map_err(|e| e.to_string())?;
    let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let got: Vec<PathBuf> = chain
        .iter()
        .map(|i| canon(Path::new(&i.filename)))
        .collect();
    let want: Vec<PathBuf> = digests.iter().map(|(p, _)| canon(p)).collect();
    if got != want {
        return Err(format!(
            "the files of point {n} chain to {got:?}, not to the backup's own {want:?}"
        ));
    }
    Ok(PointFiles { file, digests })
}

impl PointFiles {
    /// Each file's SHA-256 against the manifest's.
    pub async fn verify(&self) -> Result<(), String> {
        for (path, sha) in &self.digests {
            let got = super::copy::digest(path).await.map_err(|e| e.to_string())?;
            if &got != sha {
                return Err(format!(
                    "{} has SHA-256 {got}, the manifest says {sha}",
                    path.display()
                ));
            }
        }
        Ok(())
    }
}

const MERGED: &str = ".merged";

/// Finishes or forgets a merge a crash stopped, deciding from the bytes: a
/// `FILE.merged` whose SHA-256 is the one the manifest gives for `FILE` was
/// committed (it takes `FILE`'s place); any other is not (it goes). Runs
/// before the sweep, which would otherwise take the file below an
/// unfinished merge. Returns the files renamed.
pub fn recover(dir: &Path, m: &Manifest) -> Result<Vec<PathBuf>, TargetError> {
    let mut renamed = Vec::new();
    for f in m.points.iter().flat_map(|p| p.files.iter()) {
        let path = dir.join(&f.file);
        let merged = dir.join(format!("{}{MERGED}", f.file));
        if !merged.exists() {
            continue;
        }
        let (sha, _) = sha256_of(&merged)?;
        if sha == f.sha256 {
            std::fs::rename(&merged, &path).map_err(io("renaming", &merged))?;
            sync_dir(path.parent().unwrap_or(dir))?;
            renamed.push(path);
        } else {
            std::fs::remove_file(&merged).map_err(io("removing", &merged))?;
        }
    }
    Ok(renamed)
}

/// Keeps the newest `keep` points: the oldest kept one becomes full (when
/// it is not) by flattening its chain into a new file, and the points below
/// it go. Write order, per merge: the flattened file written beside the
/// point's file (`FILE.merged`), synced and checked; the manifest without
/// the older points, naming the new file's SHA-256 (the commit); the
/// flattened file renamed over the point's own name (so the points above,
/// which name it as their backing file, read the same bytes through it);
/// then the older files removed. [`recover`] finishes a crash in between.
pub async fn keep_newest(dir: &Path, mut m: Manifest, keep: u32) -> Result<Manifest, String> {
    let keep = keep.max(1) as usize;
    if m.points.len() <= keep {
        return Ok(m);
    }
    let first_kept = m.points.len() - keep;
    let mut kept = m.points.split_off(first_kept);
    let dropped = std::mem::take(&mut m.points);
    let oldest = &mut kept[0];
    let mut renames = Vec::new();
    if oldest.kind == BackupKind::Incremental {
        for f in oldest.files.iter_mut() {
            let path = dir.join(&f.file);
            let merged = dir.join(format!("{}{MERGED}", f.file));
            let partial = dir.join(format!("{}{MERGED}.partial", f.file));
            let _ = std::fs::remove_file(&partial);
            let written = async {
                hearth_qemu::img::QemuImg::locate()
                    .map_err(|e| e.to_string())?
                    .with_timeout(crate::snapshot::export::CONVERT_TIMEOUT)
                    .convert_standalone(&path, "qcow2", &partial, "qcow2")
                    .await
                    .map_err(|e| e.to_string())?;
                let w = super::copy::finish(&partial, 0, true)
                    .await
                    .map_err(|e| e.to_string())?;
                let sha = w.sha256.unwrap_or_default();
                std::fs::rename(&partial, &merged)
                    .map_err(|e| io("renaming", &partial)(e).to_string())?;
                sync_dir(merged.parent().unwrap_or(dir)).map_err(|e| e.to_string())?;
                Ok::<_, String>((sha, w.size))
            }
            .await;
            let (sha, size) = match written {
                Ok(w) => w,
                Err(e) => {
                    let _ = std::fs::remove_file(&partial);
                    for (_, m) in &renames {
                        let _ = std::fs::remove_file(m);
                    }
                    return Err(e);
                }
            };
            f.sha256 = sha;
            f.size = size;
            renames.push((path, merged));
        }
        oldest.kind = BackupKind::Full;
    }
    m.points = kept;
    commit(dir, &m).map_err(|e| e.to_string())?;
    for (path, merged) in &renames {
        std::fs::rename(merged, path).map_err(|e| io("renaming", merged)(e).to_string())?;
        sync_dir(path.parent().unwrap_or(dir)).map_err(|e| e.to_string())?;
    }
    for p in &dropped {
        for f in &p.files {
            let _ = std::fs::remove_file(dir.join(&f.file));
        }
    }
    Ok(m)
}

/// `DISK/NNNN.qcow2`, relative to the target.
pub fn file_name(disk: &str, point: u32) -> String {
    format!("{disk}/{point:04}.qcow2")
}

/// Removes what no point of `m` lists under the disks' folders: the
/// `.partial` files of a copy a crash stopped, and finished files of a
/// point whose manifest write never happened. Returns what it removed.
pub fn sweep(dir: &Path, m: &Manifest) -> Result<Vec<PathBuf>, TargetError> {
    let listed: std::collections::BTreeSet<PathBuf> = m
        .points
        .iter()
        .flat_map(|p| p.files.iter().map(|f| dir.join(&f.file)))
        .collect();
    let mut removed = Vec::new();
    let _ = std::fs::remove_file(dir.join(format!("{MANIFEST}.tmp")));
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(removed);
    };
    for sub in entries.flatten() {
        if !sub.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Ok(files) = std::fs::read_dir(sub.path()) else {
            continue;
        };
        for f in files.flatten() {
            let p = f.path();
            let name = f.file_name().to_string_lossy().into_owned();
            let ours = name.ends_with(".qcow2")
                || name.ends_with(".qcow2.partial")
                || name.ends_with(".qcow2.merged")
                || name.ends_with(".qcow2.merged.partial");
            if ours && !listed.contains(&p) {
                std::fs::remove_file(&p).map_err(io("removing", &p))?;
                removed.push(p);
            }
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(n: u32, disk: &str) -> Point {
        Point {
            point: n,
            backup: format!("b{n}"),
            kind: if n == 1 {
                BackupKind::Full
            } else {
                BackupKind::Incremental
            },
            cut_time: None,
            checkpoint: format!("b{n}-cp"),
            files: vec![BackupFile {
                disk: disk.into(),
                file: file_name(disk, n),
                sha256: "00".into(),
                size: 1,
                virtual_size: 1,
            }],
            virtual_machine_spec: None,
            reason_full: None,
            copy: None,
        }
    }

    #[test]
    fn recovery_decides_a_merge_from_the_bytes() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("root")).unwrap();
        let mut m = read(dir.path(), "app").unwrap();
        m.points.push(point(2, "root"));
        let file = dir.path().join("root/0002.qcow2");
        let merged = dir.path().join("root/0002.qcow2.merged");
        // Committed: the manifest names the merged bytes.
        std::fs::write(&file, b"old").unwrap();
        std::fs::write(&merged, b"new").unwrap();
        m.points[0].files[0].sha256 = sha256_of(&merged).unwrap().0;
        assert_eq!(
            recover(dir.path(), &m).unwrap(),
            std::slice::from_ref(&file)
        );
        assert_eq!(std::fs::read(&file).unwrap(), b"new");
        assert!(!merged.exists());
        // Not committed: the manifest still names the old bytes.
        std::fs::write(&merged, b"newer").unwrap();
        m.points[0].files[0].sha256 = sha256_of(&file).unwrap().0;
        assert!(recover(dir.path(), &m).unwrap().is_empty());
        assert_eq!(std::fs::read(&file).unwrap(), b"new");
        assert!(!merged.exists());
    }

    #[test]
    fn a_committed_manifest_reads_back_and_unlisted_files_are_swept() {
        let dir = tempfile::tempdir().unwrap();
        let empty = read(dir.path(), "app").unwrap();
        assert!(empty.points.is_empty());
        let mut m = empty;
        m.points.push(point(1, "root"));
        commit(dir.path(), &m).unwrap();
        assert_eq!(read(dir.path(), "app").unwrap(), m);
        assert!(matches!(
            read(dir.path(), "db"),
            Err(TargetError::OtherVm { .. })
        ));
        std::fs::create_dir_all(dir.path().join("root")).unwrap();
        for f in [
            "0001.qcow2",
            "0002.qcow2",
            "0002.qcow2.partial",
            "notes.txt",
        ] {
            std::fs::write(dir.path().join("root").join(f), b"x").unwrap();
        }
        let removed = sweep(dir.path(), &m).unwrap();
        assert_eq!(removed.len(), 2, "{removed:?}");
        assert!(dir.path().join("root/0001.qcow2").exists());
        assert!(dir.path().join("root/notes.txt").exists());
        assert!(!dir.path().join("root/0002.qcow2").exists());
    }
}
