//! `GET /v1/sources`: the manifest directory as hearthd sees it — every file,
//! what it declares and in what state, parse errors with line and column,
//! conflicts, pending deletes, and how the last re-list went. Read only.

use std::sync::Arc;

use axum::Json;
use axum::extract::Extension;
use axum::http::StatusCode;
use hearth_engine::ManifestSource;
use serde_json::Value;

use super::ApiError;

pub async fn list(
    Extension(source): Extension<Arc<ManifestSource>>,
) -> Result<Json<Value>, ApiError> {
    // The view waits for a running re-list: keep it off the async workers.
    tokio::task::spawn_blocking(move || {
        let mut view = source.view();
        hearth_api::redact::redact_json(&mut view);
        view
    })
    .await
    .map(Json)
    .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}
