//! `hearth cp`: one file into or out of a VM's guest, through the guest
//! agent, with a progress bar on a terminal.

use std::io::{IsTerminal, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context as _, anyhow, bail};
use hearth_api::{Kind, check_dns_label};
use http_body_util::BodyExt;
use hyper::Method;
use hyper::body::Bytes;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::Value;
use tokio::io::AsyncReadExt;

use crate::client::{ApiClient, query_escape};

/// Files this big or bigger get a progress bar (on a terminal).
const BAR_FROM: u64 = 1 << 20;
/// Bytes per chunk handed to the HTTP body.
const READ_BLOCK: usize = 64 << 10;
/// A file of unknown mode (stdin, a guest without `stat`) gets this.
const DEFAULT_MODE: u32 = 0o644;

#[derive(Debug, clap::Args)]
#[command(
    about = "Copy a file into or out of a VM's guest through the guest agent",
    long_about = "Copy one file into or out of a VM's guest through the guest agent \
(qemu-ga's guest-file-* calls, one small chunk per call, so snapshots are never held up). \
The file's permission bits go with it. Into the guest, the data goes to a temporary file \
next to the target and is renamed over it only when complete (with `mv` in the guest); \
out of it, the same happens on this side. `-` is stdin or stdout. A guest path ending in \
`/`, or a local directory, takes the source's file name.",
    after_help = "\
Examples:
  hearth cp ./app.conf demo:/etc/app.conf
  hearth cp demo:/var/log/app.log ./app.log
  hearth cp demo:/etc/hostname -            # to stdout
  tar c ./site | hearth cp - demo:/tmp/site.tar
  hearth cp ./tool demo:/usr/local/bin/     # keeps the name and the mode"
)]
pub struct Args {
    /// FILE, VM:/PATH, or - for stdin.
    #[arg(value_name = "SRC")]
    pub source: String,
    /// FILE, VM:/PATH, or - for stdout.
    #[arg(value_name = "DEST")]
    pub dest: String,
}

/// One side of a copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `-`: stdin or stdout.
    Std,
    Local(PathBuf),
    Guest {
        vm: String,
        path: String,
    },
}

/// `demo:/etc/hosts` is a guest path of VM `demo`; `-` is stdin/stdout;
/// anything else is a local path (write `./demo:x` for a local file whose
/// name looks like a guest path).
pub fn parse_endpoint(s: &str) -> Result<Endpoint, String> {
    if s == "-" {
        return Ok(Endpoint::Std);
    }
    if let Some((vm, path)) = s.split_once(':')
        && check_dns_label(vm).is_ok()
    {
        if !path.starts_with('/') {
            return Err(format!(
                "{s:?}: a path in the guest must be absolute ({vm}:/{path}); for a local file of that name write ./{s}"
            ));
        }
        return Ok(Endpoint::Guest {
            vm: vm.to_string(),
            path: path.to_string(),
        });
    }
    if s.is_empty() {
        return Err("an empty path".into());
    }
    Ok(Endpoint::Local(PathBuf::from(s)))
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let source = parse_endpoint(&args.source).map_err(|e| anyhow!(e))?;
    let dest = parse_endpoint(&args.dest).map_err(|e| anyhow!(e))?;
    match (source, dest) {
        (Endpoint::Guest { .. }, Endpoint::Guest { .. }) => {
            bail!("both sides are in a guest; copy out to a local file, then in")
        }
        (src, Endpoint::Guest { vm, path }) => copy_in(client, &src, &vm, &path).await,
        (Endpoint::Guest { vm, path }, dst) => copy_out(client, &vm, &path, &dst).await,
        _ => bail!("one of SRC and DEST must be in a guest, written VM:/PATH"),
    }
}

fn files_path(vm: &str, guest_path: &str) -> String {
    format!(
        "{}/agent/files?path={}",
        super::object_path(Kind::VirtualMachine, vm),
        query_escape(guest_path)
    )
}

/// A byte bar on stderr when a person watches and the file is large (or
/// of unknown size); hidden otherwise.
pub(crate) fn progress(label: &str, total: Option<u64>) -> ProgressBar {
    let watched = std::io::stderr().is_terminal()
        && std::env::var_os("TERM").is_none_or(|t| t != "dumb")
        && total.is_none_or(|t| t >= BAR_FROM);
    if !watched {
        return ProgressBar::hidden();
    }
    let (bar, template) = match total {
        Some(t) => (
            ProgressBar::new(t),
            "{msg}  [{bar:30}] {bytes}/{total_bytes}  {bytes_per_sec}  eta {eta}",
        ),
        None => (
            ProgressBar::new_spinner(),
            "{msg}  {spinner} {bytes}  {bytes_per_sec}",
        ),
    };
    bar.set_draw_target(ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(label.to_string());
    bar
}

async fn copy_in(
    client: &ApiClient,
    source: &Endpoint,
    vm: &str,
    guest_path: &str,
) -> anyhow::Result<()> {
    let (reader, size, mode, name): (Box<dyn tokio::io::AsyncRead + Unpin + Send>, _, _, _) =
        match source {
            Endpoint::Local(p) => {
                let meta =
                    std::fs::metadata(p).with_context(|| format!("cannot read {}", p.display()))?;
                if meta.is_dir() {
                    bail!(
                        "{} is a directory (hearth cp copies one file; tar it and copy the archive)",
                        p.display()
                    );
                }
                let file = tokio::fs::File::open(p)
                    .await
                    .with_context(|| format!("cannot open {}", p.display()))?;
                (
                    Box::new(file),
                    meta.is_file().then_some(meta.len()),
                    meta.permissions().mode() & 0o777,
                    p.file_name().map(|n| n.to_string_lossy().into_owned()),
                )
            }
            _ => (Box::new(tokio::io::stdin()), None, DEFAULT_MODE, None),
        };
    let target = if guest_path.ends_with('/') {
        let Some(name) = name else {
            bail!(
                "{vm}:{guest_path} is a directory: name the file to write ({vm}:{guest_path}NAME)"
            );
        };
        format!("{guest_path}{name}")
    } else {
        guest_path.to_string()
    };
    let bar = progress(&format!("{vm}:{target}"), size);
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(4);
    let feeder = {
        let bar = bar.clone();
        tokio::spawn(async move {
            let mut reader = reader;
            loop {
                let mut block = vec![0u8; READ_BLOCK];
                match reader.read(&mut block).await {
                    Ok(0) => return Ok(()),
                    Ok(n) => {
                        block.truncate(n);
                        if tx.send(Ok(Bytes::from(block))).await.is_err() {
                            return Ok(());
                        }
                        bar.inc(n as u64);
                    }
                    Err(e) => {
                        let text = e.to_string();
                        let _ = tx.send(Err(e)).await;
                        return Err(text);
                    }
                }
            }
        })
    };
    let path = format!("{}&mode={mode:o}", files_path(vm, &target));
    let answer = client.send_stream(Method::PUT, &path, rx).await;
    bar.finish_and_clear();
    let read_error = match feeder.await {
        Ok(Err(text)) => Some(text),
        _ => None,
    };
    if let Some(text) = read_error {
        bail!("reading the source failed: {text}; nothing was written to {vm}:{target}");
    }
    let answer = answer?;
    if let Some(warning) = answer.get("warning").and_then(Value::as_str) {
        eprintln!("warning: {warning}");
    }
    Ok(())
}

async fn copy_out(
    client: &ApiClient,
    vm: &str,
    guest_path: &str,
    dest: &Endpoint,
) -> anyhow::Result<()> {
    let (headers, mut body) = client
        .stream_with_headers(&files_path(vm, guest_path))
        .await?;
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let size = header("x-hearth-file-size").and_then(|v| v.parse::<u64>().ok());
    let mode = header("x-hearth-file-mode").and_then(|v| u32::from_str_radix(&v, 8).ok());
    let mut sink = match dest {
        Endpoint::Std => Sink::Stdout(std::io::stdout()),
        Endpoint::Local(p) => Sink::File(LocalFile::create(p, guest_path)?),
        Endpoint::Guest { .. } => bail!("both sides are in a guest"),
    };
    let label = format!("{vm}:{guest_path}");
    let bar = progress(&label, size);
    let mut copied: u64 = 0;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            Err(e) => {
                bar.finish_and_clear();
                sink.discard();
                bail!(
                    "the copy of {label} broke off after {copied} bytes: {e} (hearthd's log says why); nothing was kept"
                );
            }
        };
        if let Ok(data) = frame.into_data() {
            if let Err(e) = sink.write(&data) {
                bar.finish_and_clear();
                sink.discard();
                return Err(e);
            }
            copied += data.len() as u64;
            bar.inc(data.len() as u64);
        }
    }
    bar.finish_and_clear();
    sink.commit(mode.unwrap_or(DEFAULT_MODE) & 0o777)
}

enum Sink {
    Stdout(std::io::Stdout),
    File(LocalFile),
}

impl Sink {
    fn write(&mut self, data: &[u8]) -> anyhow::Result<()> {
        match self {
            Sink::Stdout(out) => {
                let mut out = out.lock();
                out.write_all(data)?;
                out.flush()?;
                Ok(())
            }
            Sink::File(f) => f
                .file
                .write_all(data)
                .with_context(|| format!("cannot write {}", f.tmp.display())),
        }
    }

    fn discard(&mut self) {
        if let Sink::File(f) = self {
            let _ = std::fs::remove_file(&f.tmp);
        }
    }

    fn commit(self, mode: u32) -> anyhow::Result<()> {
        match self {
            Sink::Stdout(_) => Ok(()),
            Sink::File(f) => f.commit(mode),
        }
    }
}

/// A local file written under a temporary name next to the target and
/// renamed over it when complete.
struct LocalFile {
    file: std::fs::File,
    tmp: PathBuf,
    target: PathBuf,
}

impl LocalFile {
    fn create(dest: &Path, guest_path: &str) -> anyhow::Result<LocalFile> {
        let name = guest_path.rsplit('/').next().unwrap_or(guest_path);
        let target = if dest.is_dir() || dest.as_os_str().to_string_lossy().ends_with('/') {
            dest.join(name)
        } else {
            dest.to_path_buf()
        };
        let dir = match target.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let base = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| name.to_string());
        let tmp = dir.join(format!(".{base}.hearth-{}.tmp", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| {
                format!(
                    "cannot write {} (creating {} next to it)",
                    target.display(),
                    tmp.display()
                )
            })?;
        Ok(LocalFile { file, tmp, target })
    }

    fn commit(self, mode: u32) -> anyhow::Result<()> {
        let done = (|| -> std::io::Result<()> {
            self.file.sync_all()?;
            self.file
                .set_permissions(std::fs::Permissions::from_mode(mode))?;
            std::fs::rename(&self.tmp, &self.target)
        })();
        if let Err(e) = done {
            let _ = std::fs::remove_file(&self.tmp);
            return Err(e).with_context(|| format!("cannot write {}", self.target.display()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_guest_paths_local_paths_or_std() {
        assert_eq!(parse_endpoint("-"), Ok(Endpoint::Std));
        assert_eq!(
            parse_endpoint("demo:/etc/hosts"),
            Ok(Endpoint::Guest {
                vm: "demo".into(),
                path: "/etc/hosts".into()
            })
        );
        assert_eq!(
            parse_endpoint("./demo:/x"),
            Ok(Endpoint::Local("./demo:/x".into()))
        );
        assert_eq!(
            parse_endpoint("/tmp/a:b"),
            Ok(Endpoint::Local("/tmp/a:b".into()))
        );
        assert_eq!(
            parse_endpoint("Big_Name:/x"),
            Ok(Endpoint::Local("Big_Name:/x".into()))
        );
        let err = parse_endpoint("demo:etc/hosts").expect_err("relative");
        assert!(err.contains("demo:/etc/hosts"), "{err}");
        assert!(err.contains("./demo:etc/hosts"), "{err}");
        assert!(parse_endpoint("").is_err());
    }

    #[test]
    fn a_local_copy_is_renamed_into_place_only_when_committed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("out.bin");
        let mut sink = Sink::File(LocalFile::create(&target, "/guest/x").expect("create"));
        sink.write(b"half").expect("write");
        assert!(!target.exists(), "nothing under the final name yet");
        sink.discard();
        assert_eq!(
            std::fs::read_dir(dir.path()).expect("list").count(),
            0,
            "a discarded copy leaves nothing"
        );
        let mut sink = Sink::File(LocalFile::create(&target, "/guest/x").expect("create"));
        sink.write(b"whole").expect("write");
        sink.commit(0o750).expect("commit");
        assert_eq!(std::fs::read(&target).expect("read"), b"whole");
        let mode = std::fs::metadata(&target)
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o750);
        // Into a directory: the guest file's name.
        let sink = LocalFile::create(dir.path(), "/guest/name.txt").expect("create");
        Sink::File(sink).commit(0o644).expect("commit");
        assert!(dir.path().join("name.txt").is_file());
    }
}
