//! `GET /v1/virtualmachines/{name}/console`: the serial console log, and with
//! `follow=true` everything written to it afterwards.

use std::io::SeekFrom;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use hearth_api::Kind;
use hearth_engine::Engine;
use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use super::ApiError;

const POLL: Duration = Duration::from_millis(200);
const CHUNK: usize = 64 << 10;

#[derive(Deserialize)]
pub struct ConsoleQuery {
    #[serde(default)]
    follow: bool,
}

struct Tail {
    engine: Arc<Engine>,
    vm: String,
    path: std::path::PathBuf,
    file: Option<tokio::fs::File>,
    offset: u64,
    follow: bool,
}

pub async fn console(
    State(engine): State<Arc<Engine>>,
    Path(name): Path<String>,
    Query(q): Query<ConsoleQuery>,
) -> Result<Response, ApiError> {
    let path = engine.console_path(&name)?;
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
            }
            if let Some(f) = t.file.as_mut() {
                // The log is truncated when the VM starts again: start over.
                let len = f.metadata().await.map(|m| m.len()).unwrap_or(0);
                if len < t.offset {
                    t.offset = 0;
                }
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
                .store
                .get(Kind::VirtualMachine, &t.vm)
                .ok()
                .flatten()
                .is_some();
            if !t.follow || !vm_exists {
                return None;
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
