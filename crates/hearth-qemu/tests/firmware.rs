//! Booting from disks through real firmware: SeaBIOS and OVMF, started from
//! the argv `build_args` makes, with the disk order as the boot order and the
//! cloud-init seed attached but never booted.
//!
//! The disks are tiny qcow2 images: either blank (nothing to boot) or holding
//! a boot sector that prints a marker on COM1 and halts, so what booted is
//! read from the serial console, where SeaBIOS and OVMF also print.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use hearth_qemu::accel::Accel;
use hearth_qemu::cmdline::{
    DiskAttachment, Firmware, LaunchSpec, Ovmf, SEED_DEVICE_ID, disk_device_id,
};
use hearth_qemu::process::{self, ProcessIdentity, Signal};
use hearth_qemu::qmp::QmpClient;
use serde_json::{Value, json};

const READY: Duration = Duration::from_secs(20);
const T: Duration = Duration::from_secs(10);
/// OVMF under TCG on a busy 2-core machine takes a while to reach its shell.
const OVMF_BOOT: Duration = Duration::from_secs(180);

/// Debian's OVMF build (the `ovmf` package), as hearthd uses by default.
const OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
const OVMF_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";

fn ovmf_files() -> (PathBuf, PathBuf) {
    for f in [OVMF_CODE, OVMF_VARS] {
        assert!(
            Path::new(f).is_file(),
            "{f} is missing: install OVMF with `apt-get install ovmf` (or run .ci/install-deps.sh)"
        );
    }
    (OVMF_CODE.into(), OVMF_VARS.into())
}

/// A BIOS boot sector (real mode, loaded at 0x7c00) that writes `text` to
/// COM1 byte by byte and halts.
fn boot_sector_printing(text: &str) -> [u8; 512] {
    let mut code = vec![0xBA, 0xF8, 0x03]; // mov dx, 0x3f8
    for byte in text.bytes().chain(*b"\r\n") {
        code.extend_from_slice(&[0xB0, byte, 0xEE]); // mov al, byte; out dx, al
    }
    code.extend_from_slice(&[0xFA, 0xF4, 0xEB, 0xFD]); // cli; hlt; jmp hlt
    assert!(code.len() <= 446, "boot code too long");
    let mut sector = [0u8; 512];
    sector[..code.len()].copy_from_slice(&code);
    sector[510] = 0x55;
    sector[511] = 0xAA;
    sector
}

/// A raw image of `size` bytes, starting with `sector` if given.
fn raw_image(path: &Path, sector: Option<&[u8; 512]>, size: u64) {
    let file = std::fs::File::create(path).expect("create raw image");
    file.set_len(size).expect("size raw image");
    if let Some(sector) = sector {
        use std::os::unix::fs::FileExt;
        file.write_all_at(sector, 0).expect("write boot sector");
    }
}

/// A 4 MiB qcow2 disk, bootable (printing `marker`) or blank.
fn qcow2_disk(dir: &Path, name: &str, marker: Option<&str>) -> PathBuf {
    let raw = dir.join(format!("{name}.raw"));
    raw_image(&raw, marker.map(boot_sector_printing).as_ref(), 4 << 20);
    let qcow2 = dir.join(format!("{name}.qcow2"));
    let out = std::process::Command::new(common::qemu_img())
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(&qcow2)
        .output()
        .expect("run qemu-img convert");
    assert!(
        out.status.success(),
        "qemu-img convert: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    qcow2
}

fn disk(index: usize, path: &Path) -> DiskAttachment {
    DiskAttachment {
        node_name: format!("disk{index}"),
        path: path.to_owned(),
        read_only: false,
        serial: format!("disk{index}"),
        backing: vec![],
    }
}

fn firmware_spec(
    dir: &Path,
    name: &str,
    firmware: Firmware,
    disks: &[&Path],
    seed: Option<&Path>,
) -> LaunchSpec {
    LaunchSpec {
        vm_name: name.to_owned(),
        cpus: 1,
        memory_mib: if matches!(firmware, Firmware::Uefi(_)) {
            256
        } else {
            64
        },
        accel: Accel::Tcg,
        firmware,
        kernel: None,
        disks: disks.iter().enumerate().map(|(i, p)| disk(i, p)).collect(),
        seed: seed.map(Path::to_owned),
        nics: vec![],
        agent_socket: None,
        qmp_socket: dir.join(format!("{name}.qmp")),
        serial_log: dir.join(format!("{name}.serial")),
        serial_socket: None,
    }
}

/// Kills the VM even when an assertion fails half-way.
struct Running(Option<ProcessIdentity>);
impl Running {
    async fn kill(mut self) {
        if let Some(id) = self.0.take() {
            let _ = process::signal(&id, Signal::Kill);
            tokio::time::timeout(T, process::wait_for_exit(&id))
                .await
                .expect("QEMU exits after SIGKILL");
        }
    }
}
impl Drop for Running {
    fn drop(&mut self) {
        if let Some(id) = self.0.take() {
            let _ = process::signal(&id, Signal::Kill);
        }
    }
}

async fn start(spec: &LaunchSpec, dir: &Path) -> Running {
    let log = dir.join(format!("{}.qemu.log", spec.vm_name));
    let id = process::launch(&common::qemu(), spec, &log, READY)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "QEMU starts: {e}\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        });
    Running(Some(id))
}

/// The serial console so far, without terminal escapes and carriage returns.
fn console(path: &Path) -> String {
    let raw = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&raw);
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => {
                // ESC [ params letter, or ESC and one character.
                if chars.peek() == Some(&'[') {
                    chars.next();
                    for c in chars.by_ref() {
                        if c.is_ascii_alphabetic() {
                            break;
                        }
                    }
                } else {
                    chars.next();
                }
            }
            '\r' => {}
            c => out.push(c),
        }
    }
    out
}

/// Waits until the console shows `needle`; returns the console then.
async fn wait_for_console(path: &Path, needle: &str, timeout: Duration) -> String {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let text = console(path);
        if text.contains(needle) {
            return text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{needle:?} not on the console after {timeout:?}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn seabios_boots_the_first_disk_of_the_list_and_never_the_seed() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("bios,dir x");
    std::fs::create_dir(&dir).expect("mkdir");
    let a = qcow2_disk(&dir, "a", Some("hearth-boot-a"));
    let b = qcow2_disk(&dir, "b", Some("hearth-boot-b"));
    let blank = qcow2_disk(&dir, "blank", None);
    // A bootable seed: if the firmware ever tried it, it would say so.
    let seed = dir.join("seed,x.img");
    raw_image(
        &seed,
        Some(&boot_sector_printing("hearth-boot-seed")),
        1 << 20,
    );

    for (name, disks, booted, not_booted) in [
        ("order-ab", [&a, &b], "hearth-boot-a", "hearth-boot-b"),
        ("order-ba", [&b, &a], "hearth-boot-b", "hearth-boot-a"),
    ] {
        let spec = firmware_spec(
            &dir,
            name,
            Firmware::Bios,
            &[disks[0].as_path(), disks[1].as_path()],
            Some(&seed),
        );
        let vm = start(&spec, &dir).await;
        let text = wait_for_console(&spec.serial_log, booted, T).await;
        assert!(text.contains("SeaBIOS"), "{text}");
        assert!(text.contains("Booting from Hard Disk"), "{text}");
        vm.kill().await;
        let text = console(&spec.serial_log);
        assert!(!text.contains(not_booted), "{name}: {text}");
        assert!(!text.contains("hearth-boot-seed"), "{name}: {text}");
    }

    // The first disk is not bootable: SeaBIOS gives up rather than trying
    // the second disk or the seed (a BIOS boots drive 0x80 only).
    let spec = firmware_spec(
        &dir,
        "unbootable",
        Firmware::Bios,
        &[&blank, &a],
        Some(&seed),
    );
    let vm = start(&spec, &dir).await;
    let text = wait_for_console(&spec.serial_log, "No bootable device", T).await;
    vm.kill().await;
    assert!(
        text.contains("Boot failed: not a bootable disk"),
        "SeaBIOS tried the first disk: {text}"
    );
    assert!(!text.contains("hearth-boot-"), "{text}");
}

/// The PCI slot of each device id on bus 0, from `query-pci`.
async fn pci_slots(qmp: &QmpClient) -> Vec<(String, u64)> {
    let reply = qmp.execute("query-pci", None, T).await.expect("query-pci");
    reply
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|bus| bus["devices"].as_array().cloned().unwrap_or_default())
        .filter_map(|d| Some((d["qdev_id"].as_str()?.to_owned(), d["slot"].as_u64()?)))
        .filter(|(id, _)| !id.is_empty())
        .collect()
}

/// The PCI slots of the boot options OVMF tried, in the order it tried
/// them: `BdsDxe: failed to load Boot0001 "..." from PciRoot(0x0)/Pci(0x1,0x0): ...`.
fn slots_tried(console: &str) -> Vec<u64> {
    console
        .lines()
        .filter(|l| l.contains("BdsDxe: failed to load Boot"))
        .filter_map(|l| {
            let after = &l[l.find("/Pci(0x")? + "/Pci(0x".len()..];
            u64::from_str_radix(&after[..after.find(',')?], 16).ok()
        })
        .collect()
}

#[tokio::test]
async fn ovmf_tries_each_disk_in_list_order_never_the_seed_and_writes_the_vms_vars() {
    let (code, template) = ovmf_files();
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("uefi,dir \"x\"");
    std::fs::create_dir(&dir).expect("mkdir");
    let first = qcow2_disk(&dir, "first", None);
    let second = qcow2_disk(&dir, "second", None);
    let seed = dir.join("seed,driver=x.img");
    raw_image(&seed, None, 1 << 20);
    // The VM's own copy of the variables store, at a path full of option syntax.
    let vars = dir.join("vars,pflash1=x.fd");
    std::fs::copy(&template, &vars).expect("copy the vars template");

    let spec = firmware_spec(
        &dir,
        "uefi",
        Firmware::Uefi(Ovmf {
            code: code.clone(),
            vars: vars.clone(),
        }),
        &[&first, &second],
        Some(&seed),
    );
    let vm = start(&spec, &dir).await;
    let (qmp, _events) = QmpClient::connect(&spec.qmp_socket, T)
        .await
        .expect("QMP handshake");

    // The flash images are the files given, the code read-only.
    let nodes = qmp
        .execute("query-named-block-nodes", Some(json!({"flat": true})), T)
        .await
        .expect("nodes");
    // The VM's own files came by descriptor: a node names its fd set, and
    // the set is labelled with the file's path.
    let fdsets = hearth_qemu::qmp::fdsets(&qmp, T)
        .await
        .expect("query-fdsets");
    let node = |name: &str| -> (String, bool) {
        let n: &Value = nodes
            .as_array()
            .and_then(|a| a.iter().find(|n| n["node-name"] == name))
            .unwrap_or_else(|| panic!("no node {name}: {nodes:#}"));
        (
            hearth_qemu::qmp::resolve_filename(n["file"].as_str().unwrap_or_default(), &fdsets),
            n["ro"].as_bool().unwrap_or(false),
        )
    };
    assert_eq!(node("ovmf-code"), (code.display().to_string(), true));
    assert_eq!(node("ovmf-vars"), (vars.display().to_string(), false));
    assert_eq!(node("cidata"), (seed.display().to_string(), true));

    // OVMF went through every disk in order and found nothing to boot, so
    // it falls back to its built-in shell.
    let text = wait_for_console(&spec.serial_log, "EFI Internal Shell", OVMF_BOOT).await;
    let slots = pci_slots(&qmp).await;
    let slot_of = |id: &str| -> u64 {
        slots
            .iter()
            .find(|(i, _)| i == id)
            .map(|(_, s)| *s)
            .unwrap_or_else(|| panic!("no device {id} in {slots:?}"))
    };
    assert_eq!(
        slots_tried(&text),
        vec![slot_of(&disk_device_id(0)), slot_of(&disk_device_id(1))],
        "OVMF tried the disks in list order and nothing else (the seed is at slot {}):\n{text}",
        slot_of(SEED_DEVICE_ID)
    );

    qmp.execute("quit", None, T).await.expect("quit");
    let id = vm.0.clone().expect("running");
    tokio::time::timeout(T, process::wait_for_exit(&id))
        .await
        .expect("QEMU exits after quit");
    vm.kill().await;

    // OVMF keeps its boot entries in the VM's variables file, not the template.
    let written = std::fs::read(&vars).expect("read vars");
    let original = std::fs::read(&template).expect("read template");
    assert_eq!(written.len(), original.len());
    assert_ne!(
        written, original,
        "OVMF wrote its variables to the VM's copy"
    );
}
