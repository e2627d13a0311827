//! Which firmware a VM's QEMU runs, and the UEFI variables file each UEFI VM
//! keeps. Decisions and reasons: docs/guests.md, "Firmware and cloud-init".

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use hearth_api::Firmware;
use hearth_qemu::cmdline::{Firmware as QemuFirmware, Ovmf};

use crate::config::EngineConfig;

/// Why a VM's firmware cannot be prepared. Every message starts with the
/// field, `spec.firmware`, and names the file.
#[derive(Debug, thiserror::Error)]
pub enum FirmwareError {
    #[error(
        "spec.firmware: UEFI needs OVMF's {what} {}, which is not a regular file; start hearthd with {flag} PATH",
        path.display()
    )]
    NotAFile {
        what: &'static str,
        path: PathBuf,
        flag: &'static str,
    },
    #[error(
        "spec.firmware: UEFI needs OVMF's {what} {} ({source}): install OVMF with `apt-get install ovmf`, or start hearthd with {flag} PATH",
        path.display()
    )]
    Missing {
        what: &'static str,
        path: PathBuf,
        flag: &'static str,
        #[source]
        source: io::Error,
    },
    #[error(
        "spec.firmware: the VM's UEFI variables file {} is {vars_bytes} bytes but the template {} is {template_bytes} bytes (another OVMF build?); remove the VM's file to start over from the template (its boot entries are lost)",
        vars.display(),
        template.display()
    )]
    OtherBuild {
        vars: PathBuf,
        vars_bytes: u64,
        template: PathBuf,
        template_bytes: u64,
    },
    #[error("spec.firmware: {}: {source}", vars.display())]
    Vars {
        vars: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "spec.firmware: cannot copy the UEFI variables template {} to {}: {source}",
        template.display(),
        vars.display()
    )]
    Copy {
        template: PathBuf,
        vars: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// What [`prepare`] did for one launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prepared {
    pub firmware: QemuFirmware,
    /// The VM's variables file was made now, from this template.
    pub vars_created_from: Option<PathBuf>,
}

/// The firmware for VM `vm` with `firmware`: nothing to prepare for BIOS;
/// for UEFI the OVMF code image must exist, and the VM's own variables file
/// is copied from the template on its first UEFI start (and kept after).
/// Only called while no QEMU of the VM runs. Errors name the field and, for
/// a missing file, the package that brings it.
pub fn prepare(
    cfg: &EngineConfig,
    vm: &str,
    firmware: Firmware,
) -> Result<Prepared, FirmwareError> {
    match firmware {
        Firmware::Bios => Ok(Prepared {
            firmware: QemuFirmware::Bios,
            vars_created_from: None,
        }),
        Firmware::Uefi => {
            let code = existing_ovmf_file(&cfg.ovmf_code, "code image", "--ovmf-code")?;
            let vars = cfg.uefi_vars_path(vm);
            let created = ensure_vars(&cfg.ovmf_vars, &vars)?;
            Ok(Prepared {
                firmware: QemuFirmware::Uefi(Ovmf { code, vars }),
                vars_created_from: created.then(|| cfg.ovmf_vars.clone()),
            })
        }
    }
}

fn existing_ovmf_file(
    path: &Path,
    what: &'static str,
    flag: &'static str,
) -> Result<PathBuf, FirmwareError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(path.to_owned()),
        Ok(_) => Err(FirmwareError::NotAFile {
            what,
            path: path.to_owned(),
            flag,
        }),
        Err(source) => Err(FirmwareError::Missing {
            what,
            path: path.to_owned(),
            flag,
            source,
        }),
    }
}

/// Makes sure the VM's variables file exists; true when it was made now.
/// An existing one is kept as it is (it holds the guest's boot entries),
/// unless its size shows it belongs to another OVMF build, which would not
/// start: then the start fails saying so.
fn ensure_vars(template: &Path, vars: &Path) -> Result<bool, FirmwareError> {
    match std::fs::metadata(vars) {
        Ok(existing) => {
            if let Ok(t) = std::fs::metadata(template)
                && t.len() != existing.len()
            {
                return Err(FirmwareError::OtherBuild {
                    vars: vars.to_owned(),
                    vars_bytes: existing.len(),
                    template: template.to_owned(),
                    template_bytes: t.len(),
                });
            }
            return Ok(false);
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(FirmwareError::Vars {
                vars: vars.to_owned(),
                source,
            });
        }
    }
    let template = existing_ovmf_file(template, "variables template", "--ovmf-vars")?;
    copy_atomically(&template, vars).map_err(|source| FirmwareError::Copy {
        template: template.clone(),
        vars: vars.to_owned(),
        source,
    })?;
    Ok(true)
}

/// Copies `from` to `to` through a temporary file and a rename, so `to`
/// is never half written.
fn copy_atomically(from: &Path, to: &Path) -> io::Result<()> {
    let content = std::fs::read(from)?;
    let mut tmp_name = to.as_os_str().to_owned();
    tmp_name.push(".tmp");
    let tmp = Path::new(&tmp_name);
    let _ = std::fs::remove_file(tmp);
    let result = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(tmp)?;
        file.write_all(&content)?;
        file.sync_all()?;
        std::fs::rename(tmp, to)?;
        match to.parent() {
            Some(dir) => File::open(dir)?.sync_all(),
            None => Ok(()),
        }
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;
    use std::time::Duration;

    fn config(dir: &Path) -> EngineConfig {
        EngineConfig {
            state_dir: dir.join("state"),
            run_dir: dir.join("run"),
            image_roots: vec![],
            qemu_binary: "/usr/bin/qemu-system-x86_64".into(),
            qemu_user: None,
            accel: hearth_qemu::accel::AccelDecision {
                accel: hearth_qemu::Accel::Tcg,
                reason: "test".into(),
            },
            resync_interval: Duration::from_secs(10),
            images: Default::default(),
            forwards: Default::default(),
            ovmf_code: dir.join("OVMF_CODE.fd"),
            ovmf_vars: dir.join("OVMF_VARS.fd"),
            compaction_speed: 0,
            dns_resolv_file: "/etc/resolv.conf".into(),
            console_log_max_bytes: crate::config::DEFAULT_CONSOLE_LOG_MAX_BYTES,
        }
    }

    fn setup() -> (tempfile::TempDir, EngineConfig) {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = config(dir.path());
        std::fs::write(&cfg.ovmf_code, b"code").expect("code");
        std::fs::write(&cfg.ovmf_vars, b"template").expect("vars");
        std::fs::create_dir_all(cfg.vm_state_dir("web")).expect("state dir");
        (dir, cfg)
    }

    #[test]
    fn bios_needs_nothing() {
        let (_dir, mut cfg) = setup();
        cfg.ovmf_code = "/nonexistent".into();
        let p = prepare(&cfg, "web", Firmware::Bios).expect("bios");
        assert_eq!(p.firmware, QemuFirmware::Bios);
        assert!(!cfg.uefi_vars_path("web").exists());
    }

    #[test]
    fn the_first_uefi_start_copies_the_template_and_later_ones_keep_the_file() {
        let (_dir, cfg) = setup();
        let vars = cfg.uefi_vars_path("web");
        let p = prepare(&cfg, "web", Firmware::Uefi).expect("uefi");
        assert_eq!(
            p.firmware,
            QemuFirmware::Uefi(Ovmf {
                code: cfg.ovmf_code.clone(),
                vars: vars.clone()
            })
        );
        assert_eq!(p.vars_created_from.as_ref(), Some(&cfg.ovmf_vars));
        assert_eq!(std::fs::read(&vars).expect("vars"), b"template");
        assert_eq!(
            std::fs::metadata(&vars).expect("stat").mode() & 0o777,
            0o600
        );
        // The guest changed its variables (same size, as OVMF writes in place).
        std::fs::write(&vars, b"TEMPLATE").expect("guest writes");
        let ino = std::fs::metadata(&vars).expect("stat").ino();
        let p = prepare(&cfg, "web", Firmware::Uefi).expect("uefi again");
        assert_eq!(p.vars_created_from, None);
        assert_eq!(std::fs::read(&vars).expect("vars"), b"TEMPLATE");
        assert_eq!(std::fs::metadata(&vars).expect("stat").ino(), ino);
    }

    #[test]
    fn a_missing_code_image_names_the_file_and_the_package() {
        let (_dir, mut cfg) = setup();
        cfg.ovmf_code = "/nonexistent/OVMF_CODE_4M.fd".into();
        let err = prepare(&cfg, "web", Firmware::Uefi)
            .expect_err("no code")
            .to_string();
        assert!(err.starts_with("spec.firmware: "), "{err}");
        assert!(err.contains("/nonexistent/OVMF_CODE_4M.fd"), "{err}");
        assert!(err.contains("apt-get install ovmf"), "{err}");
        assert!(err.contains("--ovmf-code"), "{err}");
        assert!(!cfg.uefi_vars_path("web").exists());
    }

    #[test]
    fn a_missing_template_fails_only_the_first_start() {
        let (_dir, mut cfg) = setup();
        cfg.ovmf_vars = "/nonexistent/OVMF_VARS_4M.fd".into();
        let err = prepare(&cfg, "web", Firmware::Uefi)
            .expect_err("no template")
            .to_string();
        assert!(err.contains("/nonexistent/OVMF_VARS_4M.fd"), "{err}");
        assert!(err.contains("apt-get install ovmf"), "{err}");
        assert!(err.contains("--ovmf-vars"), "{err}");
        // A VM that has its file already needs no template.
        std::fs::write(cfg.uefi_vars_path("web"), b"mine").expect("vars");
        prepare(&cfg, "web", Firmware::Uefi).expect("existing vars are enough");
    }

    #[test]
    fn vars_of_another_ovmf_build_are_not_used() {
        let (_dir, cfg) = setup();
        std::fs::write(cfg.uefi_vars_path("web"), b"of another size").expect("vars");
        let err = prepare(&cfg, "web", Firmware::Uefi)
            .expect_err("size mismatch")
            .to_string();
        assert!(err.contains("another OVMF build"), "{err}");
        assert!(err.contains("uefi-vars.fd"), "{err}");
        assert_eq!(
            std::fs::read(cfg.uefi_vars_path("web")).expect("vars"),
            b"of another size",
            "left as it was"
        );
    }
}
