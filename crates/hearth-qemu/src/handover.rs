//! What hearthd opens for a QEMU and hands over by descriptor, and the user
//! QEMU runs as.
//!
//! QEMU runs as an unprivileged user that can open none of hearth's files:
//! the state and run directories stay root's and private. Everything a VM
//! needs of them — every layer of every disk's chain, the cloud-init seed,
//! the UEFI variables file, the serial log, the QMP, agent and serial
//! sockets, the taps — is opened here (as root) and inherited by QEMU as a
//! descriptor, so a QEMU reaches exactly its own files and nothing it could
//! name by path. `docs/qemu-driver.md` ("Privileges") says what stays by path
//! and why.

use std::ffi::CString;
use std::fs::OpenOptions;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use crate::cmdline::{Accel, FdNumbers, Firmware, LaunchSpec, NicFds};

/// The account QEMU runs as, resolved once at daemon start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QemuUser {
    pub name: String,
    pub uid: u32,
    /// The user's primary group.
    pub gid: u32,
    /// The `kvm` group's id, if the host has one: QEMU gets it as its only
    /// supplementary group when it runs with KVM and `/dev/kvm` belongs to it.
    pub kvm_gid: Option<u32>,
}

/// The system user the Debian package creates.
pub const DEFAULT_QEMU_USER: &str = "hearth-qemu";

#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error(
        "--qemu-user {name:?}: no such user; create it with `useradd --system --user-group --no-create-home --shell /usr/sbin/nologin {name}` (and `usermod -aG kvm {name}` on a host with KVM)"
    )]
    NoSuchUser { name: String },
    #[error("--qemu-user {name:?}: cannot look the user up")]
    Lookup {
        name: String,
        #[source]
        source: std::io::Error,
    },
}

impl QemuUser {
    /// Looks `name` up in the user database (NSS). `root` resolves to uid 0:
    /// the caller decides whether to allow it.
    pub fn lookup(name: &str) -> Result<QemuUser, UserError> {
        let (uid, gid) = lookup_user(name)?;
        Ok(QemuUser {
            name: name.to_owned(),
            uid,
            gid,
            kvm_gid: lookup_group("kvm"),
        })
    }

    pub fn is_root(&self) -> bool {
        self.uid == 0
    }

    /// The supplementary groups QEMU gets for `accel`: `kvm` only, and only
    /// when KVM is used and `/dev/kvm` belongs to that group.
    pub fn groups_for(&self, accel: Accel) -> Vec<u32> {
        use std::os::unix::fs::MetadataExt;
        match (accel, self.kvm_gid) {
            (Accel::Kvm, Some(kvm)) => std::fs::metadata("/dev/kvm")
                .ok()
                .filter(|m| m.gid() == kvm)
                .map(|_| vec![kvm])
                .unwrap_or_default(),
            _ => Vec::new(),
        }
    }
}

fn lookup_user(name: &str) -> Result<(u32, u32), UserError> {
    let c = CString::new(name).map_err(|_| UserError::NoSuchUser {
        name: name.to_owned(),
    })?;
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: all-zero is a valid `passwd` (null pointers, zero ids).
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; `buf` outlives it and its
    // length is passed; `result` is only read after the call.
    let rc = unsafe {
        libc::getpwnam_r(
            c.as_ptr(),
            &mut pwd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 {
        return Err(UserError::Lookup {
            name: name.to_owned(),
            source: std::io::Error::from_raw_os_error(rc),
        });
    }
    if result.is_null() {
        return Err(UserError::NoSuchUser {
            name: name.to_owned(),
        });
    }
    Ok((pwd.pw_uid, pwd.pw_gid))
}

fn lookup_group(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    let mut buf = vec![0u8; 64 * 1024];
    // SAFETY: all-zero is a valid `group`.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::group = std::ptr::null_mut();
    // SAFETY: as in `lookup_user`.
    let rc = unsafe {
        libc::getgrnam_r(
            c.as_ptr(),
            &mut grp,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut result,
        )
    };
    (rc == 0 && !result.is_null()).then_some(grp.gr_gid)
}

#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    #[error("cannot open {what} {path} for QEMU")]
    Open {
        what: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("socket {path} is in use by a running process; is this VM already running?")]
    SocketInUse { path: PathBuf },
    #[error("disks[{index}]: {source}")]
    Layer {
        index: usize,
        #[source]
        source: crate::chain::LayerError,
    },
    #[error("cannot open tap {tap} for QEMU")]
    Tap {
        tap: String,
        #[source]
        source: std::io::Error,
    },
}

/// The descriptors of one launch: kept open by hearthd until QEMU has
/// inherited them, then closed (dropped) on hearthd's side.
#[derive(Debug)]
pub struct Handover {
    owned: Vec<OwnedFd>,
    pub numbers: FdNumbers,
}

impl Handover {
    /// Every descriptor number QEMU must inherit.
    pub fn inherited(&self) -> Vec<RawFd> {
        self.owned.iter().map(|f| f.as_raw_fd()).collect()
    }

    /// Opens everything `spec` names for QEMU. Layers are opened in the mode
    /// QEMU opens their node with (the top read-write unless the disk is
    /// read-only, backing layers read-only); the serial log is created or
    /// truncated (mode 0600); the sockets are bound and listening, a stale
    /// socket file removed first (one that still accepts a connection
    /// belongs to a running VM: `SocketInUse`).
    pub fn open(spec: &LaunchSpec) -> Result<Handover, HandoverError> {
        let mut owned = Vec::new();
        let mut keep = |fd: OwnedFd| {
            let n = fd.as_raw_fd();
            owned.push(fd);
            n
        };
        let mut numbers = FdNumbers::default();
        for (index, disk) in spec.disks.iter().enumerate() {
            // Checked on the descriptors themselves: what QEMU gets is what
            // was checked (crate::chain).
            let layers = crate::chain::open_disk(disk)
                .map_err(|source| HandoverError::Layer { index, source })?;
            numbers
                .disk_layers
                .push(layers.into_iter().map(&mut keep).collect());
        }
        if let Some(seed) = &spec.seed {
            numbers.seed = Some(keep(open_file("cloud-init seed", seed, false)?));
        }
        if let Firmware::Uefi(ovmf) = &spec.firmware {
            numbers.ovmf_vars = Some(keep(open_file("UEFI variables file", &ovmf.vars, true)?));
        }
        let log = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&spec.serial_log)
            .map_err(|source| HandoverError::Open {
                what: "serial log".into(),
                path: spec.serial_log.clone(),
                source,
            })?;
        numbers.serial_log = keep(log.into());
        numbers.qmp = keep(listen(&spec.qmp_socket)?);
        if let Some(agent) = &spec.agent_socket {
            numbers.agent = Some(keep(listen(agent)?));
        }
        if let Some(serial) = &spec.serial_socket {
            numbers.serial_socket = Some(keep(listen(serial)?));
        }
        for nic in &spec.nics {
            let tap = keep(open_tap(&nic.tap)?);
            let vhost = if nic.vhost {
                Some(keep(open_file(
                    "vhost-net device",
                    Path::new("/dev/vhost-net"),
                    true,
                )?))
            } else {
                None
            };
            numbers.nics.push(NicFds { tap, vhost });
        }
        Ok(Handover { owned, numbers })
    }
}

fn open_file(what: &str, path: &Path, writable: bool) -> Result<OwnedFd, HandoverError> {
    OpenOptions::new()
        .read(true)
        .write(writable)
        .open(path)
        .map(OwnedFd::from)
        .map_err(|source| HandoverError::Open {
            what: what.to_owned(),
            path: path.to_owned(),
            source,
        })
}

/// Removes a leftover socket file (only if nobody accepts on it) and
/// listens on a fresh one.
fn listen(path: &Path) -> Result<OwnedFd, HandoverError> {
    use std::os::unix::fs::FileTypeExt;
    if let Ok(meta) = std::fs::symlink_metadata(path)
        && meta.file_type().is_socket()
    {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(HandoverError::SocketInUse {
                path: path.to_owned(),
            });
        }
        let _ = std::fs::remove_file(path);
    }
    let listener = UnixListener::bind(path).map_err(|source| HandoverError::Open {
        what: "socket".into(),
        path: path.to_owned(),
        source,
    })?;
    Ok(listener.into())
}

// <linux/if_tun.h>
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Attaches to the persistent tap `name` (made by hearthd beforehand) with
/// the flags QEMU's own `tap_open` uses (`IFF_TAP | IFF_NO_PI`, plus
/// `IFF_VNET_HDR`, which virtio-net uses for offloads; `IFF_ONE_QUEUE` is a
/// no-op since Linux 3.8 and QEMU no longer sets it). The tap is owned by
/// root, so only root can attach: QEMU needs no CAP_NET_ADMIN and no
/// TUNSETOWNER.
pub fn open_tap(name: &str) -> Result<OwnedFd, HandoverError> {
    let err = |source| HandoverError::Tap {
        tap: name.to_owned(),
        source,
    };
    tun_attach(name).map_err(err)
}

/// Opens `/dev/net/tun` and attaches it to tap `name` (`TUNSETIFF` with
/// `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`; the kernel makes the tap if it does
/// not exist). `name` must be shorter than `IFNAMSIZ`. The one place hearth
/// speaks the tun ioctl: the network side makes its persistent taps with it.
pub fn tun_attach(name: &str) -> std::io::Result<OwnedFd> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?;
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: the fd is an open /dev/net/tun descriptor owned by `file`, and
    // the argument points to a live, correctly laid out ifreq.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req as *mut IfReq) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file.into())
}

/// Runs in the forked child right before `exec` (async-signal-safe calls
/// only): lets exactly `inherit` survive the exec, then drops to `user`
/// with `groups` as the only supplementary groups. Setting all three uids
/// to a non-zero one clears every capability.
pub(crate) fn child_setup(
    inherit: &[RawFd],
    user: Option<(u32, u32, &[u32])>,
) -> std::io::Result<()> {
    for &fd in inherit {
        // SAFETY: plain fcntl on a descriptor number; no memory involved.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    if let Some((uid, gid, groups)) = user {
        // SAFETY: `groups` is a live slice whose length is passed.
        if unsafe { libc::setgroups(groups.len(), groups.as_ptr()) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: plain syscalls with integer arguments.
        if unsafe { libc::setresgid(gid, gid, gid) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: as above.
        if unsafe { libc::setresuid(uid, uid, uid) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_resolves_to_uid_zero_and_a_missing_user_names_the_command_to_create_it() {
        let root = QemuUser::lookup("root").expect("root exists");
        assert!(root.is_root());
        assert_eq!(root.gid, 0);
        let err = QemuUser::lookup("hearth-no-such-user").expect_err("missing");
        let text = err.to_string();
        assert!(
            text.contains("\"hearth-no-such-user\": no such user"),
            "{text}"
        );
        assert!(
            text.contains("useradd --system --user-group --no-create-home --shell /usr/sbin/nologin hearth-no-such-user"),
            "{text}"
        );
        assert!(matches!(
            QemuUser::lookup("a\0b"),
            Err(UserError::NoSuchUser { .. })
        ));
    }

    #[test]
    fn only_kvm_and_only_with_kvm() {
        let user = QemuUser {
            name: "q".into(),
            uid: 1000,
            gid: 1000,
            kvm_gid: Some(u32::MAX - 1),
        };
        assert!(user.groups_for(Accel::Tcg).is_empty());
        // /dev/kvm (if any) does not belong to this made-up group.
        assert!(user.groups_for(Accel::Kvm).is_empty());
        let no_kvm_group = QemuUser {
            kvm_gid: None,
            ..user
        };
        assert!(no_kvm_group.groups_for(Accel::Kvm).is_empty());
    }

    #[test]
    fn a_live_socket_is_never_taken_over_and_a_stale_one_is_replaced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qmp.sock");
        let first = listen(&path).expect("listen");
        assert!(matches!(
            listen(&path),
            Err(HandoverError::SocketInUse { .. })
        ));
        drop(first);
        // The file is left behind, nobody listens: it is replaced.
        assert!(path.exists());
        let _second = listen(&path).expect("stale socket replaced");
        assert!(std::os::unix::net::UnixStream::connect(&path).is_ok());
    }
}
