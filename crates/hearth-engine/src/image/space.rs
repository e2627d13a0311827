//! The free space an import may use: an image is written into the state
//! directory's filesystem, which also holds the database and every disk's
//! layers, so a download (which may never end: the server decides) stops
//! before it leaves less than the reserve (`--image-free-space-reserve`)
//! free. The arithmetic is here, pure; the importer feeds it what
//! `statvfs` says.

use std::path::{Path, PathBuf};

/// How many bytes may be written between two looks at the filesystem even
/// when the last look left plenty of room: other writers (guests filling
/// their disks) use the same space.
pub const LOOK_EVERY: u64 = 16 << 20;

/// What an import has seen of the filesystem and written since.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpaceGuard {
    reserve: u64,
    /// Bytes available at the last look.
    free: u64,
    /// Bytes written since the last look.
    since: u64,
}

/// What to do before writing the next piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Space {
    /// It fits, by the last look.
    Write,
    /// Look at the filesystem again ([`SpaceGuard::looked`]), then ask again.
    Look,
    /// It does not fit even by a fresh look: the import must stop.
    Full,
}

impl SpaceGuard {
    /// After a first look that found `free` bytes available.
    pub fn new(reserve: u64, free: u64) -> SpaceGuard {
        SpaceGuard {
            reserve,
            free,
            since: 0,
        }
    }

    /// Whether `n` more bytes may be written. `fresh`: the last look was
    /// made for this very piece (so `Look` is not asked twice).
    pub fn before(&self, n: u64, fresh: bool) -> Space {
        if self.room() >= n && (fresh || self.since < LOOK_EVERY) {
            Space::Write
        } else if !fresh {
            Space::Look
        } else {
            Space::Full
        }
    }

    /// A fresh look at the filesystem: `free` bytes available now (what was
    /// written so far is already counted in it).
    pub fn looked(&mut self, free: u64) {
        self.free = free;
        self.since = 0;
    }

    /// `n` bytes were written.
    pub fn wrote(&mut self, n: u64) {
        self.since = self.since.saturating_add(n);
    }

    /// Bytes that may still be written above the reserve, by the last look.
    pub fn room(&self) -> u64 {
        self.free
            .saturating_sub(self.since)
            .saturating_sub(self.reserve)
    }

    pub fn reserve(&self) -> u64 {
        self.reserve
    }

    /// Bytes available at the last look.
    pub fn free(&self) -> u64 {
        self.free.saturating_sub(self.since)
    }
}

/// Admits `n` more bytes if they fit above the reserve, looking at the
/// filesystem (`look`) when `guard` asks to; Ok(false) when a fresh look
/// shows they do not.
pub fn admit<E>(
    guard: &mut SpaceGuard,
    n: u64,
    mut look: impl FnMut() -> Result<u64, E>,
) -> Result<bool, E> {
    let mut fresh = false;
    loop {
        match guard.before(n, fresh) {
            Space::Write => {
                guard.wrote(n);
                return Ok(true);
            }
            Space::Look => {
                guard.looked(look()?);
                fresh = true;
            }
            Space::Full => return Ok(false),
        }
    }
}

/// The free-space reserve for writes that are not one file: an OCI
/// image's blobs, its unpacked tree, the kernel taken from it. Each write
/// is admitted first, by its length.
pub struct Room {
    dir: PathBuf,
    guard: SpaceGuard,
    /// Bytes admitted so far.
    taken: u64,
}

/// Why [`Room::take`] refused: the message, and the bytes admitted with
/// the refused ones.
#[derive(Debug)]
pub struct NoRoom {
    pub needs: u64,
    pub message: String,
}

impl Room {
    /// The filesystem holding `dir`, with `reserve` bytes kept free.
    pub fn new(dir: &Path, reserve: u64) -> std::io::Result<Room> {
        Ok(Room {
            dir: dir.to_path_buf(),
            guard: SpaceGuard::new(reserve, available(dir)?),
            taken: 0,
        })
    }

    /// Admits `n` bytes of `what`, or says why not.
    pub fn take(&mut self, n: u64, what: &str) -> Result<(), NoRoom> {
        let dir = self.dir.clone();
        let fits = admit(&mut self.guard, n, || available(&dir)).map_err(|e| NoRoom {
            needs: self.taken + n,
            message: format!("statvfs {}: {e}", dir.display()),
        })?;
        if !fits {
            return Err(NoRoom {
                needs: self.taken + n,
                message: format!(
                    "not enough free space for {what} ({n} bytes): the filesystem of {} has {} free and hearthd keeps {} ({} bytes) free for its store (hearthd --image-free-space-reserve)",
                    self.dir.display(),
                    super::progress::format_bytes(self.guard.free()),
                    super::progress::format_bytes(self.guard.reserve()),
                    self.guard.reserve(),
                ),
            });
        }
        self.taken += n;
        Ok(())
    }
}

/// Bytes available to an unprivileged writer on the filesystem holding
/// `dir` (`f_bavail`: hearthd, as root, could also eat the blocks ext4
/// keeps for root, but those are not counted as room).
pub fn available(dir: &Path) -> std::io::Result<u64> {
    let s = rustix::fs::statvfs(dir)?;
    Ok(s.f_bavail.saturating_mul(s.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_piece_that_fits_is_written_without_a_look_until_enough_was_written() {
        let mut g = SpaceGuard::new(100, 1_000_000_000);
        assert_eq!(g.before(4096, false), Space::Write);
        g.wrote(LOOK_EVERY);
        assert_eq!(g.before(1, false), Space::Look, "a look every LOOK_EVERY");
        g.looked(1_000_000_000 - LOOK_EVERY);
        assert_eq!(g.before(1, true), Space::Write);
    }

    #[test]
    fn a_piece_that_would_eat_into_the_reserve_is_refused_after_a_fresh_look() {
        let mut g = SpaceGuard::new(1000, 5000);
        assert_eq!(g.before(4000, false), Space::Write);
        g.wrote(4000);
        assert_eq!(g.room(), 0);
        assert_eq!(g.before(1, false), Space::Look);
        // Someone freed space meanwhile.
        g.looked(3000);
        assert_eq!(g.before(1500, true), Space::Write);
        g.wrote(1500);
        assert_eq!(g.before(1000, false), Space::Look);
        g.looked(1500);
        assert_eq!(g.before(1000, true), Space::Full);
        assert_eq!(g.room(), 500);
    }

    #[test]
    fn below_the_reserve_from_the_start_nothing_fits() {
        let g = SpaceGuard::new(1 << 30, 100 << 20);
        assert_eq!(g.room(), 0);
        assert_eq!(g.before(1, true), Space::Full);
    }

    #[test]
    fn room_admits_what_fits_and_names_what_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let mut room = Room::new(dir.path(), 0).unwrap();
        room.take(1 << 20, "a small file").unwrap();
        room.take(1 << 20, "another").unwrap();
        // A reserve no filesystem here has: nothing fits.
        let mut none = Room::new(dir.path(), 1 << 62).unwrap();
        let e = none.take(4096, "the image's layers").unwrap_err();
        assert_eq!(e.needs, 4096);
        assert!(
            e.message.contains("the image's layers (4096 bytes)")
                && e.message.contains(&dir.path().display().to_string())
                && e.message.contains("--image-free-space-reserve"),
            "{}",
            e.message
        );
    }

    /// One look at the filesystem during a modelled import: the free space
    /// it saw, and what the import wrote until the next look.
    struct Look {
        free: u64,
        written: u64,
    }

    /// A modelled import: its looks, and (piece, free space) if it stopped.
    struct Run {
        looks: Vec<Look>,
        stopped: Option<(u64, u64)>,
    }

    /// Runs an import of `pieces` against a filesystem that other writers
    /// change by `pieces[i].1` before piece i.
    fn import(reserve: u64, start: u64, pieces: &[(u64, i64)]) -> Result<Run, TestCaseError> {
        let mut fs_free = start;
        let mut g = SpaceGuard::new(reserve, fs_free);
        let mut looks = vec![Look {
            free: fs_free,
            written: 0,
        }];
        for &(piece, other) in pieces {
            fs_free = fs_free.saturating_add_signed(other);
            let mut fresh = false;
            loop {
                match g.before(piece, fresh) {
                    Space::Write => break,
                    Space::Look => {
                        prop_assert!(!fresh, "asked to look twice for one piece");
                        g.looked(fs_free);
                        looks.push(Look {
                            free: fs_free,
                            written: 0,
                        });
                        fresh = true;
                    }
                    Space::Full => {
                        return Ok(Run {
                            looks,
                            stopped: Some((piece, fs_free)),
                        });
                    }
                }
            }
            fs_free -= piece.min(fs_free);
            g.wrote(piece);
            if let Some(l) = looks.last_mut() {
                l.written += piece;
            }
        }
        Ok(Run {
            looks,
            stopped: None,
        })
    }

    proptest! {
        /// What an import writes after a look never takes more than that
        /// look left above the reserve, and it looks again at least every
        /// LOOK_EVERY bytes (so other writers' use is seen); it stops only
        /// when a fresh look shows the piece does not fit.
        #[test]
        fn writes_after_a_look_stay_within_what_it_left_above_the_reserve(
            reserve in 0u64..(64 << 20),
            start in 0u64..(256 << 20),
            pieces in proptest::collection::vec(
                (1u64..(4 << 20), -(8i64 << 20)..(8i64 << 20)),
                1..200,
            ),
        ) {
            let run = import(reserve, start, &pieces)?;
            for l in &run.looks {
                prop_assert!(l.written <= l.free.saturating_sub(reserve));
                prop_assert!(l.written < LOOK_EVERY + (4 << 20));
            }
            if let Some((piece, fs_free)) = run.stopped {
                prop_assert!(fs_free < piece.saturating_add(reserve));
            }
        }

        /// Alone on the filesystem, an import never takes it below the
        /// reserve.
        #[test]
        fn alone_it_never_crosses_the_reserve(
            reserve in 0u64..(64 << 20),
            start in 0u64..(256 << 20),
            pieces in proptest::collection::vec(1u64..(4 << 20), 1..200),
        ) {
            let pieces: Vec<(u64, i64)> = pieces.into_iter().map(|p| (p, 0)).collect();
            let run = import(reserve, start, &pieces)?;
            let written: u64 = run.looks.iter().map(|l| l.written).sum();
            prop_assert!(start.saturating_sub(written) >= reserve.min(start));
            prop_assert!(written <= start.saturating_sub(reserve));
        }
    }
}
