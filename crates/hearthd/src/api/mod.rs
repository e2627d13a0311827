//! The HTTP API: each handler turns a request into one engine call.
//! The contract is docs/http-api.md.

mod console;
mod export;
mod guest;
pub mod metrics;
pub mod openapi;
mod sources;
mod watch;

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hearth_api::{Kind, Object, object_from_value};
use hearth_engine::{Engine, RequestError, VmAction};
use serde::Deserialize;
use serde_json::{Value, json};

/// Where API-made objects say they came from.
pub const API_OWNER: &str = "api";

/// Largest request body: manifests are small, and an apply is read whole
/// before it is checked (docs/limits.md).
const MAX_BODY: usize = 8 << 20;

pub fn router(engine: Arc<Engine>) -> Router {
    routes()
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .with_state(engine)
}

/// Every route the API answers; `openapi::tests` checks each is in the
/// OpenAPI document.
fn routes() -> Router<Arc<Engine>> {
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/openapi.json", get(openapi::serve))
        .route("/metrics", get(metrics::scrape))
        .route("/v1/apply", post(apply))
        .route("/v1/events", get(events))
        .route("/v1/sources", get(sources::list))
        .route("/v1/watch", get(watch::watch))
        .route("/v1/{plural}", get(watch::list_or_watch))
        .route("/v1/{plural}/{name}", get(get_one).delete(delete))
        .route(
            "/v1/virtualdisksnapshots/{name}/export",
            get(export::export),
        )
        .route("/v1/virtualmachines/{name}/console", get(console::console))
        .route(
            "/v1/virtualmachines/{name}/console/attach",
            get(console::attach),
        )
        .route("/v1/virtualmachines/{name}/agent/ping", post(agent_ping))
        .route("/v1/virtualmachines/{name}/agent/exec", post(agent_exec))
        .route(
            "/v1/virtualmachines/{name}/agent/exec/start",
            post(guest::exec_start),
        )
        .route(
            "/v1/virtualmachines/{name}/agent/exec/{id}",
            get(guest::exec_status),
        )
        .route(
            "/v1/virtualmachines/{name}/agent/files",
            get(guest::get_file).put(guest::put_file),
        )
        .route(
            "/v1/virtualmachines/{name}/agent/fsfreeze-status",
            post(agent_freeze_status),
        )
        .route("/v1/virtualmachines/{name}/restore", post(restore))
        .route(
            "/v1/virtualmachinesnapshotgroups/{name}/restore",
            post(restore_group),
        )
        .route("/v1/virtualmachines/{name}/{action}", post(vm_action))
}

/// An error as the API shows it: a status and `{"error": message}`.
pub struct ApiError(StatusCode, String);

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        let status = match &e {
            RequestError::Invalid(_) | RequestError::BadRequest(_) => StatusCode::BAD_REQUEST,
            RequestError::NotFound(_) => StatusCode::NOT_FOUND,
            RequestError::Conflict(_) => StatusCode::CONFLICT,
            RequestError::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(status, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({"error": self.1}))).into_response()
    }
}

fn kind_of(plural: &str) -> Result<Kind, ApiError> {
    Kind::ALL
        .into_iter()
        .find(|k| k.plural() == plural)
        .ok_or_else(|| {
            ApiError(
                StatusCode::NOT_FOUND,
                format!(
                    "unknown resource {plural:?} (use virtualmachines, virtualdisks, virtualimages, virtualnetworks, virtualdisksnapshots, virtualmachinesnapshots or virtualmachinesnapshotgroups)"
                ),
            )
        })
}

async fn health(State(engine): State<Arc<Engine>>) -> Json<Value> {
    let a = &engine.config.accel;
    Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "accelerator": a.accel.as_str(),
        "acceleratorReason": a.reason,
    }))
}

async fn list(
    State(engine): State<Arc<Engine>>,
    Path(plural): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let kind = kind_of(&plural)?;
    let items: Vec<Value> = engine.list(kind)?.iter().map(|o| o.to_json()).collect();
    Ok(Json(json!({"items": items})))
}

async fn get_one(
    State(engine): State<Arc<Engine>>,
    Path((plural, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let kind = kind_of(&plural)?;
    Ok(Json(engine.get(kind, &name)?.to_json()))
}

async fn apply(
    State(engine): State<Arc<Engine>>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let bad = |m: String| ApiError(StatusCode::BAD_REQUEST, m);
    let body = body.map_err(|r| match r.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "request body is larger than {} MiB ({MAX_BODY} bytes), the most one apply may carry; split the objects over several applies",
                MAX_BODY >> 20
            ),
        ),
        status => ApiError(status, r.body_text()),
    })?;
    let value: Value =
        serde_json::from_slice(&body).map_err(|e| bad(format!("request body is not JSON: {e}")))?;
    let Some(Value::Array(items)) = value.get("items") else {
        return Err(bad("request body must be {\"items\": [objects]}".into()));
    };
    let mut objects: Vec<Object> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let obj = object_from_value(item.clone(), &format!("items[{i}]"))
            .map_err(|e| bad(e.to_string()))?;
        objects.push(obj);
    }
    let outcomes = tokio::task::block_in_place(|| engine.apply(objects, API_OWNER))?;
    Ok(Json(json!({"results": outcomes})))
}

async fn delete(
    State(engine): State<Arc<Engine>>,
    Path((plural, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let kind = kind_of(&plural)?;
    engine.delete(kind, &name, API_OWNER)?;
    Ok(Json(
        json!({"kind": kind, "name": name, "action": "deleted"}),
    ))
}

async fn vm_action(
    State(engine): State<Arc<Engine>>,
    Path((name, action)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let action = match action.as_str() {
        "start" => VmAction::Start,
        "stop" => VmAction::Stop,
        "restart" => VmAction::Restart,
        other => {
            return Err(ApiError(
                StatusCode::NOT_FOUND,
                format!("unknown action {other:?} (use start, stop or restart)"),
            ));
        }
    };
    let message = engine.vm_action(&name, action)?;
    Ok(Json(json!({"message": message})))
}

async fn restore_group(
    State(engine): State<Arc<Engine>>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    // In its own task, like a VM's restore: a client that goes away does not
    // stop it half-way.
    let task = tokio::spawn(async move { engine.restore_group(&name).await });
    let message = task.await.map_err(|e| {
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("restore task failed: {e}"),
        )
    })??;
    Ok(Json(json!({"message": message})))
}

#[derive(Deserialize)]
struct EventQuery {
    kind: Option<String>,
    name: Option<String>,
    limit: Option<usize>,
}

async fn events(
    State(engine): State<Arc<Engine>>,
    Query(q): Query<EventQuery>,
) -> Result<Json<Value>, ApiError> {
    let kind = match q.kind.as_deref() {
        None => None,
        Some(k) => Some(
            Kind::from_user(k)
                .ok_or_else(|| ApiError(StatusCode::BAD_REQUEST, format!("unknown kind {k:?}")))?,
        ),
    };
    let items = engine.events(kind, q.name.as_deref(), q.limit.unwrap_or(100).min(10_000))?;
    Ok(Json(json!({"items": items})))
}

async fn agent_ping(
    State(engine): State<Arc<Engine>>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let started = std::time::Instant::now();
    engine.agent_ping(&name).await?;
    Ok(Json(
        json!({"ok": true, "ms": started.elapsed().as_millis() as u64}),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ExecRequest {
    path: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default = "default_exec_timeout")]
    timeout_seconds: u64,
}

fn default_exec_timeout() -> u64 {
    60
}

async fn agent_exec(
    State(engine): State<Arc<Engine>>,
    Path(name): Path<String>,
    Json(req): Json<ExecRequest>,
) -> Result<Json<Value>, ApiError> {
    let timeout = std::time::Duration::from_secs(req.timeout_seconds.clamp(1, 600));
    let out = engine
        .agent_exec(&name, &req.path, &req.args, timeout)
        .await?;
    Ok(Json(json!({
        "exitCode": out.exit_code,
        "signal": out.signal,
        "stdout": String::from_utf8_lossy(&out.stdout),
        "stderr": String::from_utf8_lossy(&out.stderr),
        "truncated": out.truncated,
    })))
}

async fn agent_freeze_status(
    State(engine): State<Arc<Engine>>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let frozen = engine.agent_freeze_status(&name).await?;
    Ok(Json(
        json!({"status": if frozen { "frozen" } else { "thawed" }}),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RestoreRequest {
    from: String,
}

async fn restore(
    State(engine): State<Arc<Engine>>,
    Path(name): Path<String>,
    Json(req): Json<RestoreRequest>,
) -> Result<Json<Value>, ApiError> {
    // In its own task: a client that goes away must not abort a restore
    // half-way (with the VM stopped and the disks not yet switched).
    let task = tokio::spawn(async move { engine.restore_vm(&name, &req.from).await });
    let message = task.await.map_err(|e| {
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("restore task failed: {e}"),
        )
    })??;
    Ok(Json(json!({"message": message})))
}
