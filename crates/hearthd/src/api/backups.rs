//! `GET /v1/backups/verify?dir=DIR[&at=N]`: every file of a backup target checked against
//! its manifest (docs/backup.md, "Verify"): a JSON line with what will be
//! read, one per file as it is checked, one about every second with the
//! bytes read so far, then the summary. Reads the target, never writes it.

use std::path::PathBuf;

use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use hearth_engine::{BackupReport, BackupTarget};
use serde::Deserialize;
use serde_json::json;

use super::request::ApiQuery;
use super::{ApiError, NDJSON, json_line};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyQuery {
    /// The target directory, absolute, on hearthd's host.
    dir: PathBuf,
    /// The newest point checked (every point when absent).
    at: Option<u32>,
}

pub async fn verify(ApiQuery(req): ApiQuery<VerifyQuery>) -> Result<Response, ApiError> {
    let dir = req.dir;
    let target = tokio::task::spawn_blocking(move || BackupTarget::open(&dir))
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|why| ApiError(StatusCode::BAD_REQUEST, format!("dir: {why}")))?;
    let (lines, rx) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
    let at = req.at;
    tokio::spawn(async move {
        let gone = lines.clone();
        let check = target.verify(at, |report| {
            let v = match report {
                BackupReport::Plan { files, bytes } => {
                    json!({"plan": {"files": files, "bytes": bytes}})
                }
                BackupReport::Progress { bytes_done } => {
                    json!({"progress": {"bytesDone": bytes_done}})
                }
                BackupReport::File(check) => json!({ "file": check }),
            };
            let _ = lines.send(json_line(&v));
        });
        // A client that hangs up ends the check: nobody reads its result.
        tokio::select! {
            summary = check => {
                let _ = gone.send(json_line(&json!({ "summary": summary })));
            }
            () = gone.closed() => {}
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<Bytes, std::io::Error>(b), rx))
    });
    Ok(([(header::CONTENT_TYPE, NDJSON)], Body::from_stream(stream)).into_response())
}
