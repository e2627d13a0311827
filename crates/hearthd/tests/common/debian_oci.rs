//! The Debian 12 test image (guest/debian/) made into OCI images with
//! umoci, for the tests that boot OCI images: its root tree as a rootfs
//! layer (with and without /boot), a kernel image of its kernel and
//! initrd, and its qcow2 as a containerDisk.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use hearth_test_support::oci::{sha256sum, tool, umoci_tag};

use super::debian::{debian_image, debian_out_dir};

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The Debian image's root filesystem, mounted read-only; unmounted (and
/// its raw copy removed) when dropped.
struct Mounted {
    dir: PathBuf,
    raw: PathBuf,
}

impl Mounted {
    fn new(qcow2: &Path, work: &Path) -> Mounted {
        let raw = work.join("debian.raw");
        tool(
            "qemu-img",
            &["convert", "-q", "-O", "raw", s(qcow2), s(&raw)],
        );
        let dir = work.join("mnt");
        fs::create_dir_all(&dir).unwrap();
        // Partition 1 (the root) starts at sector 262144 (guest/debian/build.sh).
        tool(
            "mount",
            &[
                "-o",
                "ro,loop,offset=134217728",
                "-t",
                "ext4",
                s(&raw),
                s(&dir),
            ],
        );
        Mounted { dir, raw }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
        let _ = fs::remove_file(&self.raw);
    }
}

/// A tar of `dir`'s content (owners by number, xattrs), in `out`.
pub fn tar_dir(dir: &Path, out: &Path, exclude: &[&str]) {
    let mut args = vec![
        "--numeric-owner".to_string(),
        "--xattrs".into(),
        "--xattrs-include=*".into(),
        "-C".into(),
        s(dir).into(),
        "-cf".into(),
        s(out).into(),
    ];
    for e in exclude {
        args.insert(0, format!("--exclude={e}"));
    }
    args.push(".".into());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    tool("tar", &refs);
}

/// An OCI layout of the Debian image, and what the tests check against.
pub struct DebianOci {
    pub layout: PathBuf,
    /// The kernel's release (`uname -r` in the guest).
    pub version: String,
    pub kernel_sha: String,
    pub initrd_sha: String,
    /// A module of the kernel, relative to `/lib/modules/VERSION`, and its
    /// SHA-256: the kernel image has it, the `noboot` tree does not.
    pub module: String,
    pub module_sha: String,
}

/// Tags in `work/layout`: `rootfs` (the root tree, and an fstab naming
/// /dev/vda: the partition's UUIDs mean nothing on hearth's disk),
/// `noboot` (the same without /boot, the links to it and the kernel's
/// modules), `kernel` (only /boot/vmlinuz, /boot/initrd.img and
/// /lib/modules/VERSION, as Ignite's kernel images are) and,
/// with `container_disk`, `disk` (the qcow2 under /disk/).
pub fn debian_oci(work: &Path, container_disk: bool) -> DebianOci {
    let (qcow2, _) = debian_image();
    let info = fs::read_to_string(debian_out_dir().join("debian-12.info")).unwrap();
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("kernel="))
        .expect("debian-12.info names the kernel")
        .trim()
        .to_string();
    let w = work;
    let tree = Mounted::new(&qcow2, w);
    let root = &tree.dir;
    let kernel_file = root.join(format!("boot/vmlinuz-{version}"));
    let initrd_file = root.join(format!("boot/initrd.img-{version}"));
    assert!(kernel_file.is_file() && initrd_file.is_file(), "{version}");
    let kernel_sha = sha256sum(&kernel_file);
    let initrd_sha = sha256sum(&initrd_file);
    let base = w.join("base.tar");
    tar_dir(root, &base, &[]);
    let noboot = w.join("noboot.tar");
    tar_dir(
        root,
        &noboot,
        &[
            "./boot",
            "./vmlinuz",
            "./vmlinuz.old",
            "./initrd.img",
            "./initrd.img.old",
            "./usr/lib/modules",
            "./lib/modules",
        ],
    );
    let fix = w.join("fix");
    fs::create_dir_all(fix.join("etc")).unwrap();
    fs::write(
        fix.join("etc/fstab"),
        "/dev/vda / ext4 defaults,errors=remount-ro 0 0\n",
    )
    .unwrap();
    let fstab = w.join("fstab.tar");
    tar_dir(&fix, &fstab, &[]);
    let k = w.join("k");
    fs::create_dir_all(k.join("boot")).unwrap();
    fs::copy(&kernel_file, k.join("boot/vmlinuz")).unwrap();
    fs::copy(&initrd_file, k.join("boot/initrd.img")).unwrap();
    // /lib is a link to usr/lib in the tree (merged /usr); the kernel image
    // has a real /lib/modules, as Ignite's do.
    let modules = root.join("usr/lib/modules").join(&version);
    fs::create_dir_all(k.join("lib/modules")).unwrap();
    tool("cp", &["-a", s(&modules), s(&k.join("lib/modules"))]);
    let module = pick_module(&modules);
    let module_sha = sha256sum(&modules.join(&module));
    let kernel_tar = w.join("kernel.tar");
    tar_dir(&k, &kernel_tar, &[]);
    drop(tree);
    let layout = w.join("layout");
    umoci_tag(&layout, "rootfs", &[&base, &fstab]);
    umoci_tag(&layout, "noboot", &[&noboot, &fstab]);
    umoci_tag(&layout, "kernel", &[&kernel_tar]);
    let mut made = vec![base, noboot, kernel_tar, fstab];
    if container_disk {
        let cd = w.join("cd");
        fs::create_dir_all(cd.join("disk")).unwrap();
        fs::copy(&qcow2, cd.join("disk/debian-12.qcow2")).unwrap();
        let disk_tar = w.join("disk.tar");
        tar_dir(&cd, &disk_tar, &[]);
        fs::remove_dir_all(&cd).unwrap();
        umoci_tag(&layout, "disk", &[&disk_tar]);
        made.push(disk_tar);
    }
    for f in made {
        let _ = fs::remove_file(f);
    }
    DebianOci {
        layout,
        version,
        kernel_sha,
        initrd_sha,
        module,
        module_sha,
    }
}

/// A module the guest does not load by itself (the dummy network device),
/// relative to the modules directory.
fn pick_module(modules: &Path) -> String {
    let dir = modules.join("kernel/drivers/net");
    let name = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("dummy.ko"))
        .unwrap_or_else(|| panic!("no dummy.ko* in {}", dir.display()));
    format!("kernel/drivers/net/{name}")
}
