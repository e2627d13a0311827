//! The kernel and initrd a rootfs brings under `/boot` (as Debian, Ubuntu
//! and Ignite's kernel images do), found in the unpacked tree and copied
//! into the image store, named by their content.
//!
//! The tree comes from someone else's layers: a symlink is followed only
//! while it stays inside the tree (an absolute target is taken from the
//! tree's root, a `..` above the root ends the search), and only a regular
//! file is ever read.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use sha2::{Digest as _, Sha256};

use crate::OciError;

/// Symlinks followed at most while resolving one name (Linux's own limit).
const MAX_LINKS: usize = 40;

/// What a tree's `/boot` holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// The kernel, relative to the tree's root, every link resolved.
    pub kernel: PathBuf,
    /// Its initrd, likewise.
    pub initrd: Option<PathBuf>,
    /// The version the kernel's file name says (`6.1.0-28-amd64` of
    /// `vmlinuz-6.1.0-28-amd64`).
    pub version: Option<String>,
}

/// The kernel of the tree at `root`, if it has one: the `/vmlinuz` (or
/// `/vmlinux`) link and `/boot/vmlinuz`/`/boot/vmlinux` first (they name the
/// distribution's default), else the `/boot/vmlinuz-*`/`/boot/vmlinux-*` of
/// the highest version. The initrd is the one with the kernel's version
/// suffix (`initrd.img-V`, `initramfs-V.img`), or an unversioned one for an
/// unversioned kernel.
pub fn find(root: &Path) -> Option<Found> {
    let named = ["vmlinuz", "vmlinux", "boot/vmlinuz", "boot/vmlinux"]
        .iter()
        .find_map(|n| resolve(root, Path::new(n)));
    let kernel = named.or_else(|| {
        let mut versioned: Vec<(String, PathBuf)> = fs::read_dir(root.join("boot"))
            .ok()?
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_str()?.to_string();
                let version = version_of(&name)?.to_string();
                let at = resolve(root, &Path::new("boot").join(&name))?;
                Some((version, at))
            })
            .collect();
        versioned.sort_by(|a, b| version_cmp(&a.0, &b.0));
        versioned.pop().map(|(_, at)| at)
    })?;
    let version = kernel
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(version_of)
        .map(str::to_string);
    let candidates: Vec<String> = match &version {
        Some(v) => vec![
            format!("boot/initrd.img-{v}"),
            format!("boot/initramfs-{v}.img"),
            format!("boot/initramfs-{v}"),
            format!("boot/initrd-{v}"),
            format!("boot/initrd-{v}.img"),
        ],
        None => [
            "boot/initrd.img",
            "boot/initramfs.img",
            "boot/initramfs",
            "boot/initrd",
            "initrd.img",
        ]
        .map(String::from)
        .to_vec(),
    };
    let initrd = candidates.iter().find_map(|c| resolve(root, Path::new(c)));
    Some(Found {
        kernel,
        initrd,
        version,
    })
}

/// `V` of `vmlinuz-V` or `vmlinux-V`.
fn version_of(name: &str) -> Option<&str> {
    name.strip_prefix("vmlinuz-")
        .or_else(|| name.strip_prefix("vmlinux-"))
        .filter(|v| !v.is_empty() && !v.ends_with(".old"))
}

/// Versions compared by their runs of digits as numbers (`6.10` after
/// `6.9`), the rest as text.
fn version_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    fn parts(s: &str) -> Vec<Result<u64, String>> {
        let mut out = Vec::new();
        let mut cur = String::new();
        let mut digits = false;
        for c in s.chars() {
            if !cur.is_empty() && c.is_ascii_digit() != digits {
                out.push(part(&cur, digits));
                cur.clear();
            }
            digits = c.is_ascii_digit();
            cur.push(c);
        }
        if !cur.is_empty() {
            out.push(part(&cur, digits));
        }
        out
    }
    fn part(s: &str, digits: bool) -> Result<u64, String> {
        if digits {
            s.parse().map_err(|_| s.to_string())
        } else {
            Err(s.to_string())
        }
    }
    parts(a).cmp(&parts(b))
}

/// `rel` resolved inside `root` to a regular file: each component looked
/// at without following it, links replaced by their targets (absolute ones
/// from `root`). `None` when it is missing, not a regular file, leaves the
/// tree or takes too many links.
pub fn resolve(root: &Path, rel: &Path) -> Option<PathBuf> {
    enum Part {
        Root,
        Up,
        Name(std::ffi::OsString),
    }
    // The parts still to walk, the next one last.
    fn push(todo: &mut Vec<Part>, p: &Path) {
        for c in p.components().collect::<Vec<_>>().into_iter().rev() {
            match c {
                Component::RootDir => todo.push(Part::Root),
                Component::ParentDir => todo.push(Part::Up),
                Component::Normal(n) => todo.push(Part::Name(n.to_os_string())),
                Component::Prefix(_) | Component::CurDir => {}
            }
        }
    }
    let mut todo = Vec::new();
    push(&mut todo, rel);
    let mut at = PathBuf::new();
    let mut links = 0usize;
    while let Some(part) = todo.pop() {
        match part {
            Part::Root => at = PathBuf::new(),
            Part::Up => {
                if !at.pop() {
                    return None;
                }
            }
            Part::Name(n) => {
                let next = at.join(n);
                let meta = fs::symlink_metadata(root.join(&next)).ok()?;
                if meta.file_type().is_symlink() {
                    links += 1;
                    if links > MAX_LINKS {
                        return None;
                    }
                    let target = fs::read_link(root.join(&next)).ok()?;
                    // Relative to the link's directory, which `at` is.
                    push(&mut todo, &target);
                } else if todo.is_empty() || meta.is_dir() {
                    at = next;
                } else {
                    return None;
                }
            }
        }
    }
    let meta = fs::symlink_metadata(root.join(&at)).ok()?;
    (meta.is_file() && !at.as_os_str().is_empty()).then_some(at)
}

/// A kernel or initrd in the image store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    pub path: PathBuf,
    /// Its SHA-256, hex.
    pub hex: String,
}

/// Copies `src` (a regular file of the build tree) into `dir` as
/// `sha256-<hex>.<ext>` through `tmp`: written, flushed, renamed and the
/// directory flushed, so the file is whole on disk before anything names
/// it. A file of that content already there is kept and `tmp` dropped.
pub fn store(src: &Path, dir: &Path, ext: &str, tmp: &Path) -> Result<Stored, OciError> {
    let mut from = OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(src)
        .map_err(|e| OciError::io("reading", src, e))?;
    if !from
        .metadata()
        .map_err(|e| OciError::io("reading", src, e))?
        .is_file()
    {
        return Err(OciError::io(
            "reading",
            src,
            std::io::Error::other("not a regular file"),
        ));
    }
    let mut to = File::create(tmp).map_err(|e| OciError::io("making", tmp, e))?;
    let result = (|| -> Result<String, OciError> {
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = from
                .read(&mut buf)
                .map_err(|e| OciError::io("reading", src, e))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            to.write_all(&buf[..n])
                .map_err(|e| OciError::io("writing", tmp, e))?;
        }
        // Only read, by QEMU.
        to.set_permissions(fs::Permissions::from_mode(0o444))
            .map_err(|e| OciError::io("writing", tmp, e))?;
        to.sync_all()
            .map_err(|e| OciError::io("flushing", tmp, e))?;
        Ok(format!("{:x}", h.finalize()))
    })();
    let hex = match result {
        Ok(h) => h,
        Err(e) => {
            let _ = fs::remove_file(tmp);
            return Err(e);
        }
    };
    let path = dir.join(format!("sha256-{hex}.{ext}"));
    if path.is_file() {
        let _ = fs::remove_file(tmp);
    } else {
        fs::rename(tmp, &path).map_err(|e| {
            let _ = fs::remove_file(tmp);
            OciError::io("storing", &path, e)
        })?;
    }
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| OciError::io("flushing", dir, e))?;
    Ok(Stored { path, hex })
}

/// The kernel (and initrd) of a built rootfs, stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Boot {
    pub kernel: Stored,
    pub initrd: Option<Stored>,
    pub version: Option<String>,
}

/// Finds the kernel of the tree at `root` and stores it and its initrd in
/// `dir` (`.kernel`, `.initrd`), through temporaries named `tmp_base` plus
/// `.kernel.tmp` / `.initrd.tmp`.
pub fn extract(root: &Path, dir: &Path, tmp_base: &str) -> Result<Option<Boot>, OciError> {
    let Some(found) = find(root) else {
        return Ok(None);
    };
    let kernel = store(
        &root.join(&found.kernel),
        dir,
        "kernel",
        &dir.join(format!("{tmp_base}.kernel.tmp")),
    )?;
    let initrd = match &found.initrd {
        Some(i) => Some(store(
            &root.join(i),
            dir,
            "initrd",
            &dir.join(format!("{tmp_base}.initrd.tmp")),
        )?),
        None => None,
    };
    Ok(Some(Boot {
        kernel,
        initrd,
        version: found.version,
    }))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn tree() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        fs::create_dir_all(t.path().join("boot")).unwrap();
        t
    }

    fn write(root: &Path, rel: &str, data: &str) {
        fs::write(root.join(rel), data).unwrap();
    }

    #[test]
    fn debian_links_name_the_kernel_and_its_initrd_by_version() {
        let t = tree();
        let r = t.path();
        write(r, "boot/vmlinuz-6.1.0-27-amd64", "old");
        write(r, "boot/vmlinuz-6.1.0-28-amd64", "new");
        write(r, "boot/initrd.img-6.1.0-27-amd64", "i-old");
        write(r, "boot/initrd.img-6.1.0-28-amd64", "i-new");
        // Debian's links: the default is the older one here, and it wins.
        symlink("boot/vmlinuz-6.1.0-27-amd64", r.join("vmlinuz")).unwrap();
        symlink("/boot/vmlinuz-6.1.0-28-amd64", r.join("vmlinuz.old")).unwrap();
        let f = find(r).unwrap();
        assert_eq!(f.kernel, Path::new("boot/vmlinuz-6.1.0-27-amd64"));
        assert_eq!(
            f.initrd.as_deref(),
            Some(Path::new("boot/initrd.img-6.1.0-27-amd64"))
        );
        assert_eq!(f.version.as_deref(), Some("6.1.0-27-amd64"));
    }

    #[test]
    fn without_links_the_highest_version_wins_numerically() {
        let t = tree();
        let r = t.path();
        write(r, "boot/vmlinuz-6.9.0", "a");
        write(r, "boot/vmlinuz-6.10.0", "b");
        write(r, "boot/initramfs-6.10.0.img", "i");
        write(r, "boot/initramfs-6.9.0.img", "j");
        write(r, "boot/config-6.11.0", "not a kernel");
        let f = find(r).unwrap();
        assert_eq!(f.kernel, Path::new("boot/vmlinuz-6.10.0"));
        assert_eq!(
            f.initrd.as_deref(),
            Some(Path::new("boot/initramfs-6.10.0.img"))
        );
    }

    #[test]
    fn an_initrd_of_another_version_is_not_taken() {
        let t = tree();
        let r = t.path();
        write(r, "boot/vmlinux-5.10.77", "k");
        write(r, "boot/initrd.img-5.4.0", "other");
        let f = find(r).unwrap();
        assert_eq!(f.kernel, Path::new("boot/vmlinux-5.10.77"));
        assert_eq!(f.initrd, None);
    }

    #[test]
    fn an_ignite_kernel_image_has_plain_names() {
        let t = tree();
        let r = t.path();
        write(r, "boot/vmlinux", "k");
        let f = find(r).unwrap();
        assert_eq!(f.kernel, Path::new("boot/vmlinux"));
        assert_eq!((f.initrd, f.version), (None, None));
        write(r, "boot/initrd.img", "i");
        assert_eq!(
            find(r).unwrap().initrd.as_deref(),
            Some(Path::new("boot/initrd.img"))
        );
    }

    #[test]
    fn links_leaving_the_tree_are_not_followed() {
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("vmlinuz-9.9"), "host kernel").unwrap();
        let t = tree();
        let r = t.path();
        // An absolute target is the tree's own, which lacks it.
        symlink(outside.path().join("vmlinuz-9.9"), r.join("vmlinuz")).unwrap();
        // A climb above the root.
        let up = format!(
            "../../../../../../../..{}/vmlinuz-9.9",
            outside.path().display()
        );
        symlink(&up, r.join("boot/vmlinuz")).unwrap();
        symlink(&up, r.join("boot/vmlinuz-9.9")).unwrap();
        assert_eq!(find(r), None);
        assert_eq!(resolve(r, Path::new("boot/vmlinuz")), None);
    }

    #[test]
    fn link_chains_and_directory_links_resolve_inside_the_tree() {
        let t = tree();
        let r = t.path();
        fs::create_dir_all(r.join("usr/lib/kernel")).unwrap();
        write(r, "usr/lib/kernel/vmlinuz-6.5", "k");
        symlink("/usr/lib", r.join("lib")).unwrap();
        symlink("../lib/kernel/vmlinuz-6.5", r.join("boot/vmlinuz-6.5")).unwrap();
        symlink("boot/vmlinuz-6.5", r.join("vmlinuz")).unwrap();
        let f = find(r).unwrap();
        assert_eq!(f.kernel, Path::new("usr/lib/kernel/vmlinuz-6.5"));
        assert_eq!(f.version.as_deref(), Some("6.5"));
        // A loop ends.
        symlink("b", r.join("a")).unwrap();
        symlink("a", r.join("b")).unwrap();
        assert_eq!(resolve(r, Path::new("a")), None);
        // A directory is not a kernel.
        fs::create_dir_all(r.join("boot/vmlinuz-7.0")).unwrap();
        assert_eq!(resolve(r, Path::new("boot/vmlinuz-7.0")), None);
    }

    #[test]
    fn no_boot_no_kernel() {
        let t = tempfile::tempdir().unwrap();
        assert_eq!(find(t.path()), None);
        fs::create_dir_all(t.path().join("boot")).unwrap();
        write(t.path(), "boot/grub.cfg", "x");
        assert_eq!(find(t.path()), None);
    }

    #[test]
    fn stored_files_are_named_by_content_read_only_and_once() {
        let t = tree();
        let r = t.path();
        write(r, "boot/vmlinuz-1.0", "kernel bytes");
        write(r, "boot/initrd.img-1.0", "initrd bytes");
        let store_dir = tempfile::tempdir().unwrap();
        let d = store_dir.path();
        let b = extract(r, d, ".import-00000001-x").unwrap().unwrap();
        let hex = format!("{:x}", Sha256::digest(b"kernel bytes"));
        assert_eq!(b.kernel.path, d.join(format!("sha256-{hex}.kernel")));
        assert_eq!(fs::read(&b.kernel.path).unwrap(), b"kernel bytes");
        let mode = fs::metadata(&b.kernel.path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o444);
        let initrd = b.initrd.unwrap();
        assert!(initrd.path.to_str().unwrap().ends_with(".initrd"));
        assert_eq!(b.version.as_deref(), Some("1.0"));
        // Again: the same files, no temporaries left.
        let again = extract(r, d, ".import-00000002-y").unwrap().unwrap();
        assert_eq!(again.kernel.path, b.kernel.path);
        let names: Vec<_> = fs::read_dir(d).unwrap().flatten().collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }
}
