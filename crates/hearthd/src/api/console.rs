//! `GET /v1/virtualmachines/{name}/console`: the serial console log, and with
//! `follow=true` everything written to it afterwards.
//! `GET /v1/virtualmachines/{name}/console/attach`: the serial port itself,
//! both ways, over an HTTP/1.1 upgrade (one client at a time).

use std::collections::HashSet;
use std::io::SeekFrom;
use std::path::PathBuf;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use hearth_api::Kind;
use hearth_engine::Engine;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
use tokio::net::UnixStream;

use super::ApiError;
use super::request::{ApiPath, ApiQuery};

const POLL: Duration = Duration::from_millis(200);
const CHUNK: usize = 64 << 10;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleQuery {
    #[serde(default)]
    follow: bool,
    /// The console of the previous start, whole (no `follow`).
    #[serde(default)]
    previous: bool,
}

struct Tail {
    engine: Arc<Engine>,
    vm: String,
    path: std::path::PathBuf,
    file: Option<tokio::fs::File>,
    offset: u64,
    follow: bool,
}

/// The identity of a file (device, inode): a new start moves the log
/// aside and QEMU makes a new one at the same path.
fn identity(m: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (m.dev(), m.ino())
}

pub async fn console(
    State(engine): State<Arc<Engine>>,
    ApiPath(name): ApiPath<String>,
    ApiQuery(q): ApiQuery<ConsoleQuery>,
) -> Result<Response, ApiError> {
    if q.previous && q.follow {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            "previous and follow cannot be asked together: the previous start's console no longer grows".into(),
        ));
    }
    let path = if q.previous {
        let path = engine.previous_console_path(&name)?;
        if !path.exists() {
            return Err(ApiError(
                StatusCode::NOT_FOUND,
                format!(
                    "VirtualMachine {name:?}: no console of a previous start (one is kept from the second start on)"
                ),
            ));
        }
        path
    } else {
        engine.console_path(&name)?
    };
    let tail = Tail {
        engine,
        vm: name,
        path,
        file: None,
        offset: 0,
        follow: q.follow,
    };
    let stream = futures_util::stream::unfold(tail, |mut t| async move {
        loop {
            if t.file.is_none() {
                t.file = tokio::fs::File::open(&t.path).await.ok();
                t.offset = 0;
            }
            if let Some(f) = t.file.as_mut() {
                // A log cut short: start over.
                let len = f.metadata().await.map(|m| m.len()).unwrap_or(0);
                if len < t.offset {
                    t.offset = 0;
                }
                // Past the hole a bounded log's oldest bytes left (they
                // were dropped), never through it as zeroes.
                t.offset = match hearth_engine::console_data_from(&*f, t.offset) {
                    Some(at) => t.offset.max(at),
                    None => t.offset.max(len),
                };
                if f.seek(SeekFrom::Start(t.offset)).await.is_ok() {
                    let mut buf = vec![0u8; CHUNK];
                    if let Ok(n) = f.read(&mut buf).await
                        && n > 0
                    {
                        t.offset += n as u64;
                        buf.truncate(n);
                        return Some((Ok::<Bytes, std::io::Error>(Bytes::from(buf)), t));
                    }
                }
            }
            let vm_exists = t
                .engine
                .find(Kind::VirtualMachine, &t.vm)
                .ok()
                .flatten()
                .is_some();
            if !t.follow || !vm_exists {
                return None;
            }
            // Read to its end: if the VM started again meanwhile, its log
            // was moved aside (it no longer grows) and the new start's is
            // at the path; follow that one from its first byte.
            if let Some(f) = t.file.as_ref() {
                let open = f.metadata().await.ok().map(|m| identity(&m));
                let now = tokio::fs::metadata(&t.path)
                    .await
                    .ok()
                    .map(|m| identity(&m));
                if now.is_some() && open != now {
                    t.file = None;
                    continue;
                }
            }
            tokio::time::sleep(POLL).await;
        }
    });
    Ok((
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        Body::from_stream(stream),
    )
        .into_response())
}

/// The `Upgrade` protocol of `GET .../console/attach`: after the 101 the
/// connection carries raw serial bytes both ways.
pub const ATTACH_PROTOCOL: &str = "hearth-console";

/// Serial sockets with a client attached. QEMU serves one client at a time
/// (a second connect would wait unanswered in its backlog), so a second
/// attach is refused here, at once, with a 409. Keyed by socket path, which
/// is unique per daemon and VM.
static ATTACHED: LazyLock<Mutex<HashSet<PathBuf>>> = LazyLock::new(Default::default);

/// Holds a VM's console for one client; dropping it lets the next one in.
struct Claim(PathBuf);

impl Claim {
    fn take(sock: &std::path::Path) -> Option<Claim> {
        let mut set = ATTACHED.lock().unwrap_or_else(|e| e.into_inner());
        set.insert(sock.to_path_buf())
            .then(|| Claim(sock.to_path_buf()))
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        ATTACHED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.0);
    }
}

/// `GET /v1/virtualmachines/{name}/console/attach` with `Connection:
/// upgrade` and `Upgrade: hearth-console`: answers 101 and then pipes the
/// connection to and from the VM's serial port. 409 while another client
/// is attached or when the VM is not running.
pub async fn attach(
    State(engine): State<Arc<Engine>>,
    ApiPath(name): ApiPath<String>,
    mut req: Request,
) -> Result<Response, ApiError> {
    let sock = engine.console_socket(&name)?;
    let wants = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(ATTACH_PROTOCOL));
    if !wants {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!(
                "VirtualMachine {name:?}: console attach needs `Connection: upgrade` and \
                 `Upgrade: {ATTACH_PROTOCOL}` (or use GET .../console for the log)"
            ),
        ));
    }
    let claim = Claim::take(&sock).ok_or_else(|| {
        ApiError(
            StatusCode::CONFLICT,
            format!(
                "VirtualMachine {name:?}: its console already has a client attached \
                 (only one at a time; `hearth logs -f {name}` follows the output)"
            ),
        )
    })?;
    let serial = UnixStream::connect(&sock).await.map_err(|e| {
        ApiError(
            StatusCode::CONFLICT,
            format!(
                "VirtualMachine {name:?} is not running, or its QEMU has no console socket \
                 (started by an older hearthd): {}: {e}",
                sock.display()
            ),
        )
    })?;
    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        let upgraded = match on_upgrade.await {
            Ok(u) => u,
            Err(e) => {
                tracing::warn!(vm = %name, "console attach: upgrade failed: {e}");
                return;
            }
        };
        let (mut client_rx, mut client_tx) = tokio::io::split(TokioIo::new(upgraded));
        let (mut serial_rx, mut serial_tx) = serial.into_split();
        // Either side ending ends the attach: the client hung up or
        // detached, or QEMU went away.
        tokio::select! {
            _ = tokio::io::copy(&mut client_rx, &mut serial_tx) => {}
            _ = tokio::io::copy(&mut serial_rx, &mut client_tx) => {}
        }
        drop((serial_rx, serial_tx));
        // The next client may attach before this one sees its connection
        // close: a client that waits for the close can attach again at once.
        drop(claim);
        let _ = client_tx.shutdown().await;
    });
    Ok((
        StatusCode::SWITCHING_PROTOCOLS,
        [
            (header::CONNECTION, "upgrade"),
            (header::UPGRADE, ATTACH_PROTOCOL),
        ],
    )
        .into_response())
}
