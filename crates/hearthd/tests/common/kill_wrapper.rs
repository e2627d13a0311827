//! A program ahead in hearthd's PATH that runs the real one and then, once
//! the test has made the trigger file exist and the arguments match a shell
//! `case` pattern, SIGKILLs its parent (hearthd) right after the real
//! program returned: a crash at a chosen step, with that step's effect done.

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct KillWrapper {
    _dir: tempfile::TempDir,
    /// Made by the test to arm the wrapper; removed when it fires.
    pub trigger: PathBuf,
    /// The PATH to give hearthd.
    pub path: String,
}

impl KillWrapper {
    /// Wraps `tool`; fires when `" $* "` matches `pattern` (for example
    /// `*" -w "*`).
    pub fn new(tool: &str, pattern: &str) -> KillWrapper {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::Builder::new()
            .prefix("hearth-wrapper-")
            .tempdir()
            .unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let trigger = dir.path().join("armed");
        let real = real_path(tool);
        std::fs::write(
            bin.join(tool),
            format!(
                "#!/bin/sh\n{real} \"$@\"\nrc=$?\ncase \" $* \" in {pattern})\n  if [ -e {t} ]; then rm -f {t}; kill -9 $PPID; fi;;\nesac\nexit $rc\n",
                t = trigger.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(bin.join(tool), std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        KillWrapper {
            _dir: dir,
            trigger,
            path,
        }
    }

    /// The next matching run kills hearthd.
    pub fn arm(&self) {
        std::fs::write(&self.trigger, "").unwrap();
    }
}

fn real_path(tool: &str) -> String {
    let out = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .unwrap();
    let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        Path::new(&p).is_absolute(),
        "{tool} is not installed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    p
}
