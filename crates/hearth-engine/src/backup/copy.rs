//! Writing one disk of a backup point into the target, from the cut's own
//! layers (never the live disk), read through a read-only export of the
//! cut's chain: a full point is a new qcow2 holding every extent with data;
//! an incremental point is a qcow2 backed by the previous point's file
//! holding the extents the layers above the previous checkpoint hold. The file is written under `.partial`, flushed (the export's
//! daemon stopped), fsynced, checked and hashed; renaming it is the
//! caller's, after every disk is done.

use super::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hearth_qemu::img::{self, Extent};
use hearth_qemu::storage_daemon::{Access, FuseExport};

const TIMEOUT: Duration = Duration::from_secs(6 * 3600);
const START: Duration = Duration::from_secs(30);
const CHUNK: u64 = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error(transparent)]
    Img(#[from] img::ImgError),
    #[error(transparent)]
    Export(#[from] hearth_qemu::storage_daemon::DaemonError),
    #[error(transparent)]
    File(#[from] super::FileError),
    #[error("qemu-img create {}: {said}", path.display())]
    Create { path: PathBuf, said: String },
    #[error("{} is not sound after writing: {report}", path.display())]
    Check { path: PathBuf, report: String },
    #[error("the copy task failed: {0}")]
    Join(String),
}

/// Where the copies' exports are mounted: `STATE/backups/BACKUP/DISK`.
pub fn work_root(state_dir: &Path) -> PathBuf {
    state_dir.join("backups")
}

/// At start-up: kills storage daemons a killed hearthd left (normally gone
/// with it), unmounts their exports, removes the directories.
pub fn sweep(state_dir: &Path) {
    hearth_qemu::storage_daemon::clear_work_dir(&work_root(state_dir), "backup copies");
}

/// What writing one file took.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Written {
    pub bytes_read: u64,
    pub size: u64,
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

/// What one disk's file takes: the extents to copy, and how many bytes.
pub struct Plan {
    extents: Vec<Extent>,
    pub bytes: u64,
    /// `Some(file name)`: over the previous point's file; `None`: whole.
    backing: Option<String>,
}

/// The extents of `layer`'s chain a point holds: every one with data for a
/// full point (a new image reads zeroes elsewhere); for an incremental one
/// (`over`: the previous checkpoint's depth and the previous point's file
/// name), those some layer above the previous checkpoint holds.
pub async fn plan(layer: &Path, over: Option<(u32, String)>) -> Result<Plan, CopyError> {
    let map = img::map(layer, TIMEOUT).await?;
    let (extents, backing) = match over {
        None => (
            map.into_iter().filter(|e| e.present && e.data).collect(),
            None,
        ),
        Some((depth, file)) => (changed(&map, depth), Some(file)),
    };
    let bytes = extents.iter().map(|e: &Extent| e.length).sum();
    Ok(Plan {
        extents,
        bytes,
        backing,
    })
}

/// Writes `plan` from `layer`'s chain into a new qcow2 at `out` (backed by
/// the previous point's file for an incremental one), through a read-only
/// export of the chain and a writable one of the new file.
pub async fn write(
    layer: &Path,
    plan: Plan,
    out: &Path,
    virtual_size: u64,
    work: &Path,
    progress: Progress,
) -> Result<Written, CopyError> {
    let extents = plan.extents;
    create(out, plan.backing.as_deref(), virtual_size).await?;
    std::fs::create_dir_all(work).map_err(io("making", work))?;
    let src_mount = work.join("source");
    let dst_mount = work.join("target");
    for m in [&src_mount, &dst_mount] {
        let _ = hearth_qemu::storage_daemon::unmount(m);
        let _ = std::fs::remove_file(m);
    }
    let source = FuseExport::start_with(
        layer,
        &src_mount,
        &work.join("source.log"),
        START,
        Access::ReadOnly,
    )
    .await?;
    let target = FuseExport::start(out, &dst_mount, &work.join("target.log"), START).await?;
    let (src_dev, dst_dev) = (source.device().to_path_buf(), target.device().to_path_buf());
    let copied =
        tokio::task::spawn_blocking(move || copy_extents(&src_dev, &dst_dev, &extents, &progress))
            .await
            .map_err(|e| CopyError::Join(e.to_string()))?;
    // Both stopped whatever happened: the target's daemon flushes the
    // qcow2 on its way out.
    let stopped_target = target.stop(Duration::from_secs(120)).await;
    let stopped_source = source.stop(Duration::from_secs(30)).await;
    for m in [&src_mount, &dst_mount] {
        let _ = std::fs::remove_file(m);
    }
    let bytes_read = copied?;
    stopped_target?;
    stopped_source?;
    finish(out, bytes_read).await
}

/// A new qcow2 at `out`, over `backing` (a name in its folder) when given.
async fn create(out: &Path, backing: Option<&str>, size: u64) -> Result<(), CopyError> {
    let qemu_img = hearth_qemu::tools::find_binary("qemu-img")
        .map_err(|e| CopyError::Img(img::ImgError::MissingTool(e)))?;
    let dir = out.parent().unwrap_or(Path::new("/"));
    let mut command = tokio::process::Command::new(qemu_img);
    command
        .current_dir(dir)
        .args(["create", "-q", "-f", "qcow2"]);
    if let Some(b) = backing {
        command.args(["-F", "qcow2", "-b", b]);
    }
    let result = command
        .arg(out)
        .arg(size.to_string())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(io("running qemu-img create for", out))?;
    if !result.status.success() {
        return Err(CopyError::Create {
            path: out.to_path_buf(),
            said: String::from_utf8_lossy(&result.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// Copies each extent from the source export to the target export. A zero
/// extent must read as zeroes even where the target's backing holds data:
/// it is asked for as a zeroed range (`fallocate(ZERO_RANGE)`, which the
/// export turns into qcow2 zero clusters, taking no space), and written as
/// zero bytes only where that is refused.
fn copy_extents(
    src: &Path,
    dst: &Path,
    extents: &[Extent],
    progress: &Progress,
) -> Result<u64, CopyError> {
    let s = std::fs::File::open(src).map_err(io("opening", src))?;
    let d = std::fs::OpenOptions::new()
        .write(true)
        .open(dst)
        .map_err(io("opening", dst))?;
    let mut buf = vec![0u8; CHUNK as usize];
    let mut read = 0u64;
    for e in extents {
        let mut off = e.start;
        let end = e.start + e.length;
        while off < end {
            let n = (end - off).min(CHUNK) as usize;
            if e.data {
                s.read_exact_at(&mut buf[..n], off)
                    .map_err(io("reading", src))?;
                read += n as u64;
                d.write_all_at(&buf[..n], off).map_err(io("writing", dst))?;
            } else if !zero_range(&d, off, n as u64) {
                buf[..n].fill(0);
                d.write_all_at(&buf[..n], off).map_err(io("writing", dst))?;
            }
            off += n as u64;
            progress.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        }
    }
    d.sync_all().map_err(io("syncing", dst))?;
    Ok(read)
}

/// `len` bytes at `off` of `f` made zeroes without writing them; false
/// when the file cannot do that (the caller writes zeroes).
fn zero_range(f: &std::fs::File, off: u64, len: u64) -> bool {
    use std::os::fd::AsRawFd as _;
    let (Ok(off), Ok(len)) = (libc::off_t::try_from(off), libc::off_t::try_from(len)) else {
        return false;
    };
    // SAFETY: fallocate on a file descriptor this function borrows, with
    // plain integers; it touches no memory of ours.
    unsafe { libc::fallocate(f.as_raw_fd(), libc::FALLOC_FL_ZERO_RANGE, off, len) == 0 }
}

/// fsync and `qemu-img check` of a file just written; its length.
pub(super) async fn finish(out: &Path, bytes_read: u64) -> Result<Written, CopyError> {
    let path = out.to_path_buf();
    let size = tokio::task::spawn_blocking(move || -> Result<u64, super::FileError> {
        let f = std::fs::File::open(&path).map_err(io("opening", &path))?;
        f.sync_all().map_err(io("syncing", &path))?;
        Ok(f.metadata().map_err(io("reading", &path))?.len())
    })
    .await
    .map_err(|e| CopyError::Join(e.to_string()))??;
    let report = img::QemuImg::locate()
        .map_err(img::ImgError::from)?
        .check(out)
        .await?;
    if report.corruptions > 0 || !report.is_clean() {
        return Err(CopyError::Check {
            path: out.to_path_buf(),
            report: format!("{report:?}"),
        });
    }
    Ok(Written { bytes_read, size })
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
        let plan = plan(&layer, Some((1, "prev.qcow2".into()))).await.unwrap();
        assert_eq!(plan.bytes, 3 << 20, "the zeroed and the rewritten ranges");
        let out = d.join("point.qcow2");
        let progress = Progress::default();
        let w = write(
            &layer,
            plan,
            &out,
            8 << 20,
            &d.join("work"),
            progress.clone(),
        )
        .await
        .unwrap();
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
}
