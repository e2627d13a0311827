//! Writing one disk of a backup point into the target, from the cut's own
//! layers (never the live disk): a full point is a new qcow2 holding every
//! cluster of the cut's chain with data; an incremental point is a qcow2
//! backed by the previous point's file holding what the layers above the
//! previous checkpoint hold.
//!
//! An incremental point is written by hearth itself when those layers are
//! plain qcow2 (`hearth_qemu::qcow2`): their cluster maps read from their
//! own tables, the point written front to back and hashed as it goes. Any
//! layer outside that subset, and every full point, goes through `qemu-img
//! convert`: one run per layer for an incremental (from the lowest, each
//! adding what its own layer holds: convert over a backing file copies the
//! source's top layer alone), then `qemu-img check`. The file is written
//! under `.partial` and fsynced; renaming it is the caller's, after every
//! disk is done.

use super::io;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

use hearth_qemu::img::{self, CopyInto, Extent};
use hearth_qemu::qcow2;

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
    #[error(transparent)]
    Qcow2(#[from] qcow2::Qcow2Error),
    #[error("writing {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: qcow2::WriteError,
    },
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

/// What one disk's file takes, and how many bytes.
#[derive(Debug)]
pub struct Plan {
    how: How,
    /// The bytes the point holds: data and zeroes.
    pub bytes: u64,
    /// The data among them (zeroes are not read).
    data: u64,
}

#[derive(Debug)]
enum How {
    /// `qemu-img convert` runs.
    Convert {
        /// The layers copied from, lowest first, each with the bytes it
        /// is the top of (its share of the progress).
        passes: Vec<(PathBuf, u64)>,
        /// `Some(file name)`: over the previous point's file; `None`: whole.
        backing: Option<String>,
    },
    /// An incremental point written by hearth from the layers' own maps.
    Direct {
        /// The layers above the previous checkpoint, top first.
        layers: Vec<qcow2::Layer>,
        clusters: BTreeMap<u64, qcow2::Cluster>,
        cluster_bits: u32,
        virtual_size: u64,
        /// The previous point's file name.
        backing: String,
    },
}

/// The point of `layer`'s chain through `qemu-img`: a full one (`over`
/// None) holds every extent with data; an incremental one the extents some
/// layer above the previous checkpoint holds, copied layer by layer.
pub async fn plan(layer: &Path, over: Option<Over>) -> Result<Plan, CopyError> {
    plan_from(layer, &extents(layer).await?, over)
}

/// An incremental point of a disk of `virtual_size`: read and written by
/// hearth when every layer above the previous checkpoint is a qcow2 it
/// reads itself, else through `qemu-img` ([`plan`]).
pub async fn plan_incremental(
    layer: &Path,
    virtual_size: u64,
    over: Over,
) -> Result<Plan, CopyError> {
    check_depth(layer, &over)?;
    let (top, file) = (
        over.chain[..over.depth as usize].to_vec(),
        over.file.clone(),
    );
    let direct = tokio::task::spawn_blocking(move || plan_direct(&top, virtual_size, file))
        .await
        .map_err(|e| CopyError::Join(e.to_string()))?;
    match direct {
        Ok(plan) => Ok(plan),
        Err(why) => {
            tracing::info!(layer = %layer.display(), %why, "copying through qemu-img");
            plan(layer, Some(over)).await
        }
    }
}

/// At most this many clusters in the layers above the previous checkpoint
/// for a copy by hearth (their maps take ~60 bytes a cluster: 64 MiB here,
/// 64 GiB of changes in 64 KiB clusters); more go through `qemu-img`.
const MAX_DIRECT_CLUSTERS: usize = 1 << 20;

/// The clusters of `layers` (top first): for each guest cluster, what the
/// highest layer that holds it holds.
fn plan_direct(layers: &[PathBuf], virtual_size: u64, backing: String) -> Result<Plan, String> {
    let mut left = MAX_DIRECT_CLUSTERS;
    let mut open = Vec::new();
    for l in layers {
        let layer = qcow2::Layer::open(l, left).map_err(|e| e.to_string())?;
        left -= layer.clusters.len();
        open.push(layer);
    }
    let layers = open;
    let Some(cluster_bits) = layers.first().map(|l| l.header.cluster_bits) else {
        return Err("no layer above the checkpoint".into());
    };
    for l in &layers {
        if l.header.cluster_bits != cluster_bits || cluster_bits < 12 {
            return Err(format!(
                "{}: clusters of 2^{} bytes (2^{cluster_bits} at the top)",
                l.path.display(),
                l.header.cluster_bits
            ));
        }
        if l.header.size != virtual_size {
            return Err(format!(
                "{}: {} bytes, the disk {virtual_size}",
                l.path.display(),
                l.header.size
            ));
        }
    }
    let mut clusters = BTreeMap::new();
    for (source, l) in layers.iter().enumerate() {
        for &(g, e) in &l.clusters {
            clusters.entry(g).or_insert(match e {
                qcow2::Entry::Data(at) => qcow2::Cluster::Data { source, at },
                qcow2::Entry::Zero => qcow2::Cluster::Zero,
            });
        }
    }
    let cs = 1u64 << cluster_bits;
    let len = |g: u64| cs.min(virtual_size - g * cs);
    let bytes = clusters.keys().map(|&g| len(g)).sum();
    let data = clusters
        .iter()
        .filter(|(_, c)| matches!(c, qcow2::Cluster::Data { .. }))
        .map(|(&g, _)| len(g))
        .sum();
    Ok(Plan {
        how: How::Direct {
            layers,
            clusters,
            cluster_bits,
            virtual_size,
            backing,
        },
        bytes,
        data,
    })
}

/// `qemu-img map` of `layer`'s chain: every extent, with the depth of the
/// layer that holds it.
pub async fn extents(layer: &Path) -> Result<Vec<Extent>, CopyError> {
    Ok(img::map(layer, TIMEOUT).await?)
}

/// Depth 0 would make the cut's own new layer the previous checkpoint's.
fn check_depth(layer: &Path, over: &Over) -> Result<(), CopyError> {
    if over.depth == 0 || over.chain.len() <= over.depth as usize {
        return Err(CopyError::ShortChain {
            layer: layer.to_path_buf(),
            have: over.chain.len(),
            depth: over.depth,
        });
    }
    Ok(())
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
            how: How::Convert {
                passes: vec![(layer.to_path_buf(), data)],
                backing: None,
            },
            bytes: data,
            data,
        });
    };
    check_depth(layer, &over)?;
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
        how: How::Convert {
            passes,
            backing: Some(over.file),
        },
        bytes: extents.iter().map(|e| e.length).sum(),
        data: extents.iter().filter(|e| e.data).map(|e| e.length).sum(),
    })
}

/// Writes `plan` into a new file at `out`, then syncs it, and hashes it
/// when `hash` (a file a manifest names); a file of `qemu-img` is also
/// checked.
pub async fn write(
    plan: Plan,
    out: &Path,
    progress: Progress,
    hash: bool,
) -> Result<Written, CopyError> {
    let (passes, backing) = match plan.how {
        How::Convert { passes, backing } => (passes, backing),
        How::Direct {
            layers,
            clusters,
            cluster_bits,
            virtual_size,
            backing,
        } => {
            let out = out.to_path_buf();
            let image = Direct {
                layers,
                clusters,
                cluster_bits,
                virtual_size,
                backing,
                data: plan.data,
            };
            let before = progress.load(Ordering::Relaxed);
            let written = tokio::task::spawn_blocking(move || {
                image.write(&out, &progress, hash).map(|w| (w, progress))
            })
            .await
            .map_err(|e| CopyError::Join(e.to_string()))?;
            let (written, progress) = written?;
            progress.store(before + plan.bytes, Ordering::Relaxed);
            return Ok(written);
        }
    };
    let qemu_img = img::QemuImg::locate()
        .map_err(img::ImgError::from)?
        .with_timeout(TIMEOUT);
    for (i, (source, share)) in passes.iter().enumerate() {
        let into = match (&backing, i) {
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

/// An incremental point hearth writes itself.
struct Direct {
    layers: Vec<qcow2::Layer>,
    clusters: BTreeMap<u64, qcow2::Cluster>,
    cluster_bits: u32,
    virtual_size: u64,
    backing: String,
    data: u64,
}

impl Direct {
    /// The file, written in one pass (hashed as it goes), then fsynced.
    /// Not `qemu-img check`ed: every cluster of it is placed and counted
    /// before the first byte, and the tests check the writer against QEMU.
    fn write(self, out: &Path, progress: &Progress, hash: bool) -> Result<Written, CopyError> {
        let mut sink = super::sink::Sink::create(out, hash)?;
        let image = qcow2::NewImage {
            virtual_size: self.virtual_size,
            cluster_bits: self.cluster_bits,
            backing_file: &self.backing,
            backing_format: "qcow2",
        };
        let layers = &self.layers;
        image
            .write(
                &self.clusters,
                |source, at, buf| {
                    layers[source]
                        .read_cluster(at, buf)
                        .map_err(std::io::Error::other)
                },
                &mut sink,
                |n| {
                    progress.fetch_add(n, Ordering::Relaxed);
                },
            )
            .map_err(|source| CopyError::Write {
                path: out.to_path_buf(),
                source,
            })?;
        let (size, sha256) = sink.finish()?;
        Ok(Written {
            bytes_read: self.data,
            size,
            sha256,
        })
    }
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

    /// The plan of an incremental point both ways: hearth's own (which
    /// must be taken for these plain layers) or `qemu-img`'s.
    async fn incremental(layer: &Path, virtual_size: u64, over: Over, direct: bool) -> Plan {
        let plan = match direct {
            true => plan_incremental(layer, virtual_size, over).await.unwrap(),
            false => plan(layer, Some(over)).await.unwrap(),
        };
        assert_eq!(matches!(plan.how, How::Direct { .. }), direct, "{plan:?}");
        plan
    }

    /// Zeroes written above the checkpoint go into the incremental as
    /// zeroes that read as such over the previous point's data, and take no
    /// space.
    #[tokio::test]
    async fn zeroes_written_since_the_checkpoint_are_zero_clusters_over_older_data() {
        zeroes_over_older_data(true).await;
        zeroes_over_older_data(false).await;
    }

    async fn zeroes_over_older_data(direct: bool) {
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
        let plan = incremental(&layer, 8 << 20, over, direct).await;
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
        run("qemu-img", &["check", "-q", "point.qcow2"], d);
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
        two_layers_above(true).await;
        two_layers_above(false).await;
    }

    async fn two_layers_above(direct: bool) {
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
        let plan = incremental(&layer, 16 << 20, over, direct).await;
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
        run("qemu-img", &["check", "-q", "point.qcow2"], d);
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
        let How::Convert { passes, backing } = &p.how else {
            panic!("{p:?}")
        };
        assert_eq!(
            passes,
            &[(PathBuf::from("/l/1"), 10), (PathBuf::from("/l/0"), 10)]
        );
        assert_eq!((p.bytes, p.data, backing.as_deref()), (20, 15, Some("p")));
        assert!(matches!(
            plan_from(Path::new("/l/0"), &map, Some(over(4))),
            Err(CopyError::ShortChain { .. })
        ));
        assert!(matches!(
            plan_from(Path::new("/l/0"), &map, Some(over(0))),
            Err(CopyError::ShortChain { .. })
        ));
        let full = plan_from(Path::new("/l/0"), &map, None).unwrap();
        let How::Convert { passes, .. } = &full.how else {
            panic!("{full:?}")
        };
        assert_eq!((full.bytes, passes.len()), (20, 1));
    }
}
