//! A `qemu-img` first in hearthd's PATH: one that logs every run, for
//! tests and benchmarks that count what hearthd runs (ground truth: the log
//! is written by the processes themselves, not by hearthd), and one that
//! runs a test's script first (to hold a run still or kill it at a chosen
//! system call).

use std::path::{Path, PathBuf};
use std::process::Command;

/// Writes a `qemu-img` into `dir/bin` that runs the shell `script` and
/// then the real qemu-img with the same arguments (`$REAL` in the script
/// names it; the script may `exec` it another way itself, e.g. under
/// strace). Returns hearthd's PATH with it first.
pub fn wrapped_qemu_img(dir: &Path, script: &str) -> String {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).expect("bin dir");
    let text = format!(
        "#!/bin/sh
REAL={real}
{script}
exec \"$REAL\" \"$@\"\n",
        real = real_qemu_img().display(),
    );
    let path = bin.join("qemu-img");
    std::fs::write(&path, text).expect("write wrapper");
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod wrapper");
    format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

/// A `qemu-img` that appends `start PID ARGS` before running the real one
/// and `end PID` after it, so the test counts runs and sees how many ran at
/// once from the log alone.
pub struct QemuImgLog {
    dir: tempfile::TempDir,
}

impl QemuImgLog {
    /// `pause`: shell commands run before the real qemu-img (to widen the
    /// window in which runs overlap), or "".
    pub fn new(pause: &str) -> QemuImgLog {
        let real = real_qemu_img();
        let dir = tempfile::Builder::new()
            .prefix("hearth-qemu-img-")
            .tempdir()
            .expect("tempdir");
        let log = dir.path().join("runs.log");
        let script = format!(
            "#!/bin/sh\necho \"start $$ $*\" >> {log}\n{pause}\n{real} \"$@\"\nrc=$?\necho \"end $$\" >> {log}\nexit $rc\n",
            log = log.display(),
            real = real.display(),
        );
        let path = dir.path().join("qemu-img");
        std::fs::write(&path, script).expect("write wrapper");
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod wrapper");
        QemuImgLog { dir }
    }

    /// hearthd's PATH: the wrapper's directory first.
    pub fn path_var(&self) -> String {
        format!(
            "{}:{}",
            self.dir.path().display(),
            std::env::var("PATH").unwrap_or_default()
        )
    }

    pub fn lines(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("runs.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    pub fn starts(&self) -> Vec<String> {
        self.lines()
            .into_iter()
            .filter(|l| l.starts_with("start "))
            .collect()
    }

    pub fn ends(&self) -> usize {
        self.lines()
            .iter()
            .filter(|l| l.starts_with("end "))
            .count()
    }

    /// The most runs that had started and not ended at any one time.
    pub fn most_at_once(&self) -> usize {
        let (mut now, mut most) = (0usize, 0usize);
        for l in self.lines() {
            if l.starts_with("start ") {
                now += 1;
                most = most.max(now);
            } else if l.starts_with("end ") {
                now = now.saturating_sub(1);
            }
        }
        most
    }
}

pub fn real_qemu_img() -> PathBuf {
    let out = Command::new("sh")
        .args(["-c", "command -v qemu-img"])
        .output()
        .expect("sh");
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        !path.is_empty(),
        "qemu-img is not installed: apt-get install qemu-utils"
    );
    PathBuf::from(path)
}
