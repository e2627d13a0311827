//! A scripted stand-in for hearthd in tests: a unix socket that answers each
//! connection with the next canned response and records what it was asked.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode, header};
use hyper_util::rt::TokioIo;
use tokio::net::UnixListener;

/// One request as the server saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub content_type: Option<String>,
    pub body: Vec<u8>,
}

pub struct ScriptedServer {
    pub socket: PathBuf,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl ScriptedServer {
    /// Starts serving `script` in order, one response per connection; after
    /// the last one the last answer repeats.
    pub fn start(dir: &Path, script: Vec<(StatusCode, String)>) -> Self {
        let socket = dir.join("hearthd.sock");
        let listener = UnixListener::bind(&socket).expect("bind test socket");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        tokio::spawn(async move {
            let mut next = 0usize;
            while let Ok((stream, _)) = listener.accept().await {
                let Some((status, body)) = script.get(next).or(script.last()).cloned() else {
                    return;
                };
                next += 1;
                let log = Arc::clone(&log);
                let service = service_fn(move |req: Request<Incoming>| {
                    let log = Arc::clone(&log);
                    let body = body.clone();
                    async move {
                        let seen = Seen {
                            method: req.method().to_string(),
                            path: req
                                .uri()
                                .path_and_query()
                                .map(|p| p.to_string())
                                .unwrap_or_default(),
                            content_type: req
                                .headers()
                                .get(header::CONTENT_TYPE)
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_string),
                            body: req
                                .into_body()
                                .collect()
                                .await
                                .map(|b| b.to_bytes().to_vec())
                                .unwrap_or_default(),
                        };
                        if let Ok(mut l) = log.lock() {
                            l.push(seen);
                        }
                        let response = Response::builder()
                            .status(status)
                            .header(header::CONTENT_TYPE, "application/json")
                            .body(Full::new(Bytes::from(body)))
                            .expect("canned response");
                        Ok::<_, Infallible>(response)
                    }
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        ScriptedServer { socket, seen }
    }

    /// Every request so far, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

pub fn ok(body: &str) -> (StatusCode, String) {
    (StatusCode::OK, body.to_string())
}
