//! Support for the manifest-directory end-to-end tests: a real hearthd
//! watching a real directory (outside /tmp, so vim's default `backupskip`
//! does not change how it saves), real editors driven through tmux, and
//! helpers to read what the daemon made of it.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::Value;

use crate::common::*;

/// A daemon and its manifest directory.
pub struct Env {
    pub d: Daemon,
    pub dir: PathBuf,
    /// Parent of `dir`, for files moved in and out.
    pub outside: PathBuf,
}

impl Env {
    pub fn start() -> Env {
        Env::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> Env {
        // vim's default 'backupskip' covers /tmp and $TMPDIR: a checkout under
        // /tmp (as CI's may be) must put the manifest directory elsewhere.
        let target_tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let under_skip = target_tmp.starts_with("/tmp")
            || std::env::var_os("TMPDIR").is_some_and(|t| target_tmp.starts_with(t));
        let base = if under_skip {
            PathBuf::from("/var/tmp/hearth-manifest-e2e")
        } else {
            target_tmp.join("manifest-e2e")
        };
        std::fs::create_dir_all(&base).expect("mkdir");
        let outside = tempfile::Builder::new()
            .prefix("m-")
            .tempdir_in(&base)
            .expect("tempdir")
            .keep();
        assert!(
            !outside.starts_with("/tmp")
                && !std::env::var_os("TMPDIR").is_some_and(|t| outside.starts_with(t)),
            "vim skips backups under /tmp and $TMPDIR: the directory must be elsewhere"
        );
        let dir = outside.join("manifests");
        std::fs::create_dir(&dir).expect("mkdir");
        let dir_arg = dir.to_str().expect("utf8").to_string();
        let mut args = vec!["--manifests", dir_arg.as_str()];
        args.extend_from_slice(extra);
        let d = Daemon::start_with(&args);
        Env { d, dir, outside }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, text).expect("write");
        p
    }

    /// Writes a file elsewhere and renames it in: how a careful tool writes.
    pub fn write_atomic(&self, name: &str, text: &str) {
        let tmp = self.outside.join(format!(".{name}.new"));
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, self.path(name)).expect("rename");
    }

    pub fn sources(&self) -> Value {
        let (status, v) = self.d.request("GET", "/v1/sources", None);
        assert_eq!(status, 200, "{v}");
        v
    }

    /// The entry of one file in `GET /v1/sources`.
    pub fn source_file(&self, name: &str) -> Option<Value> {
        let path = self.path(name);
        self.sources()["files"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|f| f["path"].as_str() == path.to_str())
            .cloned()
    }

    pub fn vm(&self, name: &str) -> Option<Value> {
        self.d.get_vm(name)
    }

    pub fn generation(&self, name: &str) -> u64 {
        self.vm(name)
            .and_then(|v| v["metadata"]["generation"].as_u64())
            .unwrap_or(0)
    }

    pub fn memory(&self, name: &str) -> Option<String> {
        self.vm(name)
            .and_then(|v| v["spec"]["memory"].as_str().map(str::to_string))
    }

    pub fn owner(&self, name: &str) -> Option<String> {
        self.vm(name)
            .and_then(|v| v["metadata"]["managedBy"].as_str().map(str::to_string))
    }

    pub fn count(&self, vm: &str, reason: &str) -> usize {
        self.d
            .event_reasons("VirtualMachine", vm)
            .iter()
            .filter(|r| *r == reason)
            .count()
    }

    pub fn condition(&self, vm: &str) -> Option<Value> {
        self.vm(vm)?["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "ManifestValid")
            .cloned()
    }

    /// Polls `f` until true; on timeout shows the sources view and the log.
    pub fn until(&self, what: &str, timeout: Duration, f: impl Fn() -> bool) {
        if eventually(timeout, f) {
            return;
        }
        panic!(
            "{what}: not true after {timeout:?}\nsources: {:#}\nlog (tail):\n{}",
            self.sources(),
            tail(&self.d.log(), 60)
        );
    }

    pub fn wait_generation(&self, vm: &str, generation: u64) {
        self.until(
            &format!("vm {vm} at generation {generation}"),
            Duration::from_secs(20),
            || self.generation(vm) == generation,
        );
    }

    pub fn wait_gone(&self, vm: &str, timeout: Duration) {
        self.until(&format!("vm {vm} deleted"), timeout, || {
            self.vm(vm).is_none()
        });
    }

    /// What the directory holds, to show hearthd changed nothing in it.
    pub fn snapshot(&self) -> BTreeMap<String, (u64, i64, i64, Vec<u8>)> {
        let mut out = BTreeMap::new();
        for e in std::fs::read_dir(&self.dir).expect("read_dir").flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Ok(meta) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            let bytes = if meta.is_file() {
                std::fs::read(e.path()).unwrap_or_default()
            } else {
                Vec::new()
            };
            out.insert(name, (meta.ino(), meta.mtime(), meta.mtime_nsec(), bytes));
        }
        out
    }

    /// Re-lists of the directory finished so far, whatever started them.
    pub fn relists(&self) -> u64 {
        self.sources()["relists"]
            .as_object()
            .map(|m| m.values().filter_map(Value::as_u64).sum())
            .unwrap_or(0)
    }

    /// Re-lists begun so far. They run one at a time and are counted before
    /// the directory is listed, so once [`Env::relists`] exceeds this read,
    /// a re-list that began after this read has finished.
    pub fn relists_started(&self) -> u64 {
        self.sources()["relistsStarted"].as_u64().unwrap_or(0)
    }

    /// Makes `change` to the directory and returns once hearthd has
    /// re-listed the directory as `change` left it: what a "nothing changed"
    /// assertion waits for, instead of a sleep. `change` must touch a
    /// manifest name (an ignored name wakes no re-list).
    ///
    /// Waits for a re-list begun after `change` to finish. If none began
    /// while `change` was made, the next one is the change's event, one
    /// quiet period later. If one began meanwhile, it may have listed the
    /// directory before `change`, so the wait is for the one after it: the
    /// change's event if that re-list did not take it, else the periodic one.
    pub fn relisted_after<R>(&self, what: &str, change: impl FnOnce() -> R) -> R {
        let out = change();
        let begun = self.relists_started();
        let resync = self.sources()["settings"]["resyncSeconds"]
            .as_u64()
            .unwrap_or(30);
        self.until(
            &format!("a re-list after {what}"),
            Duration::from_secs(resync + 15),
            || self.relists() > begun,
        );
        out
    }

    /// For the negative assertions at the end of a scenario, once a positive
    /// wait or [`Env::relisted_after`] has shown that hearthd re-listed the
    /// directory as the test left it: asserts that no delete is pending. A
    /// delete needs an object absent from every re-list for the grace
    /// period, and a re-list that finds it again cancels it; with none
    /// pending and the directory left alone, nothing is deleted later, so no
    /// sleep is needed to let a wrong delete show.
    #[track_caller]
    pub fn assert_settled(&self) {
        let v = self.sources();
        assert_eq!(
            v["pendingDeletes"].as_array().map(Vec::len).unwrap_or(0),
            0,
            "a delete is pending: {v:#}"
        );
    }

    /// Waits until the reconciler has acted on `generation` of a VM: it
    /// records the generation it observed only once it keeps the VM as it
    /// is (running or stopped) or has (re)started it, so a restart that a
    /// change caused, or wrongly did not cause, has shown by then.
    pub fn wait_observed(&self, vm: &str, generation: u64) {
        self.until(
            &format!("vm {vm}: generation {generation} observed"),
            Duration::from_secs(60),
            || {
                self.vm(vm)
                    .is_some_and(|v| v["status"]["observedGeneration"].as_u64() == Some(generation))
            },
        );
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        self.d.kill();
        let _ = std::fs::remove_dir_all(&self.outside);
    }
}

pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A VM of the test guest; `AlwaysOff` VMs never boot, so most scenarios
/// cost no guest at all.
pub fn vm_text(name: &str, policy: &str, memory: &str) -> String {
    vm_yaml(name, policy, &[], "").replace("memory: 256Mi", &format!("memory: {memory}"))
}

/// A blank 64 MiB disk, as a manifest file would hold it.
pub fn disk_text(name: &str) -> String {
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata:\n  name: {name}\nspec:\n  size: 64Mi\n  source:\n    blank: {{}}\n"
    )
}

/// Sessions started by this test process: each gets its own name.
static SESSIONS: AtomicU64 = AtomicU64::new(0);

/// vim (or another terminal program) in a tmux session, typed at like a
/// person would.
pub struct Tmux {
    socket: String,
    session: String,
}

impl Tmux {
    /// Starts `program` in `dir` in a detached 160x40 terminal.
    pub fn start(dir: &Path, program: &str) -> Tmux {
        let t = Tmux {
            socket: format!("hearth-manifest-{}", std::process::id()),
            session: format!(
                "s{}-{}",
                std::process::id(),
                SESSIONS.fetch_add(1, Ordering::Relaxed)
            ),
        };
        let status = Command::new("tmux")
            .args([
                "-L",
                &t.socket,
                "new-session",
                "-d",
                "-x",
                "160",
                "-y",
                "40",
            ])
            .args(["-s", &t.session, "-c"])
            .arg(dir)
            .arg(program)
            .status()
            .expect("run tmux (installed by .ci/install-deps.sh)");
        assert!(status.success(), "tmux new-session failed");
        t
    }

    /// The session's name, unique in this test process (pid and a counter).
    pub fn session(&self) -> &str {
        &self.session
    }

    /// Types keys (tmux key names such as `Enter` and `Escape` allowed).
    pub fn keys(&self, keys: &[&str]) {
        let status = Command::new("tmux")
            .args(["-L", &self.socket, "send-keys", "-t", &self.session])
            .args(keys)
            .status()
            .expect("tmux send-keys");
        assert!(status.success());
    }

    /// Types an ex command and Enter: `ex(":w")`.
    pub fn ex(&self, command: &str) {
        self.keys(&[command, "Enter"]);
    }

    pub fn screen(&self) -> String {
        let out = Command::new("tmux")
            .args([
                "-L",
                &self.socket,
                "capture-pane",
                "-p",
                "-t",
                &self.session,
            ])
            .output()
            .expect("tmux capture-pane");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn wait_screen(&self, what: &str, timeout: Duration, f: impl Fn(&str) -> bool) -> String {
        let mut s = String::new();
        let shown = eventually_every(Duration::from_millis(50), timeout, || {
            s = self.screen();
            f(&s)
        });
        assert!(shown, "{what}: screen is:\n{s}");
        s
    }

    /// The pid of the program in the pane.
    pub fn pid(&self) -> u32 {
        let out = Command::new("tmux")
            .args([
                "-L",
                &self.socket,
                "display-message",
                "-p",
                "-t",
                &self.session,
            ])
            .arg("#{pane_pid}")
            .output()
            .expect("tmux display-message");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("pane pid")
    }

    pub fn alive(&self) -> bool {
        Command::new("tmux")
            .args(["-L", &self.socket, "has-session", "-t", &self.session])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["-L", &self.socket, "kill-session", "-t", &self.session])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// vim with its default settings (`-u DEFAULTS`: defaults.vim, no user or
/// system vimrc; `-i NONE`: no viminfo), editing `file` in `dir`.
pub struct Vim {
    pub tmux: Tmux,
    file: PathBuf,
}

impl Vim {
    pub fn open(dir: &Path, file: &str) -> Vim {
        let tmux = Tmux::start(dir, &format!("vim -u DEFAULTS -i NONE {file}"));
        let vim = Vim {
            tmux,
            file: dir.join(file),
        };
        vim.tmux
            .wait_screen("vim is up", Duration::from_secs(10), |s| {
                s.contains(file) || s.contains("ATTENTION")
            });
        vim
    }

    /// Asserts the options that decide how vim writes a file are vim's
    /// defaults: write a backup while saving (rename the original away),
    /// keep no backup afterwards, let vim choose rename or copy.
    pub fn assert_default_write_options(&self) {
        self.tmux.ex(":set wb? bk? bkc?");
        self.tmux
            .wait_screen("vim's write options", Duration::from_secs(5), |s| {
                s.contains("writebackup") && s.contains("nobackup") && s.contains("backupcopy=auto")
            });
    }

    /// `:w`, then waits until vim says it wrote the file.
    pub fn save(&self) {
        let before = std::fs::metadata(&self.file)
            .ok()
            .map(|m| (m.ino(), m.mtime_nsec(), m.mtime()));
        self.tmux.ex(":w");
        let written = eventually_every(Duration::from_millis(20), Duration::from_secs(10), || {
            let now = std::fs::metadata(&self.file)
                .ok()
                .map(|m| (m.ino(), m.mtime_nsec(), m.mtime()));
            now.is_some() && now != before && self.tmux.screen().contains("written")
        });
        assert!(written, "vim did not write:\n{}", self.tmux.screen());
    }

    pub fn quit(&self) {
        self.tmux.ex(":q!");
        assert!(
            eventually_every(Duration::from_millis(50), Duration::from_secs(10), || {
                !self.tmux.alive()
            }),
            "vim did not quit"
        );
    }
}

pub fn inode(p: &Path) -> u64 {
    std::fs::metadata(p).expect("stat").ino()
}

/// Sends a signal to one process (ours: a daemon or an editor we started).
pub fn signal(pid: u32, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("pid > 0");
    rustix::process::kill_process(pid, sig).expect("kill");
}
