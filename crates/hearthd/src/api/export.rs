//! `GET /v1/virtualdisksnapshots/{name}/export?format=qcow2|raw`: a disk
//! snapshot as one standalone image, streamed. hearthd converts it into a
//! private, already unlinked file first (`hearth_engine::snapshot::export`)
//! and answers once the conversion is done, with the length known; it never
//! writes anywhere the client names.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use hearth_engine::Engine;
use hearth_engine::ExportFormat;
use serde::Deserialize;
use tokio::io::AsyncReadExt;

use super::ApiError;
use super::request::{ApiPath, ApiQuery};

/// The image format of the body (`qcow2` or `raw`).
pub const FORMAT_HEADER: &str = "x-hearth-export-format";
/// The disk's size as the guest sees it, in bytes.
pub const VIRTUAL_SIZE_HEADER: &str = "x-hearth-virtual-size";
/// Bytes read from the file per body chunk.
const CHUNK: usize = 256 << 10;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportQuery {
    format: Option<String>,
}

pub async fn export(
    State(engine): State<Arc<Engine>>,
    ApiPath(name): ApiPath<String>,
    ApiQuery(q): ApiQuery<ExportQuery>,
) -> Result<Response, ApiError> {
    let format = ExportFormat::parse(q.format.as_deref().unwrap_or("qcow2")).map_err(|e| {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!("VirtualDiskSnapshot {name:?}: {e}"),
        )
    })?;
    let export = engine.export_snapshot(&name, format).await?;
    let (size, virtual_size) = (export.size, export.virtual_size);
    let file = tokio::fs::File::from_std(export.file);
    let stream = futures_util::stream::unfold(Some((file, 0u64)), move |state| async move {
        let (mut file, sent) = state?;
        if sent >= size {
            return None;
        }
        let mut buf = vec![0u8; CHUNK];
        match file.read(&mut buf).await {
            Ok(0) => Some((
                Err(std::io::Error::other(format!(
                    "the export ended after {sent} of {size} bytes"
                ))),
                None,
            )),
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(Bytes::from(buf)), Some((file, sent + n as u64))))
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading an export failed");
                Some((Err(e), None))
            }
        }
    });
    let mut response = Body::from_stream(stream).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/octet-stream"),
    );
    headers.insert(header::CONTENT_LENGTH, size.into());
    headers.insert(
        FORMAT_HEADER,
        header::HeaderValue::from_static(format.as_str()),
    );
    headers.insert(VIRTUAL_SIZE_HEADER, virtual_size.into());
    Ok(response)
}
