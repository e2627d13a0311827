//! A disk's chain of layers, opened for QEMU and checked on the very
//! descriptors QEMU gets.
//!
//! hearthd opens every layer as root and QEMU, unprivileged, reads through
//! the descriptor. So what is checked must be the file that is handed over:
//! each layer is opened once, without following a symbolic link and
//! without blocking (a FIFO put in its place cannot hang the open), and
//! then, on that descriptor, it must be a regular file whose real path (the
//! kernel's name for the descriptor) is the one the caller expects, and its
//! header must name exactly the next layer of the chain as its backing file
//! (the bottom: none, and no data file either). A base image re-pointed at
//! a device with `qemu-img rebase -u`, or swapped for a link to another
//! file, is refused before QEMU has anything of it; a swap after the open
//! changes nothing, the descriptor is already the checked file.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::cmdline::DiskAttachment;
use crate::probe::{self, Qcow2Refusal, Sniffed};

/// Why a layer of a chain is not handed to QEMU. Every message names the
/// file.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is a symbolic link (to {target}), not the file the disk was made with")]
    Symlink { path: PathBuf, target: String },
    #[error("{path} is a {kind}, not a regular file")]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error("{path} opens the file {real}, not {expected}: a directory on its way was replaced")]
    Elsewhere {
        path: PathBuf,
        real: PathBuf,
        expected: PathBuf,
    },
    #[error("cannot read the header of {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a qcow2 image any more ({found})")]
    NotQcow2 { path: PathBuf, found: String },
    #[error("{path} {}", backing_mismatch(.named, .expected))]
    WrongBacking {
        path: PathBuf,
        named: Option<String>,
        expected: Option<PathBuf>,
    },
    #[error("{path} is refused: {refusal}")]
    Refused {
        path: PathBuf,
        refusal: Qcow2Refusal,
    },
    #[error("{path}: a {format} layer can only be the bottom of a chain")]
    NotBottom { path: PathBuf, format: String },
    #[error("{path}: layer format {format:?} is not qcow2 or raw")]
    Format { path: PathBuf, format: String },
}

fn backing_mismatch(named: &Option<String>, expected: &Option<PathBuf>) -> String {
    match (named, expected) {
        (Some(n), None) => format!(
            "names {n:?} as its backing file, but it is the bottom of the chain recorded for the disk"
        ),
        (None, Some(x)) => format!(
            "names no backing file, but the chain recorded for the disk has {} below it",
            x.display()
        ),
        (n, x) => format!(
            "names {:?} as its backing file, but the chain recorded for the disk has {} below it",
            n.as_deref().unwrap_or_default(),
            x.as_deref()
                .map(Path::display)
                .map(|d| d.to_string())
                .unwrap_or_default()
        ),
    }
}

/// One file of a chain and what it must be.
#[derive(Clone, Copy, Debug)]
pub struct ExpectedLayer<'a> {
    /// The name it is opened by (also its fd set's label).
    pub path: &'a Path,
    /// What the kernel must call the opened file (`/proc/self/fd/N`).
    pub real_path: &'a Path,
    /// `qcow2` or `raw`.
    pub format: &'a str,
    pub writable: bool,
    /// The file the header must name as its backing file: the next layer's
    /// `path`; `None` at the bottom.
    pub backing: Option<&'a Path>,
}

/// Opens the disk's layers, top first, as QEMU's nodes open them (the top
/// read-write unless the disk is read-only, the others read-only), each
/// checked as [`open_layer`] does. The top is the disk's own file in
/// hearthd's private state directory: its real path is what its name
/// resolves to now.
pub fn open_disk(disk: &DiskAttachment) -> Result<Vec<OwnedFd>, LayerError> {
    open_chain(disk, !disk.read_only)
}

/// The checks of [`open_disk`], everything opened read-only and closed
/// again: for a caller that wants to refuse a chain before it prepares
/// anything else for QEMU.
pub fn check_disk(disk: &DiskAttachment) -> Result<(), LayerError> {
    open_chain(disk, false).map(drop)
}

fn open_chain(disk: &DiskAttachment, writable_top: bool) -> Result<Vec<OwnedFd>, LayerError> {
    let top_real = std::fs::canonicalize(&disk.path).map_err(|source| LayerError::Open {
        path: disk.path.clone(),
        source,
    })?;
    let mut fds = vec![open_layer(&ExpectedLayer {
        path: &disk.path,
        real_path: &top_real,
        format: "qcow2",
        writable: writable_top,
        backing: disk.backing.first().map(|b| b.path.as_path()),
    })?];
    for (j, layer) in disk.backing.iter().enumerate() {
        fds.push(open_layer(&ExpectedLayer {
            path: &layer.path,
            real_path: &layer.real_path,
            format: &layer.format,
            writable: false,
            backing: disk.backing.get(j + 1).map(|b| b.path.as_path()),
        })?);
    }
    Ok(fds)
}

/// Opens one layer and checks it on the descriptor: a regular file, really
/// at `real_path`, whose header (a qcow2's) names `backing` and no data
/// file. The bottom of a chain (`backing: None`) passes the checks of an
/// imported image ([`probe::Qcow2Header::check`]); a raw file names
/// nothing, so it only has to be the bottom.
pub fn open_layer(e: &ExpectedLayer<'_>) -> Result<OwnedFd, LayerError> {
    let path = e.path.to_path_buf();
    let open_err = |source: std::io::Error| LayerError::Open {
        path: path.clone(),
        source,
    };
    // Refused by name first, so a device put in its place is not even
    // opened (opening some devices does something).
    let meta = std::fs::symlink_metadata(e.path).map_err(open_err)?;
    not_a_link_or_special(e.path, &meta.file_type())?;
    let file = OpenOptions::new()
        .read(true)
        .write(e.writable)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(e.path)
        .map_err(|source| {
            if source.raw_os_error() == Some(libc::ELOOP) {
                LayerError::Symlink {
                    path: path.clone(),
                    target: link_target(e.path),
                }
            } else {
                open_err(source)
            }
        })?;
    let meta = file.metadata().map_err(open_err)?;
    not_a_link_or_special(e.path, &meta.file_type())?;
    // O_NONBLOCK was for the open only; QEMU gets an ordinary descriptor.
    let flags = rustix::fs::fcntl_getfl(&file).map_err(|e| open_err(e.into()))?;
    rustix::fs::fcntl_setfl(&file, flags - rustix::fs::OFlags::NONBLOCK)
        .map_err(|e| open_err(e.into()))?;
    let real =
        std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).map_err(open_err)?;
    if real != e.real_path {
        return Err(LayerError::Elsewhere {
            path,
            real,
            expected: e.real_path.to_path_buf(),
        });
    }
    match e.format {
        "qcow2" => check_qcow2(&file, e)?,
        "raw" if e.backing.is_none() => {}
        "raw" => {
            return Err(LayerError::NotBottom {
                path,
                format: "raw".into(),
            });
        }
        other => {
            return Err(LayerError::Format {
                path,
                format: other.into(),
            });
        }
    }
    Ok(file.into())
}

fn not_a_link_or_special(path: &Path, t: &std::fs::FileType) -> Result<(), LayerError> {
    let kind = if t.is_file() {
        return Ok(());
    } else if t.is_symlink() {
        return Err(LayerError::Symlink {
            path: path.to_path_buf(),
            target: link_target(path),
        });
    } else if t.is_dir() {
        "directory"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else {
        "special file"
    };
    Err(LayerError::NotRegular {
        path: path.to_path_buf(),
        kind,
    })
}

fn link_target(path: &Path) -> String {
    std::fs::read_link(path)
        .map(|t| t.display().to_string())
        .unwrap_or_else(|_| "an unreadable target".into())
}

/// The first [`probe::HEAD_BYTES`] of the file (fewer if it is shorter),
/// read with `pread`: the descriptor's offset, which QEMU inherits, is not
/// moved.
pub fn read_head(file: &File) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let mut head = vec![0u8; probe::HEAD_BYTES];
    let mut got = 0;
    while got < head.len() {
        match file.read_at(&mut head[got..], got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    head.truncate(got);
    Ok(head)
}

fn check_qcow2(file: &File, e: &ExpectedLayer<'_>) -> Result<(), LayerError> {
    let path = e.path.to_path_buf();
    let head = read_head(file).map_err(|source| LayerError::Read {
        path: path.clone(),
        source,
    })?;
    let header = match probe::sniff(&head) {
        Ok(Sniffed::Qcow2(h)) => h,
        Ok(Sniffed::Raw(_)) => {
            return Err(LayerError::NotQcow2 {
                path,
                found: "no image format's header".into(),
            });
        }
        Ok(Sniffed::Other(format)) => {
            return Err(LayerError::NotQcow2 {
                path,
                found: format!("a {format} image"),
            });
        }
        Err(refusal) => return Err(LayerError::Refused { path, refusal }),
    };
    let refused = |refusal| LayerError::Refused {
        path: path.clone(),
        refusal,
    };
    let named = header.backing_file_name(&head).map_err(refused)?;
    if named != e.backing.map(|b| b.as_os_str().as_encoded_bytes()) {
        return Err(LayerError::WrongBacking {
            path: path.clone(),
            named: named.map(|n| String::from_utf8_lossy(n).into_owned()),
            expected: e.backing.map(Path::to_path_buf),
        });
    }
    if e.backing.is_none() {
        // The bottom: what an imported image must pass.
        return header.check().map_err(refused);
    }
    if header.names_data_file() {
        return Err(refused(Qcow2Refusal::ExternalDataFile));
    }
    Ok(())
}
