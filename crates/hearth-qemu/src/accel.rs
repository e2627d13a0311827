//! Choosing KVM or TCG.
//!
//! "/dev/kvm opens" is not enough: some hosts expose a paravirtual KVM device (e.g.
//! nested "PVM") on which ordinary guests crawl or hang. KVM is chosen only when all
//! three hold: the device opens read-write, the CPU advertises hardware
//! virtualisation (vmx/svm), and a tiny probe VM really runs under `-accel kvm`
//! within a deadline. Anything else falls back to TCG with a reason a person can
//! read. Environment overrides are the caller's business.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::AsyncReadExt;

pub use crate::cmdline::Accel;

/// How long the probe VM may take under KVM; it needs milliseconds on real hardware.
pub const PROBE_DEADLINE: Duration = Duration::from_secs(5);
/// `isa-debug-exit` turns a written value v into exit status `(v << 1) | 1`.
pub const PROBE_EXIT_VALUE: u8 = 0x21;
pub const PROBE_EXIT_STATUS: i32 = ((PROBE_EXIT_VALUE as i32) << 1) | 1;
const PROBE_PORT: u8 = 0xf4;
const PROBE_DISK_BYTES: u64 = 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccelDecision {
    pub accel: Accel,
    pub reason: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("cannot write the probe disk {path}")]
    Disk {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start {binary}")]
    Spawn {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("probe VM did not finish within {0:?}")]
    Deadline(Duration),
    #[error("probe VM exited with {status} instead of {PROBE_EXIT_STATUS}: {stderr}")]
    WrongExit { status: String, stderr: String },
}

/// A BIOS boot sector that writes 0x21 to the debug-exit port and halts.
pub fn boot_sector() -> [u8; 512] {
    let mut sector = [0u8; 512];
    let code = [
        0xB0,
        PROBE_EXIT_VALUE, // mov al, 0x21
        0xE6,
        PROBE_PORT, // out 0xf4, al
        0xF4,       // hlt
        0xEB,
        0xFD, // jmp back to hlt, in case an interrupt wakes us
    ];
    sector[..code.len()].copy_from_slice(&code);
    sector[510] = 0x55;
    sector[511] = 0xAA;
    sector
}

/// True if the `flags` lines of a `/proc/cpuinfo` text list vmx or svm.
pub fn cpuinfo_has_virt_flags(cpuinfo: &str) -> bool {
    cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .filter_map(|l| l.split_once(':'))
        .any(|(_, flags)| flags.split_whitespace().any(|f| f == "vmx" || f == "svm"))
}

/// Decides which accelerator `qemu_binary` should use on this host.
pub async fn detect(qemu_binary: &Path) -> AccelDecision {
    let tcg = |reason: String| AccelDecision {
        accel: Accel::Tcg,
        reason,
    };
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        return tcg(format!("tcg: cannot open /dev/kvm read-write ({e})"));
    }
    match std::fs::read_to_string("/proc/cpuinfo") {
        Ok(text) if cpuinfo_has_virt_flags(&text) => {}
        Ok(_) => {
            return tcg("tcg: /proc/cpuinfo has no vmx/svm flag \
                 (KVM device is present but not hardware-backed)"
                .to_owned());
        }
        Err(e) => return tcg(format!("tcg: cannot read /proc/cpuinfo ({e})")),
    }
    match probe_boot(qemu_binary, Accel::Kvm, PROBE_DEADLINE).await {
        Ok(()) => AccelDecision {
            accel: Accel::Kvm,
            reason: "kvm: /dev/kvm is usable and a probe VM ran under it".to_owned(),
        },
        Err(e) => tcg(format!("tcg: KVM probe VM failed: {e}")),
    }
}

/// Boots the probe sector under `accel` and checks it reached the debug-exit port
/// within `deadline`.
pub async fn probe_boot(
    qemu_binary: &Path,
    accel: Accel,
    deadline: Duration,
) -> Result<(), ProbeError> {
    let disk = ProbeDisk::create()?;
    let mut child = tokio::process::Command::new(qemu_binary)
        .args(["-accel", accel.as_str()])
        .args(["-machine", "q35", "-m", "16"])
        .args(["-no-user-config", "-nodefaults", "-display", "none"])
        .args([
            "-device",
            &format!("isa-debug-exit,iobase={PROBE_PORT:#x},iosize=0x04"),
        ])
        .arg("-drive")
        .arg(disk.drive_arg())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| ProbeError::Spawn {
            binary: qemu_binary.to_owned(),
            source,
        })?;

    let stderr = child.stderr.take();
    let collect = async move {
        let mut out = Vec::new();
        if let Some(stderr) = stderr {
            // Bounded: a chatty QEMU cannot make us buffer much.
            let _ = stderr.take(4096).read_to_end(&mut out).await;
        }
        out
    };
    let run = async {
        let (status, err) = tokio::join!(child.wait(), collect);
        (status, err)
    };
    let (status, stderr) = match tokio::time::timeout(deadline, run).await {
        Ok(done) => done,
        Err(_) => {
            let _ = child.kill().await;
            return Err(ProbeError::Deadline(deadline));
        }
    };
    let stderr = String::from_utf8_lossy(&stderr).trim().to_owned();
    match status {
        Ok(s) if s.code() == Some(PROBE_EXIT_STATUS) => Ok(()),
        Ok(s) => Err(ProbeError::WrongExit {
            status: s.to_string(),
            stderr,
        }),
        Err(e) => Err(ProbeError::WrongExit {
            status: format!("wait failed: {e}"),
            stderr,
        }),
    }
}

/// A temporary raw disk holding the boot sector, removed on drop.
struct ProbeDisk {
    path: PathBuf,
}

impl ProbeDisk {
    fn create() -> Result<ProbeDisk, ProbeError> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("hearth-accel-probe-{}-{n}.img", std::process::id()));
        let err = |source| ProbeError::Disk {
            path: path.clone(),
            source,
        };
        // create_new: never follow or reuse something another user planted there.
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(err)?;
        let disk = ProbeDisk { path: path.clone() };
        file.write_all(&boot_sector()).map_err(err)?;
        // SeaBIOS on q35 (AHCI) fails "could not read the boot disk" for a
        // one-sector disk; 1 MiB (sparse) boots.
        file.set_len(PROBE_DISK_BYTES).map_err(err)?;
        Ok(disk)
    }

    /// `-drive` value; the path is ours (temp dir + fixed name) but is escaped the
    /// QEMU way anyway in case TMPDIR contains a comma.
    fn drive_arg(&self) -> String {
        let path = self.path.to_string_lossy().replace(',', ",,");
        format!("file={path},format=raw,if=ide")
    }
}

impl Drop for ProbeDisk {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_sector_has_signature_and_exit_code() {
        let s = boot_sector();
        assert_eq!(&s[510..], &[0x55, 0xAA]);
        assert_eq!(&s[..4], &[0xB0, 0x21, 0xE6, 0xF4]);
        assert_eq!(PROBE_EXIT_STATUS, 67);
    }

    #[test]
    fn virt_flags_are_read_from_flags_lines_only() {
        let pvm = "processor\t: 0\nflags\t\t: fpu vme de pse tsc msr hypervisor\nmodel name\t: vmx-like CPU\n";
        assert!(!cpuinfo_has_virt_flags(pvm));
        let intel = "flags\t\t: fpu vme vmx ept\n";
        assert!(cpuinfo_has_virt_flags(intel));
        let amd = "flags\t\t: fpu svm npt\n";
        assert!(cpuinfo_has_virt_flags(amd));
        assert!(!cpuinfo_has_virt_flags("flags\t\t: fpu vmxfoo svm_lock\n"));
        assert!(!cpuinfo_has_virt_flags(""));
    }

    #[test]
    fn probe_disk_is_removed_after_use() {
        let disk = ProbeDisk::create().expect("temp disk");
        let path = disk.path.clone();
        let bytes = std::fs::read(&path).expect("read");
        assert_eq!(bytes.len() as u64, PROBE_DISK_BYTES);
        assert_eq!(&bytes[..512], &boot_sector()[..]);
        drop(disk);
        assert!(!path.exists());
    }

    #[tokio::test]
    async fn a_missing_binary_is_a_spawn_error_not_a_panic() {
        let err = probe_boot(
            Path::new("/nonexistent/qemu-system-x86_64"),
            Accel::Tcg,
            PROBE_DEADLINE,
        )
        .await
        .expect_err("no binary");
        assert!(matches!(err, ProbeError::Spawn { .. }), "{err}");
    }
}
