//! The cloud-init NoCloud seed of a VM: a small FAT filesystem labelled
//! `CIDATA` holding `meta-data`, `user-data` and, when there is one,
//! `network-config`. cloud-init in the guest finds it by its label.
//!
//! What goes into the files ([`SeedFiles::for_vm`]) is pure and tested on its
//! own; [`write_image`] lays them out as FAT on any seekable storage (a file,
//! or memory in the tests); [`write_seed`] puts the image in place atomically.
//! Decisions and reasons: docs/guests.md, "Firmware and cloud-init".

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use hearth_api::{CloudInit, VirtualMachine};
use serde::Serialize;
use sha2::{Digest, Sha256};

/// The volume label cloud-init looks for (`cidata` or `CIDATA`; FAT labels
/// are upper case), padded to FAT's 11 bytes.
pub const VOLUME_LABEL: [u8; 11] = *b"CIDATA     ";

/// The `user-data` of a VM whose `cloudInit` gives none: an empty
/// cloud-config, so cloud-init still applies `meta-data` (hostname, keys).
pub const MINIMAL_USER_DATA: &str = "#cloud-config\n";

/// Size of the seed image when its files fit in [`SMALL_IMAGE_CONTENT`].
pub const SMALL_IMAGE_BYTES: u64 = 1 << 20;
/// The most file content a [`SMALL_IMAGE_BYTES`] image is used for (the rest
/// is FAT overhead and slack).
pub const SMALL_IMAGE_CONTENT: u64 = 768 << 10;
/// Size of the seed image otherwise; the file is sparse, so only what is
/// written takes space on the host. The API's bounds (2 × 256 KiB of text,
/// 64 keys of at most 16 KiB) keep every seed well below it.
pub const LARGE_IMAGE_BYTES: u64 = 8 << 20;
/// The most file content a [`LARGE_IMAGE_BYTES`] image takes.
pub const LARGE_IMAGE_CONTENT: u64 = 6 << 20;

/// The files of one seed, as the guest will read them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeedFiles {
    /// `hearth-<vm>-<16 hex>`: the hex are the start of a SHA-256 over every
    /// file's content apart from this id, so the id changes exactly when
    /// the content does, and cloud-init runs its per-instance modules again.
    pub instance_id: String,
    pub meta_data: String,
    pub user_data: String,
    pub network_config: Option<String>,
}

#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct MetaData<'a> {
    #[serde(skip_serializing_if = "str::is_empty")]
    instance_id: &'a str,
    local_hostname: &'a str,
    /// NoCloud hands these to the image's default user (cloud-init's
    /// `DataSource.get_public_ssh_keys` reads meta-data `public-keys`).
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    public_keys: &'a [String],
}

impl SeedFiles {
    /// The seed `vm` gets, or `None` when it needs none (no `cloudInit`).
    /// A VM that boots from its disks and has networks gets one even
    /// without `cloudInit`: a cloud image then configures its interfaces
    /// from it at once (a kernel-booted guest is taken to bring its own).
    pub fn for_vm(vm: &VirtualMachine) -> Option<SeedFiles> {
        let default = CloudInit::default();
        let ci = match &vm.spec.cloud_init {
            Some(ci) => ci,
            // A kernel from an image boots the image's own system, which
            // has cloud-init as a disk-booted one does.
            None if vm.spec.boot.as_ref().is_none_or(|b| b.kernel.is_none())
                && !vm.spec.networks.is_empty() =>
            {
                &default
            }
            None => return None,
        };
        Some(Self::new(&vm.metadata.name, ci, network_config(vm, ci)))
    }

    /// The seed of VM `vm` from `ci`, with `network_config` as its
    /// `network-config` file.
    pub fn new(vm: &str, ci: &CloudInit, network_config: Option<String>) -> SeedFiles {
        let hostname = ci.hostname.as_deref().unwrap_or(vm);
        let user_data = ci
            .user_data
            .clone()
            .unwrap_or_else(|| MINIMAL_USER_DATA.to_string());
        let meta = |instance_id: &str| {
            let doc = MetaData {
                instance_id,
                local_hostname: hostname,
                public_keys: &ci.ssh_authorized_keys,
            };
            // Only strings and a list of strings, all validated: the
            // serialiser cannot fail on them, and quotes whatever needs it.
            serde_yaml_ng::to_string(&doc).unwrap_or_default()
        };
        // The id is a digest of everything else the guest reads.
        let mut hash = Sha256::new();
        for (name, content) in [
            ("meta-data", Some(meta("").as_str())),
            ("user-data", Some(user_data.as_str())),
            ("network-config", network_config.as_deref()),
        ] {
            hash.update(name.as_bytes());
            match content {
                None => hash.update([0]),
                Some(text) => {
                    hash.update([1]);
                    hash.update((text.len() as u64).to_le_bytes());
                    hash.update(text.as_bytes());
                }
            }
        }
        let digest = hash.finalize();
        let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        let instance_id = format!("hearth-{vm}-{hex}");
        SeedFiles {
            meta_data: meta(&instance_id),
            instance_id,
            user_data,
            network_config,
        }
    }

    /// `(file name, content)` of each file, in the order they are written.
    pub fn files(&self) -> Vec<(&'static str, &[u8])> {
        let mut files = vec![
            ("meta-data", self.meta_data.as_bytes()),
            ("user-data", self.user_data.as_bytes()),
        ];
        if let Some(nc) = &self.network_config {
            files.push(("network-config", nc.as_bytes()));
        }
        files
    }

    fn content_bytes(&self) -> u64 {
        self.files().iter().map(|(_, c)| c.len() as u64).sum()
    }

    /// How large the image is: the smallest of the two sizes that holds
    /// the files with room to spare.
    pub fn image_bytes(&self) -> io::Result<u64> {
        match self.content_bytes() {
            n if n <= SMALL_IMAGE_CONTENT => Ok(SMALL_IMAGE_BYTES),
            n if n <= LARGE_IMAGE_CONTENT => Ok(LARGE_IMAGE_BYTES),
            n => Err(io::Error::other(format!(
                "the seed's files are {n} bytes, more than the {LARGE_IMAGE_CONTENT} a seed holds"
            ))),
        }
    }

    /// FAT's volume serial number: the first bytes of the id's digest, so
    /// the same content gives the same image.
    fn volume_id(&self) -> u32 {
        let hex = self.instance_id.rsplit('-').next().unwrap_or_default();
        u32::from_str_radix(hex.get(..8).unwrap_or_default(), 16).unwrap_or(0)
    }
}

/// The `network-config` the seed of `vm` carries: the one its `cloudInit`
/// gives, as given; else, for a VM with networks, DHCP on each of its
/// interfaces, matched by MAC (so the guest's own names for them do not
/// matter); else none (cloud-init's own fallback).
fn network_config(vm: &VirtualMachine, ci: &CloudInit) -> Option<String> {
    if let Some(given) = &ci.network_config {
        return Some(given.clone());
    }
    if vm.spec.networks.is_empty() {
        return None;
    }
    let mut text = String::from("# hearth: DHCP on every interface\nversion: 2\nethernets:\n");
    for i in 0..vm.spec.networks.len() {
        // Validated MACs: six hex pairs, nothing to quote.
        let mac = crate::network::admission::mac_of(vm, i)
            .map(|m| m.to_string())
            .unwrap_or_default();
        text.push_str(&format!(
            "  nic{i}:\n    match:\n      macaddress: \"{mac}\"\n    dhcp4: true\n"
        ));
    }
    Some(text)
}

/// Formats `storage` (already [`SeedFiles::image_bytes`] long) as FAT
/// labelled `CIDATA` and writes the seed's files into its root directory.
pub fn write_image<S: Read + Write + Seek>(mut storage: S, files: &SeedFiles) -> io::Result<()> {
    fatfs::format_volume(
        &mut storage,
        fatfs::FormatVolumeOptions::new()
            .volume_label(VOLUME_LABEL)
            .volume_id(files.volume_id()),
    )?;
    let fs = fatfs::FileSystem::new(
        &mut storage,
        fatfs::FsOptions::new().time_provider(&DOS_EPOCH),
    )?;
    {
        let root = fs.root_dir();
        for (name, content) in files.files() {
            let mut file = root.create_file(name)?;
            file.truncate()?;
            file.write_all(content)?;
            file.flush()?;
        }
    }
    fs.unmount()
}

/// Every file's time stamps: FAT's first day, 1980-01-01 00:00, so the same
/// content makes the same image (the default would be the invalid day 0).
#[derive(Debug)]
struct DosEpoch;

static DOS_EPOCH: DosEpoch = DosEpoch;

impl fatfs::TimeProvider for DosEpoch {
    fn get_current_date(&self) -> fatfs::Date {
        fatfs::Date {
            year: 1980,
            month: 1,
            day: 1,
        }
    }
    fn get_current_date_time(&self) -> fatfs::DateTime {
        fatfs::DateTime {
            date: self.get_current_date(),
            time: fatfs::Time {
                hour: 0,
                min: 0,
                sec: 0,
                millis: 0,
            },
        }
    }
}

/// Writes the seed image to `path` atomically: built in a temporary file
/// beside it, synced, then renamed over the old one, so a crash leaves
/// either the old seed or the new one, never half of one. Only called while
/// no QEMU of the VM runs.
pub fn write_seed(path: &Path, files: &SeedFiles) -> io::Result<()> {
    let size = files.image_bytes()?;
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(".tmp");
    let tmp = Path::new(&tmp_name);
    match std::fs::remove_file(tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let result = (|| {
        // The user data may hold secrets: readable by hearthd (and QEMU,
        // which runs as the same user) only.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(tmp)?;
        // Sparse: only the FAT structures and the files take space.
        file.set_len(size)?;
        write_image(&file, files)?;
        file.sync_all()?;
        std::fs::rename(tmp, path)?;
        sync_parent(path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    result
}

/// Removes the seed of a VM that no longer has `cloudInit`.
pub fn remove_seed(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => sync_parent(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn sync_parent(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(dir) => File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn ci() -> CloudInit {
        CloudInit {
            user_data: Some("#cloud-config\nruncmd: [[touch, /etc/hearth-was-here]]\n".into()),
            network_config: Some("version: 2\nethernets: {}\n".into()),
            ssh_authorized_keys: vec![
                "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGk me@laptop".into(),
                "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ #: tricky, comment".into(),
            ],
            hostname: Some("web-1".into()),
        }
    }

    fn seed(vm: &str, ci: &CloudInit) -> SeedFiles {
        SeedFiles::new(vm, ci, ci.network_config.clone())
    }

    /// Builds the image in memory and reads every file back with the same
    /// FAT implementation: (label from the boot sector, label from the root
    /// directory, files by name).
    fn read_back(files: &SeedFiles) -> (String, Option<String>, Vec<(String, String)>) {
        let size = files.image_bytes().expect("fits");
        let mut image = Cursor::new(vec![0u8; size as usize]);
        write_image(&mut image, files).expect("write image");
        image.set_position(0);
        let fs = fatfs::FileSystem::new(image, fatfs::FsOptions::new()).expect("mount");
        let label = fs.volume_label();
        let root_label = fs.read_volume_label_from_root_dir().expect("root label");
        let mut out = Vec::new();
        for entry in fs.root_dir().iter() {
            let entry = entry.expect("dir entry");
            if entry.is_file() {
                let mut text = String::new();
                entry
                    .to_file()
                    .read_to_string(&mut text)
                    .expect("read file");
                out.push((entry.file_name(), text));
            }
        }
        out.sort();
        (label, root_label, out)
    }

    fn vm_from(spec: &str) -> VirtualMachine {
        let doc = format!(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: web}}\nspec:\n  disks: [{{virtualDiskName: root}}]\n{spec}"
        );
        match hearth_api::parse_documents(&doc, "test")
            .expect("valid")
            .remove(0)
        {
            hearth_api::Object::VirtualMachine(vm) => vm,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_vm_with_networks_gets_dhcp_on_every_interface_by_mac_unless_it_gives_its_own() {
        let vm = vm_from(
            "  networks: [{virtualNetworkName: a}, {virtualNetworkName: b, macAddress: \"52:54:00:aa:bb:cc\"}]\n",
        );
        // Booted from its disk, no cloudInit: still a seed, for the network.
        let files = SeedFiles::for_vm(&vm).expect("a seed");
        let nc = files.network_config.as_deref().expect("network-config");
        let parsed: serde_yaml_ng::Value = serde_yaml_ng::from_str(nc).expect("yaml");
        assert_eq!(parsed["version"], 2);
        let derived = crate::network::admission::mac_of(&vm, 0)
            .unwrap()
            .to_string();
        assert_eq!(
            parsed["ethernets"]["nic0"]["match"]["macaddress"].as_str(),
            Some(derived.as_str())
        );
        assert_eq!(parsed["ethernets"]["nic0"]["dhcp4"], true);
        assert_eq!(
            parsed["ethernets"]["nic1"]["match"]["macaddress"].as_str(),
            Some("52:54:00:aa:bb:cc")
        );
        // The user's own network-config wins.
        let mut own = vm.clone();
        own.spec.cloud_init = Some(ci());
        assert_eq!(
            SeedFiles::for_vm(&own).unwrap().network_config.as_deref(),
            Some("version: 2\nethernets: {}\n")
        );
        // No networks: no network-config, and no seed without cloudInit.
        let plain = vm_from("");
        assert!(SeedFiles::for_vm(&plain).is_none());
        let mut with_ci = plain.clone();
        with_ci.spec.cloud_init = Some(CloudInit::default());
        assert!(
            SeedFiles::for_vm(&with_ci)
                .unwrap()
                .network_config
                .is_none()
        );
        // A kernel-booted guest brings its own network setup.
        let mut kernel = vm.clone();
        kernel.spec.boot = Some(hearth_api::Boot {
            kernel: Some("/k".into()),
            kernel_image: None,
            initrd: None,
            cmdline: String::new(),
        });
        assert!(SeedFiles::for_vm(&kernel).is_none());
        // A kernel from an image (or the rootfs's own /boot) keeps it.
        let mut from_image = vm.clone();
        from_image.spec.boot = Some(hearth_api::Boot {
            kernel: None,
            kernel_image: Some("kernel".into()),
            initrd: None,
            cmdline: String::new(),
        });
        assert!(SeedFiles::for_vm(&from_image).is_some());
    }

    #[test]
    fn the_image_is_fat_labelled_cidata_with_the_three_files() {
        let files = seed("web", &ci());
        let (label, root_label, read) = read_back(&files);
        assert_eq!(label, "CIDATA");
        assert_eq!(root_label.as_deref(), Some("CIDATA"));
        let names: Vec<&str> = read.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["meta-data", "network-config", "user-data"]);
        assert_eq!(read[1].1, "version: 2\nethernets: {}\n");
        assert_eq!(
            read[2].1,
            "#cloud-config\nruncmd: [[touch, /etc/hearth-was-here]]\n"
        );
        assert_eq!(read[0].1, files.meta_data);
    }

    #[test]
    fn files_carry_a_valid_fixed_date() {
        let files = seed("web", &ci());
        let mut image = Cursor::new(vec![0u8; files.image_bytes().expect("fits") as usize]);
        write_image(&mut image, &files).expect("write image");
        image.set_position(0);
        let fs = fatfs::FileSystem::new(image, fatfs::FsOptions::new()).expect("mount");
        for entry in fs.root_dir().iter() {
            let entry = entry.expect("entry");
            if entry.is_file() {
                let m = entry.modified();
                assert_eq!((m.date.year, m.date.month, m.date.day), (1980, 1, 1));
            }
        }
    }

    #[test]
    fn meta_data_names_the_instance_the_host_and_the_default_users_keys() {
        let files = seed("web", &ci());
        let meta: serde_json::Value =
            serde_yaml_ng::from_str(&files.meta_data).expect("meta-data is YAML");
        assert_eq!(
            meta,
            serde_json::json!({
                "instance-id": files.instance_id,
                "local-hostname": "web-1",
                "public-keys": [
                    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGk me@laptop",
                    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ #: tricky, comment",
                ],
            })
        );
        let id = files
            .instance_id
            .strip_prefix("hearth-web-")
            .expect("prefix");
        assert_eq!(id.len(), 16);
        assert!(
            id.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
    }

    #[test]
    fn without_user_data_hostname_or_keys_the_seed_is_minimal() {
        let files = seed("db", &CloudInit::default());
        assert_eq!(files.user_data, MINIMAL_USER_DATA);
        assert_eq!(files.network_config, None);
        let meta: serde_json::Value = serde_yaml_ng::from_str(&files.meta_data).expect("YAML");
        assert_eq!(
            meta,
            serde_json::json!({"instance-id": files.instance_id, "local-hostname": "db"})
        );
        let (label, _, read) = read_back(&files);
        assert_eq!(label, "CIDATA");
        let names: Vec<&str> = read.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["meta-data", "user-data"], "no network-config file");
        assert_eq!(read[1].1, "#cloud-config\n");
    }

    #[test]
    fn the_same_spec_gives_the_same_id_and_the_same_image() {
        let a = seed("web", &ci());
        let b = seed("web", &ci());
        assert_eq!(a, b);
        let image = |f: &SeedFiles| {
            let mut c = Cursor::new(vec![0u8; f.image_bytes().expect("fits") as usize]);
            write_image(&mut c, f).expect("write");
            c.into_inner()
        };
        assert_eq!(image(&a), image(&b), "byte for byte");
        // Fixed by the algorithm, not by the build: a guest that already ran
        // must not run its first-boot modules again after a hearth upgrade.
        // (The digest of `meta-data` without the id, `local-hostname:
        // pinned\n`, and `user-data` `#cloud-config\n`, each as name, 1,
        // length as u64 LE, bytes, then `network-config`, 0; checked with
        // Python's hashlib.)
        assert_eq!(
            seed("pinned", &CloudInit::default()).instance_id,
            "hearth-pinned-e4cedf0fb236dfc9"
        );
    }

    #[test]
    fn the_id_changes_with_every_file_and_with_the_vm() {
        let base = seed("web", &ci());
        let mut variants = Vec::new();
        let mut c = ci();
        c.user_data = Some("#cloud-config\nruncmd: [[touch, /x]]\n".into());
        variants.push(("userData", seed("web", &c)));
        let mut c = ci();
        c.user_data = None;
        variants.push(("userData removed", seed("web", &c)));
        let mut c = ci();
        c.network_config = None;
        variants.push(("networkConfig removed", seed("web", &c)));
        let mut c = ci();
        c.network_config = Some(String::new());
        variants.push(("networkConfig empty", seed("web", &c)));
        let mut c = ci();
        c.ssh_authorized_keys.pop();
        variants.push(("a key removed", seed("web", &c)));
        let mut c = ci();
        c.ssh_authorized_keys.reverse();
        variants.push(("keys reordered", seed("web", &c)));
        let mut c = ci();
        c.hostname = Some("web-2".into());
        variants.push(("hostname", seed("web", &c)));
        variants.push(("another VM", seed("web2", &ci())));
        for (what, v) in &variants {
            assert_ne!(v.instance_id, base.instance_id, "{what}");
        }
        // Writing out what was left out gives the same files, and the same id.
        let mut c = ci();
        c.hostname = None;
        let mut named = ci();
        named.hostname = Some("web".into());
        assert_eq!(seed("web", &c), seed("web", &named));
    }

    proptest::proptest! {
        /// The id of two seeds is the same exactly when the files the guest
        /// reads (apart from the id itself) are the same.
        #[test]
        fn the_id_changes_exactly_when_the_content_does(
            ud in proptest::option::of("[a-c\n]{0,4}"),
            nc in proptest::option::of("[a-c]{0,3}"),
            keys in proptest::collection::vec("ssh-ed25519 A[ab]{0,2}", 0..3),
            host in proptest::option::of("[ab]{1,2}"),
            ud2 in proptest::option::of("[a-c\n]{0,4}"),
            nc2 in proptest::option::of("[a-c]{0,3}"),
            keys2 in proptest::collection::vec("ssh-ed25519 A[ab]{0,2}", 0..3),
            host2 in proptest::option::of("[ab]{1,2}"),
        ) {
            let a = CloudInit { user_data: ud, network_config: nc, ssh_authorized_keys: keys, hostname: host };
            let b = CloudInit { user_data: ud2, network_config: nc2, ssh_authorized_keys: keys2, hostname: host2 };
            let (sa, sb) = (seed("vm", &a), seed("vm", &b));
            let without_id = |s: &SeedFiles| {
                (s.meta_data.replace(&s.instance_id, ""), s.user_data.clone(), s.network_config.clone())
            };
            proptest::prop_assert_eq!(
                sa.instance_id == sb.instance_id,
                without_id(&sa) == without_id(&sb)
            );
        }
    }

    #[test]
    fn the_largest_seed_the_api_allows_fits_the_large_image() {
        let big = "x".repeat(hearth_api::MAX_CLOUD_INIT_TEXT - 20);
        let key = format!("ssh-ed25519 {}", "A".repeat((16 << 10) - 20));
        let c = CloudInit {
            user_data: Some(format!("#!/bin/sh\n# {big}\n")),
            network_config: Some(format!("# {big}\nversion: 2\n")),
            ssh_authorized_keys: vec![key; 64],
            hostname: None,
        };
        let files = seed("big", &c);
        assert_eq!(files.image_bytes().expect("fits"), LARGE_IMAGE_BYTES);
        let (label, _, read) = read_back(&files);
        assert_eq!(label, "CIDATA");
        assert_eq!(read[0].1, files.meta_data);
        assert_eq!(read[1].1, files.network_config.clone().expect("nc"));
        assert_eq!(read[2].1, files.user_data);
        // One byte past what an image holds is an error, not a broken image.
        let too_big = SeedFiles {
            user_data: "x".repeat(LARGE_IMAGE_CONTENT as usize + 1),
            ..seed("big", &CloudInit::default())
        };
        assert!(too_big.image_bytes().is_err());
    }

    #[test]
    fn write_seed_replaces_the_file_atomically_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("cidata.img");
        let first = seed("web", &ci());
        write_seed(&path, &first).expect("first write");
        let inode =
            |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).expect("stat"));
        let first_inode = inode(&path);
        let meta = std::fs::metadata(&path).expect("stat");
        assert_eq!(meta.len(), SMALL_IMAGE_BYTES);
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
            0o600
        );
        // A temporary a crash left behind is no obstacle.
        std::fs::write(dir.path().join("cidata.img.tmp"), b"junk").expect("junk");
        let mut c = ci();
        c.user_data = Some("#cloud-config\nhostname: other\n".into());
        let second = seed("web", &c);
        write_seed(&path, &second).expect("second write");
        assert_ne!(inode(&path), first_inode, "a new file renamed into place");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["cidata.img"]);
        let fs = fatfs::FileSystem::new(File::open(&path).expect("open"), fatfs::FsOptions::new())
            .expect("mount");
        let mut text = String::new();
        fs.root_dir()
            .open_file("user-data")
            .expect("user-data")
            .read_to_string(&mut text)
            .expect("read");
        assert_eq!(text, "#cloud-config\nhostname: other\n");
        drop(fs);
        remove_seed(&path).expect("remove");
        assert!(!path.exists());
        remove_seed(&path).expect("removing a missing seed is fine");
    }
}
