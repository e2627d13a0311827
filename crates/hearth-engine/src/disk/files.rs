//! A head's file as hearthd reads it (capacity and allocated bytes, with
//! no program), and blank images written as sparse copies.

use std::path::Path;

use hearth_qemu::img;

use super::error::{DiskError, HeaderError};

/// What is read of a head for its qcow2 header (its extensions end within
/// the first cluster; 64 KiB is qemu-img's default cluster).
const HEADER_BYTES: u64 = 64 << 10;

/// What a head's file says: its virtual size and the bytes it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Files {
    pub(super) capacity: u64,
    pub(super) allocated: u64,
}

/// A head's capacity and allocated bytes, read by hearthd itself: the qcow2
/// header's size field (what `qemu-img info` reports as its virtual size)
/// and the blocks the file holds (its actual size). `qemu-img info` only
/// when the header is not one hearthd reads.
pub(super) async fn file_status(path: &Path) -> Result<Files, DiskError> {
    let owned = path.to_path_buf();
    let read = tokio::task::spawn_blocking(move || read_files(&owned))
        .await
        .map_err(|source| DiskError::Reader {
            path: path.to_path_buf(),
            source,
        })?;
    match read {
        Ok(files) => Ok(files),
        Err(why) => {
            tracing::debug!(path = %path.display(), why = %why, "reading the qcow2 header failed; asking qemu-img");
            let info = img::info(path).await.map_err(|source| DiskError::Info {
                path: path.to_path_buf(),
                source,
            })?;
            Ok(Files {
                capacity: info.virtual_size,
                allocated: info.actual_size,
            })
        }
    }
}

fn read_files(path: &Path) -> Result<Files, HeaderError> {
    use std::io::Read;
    let file = std::fs::File::open(path)?;
    let meta = file.metadata()?;
    let mut head = Vec::new();
    file.take(HEADER_BYTES).read_to_end(&mut head)?;
    let header = hearth_qemu::probe::Qcow2Header::parse(&head)?;
    Ok(Files {
        capacity: header.size,
        allocated: allocated_bytes(&meta),
    })
}

/// What `qemu-img info` calls a file's actual size: its blocks, in bytes.
pub(super) fn allocated_bytes(meta: &std::fs::Metadata) -> u64 {
    use std::os::unix::fs::MetadataExt;
    meta.blocks().saturating_mul(512)
}

/// Writes `bytes` to the new file `path`, leaving holes where a 4 KiB block
/// is all zeros (qcow2 reads a hole as zeros, like the zeros qemu-img
/// wrote), then syncs it.
pub(super) fn write_sparse(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    const BLOCK: usize = 4096;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    for (i, block) in bytes.chunks(BLOCK).enumerate() {
        if block.iter().any(|&b| b != 0) {
            file.write_all_at(block, (i * BLOCK) as u64)?;
        }
    }
    file.set_len(bytes.len() as u64)?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qemu_img(args: &[&str]) -> std::process::Output {
        let out = std::process::Command::new("qemu-img")
            .args(args)
            .output()
            .expect("qemu-img (apt-get install qemu-utils)");
        assert!(out.status.success(), "qemu-img {args:?}: {out:?}");
        out
    }

    fn info(path: &Path) -> serde_json::Value {
        let out = qemu_img(&["info", "--output=json", "-U", path.to_str().unwrap()]);
        serde_json::from_slice(&out.stdout).unwrap()
    }

    #[test]
    fn a_blank_copy_is_what_qemu_img_makes_and_reads_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let (made, copy) = (dir.path().join("made.qcow2"), dir.path().join("copy.qcow2"));
        for size in ["64M", "3G", "1T"] {
            let _ = std::fs::remove_file(&made);
            let _ = std::fs::remove_file(&copy);
            qemu_img(&["create", "-q", "-f", "qcow2", made.to_str().unwrap(), size]);
            let bytes = std::fs::read(&made).unwrap();
            write_sparse(&copy, &bytes).unwrap();
            assert_eq!(std::fs::read(&copy).unwrap(), bytes, "{size}");
            // qemu-img finds nothing wrong with it and reads it as the same disk.
            qemu_img(&["check", "-f", "qcow2", copy.to_str().unwrap()]);
            assert_eq!(info(&copy)["virtual-size"], info(&made)["virtual-size"]);
            let holes = std::fs::metadata(&copy).unwrap();
            assert!(
                allocated_bytes(&holes) <= allocated_bytes(&std::fs::metadata(&made).unwrap()),
                "the copy is sparse"
            );
            assert!(
                write_sparse(&copy, &bytes).is_err(),
                "an existing file is never overwritten"
            );
        }
    }

    #[test]
    fn the_files_status_is_what_qemu_img_info_reports() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.qcow2");
        let top = dir.path().join("top.qcow2");
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            base.to_str().unwrap(),
            "100M",
        ]);
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            base.to_str().unwrap(),
            "-F",
            "qcow2",
            top.to_str().unwrap(),
            "200M",
        ]);
        let written = std::process::Command::new("qemu-io")
            .args([
                "-f",
                "qcow2",
                "-c",
                "write -P 7 0 3M",
                top.to_str().unwrap(),
            ])
            .output()
            .expect("qemu-io (apt-get install qemu-utils)");
        assert!(written.status.success(), "{written:?}");
        for path in [&base, &top] {
            let files = read_files(path).unwrap();
            let i = info(path);
            assert_eq!(
                Some(files.capacity),
                i["virtual-size"].as_u64(),
                "{}",
                path.display()
            );
            assert_eq!(
                Some(files.allocated),
                i["actual-size"].as_u64(),
                "{}",
                path.display()
            );
        }
        assert!(read_files(&dir.path().join("missing.qcow2")).is_err());
        std::fs::write(dir.path().join("raw"), [0u8; 4096]).unwrap();
        assert!(
            read_files(&dir.path().join("raw")).is_err(),
            "not a qcow2: qemu-img is asked"
        );
    }
}
