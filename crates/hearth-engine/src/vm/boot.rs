//! Which kernel a VM boots, and where QEMU reads it from.
//!
//! The choice is a pure function of the spec and of what the store says
//! about the images ([`choose`], tested over every case below); the shell
//! around it reads the store and puts an image's kernel where the QEMU
//! user can read it.

use std::path::PathBuf;

use hearth_api::{Boot, DiskSource, ImagePhase, Kind, Object, VirtualImageStatus, VirtualMachine};
use hearth_qemu::cmdline::KernelBoot;

use super::VmError;
use crate::context::Context;

/// The command line a kernel from an image starts with: the first
/// virtio-blk disk (`/dev/vda`, the disks come before the seed) is the
/// root, the serial port the console.
pub const IMAGE_KERNEL_CMDLINE: &str = "root=/dev/vda rw console=ttyS0";

/// What an image can give a kernel boot.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum ImageKernel {
    Files {
        kernel: PathBuf,
        initrd: Option<PathBuf>,
    },
    /// None to give, and why. `rootfs`: the image is a root filesystem,
    /// which no firmware can boot (it has no partition table and no boot
    /// loader).
    None { why: String, rootfs: bool },
}

/// The image a VM's first disk is made from, or why there is none.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum FirstDisk {
    Image(String),
    NoImage(String),
}

/// How a VM boots.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum BootPlan {
    /// `spec.boot.kernel` and `spec.boot.initrd`: host files, with
    /// `spec.boot.cmdline` as it is.
    HostKernel,
    /// A kernel (and initrd) an image holds, with hearth's `root=` and
    /// console before `spec.boot.cmdline`.
    FromImage {
        kernel: PathBuf,
        initrd: Option<PathBuf>,
        cmdline: String,
    },
    /// The firmware boots the disks, in their order.
    Firmware,
}

/// The boot of a VM with `boot` as its `spec.boot`: its own kernel file,
/// or the kernel of `spec.boot.kernelImage`, or the kernel of the image
/// its first disk is made from; the firmware only when there is no
/// `spec.boot` and that image is not a bare root filesystem. `image` tells
/// what an image can give, `first_disk_image` the image of the first disk
/// (or why there is none); each is asked only when the choice needs it.
pub(super) fn choose(
    boot: Option<&Boot>,
    image: &mut dyn FnMut(&str) -> Result<ImageKernel, VmError>,
    first_disk_image: &mut dyn FnMut() -> Result<FirstDisk, VmError>,
) -> Result<BootPlan, VmError> {
    if boot.is_some_and(|b| b.kernel.is_some()) {
        return Ok(BootPlan::HostKernel);
    }
    let from_image = |kernel, initrd| {
        let extra = boot.map(|b| b.cmdline.trim()).unwrap_or("");
        let cmdline = if extra.is_empty() {
            IMAGE_KERNEL_CMDLINE.to_string()
        } else {
            format!("{IMAGE_KERNEL_CMDLINE} {extra}")
        };
        BootPlan::FromImage {
            kernel,
            initrd,
            cmdline,
        }
    };
    if let Some(name) = boot.and_then(|b| b.kernel_image.as_ref()) {
        return match image(name)? {
            ImageKernel::Files { kernel, initrd } => Ok(from_image(kernel, initrd)),
            ImageKernel::None { why, .. } => Err(VmError::KernelImage {
                image: name.clone(),
                why,
            }),
        };
    }
    let (why, rootfs) = match first_disk_image()? {
        FirstDisk::Image(name) => match image(&name)? {
            ImageKernel::Files { kernel, initrd } => return Ok(from_image(kernel, initrd)),
            ImageKernel::None { why, rootfs } => (
                format!("the VirtualImage {name:?} of spec.disks[0] {why}"),
                rootfs,
            ),
        },
        FirstDisk::NoImage(why) => (why, false),
    };
    match boot {
        Some(_) => Err(VmError::NoKernel { why }),
        None if rootfs => Err(VmError::RootfsWithoutKernel { why }),
        None => Ok(BootPlan::Firmware),
    }
}

/// The kernel `vm` boots ([`choose`]). `None`: the firmware boots the
/// disks. The flag: the kernel came from an image (and is staged for the
/// QEMU user).
pub(super) fn kernel_boot(
    ctx: &Context,
    vm: &VirtualMachine,
) -> Result<(Option<KernelBoot>, bool), VmError> {
    let boot = vm.spec.boot.as_ref();
    let plan = choose(boot, &mut |name| image_kernel(ctx, name), &mut || {
        first_disk_image(ctx, vm)
    })?;
    Ok(match plan {
        BootPlan::HostKernel => {
            let b = boot.expect("a host kernel comes from spec.boot");
            let host = |p: &std::path::Path, field| {
                ctx.config
                    .confine(p)
                    .map_err(|source| VmError::BootFile { field, source })
            };
            let kernel = b.kernel.as_deref().expect("spec.boot.kernel");
            let k = KernelBoot {
                kernel: host(kernel, "spec.boot.kernel")?,
                initrd: match &b.initrd {
                    Some(p) => Some(host(p, "spec.boot.initrd")?),
                    None => None,
                },
                cmdline: b.cmdline.clone(),
            };
            (Some(k), false)
        }
        BootPlan::FromImage {
            kernel,
            initrd,
            cmdline,
        } => (
            Some(KernelBoot {
                kernel,
                initrd,
                cmdline,
            }),
            true,
        ),
        BootPlan::Firmware => (None, false),
    })
}

/// Puts the kernel and initrd of `k` into `dir` as `VM.kernel` and
/// `VM.initrd` (hard links, copies across filesystems; read-only) and
/// points `k` at them.
pub(super) fn stage_boot_files(
    dir: &std::path::Path,
    vm: &str,
    mut k: KernelBoot,
) -> Result<KernelBoot, VmError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)))
        .map_err(|source| VmError::Dir {
            path: dir.to_path_buf(),
            source,
        })?;
    let stage = |src: &std::path::Path, kind: &str| -> Result<std::path::PathBuf, VmError> {
        let to = dir.join(format!("{vm}.{kind}"));
        let tmp = dir.join(format!(".{vm}.{kind}.tmp"));
        let io = |source| VmError::Dir {
            path: to.clone(),
            source,
        };
        let _ = std::fs::remove_file(&tmp);
        if std::fs::hard_link(src, &tmp).is_err() {
            std::fs::copy(src, &tmp).map_err(io)?;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o444)).map_err(io)?;
        }
        std::fs::rename(&tmp, &to).map_err(io)?;
        Ok(to)
    };
    k.kernel = stage(&k.kernel, "kernel")?;
    k.initrd = match &k.initrd {
        Some(i) => Some(stage(i, "initrd")?),
        None => {
            let _ = std::fs::remove_file(dir.join(format!("{vm}.initrd")));
            None
        }
    };
    Ok(k)
}

/// Removes what [`stage_boot_files`] put into `dir` for `vm`: links that
/// would keep a released kernel's blocks after the VM is gone.
pub(super) fn remove_staged(dir: &std::path::Path, vm: &str) {
    for kind in ["kernel", "initrd"] {
        let _ = std::fs::remove_file(dir.join(format!("{vm}.{kind}")));
        let _ = std::fs::remove_file(dir.join(format!(".{vm}.{kind}.tmp")));
    }
}

/// The VirtualImage the VM's first disk is made from, or why there is none.
fn first_disk_image(ctx: &Context, vm: &VirtualMachine) -> Result<FirstDisk, VmError> {
    let Some(d) = vm.spec.disks.first() else {
        return Ok(FirstDisk::NoImage("the VM has no disk".into()));
    };
    let name = &d.virtual_disk_name;
    Ok(
        match ctx.store.get(Kind::VirtualDisk, name)?.map(|s| s.object) {
            Some(Object::VirtualDisk(disk)) => match disk.spec.source {
                DiskSource::VirtualImage(image) => FirstDisk::Image(image),
                _ => FirstDisk::NoImage(format!(
                    "spec.disks[0] (VirtualDisk {name:?}) is not made from a VirtualImage"
                )),
            },
            _ => FirstDisk::NoImage(format!(
                "spec.disks[0]: VirtualDisk {name:?} does not exist"
            )),
        },
    )
}

/// What the image `name` can give a kernel boot, by its stored status.
fn image_kernel(ctx: &Context, name: &str) -> Result<ImageKernel, VmError> {
    let none = |why: String, rootfs| Ok(ImageKernel::None { why, rootfs });
    let Some(stored) = ctx.store.get(Kind::VirtualImage, name)? else {
        return none("does not exist".into(), false);
    };
    if stored.deleting {
        return none("is being deleted".into(), false);
    }
    let st: VirtualImageStatus = serde_json::from_value(stored.status).unwrap_or_default();
    if st.phase != ImagePhase::Ready {
        return none(format!("is not Ready ({})", st.phase), false);
    }
    let Some(kernel) = st.kernel else {
        let shape = st.shape.as_deref();
        return none(
            format!(
                "has no kernel: its content (shape {}) has no /boot/vmlinuz or /boot/vmlinux",
                shape.unwrap_or("not OCI")
            ),
            shape == Some("rootfs"),
        );
    };
    for p in std::iter::once(&kernel).chain(st.initrd.iter()) {
        if !p.is_file() {
            return none(format!("names {}, which is gone", p.display()), false);
        }
    }
    Ok(ImageKernel::Files {
        kernel,
        initrd: st.initrd,
    })
}

/// Why the VM must wait for `spec.boot.kernelImage` (missing or not yet
/// Ready, as a disk waits for its image), if it must.
pub(super) fn kernel_image_waiting(
    ctx: &Context,
    vm: &VirtualMachine,
) -> Result<Option<String>, crate::store::StoreError> {
    let Some(image) = vm.spec.boot.as_ref().and_then(|b| b.kernel_image.as_ref()) else {
        return Ok(None);
    };
    let Some(stored) = ctx.store.get(Kind::VirtualImage, image)? else {
        return Ok(Some(format!(
            "spec.boot.kernelImage: waiting for VirtualImage {image:?}, which does not exist"
        )));
    };
    let st: VirtualImageStatus = serde_json::from_value(stored.status).unwrap_or_default();
    Ok((st.phase != ImagePhase::Ready || stored.deleting).then(|| {
        format!(
            "spec.boot.kernelImage: waiting for VirtualImage {image:?} ({}{})",
            if stored.deleting {
                "being deleted".to_string()
            } else {
                st.phase.to_string()
            },
            st.progress
                .as_deref()
                .map(|p| format!(", {p}"))
                .unwrap_or_default()
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn files(k: &str, i: Option<&str>) -> ImageKernel {
        ImageKernel::Files {
            kernel: k.into(),
            initrd: i.map(PathBuf::from),
        }
    }

    fn none(rootfs: bool) -> ImageKernel {
        ImageKernel::None {
            why: "has no kernel".into(),
            rootfs,
        }
    }

    /// The choice with `images` as what the store says and `first` as the
    /// first disk's image; also which images were asked about.
    fn run(
        boot: Option<&Boot>,
        images: &BTreeMap<&str, ImageKernel>,
        first: Result<&str, &str>,
    ) -> (Result<BootPlan, VmError>, Vec<String>) {
        let mut asked = Vec::new();
        let plan = choose(
            boot,
            &mut |name| {
                asked.push(name.to_string());
                Ok(images.get(name).cloned().unwrap_or(ImageKernel::None {
                    why: "does not exist".into(),
                    rootfs: false,
                }))
            },
            &mut || {
                Ok(match first {
                    Ok(name) => FirstDisk::Image(name.to_string()),
                    Err(why) => FirstDisk::NoImage(why.to_string()),
                })
            },
        );
        (plan, asked)
    }

    fn boot(kernel: Option<&str>, kernel_image: Option<&str>, cmdline: &str) -> Boot {
        Boot {
            kernel: kernel.map(PathBuf::from),
            kernel_image: kernel_image.map(str::to_string),
            initrd: None,
            cmdline: cmdline.into(),
        }
    }

    fn images() -> BTreeMap<&'static str, ImageKernel> {
        BTreeMap::from([
            ("debian", files("/k/deb", Some("/k/deb.initrd"))),
            ("kernel", files("/k/vmlinux", None)),
            ("bare-rootfs", none(true)),
            ("container-disk", none(false)),
        ])
    }

    #[test]
    fn a_host_kernel_wins_and_no_image_is_asked() {
        let b = boot(Some("/vmlinuz"), Some("kernel"), "quiet");
        let (plan, asked) = run(Some(&b), &images(), Ok("debian"));
        assert_eq!(plan.ok(), Some(BootPlan::HostKernel));
        assert!(asked.is_empty(), "{asked:?}");
    }

    #[test]
    fn a_kernel_image_gives_its_files_with_root_and_console_first() {
        let b = boot(None, Some("kernel"), "  quiet ");
        let (plan, asked) = run(Some(&b), &images(), Ok("bare-rootfs"));
        assert_eq!(
            plan.ok(),
            Some(BootPlan::FromImage {
                kernel: "/k/vmlinux".into(),
                initrd: None,
                cmdline: format!("{IMAGE_KERNEL_CMDLINE} quiet"),
            })
        );
        assert_eq!(asked, ["kernel"], "the disk's image is not asked");
    }

    #[test]
    fn a_kernel_image_without_a_kernel_is_an_error_naming_it() {
        for name in ["container-disk", "missing"] {
            let b = boot(None, Some(name), "");
            let (plan, _) = run(Some(&b), &images(), Ok("debian"));
            let e = plan.expect_err("no kernel").to_string();
            assert!(
                e.starts_with("spec.boot.kernelImage:") && e.contains(name),
                "{e}"
            );
        }
    }

    #[test]
    fn without_a_kernel_field_the_first_disks_image_gives_its_kernel() {
        for b in [None, Some(boot(None, None, ""))] {
            let (plan, asked) = run(b.as_ref(), &images(), Ok("debian"));
            assert_eq!(
                plan.ok(),
                Some(BootPlan::FromImage {
                    kernel: "/k/deb".into(),
                    initrd: Some("/k/deb.initrd".into()),
                    cmdline: IMAGE_KERNEL_CMDLINE.into(),
                })
            );
            assert_eq!(asked, ["debian"]);
        }
    }

    #[test]
    fn without_spec_boot_a_disk_image_or_a_plain_disk_boots_through_the_firmware() {
        for first in [
            Ok("container-disk"),
            Ok("missing"),
            Err("not from an image"),
        ] {
            let (plan, _) = run(None, &images(), first);
            assert_eq!(plan.ok(), Some(BootPlan::Firmware), "{first:?}");
        }
    }

    #[test]
    fn without_spec_boot_a_bare_rootfs_is_refused_not_handed_to_the_firmware() {
        let (plan, _) = run(None, &images(), Ok("bare-rootfs"));
        let e = plan.expect_err("refused").to_string();
        assert!(e.starts_with("spec.disks[0]:"), "{e}");
        assert!(e.contains("\"bare-rootfs\""), "{e}");
        assert!(e.contains("spec.boot.kernelImage"), "{e}");
    }

    #[test]
    fn spec_boot_without_any_kernel_is_an_error_saying_why() {
        let b = boot(None, None, "quiet");
        for first in [
            Ok("container-disk"),
            Ok("bare-rootfs"),
            Err("the VM has no disk"),
        ] {
            let (plan, _) = run(Some(&b), &images(), first);
            let e = plan.expect_err("no kernel").to_string();
            assert!(e.starts_with("spec.boot: no kernel to boot"), "{e}");
            match first {
                Ok(name) => assert!(e.contains(name), "{e}"),
                Err(why) => assert!(e.contains(why), "{e}"),
            }
        }
    }
}
