//! A thin wrapper around `qemu-img`.
//!
//! Paths must be absolute: `qemu-img` treats `proto:...` filenames (including
//! `json:{...}`) as protocol specs, and an absolute path can never look like one.
//! Output is read with a bound and every run has a timeout (a hung NFS mount must
//! not hang a reconciler forever). Every run takes a slot of the program pool
//! (`programs`): however many objects want one, only so many run at once.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::programs;
use crate::tools::{MissingTool, find_binary};

pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
const MAX_STDOUT: usize = 1024 * 1024;
const MAX_STDERR: usize = 16 * 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageInfo {
    pub filename: String,
    pub virtual_size: u64,
    /// Bytes allocated on the host; 0 if qemu-img does not report it.
    pub actual_size: u64,
    pub format: String,
    /// As stored in the image header (may be relative to the image's directory).
    pub backing_filename: Option<String>,
    pub backing_format: Option<String>,
    /// qcow2's "corrupt" flag, when reported.
    pub corrupt: bool,
    /// qcow2's external data file, when it has one.
    pub data_file: Option<String>,
}

/// What `qemu-img check` found in a qcow2 image.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckReport {
    /// Metadata errors: the image is corrupt.
    pub corruptions: u64,
    /// Clusters allocated but unused: wasted space, harmless.
    pub leaks: u64,
    /// Errors that kept the check from finishing.
    pub check_errors: u64,
}

impl CheckReport {
    pub fn is_clean(&self) -> bool {
        self.corruptions == 0 && self.check_errors == 0
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ImgError {
    #[error(transparent)]
    MissingTool(#[from] MissingTool),
    #[error("image path {path} must be absolute")]
    NotAbsolute { path: PathBuf },
    #[error("image {path} already exists; refusing to overwrite it")]
    AlreadyExists { path: PathBuf },
    #[error("image format {0:?} is not a plain format name")]
    InvalidFormat(String),
    #[error("cannot start {binary}")]
    Spawn {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("qemu-img {operation} {path} failed ({status}): {stderr}")]
    Failed {
        operation: &'static str,
        path: PathBuf,
        status: String,
        stderr: String,
    },
    #[error("qemu-img {operation} {path} did not finish within {timeout:?}")]
    Timeout {
        operation: &'static str,
        path: PathBuf,
        timeout: Duration,
    },
    #[error("qemu-img info {path} printed unexpected output: {reason}")]
    BadOutput { path: PathBuf, reason: String },
}

/// A located `qemu-img` binary plus the timeout applied to each run.
#[derive(Debug, Clone)]
pub struct QemuImg {
    binary: PathBuf,
    timeout: Duration,
}

impl QemuImg {
    pub fn new(binary: impl Into<PathBuf>) -> Self {
        QemuImg {
            binary: binary.into(),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Finds `qemu-img` in `PATH`.
    pub fn locate() -> Result<Self, MissingTool> {
        find_binary("qemu-img").map(QemuImg::new)
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Creates an empty qcow2 image of `size_bytes`.
    pub async fn create_blank(&self, path: &Path, size_bytes: u64) -> Result<(), ImgError> {
        check_new_image(path)?;
        let args: Vec<OsString> = vec![
            "create".into(),
            "-q".into(),
            "-f".into(),
            "qcow2".into(),
            path.into(),
            size_bytes.to_string().into(),
        ];
        self.run("create", path, args).await?;
        private(path)
    }

    /// Creates a qcow2 overlay of `backing` (recorded by absolute path). Without
    /// `size` the overlay has the backing image's size.
    pub async fn create_overlay(
        &self,
        path: &Path,
        backing: &Path,
        backing_format: &str,
        size: Option<u64>,
    ) -> Result<(), ImgError> {
        self.overlay(path, backing, backing_format, size, true)
            .await
    }

    /// Like `create_overlay`, but without opening the backing image (`-u`):
    /// for an overlay over a layer that a running VM holds locked. The size
    /// must be given since it cannot be read from the backing image.
    pub async fn create_overlay_unopened(
        &self,
        path: &Path,
        backing: &Path,
        backing_format: &str,
        size: u64,
    ) -> Result<(), ImgError> {
        self.overlay(path, backing, backing_format, Some(size), false)
            .await
    }

    async fn overlay(
        &self,
        path: &Path,
        backing: &Path,
        backing_format: &str,
        size: Option<u64>,
        open_backing: bool,
    ) -> Result<(), ImgError> {
        check_new_image(path)?;
        check_absolute(backing)?;
        check_format(backing_format)?;
        let mut args: Vec<OsString> = vec!["create".into(), "-q".into()];
        if !open_backing {
            args.push("-u".into());
        }
        args.extend([
            "-f".into(),
            "qcow2".into(),
            "-b".into(),
            backing.into(),
            "-F".into(),
            backing_format.into(),
            path.into(),
        ]);
        if let Some(size) = size {
            args.push(size.to_string().into());
        }
        self.run("create", path, args).await?;
        private(path)
    }

    /// Writes `source` with its whole backing chain flattened into `dest`, a
    /// new image in `format` with no backing file (`qemu-img convert`; raw
    /// output is sparse). `-U`: `source` may be a layer below a running VM's
    /// head, which QEMU holds open; nothing writes to such a layer, so the
    /// read is consistent without the lock.
    pub async fn convert_standalone(
        &self,
        source: &Path,
        source_format: &str,
        dest: &Path,
        format: &str,
    ) -> Result<(), ImgError> {
        check_absolute(source)?;
        check_new_image(dest)?;
        check_format(source_format)?;
        check_format(format)?;
        let args: Vec<OsString> = vec![
            "convert".into(),
            "-q".into(),
            "-U".into(),
            "-f".into(),
            source_format.into(),
            "-O".into(),
            format.into(),
            source.into(),
            dest.into(),
        ];
        self.run("convert", dest, args).await.map(|_| ())
    }

    /// Copies clusters of the qcow2 `source` into the qcow2 `dest` in one
    /// `qemu-img convert` (out-of-order writes, zeroes as zero clusters),
    /// handing `progress` its percentage as it goes. What is copied, and
    /// into what, is `into`'s: see [`CopyInto`]. `-U`: `source` may be a
    /// layer below a running VM's head, which nothing writes to. The output
    /// is not synced: the caller syncs it before anything names it. The
    /// program dies with this process (`PR_SET_PDEATHSIG`; the pool starts
    /// it from a thread that lasts as long as the process), so a killed
    /// hearthd leaves no copy writing into a file it will remove.
    pub async fn copy_into(
        &self,
        source: &Path,
        dest: &Path,
        into: CopyInto<'_>,
        progress: &mut (dyn FnMut(f64) + Send),
    ) -> Result<(), ImgError> {
        check_absolute(source)?;
        match into {
            CopyInto::Existing { .. } => check_absolute(dest)?,
            _ => check_new_image(dest)?,
        }
        let mut command = tokio::process::Command::new(&self.binary);
        command.args(copy_args(source, dest, &into));
        if let Some(dir) = dest.parent() {
            // A backing file is named relative to the output's folder.
            command.current_dir(dir);
        }
        // SAFETY: prctl is async-signal-safe and touches only the child.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut meter = ProgressMeter::default();
        let mut watch = |piece: &[u8]| {
            if let Some(p) = meter.feed(piece) {
                progress(p);
            }
        };
        self.run_command("convert", dest, command, &mut watch)
            .await
            .map(|_| ())
    }

    /// Makes `new_backing` the backing file of `path` while keeping what
    /// `path` reads identical (`qemu-img rebase`, safe mode): every cluster
    /// that reads differently through the new backing chain than through the
    /// old one, and that `path` does not hold itself, is copied into `path`.
    /// The write order is not "header last": qemu-img writes the copied
    /// clusters, then the header naming the new backing, then the refcounts,
    /// `fdatasync`s, and only then the L2 tables that point at the copies.
    /// So only an exit 0 shows the rebase is done; a run killed part way can
    /// leave a header naming the new backing over old bytes (the caller
    /// sets the header back, see docs/snapshots.md). The image must not be
    /// open anywhere else (qemu-img takes its write lock).
    pub async fn rebase(
        &self,
        path: &Path,
        new_backing: &Path,
        backing_format: &str,
    ) -> Result<(), ImgError> {
        let args = rebase_args(path, new_backing, backing_format, false)?;
        self.run("rebase", path, args).await.map(|_| ())
    }

    /// Writes `new_backing` into `path`'s header and nothing else
    /// (`qemu-img rebase -u`): no cluster is copied, so what `path` reads
    /// changes unless the new backing reads as the old one did. For setting
    /// a merge's top back to the layer it was read through.
    pub async fn set_backing(
        &self,
        path: &Path,
        new_backing: &Path,
        backing_format: &str,
    ) -> Result<(), ImgError> {
        let args = rebase_args(path, new_backing, backing_format, true)?;
        // The header alone: quick, so not in the pool of copies.
        self.run("rebase -u", path, args).await.map(|_| ())
    }

    /// `qemu-img check -r leaks`: frees clusters that are allocated but not
    /// referenced (what a killed writer leaves). Never touches a referenced
    /// cluster, so what the image reads does not change.
    pub async fn repair_leaks(&self, path: &Path) -> Result<(), ImgError> {
        check_absolute(path)?;
        let args: Vec<OsString> = vec![
            "check".into(),
            "-q".into(),
            "-r".into(),
            "leaks".into(),
            "-f".into(),
            "qcow2".into(),
            path.into(),
        ];
        self.run("check", path, args).await.map(|_| ())
    }

    /// `qemu-img info` of one image. `-U` so it also works on images a running VM
    /// holds locked.
    pub async fn info(&self, path: &Path) -> Result<ImageInfo, ImgError> {
        check_absolute(path)?;
        let args: Vec<OsString> = vec![
            "info".into(),
            "--output=json".into(),
            "-U".into(),
            path.into(),
        ];
        let out = self.run("info", path, args).await?;
        parse_info_output(path, &out)
    }

    /// `qemu-img info -f FORMAT` of a file that is not open anywhere: the
    /// format is given, never probed, so qemu-img opens the file with that
    /// driver alone (see `probe` for why an image is never probed first).
    pub async fn info_as(&self, path: &Path, format: &str) -> Result<ImageInfo, ImgError> {
        check_absolute(path)?;
        check_format(format)?;
        let args: Vec<OsString> = vec![
            "info".into(),
            "--output=json".into(),
            "-f".into(),
            format.into(),
            path.into(),
        ];
        let out = self.run("info", path, args).await?;
        parse_info_output(path, &out)
    }

    /// The format qemu-img's probes detect. This opens the file with the
    /// detected driver: only for files `probe::sniff` has already found to
    /// be a qcow2 without references or raw.
    pub async fn detect_format(&self, path: &Path) -> Result<String, ImgError> {
        check_absolute(path)?;
        let args: Vec<OsString> = vec!["info".into(), "--output=json".into(), path.into()];
        let out = self.run("info", path, args).await?;
        Ok(parse_info_output(path, &out)?.format)
    }

    /// `qemu-img check` of a qcow2 image (read-only: nothing is repaired).
    pub async fn check(&self, path: &Path) -> Result<CheckReport, ImgError> {
        check_absolute(path)?;
        let args: Vec<OsString> = vec![
            "check".into(),
            "--output=json".into(),
            "-f".into(),
            "qcow2".into(),
            path.into(),
        ];
        // Exit 2 means corruptions, 3 leaks: both still print the report.
        let (status, out, err) = self.run_status("check", path, args).await?;
        let code = status.as_ref().ok().and_then(|s| s.code());
        if !matches!(code, Some(0 | 2 | 3)) {
            return Err(ImgError::Failed {
                operation: "check",
                path: path.to_owned(),
                status: match &status {
                    Ok(s) => s.to_string(),
                    Err(e) => format!("wait failed: {e}"),
                },
                stderr: String::from_utf8_lossy(&err).trim().to_owned(),
            });
        }
        let value: Value = serde_json::from_slice(&out).map_err(|e| ImgError::BadOutput {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        let n = |k: &str| value.get(k).and_then(Value::as_u64).unwrap_or(0);
        Ok(CheckReport {
            corruptions: n("corruptions"),
            leaks: n("leaks"),
            check_errors: n("check-errors"),
        })
    }

    /// The image and every image below it, top first. Lets a caller check that a
    /// user-supplied base image does not chain to files outside allowed roots.
    pub async fn backing_chain(&self, path: &Path) -> Result<Vec<ImageInfo>, ImgError> {
        check_absolute(path)?;
        let args: Vec<OsString> = vec![
            "info".into(),
            "--output=json".into(),
            "--backing-chain".into(),
            "-U".into(),
            path.into(),
        ];
        let out = self.run("info", path, args).await?;
        let bad = |reason: String| ImgError::BadOutput {
            path: path.to_owned(),
            reason,
        };
        let value: Value = serde_json::from_slice(&out).map_err(|e| bad(e.to_string()))?;
        let items = value
            .as_array()
            .ok_or_else(|| bad("--backing-chain output is not an array".into()))?;
        items
            .iter()
            .map(|v| parse_info(v).map_err(|e| bad(e.to_string())))
            .collect()
    }

    async fn run(
        &self,
        operation: &'static str,
        path: &Path,
        args: Vec<OsString>,
    ) -> Result<Vec<u8>, ImgError> {
        let mut command = tokio::process::Command::new(&self.binary);
        command.args(&args);
        self.run_command(operation, path, command, &mut |_| {})
            .await
    }

    /// [`QemuImg::run`] of a command made by the caller, `watch` seeing its
    /// stdout as it comes.
    async fn run_command(
        &self,
        operation: &'static str,
        path: &Path,
        command: tokio::process::Command,
        watch: &mut (dyn FnMut(&[u8]) + Send),
    ) -> Result<Vec<u8>, ImgError> {
        let (status, out, err) = self.run_status_of(operation, path, command, watch).await?;
        let failed = |status: String| ImgError::Failed {
            operation,
            path: path.to_owned(),
            status,
            stderr: String::from_utf8_lossy(&err).trim().to_owned(),
        };
        match status {
            Ok(s) if s.success() => Ok(out),
            Ok(s) => Err(failed(s.to_string())),
            Err(e) => Err(failed(format!("wait failed: {e}"))),
        }
    }

    /// Runs qemu-img in the program pool (`programs`), with the timeout;
    /// its exit status and bounded output.
    async fn run_status(
        &self,
        operation: &'static str,
        path: &Path,
        args: Vec<OsString>,
    ) -> Result<RunOutput, ImgError> {
        let mut command = tokio::process::Command::new(&self.binary);
        command.args(&args);
        self.run_status_of(operation, path, command, &mut |_| {})
            .await
    }

    async fn run_status_of(
        &self,
        operation: &'static str,
        path: &Path,
        command: tokio::process::Command,
        watch: &mut (dyn FnMut(&[u8]) + Send),
    ) -> Result<RunOutput, ImgError> {
        // Copies take time in proportion to the data: their own pool.
        let class = match operation {
            "convert" | "rebase" => programs::Class::Copy,
            _ => programs::Class::Quick,
        };
        let limits = programs::Limits {
            timeout: self.timeout,
            stdout: MAX_STDOUT,
            stderr: MAX_STDERR,
        };
        match programs::run_watched(command, class, limits, watch).await {
            Ok(f) => Ok((Ok(f.status), f.stdout, f.stderr)),
            Err(programs::RunError::Spawn(source)) => Err(ImgError::Spawn {
                binary: self.binary.clone(),
                source,
            }),
            Err(programs::RunError::Wait(e)) => Ok((Err(e), Vec::new(), Vec::new())),
            Err(programs::RunError::Timeout(_)) => Err(ImgError::Timeout {
                operation,
                path: path.to_owned(),
                timeout: self.timeout,
            }),
        }
    }
}

/// What [`QemuImg::copy_into`] copies, and into what.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyInto<'a> {
    /// A new qcow2 without a backing file, holding every cluster of the
    /// source's whole chain that holds data.
    Whole,
    /// A new qcow2 over `backing` (a qcow2, named relative to the output's
    /// folder), holding what the source's own layer holds (not the layers
    /// below it): data, and zeroes as zero clusters, which read as zeroes
    /// over whatever `backing` holds there.
    NewOver { backing: &'a str },
    /// The same into an existing qcow2 over `backing`: the layers above a
    /// point, one run each from the lowest, add up in it.
    Existing { backing: &'a str },
}

fn copy_args(source: &Path, dest: &Path, into: &CopyInto<'_>) -> Vec<OsString> {
    let mut args: Vec<OsString> = ["convert", "-p", "-U", "-W", "-f", "qcow2", "-O", "qcow2"]
        .map(OsString::from)
        .to_vec();
    match into {
        CopyInto::Whole => {}
        CopyInto::NewOver { backing } => {
            args.extend(["-B".into(), (*backing).into(), "-F".into(), "qcow2".into()])
        }
        CopyInto::Existing { backing } => args.extend([
            "-n".into(),
            "-B".into(),
            (*backing).into(),
            "-F".into(),
            "qcow2".into(),
        ]),
    }
    args.extend([source.into(), dest.into()]);
    args
}

/// Reads `qemu-img convert -p`'s lines (`    (12.34/100%)\r`), which may
/// arrive cut anywhere: the newest complete percentage of each piece.
#[derive(Debug, Default)]
struct ProgressMeter {
    partial: Vec<u8>,
}

impl ProgressMeter {
    fn feed(&mut self, piece: &[u8]) -> Option<f64> {
        self.partial.extend_from_slice(piece);
        let mut newest = None;
        while let Some(end) = self.partial.iter().position(|&b| b == b'\r' || b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=end).collect();
            let text = String::from_utf8_lossy(&line);
            if let Some(p) = text
                .trim()
                .strip_prefix('(')
                .and_then(|t| t.split_once('/'))
                .and_then(|(p, _)| p.parse::<f64>().ok())
            {
                newest = Some(p.clamp(0.0, 100.0));
            }
        }
        // A line never comes without its end: bound what waits for one.
        if self.partial.len() > 256 {
            self.partial.clear();
        }
        newest
    }
}

type RunOutput = (std::io::Result<std::process::ExitStatus>, Vec<u8>, Vec<u8>);

fn check_absolute(path: &Path) -> Result<(), ImgError> {
    if path.is_absolute() {
        Ok(())
    } else {
        Err(ImgError::NotAbsolute {
            path: path.to_owned(),
        })
    }
}

/// `qemu-img create` silently replaces an existing file; a disk must never be
/// clobbered by a retried reconcile, so refuse.
fn check_new_image(path: &Path) -> Result<(), ImgError> {
    check_absolute(path)?;
    if std::fs::symlink_metadata(path).is_ok() {
        return Err(ImgError::AlreadyExists {
            path: path.to_owned(),
        });
    }
    Ok(())
}

/// A format name as qemu-img spells them (`qcow2`, `raw`): never an option
/// string (`qcow2,backing=...`).
fn check_format(format: &str) -> Result<(), ImgError> {
    if format.is_empty()
        || !format
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return Err(ImgError::InvalidFormat(format.to_owned()));
    }
    Ok(())
}

fn parse_info_output(path: &Path, out: &[u8]) -> Result<ImageInfo, ImgError> {
    let value: Value = serde_json::from_slice(out).map_err(|e| ImgError::BadOutput {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    parse_info(&value).map_err(|e| ImgError::BadOutput {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

/// A field `qemu-img info` always prints, missing from its output.
#[derive(Debug, thiserror::Error)]
#[error("no {0}")]
struct MissingField(&'static str);

fn parse_info(v: &Value) -> Result<ImageInfo, MissingField> {
    let text = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    Ok(ImageInfo {
        filename: text("filename").ok_or(MissingField("filename"))?,
        virtual_size: v
            .get("virtual-size")
            .and_then(Value::as_u64)
            .ok_or(MissingField("virtual-size"))?,
        actual_size: v.get("actual-size").and_then(Value::as_u64).unwrap_or(0),
        format: text("format").ok_or(MissingField("format"))?,
        backing_filename: text("backing-filename"),
        backing_format: text("backing-filename-format"),
        corrupt: v
            .pointer("/format-specific/data/corrupt")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        data_file: v
            .pointer("/format-specific/data/data-file")
            .and_then(Value::as_str)
            .map(str::to_owned),
    })
}

/// A new image is root's alone (0600; qemu-img makes it 0644 under the
/// umask): QEMU gets it by descriptor, nobody needs it by path.
fn private(path: &Path) -> Result<(), ImgError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(|e| {
        ImgError::Failed {
            operation: "create",
            path: path.to_owned(),
            status: "created, but its mode could not be set to 0600".into(),
            stderr: e.to_string(),
        }
    })
}

/// [`QemuImg::create_blank`] with `qemu-img` from `PATH`.
pub async fn create_blank(path: &Path, size_bytes: u64) -> Result<(), ImgError> {
    QemuImg::locate()?.create_blank(path, size_bytes).await
}

/// [`QemuImg::create_overlay`] with `qemu-img` from `PATH`.
pub async fn create_overlay(
    path: &Path,
    backing: &Path,
    backing_format: &str,
    size: Option<u64>,
) -> Result<(), ImgError> {
    QemuImg::locate()?
        .create_overlay(path, backing, backing_format, size)
        .await
}

/// [`QemuImg::create_overlay_unopened`] with `qemu-img` from `PATH`.
pub async fn create_overlay_unopened(
    path: &Path,
    backing: &Path,
    backing_format: &str,
    size: u64,
) -> Result<(), ImgError> {
    QemuImg::locate()?
        .create_overlay_unopened(path, backing, backing_format, size)
        .await
}

/// [`QemuImg::convert_standalone`] with `qemu-img` from `PATH`, bounded by
/// `timeout` (a copy takes time in proportion to the disk's data).
pub async fn convert_standalone(
    source: &Path,
    source_format: &str,
    dest: &Path,
    format: &str,
    timeout: Duration,
) -> Result<(), ImgError> {
    QemuImg::locate()?
        .with_timeout(timeout)
        .convert_standalone(source, source_format, dest, format)
        .await
}

/// [`QemuImg::rebase`] with `qemu-img` from `PATH`, bounded by `timeout`
/// (the copy takes time in proportion to the data of the merged layers).
pub async fn rebase(
    path: &Path,
    new_backing: &Path,
    backing_format: &str,
    timeout: Duration,
) -> Result<(), ImgError> {
    QemuImg::locate()?
        .with_timeout(timeout)
        .rebase(path, new_backing, backing_format)
        .await
}

/// [`QemuImg::set_backing`] with `qemu-img` from `PATH`.
pub async fn set_backing(
    path: &Path,
    new_backing: &Path,
    backing_format: &str,
) -> Result<(), ImgError> {
    QemuImg::locate()?
        .set_backing(path, new_backing, backing_format)
        .await
}

/// One extent of `qemu-img map`: where the guest's bytes
/// `start..start+length` come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Extent {
    pub start: u64,
    pub length: u64,
    /// The layer the bytes are in: 0 the image itself, 1 its backing file,
    /// and so on; for bytes no layer holds, the depth the search ended at.
    pub depth: u32,
    /// Some layer holds these bytes (data or zeroes).
    pub present: bool,
    pub zero: bool,
    pub data: bool,
}

/// `qemu-img map --output=json` of `path` and its backing chain (opened
/// shared: the chain may be a running VM's).
pub async fn map(path: &Path, timeout: std::time::Duration) -> Result<Vec<Extent>, ImgError> {
    let img = QemuImg::locate()?.with_timeout(timeout);
    check_absolute(path)?;
    let args: Vec<OsString> = vec![
        "map".into(),
        "--output=json".into(),
        "-U".into(),
        path.into(),
    ];
    let out = img.run("map", path, args).await?;
    parse_map(path, &out)
}

fn parse_map(path: &Path, out: &[u8]) -> Result<Vec<Extent>, ImgError> {
    let bad = |reason: String| ImgError::BadOutput {
        path: path.to_owned(),
        reason,
    };
    let value: Value = serde_json::from_slice(out).map_err(|e| bad(e.to_string()))?;
    let items = value
        .as_array()
        .ok_or_else(|| bad("map output is not an array".into()))?;
    items
        .iter()
        .map(|v| {
            let n = |k: &str| {
                v.get(k)
                    .and_then(Value::as_u64)
                    .ok_or_else(|| bad(format!("map entry without {k}: {v}")))
            };
            let b = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
            Ok(Extent {
                start: n("start")?,
                length: n("length")?,
                depth: n("depth")? as u32,
                // Before QEMU 8.2 there is no "present": data or zero from
                // some layer is present.
                present: v
                    .get("present")
                    .and_then(Value::as_bool)
                    .unwrap_or(b("data") || b("zero")),
                zero: b("zero"),
                data: b("data"),
            })
        })
        .collect()
}

/// [`QemuImg::repair_leaks`] with `qemu-img` from `PATH`.
pub async fn repair_leaks(path: &Path) -> Result<(), ImgError> {
    QemuImg::locate()?.repair_leaks(path).await
}

/// [`QemuImg::backing_chain`] with `qemu-img` from `PATH`.
pub async fn backing_chain(path: &Path) -> Result<Vec<ImageInfo>, ImgError> {
    QemuImg::locate()?.backing_chain(path).await
}

/// [`QemuImg::info`] with `qemu-img` from `PATH`.
pub async fn info(path: &Path) -> Result<ImageInfo, ImgError> {
    QemuImg::locate()?.info(path).await
}

/// `qemu-img rebase` of the qcow2 `path` onto `new_backing`; `unsafe_header`
/// adds `-u` (the header alone, no copy).
fn rebase_args(
    path: &Path,
    new_backing: &Path,
    backing_format: &str,
    unsafe_header: bool,
) -> Result<Vec<OsString>, ImgError> {
    check_absolute(path)?;
    check_absolute(new_backing)?;
    check_format(backing_format)?;
    let mut args: Vec<OsString> = vec!["rebase".into(), "-q".into()];
    if unsafe_header {
        args.push("-u".into());
    }
    args.extend([
        "-f".into(),
        "qcow2".into(),
        "-b".into(),
        new_backing.into(),
        "-F".into(),
        backing_format.into(),
        path.into(),
    ]);
    Ok(args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn convert_progress_is_read_from_pieces_cut_anywhere() {
        let mut m = ProgressMeter::default();
        assert_eq!(m.feed(b"    (0.00/100%)\r    (1"), Some(0.0));
        assert_eq!(m.feed(b"2.5"), None, "no line ended yet");
        assert_eq!(m.feed(b"0/100%)\r    (33.10/100%)\r"), Some(33.1));
        assert_eq!(m.feed(b"garbage\r"), None);
        assert_eq!(m.feed(b"    (100.00/100%)\n"), Some(100.0));
        assert_eq!(m.feed(&[b'x'; 300]), None);
        assert!(m.partial.is_empty(), "an endless line is not kept");
    }

    #[test]
    fn a_copy_over_a_backing_names_it_and_an_existing_output_is_not_created() {
        let (src, dst) = (Path::new("/s/layer.qcow2"), Path::new("/t/p.qcow2"));
        let text = |into| {
            copy_args(src, dst, &into)
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(
            text(CopyInto::Whole),
            "convert -p -U -W -f qcow2 -O qcow2 /s/layer.qcow2 /t/p.qcow2"
        );
        assert_eq!(
            text(CopyInto::NewOver { backing: "a.qcow2" }),
            "convert -p -U -W -f qcow2 -O qcow2 -B a.qcow2 -F qcow2 /s/layer.qcow2 /t/p.qcow2"
        );
        assert_eq!(
            text(CopyInto::Existing { backing: "a.qcow2" }),
            "convert -p -U -W -f qcow2 -O qcow2 -n -B a.qcow2 -F qcow2 /s/layer.qcow2 /t/p.qcow2"
        );
    }

    #[test]
    fn info_json_is_parsed_including_backing_fields() {
        let v: Value = serde_json::from_str(
            r#"{"virtual-size": 1073741824, "filename": "/d/o.qcow2", "format": "qcow2",
                "actual-size": 200704, "backing-filename": "/d/b.qcow2",
                "backing-filename-format": "qcow2",
                "format-specific": {"type": "qcow2", "data": {"corrupt": false}}}"#,
        )
        .expect("json");
        let info = parse_info(&v).expect("parses");
        assert_eq!(info.virtual_size, 1 << 30);
        assert_eq!(info.actual_size, 200_704);
        assert_eq!(info.backing_filename.as_deref(), Some("/d/b.qcow2"));
        assert_eq!(info.backing_format.as_deref(), Some("qcow2"));
        assert!(!info.corrupt);
        assert!(parse_info(&serde_json::json!({"format": "raw"})).is_err());
    }

    #[tokio::test]
    async fn relative_paths_and_odd_formats_are_refused_before_running_anything() {
        let img = QemuImg::new("/nonexistent/qemu-img");
        assert!(matches!(
            img.create_blank(Path::new("disk.qcow2"), 1).await,
            Err(ImgError::NotAbsolute { .. })
        ));
        assert!(matches!(
            img.create_overlay(
                Path::new("/tmp/x.qcow2"),
                Path::new("json:{}"),
                "qcow2",
                None
            )
            .await,
            Err(ImgError::NotAbsolute { .. })
        ));
        assert!(matches!(
            img.create_overlay(
                Path::new("/tmp/hearth-never.qcow2"),
                Path::new("/b"),
                "qcow2,x=y",
                None
            )
            .await,
            Err(ImgError::InvalidFormat(_))
        ));
    }

    #[tokio::test]
    async fn a_missing_binary_is_a_spawn_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let img = QemuImg::new("/nonexistent/qemu-img");
        let err = img
            .create_blank(&dir.path().join("d.qcow2"), 1 << 20)
            .await
            .expect_err("no binary");
        assert!(matches!(err, ImgError::Spawn { .. }), "{err}");
    }
}
