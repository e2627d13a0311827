//! The Debian 12 test image (guest/debian/): where it is, its default user,
//! disks made from it, and waiting on the guest.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{Daemon, repo_root, serial_log};

/// Firmware, GRUB, the kernel, systemd and cloud-init, all emulated.
pub const DEBIAN_BOOT_TIMEOUT: Duration = Duration::from_secs(600);

/// Where the image is: `HEARTH_GUEST_OUT` when set (a variant built with
/// `HEARTH_GUEST_OUT=DIR guest/debian/build.sh`), else guest/out.
pub fn debian_out_dir() -> PathBuf {
    std::env::var_os("HEARTH_GUEST_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("guest/out"))
}

/// The built image and its SHA-256; fails loudly when it is not built.
pub fn debian_image() -> (PathBuf, String) {
    let out = debian_out_dir();
    let image = out.join("debian-12.qcow2");
    let sha = out.join("debian-12.sha256");
    assert!(
        image.is_file() && sha.is_file(),
        "the Debian test image is not built ({} missing): run `.ci/install-deps.sh && guest/debian/build.sh`",
        image.display()
    );
    let hex = std::fs::read_to_string(&sha).expect("read sha256");
    let hex = hex
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    assert_eq!(hex.len(), 64, "{}: not a sha256: {hex:?}", sha.display());
    (image, hex)
}

/// The image's default user (cloud-init's `default_user`), as the build recorded it.
pub fn default_user() -> String {
    let path = debian_out_dir().join("debian-12.info");
    let info = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    info.lines()
        .find_map(|l| l.strip_prefix("user="))
        .map(|u| u.trim().to_string())
        .expect("debian-12.info names the default user (user=NAME)")
}

/// Polls the guest until `script` succeeds (cloud-init's final stage runs
/// after the agent is up).
pub fn wait_guest(d: &Daemon, vm: &str, what: &str, script: &str, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let (code, out) = d.agent_sh(vm, script);
        if code == 0 {
            return out;
        }
        assert!(
            Instant::now() < deadline,
            "{vm}: {what} not seen in {timeout:?} (last exit {code}: {out})\nconsole:\n{}",
            std::fs::read_to_string(serial_log(d, vm)).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// A VirtualDisk over the VirtualImage `image`, of `size` bytes if given.
pub fn image_disk(name: &str, image: &str, size: Option<u64>) -> Value {
    let mut spec = json!({"source": {"virtualImage": image}});
    if let Some(s) = size {
        spec["size"] = json!(s);
    }
    json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk",
           "metadata": {"name": name}, "spec": spec})
}
