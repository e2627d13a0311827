//! File names in the image store: `sha256-<hex>.<format>` for images, one
//! file per content, and `.import-<n>-<image>.tmp` for imports in progress.
//! Nothing else in the directory is ever touched (it is also the default
//! image root, where people keep files of their own).

use std::path::{Path, PathBuf};

/// The formats an image may be stored as.
pub const FORMATS: [&str; 2] = ["qcow2", "raw"];

/// `sha256:<hex>`, as `status.digest` shows it.
pub fn digest(hex: &str) -> String {
    format!("sha256:{hex}")
}

/// The hex digits of a `sha256:<hex>` digest.
pub fn hex_of(digest: &str) -> Option<&str> {
    digest.strip_prefix("sha256:").filter(|h| is_hex64(h))
}

fn is_hex64(h: &str) -> bool {
    h.len() == 64
        && h.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Where the image with this content and format lives.
pub fn stored_path(dir: &Path, hex: &str, format: &str) -> PathBuf {
    dir.join(format!("sha256-{hex}.{format}"))
}

/// The digest and format of a store file name; `None` for any other file.
pub fn parse_stored(name: &str) -> Option<(&str, &str)> {
    let rest = name.strip_prefix("sha256-")?;
    let (hex, format) = rest.split_once('.')?;
    (is_hex64(hex) && FORMATS.contains(&format)).then_some((hex, format))
}

/// The kinds of boot files a rootfs image's `/boot` gives the store.
pub const BOOT_FILES: [&str; 2] = ["kernel", "initrd"];

/// The digest and kind of a boot file's name (`sha256-<hex>.kernel`,
/// `.initrd`); `None` for any other file.
pub fn parse_boot_file(name: &str) -> Option<(&str, &str)> {
    let rest = name.strip_prefix("sha256-")?;
    let (hex, kind) = rest.split_once('.')?;
    (is_hex64(hex) && BOOT_FILES.contains(&kind)).then_some((hex, kind))
}

/// Whether `path` is an image-store file (by its name alone).
#[cfg(test)]
pub fn is_stored(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_stored)
        .is_some()
}

/// The image stored with this digest, in whichever format, if present.
pub fn find_stored(dir: &Path, hex: &str) -> Option<(PathBuf, &'static str)> {
    FORMATS
        .iter()
        .map(|f| (stored_path(dir, hex, f), *f))
        .find(|(p, _)| p.is_file())
}

/// A temporary file name that never repeats (`n` comes from a durable
/// counter) and says which image it was for.
pub fn temp_path(dir: &Path, n: u64, image: &str) -> PathBuf {
    dir.join(format!(".import-{n:08}-{image}.tmp"))
}

pub fn is_temp(name: &str) -> bool {
    name.starts_with(".import-") && name.ends_with(".tmp")
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    #[test]
    fn a_digest_names_one_file_per_format_and_reads_back() {
        let dir = Path::new("/var/lib/hearth/images");
        let p = stored_path(dir, HEX, "qcow2");
        assert_eq!(
            p,
            Path::new(&format!("/var/lib/hearth/images/sha256-{HEX}.qcow2"))
        );
        let name = p.file_name().and_then(|n| n.to_str()).expect("name");
        assert_eq!(parse_stored(name), Some((HEX, "qcow2")));
        assert!(is_stored(&p));
        assert_eq!(digest(HEX), format!("sha256:{HEX}"));
        assert_eq!(hex_of(&digest(HEX)), Some(HEX));
    }

    #[test]
    fn other_files_in_the_directory_are_not_store_files() {
        for name in [
            "debian.qcow2",
            "sha256-abc.qcow2",
            &format!("sha256-{HEX}.vmdk"),
            &format!("sha256-{}.qcow2", HEX.to_uppercase()),
            &format!("sha256-{HEX}"),
            ".import-1-x.tmp",
        ] {
            assert_eq!(parse_stored(name), None, "{name}");
        }
        // Boot files are store files of their own kind, never images.
        let kernel = format!("sha256-{HEX}.kernel");
        assert_eq!(parse_stored(&kernel), None);
        assert_eq!(parse_boot_file(&kernel), Some((HEX, "kernel")));
        assert_eq!(parse_boot_file(&format!("sha256-{HEX}.qcow2")), None);
        assert_eq!(parse_boot_file("sha256-abc.initrd"), None);
        assert_eq!(hex_of("sha256:xyz"), None);
        assert_eq!(hex_of(HEX), None);
    }

    #[test]
    fn temporaries_are_hidden_unique_and_recognised() {
        let dir = Path::new("/s/images");
        let a = temp_path(dir, 1, "debian");
        let b = temp_path(dir, 2, "debian");
        assert_ne!(a, b);
        let name = a.file_name().and_then(|n| n.to_str()).expect("name");
        assert!(name.starts_with('.'));
        assert!(is_temp(name));
        assert!(!is_temp("debian.tmp"));
        assert!(!is_stored(&a));
    }

    #[test]
    fn find_stored_finds_either_format() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(find_stored(dir.path(), HEX), None);
        std::fs::write(stored_path(dir.path(), HEX, "raw"), b"x").expect("write");
        assert_eq!(
            find_stored(dir.path(), HEX),
            Some((stored_path(dir.path(), HEX, "raw"), "raw"))
        );
    }
}
