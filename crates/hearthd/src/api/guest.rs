//! Guest access through the agent: programs (`hearth exec`) and files
//! (`hearth cp`). Each handler is one engine call; the engine makes every
//! agent request on its own, so none holds the channel between two.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use futures_util::StreamExt;
use hearth_engine::Engine;
use hearth_engine::ExecStatus;
use serde::Deserialize;
use serde_json::{Value, json};

use super::ApiError;
use super::request::{ApiPath, ApiQuery, JsonBody};

/// The size of a guest file being read, when the guest's `stat` told it.
pub const SIZE_HEADER: &str = "x-hearth-file-size";
/// Its permission bits, octal (`0750`).
pub const MODE_HEADER: &str = "x-hearth-file-mode";
/// The mode a file written into a guest gets when the request names none.
const DEFAULT_MODE: u32 = 0o644;

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

fn bad(message: String) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, message)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct StartRequest {
    path: String,
    #[serde(default)]
    args: Vec<String>,
    /// The program's stdin, base64.
    stdin_base64: Option<String>,
}

/// `POST /v1/virtualmachines/{name}/agent/exec/start`: starts a program and
/// returns at once with its session id and guest pid.
pub async fn exec_start(
    State(engine): State<Arc<Engine>>,
    ApiPath(name): ApiPath<String>,
    JsonBody(req): JsonBody<StartRequest>,
) -> Result<Json<Value>, ApiError> {
    let input = match &req.stdin_base64 {
        None => None,
        Some(text) => Some(
            b64()
                .decode(text)
                .map_err(|e| bad(format!("stdinBase64: not base64: {e}")))?,
        ),
    };
    let started = engine
        .exec_start(&name, &req.path, &req.args, input.as_deref())
        .await?;
    Ok(Json(json!({"id": started.id, "pid": started.pid})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct StatusQuery {
    /// Wait up to this many milliseconds for the program to end (at most
    /// 30 000).
    #[serde(default)]
    wait_ms: u64,
}

/// The longest `waitMs`: the engine's own longest wait.
const MAX_WAIT_MS: u64 = hearth_engine::EXEC_MAX_WAIT.as_millis() as u64;

#[derive(Deserialize)]
pub struct ExecPath {
    name: String,
    id: u64,
}

/// `GET /v1/virtualmachines/{name}/agent/exec/{id}`: the program's state;
/// once it has ended, its exit and output (given once).
pub async fn exec_status(
    State(engine): State<Arc<Engine>>,
    ApiPath(ExecPath { name, id }): ApiPath<ExecPath>,
    ApiQuery(q): ApiQuery<StatusQuery>,
) -> Result<Json<Value>, ApiError> {
    if q.wait_ms > MAX_WAIT_MS {
        return Err(bad(format!(
            "query parameter waitMs: {} is more than the {MAX_WAIT_MS} allowed",
            q.wait_ms
        )));
    }
    let wait = Duration::from_millis(q.wait_ms);
    Ok(Json(match engine.exec_status(&name, id, wait).await? {
        ExecStatus::Running { pid } => json!({"id": id, "pid": pid, "exited": false}),
        ExecStatus::Exited { pid, output } => json!({
            "id": id,
            "pid": pid,
            "exited": true,
            "exitCode": output.exit_code,
            "signal": output.signal,
            "stdoutBase64": b64().encode(&output.stdout),
            "stderrBase64": b64().encode(&output.stderr),
            "truncated": output.truncated,
        }),
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileQuery {
    path: String,
    /// Octal permission bits for a file written into the guest (`750`).
    mode: Option<String>,
}

/// `PUT /v1/virtualmachines/{name}/agent/files?path=/abs/path&mode=750`:
/// the request body becomes the file. Nothing is under the final name until
/// the whole body has arrived.
pub async fn put_file(
    State(engine): State<Arc<Engine>>,
    ApiPath(name): ApiPath<String>,
    ApiQuery(q): ApiQuery<FileQuery>,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let mode = match q.mode.as_deref() {
        None => DEFAULT_MODE,
        Some(text) => u32::from_str_radix(text, 8)
            .ok()
            .filter(|m| *m <= 0o777)
            .ok_or_else(|| {
                bad(format!(
                    "mode {text:?} is not an octal permission mode (0 to 777)"
                ))
            })?,
    };
    let mut upload = engine.upload_begin(&name, &q.path, Some(mode)).await?;
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            bad(format!(
                "VirtualMachine {name:?}: the upload of {} broke off after {} bytes: {e}",
                q.path,
                upload.bytes_written()
            ))
        })?;
        upload.write(&chunk).await?;
    }
    let done = upload.finish().await?;
    Ok(Json(json!({
        "path": done.path,
        "bytes": done.bytes,
        "mode": done.mode.map(|m| format!("{m:04o}")),
        "warning": done.mode_warning,
    })))
}

/// `GET /v1/virtualmachines/{name}/agent/files?path=/abs/path`: the file's
/// bytes as they are read, with its size and mode in headers when known. A
/// read that fails half-way ends the connection without the final chunk,
/// so the client sees an incomplete answer, never a short file as whole.
pub async fn get_file(
    State(engine): State<Arc<Engine>>,
    ApiPath(name): ApiPath<String>,
    ApiQuery(q): ApiQuery<FileQuery>,
) -> Result<Response, ApiError> {
    if q.mode.is_some() {
        return Err(bad(
            "mode is for writing a file (PUT), not reading one".into()
        ));
    }
    let download = engine.download_begin(&name, &q.path).await?;
    let (size, mode) = (download.size, download.mode);
    let stream = futures_util::stream::unfold(Some(download), |state| async move {
        let mut download = state?;
        match download.next_chunk().await {
            Ok(Some(data)) => Some((Ok(Bytes::from(data)), Some(download))),
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(error = %e, "copy out of the guest failed");
                Some((Err(std::io::Error::other(e.to_string())), None))
            }
        }
    });
    let mut response = Body::from_stream(stream).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/octet-stream"),
    );
    if let Some(size) = size {
        headers.insert(SIZE_HEADER, size.into());
    }
    if let Some(mode) = mode
        && let Ok(v) = header::HeaderValue::from_str(&format!("{mode:04o}"))
    {
        headers.insert(MODE_HEADER, v);
    }
    Ok(response)
}
