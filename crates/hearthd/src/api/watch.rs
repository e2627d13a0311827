//! `GET /v1/watch` and `GET /v1/{plural}?watch=true`: the change stream, as
//! JSON lines (`application/x-ndjson`, chunked). The stream itself is
//! `hearth_engine::watch`; this only reads the query and frames the lines.
//! The contract is docs/http-api.md "Watching".

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use hearth_api::{Kind, check_dns_label};
use hearth_engine::Engine;
use hearth_engine::watch::{Filter, Options};
use serde::Deserialize;

use super::request::{ApiPath, ApiQuery};
use super::{ApiError, redact_shown};

/// Bookmarks while nothing happens, unless the client asks otherwise.
const DEFAULT_HEARTBEAT_SECONDS: u64 = 15;
const MAX_HEARTBEAT_SECONDS: u64 = 300;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatchQuery {
    /// Comma-separated kinds (plurals, kind names or the CLI's short names).
    kinds: Option<String>,
    name: Option<String>,
    since: Option<u64>,
    objects: Option<bool>,
    events: Option<bool>,
    /// Events in the initial list.
    limit: Option<usize>,
    /// Seconds between bookmarks while idle.
    heartbeat: Option<u64>,
}

/// The query of a list that may be a watch; other parameters are ignored,
/// as a plain list always ignored them.
#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    #[serde(default)]
    watch: bool,
    since: Option<u64>,
    name: Option<String>,
    heartbeat: Option<u64>,
}

fn bad(message: String) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, message)
}

pub async fn watch(
    State(engine): State<Arc<Engine>>,
    ApiQuery(q): ApiQuery<WatchQuery>,
) -> Result<Response, ApiError> {
    let mut kinds = Vec::new();
    let mut sources = false;
    for word in q.kinds.iter().flat_map(|k| k.split(',')) {
        let word = word.trim();
        if word.is_empty() {
            continue;
        }
        if matches!(word, "sources" | "source" | "Source") {
            // The events of sources of manifests (they are not objects).
            sources = true;
            continue;
        }
        let kind = Kind::from_user(word).ok_or_else(|| {
            bad(format!(
                "query parameter kinds: unknown kind {word:?} (use virtualmachines, virtualdisks, \
                 virtualimages, virtualnetworks, virtualdisksnapshots, virtualmachinesnapshots, \
                 or sources for the events of sources of manifests)"
            ))
        })?;
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    }
    let filter = Filter {
        kinds,
        sources,
        name: checked_name(q.name)?,
        objects: q.objects.unwrap_or(true),
        events: q.events.unwrap_or(false),
    };
    if !filter.objects && !filter.events {
        return Err(bad(
            "query parameters objects and events are both false: nothing to watch".into(),
        ));
    }
    let options = Options {
        since: q.since,
        initial_events: super::events_limit(q.limit)?,
        heartbeat: heartbeat(q.heartbeat)?,
    };
    stream(&engine, filter, options)
}

/// `GET /v1/{plural}`: the list, or with `watch=true` the stream of that kind.
pub async fn list_or_watch(
    State(engine): State<Arc<Engine>>,
    ApiPath(plural): ApiPath<String>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Response, ApiError> {
    if !q.watch {
        return super::list(&engine, &plural)
            .await
            .map(IntoResponse::into_response);
    }
    let kind = super::kind_of(&plural)?;
    let filter = Filter {
        kinds: vec![kind],
        sources: false,
        name: checked_name(q.name)?,
        objects: true,
        events: false,
    };
    let options = Options {
        since: q.since,
        initial_events: 0,
        heartbeat: heartbeat(q.heartbeat)?,
    };
    stream(&engine, filter, options)
}

fn checked_name(name: Option<String>) -> Result<Option<String>, ApiError> {
    match name {
        Some(n) => check_dns_label(&n)
            .map(|()| Some(n))
            .map_err(|e| bad(format!("query parameter name: {e}"))),
        None => Ok(None),
    }
}

fn heartbeat(seconds: Option<u64>) -> Result<Duration, ApiError> {
    match seconds.unwrap_or(DEFAULT_HEARTBEAT_SECONDS) {
        s @ 1..=MAX_HEARTBEAT_SECONDS => Ok(Duration::from_secs(s)),
        s => Err(bad(format!(
            "query parameter heartbeat: {s} is not between 1 and {MAX_HEARTBEAT_SECONDS} seconds"
        ))),
    }
}

fn stream(engine: &Engine, filter: Filter, options: Options) -> Result<Response, ApiError> {
    let watch = engine.watch(filter, options).map_err(|e| {
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot read the store: {e}"),
        )
    })?;
    // Ends when the client goes (the body is dropped) or the store fails
    // (the client reconnects with its last seq).
    let lines = futures_util::stream::unfold(watch, |mut w| async move {
        match w.next().await {
            Ok(Some(line)) => {
                let mut line = serde_json::to_value(&line).unwrap_or_default();
                if let Some(object) = line.get_mut("object") {
                    redact_shown(object);
                }
                if let Some(event) = line.get_mut("event") {
                    hearth_api::redact::redact_json(event);
                }
                Some((Ok::<Bytes, Infallible>(super::json_line(&line)), w))
            }
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(error = %e, "ending a watch stream: cannot read the store");
                None
            }
        }
    });
    Ok((
        [
            (header::CONTENT_TYPE, super::NDJSON),
            (header::CACHE_CONTROL, "no-store"),
        ],
        Body::from_stream(lines),
    )
        .into_response())
}
