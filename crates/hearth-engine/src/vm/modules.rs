//! A kernel image's modules in the VM's root disk. A kernel image (Ignite's
//! kind) carries `/lib/modules/VERSION` beside `/boot/vmlinuz`; the guest
//! loads modules from its own root filesystem, so at each start of a VM
//! with `spec.boot.kernelImage` every `/lib/modules/VERSION` the image has
//! and the first disk's filesystem lacks is copied in.
//!
//! The copy never writes into the disk's head. What is on disk after each
//! step, and what a crash there leaves:
//! 1. the image's versions listed (`debugfs ls`, read-only on its ext4);
//! 2. a new qcow2 overlay over the head, not recorded: a crash leaves a
//!    layer file no row names, which the start-up sweep removes;
//! 3. the overlay exported over FUSE (`hearth_qemu::storage_daemon`), each
//!    version looked up: all there, the overlay is removed and nothing
//!    changes (the usual start, after the first);
//! 4. `e2fsck -fn`; a filesystem the guest left unclean is replayed and
//!    preened in the overlay (`e2fsck -fp`), and one that stays damaged is
//!    left to the guest's own check: no modules, a warning event;
//! 5. each missing version dumped from the image (`debugfs rdump`) and
//!    written into the overlay by one `debugfs -w` script;
//! 6. read back: dumped again from the overlay and compared with what was
//!    dumped from the image, entry by entry (type, mode, owner, bytes,
//!    link target); then `e2fsck -fn`;
//! 7. the storage daemon stopped (QEMU's qcow2 driver flushes on the way
//!    out) and the overlay `fsync`ed;
//! 8. one transaction makes it the disk's head (the old head below it) and
//!    the disk's `status.path`. Only this makes the copy count.
//!
//! The old head stays below the new one until compaction merges it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hearth_api::{
    EventType, ImagePhase, Kind, VirtualDiskStatus, VirtualImageStatus, VirtualMachine,
};
use hearth_qemu::storage_daemon::FuseExport;
use sha2::{Digest, Sha256};

use crate::context::Context;
use crate::disk::e2fs::{self, DEBUGFS_TIMEOUT, DEBUGFS_TREE_TIMEOUT, Found, quotable, quote};
use crate::snapshot::storage;

const START_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(120);
/// Where modules live in a root filesystem (through `/lib -> usr/lib` on a
/// merged-/usr distribution: debugfs follows links on the way).
pub const MODULES_DIR: &str = "/lib/modules";

/// Why the modules could not be put into the root disk.
#[derive(Debug, thiserror::Error)]
pub enum ModulesError {
    #[error("reading the modules of VirtualImage {image:?}: {message}")]
    Image { image: String, message: String },
    #[error("putting the modules of VirtualImage {image:?} into VirtualDisk {disk:?}: {message}")]
    Disk {
        image: String,
        disk: String,
        message: String,
    },
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

/// Why a tree could not be copied or read back.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error("{path:?} holds {found:?}, which a debugfs command cannot take")]
    Unquotable { path: String, found: char },
    #[error("{path:?} is a {kind}, not a file, directory or link")]
    Special { path: String, kind: String },
    #[error("debugfs rdump {path} failed ({status}): {said}")]
    Rdump {
        path: String,
        status: std::process::ExitStatus,
        said: String,
    },
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Tool(#[from] e2fs::ToolError),
    #[error("{0}")]
    Resolve(#[from] e2fs::ResolveError),
    #[error("debugfs: {0}")]
    Debugfs(#[from] e2fs::DebugfsSaid),
}

/// `path` in the filesystem of `device` with its links resolved
/// ([`e2fs::Resolve`]): debugfs looks paths up through links, but makes
/// directories only where a path names real ones.
async fn resolve_in(device: &Path, dir: &Path, path: &str) -> Result<String, TreeError> {
    let mut r = e2fs::Resolve::new(path);
    while let Some(p) = r.next() {
        // Names come from a filesystem someone else made: none reaches a
        // debugfs command unless it fits inside its quotes.
        must_quote(&p)?;
        match e2fs::stat(device, dir, &p).await?? {
            Found::Symlink => {
                let target = e2fs::link_target(device, dir, &p).await??;
                r.link(&target)?;
            }
            _ => r.other(),
        }
    }
    Ok(r.path())
}

fn must_quote(path: &str) -> Result<(), TreeError> {
    quotable(path).map_err(|found| TreeError::Unquotable {
        path: path.to_string(),
        found,
    })
}

/// One entry of `debugfs ls -p` (`/INODE/MODE/UID/GID/NAME/SIZE/`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub name: String,
    pub mode: u32,
}

/// Reads `debugfs -R 'ls -p DIR'`. Names holding a `/` cannot occur in a
/// directory; the name is what lies between the fourth and the last but
/// one slash.
pub fn parse_ls(stdout: &str) -> Vec<Listed> {
    let mut out = Vec::new();
    for line in stdout.lines() {
        let Some(body) = line.strip_prefix('/').and_then(|l| l.strip_suffix('/')) else {
            continue;
        };
        let parts: Vec<&str> = body.splitn(5, '/').collect();
        if parts.len() != 5 {
            continue;
        }
        let Some((name, _size)) = parts[4].rsplit_once('/') else {
            continue;
        };
        let Ok(mode) = u32::from_str_radix(parts[1], 8) else {
            continue;
        };
        out.push(Listed {
            name: name.to_string(),
            mode,
        });
    }
    out
}

/// The module versions among `listed`: its directories but `.` and `..`,
/// sorted.
pub fn versions(listed: &[Listed]) -> Vec<String> {
    let mut v: Vec<String> = listed
        .iter()
        .filter(|l| l.mode & 0o170000 == 0o040000 && l.name != "." && l.name != "..")
        .map(|l| l.name.clone())
        .collect();
    v.sort();
    v.dedup();
    v
}

/// One entry of a tree on the host, as dumped by debugfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryKind {
    Dir,
    /// A regular file: its size and SHA-256.
    File {
        size: u64,
        sha256: String,
    },
    Symlink {
        target: String,
    },
    Other(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub kind: EntryKind,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

/// Every entry under `root` (relative paths, `root` itself as ""), links
/// not followed, files hashed.
pub fn read_tree(root: &Path) -> std::io::Result<BTreeMap<String, Entry>> {
    use std::os::unix::fs::MetadataExt;
    let mut out = BTreeMap::new();
    let mut stack = vec![(root.to_path_buf(), String::new())];
    while let Some((path, rel)) = stack.pop() {
        let m = std::fs::symlink_metadata(&path)?;
        let t = m.file_type();
        let kind = if t.is_dir() {
            for e in std::fs::read_dir(&path)? {
                let e = e?;
                let name = e.file_name().to_string_lossy().into_owned();
                let child = if rel.is_empty() {
                    name
                } else {
                    format!("{rel}/{name}")
                };
                stack.push((e.path(), child));
            }
            EntryKind::Dir
        } else if t.is_symlink() {
            EntryKind::Symlink {
                target: std::fs::read_link(&path)?.to_string_lossy().into_owned(),
            }
        } else if t.is_file() {
            let mut h = Sha256::new();
            std::io::copy(&mut std::fs::File::open(&path)?, &mut h)?;
            EntryKind::File {
                size: m.len(),
                sha256: format!("{:x}", h.finalize()),
            }
        } else {
            EntryKind::Other(format!("{:?}", t))
        };
        out.insert(
            rel,
            Entry {
                kind,
                mode: m.mode() & 0o7777,
                uid: m.uid(),
                gid: m.gid(),
            },
        );
    }
    Ok(out)
}

/// The debugfs script that makes `tree` (read from `staged`, a directory
/// relative to debugfs's working directory) at `dest` in the filesystem:
/// directories first (a parent before its children), each entry given its
/// mode, uid and gid. Only directories, regular files and symlinks; every
/// name must fit in debugfs's double quotes.
pub fn tree_script(
    tree: &BTreeMap<String, Entry>,
    staged: &str,
    dest: &str,
) -> Result<String, TreeError> {
    let mut out = String::new();
    // BTreeMap order puts "a" before "a/b": parents come first.
    for (rel, e) in tree {
        let at = if rel.is_empty() {
            dest.to_string()
        } else {
            format!("{dest}/{rel}")
        };
        let from = if rel.is_empty() {
            staged.to_string()
        } else {
            format!("{staged}/{rel}")
        };
        must_quote(&at)?;
        let q = quote(&at);
        let type_bits = match &e.kind {
            EntryKind::Dir => {
                out.push_str(&format!("mkdir {q}\n"));
                0o040000
            }
            EntryKind::File { .. } => {
                must_quote(&from)?;
                out.push_str(&format!("write {} {q}\n", quote(&from)));
                0o100000
            }
            EntryKind::Symlink { target } => {
                must_quote(target)?;
                out.push_str(&format!("symlink {q} {}\n", quote(target)));
                0o120000
            }
            EntryKind::Other(t) => {
                return Err(TreeError::Special {
                    path: at,
                    kind: t.clone(),
                });
            }
        };
        out.push_str(&format!(
            "sif {q} mode 0{:o}\nsif {q} uid {}\nsif {q} gid {}\n",
            type_bits | e.mode,
            e.uid,
            e.gid
        ));
    }
    Ok(out)
}

/// The first entry where `got` differs from `want`, said in words.
pub fn first_difference(
    want: &BTreeMap<String, Entry>,
    got: &BTreeMap<String, Entry>,
) -> Option<String> {
    for (rel, w) in want {
        match got.get(rel) {
            None => return Some(format!("{rel:?} is missing")),
            Some(g) if g != w => return Some(format!("{rel:?} reads back as {g:?}, not {w:?}")),
            Some(_) => {}
        }
    }
    got.keys()
        .find(|k| !want.contains_key(*k))
        .map(|k| format!("{k:?} was not written but is there"))
}

/// The image file and name of `spec.boot.kernelImage`, when the VM has one
/// and it is Ready.
fn kernel_image(
    ctx: &Context,
    vm: &VirtualMachine,
) -> Result<Option<(String, PathBuf)>, ModulesError> {
    let Some(name) = vm.spec.boot.as_ref().and_then(|b| b.kernel_image.clone()) else {
        return Ok(None);
    };
    let Some(stored) = ctx.store.get(Kind::VirtualImage, &name)? else {
        return Ok(None);
    };
    let st: VirtualImageStatus = serde_json::from_value(stored.status).unwrap_or_default();
    if st.phase != ImagePhase::Ready || st.shape.as_deref() != Some("rootfs") {
        return Ok(None);
    }
    Ok(st.path.map(|p| (name, p)))
}

/// The work directory of one copy, removed (after its export) when dropped.
struct WorkDir(PathBuf);

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = hearth_qemu::storage_daemon::unmount(&self.0.join("disk"));
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Puts the modules of the VM's kernel image that its first disk lacks
/// into that disk (see the module's text). Runs before a start, under the
/// VM's and its disks' operations locks, with no QEMU of the VM running.
pub async fn ensure(ctx: &Arc<Context>, vm: &VirtualMachine) -> Result<(), ModulesError> {
    let Some((image, image_file)) = kernel_image(ctx, vm)? else {
        return Ok(());
    };
    let Some(disk) = vm.spec.disks.first().map(|d| d.virtual_disk_name.clone()) else {
        return Ok(());
    };
    let image_err = |message: String| ModulesError::Image {
        image: image.clone(),
        message,
    };
    let disk_err = |message: String| ModulesError::Disk {
        image: image.clone(),
        disk: disk.clone(),
        message,
    };

    let root = crate::disk::prepare::work_root(&ctx.config.state_dir);
    let image_dir = resolve_in(&image_file, Path::new("/"), MODULES_DIR)
        .await
        .map_err(|e| image_err(e.to_string()))?;
    let listing = e2fs::debugfs(
        &image_file,
        Path::new("/"),
        &["-R".into(), format!("ls -p {}", quote(&image_dir))],
        None,
        DEBUGFS_TIMEOUT,
    )
    .await
    .map_err(|e| image_err(e.to_string()))?;
    let have = versions(&parse_ls(&e2fs::text(&listing.stdout)));
    if have.is_empty() {
        // A kernel image without modules (a kernel built with what it
        // needs): nothing to copy.
        return Ok(());
    }
    let Some(head) = storage::head(&ctx.store, &disk)? else {
        return Err(disk_err("it has no head layer".into()));
    };
    let new = storage::allocate(&ctx.store, &ctx.config.state_dir, &disk)?;
    std::fs::create_dir_all(storage::layers_dir(&ctx.config.state_dir))
        .map_err(|e| disk_err(format!("making the layers directory: {e}")))?;
    if let Err(e) = hearth_qemu::img::create_overlay(&new.path, &head.path, "qcow2", None).await {
        let _ = std::fs::remove_file(&new.path);
        return Err(disk_err(format!("making an overlay over its head: {e}")));
    }
    let result = copy_into(&root, &new, (&image_file, &image_dir), &have, vm).await;
    if !matches!(result, Ok(Some(_))) {
        let _ = std::fs::remove_file(&new.path);
    }
    let not_copied = |why: String| {
        ctx.event(
            Kind::VirtualMachine,
            &vm.metadata.name,
            EventType::Warning,
            "KernelModulesNotCopied",
            &format!("{why}; {MODULES_DIR} of VirtualImage {image:?} not copied this start"),
        )
    };
    match result {
        Ok(Some(written)) => {
            ctx.store.with_tx(|tx| {
                storage::set_head_tx(tx, &disk, &new, Some(&head.id))?;
                let path = new.path.clone();
                crate::store::Store::update_status_tx::<VirtualDiskStatus, _>(
                    tx,
                    Kind::VirtualDisk,
                    &disk,
                    |s| s.path = Some(path),
                )?;
                Ok(())
            })?;
            ctx.wake(Kind::VirtualDisk, &disk);
            ctx.event(
                Kind::VirtualMachine,
                &vm.metadata.name,
                EventType::Normal,
                "KernelModulesCopied",
                &format!(
                    "{MODULES_DIR}/{} of VirtualImage {image:?} copied into VirtualDisk {disk:?}",
                    written.join(", ")
                ),
            );
            Ok(())
        }
        Ok(None) => Ok(()),
        Err(Copy::Unclean(said)) => {
            not_copied(format!(
                "the filesystem of VirtualDisk {disk:?} needs a check the guest must make (e2fsck -fp: {said})"
            ));
            Ok(())
        }
        Err(Copy::NotExt) => {
            not_copied(format!(
                "VirtualDisk {disk:?} holds no ext2/3/4 filesystem at its start"
            ));
            Ok(())
        }
        Err(Copy::Image(m)) => Err(image_err(m)),
        Err(Copy::Disk(m)) => Err(disk_err(m)),
    }
}

enum Copy {
    /// The disk's filesystem is damaged beyond a preen.
    Unclean(String),
    /// The disk holds no ext2/3/4 filesystem (its superblock's magic).
    NotExt,
    Image(String),
    Disk(String),
}

/// Steps 3 to 7 on the unrecorded overlay `new`: the versions written, or
/// None when the disk has them all.
async fn copy_into(
    root: &Path,
    new: &storage::NewLayer,
    (image_file, image_dir): (&Path, &str),
    have: &[String],
    vm: &VirtualMachine,
) -> Result<Option<Vec<String>>, Copy> {
    let dir = root.join(format!("modules-{}", new.id));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)
        .map_err(|e| Copy::Disk(format!("making {}: {e}", dir.display())))?;
    let work = WorkDir(dir.clone());
    let device = work.0.join("disk");
    let export = FuseExport::start(&new.path, &device, &work.0.join("qsd.log"), START_TIMEOUT)
        .await
        .map_err(|e| Copy::Disk(format!("opening the overlay: {e}")))?;
    // Only an ext filesystem is written (a root filesystem from an image
    // is one); anything else is the guest's own business.
    if !is_ext(&device) {
        let _ = export.stop(STOP_TIMEOUT).await;
        return Err(Copy::NotExt);
    }
    // Where the guest's /lib/modules leads in this filesystem.
    let disk_dir = resolve_in(&device, &work.0, MODULES_DIR)
        .await
        .map_err(|e| Copy::Disk(e.to_string()))?;
    let mut missing = Vec::new();
    for v in have {
        let at = format!("{disk_dir}/{v}");
        match e2fs::stat(&device, &work.0, &at).await {
            Ok(Ok(Found::Missing)) => missing.push(v.clone()),
            Ok(Ok(_)) => {}
            Ok(Err(said)) => return Err(Copy::Disk(format!("debugfs stat {at:?}: {said}"))),
            Err(e) => return Err(Copy::Disk(e.to_string())),
        }
    }
    if missing.is_empty() {
        let _ = export.stop(STOP_TIMEOUT).await;
        return Ok(None);
    }
    tracing::info!(vm = %vm.metadata.name, ?missing, "copying a kernel image's modules into the root disk");
    let fsck = e2fs::e2fsck(&device, "-fn")
        .await
        .map_err(|e| Copy::Disk(e.to_string()))?;
    if !fsck.passed {
        let preen = e2fs::e2fsck(&device, "-fp")
            .await
            .map_err(|e| Copy::Disk(e.to_string()))?;
        if !preen.passed {
            let _ = export.stop(STOP_TIMEOUT).await;
            return Err(Copy::Unclean(preen.said));
        }
    }
    // Directories on the way the filesystem lacks (a root without
    // /lib/modules at all).
    let mut script = String::new();
    let mut at = String::new();
    for part in disk_dir.split('/').filter(|p| !p.is_empty()) {
        at.push('/');
        at.push_str(part);
        let p = at.as_str();
        must_quote(p).map_err(|e| Copy::Disk(e.to_string()))?;
        match e2fs::stat(&device, &work.0, p).await {
            Ok(Ok(Found::Missing)) => {
                script.push_str(&format!(
                    "mkdir {q}\nsif {q} mode 040755\nsif {q} uid 0\nsif {q} gid 0\n",
                    q = quote(p)
                ));
            }
            Ok(Ok(Found::Directory)) => {}
            Ok(Ok(other)) => {
                return Err(Copy::Disk(format!(
                    "{p} in the disk is a {other:?}, not a directory"
                )));
            }
            Ok(Err(said)) => return Err(Copy::Disk(format!("debugfs stat {p:?}: {said}"))),
            Err(e) => return Err(Copy::Disk(e.to_string())),
        }
    }
    // Each missing version out of the image, then one script writes them.
    std::fs::create_dir_all(work.0.join("from")).map_err(|e| Copy::Disk(e.to_string()))?;
    let mut trees = Vec::new();
    for v in &missing {
        let from = work.0.join("from");
        let image = |e: TreeError| Copy::Image(e.to_string());
        rdump(image_file, &work.0, &format!("{image_dir}/{v}"), &from)
            .await
            .map_err(image)?;
        let tree = read_tree_blocking(from.join(v)).await.map_err(image)?;
        script.push_str(
            &tree_script(&tree, &format!("from/{v}"), &format!("{disk_dir}/{v}")).map_err(image)?,
        );
        trees.push((v.clone(), tree));
    }
    let out = e2fs::debugfs(
        &device,
        &work.0,
        &["-w".into(), "-f".into(), "-".into()],
        Some(script.as_bytes()),
        DEBUGFS_TREE_TIMEOUT,
    )
    .await
    .map_err(|e| Copy::Disk(e.to_string()))?;
    let complaints = e2fs::complaints(&e2fs::text(&out.stderr));
    if !out.status.success() || !complaints.is_empty() {
        return Err(Copy::Disk(format!(
            "debugfs -w failed ({}): {}",
            out.status,
            complaints
                .iter()
                .take(5)
                .cloned()
                .collect::<Vec<_>>()
                .join("; ")
        )));
    }
    // Read back what the filesystem now holds, entry by entry.
    let back = work.0.join("back");
    std::fs::create_dir_all(&back).map_err(|e| Copy::Disk(e.to_string()))?;
    for (v, want) in &trees {
        let disk = |e: TreeError| Copy::Disk(e.to_string());
        rdump(&device, &work.0, &format!("{disk_dir}/{v}"), &back)
            .await
            .map_err(disk)?;
        let got = read_tree_blocking(back.join(v)).await.map_err(disk)?;
        if let Some(d) = first_difference(want, &got) {
            return Err(Copy::Disk(format!("{MODULES_DIR}/{v}: {d}")));
        }
    }
    let after = e2fs::e2fsck(&device, "-fn")
        .await
        .map_err(|e| Copy::Disk(e.to_string()))?;
    if !after.passed {
        return Err(Copy::Disk(format!(
            "the filesystem fails e2fsck -fn after the modules were written: {}",
            after.said
        )));
    }
    export
        .stop(STOP_TIMEOUT)
        .await
        .map_err(|e| Copy::Disk(format!("closing the overlay: {e}")))?;
    std::fs::File::open(&new.path)
        .and_then(|f| f.sync_all())
        .map_err(|e| Copy::Disk(format!("syncing {}: {e}", new.path.display())))?;
    drop(work);
    Ok(Some(missing))
}

/// Whether `device` starts with an ext2/3/4 superblock: the magic 0xEF53
/// at byte 1080.
fn is_ext(device: &Path) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let mut magic = [0u8; 2];
    std::fs::File::open(device)
        .and_then(|mut f| {
            f.seek(SeekFrom::Start(1080))?;
            f.read_exact(&mut magic)
        })
        .is_ok()
        && magic == [0x53, 0xEF]
}

/// `debugfs -R 'rdump PATH DEST'`: the tree at `path` in `device` as
/// `DEST/NAME`, with its modes and owners (hearthd is root).
async fn rdump(device: &Path, dir: &Path, path: &str, dest: &Path) -> Result<(), TreeError> {
    let dest_text = dest.to_string_lossy();
    must_quote(&dest_text)?;
    let out = e2fs::debugfs(
        device,
        dir,
        &[
            "-R".into(),
            format!("rdump {} {}", quote(path), quote(&dest_text)),
        ],
        None,
        DEBUGFS_TREE_TIMEOUT,
    )
    .await?;
    let complaints = e2fs::complaints(&e2fs::text(&out.stderr));
    if !out.status.success() || !complaints.is_empty() {
        return Err(TreeError::Rdump {
            path: path.to_string(),
            status: out.status,
            said: complaints
                .iter()
                .take(5)
                .cloned()
                .collect::<Vec<_>>()
                .join("; "),
        });
    }
    Ok(())
}

async fn read_tree_blocking(root: PathBuf) -> Result<BTreeMap<String, Entry>, TreeError> {
    let path = root.clone();
    let read = tokio::task::spawn_blocking(move || read_tree(&root))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)));
    read.map_err(|source| TreeError::Read { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ls_p_lines_are_read_with_slashes_and_spaces_in_names() {
        let out = "debugfs 1.47.0\n/2/040755/0/0/./4096/\n/2/040755/0/0/../4096/\n\
                   /12/040755/0/0/6.1.0-28-cloud-amd64/4096/\n/13/100644/0/0/a b/7/\n\
                   garbage\n";
        let l = parse_ls(out);
        assert_eq!(l.len(), 4);
        assert_eq!(
            l[3],
            Listed {
                name: "a b".into(),
                mode: 0o100644
            }
        );
        assert_eq!(versions(&l), vec!["6.1.0-28-cloud-amd64".to_string()]);
        assert!(versions(&parse_ls("")).is_empty());
    }

    fn entry(kind: EntryKind, mode: u32) -> Entry {
        Entry {
            kind,
            mode,
            uid: 0,
            gid: 0,
        }
    }

    #[test]
    fn a_tree_script_makes_parents_first_and_sets_every_mode() {
        let mut t = BTreeMap::new();
        t.insert(String::new(), entry(EntryKind::Dir, 0o755));
        t.insert("kernel".into(), entry(EntryKind::Dir, 0o755));
        t.insert(
            "kernel/a.ko".into(),
            entry(
                EntryKind::File {
                    size: 3,
                    sha256: "x".into(),
                },
                0o644,
            ),
        );
        t.insert(
            "build".into(),
            entry(
                EntryKind::Symlink {
                    target: "/usr/src/linux".into(),
                },
                0o777,
            ),
        );
        let s = tree_script(&t, "from/6.1", "/lib/modules/6.1").unwrap();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "mkdir \"/lib/modules/6.1\"");
        assert_eq!(lines[1], "sif \"/lib/modules/6.1\" mode 040755");
        let kernel = lines
            .iter()
            .position(|l| *l == "mkdir \"/lib/modules/6.1/kernel\"")
            .unwrap();
        let ko = lines
            .iter()
            .position(|l| *l == "write \"from/6.1/kernel/a.ko\" \"/lib/modules/6.1/kernel/a.ko\"")
            .unwrap();
        assert!(kernel < ko, "{s}");
        assert!(
            s.contains("symlink \"/lib/modules/6.1/build\" \"/usr/src/linux\"\n"),
            "{s}"
        );
        assert!(
            s.contains("sif \"/lib/modules/6.1/build\" mode 0120777\n"),
            "{s}"
        );
        assert!(
            s.contains("sif \"/lib/modules/6.1/kernel/a.ko\" mode 0100644\n"),
            "{s}"
        );
    }

    #[test]
    fn names_debugfs_cannot_quote_and_special_files_are_refused() {
        let mut t = BTreeMap::new();
        t.insert("a\"b".into(), entry(EntryKind::Dir, 0o755));
        assert!(
            tree_script(&t, "s", "/d")
                .unwrap_err()
                .to_string()
                .contains("cannot take")
        );
        let mut t = BTreeMap::new();
        t.insert("fifo".into(), entry(EntryKind::Other("FIFO".into()), 0o644));
        assert!(
            tree_script(&t, "s", "/d")
                .unwrap_err()
                .to_string()
                .contains("not a file")
        );
        let mut t = BTreeMap::new();
        t.insert(
            "l".into(),
            entry(
                EntryKind::Symlink {
                    target: "x\ny".into(),
                },
                0o777,
            ),
        );
        assert!(tree_script(&t, "s", "/d").is_err());
    }

    #[test]
    fn only_an_ext_superblock_is_taken_for_a_filesystem() {
        let dir = tempfile::tempdir().unwrap();
        let blank = dir.path().join("blank");
        std::fs::write(&blank, vec![0u8; 4096]).unwrap();
        assert!(!is_ext(&blank));
        let mut ext = vec![0u8; 4096];
        ext[1080] = 0x53;
        ext[1081] = 0xEF;
        std::fs::write(dir.path().join("ext"), ext).unwrap();
        assert!(is_ext(&dir.path().join("ext")));
        assert!(!is_ext(&dir.path().join("missing")));
    }

    #[test]
    fn a_tree_read_back_differs_by_any_entry() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        std::fs::create_dir_all(a.join("k")).unwrap();
        std::fs::write(a.join("k/m.ko"), b"module").unwrap();
        std::os::unix::fs::symlink("k/m.ko", a.join("link")).unwrap();
        let want = read_tree(&a).unwrap();
        assert_eq!(want.len(), 4, "{want:?}");
        assert_eq!(first_difference(&want, &want), None);
        // Other bytes of the same size.
        std::fs::write(a.join("k/m.ko"), b"MODULE").unwrap();
        let got = read_tree(&a).unwrap();
        assert!(first_difference(&want, &got).unwrap().contains("k/m.ko"));
        // A missing entry, an extra one, another link target.
        let mut got = want.clone();
        got.remove("link");
        assert!(first_difference(&want, &got).unwrap().contains("missing"));
        let mut got = want.clone();
        got.insert("x".into(), entry(EntryKind::Dir, 0o755));
        assert!(
            first_difference(&want, &got)
                .unwrap()
                .contains("not written")
        );
        let mut got = want.clone();
        got.insert(
            "link".into(),
            entry(EntryKind::Symlink { target: "y".into() }, 0o777),
        );
        assert!(first_difference(&want, &got).is_some());
    }
}
