//! One import attempt's I/O: read the source into a temporary file in the
//! image store while hashing it, then check what the file is before
//! anything else opens it. Nothing here writes the store; the caller turns
//! the result into status.

use std::path::{Path, PathBuf};
use std::time::Instant;

use futures_util::StreamExt;
use hearth_qemu::img::QemuImg;
use hearth_qemu::probe::{self, Sniffed};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::progress::{Progress, Report, format_bytes};
use super::space::{self, Space, SpaceGuard};
use crate::config::ImageImportConfig;

/// Why an attempt failed: `reason` is the status's one-word reason, the
/// message says what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub reason: &'static str,
    pub message: String,
    /// `NoSpace`: the room above the free-space reserve the next attempt
    /// needs to get further than this one; it is not started before.
    pub needs_room: Option<u64>,
}

impl Failure {
    pub fn new(reason: &'static str, message: impl Into<String>) -> Failure {
        Failure {
            reason,
            message: message.into(),
            needs_room: None,
        }
    }

    /// The message with `context` (the source, the field) in front.
    fn within(mut self, context: &str) -> Failure {
        self.message = format!("{context}: {}", self.message);
        self
    }
}

/// The reason of an import stopped by the free-space reserve.
pub const NO_SPACE: &str = "NoSpace";

/// A temporary file of an import. Removed when dropped, unless it was
/// renamed into the store: an attempt that fails, is cancelled (its task
/// aborted) or panics leaves nothing behind. A crash is covered by the sweep
/// at start-up.
/// Every write first makes sure the filesystem keeps `reserve` bytes free
/// ([`SpaceGuard`]).
pub struct TempFile {
    pub path: PathBuf,
    pub file: Option<tokio::fs::File>,
    space: SpaceGuard,
    written: u64,
}

impl TempFile {
    /// Creates the file; fails with `NoSpace` when its filesystem already
    /// has no more than `reserve` bytes free.
    pub async fn create(path: PathBuf, reserve: u64) -> Result<TempFile, Failure> {
        let free = free_space(&path)?;
        let file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .await
            .map_err(|e| Failure::new("StoreFailed", format!("{}: {e}", path.display())))?;
        let out = TempFile {
            path,
            file: Some(file),
            space: SpaceGuard::new(reserve, free),
            written: 0,
        };
        if out.space.room() == 0 {
            return Err(out.no_space(1, "before the first byte"));
        }
        Ok(out)
    }

    /// Fails with `NoSpace` unless `n` more bytes fit above the reserve,
    /// by a fresh look: for a source whose length is known before a byte is
    /// read.
    pub fn ensure_room(&mut self, n: u64) -> Result<(), Failure> {
        self.space.looked(free_space(&self.path)?);
        if self.space.before(n, true) == Space::Full {
            return Err(self.no_space(n, &format!("for its {n} bytes, before the first one")));
        }
        Ok(())
    }

    fn no_space(&self, needs: u64, when: &str) -> Failure {
        let dir = self.path.parent().unwrap_or(Path::new("/"));
        Failure {
            reason: NO_SPACE,
            message: format!(
                "not enough free space {when}: the filesystem of {} has {} free and hearthd keeps {} ({} bytes) free for its store (hearthd --image-free-space-reserve)",
                dir.display(),
                format_bytes(self.space.free()),
                format_bytes(self.space.reserve()),
                self.space.reserve(),
            ),
            needs_room: Some(self.written.saturating_add(needs)),
        }
    }

    /// The data on disk (fsync) and the file closed.
    pub async fn finish(&mut self) -> Result<(), Failure> {
        if let Some(mut f) = self.file.take() {
            let fail = |e: std::io::Error| {
                Failure::new("StoreFailed", format!("{}: {e}", self.path.display()))
            };
            f.flush().await.map_err(fail)?;
            f.sync_all().await.map_err(fail)?;
        }
        Ok(())
    }

    /// On a failed attempt: waits for the write tokio still has in flight
    /// and closes the file, so the space of the removed file is free once
    /// the image reports its failure (an unlinked file that is still open
    /// keeps its blocks).
    pub async fn discard_on_error<T>(&mut self, r: Result<T, Failure>) -> Result<T, Failure> {
        if r.is_err()
            && let Some(mut f) = self.file.take()
        {
            let _ = f.flush().await;
            drop(f);
            let _ = std::fs::remove_file(&self.path);
        }
        r
    }

    async fn write(&mut self, data: &[u8]) -> Result<(), Failure> {
        let n = data.len() as u64;
        if !space::admit(&mut self.space, n, || free_space(&self.path))? {
            return Err(self.no_space(n, &format!("after {} bytes", self.written)));
        }
        let fail = |e: String| Failure::new("StoreFailed", format!("{}: {e}", self.path.display()));
        let Some(f) = self.file.as_mut() else {
            return Err(fail("written after it was closed".into()));
        };
        f.write_all(data).await.map_err(|e| fail(e.to_string()))?;
        self.written += n;
        Ok(())
    }
}

/// Bytes available on the filesystem that holds `file`'s directory.
fn free_space(file: &Path) -> Result<u64, Failure> {
    let dir = file.parent().unwrap_or(Path::new("/"));
    space::available(dir)
        .map_err(|e| Failure::new("StoreFailed", format!("statvfs {}: {e}", dir.display())))
}

impl Drop for TempFile {
    fn drop(&mut self) {
        // After a rename into the store the name is gone: NotFound.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// What was read from the source.
#[derive(Clone, Debug)]
pub struct Fetched {
    pub hex: String,
    pub bytes: u64,
    pub seconds: f64,
    pub bytes_per_second: u64,
}

/// The message of an error and all its causes, once each.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cur = s.source();
    }
    out
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The HTTP client of imports: connect timeout, a few redirects, no proxy.
pub fn http_client(cfg: &ImageImportConfig) -> Result<reqwest::Client, Failure> {
    reqwest::Client::builder()
        .connect_timeout(cfg.connect_timeout)
        .redirect(reqwest::redirect::Policy::limited(5))
        .user_agent(concat!("hearthd/", env!("CARGO_PKG_VERSION")))
        .no_proxy()
        .build()
        .map_err(|e| Failure::new("HttpError", chain(&e)))
}

/// Streams `url` into `out`, hashing it. The response must start, and each
/// piece of the body arrive, within `read_timeout`; the length (said or
/// read) must stay within `max_bytes`; a body shorter than its
/// Content-Length is `Truncated`.
pub async fn fetch_http(
    cfg: &ImageImportConfig,
    url: &str,
    out: &mut TempFile,
    mut report: impl FnMut(Report),
) -> Result<Fetched, Failure> {
    let client = http_client(cfg)?;
    let secs = cfg.read_timeout.as_secs_f64();
    let send = tokio::time::timeout(cfg.read_timeout, client.get(url).send());
    let response = match send.await {
        Err(_) => {
            return Err(Failure::new(
                "Timeout",
                format!("spec.source.http.url: GET {url}: no response within {secs} s"),
            ));
        }
        Ok(Err(e)) => {
            let reason = if e.is_timeout() {
                "Timeout"
            } else if e.is_connect() {
                "ConnectFailed"
            } else {
                "HttpError"
            };
            return Err(Failure::new(
                reason,
                format!("spec.source.http.url: GET {url}: {}", chain(&e)),
            ));
        }
        Ok(Ok(r)) => r,
    };
    let status = response.status();
    if !status.is_success() {
        return Err(Failure::new(
            "HttpStatus",
            format!("spec.source.http.url: GET {url}: the server answered {status}"),
        ));
    }
    let total = response.content_length();
    if let Some(t) = total
        && t > cfg.max_bytes
    {
        return Err(Failure::new(
            "TooLarge",
            format!(
                "spec.source.http.url: GET {url}: Content-Length {t} is more than the {} bytes allowed (hearthd --image-max-bytes)",
                cfg.max_bytes
            ),
        ));
    }
    let context = format!("spec.source.http.url: GET {url}");
    if let Some(t) = total {
        out.ensure_room(t).map_err(|f| f.within(&context))?;
    }
    let mut progress = Progress::new(total, Instant::now());
    report(progress.report());
    let mut hasher = Sha256::new();
    let mut body = response.bytes_stream();
    loop {
        let next = match tokio::time::timeout(cfg.read_timeout, body.next()).await {
            Err(_) => {
                return Err(Failure::new(
                    "Timeout",
                    format!(
                        "spec.source.http.url: GET {url}: nothing received for {secs} s after {} bytes (hearthd --image-read-timeout-seconds)",
                        progress.done
                    ),
                ));
            }
            Ok(next) => next,
        };
        let chunk = match next {
            None => break,
            Some(Ok(c)) => c,
            Some(Err(e)) => {
                if let Some(t) = total
                    && progress.done < t
                {
                    return Err(Failure::new(
                        "Truncated",
                        format!(
                            "spec.source.http.url: GET {url}: the connection ended after {} of {t} bytes: {}",
                            progress.done,
                            chain(&e)
                        ),
                    ));
                }
                return Err(Failure::new(
                    "HttpError",
                    format!(
                        "spec.source.http.url: GET {url}: reading the body after {} bytes: {}",
                        progress.done,
                        chain(&e)
                    ),
                ));
            }
        };
        if progress.done.saturating_add(chunk.len() as u64) > cfg.max_bytes {
            return Err(Failure::new(
                "TooLarge",
                format!(
                    "spec.source.http.url: GET {url}: more than the {} bytes allowed (hearthd --image-max-bytes)",
                    cfg.max_bytes
                ),
            ));
        }
        hasher.update(&chunk);
        out.write(&chunk).await.map_err(|f| f.within(&context))?;
        if let Some(r) = progress.add(chunk.len() as u64, Instant::now()) {
            report(r);
        }
    }
    if let Some(t) = total
        && progress.done != t
    {
        return Err(Failure::new(
            "Truncated",
            format!(
                "spec.source.http.url: GET {url}: the body had {} bytes, its Content-Length said {t}",
                progress.done
            ),
        ));
    }
    let now = Instant::now();
    Ok(Fetched {
        hex: hex(&hasher.finalize()),
        bytes: progress.done,
        seconds: progress.elapsed(now).as_secs_f64(),
        bytes_per_second: progress.mean_rate(now),
    })
}

/// Copies the host file `src` into `out`, hashing it.
pub async fn fetch_file(
    cfg: &ImageImportConfig,
    src: &Path,
    out: &mut TempFile,
    mut report: impl FnMut(Report),
) -> Result<Fetched, Failure> {
    let read_failed = |e: std::io::Error| {
        let reason = if e.kind() == std::io::ErrorKind::NotFound {
            "SourceMissing"
        } else {
            "ReadFailed"
        };
        Failure::new(reason, format!("spec.source.file: {}: {e}", src.display()))
    };
    let mut f = tokio::fs::File::open(src).await.map_err(read_failed)?;
    let len = f.metadata().await.map_err(read_failed)?.len();
    if len > cfg.max_bytes {
        return Err(Failure::new(
            "TooLarge",
            format!(
                "spec.source.file: {} is {} bytes, more than the {} allowed (hearthd --image-max-bytes)",
                src.display(),
                len,
                cfg.max_bytes
            ),
        ));
    }
    let context = format!("spec.source.file: {}", src.display());
    out.ensure_room(len).map_err(|f| f.within(&context))?;
    let mut progress = Progress::new(Some(len), Instant::now());
    report(progress.report());
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).await.map_err(read_failed)?;
        if n == 0 {
            break;
        }
        if progress.done.saturating_add(n as u64) > cfg.max_bytes {
            return Err(Failure::new(
                "TooLarge",
                format!(
                    "spec.source.file: {} grew past the {} bytes allowed while it was copied",
                    src.display(),
                    cfg.max_bytes
                ),
            ));
        }
        hasher.update(&buf[..n]);
        out.write(&buf[..n]).await.map_err(|f| f.within(&context))?;
        if let Some(r) = progress.add(n as u64, Instant::now()) {
            report(r);
        }
    }
    let now = Instant::now();
    Ok(Fetched {
        hex: hex(&hasher.finalize()),
        bytes: progress.done,
        seconds: progress.elapsed(now).as_secs_f64(),
        bytes_per_second: progress.mean_rate(now),
    })
}

/// A file that passed every check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verified {
    pub format: &'static str,
    pub virtual_size: u64,
}

/// Checks an imported file before it may become an image, in this order,
/// each before anything opens the file further:
/// 1. its header, read here (`probe::sniff`): a qcow2 must name no backing
///    file and no external data file and be neither corrupt, dirty nor
///    encrypted; any other image format is refused; a raw file must carry a
///    partition table or filesystem signature and be whole 512-byte sectors;
/// 2. `qemu-img info` (probing) must detect the same format;
/// 3. `qemu-img info -f FORMAT` gives the virtual size and must show no
///    backing or data file either;
/// 4. a qcow2 must pass `qemu-img check` (no corruptions).
pub async fn verify(path: &Path, size: u64) -> Result<Verified, Failure> {
    let mut head = Vec::with_capacity(probe::HEAD_BYTES);
    let f = tokio::fs::File::open(path)
        .await
        .map_err(|e| Failure::new("StoreFailed", format!("{}: {e}", path.display())))?;
    f.take(probe::HEAD_BYTES as u64)
        .read_to_end(&mut head)
        .await
        .map_err(|e| Failure::new("StoreFailed", format!("{}: {e}", path.display())))?;
    let format = match probe::sniff(&head) {
        Err(refusal) => {
            return Err(Failure::new(
                refusal.reason(),
                format!("the qcow2 image is refused: {refusal}"),
            ));
        }
        Ok(Sniffed::Qcow2(header)) => {
            header.check().map_err(|refusal| {
                Failure::new(
                    refusal.reason(),
                    format!("the qcow2 image is refused: {refusal}"),
                )
            })?;
            "qcow2"
        }
        Ok(Sniffed::Other(format)) => {
            return Err(Failure::new(
                "UnsupportedFormat",
                format!(
                    "it is a {format} image; only self-contained qcow2 and raw images are imported ({format} images can name other files). Convert it first: qemu-img convert -O qcow2 IN OUT"
                ),
            ));
        }
        Ok(Sniffed::Raw(None)) => {
            return Err(Failure::new(
                "NotAnImage",
                format!(
                    "the {} file has no image format, partition table or filesystem signature: it is not a disk image (a text or HTML page?)",
                    format_bytes(size)
                ),
            ));
        }
        Ok(Sniffed::Raw(Some(signature))) => {
            if !size.is_multiple_of(512) {
                return Err(Failure::new(
                    "NotAnImage",
                    format!(
                        "it starts with {signature} but its {size} bytes are not whole 512-byte sectors: not a complete raw disk image"
                    ),
                ));
            }
            "raw"
        }
    };
    let img = QemuImg::locate().map_err(|e| Failure::new("ToolMissing", e.to_string()))?;
    let unreadable = |e: hearth_qemu::img::ImgError| {
        Failure::new("CorruptImage", format!("qemu-img cannot read it: {e}"))
    };
    let detected = img.detect_format(path).await.map_err(unreadable)?;
    if detected != format {
        return Err(Failure::new(
            "UnsupportedFormat",
            format!("qemu-img detects it as {detected}, not {format}"),
        ));
    }
    let info = img.info_as(path, format).await.map_err(unreadable)?;
    if let Some(reference) = info.backing_filename.as_ref().or(info.data_file.as_ref()) {
        return Err(Failure::new(
            "UnsafeImage",
            format!(
                "qemu-img reports a reference to {reference:?}; an image must be self-contained"
            ),
        ));
    }
    if format == "qcow2" {
        let report = img.check(path).await.map_err(unreadable)?;
        if !report.is_clean() {
            return Err(Failure::new(
                "CorruptImage",
                format!(
                    "qemu-img check found {} corruption(s) and {} error(s); repair it with `qemu-img check -r all` first",
                    report.corruptions, report.check_errors
                ),
            ));
        }
    }
    Ok(Verified {
        format,
        virtual_size: info.virtual_size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_raw_file_must_look_like_a_disk_and_be_whole_sectors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let text = dir.path().join("notes.txt");
        std::fs::write(&text, "not a disk\n".repeat(100)).expect("write");
        let f = verify(&text, 1100).await.expect_err("text");
        assert_eq!(f.reason, "NotAnImage", "{f:?}");

        let mut mbr = vec![0u8; 1 << 20];
        mbr[510] = 0x55;
        mbr[511] = 0xaa;
        let disk = dir.path().join("disk.raw");
        std::fs::write(&disk, &mbr).expect("write");
        assert_eq!(
            verify(&disk, mbr.len() as u64).await,
            Ok(Verified {
                format: "raw",
                virtual_size: 1 << 20
            })
        );
        let odd = dir.path().join("odd.raw");
        std::fs::write(&odd, &mbr[..1000]).expect("write");
        let f = verify(&odd, 1000).await.expect_err("odd size");
        assert_eq!(f.reason, "NotAnImage");
        assert!(f.message.contains("512-byte sectors"), "{}", f.message);
    }
}
