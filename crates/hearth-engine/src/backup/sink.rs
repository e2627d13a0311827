//! The file a point hearth writes itself goes into, front to back: bytes
//! gathered into 1 MiB chunks, each written, then handed to a thread that
//! hashes it while the next is made, and the kernel's writeback of every
//! 8 MiB started as it is written, so the fsync at the end waits for the
//! tail alone. Hashing in the writing thread added the hash's time to
//! every copy (docs/benchmarks.md, run 9: 1, 16 and 64 MiB incrementals
//! took 14, 40 and 204 ms that way, 10, 31 and 180 ms this way).

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use super::{FileError, io};

const CHUNK: usize = 1 << 20;
const WRITEBACK: u64 = 8 << 20;

struct Hasher {
    chunks: mpsc::SyncSender<Vec<u8>>,
    /// Chunks hashed, to be filled again.
    spent: mpsc::Receiver<Vec<u8>>,
    thread: std::thread::JoinHandle<String>,
}

pub(super) struct Sink {
    file: File,
    path: PathBuf,
    buf: Vec<u8>,
    at: u64,
    /// Writeback started up to here.
    started: u64,
    hasher: Option<Hasher>,
}

impl Sink {
    /// A new file at `path` (it must not exist); hashed when `hash`.
    pub(super) fn create(path: &Path, hash: bool) -> Result<Self, FileError> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(io("creating", path))?;
        let hasher = hash.then(|| {
            let (chunks, todo) = mpsc::sync_channel::<Vec<u8>>(4);
            let (give_back, spent) = mpsc::channel();
            let thread = std::thread::spawn(move || {
                use sha2::Digest as _;
                let mut sha = sha2::Sha256::new();
                for chunk in todo {
                    sha.update(&chunk);
                    let _ = give_back.send(chunk);
                }
                format!("{:x}", sha.finalize())
            });
            Hasher {
                chunks,
                spent,
                thread,
            }
        });
        Ok(Self {
            file,
            path: path.to_path_buf(),
            buf: Vec::with_capacity(CHUNK),
            at: 0,
            started: 0,
            hasher,
        })
    }

    fn write_chunk(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        self.file.write_all(&self.buf)?;
        self.at += self.buf.len() as u64;
        if self.at - self.started >= WRITEBACK {
            // Only starts the writes, a hint: the fsync at the end is what
            // makes them durable, and reports what failed, so a filesystem
            // that refuses the hint changes nothing.
            // SAFETY: a plain syscall on a descriptor this struct owns.
            let _ = unsafe {
                libc::sync_file_range(
                    self.file.as_raw_fd(),
                    self.started as libc::off64_t,
                    (self.at - self.started) as libc::off64_t,
                    libc::SYNC_FILE_RANGE_WRITE,
                )
            };
            self.started = self.at;
        }
        match &self.hasher {
            Some(h) => {
                let next = h
                    .spent
                    .try_recv()
                    .unwrap_or_else(|_| Vec::with_capacity(CHUNK));
                let full = std::mem::replace(&mut self.buf, next);
                self.buf.clear();
                h.chunks
                    .send(full)
                    .map_err(|_| std::io::Error::other("the hashing thread ended"))?;
            }
            None => self.buf.clear(),
        }
        Ok(())
    }

    /// Everything written and fsynced: the file's length and its SHA-256.
    pub(super) fn finish(mut self) -> Result<(u64, Option<String>), FileError> {
        let path = self.path.clone();
        self.write_chunk().map_err(io("writing", &path))?;
        self.file.sync_all().map_err(io("syncing", &path))?;
        let sha = match self.hasher.take() {
            Some(Hasher { chunks, thread, .. }) => {
                drop(chunks);
                let sha = thread.join().map_err(|_| {
                    io("hashing", &path)(std::io::Error::other("the hashing thread panicked"))
                })?;
                Some(sha)
            }
            None => None,
        };
        Ok((self.at, sha))
    }
}

impl Write for Sink {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let n = data.len().min(CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == CHUNK {
            self.write_chunk()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lengths around the chunk and writeback sizes: the file holds the
    /// bytes written, and the hash is that of the file read back.
    #[test]
    fn the_file_and_its_hash_are_the_bytes_written() {
        let dir = tempfile::tempdir().unwrap();
        for (i, len) in [0usize, 1, CHUNK - 1, CHUNK, CHUNK + 7, 9 * CHUNK + 3]
            .into_iter()
            .enumerate()
        {
            let path = dir.path().join(format!("f{i}"));
            let data: Vec<u8> = (0..len).map(|k| (k * 31 % 251) as u8).collect();
            let mut sink = Sink::create(&path, true).unwrap();
            // Odd-sized writes, across chunk boundaries.
            for part in data.chunks(65_531) {
                sink.write_all(part).unwrap();
            }
            let (size, sha) = sink.finish().unwrap();
            assert_eq!(size, len as u64);
            assert_eq!(std::fs::read(&path).unwrap(), data, "{len}");
            let (want, _) = crate::backup::sha256_of(&path).unwrap();
            assert_eq!(sha.as_deref(), Some(want.as_str()), "{len}");
        }
        assert!(Sink::create(&dir.path().join("f0"), false).is_err());
    }
}
