//! What an image file is, read from its first bytes by hearth itself, before
//! `qemu-img` ever opens it.
//!
//! `qemu-img info` without `-f` probes the format and then opens the file with
//! the driver it picked, and several drivers open other files named inside
//! the image: a qcow2 backing file or external data file, a VMDK descriptor's
//! extents, a qcow (v1) backing file, a QED backing file. An image from the
//! network could so make hearth (and later QEMU) read any host file. So the
//! header is checked here first, with the same magic numbers QEMU's probes
//! use (they all look at the first 2048 bytes only; the DMG probe looks at
//! the file name, which hearth chooses), and only a qcow2 without references
//! or a raw disk image ever reaches `qemu-img`.
//!
//! Pure functions on byte slices: tested with headers built by hand.

use std::fmt;

/// How many leading bytes [`sniff`] wants: QEMU's probes read 2048, the
/// raw disk signatures reach up to btrfs's superblock at 64 KiB + 64.
pub const HEAD_BYTES: usize = 128 * 1024;

const QCOW_MAGIC: &[u8; 4] = b"QFI\xfb";

/// The qcow2 header fields the safety checks read (docs/interop/qcow2.txt
/// in QEMU's tree). All numbers are big-endian in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Qcow2Header {
    pub version: u32,
    pub backing_file_offset: u64,
    pub backing_file_size: u32,
    pub cluster_bits: u32,
    /// The virtual disk size.
    pub size: u64,
    pub crypt_method: u32,
    pub incompatible_features: u64,
    pub autoclear_features: u64,
    pub header_length: u32,
    /// Types of the header extensions, in file order.
    pub extensions: Vec<u32>,
}

pub const INCOMPAT_DIRTY: u64 = 1 << 0;
pub const INCOMPAT_CORRUPT: u64 = 1 << 1;
pub const INCOMPAT_DATA_FILE: u64 = 1 << 2;
pub const INCOMPAT_COMPRESSION: u64 = 1 << 3;
pub const INCOMPAT_EXTL2: u64 = 1 << 4;
const INCOMPAT_KNOWN: u64 =
    INCOMPAT_DIRTY | INCOMPAT_CORRUPT | INCOMPAT_DATA_FILE | INCOMPAT_COMPRESSION | INCOMPAT_EXTL2;
/// Autoclear bit 1: the external data file is a raw image.
pub const AUTOCLEAR_DATA_FILE_RAW: u64 = 1 << 1;

pub const EXT_END: u32 = 0;
pub const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
pub const EXT_DATA_FILE: u32 = 0x4441_5441;

/// Why a qcow2 image is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Qcow2Refusal {
    #[error(
        "it names a backing file ({size} bytes at offset {offset}): an image must be self-contained, and its backing file would be opened from this host"
    )]
    BackingFile { offset: u64, size: u32 },
    #[error(
        "it keeps its data in an external data file: an image must be self-contained, and that file would be opened from this host"
    )]
    ExternalDataFile,
    #[error("it is encrypted (crypt_method {0}); import the decrypted image")]
    Encrypted(u32),
    #[error("its header marks it corrupt; repair it with `qemu-img check -r all` first")]
    Corrupt,
    #[error(
        "its header marks it dirty (lazy refcounts not written back); repair it with `qemu-img check -r all` first"
    )]
    Dirty,
    #[error("it uses incompatible features unknown to this version (bits {0:#x})")]
    UnknownFeatures(u64),
    #[error("qcow2 version {0} is not 2 or 3")]
    Version(u32),
    #[error("its header is malformed: {0}")]
    Malformed(String),
}

impl Qcow2Refusal {
    /// The status reason: a reference to another file is unsafe; the rest
    /// are images that cannot be used as they are.
    pub fn reason(&self) -> &'static str {
        match self {
            Qcow2Refusal::BackingFile { .. } | Qcow2Refusal::ExternalDataFile => "UnsafeImage",
            Qcow2Refusal::Corrupt | Qcow2Refusal::Dirty | Qcow2Refusal::Malformed(_) => {
                "CorruptImage"
            }
            Qcow2Refusal::Encrypted(_)
            | Qcow2Refusal::UnknownFeatures(_)
            | Qcow2Refusal::Version(_) => "UnsupportedFormat",
        }
    }
}

fn be32(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4)
        .map(|s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
}

fn be64(b: &[u8], at: usize) -> Option<u64> {
    b.get(at..at + 8).map(|s| {
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        u64::from_be_bytes(a)
    })
}

impl Qcow2Header {
    /// Parses the header (and the header extensions' types) from the first
    /// bytes of a file that starts with the qcow magic.
    pub fn parse(head: &[u8]) -> Result<Qcow2Header, Qcow2Refusal> {
        let short = || Qcow2Refusal::Malformed("the file ends inside the header".into());
        if head.get(..4) != Some(QCOW_MAGIC.as_slice()) {
            return Err(Qcow2Refusal::Malformed("no qcow2 magic".into()));
        }
        let version = be32(head, 4).ok_or_else(short)?;
        if !(2..=3).contains(&version) {
            return Err(Qcow2Refusal::Version(version));
        }
        let (incompatible_features, autoclear_features, header_length) = if version >= 3 {
            let len = be32(head, 100).ok_or_else(short)?;
            if len < 104 || len % 8 != 0 {
                return Err(Qcow2Refusal::Malformed(format!(
                    "header_length {len} is not a multiple of 8 of at least 104"
                )));
            }
            (
                be64(head, 72).ok_or_else(short)?,
                be64(head, 88).ok_or_else(short)?,
                len,
            )
        } else {
            (0, 0, 72)
        };
        let cluster_bits = be32(head, 20).ok_or_else(short)?;
        if !(9..=21).contains(&cluster_bits) {
            return Err(Qcow2Refusal::Malformed(format!(
                "cluster_bits {cluster_bits} is outside 9..=21"
            )));
        }
        let mut header = Qcow2Header {
            version,
            backing_file_offset: be64(head, 8).ok_or_else(short)?,
            backing_file_size: be32(head, 16).ok_or_else(short)?,
            cluster_bits,
            size: be64(head, 24).ok_or_else(short)?,
            crypt_method: be32(head, 32).ok_or_else(short)?,
            incompatible_features,
            autoclear_features,
            header_length,
            extensions: Vec::new(),
        };
        // Header extensions follow the header, inside the first cluster;
        // the list must end within what was read.
        let cluster = 1usize << cluster_bits;
        let area_end = cluster.min(head.len());
        let mut at = header_length as usize;
        loop {
            let (Some(kind), Some(len)) = (be32(head, at), be32(head, at + 4)) else {
                return Err(Qcow2Refusal::Malformed(
                    "the header extensions do not end within the first cluster".into(),
                ));
            };
            if kind == EXT_END {
                break;
            }
            header.extensions.push(kind);
            let padded = (len as usize).div_ceil(8) * 8;
            at = at
                .checked_add(8 + padded)
                .filter(|&e| e <= area_end)
                .ok_or_else(|| {
                    Qcow2Refusal::Malformed(format!(
                        "header extension {kind:#010x} runs past the first cluster"
                    ))
                })?;
        }
        Ok(header)
    }

    /// The backing file name the header names, as bytes (`None`: it names
    /// none). The name must lie inside `head`, the bytes the header was
    /// parsed from.
    pub fn backing_file_name<'a>(&self, head: &'a [u8]) -> Result<Option<&'a [u8]>, Qcow2Refusal> {
        if self.backing_file_offset == 0 && self.backing_file_size == 0 {
            return Ok(None);
        }
        usize::try_from(self.backing_file_offset)
            .ok()
            .and_then(|start| head.get(start..start.checked_add(self.backing_file_size as usize)?))
            .map(Some)
            .ok_or_else(|| {
                Qcow2Refusal::Malformed(format!(
                    "the backing file name ({} bytes at offset {}) lies outside the first {} bytes",
                    self.backing_file_size,
                    self.backing_file_offset,
                    head.len()
                ))
            })
    }

    /// Whether the guest data is in an external data file (the bit, the
    /// raw-data-file autoclear bit, or the file name extension).
    pub fn names_data_file(&self) -> bool {
        self.incompatible_features & INCOMPAT_DATA_FILE != 0
            || self.autoclear_features & AUTOCLEAR_DATA_FILE_RAW != 0
            || self.extensions.contains(&EXT_DATA_FILE)
    }

    /// The checks that make an image safe to open: no reference to any other
    /// file, nothing qemu-img would have to repair or decrypt.
    pub fn check(&self) -> Result<(), Qcow2Refusal> {
        if self.backing_file_offset != 0 || self.backing_file_size != 0 {
            return Err(Qcow2Refusal::BackingFile {
                offset: self.backing_file_offset,
                size: self.backing_file_size,
            });
        }
        if self.names_data_file() {
            return Err(Qcow2Refusal::ExternalDataFile);
        }
        let unknown = self.incompatible_features & !INCOMPAT_KNOWN;
        if unknown != 0 {
            return Err(Qcow2Refusal::UnknownFeatures(unknown));
        }
        if self.incompatible_features & INCOMPAT_CORRUPT != 0 {
            return Err(Qcow2Refusal::Corrupt);
        }
        if self.incompatible_features & INCOMPAT_DIRTY != 0 {
            return Err(Qcow2Refusal::Dirty);
        }
        if self.crypt_method != 0 {
            return Err(Qcow2Refusal::Encrypted(self.crypt_method));
        }
        Ok(())
    }
}

/// A signature that makes a raw file look like a disk or filesystem image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawSignature {
    /// A DOS partition table or boot sector (also FAT): 0x55 0xAA at 510.
    Mbr,
    /// A GPT header, "EFI PART" at 512.
    Gpt,
    /// An ISO 9660 filesystem (a CD image): "CD001" at 32769.
    Iso9660,
    /// An ext2/3/4 filesystem: 0xEF53 at 1080.
    Ext,
    Xfs,
    Btrfs,
    Squashfs,
}

impl fmt::Display for RawSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RawSignature::Mbr => "an MBR partition table or boot sector",
            RawSignature::Gpt => "a GPT partition table",
            RawSignature::Iso9660 => "an ISO 9660 filesystem",
            RawSignature::Ext => "an ext2/3/4 filesystem",
            RawSignature::Xfs => "an XFS filesystem",
            RawSignature::Btrfs => "a btrfs filesystem",
            RawSignature::Squashfs => "a squashfs filesystem",
        })
    }
}

/// What the first bytes of a file say it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sniffed {
    Qcow2(Qcow2Header),
    /// No image format's magic: a raw image, with the disk signature found,
    /// if any.
    Raw(Option<RawSignature>),
    /// A format QEMU would probe that hearth does not accept (it may name
    /// other files, or needs a driver hearth does not vet).
    Other(&'static str),
}

/// The image format QEMU's probes would pick for a file starting with
/// `head`, checked the same way (first 2048 bytes), without opening
/// anything. The caller passes at least [`HEAD_BYTES`] when the file is
/// that long.
pub fn sniff(head: &[u8]) -> Result<Sniffed, Qcow2Refusal> {
    let probe = &head[..head.len().min(2048)];
    let at = |off: usize, magic: &[u8]| probe.get(off..off + magic.len()) == Some(magic);
    if at(0, QCOW_MAGIC) {
        return match be32(probe, 4) {
            Some(1) => Ok(Sniffed::Other("qcow")),
            _ => Qcow2Header::parse(head).map(Sniffed::Qcow2),
        };
    }
    let other = [
        (0, b"QED\0".as_slice(), "qed"),
        (0, b"KDMV", "vmdk"),
        (0, b"COWD", "vmdk"),
        (0, b"vhdxfile", "vhdx"),
        (0, b"conectix", "vpc"),
        (0, b"LUKS\xba\xbe", "luks"),
        (0, b"WithoutFreeSpace", "parallels"),
        (0, b"WithouFreSpacExt", "parallels"),
        (0, b"Bochs Virtual HD Image", "bochs"),
        (0, b"#!/bin/sh\n#V2.0 Format\n", "cloop"),
        (64, &0xbeda_107fu32.to_le_bytes(), "vdi"),
    ];
    for (off, magic, name) in other {
        if at(off, magic) {
            return Ok(Sniffed::Other(name));
        }
    }
    if is_vmdk_descriptor(probe) {
        return Ok(Sniffed::Other("vmdk"));
    }
    Ok(Sniffed::Raw(raw_signature(head)))
}

/// A VMDK text descriptor, as QEMU's probe sees one (comment and blank lines,
/// then `version=N`), or anything that reads like one.
fn is_vmdk_descriptor(probe: &[u8]) -> bool {
    let text = String::from_utf8_lossy(probe);
    if text.contains("# Disk DescriptorFile") || text.contains("createType=") {
        return true;
    }
    for line in text.split('\n') {
        let line = line.trim_end_matches('\r');
        if line.starts_with('#') || line.trim_matches(' ').is_empty() {
            continue;
        }
        return line.starts_with("version=");
    }
    false
}

/// The disk or filesystem signature in the first bytes of a raw file.
pub fn raw_signature(head: &[u8]) -> Option<RawSignature> {
    let at = |off: usize, magic: &[u8]| head.get(off..off + magic.len()) == Some(magic);
    if at(512, b"EFI PART") {
        Some(RawSignature::Gpt)
    } else if at(32769, b"CD001") {
        Some(RawSignature::Iso9660)
    } else if at(1080, &[0x53, 0xef]) {
        Some(RawSignature::Ext)
    } else if at(0, b"XFSB") {
        Some(RawSignature::Xfs)
    } else if at(0x10040, b"_BHRfS_M") {
        Some(RawSignature::Btrfs)
    } else if at(0, b"hsqs") {
        Some(RawSignature::Squashfs)
    } else if at(510, &[0x55, 0xaa]) {
        Some(RawSignature::Mbr)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version 3 qcow2 header as `qemu-img create` writes it, 64 KiB
    /// clusters, followed by an empty extension list.
    fn header_v3() -> Vec<u8> {
        let mut h = vec![0u8; 4096];
        h[..4].copy_from_slice(QCOW_MAGIC);
        h[4..8].copy_from_slice(&3u32.to_be_bytes());
        h[20..24].copy_from_slice(&16u32.to_be_bytes());
        h[24..32].copy_from_slice(&(1u64 << 30).to_be_bytes());
        h[96..100].copy_from_slice(&4u32.to_be_bytes());
        h[100..104].copy_from_slice(&112u32.to_be_bytes());
        h
    }

    fn set64(h: &mut [u8], at: usize, v: u64) {
        h[at..at + 8].copy_from_slice(&v.to_be_bytes());
    }

    fn add_extension(h: &mut [u8], at: usize, kind: u32, data: &[u8]) -> usize {
        h[at..at + 4].copy_from_slice(&kind.to_be_bytes());
        h[at + 4..at + 8].copy_from_slice(&(data.len() as u32).to_be_bytes());
        h[at + 8..at + 8 + data.len()].copy_from_slice(data);
        at + 8 + data.len().div_ceil(8) * 8
    }

    fn refusal(h: &[u8]) -> Qcow2Refusal {
        match sniff(h) {
            Ok(Sniffed::Qcow2(q)) => q.check().expect_err("refused"),
            Ok(other) => panic!("sniffed as {other:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn a_plain_qcow2_header_passes() {
        let h = header_v3();
        let Ok(Sniffed::Qcow2(q)) = sniff(&h) else {
            panic!("not qcow2")
        };
        assert_eq!(q.size, 1 << 30);
        assert_eq!(q.version, 3);
        assert!(q.extensions.is_empty());
        assert_eq!(q.check(), Ok(()));
    }

    #[test]
    fn a_backing_file_is_refused_as_unsafe() {
        let mut h = header_v3();
        set64(&mut h, 8, 512);
        h[16..20].copy_from_slice(&11u32.to_be_bytes());
        h[512..523].copy_from_slice(b"/etc/shadow");
        let r = refusal(&h);
        assert_eq!(
            r,
            Qcow2Refusal::BackingFile {
                offset: 512,
                size: 11
            }
        );
        assert_eq!(r.reason(), "UnsafeImage");
        // Only the size set: still a reference.
        let mut h = header_v3();
        h[16..20].copy_from_slice(&1u32.to_be_bytes());
        assert!(matches!(refusal(&h), Qcow2Refusal::BackingFile { .. }));
    }

    #[test]
    fn the_backing_file_name_is_read_from_the_header_and_must_lie_inside_it() {
        let mut h = header_v3();
        let q = Qcow2Header::parse(&h).expect("parse");
        assert_eq!(q.backing_file_name(&h), Ok(None));
        set64(&mut h, 8, 512);
        h[16..20].copy_from_slice(&11u32.to_be_bytes());
        h[512..523].copy_from_slice(b"/dev/sda123");
        let q = Qcow2Header::parse(&h).expect("parse");
        assert_eq!(q.backing_file_name(&h), Ok(Some(b"/dev/sda123".as_slice())));
        // Past the bytes read, or an offset that does not fit: malformed.
        set64(&mut h, 8, 4090);
        let q = Qcow2Header::parse(&h).expect("parse");
        assert!(matches!(
            q.backing_file_name(&h),
            Err(Qcow2Refusal::Malformed(_))
        ));
        set64(&mut h, 8, u64::MAX);
        let q = Qcow2Header::parse(&h).expect("parse");
        assert!(matches!(
            q.backing_file_name(&h),
            Err(Qcow2Refusal::Malformed(_))
        ));
    }

    #[test]
    fn an_external_data_file_is_refused_by_the_bit_or_by_the_extension() {
        let mut h = header_v3();
        set64(&mut h, 72, INCOMPAT_DATA_FILE);
        assert_eq!(refusal(&h), Qcow2Refusal::ExternalDataFile);
        assert_eq!(refusal(&h).reason(), "UnsafeImage");
        // The name extension without the bit (qemu would ignore it; hearth
        // does not guess).
        let mut h = header_v3();
        add_extension(&mut h, 112, EXT_DATA_FILE, b"/dev/sda");
        assert_eq!(refusal(&h), Qcow2Refusal::ExternalDataFile);
        let mut h = header_v3();
        set64(&mut h, 88, AUTOCLEAR_DATA_FILE_RAW);
        assert_eq!(refusal(&h), Qcow2Refusal::ExternalDataFile);
    }

    #[test]
    fn other_extensions_are_read_past() {
        let mut h = header_v3();
        let next = add_extension(&mut h, 112, EXT_BACKING_FORMAT, b"raw");
        add_extension(&mut h, next, 0x6803_f857, &[0u8; 48]);
        let Ok(Sniffed::Qcow2(q)) = sniff(&h) else {
            panic!("not qcow2")
        };
        assert_eq!(q.extensions, vec![EXT_BACKING_FORMAT, 0x6803_f857]);
        assert_eq!(q.check(), Ok(()));
    }

    #[test]
    fn corrupt_dirty_encrypted_and_unknown_features_are_refused() {
        for (bits, want) in [
            (INCOMPAT_CORRUPT, Qcow2Refusal::Corrupt),
            (INCOMPAT_DIRTY, Qcow2Refusal::Dirty),
            (1 << 9, Qcow2Refusal::UnknownFeatures(1 << 9)),
        ] {
            let mut h = header_v3();
            set64(&mut h, 72, bits);
            assert_eq!(refusal(&h), want);
        }
        let mut h = header_v3();
        h[32..36].copy_from_slice(&2u32.to_be_bytes());
        assert_eq!(refusal(&h), Qcow2Refusal::Encrypted(2));
        // Compression type and extended L2 are features qemu reads itself.
        let mut h = header_v3();
        set64(&mut h, 72, INCOMPAT_COMPRESSION | INCOMPAT_EXTL2);
        let Ok(Sniffed::Qcow2(q)) = sniff(&h) else {
            panic!("not qcow2")
        };
        assert_eq!(q.check(), Ok(()));
    }

    #[test]
    fn malformed_headers_are_errors_not_panics() {
        let h = header_v3();
        for len in [4, 8, 30, 100, 110] {
            assert!(
                matches!(sniff(&h[..len]), Err(Qcow2Refusal::Malformed(_))),
                "{len}"
            );
        }
        // An extension list that never ends within the bytes read.
        let mut h = header_v3();
        h[112..116].copy_from_slice(&7u32.to_be_bytes());
        h[116..120].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(sniff(&h), Err(Qcow2Refusal::Malformed(_))));
        let mut h = header_v3();
        h[100..104].copy_from_slice(&13u32.to_be_bytes());
        assert!(matches!(sniff(&h), Err(Qcow2Refusal::Malformed(_))));
        let mut h = header_v3();
        h[4..8].copy_from_slice(&9u32.to_be_bytes());
        assert_eq!(sniff(&h), Err(Qcow2Refusal::Version(9)));
    }

    #[test]
    fn a_version_2_header_has_no_feature_fields() {
        let mut h = header_v3();
        h[4..8].copy_from_slice(&2u32.to_be_bytes());
        // Bytes 72.. are extensions in v2; end the list there.
        h[72..112].fill(0);
        let Ok(Sniffed::Qcow2(q)) = sniff(&h) else {
            panic!("not qcow2")
        };
        assert_eq!((q.header_length, q.incompatible_features), (72, 0));
        assert_eq!(q.check(), Ok(()));
    }

    #[test]
    fn formats_that_can_name_other_files_are_recognised_by_their_magic() {
        let mut qcow1 = header_v3();
        qcow1[4..8].copy_from_slice(&1u32.to_be_bytes());
        let mut vdi = vec![0u8; 512];
        vdi[64..68].copy_from_slice(&0xbeda_107fu32.to_le_bytes());
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (qcow1, "qcow"),
            (b"QED\0rest".to_vec(), "qed"),
            (b"KDMV\x01\0\0\0".to_vec(), "vmdk"),
            (
                b"# Disk DescriptorFile\nversion=1\nRW 100 FLAT \"/etc/shadow\" 0\n".to_vec(),
                "vmdk",
            ),
            (b"# just a comment\n\nversion=2\n".to_vec(), "vmdk"),
            (b"vhdxfile....".to_vec(), "vhdx"),
            (b"conectix....".to_vec(), "vpc"),
            (b"LUKS\xba\xbe\0\x01".to_vec(), "luks"),
            (vdi, "vdi"),
        ];
        for (bytes, want) in cases {
            assert_eq!(sniff(&bytes), Ok(Sniffed::Other(want)), "{want}");
        }
    }

    #[test]
    fn raw_files_are_told_apart_by_disk_signatures() {
        let mut mbr = vec![0u8; 4096];
        mbr[510] = 0x55;
        mbr[511] = 0xaa;
        assert_eq!(sniff(&mbr), Ok(Sniffed::Raw(Some(RawSignature::Mbr))));
        let mut gpt = mbr.clone();
        gpt[512..520].copy_from_slice(b"EFI PART");
        assert_eq!(raw_signature(&gpt), Some(RawSignature::Gpt));
        let mut iso = vec![0u8; 40_000];
        iso[32769..32774].copy_from_slice(b"CD001");
        assert_eq!(raw_signature(&iso), Some(RawSignature::Iso9660));
        let mut ext = vec![0u8; 4096];
        ext[1080] = 0x53;
        ext[1081] = 0xef;
        assert_eq!(raw_signature(&ext), Some(RawSignature::Ext));
        let text = b"#!/bin/sh\necho this is not a disk\n".repeat(100);
        assert_eq!(sniff(&text), Ok(Sniffed::Raw(None)));
        assert_eq!(sniff(&[]), Ok(Sniffed::Raw(None)));
        assert_eq!(sniff(&vec![0u8; 8192]), Ok(Sniffed::Raw(None)));
    }
}
