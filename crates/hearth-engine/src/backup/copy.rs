//! Writing one disk of a backup point into the target, from the cut's own
//! layers (never the live disk): a full point is a new qcow2 holding every
//! cluster of the cut's chain with data; an incremental point is a qcow2
//! backed by the previous point's file holding what the layers above the
//! previous checkpoint hold. Both are `qemu-img convert` runs, one per
//! layer for an incremental (from the lowest, each adding what its own
//! layer holds: convert over a backing file copies the source's top layer
//! alone). The file is written under `.partial`, fsynced, checked and
//! (for a manifest) hashed; renaming it is the caller's, after every disk
//! is done.

use super::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

use hearth_qemu::img::{self, CopyInto, Extent};

const TIMEOUT: Duration = Duration::from_secs(6 * 3600);

#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error(transparent)]
    Img(#[from] img::ImgError),
    #[error(transparent)]
    File(#[from] super::FileError),
    #[error("{} is not sound after writing: {report}", path.display())]
    Check { path: PathBuf, report: String },
    #[error(
        "the chain of {} has {have} file(s); the previous checkpoint is {depth} below it",
        layer.display()
    )]
    ShortChain {
        layer: PathBuf,
        have: usize,
        depth: u32,
    },
    #[error("the copy task failed: {0}")]
    Join(String),
}

/// Where copies of an older hearthd (through FUSE exports) had their
/// mounts: `STATE/backups/...`.
fn work_root(state_dir: &Path) -> PathBuf {
    state_dir.join("backups")
}

/// At start-up: kills storage daemons an older hearthd's copies left (it
/// exported the layers through FUSE), unmounts their exports, removes the
/// directories.
pub fn sweep(state_dir: &Path) {
    hearth_qemu::storage_daemon::clear_work_dir(&work_root(state_dir), "backup copies");
}

/// What writing one file took.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Written {
    pub bytes_read: u64,
    pub size: u64,
    /// Only for a file a manifest names.
    pub sha256: Option<String>,
}

/// The extents an incremental point holds: those some layer above the
/// previous checkpoint's (at `depth` in the chain) holds.
pub fn changed(extents: &[Extent], depth: u32) -> Vec<Extent> {
    extents
        .iter()
        .filter(|e| e.present && e.depth < depth)
        .cloned()
        .collect()
}

/// Bytes copied so far, for the status while a copy runs.
pub type Progress = std::sync::Arc<std::sync::atomic::AtomicU64>;

/// Where an incremental point starts: the previous checkpoint's depth in
/// the cut's chain, the chain (top first), the previous point's file name.
pub struct Over {
    pub depth: u32,
    pub chain: Vec<PathBuf>,
    pub file: String,
}

/// What one disk's file takes: the runs, and how many bytes.
#[derive(Debug)]
pub struct Plan {
    /// The layers copied from, lowest first, each with the bytes it is
    /// the top of (its share of the progress).
    passes: Vec<(PathBuf, u64)>,
    /// The bytes the point holds: data and zeroes.
    pub bytes: u64,
    /// The data among them (zeroes are not read).
    data: u64,
    /// `Some(file name)`: over the previous point's file; `None`: whole.
    backing: Option<String>,
}

/// The point of `layer`'s chain: a full one (`over` None) holds every
/// extent with data; an incremental one the extents some layer above the
/// previous checkpoint holds, copied layer by layer.
pub async fn plan(layer: &Path, over: Option<Over>) -> Result<Plan, CopyError> {
    plan_from(layer, &extents(layer).await?, over)
}

/// `qemu-img map` of `layer`'s chain: every extent, with the depth of the
/// layer that holds it.
pub async fn extents(layer: &Path) -> Result<Vec<Extent>, CopyError> {
    Ok(img::map(layer, TIMEOUT).await?)
}

/// [`plan`] from the chain's extents, already read.
pub fn plan_from(layer: &Path, map: &[Extent], over: Option<Over>) -> Result<Plan, CopyError> {
    let Some(over) = over else {
        let data: u64 = map
            .iter()
            .filter(|e| e.present && e.data)
            .map(|e| e.length)
            .sum();
        return Ok(Plan {
            passes: vec![(layer.to_path_buf(), data)],
            bytes: data,
            data,
            backing: None,
        });
    };
    // Depth 0 would make the cut's own new layer the previous checkpoint's.
    if over.depth == 0 || over.chain.len() <= over.depth as usize {
        return Err(CopyError::ShortChain {
            layer: layer.to_path_buf(),
            have: over.chain.len(),
            depth: over.depth,
        });
    }
    let extents = changed(map, over.depth);
    let passes = (0..over.depth)
        .rev()
        .map(|d| {
            let share = extents
                .iter()
                .filter(|e| e.depth == d)
                .map(|e| e.length)
                .sum();
            (over.chain[d as usize].clone(), share)
        })
        .collect();
    Ok(Plan {
        passes,
        bytes: extents.iter().map(|e| e.length).sum(),
        data: extents.iter().filter(|e| e.data).map(|e| e.length).sum(),
        backing: Some(over.file),
    })
}

/// Writes `plan` into a new qcow2 at `out`, then syncs and checks it, and
/// hashes it when `hash` (a file a manifest names).
pub async fn write(
    plan: Plan,
    out: &Path,
    progress: Progress,
    hash: bool,
) -> Result<Written, CopyError> {
    let qemu_img = img::QemuImg::locate()
        .map_err(img::ImgError::from)?
        .with_timeout(TIMEOUT);
    for (i, (source, share)) in plan.passes.iter().enumerate() {
        let into = match (&plan.backing, i) {
            (None, _) => CopyInto::Whole,
            (Some(b), 0) => CopyInto::NewOver { backing: b },
            (Some(b), _) => CopyInto::Existing { backing: b },
        };
        let before = progress.load(Ordering::Relaxed);
        let mut shown = |percent: f64| {
            let now = before + (*share as f64 * percent / 100.0) as u64;
            progress.store(now, Ordering::Relaxed);
        };
        qemu_img.copy_into(source, out, into, &mut shown).await?;
        progress.store(before + share, Ordering::Relaxed);
    }
    finish(out, plan.data, hash).await
}

/// fsync and `qemu-img check` of a file just written (and its SHA-256
/// when `hash`, read at the same time); its length.
pub(super) async fn finish(out: &Path, bytes_read: u64, hash: bool) -> Result<Written, CopyError> {
    let path = out.to_path_buf();
    let size = tokio::task::spawn_blocking(move || -> Result<u64, super::FileError> {
        let f = std::fs::File::open(&path).map_err(io("opening", &path))?;
        f.sync_all().map_err(io("syncing", &path))?;
        Ok(f.metadata().map_err(io("reading", &path))?.len())
    })
    .await
    .map_err(|e| CopyError::Join(e.to_string()))??;
    let check = async {
        img::QemuImg::locate()
            .map_err(img::ImgError::from)?
            .check(out)
            .await
            .map_err(CopyError::from)
    };
    let digest = async {
        match hash {
            true => digest(out).await.map(Some),
            false => Ok(None),
        }
    };
    let (report, sha256) = tokio::join!(check, digest);
    let (report, sha256) = (report?, sha256?);
    if report.corruptions > 0 || !report.is_clean() {
        return Err(CopyError::Check {
            path: out.to_path_buf(),
            report: format!("{report:?}"),
        });
    }
    Ok(Written {
        bytes_read,
        size,
        sha256,
    })
}

/// The SHA-256 (hex) of a file a backup's manifest names. Only what goes
/// into a manifest is hashed (a restored disk's file is not).
pub async fn digest(path: &Path) -> Result<String, CopyError> {
    let path = path.to_path_buf();
    let (sha, _) = tokio::task::spawn_blocking(move || super::sha256_of(&path))
        .await
        .map_err(|e| CopyError::Join(e.to_string()))??;
    Ok(sha)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(start: u64, length: u64, depth: u32, present: bool, data: bool) -> Extent {
        Extent {
            start,
            length,
            depth,
            present,
            zero: !data,
            data,
        }
    }

    #[test]
    fn only_what_layers_above_the_checkpoint_hold_is_taken() {
        let map = [
            e(0, 10, 2, true, true),    // the checkpoint's own layer
            e(10, 5, 0, true, true),    // the new cut's layer
            e(15, 5, 1, true, false),   // zeroes written after the checkpoint
            e(20, 5, 3, true, true),    // below the checkpoint
            e(25, 50, 4, false, false), // nowhere
        ];
        let c = changed(&map, 2);
        assert_eq!(c, [map[1].clone(), map[2].clone()]);
        assert!(changed(&map, 0).is_empty());
    }

    fn run(program: &str, args: &[&str], dir: &Path) {
        let out = std::process::Command::new(program)
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap_or_else(|e| panic!("{program}: {e} (apt-get install qemu-utils)"));
        assert!(out.status.success(), "{program} {args:?}: {out:?}");
    }

    /// Zeroes written above the checkpoint go into the incremental as
    /// zeroes that read as such over the previous point's data, and take no
    /// space: through the real export (qemu-storage-daemon, FUSE).
    #[tokio::test]
    async fn zeroes_written_since_the_checkpoint_are_zero_clusters_over_older_data() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // The previous point: 8 MiB of 0xab. The chain now: that data, then
        // a layer where 1..3 MiB were zeroed and 5..6 MiB rewritten.
        run(
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "old.qcow2", "8M"],
            d,
        );
        run("qemu-io", &["-c", "write -P 0xab 0 8M", "old.qcow2"], d);
        run("cp", &["old.qcow2", "prev.qcow2"], d);
        run(
            "qemu-img",
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-F",
                "qcow2",
                "-b",
                "old.qcow2",
                "new.qcow2",
            ],
            d,
        );
        run(
            "qemu-io",
            &[
                "-c",
                "write -z 1M 2M",
                "-c",
                "write -P 0xcd 5M 1M",
                "new.qcow2",
            ],
            d,
        );
        let layer = d.join("new.qcow2");
        let over = Over {
            depth: 1,
            chain: vec![layer.clone(), d.join("old.qcow2")],
            file: "prev.qcow2".into(),
        };
        let plan = plan(&layer, Some(over)).await.unwrap();
        assert_eq!(plan.bytes, 3 << 20, "the zeroed and the rewritten ranges");
        let out = d.join("point.qcow2");
        let progress = Progress::default();
        let w = write(plan, &out, progress.clone(), false).await.unwrap();
        assert_eq!(w.bytes_read, 1 << 20, "only the rewritten data is read");
        assert_eq!(progress.load(std::sync::atomic::Ordering::Relaxed), 3 << 20);
        // The point over the previous one reads exactly the new chain.
        run(
            "qemu-img",
            &["compare", "-q", "new.qcow2", "point.qcow2"],
            d,
        );
        // 1 MiB of data and metadata, not 3 MiB.
        let size = std::fs::metadata(&out).unwrap().len();
        assert!(size < (3 << 20) / 2, "the point is {size} bytes");
    }

    /// Two layers above the checkpoint (a user's snapshot between two
    /// backups): each run adds its own layer's clusters, the lower first,
    /// so what the upper one rewrote wins, and zero bytes written as data
    /// over older data read as zeroes. Ground truth: `qemu-img compare`
    /// of the point over the previous one against the chain itself, and
    /// the point's own map (only the changed ranges are in it).
    #[tokio::test]
    async fn layers_above_the_checkpoint_add_up_lowest_first() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let q = |args: &[&str]| run("qemu-img", args, d);
        q(&["create", "-q", "-f", "qcow2", "cp.qcow2", "16M"]);
        run("qemu-io", &["-c", "write -P 0xab 0 16M", "cp.qcow2"], d);
        run("cp", &["cp.qcow2", "prev.qcow2"], d);
        for (name, backing) in [("mid.qcow2", "cp.qcow2"), ("top.qcow2", "mid.qcow2")] {
            q(&[
                "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", backing, name,
            ]);
        }
        // mid: 0..4 MiB of 0x11, 8..9 MiB of zero bytes (data, not a
        // zeroed range); top: 2..3 MiB of 0x22 over mid's.
        run(
            "qemu-io",
            &[
                "-c",
                "write -P 0x11 0 4M",
                "-c",
                "write -P 0 8M 1M",
                "mid.qcow2",
            ],
            d,
        );
        run("qemu-io", &["-c", "write -P 0x22 2M 1M", "top.qcow2"], d);
        let layer = d.join("top.qcow2");
        let over = Over {
            depth: 2,
            chain: vec![layer.clone(), d.join("mid.qcow2"), d.join("cp.qcow2")],
            file: "prev.qcow2".into(),
        };
        let plan = plan(&layer, Some(over)).await.unwrap();
        assert_eq!(plan.bytes, 5 << 20);
        let out = d.join("point.qcow2");
        let progress = Progress::default();
        let w = write(plan, &out, progress.clone(), true).await.unwrap();
        assert_eq!(progress.load(std::sync::atomic::Ordering::Relaxed), 5 << 20);
        run(
            "qemu-img",
            &["compare", "-q", "top.qcow2", "point.qcow2"],
            d,
        );
        // The point holds nothing past 9 MiB: the rest comes from prev.
        let map = img::map(&out, TIMEOUT).await.unwrap();
        let own: u64 = map
            .iter()
            .filter(|e| e.depth == 0 && e.present)
            .map(|e| e.length)
            .sum();
        assert_eq!(own, 5 << 20, "the point's own extents: {map:?}");
        let (sha, _) = super::super::sha256_of(&out).unwrap();
        assert_eq!(w.sha256.as_deref(), Some(sha.as_str()));
    }

    #[test]
    fn runs_go_from_the_lowest_layer_above_the_checkpoint_each_with_its_share() {
        let map = [
            e(0, 10, 0, true, true),
            e(10, 5, 1, true, true),
            e(15, 5, 2, true, true), // the checkpoint's layer
            e(20, 5, 1, true, false),
        ];
        let chain: Vec<PathBuf> = ["/l/0", "/l/1", "/l/2", "/l/3"].map(PathBuf::from).into();
        let over = |depth| Over {
            depth,
            chain: chain.clone(),
            file: "p".into(),
        };
        let p = plan_from(Path::new("/l/0"), &map, Some(over(2))).unwrap();
        assert_eq!(
            p.passes,
            [(PathBuf::from("/l/1"), 10), (PathBuf::from("/l/0"), 10)]
        );
        assert_eq!((p.bytes, p.data, p.backing.as_deref()), (20, 15, Some("p")));
        assert!(matches!(
            plan_from(Path::new("/l/0"), &map, Some(over(4))),
            Err(CopyError::ShortChain { .. })
        ));
        assert!(matches!(
            plan_from(Path::new("/l/0"), &map, Some(over(0))),
            Err(CopyError::ShortChain { .. })
        ));
        let full = plan_from(Path::new("/l/0"), &map, None).unwrap();
        assert_eq!((full.bytes, full.passes.len()), (20, 1));
    }
}
