//! The HTTP API: each handler turns a request into one engine call.
//! The contract is docs/http-api.md.

mod backups;
mod console;
mod export;
mod guest;
pub mod metrics;
pub mod openapi;
pub mod request;
mod sources;
mod watch;

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hearth_api::redact::{is_redacted_form_of, redact_credentials, redact_json};
use hearth_api::{ImageSource, Kind, Object, object_from_value};
use hearth_engine::store::StoredObject;
use hearth_engine::{ApplyMode, Engine, Refusal, RequestError, VmAction};
use serde::Deserialize;
use serde_json::{Value, json};

use request::{ApiPath, ApiQuery, JsonBody, MAX_BODY};

/// Where API-made objects say they came from.
pub const API_OWNER: &str = "api";

/// The most events one answer (or a watch's initial list) holds, and how
/// many it holds unless asked.
pub const MAX_EVENTS: usize = 10_000;
pub const DEFAULT_EVENTS: usize = 100;

pub fn router(engine: Arc<Engine>) -> Router {
    routes()
        .fallback(request::no_route)
        .method_not_allowed_fallback(request::no_method)
        .layer(axum::middleware::map_response(request::errors_as_json))
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
        .route("/v1/sources/{name}/refresh", post(sources::refresh))
        .route("/v1/watch", get(watch::watch))
        .route("/v1/{plural}", get(watch::list_or_watch))
        .route(
            "/v1/{plural}/{name}",
            get(get_one).delete(delete).patch(patch_labels),
        )
        .route(
            "/v1/virtualdisksnapshots/{name}/export",
            get(export::export),
        )
        .route("/v1/backups/verify", get(backups::verify))
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

/// The media type of a streamed answer: one JSON document per line.
pub const NDJSON: &str = "application/x-ndjson";

/// One line of such an answer.
pub fn json_line(v: &impl serde::Serialize) -> axum::body::Bytes {
    let mut bytes = serde_json::to_vec(v).unwrap_or_default();
    bytes.push(b'\n');
    axum::body::Bytes::from(bytes)
}

/// An error as the API shows it: a status and `{"error": message}`.
pub struct ApiError(StatusCode, String);

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        let status = match e.refusal() {
            Refusal::BadRequest => StatusCode::BAD_REQUEST,
            Refusal::NotFound => StatusCode::NOT_FOUND,
            Refusal::Conflict => StatusCode::CONFLICT,
            Refusal::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(status, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({"error": redact_credentials(&self.1)}))).into_response()
    }
}

/// An object as the API shows it: its status, and the URL of an image's
/// source, without the credentials a URL may carry (docs/http-api.md).
pub fn shown(object: &StoredObject) -> Value {
    let mut v = object.to_json();
    redact_shown(&mut v);
    v
}

/// [`shown`] for an object already in its JSON form.
pub fn redact_shown(object: &mut Value) {
    if let Some(status) = object.get_mut("status") {
        redact_json(status);
    }
    if let Some(Value::String(url)) = object.pointer_mut("/spec/source/http/url")
        && let std::borrow::Cow::Owned(r) = redact_credentials(url)
    {
        *url = r;
    }
}

/// An image sent back as hearthd showed it keeps the credentials of its
/// stored URL: the shown one is the stored one with them hidden.
fn keep_stored_credentials(engine: &Engine, object: &mut Object) -> Result<(), ApiError> {
    let Object::VirtualImage(image) = object else {
        return Ok(());
    };
    let ImageSource::Http(http) = &mut image.spec.source else {
        return Ok(());
    };
    let Some(stored) = engine.find(Kind::VirtualImage, &image.metadata.name)? else {
        return Ok(());
    };
    if let Object::VirtualImage(stored) = stored.object
        && let ImageSource::Http(stored) = stored.spec.source
        && is_redacted_form_of(&http.url, &stored.url)
    {
        http.url = stored.url;
    }
    Ok(())
}

impl From<hearth_engine::store::StoreError> for ApiError {
    fn from(e: hearth_engine::store::StoreError) -> Self {
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot read the store: {e}"),
        )
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
    let a = &engine.config().accel;
    Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "accelerator": a.accel.as_str(),
        "acceleratorReason": a.reason,
    }))
}

async fn list(engine: &Engine, plural: &str) -> Result<Json<Value>, ApiError> {
    let kind = kind_of(plural)?;
    let items: Vec<Value> = engine.list(kind)?.iter().map(shown).collect();
    Ok(Json(json!({"items": items})))
}

async fn get_one(
    State(engine): State<Arc<Engine>>,
    ApiPath((plural, name)): ApiPath<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let kind = kind_of(&plural)?;
    Ok(Json(shown(&engine.get(kind, &name)?)))
}

/// `PATCH /v1/{plural}/{name}`'s body: a merge patch of the labels only
/// (`null` removes a label).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LabelPatch {
    metadata: LabelPatchMeta,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LabelPatchMeta {
    labels: std::collections::BTreeMap<String, Option<String>>,
}

async fn patch_labels(
    State(engine): State<Arc<Engine>>,
    ApiPath((plural, name)): ApiPath<(String, String)>,
    JsonBody(patch): JsonBody<LabelPatch>,
) -> Result<Json<Value>, ApiError> {
    let kind = kind_of(&plural)?;
    let stored = engine.relabel(kind, &name, &patch.metadata.labels, API_OWNER)?;
    Ok(Json(shown(&stored)))
}

/// `POST /v1/apply`'s body: nothing but the objects.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ApplyRequest {
    items: Vec<Value>,
}

/// `POST /v1/apply?create=true`: only create; an object that exists is a
/// 409 and nothing is written.
#[derive(Deserialize)]
struct ApplyQuery {
    #[serde(default)]
    create: bool,
}

async fn apply(
    State(engine): State<Arc<Engine>>,
    ApiQuery(q): ApiQuery<ApplyQuery>,
    JsonBody(body): JsonBody<ApplyRequest>,
) -> Result<Json<Value>, ApiError> {
    let mut objects: Vec<Object> = Vec::with_capacity(body.items.len());
    for (i, item) in body.items.into_iter().enumerate() {
        let mut obj = object_from_value(item, &format!("items[{i}]"))
            .map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.to_string()))?;
        keep_stored_credentials(&engine, &mut obj)?;
        objects.push(obj);
    }
    let mode = if q.create {
        ApplyMode::CreateOnly
    } else {
        ApplyMode::CreateOrUpdate
    };
    let outcomes = tokio::task::block_in_place(|| engine.apply_with(objects, API_OWNER, mode))?;
    Ok(Json(json!({"results": outcomes})))
}

async fn delete(
    State(engine): State<Arc<Engine>>,
    ApiPath((plural, name)): ApiPath<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let kind = kind_of(&plural)?;
    engine.delete(kind, &name, API_OWNER)?;
    Ok(Json(
        json!({"kind": kind, "name": name, "action": "deleted"}),
    ))
}

async fn vm_action(
    State(engine): State<Arc<Engine>>,
    ApiPath((name, action)): ApiPath<(String, String)>,
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
    ApiPath(name): ApiPath<String>,
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

/// A `limit` of events asked for, checked against [`MAX_EVENTS`].
pub fn events_limit(limit: Option<usize>) -> Result<usize, ApiError> {
    match limit.unwrap_or(DEFAULT_EVENTS) {
        n @ 0..=MAX_EVENTS => Ok(n),
        n => Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!("query parameter limit: {n} is more than the {MAX_EVENTS} events allowed"),
        )),
    }
}

async fn events(
    State(engine): State<Arc<Engine>>,
    ApiQuery(q): ApiQuery<EventQuery>,
) -> Result<Json<Value>, ApiError> {
    let kind = match q.kind.as_deref() {
        None => None,
        Some(k) => Some(
            Kind::from_user(k)
                .ok_or_else(|| ApiError(StatusCode::BAD_REQUEST, format!("unknown kind {k:?}")))?,
        ),
    };
    let items = engine.events(kind, q.name.as_deref(), events_limit(q.limit)?)?;
    let mut items = serde_json::to_value(items).map_err(|e| {
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot write the events: {e}"),
        )
    })?;
    redact_json(&mut items);
    Ok(Json(json!({"items": items})))
}

async fn agent_ping(
    State(engine): State<Arc<Engine>>,
    ApiPath(name): ApiPath<String>,
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

/// The longest `timeoutSeconds` of `POST .../agent/exec`.
const MAX_EXEC_TIMEOUT_SECONDS: u64 = 600;

async fn agent_exec(
    State(engine): State<Arc<Engine>>,
    ApiPath(name): ApiPath<String>,
    JsonBody(req): JsonBody<ExecRequest>,
) -> Result<Json<Value>, ApiError> {
    if !(1..=MAX_EXEC_TIMEOUT_SECONDS).contains(&req.timeout_seconds) {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!(
                "request body: timeoutSeconds: {} is not between 1 and {MAX_EXEC_TIMEOUT_SECONDS}",
                req.timeout_seconds
            ),
        ));
    }
    let timeout = std::time::Duration::from_secs(req.timeout_seconds);
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
    ApiPath(name): ApiPath<String>,
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
    ApiPath(name): ApiPath<String>,
    JsonBody(req): JsonBody<RestoreRequest>,
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

#[cfg(test)]
mod tests {
    use hearth_engine::{
        ApplyConflict, ExportError, GuestAccessError, NetworkConflict, RequestError, RestoreError,
    };

    use super::*;

    /// Each subsystem's refusals keep the status and text they had.
    #[test]
    fn refusals_keep_their_status() {
        let cases: Vec<(RequestError, StatusCode, &str)> = vec![
            (
                ApplyConflict::AlwaysOff { vm: "a".into() }.into(),
                StatusCode::CONFLICT,
                r#"VirtualMachine "a" has spec.runPolicy AlwaysOff; set it to AlwaysOn or Manual to start it"#,
            ),
            (
                NetworkConflict::NetworkDeleting {
                    vm: "a".into(),
                    index: 0,
                    network: "lan".into(),
                }
                .into(),
                StatusCode::CONFLICT,
                r#"VirtualMachine "a": spec.networks[0].virtualNetworkName: VirtualNetwork "lan" is being deleted"#,
            ),
            (
                RestoreError::Running { vm: "a".into() }.into(),
                StatusCode::CONFLICT,
                r#"VirtualMachine "a" is running; stop it first (nothing was restored)"#,
            ),
            (
                ExportError::NoLayer {
                    snapshot: "s".into(),
                }
                .into(),
                StatusCode::CONFLICT,
                r#"VirtualDiskSnapshot "s" is Ready but has no stored layer"#,
            ),
            (
                GuestAccessError::NoAgent { vm: "a".into() }.into(),
                StatusCode::CONFLICT,
                r#"VirtualMachine "a" has no guest agent (spec.guestAgent is false)"#,
            ),
            (
                RequestError::NotRunning { vm: "a".into() },
                StatusCode::CONFLICT,
                r#"VirtualMachine "a" is not running"#,
            ),
            (
                RequestError::Guest {
                    vm: "a".into(),
                    message: "no program to run (path is empty)".into(),
                },
                StatusCode::BAD_REQUEST,
                r#"VirtualMachine "a": no program to run (path is empty)"#,
            ),
            (
                RequestError::NotInGuest {
                    vm: "a".into(),
                    what: "no such file /x".into(),
                },
                StatusCode::NOT_FOUND,
                r#"VirtualMachine "a": no such file /x"#,
            ),
        ];
        for (e, status, text) in cases {
            let ApiError(got, message) = ApiError::from(e);
            assert_eq!((got, message.as_str()), (status, text));
        }
    }
}
