//! The blob store: every blob once, named by its sha256, under
//! `ROOT/sha256/HEX`. Images that share layers share their files.
//!
//! A blob is written to `ROOT/tmp/`, hashed as it streams, checked against
//! the digest and size its descriptor names, flushed to disk, and only then
//! renamed to its name (and the directory flushed). So a file under
//! `sha256/` was whole and verified when it got its name; a crash leaves at
//! most a file in `tmp/`, which [`BlobStore::sweep`] removes at start.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use oci_spec::image::{Digest, DigestAlgorithm};
use sha2::{Digest as _, Sha256};

use crate::OciError;

/// The hex of a sha256 digest; any other algorithm is refused.
pub fn sha256_hex(digest: &Digest) -> Result<&str, OciError> {
    match digest.algorithm() {
        // The parser checked 64 lowercase hex characters: safe in a path.
        DigestAlgorithm::Sha256 => Ok(digest.digest()),
        _ => Err(OciError::UnsupportedDigest {
            digest: digest.to_string(),
        }),
    }
}

/// A directory of blobs named by digest.
#[derive(Clone, Debug)]
pub struct BlobStore {
    root: PathBuf,
}

impl BlobStore {
    /// Opens (making it if needed) the store at `root`. Several writers may
    /// share it; each writes its own file in `tmp/`.
    pub fn open(root: impl Into<PathBuf>) -> Result<BlobStore, OciError> {
        let root = root.into();
        for dir in [root.join("sha256"), root.join("tmp")] {
            fs::create_dir_all(&dir).map_err(|e| OciError::io("making", &dir, e))?;
        }
        Ok(BlobStore { root })
    }

    /// Removes what interrupted writes left in `tmp/`: at start, before
    /// any writer runs. Returns how many files went.
    pub fn sweep(&self) -> Result<usize, OciError> {
        let tmp = self.root.join("tmp");
        let entries = fs::read_dir(&tmp).map_err(|e| OciError::io("reading", &tmp, e))?;
        let mut n = 0;
        for entry in entries.flatten() {
            if fs::remove_file(entry.path()).is_ok() {
                n += 1;
            }
        }
        Ok(n)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the blob named `digest` lives (whether or not it is there).
    pub fn path(&self, digest: &Digest) -> Result<PathBuf, OciError> {
        Ok(self.root.join("sha256").join(sha256_hex(digest)?))
    }

    /// The blob is stored: a regular file under its name. Its content was
    /// verified before it got the name, and nothing else writes there.
    pub fn contains(&self, digest: &Digest) -> bool {
        self.path(digest)
            .ok()
            .and_then(|p| fs::symlink_metadata(p).ok())
            .is_some_and(|m| m.is_file())
    }

    /// A writer for the blob `digest` of `size` bytes. It refuses to take
    /// more than `size` bytes; [`BlobWriter::finish`] names it.
    pub fn writer(&self, digest: &Digest, size: u64) -> Result<BlobWriter, OciError> {
        let target = self.path(digest)?;
        let tmp = tempfile_in(&self.root.join("tmp"))?;
        Ok(BlobWriter {
            file: Some(tmp.1),
            tmp: tmp.0,
            target,
            hasher: Sha256::new(),
            written: 0,
            digest: digest.to_string(),
            size,
        })
    }

    /// Copies `from` into the store as blob `digest` of `size` bytes
    /// (nothing is copied when the blob is already stored). Returns the
    /// bytes copied.
    pub fn put(&self, digest: &Digest, size: u64, from: &mut impl Read) -> Result<u64, OciError> {
        if self.contains(digest) {
            return Ok(0);
        }
        let mut w = self.writer(digest, size)?;
        let n = copy(from, &mut w)?;
        w.finish()?;
        Ok(n)
    }

    /// Copies `from`, of a digest not known before (a layer of a Docker
    /// archive, named by its path), into the store under the digest its
    /// bytes hash to. At most `limit` bytes. Returns the digest and size.
    pub fn put_hashed(&self, from: &mut impl Read, limit: u64) -> Result<(Digest, u64), OciError> {
        let (tmp, mut file) = tempfile_in(&self.root.join("tmp"))?;
        let guard = Removes(tmp.clone());
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 256 << 10];
        let mut n = 0u64;
        loop {
            let got = match from.read(&mut buf) {
                Ok(0) => break,
                Ok(got) => got,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(OciError::io("reading a blob for", &tmp, e)),
            };
            n += got as u64;
            if n > limit {
                return Err(OciError::TooLarge {
                    what: "blob",
                    name: "(not yet hashed)".into(),
                    size: n,
                    limit,
                });
            }
            hasher.update(&buf[..got]);
            file.write_all(&buf[..got])
                .map_err(|e| OciError::io("writing", &tmp, e))?;
        }
        let digest: Digest = format!("sha256:{:x}", hasher.finalize())
            .parse()
            .expect("a sha256 digest");
        if !self.contains(&digest) {
            file.sync_all()
                .map_err(|e| OciError::io("flushing", &tmp, e))?;
            let target = self.path(&digest)?;
            fs::rename(&tmp, &target).map_err(|e| OciError::io("naming the blob", &target, e))?;
            File::open(self.root.join("sha256"))
                .and_then(|d| d.sync_all())
                .map_err(|e| OciError::io("flushing", self.root.join("sha256"), e))?;
        }
        drop(guard);
        Ok((digest, n))
    }

    /// Opens a stored blob for reading.
    pub fn open_blob(&self, digest: &Digest) -> Result<File, OciError> {
        let path = self.path(digest)?;
        File::open(&path).map_err(|e| OciError::io("opening the blob", &path, e))
    }

    /// Reads a stored blob of at most `limit` bytes whole.
    pub fn read_small(
        &self,
        what: &'static str,
        digest: &Digest,
        limit: u64,
    ) -> Result<Vec<u8>, OciError> {
        let file = self.open_blob(digest)?;
        read_bounded(what, digest.as_ref(), file, limit)
    }
}

/// How often a [`Counting`] reader reports: often enough for a progress
/// line, rarely enough to cost nothing.
pub(crate) const PROGRESS_STEP: u64 = 4 << 20;

/// A reader that tells `progress` how many bytes were read through it so
/// far: every [`PROGRESS_STEP`] bytes and when it reads the end.
pub(crate) struct Counting<R, F: FnMut(u64)> {
    inner: R,
    read: u64,
    told: u64,
    progress: F,
}

impl<R, F: FnMut(u64)> Counting<R, F> {
    pub(crate) fn new(inner: R, progress: F) -> Self {
        Counting {
            inner,
            read: 0,
            told: 0,
            progress,
        }
    }
}

impl<R: Read, F: FnMut(u64)> Read for Counting<R, F> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        if (n == 0 && self.read > self.told) || self.read - self.told >= PROGRESS_STEP {
            (self.progress)(self.read);
            self.told = self.read;
        }
        Ok(n)
    }
}

/// Reads `from` whole, refusing more than `limit` bytes.
/// `name` says which (a digest, or where in an archive) in errors.
pub(crate) fn read_bounded(
    what: &'static str,
    name: &str,
    from: impl Read,
    limit: u64,
) -> Result<Vec<u8>, OciError> {
    let mut buf = Vec::new();
    from.take(limit + 1)
        .read_to_end(&mut buf)
        .map_err(|e| OciError::Layer {
            digest: name.to_string(),
            message: format!("reading the {what}: {e}"),
        })?;
    if buf.len() as u64 > limit {
        return Err(OciError::TooLarge {
            what,
            name: name.to_string(),
            size: buf.len() as u64,
            limit,
        });
    }
    Ok(buf)
}

/// Copies until the end of `from`, keeping the writer's own error (a
/// blob too long) apart from a read error.
fn copy(from: &mut impl Read, to: &mut BlobWriter) -> Result<u64, OciError> {
    let mut buf = vec![0u8; 256 << 10];
    let mut n = 0u64;
    loop {
        let got = match from.read(&mut buf) {
            Ok(0) => return Ok(n),
            Ok(got) => got,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(OciError::Layer {
                    digest: to.digest.clone(),
                    message: format!("reading the blob: {e}"),
                });
            }
        };
        to.take(&buf[..got])?;
        n += got as u64;
    }
}

/// A blob being written: hashed as it streams, named only when whole.
pub struct BlobWriter {
    file: Option<File>,
    tmp: PathBuf,
    target: PathBuf,
    hasher: Sha256,
    written: u64,
    digest: String,
    size: u64,
}

impl BlobWriter {
    /// Takes the next bytes of the blob.
    pub fn take(&mut self, bytes: &[u8]) -> Result<(), OciError> {
        let after = self.written + bytes.len() as u64;
        if after > self.size {
            return Err(OciError::SizeMismatch {
                digest: self.digest.clone(),
                expected: self.size,
                actual: after,
            });
        }
        let file = self.file.as_mut().expect("taken before finish");
        file.write_all(bytes)
            .map_err(|e| OciError::io("writing", &self.tmp, e))?;
        self.hasher.update(bytes);
        self.written = after;
        Ok(())
    }

    pub fn written(&self) -> u64 {
        self.written
    }

    /// Checks the size and digest, flushes the file and gives it its name.
    pub fn finish(mut self) -> Result<PathBuf, OciError> {
        if self.written != self.size {
            return Err(OciError::SizeMismatch {
                digest: self.digest.clone(),
                expected: self.size,
                actual: self.written,
            });
        }
        let actual = format!("{:x}", std::mem::take(&mut self.hasher).finalize());
        if format!("sha256:{actual}") != self.digest {
            return Err(OciError::DigestMismatch {
                expected: self.digest.clone(),
                actual,
            });
        }
        let file = self.file.take().expect("finished once");
        file.sync_all()
            .map_err(|e| OciError::io("flushing", &self.tmp, e))?;
        drop(file);
        fs::rename(&self.tmp, &self.target)
            .map_err(|e| OciError::io("naming the blob", &self.target, e))?;
        if let Some(dir) = self.target.parent() {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| OciError::io("flushing", dir, e))?;
        }
        Ok(self.target.clone())
    }
}

impl Drop for BlobWriter {
    fn drop(&mut self) {
        // Not finished (refused, or abandoned): nothing stays behind.
        if self.file.is_some() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

/// Removes a temporary file when dropped (it is gone already once renamed).
struct Removes(PathBuf);

impl Drop for Removes {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// A new file in `dir` with a name no other writer uses.
fn tempfile_in(dir: &Path) -> Result<(PathBuf, File), OciError> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{}-{n}.part", std::process::id()));
        match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(f) => return Ok((path, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(OciError::io("making", &path, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest_of(bytes: &[u8]) -> Digest {
        format!("sha256:{:x}", Sha256::digest(bytes))
            .parse()
            .unwrap()
    }

    fn tmp_files(store: &BlobStore) -> usize {
        fs::read_dir(store.root().join("tmp")).unwrap().count()
    }

    #[test]
    fn a_blob_is_stored_once_under_its_digest() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let d = digest_of(b"hello");
        assert!(!store.contains(&d));
        assert_eq!(store.put(&d, 5, &mut &b"hello"[..]).unwrap(), 5);
        assert!(store.contains(&d));
        assert_eq!(fs::read(store.path(&d).unwrap()).unwrap(), b"hello");
        // Already there: nothing read, nothing written.
        assert_eq!(store.put(&d, 5, &mut &b"hello"[..]).unwrap(), 0);
        assert_eq!(tmp_files(&store), 0);
    }

    #[test]
    fn content_that_does_not_hash_to_its_name_is_refused_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let d = digest_of(b"hello");
        let e = store.put(&d, 5, &mut &b"jello"[..]).unwrap_err();
        assert!(matches!(e, OciError::DigestMismatch { .. }), "{e}");
        assert!(e.to_string().contains(&d.to_string()), "{e}");
        assert!(!store.contains(&d));
        assert_eq!(tmp_files(&store), 0);
    }

    #[test]
    fn a_blob_longer_or_shorter_than_its_descriptor_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let d = digest_of(b"hello");
        let long = store.put(&d, 4, &mut &b"hello"[..]).unwrap_err();
        assert!(
            matches!(
                long,
                OciError::SizeMismatch {
                    expected: 4,
                    actual: 5,
                    ..
                }
            ),
            "{long}"
        );
        let short = store.put(&d, 6, &mut &b"hello"[..]).unwrap_err();
        assert!(
            matches!(
                short,
                OciError::SizeMismatch {
                    expected: 6,
                    actual: 5,
                    ..
                }
            ),
            "{short}"
        );
        assert!(!store.contains(&d));
        assert_eq!(tmp_files(&store), 0);
    }

    #[test]
    fn only_sha256_digests_are_taken() {
        let d: Digest = format!("sha512:{}", "a".repeat(128)).parse().unwrap();
        assert!(matches!(
            sha256_hex(&d),
            Err(OciError::UnsupportedDigest { .. })
        ));
    }

    #[test]
    fn what_an_interrupted_write_left_is_removed_by_the_sweep_only() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let w = store.writer(&digest_of(b"x"), 1).unwrap();
        // A crash: the writer never runs its drop.
        std::mem::forget(w);
        assert_eq!(tmp_files(&store), 1);
        // Another writer opening the store leaves it be.
        BlobStore::open(dir.path()).unwrap();
        assert_eq!(tmp_files(&store), 1);
        assert_eq!(store.sweep().unwrap(), 1);
        assert_eq!(tmp_files(&store), 0);
    }
}
