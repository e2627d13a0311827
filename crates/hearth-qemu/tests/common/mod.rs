//! Helpers shared by the integration tests that run real programs.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use hearth_qemu::tools::find_binary;

/// The real QEMU. A missing binary fails the test with the install command: these
/// tests prove the driver works against real QEMU, so skipping would hide that.
pub fn qemu() -> PathBuf {
    match find_binary("qemu-system-x86_64") {
        Ok(path) => path,
        Err(e) => panic!("{e}"),
    }
}

/// `major.minor.micro` as the QEMU binary itself reports it (`--version`),
/// so tests compare with the installed QEMU instead of naming a release.
pub fn qemu_version_of(binary: &Path) -> (u64, u64, u64) {
    let out = std::process::Command::new(binary)
        .arg("--version")
        .output()
        .expect("run qemu --version");
    let text = String::from_utf8_lossy(&out.stdout);
    parse_qemu_version(&text).unwrap_or_else(|| panic!("no version in {text:?}"))
}

/// The first `N.N.N` after "version" in `QEMU emulator version 9.2.1 (...)`.
pub fn parse_qemu_version(text: &str) -> Option<(u64, u64, u64)> {
    let after = &text[text.find("version")? + "version".len()..];
    let word = after.split_whitespace().next()?;
    let mut parts = word.split('.').map(|p| p.parse::<u64>().ok());
    Some((
        parts.next()??,
        parts.next()??,
        parts.next().flatten().unwrap_or(0),
    ))
}

pub fn qemu_img() -> PathBuf {
    match find_binary("qemu-img") {
        Ok(path) => path,
        Err(e) => panic!("{e}"),
    }
}

/// Writes a tiny multiboot kernel that prints "hearth\n" on COM1 and halts forever,
/// so QEMU keeps running without needing a real guest.
pub fn write_halting_kernel(path: &Path) {
    const MAGIC: u32 = 0x1BAD_B002;
    // Bit 16: load addresses are given in the header (no ELF parsing needed).
    const FLAGS: u32 = 0x0001_0000;
    const BASE: u32 = 0x0010_0000;
    let checksum = 0u32.wrapping_sub(MAGIC.wrapping_add(FLAGS));
    let header = [MAGIC, FLAGS, checksum, BASE, BASE, 0, 0, BASE + 32];
    let mut image: Vec<u8> = header.iter().flat_map(|w| w.to_le_bytes()).collect();
    image.extend_from_slice(&[0x66, 0xBA, 0xF8, 0x03]); // mov dx, 0x3f8
    for byte in b"hearth\n" {
        image.extend_from_slice(&[0xB0, *byte, 0xEE]); // mov al, byte; out dx, al
    }
    image.extend_from_slice(&[0xFA, 0xF4, 0xEB, 0xFD]); // cli; hlt; jmp hlt
    std::fs::write(path, image).expect("write kernel");
}

/// `/proc/<pid>/stat` field 5, the process group.
pub fn process_group_of(pid: u32) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 1..];
    rest.split_whitespace().nth(2)?.parse().ok()
}
