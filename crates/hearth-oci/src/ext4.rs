//! The ext4 disk image of an unpacked rootfs: `mkfs.ext4 -d DIR` (e2fsprogs
//! copies the tree with owners, modes, xattrs, hard links, device nodes
//! and mtimes), sized to the content plus headroom.
//!
//! Why mkfs.ext4: it is the ext4 reference implementation, on every host
//! hearth runs on, and writes the filesystem without mounting anything.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::process::Command;

use crate::OciError;

const BLOCK: u64 = 4096;
const MIB: u64 = 1 << 20;

/// What the tree needs: data blocks and inodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Measure {
    /// Bytes of data, each file rounded up to whole blocks.
    pub bytes: u64,
    /// Entries, each one inode (hard links counted once).
    pub inodes: u64,
}

/// Walks `dir` without following links.
pub fn measure(dir: &Path) -> Result<Measure, OciError> {
    let mut m = Measure::default();
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        let entries = fs::read_dir(&at).map_err(|e| OciError::io("reading", &at, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| OciError::io("reading", &at, e))?;
            let meta = fs::symlink_metadata(entry.path())
                .map_err(|e| OciError::io("reading", entry.path(), e))?;
            if meta.nlink() > 1 && !meta.is_dir() && !seen.insert(meta.ino()) {
                continue;
            }
            m.inodes += 1;
            let ft = meta.file_type();
            if ft.is_dir() {
                m.bytes += BLOCK;
                stack.push(entry.path());
            } else if ft.is_file() {
                m.bytes += meta.len().div_ceil(BLOCK) * BLOCK;
            } else if ft.is_symlink() && meta.len() >= 60 {
                // Targets under 60 bytes live in the inode itself.
                m.bytes += BLOCK;
            } else if !(ft.is_symlink()
                || ft.is_fifo()
                || ft.is_char_device()
                || ft.is_block_device()
                || ft.is_socket())
            {
                m.bytes += BLOCK;
            }
        }
    }
    Ok(m)
}

/// The size of a filesystem for `m`: the data, an eighth more, the inode
/// tables (256 bytes an inode), and 64 MiB for the journal and metadata;
/// at least `min`, in whole MiB.
pub fn size_for(m: Measure, min: u64) -> u64 {
    let want = m.bytes + m.bytes / 8 + inodes_for(m) * 256 + 64 * MIB;
    want.max(min).div_ceil(MIB) * MIB
}

/// Inodes to make: the entries, a quarter more, and some for the guest.
pub fn inodes_for(m: Measure) -> u64 {
    m.inodes + m.inodes / 4 + 4096
}

/// Builds the ext4 image `out` from the tree `dir`, at least `min` bytes
/// large. Returns its size.
pub fn build(dir: &Path, out: &Path, min: u64) -> Result<u64, OciError> {
    let m = measure(dir)?;
    let size = size_for(m, min);
    let file = File::create(out).map_err(|e| OciError::io("making", out, e))?;
    file.set_len(size)
        .map_err(|e| OciError::io("sizing", out, e))?;
    drop(file);
    let mut command = Command::new("mkfs.ext4");
    dies_with_parent(&mut command);
    let result = command
        .args(["-q", "-F", "-t", "ext4", "-m", "1", "-L", "rootfs"])
        .arg("-N")
        .arg(inodes_for(m).to_string())
        .arg("-d")
        .arg(dir)
        .arg(out)
        .output();
    let output = match result {
        Ok(o) => o,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(OciError::io(
                "running mkfs.ext4 (install e2fsprogs) for",
                out,
                e,
            ));
        }
        Err(e) => return Err(OciError::io("running mkfs.ext4 for", out, e)),
    };
    if !output.status.success() {
        let _ = fs::remove_file(out);
        return Err(OciError::Build(format!(
            "mkfs.ext4 -d {} failed ({}): {}",
            dir.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(size)
}

/// mkfs.ext4 is killed when the thread that started it dies: a daemon
/// killed mid-build must not leave it writing into a file the restart's
/// sweep removes, from a build directory the sweep is removing.
fn dies_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = rustix::process::getpid();
    // SAFETY: the closure runs in the child between fork and exec and only
    // makes two system calls (prctl, getppid) and may exit: all
    // async-signal-safe.
    unsafe {
        command.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
            // The parent died before the prctl: nothing would send it.
            if rustix::process::getppid() != Some(parent) {
                std::process::exit(1);
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_size_covers_data_inodes_and_headroom_in_whole_mib() {
        let m = Measure {
            bytes: 100 * MIB,
            inodes: 10_000,
        };
        let s = size_for(m, 0);
        assert_eq!(s % MIB, 0);
        assert!(s >= 100 * MIB + 12 * MIB + 64 * MIB, "{s}");
        assert_eq!(size_for(Measure::default(), 1 << 30), 1 << 30);
    }
}
