//! `GET /v1/sources`: the sources of desired state as hearthd sees them.
//! The manifest directory's view is the top level (every file, what it
//! declares and in what state, parse errors with line and column,
//! conflicts, pending deletes, how the last re-list went); `sources` lists
//! every source with its kind and state: the directory and each git
//! repository (URL, ref, the fetched and the applied commit, why it is
//! Stale). Read only, but for `POST /v1/sources/{name}/refresh`, which
//! fetches a git source now.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::Extension;
use axum::http::StatusCode;
use hearth_engine::{GitSources, ManifestSource};
use serde_json::{Value, json};

use super::ApiError;
use super::request::ApiPath;

/// How long a refresh waits for its fetch and apply.
const REFRESH_WAIT: Duration = Duration::from_secs(120);

pub async fn list(
    Extension(source): Extension<Arc<ManifestSource>>,
    Extension(git): Extension<Arc<GitSources>>,
) -> Result<Json<Value>, ApiError> {
    // The view waits for a running re-list: keep it off the async workers.
    tokio::task::spawn_blocking(move || {
        let mut view = source.view();
        // A missing directory is unknown, not empty: held, nothing deleted.
        let missing = view["directoryPresent"] == Value::Bool(false);
        let mut all = vec![json!({
            "name": "directory",
            "kind": "directory",
            "path": source.dir().display().to_string(),
            "state": if missing { "Stale" } else { "Ready" },
            "reason": missing.then(|| {
                let why = view["missingReason"].as_str().unwrap_or("it is missing");
                format!("{why}; waiting for it, nothing is deleted")
            }),
        })];
        all.extend(git.sources.iter().map(|g| g.view()));
        if let Value::Object(map) = &mut view {
            map.insert("sources".into(), Value::Array(all));
        }
        hearth_api::redact::redact_json(&mut view);
        view
    })
    .await
    .map(Json)
    .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// Fetches the git source `name` now and answers with its view once that
/// fetch and its apply are done.
pub async fn refresh(
    Extension(git): Extension<Arc<GitSources>>,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    let Some(source) = git.find(&name).cloned() else {
        let known: Vec<&str> = git.sources.iter().map(|s| s.name()).collect();
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!(
                "no git source {name:?} (configured: {})",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            ),
        ));
    };
    source.refresh(REFRESH_WAIT).await;
    let mut view = tokio::task::spawn_blocking(move || source.view())
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    hearth_api::redact::redact_json(&mut view);
    Ok(Json(view))
}
