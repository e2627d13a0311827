//! `hearth backup verify DIR`: every file of a backup target checked
//! against its manifest, from the bytes, without changing anything (a merge
//! a crash stopped is reported, not finished; a leftover file is named, not
//! removed). A backup copied elsewhere, or kept for months, can be trusted
//! before a restore needs it.
//!
//! Per file, in the manifest's order: it is there, its length and SHA-256
//! are the manifest's, and its qcow2 header chains as the backup wrote it
//! (a full point names no backing file; an incremental one names the file
//! of the point before it on the same disk, by its bare name). A damaged
//! file takes with it every later point of its disk up to the next sound
//! full one: those are the points a restore could not make.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use hearth_api::BackupKind;
use serde::Serialize;

use super::target::{self, Manifest};

/// One file checked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FileCheck {
    pub point: u32,
    pub disk: String,
    /// Relative to the target directory.
    pub file: String,
    pub size: u64,
    /// What is wrong with it; `None`: sound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

/// What a check says as it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Report {
    /// First: what will be read.
    Plan { files: u32, bytes: u64 },
    /// About once a second while files are hashed: bytes read of all.
    Progress { bytes_done: u64 },
    /// One file checked.
    File(FileCheck),
}

/// How often a check says how far it is.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// What a whole check found.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    pub points: u32,
    pub files: u32,
    pub bytes: u64,
    pub damaged_files: u32,
    /// Points a restore could not make (a file of theirs, or one below it
    /// in its disk's chain, is damaged), ascending.
    pub unrestorable_points: Vec<u32>,
    /// Files in the disks' folders that no point names: what a crash left
    /// (`.partial`, `.merged`: the next backup settles them) or someone
    /// put there.
    pub strays: Vec<String>,
}

/// A backup target whose manifest has been read (and nothing else).
pub struct Target {
    dir: PathBuf,
    manifest: Manifest,
}

impl Target {
    /// Reads the manifest of `dir` (an absolute path on hearthd's host).
    pub fn open(dir: &Path) -> Result<Target, String> {
        if !dir.is_absolute() {
            return Err(format!(
                "{} is not an absolute path (a path on hearthd's host)",
                dir.display()
            ));
        }
        let manifest = target::read_existing(dir).map_err(|e| e.to_string())?;
        Ok(Target {
            dir: dir.to_path_buf(),
            manifest,
        })
    }

    /// The VM the backup is of.
    pub fn virtual_machine_name(&self) -> &str {
        &self.manifest.virtual_machine_name
    }

    /// Checks the files of the points up to `at` (every point when
    /// `None`), telling `report` what it will read, how far it is, and
    /// each file's result as it is known.
    pub async fn verify(&self, at: Option<u32>, report: impl FnMut(Report)) -> Summary {
        verify(&self.dir, &self.manifest, at, report).await
    }
}

async fn verify(
    dir: &Path,
    m: &Manifest,
    at: Option<u32>,
    mut report: impl FnMut(Report),
) -> Summary {
    let checked = || m.points.iter().filter(|p| at.is_none_or(|n| p.point <= n));
    report(Report::Plan {
        files: checked().map(|p| p.files.len() as u32).sum(),
        bytes: checked().flat_map(|p| p.files.iter()).map(|f| f.size).sum(),
    });
    let read = Arc::new(AtomicU64::new(0));
    // A check dropped half-way (its client hung up) stops the hash that
    // runs on a blocking thread too.
    let stop = Arc::new(AtomicBool::new(false));
    let _stop_on_drop = StopOnDrop(stop.clone());
    let mut summary = Summary::default();
    // Per disk: the previous point's file name, and whether the chain up to
    // it is sound.
    let mut chain: BTreeMap<String, (String, bool)> = BTreeMap::new();
    let mut unrestorable = BTreeSet::new();
    for p in checked() {
        summary.points += 1;
        for f in &p.files {
            let below = chain.get(&f.disk).cloned();
            let checking = check_file(
                dir,
                p.kind,
                f,
                below.as_ref().map(|(n, _)| n.as_str()),
                &read,
                &stop,
            );
            tokio::pin!(checking);
            let mut tick = tokio::time::interval(PROGRESS_EVERY);
            tick.tick().await;
            let problem = loop {
                tokio::select! {
                    problem = &mut checking => break problem,
                    _ = tick.tick() => report(Report::Progress {
                        bytes_done: read.load(Ordering::Relaxed),
                    }),
                }
            };
            let sound_below = match p.kind {
                BackupKind::Full => true,
                BackupKind::Incremental => below.as_ref().is_some_and(|(_, ok)| *ok),
            };
            let sound = problem.is_none() && sound_below;
            if !sound {
                unrestorable.insert(p.point);
            }
            let name = Path::new(&f.file)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            chain.insert(f.disk.clone(), (name, sound));
            summary.files += 1;
            summary.bytes += f.size;
            if problem.is_some() {
                summary.damaged_files += 1;
            }
            report(Report::File(FileCheck {
                point: p.point,
                disk: f.disk.clone(),
                file: f.file.clone(),
                size: f.size,
                problem,
            }));
        }
    }
    summary.unrestorable_points = unrestorable.into_iter().collect();
    summary.strays = strays(dir, m);
    summary
}

/// What is wrong with one file of a point, if anything. `below`: the bare
/// name of the same disk's file in the point before (an incremental
/// point's backing file).
async fn check_file(
    dir: &Path,
    kind: BackupKind,
    f: &hearth_api::BackupFile,
    below: Option<&str>,
    read: &Arc<AtomicU64>,
    stop: &Arc<AtomicBool>,
) -> Option<String> {
    let inside = Path::new(&f.file)
        .components()
        .all(|c| matches!(c, std::path::Component::Normal(_)));
    if !inside {
        return Some("the manifest names a path outside the directory".into());
    }
    let path = dir.join(&f.file);
    let len = match std::fs::symlink_metadata(&path) {
        Ok(m) if m.file_type().is_file() => m.len(),
        Ok(_) => return Some("not a regular file".into()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Some("missing".into()),
        Err(e) => return Some(format!("cannot be read: {e}")),
    };
    if len != f.size {
        return Some(format!(
            "{len} bytes long, the manifest says {} (cut short or grown)",
            f.size
        ));
    }
    let hashing = {
        let (path, read, stop) = (path.clone(), read.clone(), stop.clone());
        tokio::task::spawn_blocking(move || super::sha256_counting(&path, &read, &stop))
    };
    let digest = match hashing.await {
        Ok(d) => d.map(|(sha, _)| sha).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match digest {
        Ok(sha) if sha == f.sha256 => {}
        Ok(sha) => {
            return Some(format!(
                "SHA-256 {sha}, the manifest says {} (its bytes changed)",
                f.sha256
            ));
        }
        Err(e) => return Some(format!("cannot be read: {e}")),
    }
    let header = std::fs::File::open(&path)
        .map_err(|e| e.to_string())
        .and_then(|file| hearth_qemu::qcow2::Header::read(&file, &path).map_err(|e| e.to_string()));
    let header = match header {
        Ok(h) => h,
        Err(e) => return Some(format!("not a qcow2 image hearth reads: {e}")),
    };
    let backing = header.backing_file.as_deref();
    match (kind, below) {
        (BackupKind::Full, _) if backing.is_some() => Some(format!(
            "a full point whose header names the backing file {:?}",
            backing.unwrap_or_default()
        )),
        (BackupKind::Incremental, None) => {
            Some("an incremental point with no point of its disk before it".into())
        }
        (BackupKind::Incremental, Some(want)) if backing != Some(want) => Some(format!(
            "its header names the backing file {:?}, not the point before it ({want:?})",
            backing.unwrap_or_default()
        )),
        _ => None,
    }
}

/// Sets its flag when dropped.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Files in the disks' folders that no point names.
fn strays(dir: &Path, m: &Manifest) -> Vec<String> {
    let named: BTreeSet<PathBuf> = m
        .points
        .iter()
        .flat_map(|p| p.files.iter())
        .map(|f| PathBuf::from(&f.file))
        .collect();
    let folders: BTreeSet<PathBuf> = named
        .iter()
        .filter_map(|f| f.parent().map(Path::to_path_buf))
        .collect();
    let mut out = Vec::new();
    for folder in folders {
        for e in std::fs::read_dir(dir.join(&folder))
            .into_iter()
            .flatten()
            .flatten()
        {
            let rel = folder.join(e.file_name());
            if !named.contains(&rel) {
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backup::target::Point;
    use hearth_api::BackupFile;
    use std::process::Command;

    fn qemu_img(dir: &Path, args: &[&str]) {
        let out = Command::new("qemu-img")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("qemu-img (apt-get install qemu-utils)");
        assert!(out.status.success(), "{args:?}: {out:?}");
    }

    /// Points 1 (full), 2 (over 1), 3 (full), 4 (over 3) of disk `d`, and
    /// a manifest that matches them.
    fn target(dir: &Path) -> Manifest {
        let d = dir.join("d");
        std::fs::create_dir_all(&d).unwrap();
        for (file, below) in [
            ("0001.qcow2", None),
            ("0002.qcow2", Some("0001.qcow2")),
            ("0003.qcow2", None),
            ("0004.qcow2", Some("0003.qcow2")),
        ] {
            let mut args = vec!["create", "-q", "-f", "qcow2"];
            if let Some(b) = below {
                args.extend(["-F", "qcow2", "-b", b]);
            }
            args.extend([file, "4M"]);
            qemu_img(&d, &args);
        }
        let point = |n: u32, kind| {
            let file = format!("d/{n:04}.qcow2");
            let (sha256, size) = crate::backup::sha256_of(&dir.join(&file)).unwrap();
            Point {
                point: n,
                backup: format!("b{n}"),
                kind,
                cut_time: None,
                checkpoint: format!("b{n}-cp"),
                files: vec![BackupFile {
                    disk: "d".into(),
                    file,
                    sha256,
                    size,
                    virtual_size: 4 << 20,
                }],
                virtual_machine_spec: None,
                reason_full: None,
                copy: None,
            }
        };
        Manifest {
            version: target::VERSION,
            virtual_machine_name: "vm".into(),
            points: vec![
                point(1, BackupKind::Full),
                point(2, BackupKind::Incremental),
                point(3, BackupKind::Full),
                point(4, BackupKind::Incremental),
            ],
        }
    }

    async fn check(dir: &Path, m: &Manifest, at: Option<u32>) -> (Vec<FileCheck>, Summary) {
        let mut seen = Vec::new();
        let mut plan = None;
        let s = verify(dir, m, at, |r| match r {
            Report::File(c) => seen.push(c),
            Report::Plan { files, bytes } => plan = Some((files, bytes)),
            Report::Progress { .. } => {}
        })
        .await;
        let (files, bytes) = plan.expect("the plan comes first");
        assert_eq!((files, bytes), (s.files, s.bytes));
        (seen, s)
    }

    #[tokio::test]
    async fn a_damaged_file_takes_the_points_over_it_up_to_the_next_full_one() {
        let dir = tempfile::tempdir().unwrap();
        let m = target(dir.path());
        let (seen, s) = check(dir.path(), &m, None).await;
        assert!(seen.iter().all(|c| c.problem.is_none()), "{seen:?}");
        assert_eq!((s.points, s.files, s.damaged_files), (4, 4, 0));
        assert!(
            s.unrestorable_points.is_empty() && s.strays.is_empty(),
            "{s:?}"
        );

        // One byte of point 1 changed: 1 and 2 are lost, 3 and 4 are not.
        let one = dir.path().join("d/0001.qcow2");
        let mut bytes = std::fs::read(&one).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&one, &bytes).unwrap();
        let (seen, s) = check(dir.path(), &m, None).await;
        assert!(
            seen[0].problem.as_deref().unwrap().contains("SHA-256"),
            "{seen:?}"
        );
        assert!(seen[1].problem.is_none(), "{seen:?}");
        assert_eq!(s.unrestorable_points, [1, 2]);
        assert_eq!(s.damaged_files, 1);
        let (_, s) = check(dir.path(), &m, Some(1)).await;
        assert_eq!((s.points, s.unrestorable_points), (1, vec![1]));
    }

    #[tokio::test]
    async fn a_header_that_chains_elsewhere_is_named_even_when_its_bytes_match() {
        let dir = tempfile::tempdir().unwrap();
        let mut m = target(dir.path());
        // Point 4 re-pointed at point 2's file, and the manifest made to
        // agree with its new bytes: only the header tells.
        let d = dir.path().join("d");
        qemu_img(
            &d,
            &[
                "rebase",
                "-u",
                "-F",
                "qcow2",
                "-b",
                "0002.qcow2",
                "0004.qcow2",
            ],
        );
        let (sha, size) = crate::backup::sha256_of(&d.join("0004.qcow2")).unwrap();
        m.points[3].files[0].sha256 = sha;
        m.points[3].files[0].size = size;
        std::fs::write(d.join("0005.qcow2.partial"), b"x").unwrap();
        let (seen, s) = check(dir.path(), &m, None).await;
        let why = seen[3].problem.as_deref().unwrap();
        assert!(
            why.contains("\"0002.qcow2\"") && why.contains("\"0003.qcow2\""),
            "{why}"
        );
        assert_eq!(s.unrestorable_points, [4]);
        assert_eq!(s.strays, ["d/0005.qcow2.partial"]);
        // A name leading out of the directory is not followed.
        m.points[1].files[0].file = "../d/0002.qcow2".into();
        let (seen, _) = check(dir.path(), &m, Some(2)).await;
        assert!(
            seen[1].problem.as_deref().unwrap().contains("outside"),
            "{seen:?}"
        );
        // A length that differs is said before any hashing.
        m.points[0].files[0].size += 1;
        let (seen, _) = check(dir.path(), &m, Some(1)).await;
        assert!(
            seen[0].problem.as_deref().unwrap().contains("bytes long"),
            "{seen:?}"
        );
    }
}
