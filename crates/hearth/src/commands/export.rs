//! `hearth export snapshot|vmsnapshot`: a snapshot as standalone image files
//! on this side. hearthd converts and streams (it never writes where a client
//! says); this command writes the files, each complete or not at all, and
//! prints their SHA-256.

use std::io::{IsTerminal, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use hearth_api::Kind;
use http_body_util::BodyExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::{object_path, parse_name};
use crate::client::ApiClient;
use crate::output::{human_bytes, str_at};

/// How long hearthd may take to convert a snapshot before it answers.
const CONVERT_WAIT: Duration = Duration::from_secs(6 * 3600);
/// The manifest `hearth export vmsnapshot` writes next to the images.
pub const MANIFEST_NAME: &str = "virtualmachine.yaml";

#[derive(Debug, clap::Args)]
#[command(
    about = "Write a snapshot out as standalone image files",
    long_about = "Write a snapshot out as standalone image files (no backing file), to move \
it to another host, keep it outside hearth, or make a VirtualImage of it. hearthd converts the \
snapshot's layers in a private file of its own and streams the image; this command writes \
the file, under a name nobody sees until the whole image has arrived, then prints its SHA-256 \
(`sha256sum -c` reads the lines as they are). An interrupted export leaves no file behind.",
    after_help = "\
Examples:
  hearth export snapshot pre-upgrade-data -o data.qcow2
  hearth export snapshot pre-upgrade-data -o data.raw --format raw
  hearth export vmsnapshot pre-upgrade -o /srv/images/pre-upgrade
  hearth apply -f /srv/images/pre-upgrade/virtualmachine.yaml   # on another host"
)]
pub struct Args {
    #[command(subcommand)]
    pub target: Target,
}

#[derive(Debug, clap::Subcommand)]
pub enum Target {
    /// One VirtualDiskSnapshot as one image file
    #[command(after_help = "\
The snapshot must be Ready. Deleting it while hearthd converts it waits until
the conversion is done. The file gets mode 0600: it holds the disk's data.

Example:
  hearth export snapshot pre-upgrade-data -o data.qcow2")]
    Snapshot(SnapshotArgs),
    /// Every disk of a VirtualMachineSnapshot, plus a manifest to re-create the VM
    #[command(after_help = "\
DIR gets one image per disk, named after the disk (DISK.qcow2 or DISK.raw),
and virtualmachine.yaml: for each disk a VirtualImage (named after the disk
snapshot, `file:` source = the image's absolute path) and a VirtualDisk made
from it, then the VirtualMachine with the spec it had when the snapshot was
taken. `hearth apply -f DIR/virtualmachine.yaml` re-creates it where DIR lies
under one of hearthd's image roots (`hearthd --image-root`). On the host the
snapshot came from, the names are taken: apply it on another host, or edit
the names first.

Example:
  hearth export vmsnapshot pre-upgrade -o /srv/images/pre-upgrade")]
    Vmsnapshot(VmSnapshotArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Only the data the disk holds, no backing file
    Qcow2,
    /// The whole disk, byte for byte (written sparse)
    Raw,
}

impl Format {
    fn as_str(self) -> &'static str {
        match self {
            Format::Qcow2 => "qcow2",
            Format::Raw => "raw",
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct SnapshotArgs {
    /// The VirtualDiskSnapshot.
    #[arg(value_name = "NAME", value_parser = parse_name)]
    pub name: String,
    /// The image file to write.
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,
    /// The image format to write.
    #[arg(long, value_enum, default_value = "qcow2")]
    pub format: Format,
    /// Replace FILE if it exists.
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, clap::Args)]
pub struct VmSnapshotArgs {
    /// The VirtualMachineSnapshot.
    #[arg(value_name = "NAME", value_parser = parse_name)]
    pub name: String,
    /// The directory to write into (created if missing).
    #[arg(short, long, value_name = "DIR")]
    pub output: PathBuf,
    /// The image format to write, for every disk.
    #[arg(long, value_enum, default_value = "qcow2")]
    pub format: Format,
    /// Replace files of the same names in DIR.
    #[arg(long)]
    pub force: bool,
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    match &args.target {
        Target::Snapshot(a) => {
            refuse_existing(std::slice::from_ref(&a.output), a.force)?;
            let done = export_one(client, &a.name, &a.output, a.format, a.force).await?;
            println!("{}  {}", done.sha256, a.output.display());
            Ok(())
        }
        Target::Vmsnapshot(a) => export_vm(client, a).await,
    }
}

/// What was written.
struct Written {
    sha256: String,
}

fn refuse_existing(targets: &[PathBuf], force: bool) -> anyhow::Result<()> {
    for t in targets {
        match std::fs::symlink_metadata(t) {
            Ok(m) if m.is_dir() => bail!(
                "{} is a directory; name the file to write; nothing was written",
                t.display()
            ),
            Ok(_) if !force => bail!(
                "{} exists; nothing was written (use --force to replace it)",
                t.display()
            ),
            _ => {}
        }
    }
    Ok(())
}

fn watched() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("TERM").is_none_or(|t| t != "dumb")
}

/// A spinner while hearthd converts (on a terminal; hidden otherwise).
fn converting(label: &str) -> ProgressBar {
    if !watched() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner();
    bar.set_draw_target(ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{msg}  {spinner} converting on hearthd  {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.set_message(label.to_string());
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

async fn export_one(
    client: &ApiClient,
    name: &str,
    target: &Path,
    format: Format,
    force: bool,
) -> anyhow::Result<Written> {
    let started = Instant::now();
    let label = format!("snapshot/{name}");
    let spinner = converting(&label);
    let path = format!(
        "{}/export?format={}",
        object_path(Kind::VirtualDiskSnapshot, name),
        format.as_str()
    );
    let answer = client.stream_with_headers_within(&path, CONVERT_WAIT).await;
    spinner.finish_and_clear();
    let converted = started.elapsed();
    let (headers, mut body) = answer?;
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
    let size = header("content-length").and_then(|v| v.parse::<u64>().ok());
    let virtual_size = header("x-hearth-virtual-size").and_then(|v| v.parse::<u64>().ok());
    let mut out = OutFile::create(target)?;
    let bar = super::cp::progress(&format!("{label} downloading"), size);
    let mut hash = Sha256::new();
    let mut copied: u64 = 0;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            Err(e) => {
                bar.finish_and_clear();
                bail!(
                    "the export of {label} broke off after {copied} bytes: {e} (hearthd's log says why); nothing was written to {}",
                    target.display()
                );
            }
        };
        if let Ok(data) = frame.into_data() {
            hash.update(&data);
            if let Err(e) = out.write(&data) {
                bar.finish_and_clear();
                return Err(e);
            }
            copied += data.len() as u64;
            bar.inc(data.len() as u64);
        }
    }
    bar.finish_and_clear();
    if let Some(size) = size
        && copied != size
    {
        bail!(
            "the export of {label} ended after {copied} of {size} bytes; nothing was written to {}",
            target.display()
        );
    }
    out.commit(copied, force)?;
    let sha256 = hex(&hash.finalize());
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "exported {label} to {} ({}, {}{}) in {:.1} s (converting {:.1} s, {}/s)",
        target.display(),
        format.as_str(),
        human_bytes(copied),
        virtual_size
            .map(|v| format!(", disk size {}", human_bytes(v)))
            .unwrap_or_default(),
        secs,
        converted.as_secs_f64(),
        human_bytes((copied as f64 / (secs - converted.as_secs_f64()).max(0.001)) as u64),
    );
    Ok(Written { sha256 })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A file being written: unnamed (`O_TMPFILE`) in the target's directory
/// until it is complete, so an interrupted export, even a killed one, leaves
/// nothing; a named temporary next to the target where the filesystem has
/// no `O_TMPFILE`. All-zero chunks are skipped over (the file stays sparse).
struct OutFile {
    file: std::fs::File,
    /// The named temporary, when `O_TMPFILE` was not available.
    named: Option<PathBuf>,
    dir: PathBuf,
    target: PathBuf,
}

impl OutFile {
    fn create(target: &Path) -> anyhow::Result<OutFile> {
        let dir = match target.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let unnamed = rustix::fs::openat(
            rustix::fs::CWD,
            &dir,
            rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::TMPFILE | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::from_raw_mode(0o600),
        );
        match unnamed {
            Ok(fd) => Ok(OutFile {
                file: std::fs::File::from(fd),
                named: None,
                dir,
                target: target.to_path_buf(),
            }),
            Err(e)
                if e == rustix::io::Errno::OPNOTSUPP
                    || e == rustix::io::Errno::ISDIR
                    || e == rustix::io::Errno::INVAL =>
            {
                use std::os::unix::fs::OpenOptionsExt;
                let tmp = temp_name(&dir, target);
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&tmp)
                    .with_context(|| format!("cannot create {}", tmp.display()))?;
                Ok(OutFile {
                    file,
                    named: Some(tmp),
                    dir,
                    target: target.to_path_buf(),
                })
            }
            Err(e) => Err(std::io::Error::from(e))
                .with_context(|| format!("cannot write into {}", dir.display())),
        }
    }

    fn write(&mut self, data: &[u8]) -> anyhow::Result<()> {
        let done = if data.iter().all(|b| *b == 0) {
            self.file
                .seek(SeekFrom::Current(data.len() as i64))
                .map(|_| ())
        } else {
            self.file.write_all(data)
        };
        done.with_context(|| format!("cannot write {}", self.target.display()))
    }

    /// Gives the complete file its name: never over an existing file unless
    /// `force` (then by a rename, so the old file stays whole until then).
    fn commit(mut self, len: u64, force: bool) -> anyhow::Result<()> {
        let target = self.target.clone();
        let fail = |e: std::io::Error| {
            anyhow::Error::new(e).context(format!("cannot write {}", target.display()))
        };
        self.file.set_len(len).map_err(fail)?;
        self.file.sync_all().map_err(fail)?;
        let named = match self.named.take() {
            Some(tmp) => tmp,
            None => {
                let proc_path = format!("/proc/self/fd/{}", self.file.as_raw_fd());
                let into = if force {
                    temp_name(&self.dir, &self.target)
                } else {
                    self.target.clone()
                };
                match rustix::fs::linkat(
                    rustix::fs::CWD,
                    proc_path.as_str(),
                    rustix::fs::CWD,
                    &into,
                    rustix::fs::AtFlags::SYMLINK_FOLLOW,
                ) {
                    Ok(()) if !force => return sync_dir(&self.dir),
                    Ok(()) => into,
                    Err(e) if e == rustix::io::Errno::EXIST => bail!(
                        "{} appeared while exporting; nothing was written (use --force to replace it)",
                        self.target.display()
                    ),
                    Err(e) => return Err(fail(e.into())),
                }
            }
        };
        let placed = if force {
            std::fs::rename(&named, &self.target)
        } else {
            std::fs::hard_link(&named, &self.target)
        };
        if !force || placed.is_err() {
            let _ = std::fs::remove_file(&named);
        }
        match placed {
            Ok(()) => sync_dir(&self.dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => bail!(
                "{} appeared while exporting; nothing was written (use --force to replace it)",
                self.target.display()
            ),
            Err(e) => Err(fail(e)),
        }
    }
}

impl Drop for OutFile {
    fn drop(&mut self) {
        if let Some(tmp) = &self.named {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

fn temp_name(dir: &Path, target: &Path) -> PathBuf {
    let base = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "export".into());
    dir.join(format!(".{base}.hearth-{}.tmp", std::process::id()))
}

fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

async fn export_vm(client: &ApiClient, a: &VmSnapshotArgs) -> anyhow::Result<()> {
    let vmsnap = client
        .get(&object_path(Kind::VirtualMachineSnapshot, &a.name))
        .await?;
    let phase = str_at(&vmsnap, &["status", "phase"]).unwrap_or("Pending");
    if phase != "Ready" {
        let why = str_at(&vmsnap, &["status", "message"])
            .map(|m| format!(" ({m})"))
            .unwrap_or_default();
        bail!(
            "VirtualMachineSnapshot {:?} is {phase}{why}, not Ready: only a Ready snapshot can be exported; nothing was written",
            a.name
        );
    }
    let vm_name = str_at(&vmsnap, &["spec", "virtualMachineName"])
        .unwrap_or_default()
        .to_string();
    let children: Vec<String> = vmsnap["status"]["virtualDiskSnapshotNames"]
        .as_array()
        .map(|v| {
            v.iter()
                .filter_map(|c| c.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let spec = match vmsnap["status"].get("virtualMachineSpec") {
        Some(spec) => spec.clone(),
        None => {
            // Taken before VM snapshots recorded the spec: the VM's own, now.
            let vm = client
                .get(&object_path(Kind::VirtualMachine, &vm_name))
                .await
                .with_context(|| {
                    format!(
                        "VirtualMachineSnapshot {:?} does not record its VM's spec and the VM cannot be read; nothing was written",
                        a.name
                    )
                })?;
            eprintln!(
                "warning: VirtualMachineSnapshot {:?} does not record its VM's spec (it is older than that); writing VirtualMachine {vm_name:?}'s current spec",
                a.name
            );
            vm["spec"].clone()
        }
    };
    let mut disks = Vec::new();
    for child in &children {
        let snap = client
            .get(&object_path(Kind::VirtualDiskSnapshot, child))
            .await?;
        let disk = str_at(&snap, &["spec", "virtualDiskName"])
            .unwrap_or(child)
            .to_string();
        disks.push((child.clone(), disk));
    }
    std::fs::create_dir_all(&a.output)
        .with_context(|| format!("cannot create {}", a.output.display()))?;
    let dir = std::fs::canonicalize(&a.output)
        .with_context(|| format!("cannot read {}", a.output.display()))?;
    let files: Vec<PathBuf> = disks
        .iter()
        .map(|(_, disk)| dir.join(format!("{disk}.{}", a.format.as_str())))
        .collect();
    let manifest_path = dir.join(MANIFEST_NAME);
    let mut all = files.clone();
    all.push(manifest_path.clone());
    refuse_existing(&all, a.force)?;
    for ((child, _), file) in disks.iter().zip(&files) {
        let done = export_one(client, child, file, a.format, a.force).await?;
        println!("{}  {}", done.sha256, file.display());
    }
    let text = manifest_text(&a.name, &vm_name, &spec, &disks, &files);
    let mut out = OutFile::create(&manifest_path)?;
    out.write(text.as_bytes())?;
    out.commit(text.len() as u64, a.force)?;
    println!(
        "{}  {}",
        hex(&Sha256::digest(text.as_bytes())),
        manifest_path.display()
    );
    eprintln!(
        "wrote {} for VirtualMachine {vm_name:?}: `hearth apply -f {}` where the directory lies under an image root of hearthd",
        manifest_path.display(),
        manifest_path.display()
    );
    Ok(())
}

/// The manifest that re-creates the VM from the exported files: a
/// VirtualImage (named after the disk snapshot) and a VirtualDisk (named
/// after the disk) per file, then the VM with its recorded spec.
pub fn manifest_text(
    vmsnapshot: &str,
    vm: &str,
    spec: &Value,
    disks: &[(String, String)],
    files: &[PathBuf],
) -> String {
    let mut docs: Vec<Value> = Vec::new();
    for ((child, disk), file) in disks.iter().zip(files) {
        docs.push(json!({
            "apiVersion": hearth_api::API_VERSION,
            "kind": "VirtualImage",
            "metadata": {"name": child},
            "spec": {"source": {"file": file}},
        }));
        docs.push(json!({
            "apiVersion": hearth_api::API_VERSION,
            "kind": "VirtualDisk",
            "metadata": {"name": disk},
            "spec": {"source": {"virtualImage": child}},
        }));
    }
    docs.push(json!({
        "apiVersion": hearth_api::API_VERSION,
        "kind": "VirtualMachine",
        "metadata": {"name": vm},
        "spec": spec,
    }));
    let mut text = format!(
        "# VirtualMachine {vm:?} as VirtualMachineSnapshot {vmsnapshot:?} holds it, written by\n\
         # `hearth export vmsnapshot`. The `file:` sources must lie under one of hearthd's\n\
         # image roots (hearthd --image-root) for `hearth apply -f` to import them.\n"
    );
    for d in docs {
        text.push_str("---\n");
        text.push_str(&serde_yaml_ng::to_string(&d).unwrap_or_default());
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vm_manifest_parses_as_images_disks_and_the_vm() {
        let spec = json!({
            "memory": "256Mi",
            "disks": [{"virtualDiskName": "root"}, {"virtualDiskName": "data"}],
        });
        let disks = vec![
            ("pre-root".to_string(), "root".to_string()),
            ("pre-data".to_string(), "data".to_string()),
        ];
        let files = vec![
            PathBuf::from("/srv/images/pre/root.qcow2"),
            PathBuf::from("/srv/images/pre/data.qcow2"),
        ];
        let text = manifest_text("pre", "demo", &spec, &disks, &files);
        let objects = hearth_api::parse_documents(&text, "virtualmachine.yaml").expect("parses");
        let names: Vec<String> = objects.iter().map(|o| o.display_name()).collect();
        assert_eq!(names.len(), 5, "{names:?}");
        match &objects[0] {
            hearth_api::Object::VirtualImage(i) => assert_eq!(
                i.spec.source,
                hearth_api::ImageSource::File("/srv/images/pre/root.qcow2".into())
            ),
            other => panic!("{other:?}"),
        }
        match &objects[3] {
            hearth_api::Object::VirtualDisk(d) => assert_eq!(
                d.spec.source,
                hearth_api::DiskSource::VirtualImage("pre-data".into())
            ),
            other => panic!("{other:?}"),
        }
        match &objects[4] {
            hearth_api::Object::VirtualMachine(vm) => {
                assert_eq!(vm.metadata.name, "demo");
                assert_eq!(vm.spec.disks.len(), 2);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_file_has_its_name_only_once_complete_and_never_over_another() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("out.raw");
        let mut out = OutFile::create(&target).expect("create");
        out.write(b"data").expect("write");
        out.write(&[0u8; 8192]).expect("a hole");
        assert!(!target.exists(), "nothing under the name yet");
        drop(out);
        assert_eq!(
            std::fs::read_dir(dir.path()).expect("list").count(),
            0,
            "an unfinished file leaves nothing"
        );
        let mut out = OutFile::create(&target).expect("create");
        out.write(b"data").expect("write");
        out.write(&[0u8; 8192]).expect("a hole");
        out.commit(4 + 8192, false).expect("commit");
        let back = std::fs::read(&target).expect("read");
        assert_eq!(back.len(), 8196);
        assert_eq!(&back[..4], b"data");
        assert!(back[4..].iter().all(|b| *b == 0));
        let mut again = OutFile::create(&target).expect("create");
        again.write(b"other").expect("write");
        let err = again.commit(5, false).expect_err("exists");
        assert!(err.to_string().contains("--force"), "{err}");
        assert_eq!(std::fs::read(&target).expect("read").len(), 8196, "kept");
        let mut forced = OutFile::create(&target).expect("create");
        forced.write(b"other").expect("write");
        forced.commit(5, true).expect("forced");
        assert_eq!(std::fs::read(&target).expect("read"), b"other");
        assert_eq!(std::fs::read_dir(dir.path()).expect("list").count(), 1);
    }
}
