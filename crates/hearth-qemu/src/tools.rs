//! Locating the external binaries the driver runs.

use std::ffi::{OsStr, OsString};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Used when the daemon runs with no `PATH` at all (e.g. a bare `env -i`).
const FALLBACK_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A binary the driver needs is not installed; the message says how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name} not found in PATH: install it with `apt-get install {package}`")]
pub struct MissingTool {
    pub name: String,
    /// The Debian package that ships `name`.
    pub package: String,
}

/// The Debian package that provides `name`, so error messages can say what to install.
pub fn debian_package_for(name: &str) -> &str {
    match name {
        "qemu-system-x86_64" => "qemu-system-x86",
        "qemu-img" | "qemu-nbd" | "qemu-io" | "qemu-storage-daemon" => "qemu-utils",
        "e2fsck" | "resize2fs" | "debugfs" | "mkfs.ext4" => "e2fsprogs",
        "qemu-ga" => "qemu-guest-agent",
        "gpg" => "gnupg",
        other => other,
    }
}

/// Finds `name` in `PATH` (or checks it directly if it contains a `/`).
pub fn find_binary(name: &str) -> Result<PathBuf, MissingTool> {
    let path_var = std::env::var_os("PATH").unwrap_or_else(|| OsString::from(FALLBACK_PATH));
    find_binary_in(name, &path_var)
}

/// [`find_binary`] with an explicit search path, so it can be tested without touching
/// the process environment.
pub fn find_binary_in(name: &str, path_var: &OsStr) -> Result<PathBuf, MissingTool> {
    let missing = || MissingTool {
        name: name.to_owned(),
        package: debian_package_for(name).to_owned(),
    };
    if name.is_empty() {
        return Err(missing());
    }
    if name.contains('/') {
        let candidate = PathBuf::from(name);
        return if is_executable_file(&candidate) {
            Ok(candidate)
        } else {
            Err(missing())
        };
    }
    std::env::split_paths(path_var)
        // An empty PATH entry means the current directory; a daemon must not pick up
        // binaries from wherever it happens to run.
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable_file(candidate))
        .ok_or_else(missing)
}

fn is_executable_file(path: &Path) -> bool {
    std::fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn missing_qemu_img_names_the_debian_package_and_the_command() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = find_binary_in("qemu-img", dir.path().as_os_str()).expect_err("not there");
        assert_eq!(
            err.to_string(),
            "qemu-img not found in PATH: install it with `apt-get install qemu-utils`"
        );
        let err = find_binary_in("qemu-system-x86_64", dir.path().as_os_str()).expect_err("x");
        assert_eq!(err.package, "qemu-system-x86");
    }

    #[test]
    fn finds_an_executable_and_skips_a_non_executable_of_the_same_name() {
        let first = tempfile::tempdir().expect("tempdir");
        let second = tempfile::tempdir().expect("tempdir");
        let not_exec = first.path().join("qemu-img");
        fs::write(&not_exec, b"#!/bin/sh\n").expect("write");
        fs::set_permissions(&not_exec, fs::Permissions::from_mode(0o644)).expect("chmod");
        let exec = second.path().join("qemu-img");
        fs::write(&exec, b"#!/bin/sh\n").expect("write");
        fs::set_permissions(&exec, fs::Permissions::from_mode(0o755)).expect("chmod");

        let path_var = std::env::join_paths([first.path(), second.path()]).expect("join");
        assert_eq!(find_binary_in("qemu-img", &path_var), Ok(exec));
    }

    #[test]
    fn relative_path_entries_are_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let exec = dir.path().join("tool");
        fs::write(&exec, b"").expect("write");
        fs::set_permissions(&exec, fs::Permissions::from_mode(0o755)).expect("chmod");
        // "." would resolve against the cwd; it must never be searched.
        assert!(find_binary_in("tool", OsStr::new(".:relative/dir")).is_err());
    }
}
