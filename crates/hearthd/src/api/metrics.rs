//! `GET /metrics`: Prometheus metrics, on the API socket and, with
//! `--metrics-listen ADDR:PORT`, on a TCP listener that serves nothing else.
//! What each metric means: docs/metrics.md.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hearth_engine::Engine;
use hearth_engine::{
    METRICS_PREFIX as PREFIX, ManifestMetrics, ManifestSource, encode_metrics as encode,
};
use prometheus_client::registry::Registry;

const PROMETHEUS_TEXT: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;
const OPENMETRICS_TEXT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The router of the metrics listener: `/metrics` and nothing else.
pub fn listener_router(engine: Arc<Engine>, source: Arc<ManifestSource>) -> Router {
    Router::new()
        .route("/metrics", get(scrape))
        .layer(Extension(source))
        .with_state(engine)
}

pub async fn scrape(
    State(engine): State<Arc<Engine>>,
    source: Option<Extension<Arc<ManifestSource>>>,
    headers: HeaderMap,
) -> Response {
    let sampled = engine.sample_metrics().await;
    let mut registry = Registry::with_prefix(PREFIX);
    engine.metrics().register(&mut registry);
    registry.register_collector(Box::new(sampled));
    if let Some(Extension(source)) = source {
        registry.register_collector(Box::new(ManifestMetrics(source.counters())));
    }
    // Prometheus asks for OpenMetrics first when it can read it.
    let openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("application/openmetrics-text"));
    match encode(&registry, openmetrics) {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                if openmetrics {
                    OPENMETRICS_TEXT
                } else {
                    PROMETHEUS_TEXT
                },
            )],
            text,
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode the metrics: {e}\n"),
        )
            .into_response(),
    }
}
