//! A disk from a rootfs image, made ready before it is recorded: its ext4
//! grown to the disk's `spec.size` and `spec.files` written into it.
//!
//! The new overlay is opened by QEMU's own qcow2 driver in
//! `qemu-storage-daemon` and exported as a file over FUSE
//! (`hearth_qemu::storage_daemon`); e2fsprogs work on that file:
//! `e2fsck -fn` (a damaged filesystem is refused, nothing written),
//! `e2fsck -fp` and `resize2fs` when the disk is larger than the image,
//! `debugfs -w` for the files (no mount: hearthd never mounts a guest's
//! filesystem), `e2fsck -fn` again; then the daemon is stopped (it flushes
//! the qcow2 on the way out) and the overlay synced. Only then does the
//! caller record the layer; until then a crash leaves an unrecorded file,
//! which the start-up sweep removes, and the disk is made again.
//!
//! The pure part (which paths to look at, the debugfs script, reading
//! debugfs's `stat`) is separate and unit-tested; debugfs exits 0 whatever
//! its commands did, so every file is read back and compared after the
//! writes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use hearth_api::{DiskFile, OciShape, VirtualDisk};
use hearth_qemu::programs;
use hearth_qemu::storage_daemon::FuseExport;

use super::e2fs::{
    self, DEBUGFS_TIMEOUT, Found, RESIZE_TIMEOUT, complaints, e2fsck, parse_found, parse_inode,
    quotable, quote, stat_request, text,
};
use crate::context::Context;
use crate::image::ReadyImage;

const START_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(120);
/// The longest name ext4 holds.
const MAX_NAME: usize = 255;

/// Why a disk could not be prepared: the field it concerns and what went
/// wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct PrepareError {
    pub field: String,
    pub message: String,
}

fn err(field: impl Into<String>, message: impl Into<String>) -> PrepareError {
    PrepareError {
        field: field.into(),
        message: message.into(),
    }
}

fn path_field(i: usize) -> String {
    format!("spec.files[{i}].path")
}

/// The per-prepare directory: the FUSE mountpoint, the daemon's log, the
/// files to write. Under it nothing outlives a prepare; what a crash
/// leaves is taken away at start-up ([`sweep`]).
pub fn work_root(state_dir: &Path) -> PathBuf {
    state_dir.join("disk-prepare")
}

/// At start-up, before the layer sweep: kills storage daemons a killed
/// hearthd left (normally gone with it), unmounts their exports, removes
/// the directories.
pub fn sweep(state_dir: &Path) {
    hearth_qemu::storage_daemon::clear_work_dir(&work_root(state_dir), "disk preparations");
}

/// What to do to a new disk from `image`: nothing, or grow and/or write.
pub fn needed(disk: &VirtualDisk, image: &ReadyImage) -> Result<bool, PrepareError> {
    let rootfs = image.shape.as_deref() == Some(&OciShape::Rootfs.to_string());
    if !rootfs {
        if !disk.spec.files.is_empty() {
            return Err(err(
                "spec.files",
                format!(
                    "files can be written only into a disk from a rootfs image, and VirtualImage {:?} is {}",
                    image.name,
                    match &image.shape {
                        Some(s) => format!("of shape {s}"),
                        None => "not an OCI image".to_string(),
                    }
                ),
            ));
        }
        return Ok(false);
    }
    let size = disk.spec.size.as_ref().map(|q| q.bytes());
    Ok(!disk.spec.files.is_empty() || size.is_some_and(|s| s > image.virtual_size))
}

/// One of `spec.files`, checked: its path as debugfs reads it, the
/// directories above it, and what to set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub index: usize,
    pub path: String,
    /// `/a`, `/a/b` for `/a/b/c`.
    pub parents: Vec<String>,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// The staged copy's name in the work directory (debugfs runs there).
    pub staged: String,
}

/// Checks one `spec.files[i]`: an absolute path of plain components that
/// debugfs can take inside double quotes (no `"`, no control character,
/// UTF-8, names of at most 255 bytes), and its mode.
pub fn plan_file(i: usize, f: &DiskFile) -> Result<Planned, PrepareError> {
    let field = path_field(i);
    let Some(text) = f.path.to_str() else {
        return Err(err(field, format!("{:?} is not UTF-8", f.path)));
    };
    if let Err(c) = quotable(text) {
        return Err(err(
            field,
            format!("{text:?} holds {c:?}, which a debugfs command cannot express"),
        ));
    }
    if !text.starts_with('/') {
        return Err(err(field, format!("{text:?} is not absolute")));
    }
    let parts: Vec<&str> = text[1..].split('/').collect();
    if parts
        .iter()
        .any(|p| p.is_empty() || *p == "." || *p == "..")
    {
        return Err(err(
            field,
            format!("{text:?} is not a plain path (an empty, `.` or `..` part)"),
        ));
    }
    if let Some(p) = parts.iter().find(|p| p.len() > MAX_NAME) {
        return Err(err(
            field,
            format!(
                "a name of {} bytes is longer than ext4 holds ({MAX_NAME})",
                p.len()
            ),
        ));
    }
    let mut parents = Vec::new();
    let mut at = String::new();
    for p in &parts[..parts.len() - 1] {
        at.push('/');
        at.push_str(p);
        parents.push(at.clone());
    }
    let mode = match &f.mode {
        Some(m) => {
            hearth_api::parse_file_mode(m).map_err(|m| err(format!("spec.files[{i}].mode"), m))?
        }
        None => 0o644,
    };
    Ok(Planned {
        index: i,
        path: text.to_string(),
        parents,
        mode,
        uid: f.uid,
        gid: f.gid,
        staged: i.to_string(),
    })
}

/// The paths to look at before writing: every parent and every target,
/// each once, in order.
pub fn to_inspect(files: &[Planned]) -> Vec<String> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for f in files {
        for p in f.parents.iter().chain(std::iter::once(&f.path)) {
            if seen.insert(p.clone()) {
                out.push(p.clone());
            }
        }
    }
    out
}

/// The debugfs script that writes `files` into a filesystem where the
/// paths are as `found` says: missing parents made (0755, root's), an
/// existing regular file replaced (unlinked, so its other hard links keep
/// the old content), each file written from its staged copy and given its
/// mode, uid and gid. A path through a symlink, or to a directory, a
/// symlink or a special file, is refused naming `spec.files[i].path`.
pub fn script(files: &[Planned], found: &BTreeMap<String, Found>) -> Result<String, PrepareError> {
    let state = |p: &str| found.get(p).cloned().unwrap_or(Found::Missing);
    let mut made = BTreeSet::new();
    let targets: BTreeMap<&str, usize> = files.iter().map(|f| (f.path.as_str(), f.index)).collect();
    let mut out = String::new();
    for f in files {
        let field = path_field(f.index);
        for parent in &f.parents {
            if let Some(j) = targets.get(parent.as_str()) {
                return Err(err(
                    field,
                    format!("its parent {parent:?} is a file itself (spec.files[{j}])"),
                ));
            }
            match state(parent) {
                Found::Directory => {}
                Found::Missing => {
                    if made.insert(parent.clone()) {
                        let q = quote(parent);
                        out.push_str(&format!(
                            "mkdir {q}\nsif {q} mode 040755\nsif {q} uid 0\nsif {q} gid 0\n"
                        ));
                    }
                }
                Found::Symlink => {
                    return Err(err(
                        field,
                        format!(
                            "{:?} passes through {parent:?}, a symlink in the image; name the path it points to",
                            f.path
                        ),
                    ));
                }
                Found::Regular => {
                    return Err(err(
                        field,
                        format!("{parent:?} is a regular file in the image, not a directory"),
                    ));
                }
                Found::Other(t) => {
                    return Err(err(
                        field,
                        format!("{parent:?} is a {t} in the image, not a directory"),
                    ));
                }
            }
        }
        let q = quote(&f.path);
        match state(&f.path) {
            Found::Missing => {}
            Found::Regular => out.push_str(&format!("rm {q}\n")),
            Found::Directory => {
                return Err(err(
                    field,
                    format!("{:?} is a directory in the image", f.path),
                ));
            }
            Found::Symlink => {
                return Err(err(
                    field,
                    format!(
                        "{:?} is a symlink in the image; name the path it points to",
                        f.path
                    ),
                ));
            }
            Found::Other(t) => {
                return Err(err(field, format!("{:?} is a {t} in the image", f.path)));
            }
        }
        out.push_str(&format!(
            "write {} {q}\nsif {q} mode 0{:o}\nsif {q} uid {}\nsif {q} gid {}\n",
            quote(&f.staged),
            0o100000 | f.mode,
            f.uid,
            f.gid
        ));
    }
    Ok(out)
}

/// The work directory of one prepare, removed when dropped (after the
/// export, declared after it, is gone).
struct WorkDir(PathBuf);

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = hearth_qemu::storage_daemon::unmount(&self.0.join("disk"));
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Grows the ext4 of the new overlay at `overlay` to the disk's size and
/// writes `spec.files` into it; the overlay is flushed, closed and synced
/// when this returns Ok. On error the caller removes the overlay.
pub async fn prepare(
    ctx: &Context,
    disk: &VirtualDisk,
    layer_id: &str,
    overlay: &Path,
    image: &ReadyImage,
) -> Result<(), PrepareError> {
    let files = disk
        .spec
        .files
        .iter()
        .enumerate()
        .map(|(i, f)| plan_file(i, f))
        .collect::<Result<Vec<_>, _>>()?;
    let size = disk.spec.size.as_ref().map(|q| q.bytes());
    let grow = size.is_some_and(|s| s > image.virtual_size);

    let root = work_root(&ctx.config.state_dir);
    let dir = root.join(layer_id);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| {
        err(
            "spec.source.virtualImage",
            format!("making {}: {e}", dir.display()),
        )
    })?;
    let work = WorkDir(dir.clone());
    stage(ctx, disk, &files, &work.0).await?;

    let device = work.0.join("disk");
    let daemon_err = |e: hearth_qemu::storage_daemon::DaemonError| {
        err(
            "spec.source.virtualImage",
            format!("opening the new disk: {e}"),
        )
    };
    let export = FuseExport::start(overlay, &device, &work.0.join("qsd.log"), START_TIMEOUT)
        .await
        .map_err(daemon_err)?;
    tracing::debug!(pid = export.pid(), device = %device.display(), "disk exported for preparing");

    let fsck = e2fsck(&device, "-fn")
        .await
        .map_err(|m| err("spec.source.virtualImage", m.to_string()))?;
    if !fsck.passed {
        return Err(err(
            "spec.source.virtualImage",
            format!(
                "the ext4 filesystem of VirtualImage {:?} is damaged (e2fsck -fn): {}",
                image.name, fsck.said
            ),
        ));
    }
    if grow {
        // resize2fs wants a filesystem checked since it was last written;
        // -p fixes nothing a clean -n found, it only records the check.
        let p = e2fsck(&device, "-fp")
            .await
            .map_err(|m| err("spec.size", m.to_string()))?;
        if !p.passed {
            return Err(err(
                "spec.size",
                format!("e2fsck -fp before growing: {}", p.said),
            ));
        }
        let out = e2fs::tool(
            "resize2fs",
            &[device.as_os_str()],
            None,
            RESIZE_TIMEOUT,
            programs::Class::Copy,
        )
        .await
        .map_err(|m| err("spec.size", m.to_string()))?;
        if !out.status.success() {
            return Err(err(
                "spec.size",
                format!(
                    "resize2fs to {} bytes failed ({}): {}",
                    size.unwrap_or_default(),
                    out.status,
                    text(&out.stderr)
                ),
            ));
        }
    }
    if !files.is_empty() {
        write_files(&files, &device, &work.0).await?;
        let after = e2fsck(&device, "-fn")
            .await
            .map_err(|m| err("spec.files", m.to_string()))?;
        if !after.passed {
            return Err(err(
                "spec.files",
                format!(
                    "the filesystem fails e2fsck -fn after the files were written: {}",
                    after.said
                ),
            ));
        }
    }
    export.stop(STOP_TIMEOUT).await.map_err(|e| {
        err(
            "spec.source.virtualImage",
            format!("closing the new disk: {e}"),
        )
    })?;
    let sync = std::fs::File::open(overlay).and_then(|f| f.sync_all());
    sync.map_err(|e| {
        err(
            "spec.source.virtualImage",
            format!("syncing {}: {e}", overlay.display()),
        )
    })?;
    drop(work);
    Ok(())
}

/// Copies each file's bytes into the work directory, read by hearthd
/// itself: a host `source` confined to the image roots, or `content`.
async fn stage(
    ctx: &Context,
    disk: &VirtualDisk,
    files: &[Planned],
    dir: &Path,
) -> Result<(), PrepareError> {
    for f in files {
        let spec = &disk.spec.files[f.index];
        let to = dir.join(&f.staged);
        let source_field = format!("spec.files[{}].source", f.index);
        match (&spec.source, &spec.content) {
            (Some(src), _) => {
                let real = ctx
                    .config
                    .confine(src)
                    .map_err(|e| err(&source_field, e.to_string()))?;
                let (from, to2) = (real.clone(), to.clone());
                let copied = tokio::task::spawn_blocking(move || {
                    use std::os::unix::fs::OpenOptionsExt;
                    let mut input = std::fs::File::open(&from)?;
                    if !input.metadata()?.is_file() {
                        return Err(std::io::Error::other("not a regular file"));
                    }
                    let mut output = std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o600)
                        .open(&to2)?;
                    std::io::copy(&mut input, &mut output)
                })
                .await
                .map_err(|e| err(&source_field, e.to_string()))?;
                copied
                    .map_err(|e| err(&source_field, format!("reading {}: {e}", real.display())))?;
            }
            (None, Some(content)) => {
                std::fs::write(&to, content.as_bytes()).map_err(|e| {
                    err(
                        format!("spec.files[{}].content", f.index),
                        format!("staging: {e}"),
                    )
                })?;
            }
            (None, None) => return Err(err(source_field, "neither source nor content")),
        }
    }
    Ok(())
}

/// Looks at every path, runs the script, and reads every file back.
async fn write_files(files: &[Planned], device: &Path, dir: &Path) -> Result<(), PrepareError> {
    let mut found = BTreeMap::new();
    for p in to_inspect(files) {
        let out = e2fs::debugfs(
            device,
            dir,
            &["-R".into(), stat_request(&p)],
            None,
            DEBUGFS_TIMEOUT,
        )
        .await
        .map_err(|m| err("spec.files", m.to_string()))?;
        let f = parse_found(&text(&out.stdout), &text(&out.stderr))
            .map_err(|m| err("spec.files", format!("debugfs stat {p:?}: {m}")))?;
        found.insert(p, f);
    }
    let script = script(files, &found)?;
    let out = e2fs::debugfs(
        device,
        dir,
        &["-w".into(), "-f".into(), "-".into()],
        Some(script.as_bytes()),
        DEBUGFS_TIMEOUT,
    )
    .await
    .map_err(|m| err("spec.files", m.to_string()))?;
    // debugfs exits 0 whatever its commands did: its complaints are on
    // stderr, after its version line.
    let complaints = complaints(&text(&out.stderr));
    if !out.status.success() || !complaints.is_empty() {
        return Err(err(
            "spec.files",
            format!(
                "debugfs -w failed ({}): {}",
                out.status,
                complaints.join("; ")
            ),
        ));
    }
    for f in files {
        let want = std::fs::metadata(dir.join(&f.staged))
            .map(|m| m.len())
            .unwrap_or(0);
        let out = e2fs::debugfs(
            device,
            dir,
            &["-R".into(), stat_request(&f.path)],
            None,
            DEBUGFS_TIMEOUT,
        )
        .await
        .map_err(|m| err(path_field(f.index), m.to_string()))?;
        let got = parse_inode(&text(&out.stdout));
        let ok = got.as_ref().is_some_and(|i| {
            i.found == Found::Regular
                && i.mode == f.mode
                && i.uid == f.uid
                && i.gid == f.gid
                && i.size == want
        });
        if !ok {
            return Err(err(
                path_field(f.index),
                format!(
                    "{:?} reads back as {got:?}, not a regular file of {want} bytes, mode {:o}, uid {}, gid {}",
                    f.path, f.mode, f.uid, f.gid
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::e2fs::Inode;

    fn file(path: &str) -> DiskFile {
        DiskFile {
            path: PathBuf::from(path),
            source: None,
            content: Some("x".into()),
            mode: None,
            uid: 0,
            gid: 0,
        }
    }

    fn planned(paths: &[&str]) -> Vec<Planned> {
        paths
            .iter()
            .enumerate()
            .map(|(i, p)| plan_file(i, &file(p)).expect("plain path"))
            .collect()
    }

    fn found(entries: &[(&str, Found)]) -> BTreeMap<String, Found> {
        entries
            .iter()
            .map(|(p, f)| (p.to_string(), f.clone()))
            .collect()
    }

    #[test]
    fn missing_parents_are_made_once_root_owned_0755_and_files_get_mode_uid_gid() {
        let mut f0 = file("/etc/app/key");
        f0.mode = Some("0600".into());
        f0.uid = 1000;
        f0.gid = 100;
        let files = vec![
            plan_file(0, &f0).unwrap(),
            plan_file(1, &file("/etc/app/conf")).unwrap(),
        ];
        assert_eq!(files[0].parents, ["/etc", "/etc/app"]);
        assert_eq!(
            to_inspect(&files),
            ["/etc", "/etc/app", "/etc/app/key", "/etc/app/conf"]
        );
        let s = script(&files, &found(&[("/etc", Found::Directory)])).unwrap();
        assert_eq!(
            s,
            "mkdir \"/etc/app\"\nsif \"/etc/app\" mode 040755\nsif \"/etc/app\" uid 0\nsif \"/etc/app\" gid 0\n\
write \"0\" \"/etc/app/key\"\nsif \"/etc/app/key\" mode 0100600\nsif \"/etc/app/key\" uid 1000\nsif \"/etc/app/key\" gid 100\n\
write \"1\" \"/etc/app/conf\"\nsif \"/etc/app/conf\" mode 0100644\nsif \"/etc/app/conf\" uid 0\nsif \"/etc/app/conf\" gid 0\n"
        );
    }

    #[test]
    fn an_existing_regular_file_is_unlinked_before_it_is_written() {
        let files = planned(&["/etc/hostname"]);
        let s = script(
            &files,
            &found(&[
                ("/etc", Found::Directory),
                ("/etc/hostname", Found::Regular),
            ]),
        )
        .unwrap();
        assert!(
            s.starts_with("rm \"/etc/hostname\"\nwrite \"0\" \"/etc/hostname\"\n"),
            "{s}"
        );
    }

    #[test]
    fn a_path_through_a_symlink_or_to_a_directory_or_symlink_is_refused_naming_its_field() {
        let files = planned(&["/ok", "/lib/x"]);
        let e = script(&files, &found(&[("/lib", Found::Symlink)])).unwrap_err();
        assert_eq!(e.field, "spec.files[1].path");
        assert!(e.message.contains("symlink"), "{e}");
        for (what, f) in [
            ("directory", Found::Directory),
            ("symlink", Found::Symlink),
            ("FIFO", Found::Other("FIFO".into())),
        ] {
            let e = script(&planned(&["/t"]), &found(&[("/t", f)])).unwrap_err();
            assert_eq!(e.field, "spec.files[0].path");
            assert!(e.message.contains(what), "{e}");
        }
        let e = script(&planned(&["/f/x"]), &found(&[("/f", Found::Regular)])).unwrap_err();
        assert!(e.message.contains("not a directory"), "{e}");
        // A file whose parent is another of the files.
        let e = script(&planned(&["/a", "/a/b"]), &found(&[])).unwrap_err();
        assert_eq!(e.field, "spec.files[1].path");
    }

    #[test]
    fn paths_debugfs_cannot_express_are_refused_before_anything_runs() {
        for bad in [
            "/a\"b",
            "/a\nmkdir /x",
            "/a\tb",
            "/a\rb",
            "/x/../y",
            "/x//y",
            "/x/",
            "rel",
            "/\u{7f}",
        ] {
            let e = plan_file(3, &file(bad)).unwrap_err();
            assert_eq!(e.field, "spec.files[3].path", "{bad:?}");
        }
        let long = format!("/{}", "n".repeat(256));
        assert!(plan_file(0, &file(&long)).is_err());
        let mut bad_mode = file("/m");
        bad_mode.mode = Some("999".into());
        assert_eq!(
            plan_file(2, &bad_mode).unwrap_err().field,
            "spec.files[2].mode"
        );
        // Spaces, backslashes, `;` and `#` are plain inside the quotes.
        let p = plan_file(0, &file("/a b/c\\d;e#f")).unwrap();
        let s = script(&[p], &found(&[])).unwrap();
        assert!(s.starts_with("mkdir \"/a b\"\n"), "{s}");
        assert!(s.contains("write \"0\" \"/a b/c\\d;e#f\"\n"), "{s}");
        // Every line is one command: no path can start another.
        assert!(s.lines().all(|l| {
            ["mkdir ", "sif ", "write "]
                .iter()
                .any(|c| l.starts_with(c))
        }));
    }

    #[test]
    fn debugfs_stat_output_is_read_into_type_mode_owner_and_size() {
        let out = "Inode: 14   Type: regular    Mode:  0600   Flags: 0x80000\n\
Generation: 0    Version: 0x00000000:00000000\n\
User:  1000   Group:   100   Project:     0   Size: 6\n\
File ACL: 0\n";
        assert_eq!(
            parse_inode(out),
            Some(Inode {
                found: Found::Regular,
                mode: 0o600,
                uid: 1000,
                gid: 100,
                size: 6
            })
        );
        let dev = "Inode: 20   Type: character special    Mode:  0666   Flags: 0x0\n";
        assert_eq!(
            parse_found(dev, ""),
            Ok(Found::Other("character special".into()))
        );
        assert_eq!(
            parse_found(
                "",
                "debugfs 1.47.0 (5-Feb-2023)\n/nope: File not found by ext2_lookup \n"
            ),
            Ok(Found::Missing)
        );
        assert!(parse_found("", "debugfs 1.47.0\nBad magic number in super-block\n").is_err());
        let setuid = "Inode: 3   Type: regular    Mode:  4755   Flags: 0x0\nx\nUser:     0   Group:     0   Size: 10\n";
        assert_eq!(parse_inode(setuid).map(|i| i.mode), Some(0o4755));
    }
}
