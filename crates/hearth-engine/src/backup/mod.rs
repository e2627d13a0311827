//! Backups of a VM's disks into a directory (docs/backup.md): the cut is a
//! checkpoint VM snapshot, the change since the previous backup is read
//! off the layer chains (`choose`), the bytes come from the cut's own
//! layers (`copy`), and the target's manifest is the commit (`target`).

pub mod choose;
pub mod copy;
pub mod reconcile;
mod sink;
pub mod target;
pub mod verify;

pub use reconcile::reconcile;

use std::path::{Path, PathBuf};

/// A file operation of a backup that failed, naming the file.
#[derive(Debug, thiserror::Error)]
#[error("{what} {}: {source}", path.display())]
pub struct FileError {
    what: &'static str,
    path: PathBuf,
    #[source]
    source: std::io::Error,
}

/// `.map_err(io("syncing", path))`
fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> FileError {
    let path = path.to_path_buf();
    move |source| FileError { what, path, source }
}

/// The SHA-256 (hex) and length of a file's bytes.
fn sha256_of(path: &Path) -> Result<(String, u64), FileError> {
    sha256_counting(
        path,
        &std::sync::atomic::AtomicU64::new(0),
        &std::sync::atomic::AtomicBool::new(false),
    )
}

/// [`sha256_of`], adding each chunk's length to `read` as it goes (the
/// progress of a long hash), and giving up between chunks once `stop` is
/// set (nobody wants the result any more).
fn sha256_counting(
    path: &Path,
    read: &std::sync::atomic::AtomicU64,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<(String, u64), FileError> {
    use sha2::Digest as _;
    use std::io::Read as _;
    let mut f = std::fs::File::open(path).map_err(io("opening", path))?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(io("reading", path)(std::io::Error::other("stopped")));
        }
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io("reading", path)(e)),
        };
        h.update(&buf[..n]);
        size += n as u64;
        read.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    }
    Ok((format!("{:x}", h.finalize()), size))
}
