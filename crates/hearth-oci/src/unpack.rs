//! The layer applier: a rootfs image's layers, bottom first, written into a
//! build directory with the image spec's semantics (whiteouts, opaque
//! directories, a non-directory replacing a directory, hard links also
//! across layers, symlinks, device nodes and FIFOs, owners, modes, xattrs
//! such as `security.capability`, mtimes).
//!
//! Written by hand because no maintained crate applies OCI layers (the tar
//! crate unpacks one archive, without whiteouts, and follows what it finds).
//!
//! Nothing is written outside the build directory: every path is resolved
//! with `openat2(RESOLVE_BENEATH)` from the directory's descriptor, so a
//! `..` or an absolute symlink met on the way fails (`EXDEV`) instead of
//! being followed, and each node is made with an `*at` call on its parent's
//! descriptor without following its last component. Relative symlinks that
//! stay inside (`bin -> usr/bin`) are followed, as a container runtime does.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;

use oci_spec::image::Descriptor;
use rustix::fs::{
    AtFlags, FileType, Mode, OFlags, ResolveFlags, Timespec, Timestamps, XattrFlags, chmodat,
    chownat, linkat, makedev, mkdirat, mknodat, openat, openat2, statat, symlinkat, unlinkat,
    utimensat,
};
use rustix::io::Errno;
use rustix::process::{Gid, Uid};

use crate::OciError;
use crate::layers::tar_stream;
use crate::shape::entry_path;

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";

/// What the layers put into the build directory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Unpacked {
    pub layers: usize,
    /// Entries written (whiteouts not counted).
    pub entries: u64,
    /// Bytes of regular files written.
    pub bytes: u64,
}

/// Asked with a regular file's length before its bytes are written; an
/// `Err` (its message) stops the unpack there. The caller's free-space
/// reserve: a layer's uncompressed size is known only as it is read.
pub type RoomCheck = Box<dyn FnMut(u64) -> Result<(), String> + Send>;

/// Applies layers, in order, into one build directory.
pub struct Unpacker {
    root: OwnedFd,
    /// Directory mtimes, set at the end: writing into a directory changes
    /// its mtime.
    dir_times: HashMap<String, Timestamps>,
    done: Unpacked,
    room: Option<RoomCheck>,
}

/// Why one entry failed: an I/O error, or a path that would leave the root.
enum Refused {
    Io(String, io::Error),
    Escapes(String),
    Bad(String),
    NoRoom(u64, String),
}

fn errno(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e.raw_os_error())
}

fn split(path: &str) -> (&str, &str) {
    path.rsplit_once('/').unwrap_or(("", path))
}

fn beneath() -> ResolveFlags {
    ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS
}

impl Unpacker {
    /// An applier into `root`, an empty directory hearth made.
    pub fn new(root: &Path) -> Result<Unpacker, OciError> {
        let fd = rustix::fs::open(
            root,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
        )
        .map_err(|e| OciError::io("opening the build directory", root, errno(e)))?;
        Ok(Unpacker {
            root: fd,
            dir_times: HashMap::new(),
            done: Unpacked::default(),
            room: None,
        })
    }

    /// Every regular file is first admitted by `check`.
    pub fn with_room_check(mut self, check: RoomCheck) -> Unpacker {
        self.room = Some(check);
        self
    }

    /// Applies one layer, read from `blob`, uncompressed to at most `limit`
    /// bytes.
    pub fn layer(
        &mut self,
        layer: &Descriptor,
        blob: impl Read,
        limit: u64,
    ) -> Result<(), OciError> {
        let digest = layer.digest().to_string();
        let fail = |message: String| OciError::Layer {
            digest: digest.clone(),
            message,
        };
        let mut archive = tar::Archive::new(tar_stream(layer, blob, limit)?);
        let entries = archive
            .entries()
            .map_err(|e| fail(format!("reading the tar: {e}")))?;
        // Paths this layer wrote: an opaque directory keeps them.
        let mut this_layer: HashSet<String> = HashSet::new();
        for entry in entries {
            let mut entry = entry.map_err(|e| fail(format!("reading the tar: {e}")))?;
            let path = entry_path(&entry.path_bytes()).map_err(&fail)?;
            match self.entry(&mut entry, &path, &mut this_layer) {
                Ok(()) => {}
                Err(Refused::Io(what, e)) => return Err(fail(format!("{path:?}: {what}: {e}"))),
                Err(Refused::Escapes(through)) => {
                    return Err(fail(format!(
                        "the entry {path:?} would be written outside the root: {through} leads out of it (an absolute or climbing link)"
                    )));
                }
                Err(Refused::Bad(why)) => return Err(fail(format!("{path:?}: {why}"))),
                Err(Refused::NoRoom(needs, message)) => {
                    return Err(OciError::NoRoom {
                        needs,
                        message: format!("layer {digest}, {path:?}: {message}"),
                    });
                }
            }
        }
        self.done.layers += 1;
        Ok(())
    }

    /// Sets the directories' mtimes, deepest first, and says what was done.
    pub fn finish(self) -> Result<Unpacked, OciError> {
        let mut dirs: Vec<(&String, &Timestamps)> = self.dir_times.iter().collect();
        dirs.sort_by_key(|(p, _)| std::cmp::Reverse(p.matches('/').count()));
        for (path, times) in dirs {
            let result = if path.is_empty() {
                utimensat(&self.root, ".", times, AtFlags::empty())
            } else {
                let (parent, name) = split(path);
                match self.open_dir(parent) {
                    Ok(dir) => utimensat(&dir, name, times, AtFlags::SYMLINK_NOFOLLOW),
                    // A parent that a later layer removed or replaced.
                    Err(_) => Ok(()),
                }
            };
            match result {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(e) => {
                    return Err(OciError::Build(format!(
                        "{path:?}: setting its mtime: {}",
                        errno(e)
                    )));
                }
            }
        }
        Ok(self.done)
    }

    fn entry<R: Read>(
        &mut self,
        entry: &mut tar::Entry<R>,
        path: &str,
        this_layer: &mut HashSet<String>,
    ) -> Result<(), Refused> {
        let (parent, name) = split(path);
        if name == OPAQUE {
            return self.opaque(parent, this_layer);
        }
        if let Some(hidden) = name.strip_prefix(WHITEOUT) {
            if hidden.is_empty() || hidden == "." || hidden == ".." {
                return Err(Refused::Bad("a whiteout that names nothing".into()));
            }
            let hidden_path = if parent.is_empty() {
                hidden.to_string()
            } else {
                format!("{parent}/{hidden}")
            };
            self.forget_times(&hidden_path);
            return match self.open_dir(parent) {
                Ok(dir) => remove(&dir, hidden),
                // Nothing below to hide.
                Err(Refused::Io(_, e)) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e),
            };
        }
        let header = entry.header().clone();
        let kind = header.entry_type();
        let mode = header
            .mode()
            .map_err(|e| Refused::Bad(format!("its mode: {e}")))?
            & 0o7777;
        let mtime = header
            .mtime()
            .map_err(|e| Refused::Bad(format!("its mtime: {e}")))?;
        let times = Timestamps {
            last_access: Timespec {
                tv_sec: mtime as i64,
                tv_nsec: 0,
            },
            last_modification: Timespec {
                tv_sec: mtime as i64,
                tv_nsec: 0,
            },
        };
        let uid = header
            .uid()
            .map_err(|e| Refused::Bad(format!("its uid: {e}")))?;
        let gid = header
            .gid()
            .map_err(|e| Refused::Bad(format!("its gid: {e}")))?;
        let xattrs = xattrs(entry)?;

        if path.is_empty() {
            // The root itself: its metadata only.
            self.metadata(
                &self.root.try_clone().map_err(io_err("the root"))?,
                ".",
                uid,
                gid,
                mode,
                &xattrs,
                true,
            )?;
            self.dir_times.insert(String::new(), times);
            return Ok(());
        }
        let dir = self.make_dirs(parent)?;
        if kind != tar::EntryType::Directory {
            // Whatever directory was here goes, and its time with it.
            self.forget_times(path);
        }
        match kind {
            tar::EntryType::Directory => {
                let is_dir = matches!(
                    statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW),
                    Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory
                );
                if !is_dir {
                    remove(&dir, name)?;
                    mkdirat(&dir, name, Mode::from_raw_mode(0o700))
                        .map_err(io_errno("making the directory"))?;
                }
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                if let Some(check) = self.room.as_mut() {
                    let size = header
                        .size()
                        .map_err(|e| Refused::Bad(format!("its size: {e}")))?;
                    check(size).map_err(|m| Refused::NoRoom(self.done.bytes + size, m))?;
                }
                remove(&dir, name)?;
                let fd = openat(
                    &dir,
                    name,
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o600),
                )
                .map_err(io_errno("making the file"))?;
                let mut file = File::from(fd);
                let n = io::copy(entry, &mut file).map_err(|e| Refused::Io("writing".into(), e))?;
                self.done.bytes += n;
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| Refused::Bad("a symlink with no target".into()))?;
                remove(&dir, name)?;
                symlinkat(target.as_ref(), &dir, name).map_err(io_errno("making the symlink"))?;
            }
            tar::EntryType::Link => {
                let raw = entry
                    .link_name_bytes()
                    .ok_or_else(|| Refused::Bad("a hard link with no target".into()))?;
                let target = entry_path(&raw).map_err(Refused::Bad)?;
                if target == path {
                    return Ok(());
                }
                let (tparent, tname) = split(&target);
                let tdir = self.open_dir(tparent)?;
                remove(&dir, name)?;
                linkat(&tdir, tname, &dir, name, AtFlags::empty())
                    .map_err(|e| Refused::Io(format!("linking to {target:?}"), errno(e)))?;
                // A hard link shares its target's inode and metadata.
                this_layer.insert(path.to_string());
                self.done.entries += 1;
                return Ok(());
            }
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                let ft = match kind {
                    tar::EntryType::Char => FileType::CharacterDevice,
                    tar::EntryType::Block => FileType::BlockDevice,
                    _ => FileType::Fifo,
                };
                let major = header.device_major().ok().flatten().unwrap_or(0);
                let minor = header.device_minor().ok().flatten().unwrap_or(0);
                remove(&dir, name)?;
                mknodat(
                    &dir,
                    name,
                    ft,
                    Mode::from_raw_mode(0o600),
                    makedev(major, minor),
                )
                .map_err(io_errno("making the node"))?;
            }
            // Global pax headers carry nothing for one entry.
            tar::EntryType::XGlobalHeader => return Ok(()),
            other => {
                return Err(Refused::Bad(format!(
                    "a tar entry of type {other:?}, which hearth does not take"
                )));
            }
        }
        let is_dir = kind == tar::EntryType::Directory;
        let symlink = kind == tar::EntryType::Symlink;
        self.metadata(&dir, name, uid, gid, mode, &xattrs, !symlink)?;
        if is_dir {
            self.dir_times.insert(path.to_string(), times);
        } else {
            utimensat(&dir, name, &times, AtFlags::SYMLINK_NOFOLLOW)
                .map_err(io_errno("setting its mtime"))?;
        }
        this_layer.insert(path.to_string());
        self.done.entries += 1;
        Ok(())
    }

    /// Drops the directory times recorded for `path` and below it.
    fn forget_times(&mut self, path: &str) {
        let below = format!("{path}/");
        self.dir_times
            .retain(|p, _| p != path && !p.starts_with(&below));
    }

    /// Owner, then mode (a chown clears setuid bits), then xattrs (a chown
    /// clears `security.capability` too).
    #[allow(clippy::too_many_arguments)]
    fn metadata(
        &self,
        dir: &OwnedFd,
        name: &str,
        uid: u64,
        gid: u64,
        mode: u32,
        xattrs: &[(String, Vec<u8>)],
        chmod: bool,
    ) -> Result<(), Refused> {
        let (uid, gid) = (
            u32::try_from(uid).map_err(|_| Refused::Bad(format!("uid {uid} is out of range")))?,
            u32::try_from(gid).map_err(|_| Refused::Bad(format!("gid {gid} is out of range")))?,
        );
        chownat(
            dir,
            name,
            Some(Uid::from_raw(uid)),
            Some(Gid::from_raw(gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(io_errno("setting its owner"))?;
        if chmod {
            // Not a symlink (we made the node): following it is moot.
            chmodat(dir, name, Mode::from_raw_mode(mode), AtFlags::empty())
                .map_err(io_errno("setting its mode"))?;
        }
        if !xattrs.is_empty() {
            let at = format!("/proc/self/fd/{}/{name}", dir.as_fd().as_raw_fd());
            for (key, value) in xattrs {
                rustix::fs::lsetxattr(at.as_str(), key.as_str(), value, XattrFlags::empty())
                    .map_err(|e| Refused::Io(format!("setting the xattr {key}"), errno(e)))?;
            }
        }
        Ok(())
    }

    /// The directory `path` under the root, resolved beneath it.
    fn open_dir(&self, path: &str) -> Result<OwnedFd, Refused> {
        let at = if path.is_empty() { "." } else { path };
        openat2(
            &self.root,
            at,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            beneath(),
        )
        .map_err(|e| match e {
            Errno::XDEV => Refused::Escapes(format!("{path:?}")),
            e => Refused::Io(format!("opening {path:?}"), errno(e)),
        })
    }

    /// The directory `path`, with what is missing of it made (0755, as a
    /// container runtime makes the parents a layer does not list).
    fn make_dirs(&self, path: &str) -> Result<OwnedFd, Refused> {
        match self.open_dir(path) {
            Err(Refused::Io(_, e)) if e.kind() == io::ErrorKind::NotFound => {}
            other => return other,
        }
        let mut at = String::new();
        for part in path.split('/') {
            let parent = self.open_dir(&at)?;
            match mkdirat(&parent, part, Mode::from_raw_mode(0o755)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(e) => return Err(Refused::Io(format!("making {part:?}"), errno(e))),
            }
            if !at.is_empty() {
                at.push('/');
            }
            at.push_str(part);
        }
        self.open_dir(path)
    }

    /// Removes what lower layers put under `dir`, keeping what this layer
    /// wrote there (and, inside it, what this layer wrote).
    fn opaque(&self, dir: &str, this_layer: &HashSet<String>) -> Result<(), Refused> {
        let fd = match self.open_dir(dir) {
            Ok(fd) => fd,
            Err(Refused::Io(_, e)) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        for name in list(&fd)? {
            let child = if dir.is_empty() {
                name.clone()
            } else {
                format!("{dir}/{name}")
            };
            if !this_layer.contains(&child) {
                remove(&fd, &name)?;
            } else if matches!(
                statat(&fd, name.as_str(), AtFlags::SYMLINK_NOFOLLOW),
                Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory
            ) {
                self.opaque(&child, this_layer)?;
            }
        }
        Ok(())
    }
}

fn io_errno(what: &'static str) -> impl Fn(Errno) -> Refused {
    move |e| Refused::Io(what.to_string(), errno(e))
}

fn io_err(what: &'static str) -> impl Fn(io::Error) -> Refused {
    move |e| Refused::Io(what.to_string(), e)
}

/// The names in the directory `fd`.
fn list(fd: &OwnedFd) -> Result<Vec<String>, Refused> {
    let at = format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd());
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&at).map_err(io_err("listing"))? {
        let entry = entry.map_err(io_err("listing"))?;
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    Ok(names)
}

/// Removes `name` in `dir` and all under it; nothing there is fine.
fn remove(dir: &OwnedFd, name: &str) -> Result<(), Refused> {
    let st = match statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(Refused::Io(format!("looking at {name:?}"), errno(e))),
    };
    if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
        let child = openat(
            dir,
            name,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(io_errno("opening a directory to remove"))?;
        for n in list(&child)? {
            remove(&child, &n)?;
        }
        unlinkat(dir, name, AtFlags::REMOVEDIR).map_err(io_errno("removing a directory"))
    } else {
        unlinkat(dir, name, AtFlags::empty()).map_err(io_errno("removing"))
    }
}

/// The entry's xattrs, from its pax records (`SCHILY.xattr.NAME`, as GNU
/// tar, Docker and umoci write them).
fn xattrs<R: Read>(entry: &mut tar::Entry<R>) -> Result<Vec<(String, Vec<u8>)>, Refused> {
    let mut out = Vec::new();
    let Some(exts) = entry
        .pax_extensions()
        .map_err(io_err("reading its pax records"))?
    else {
        return Ok(out);
    };
    for ext in exts {
        let ext = ext.map_err(io_err("reading its pax records"))?;
        let Ok(key) = ext.key() else { continue };
        if let Some(name) = key.strip_prefix("SCHILY.xattr.") {
            out.push((name.to_string(), ext.value_bytes().to_vec()));
        }
    }
    Ok(out)
}
