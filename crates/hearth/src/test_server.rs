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

/// What the server answers.
enum Script {
    /// One answer per connection, in order; the last one repeats.
    InOrder { answers: Vec<Answer>, next: usize },
    /// Per `METHOD PATH`: its own answers in order, the last one repeating;
    /// anything else is a 404.
    Routes(Vec<Route>),
}

struct Route {
    method: String,
    path: String,
    answers: Vec<Answer>,
    next: usize,
}

/// A status and a body.
pub type Answer = (StatusCode, String);

impl Script {
    fn answer(&mut self, method: &str, path: &str) -> Answer {
        fn take(answers: &[Answer], next: &mut usize) -> Option<Answer> {
            let a = answers.get(*next).or(answers.last()).cloned();
            *next += 1;
            a
        }
        let found = match self {
            Script::InOrder { answers, next } => take(answers, next),
            Script::Routes(routes) => routes
                .iter_mut()
                .find(|r| r.method == method && r.path == path)
                .and_then(|r| take(&r.answers, &mut r.next)),
        };
        found.unwrap_or_else(|| {
            (
                StatusCode::NOT_FOUND,
                format!(r#"{{"error": "the test server has no answer for {method} {path}"}}"#),
            )
        })
    }
}

impl ScriptedServer {
    /// Starts serving `script` in order, one response per connection; after
    /// the last one the last answer repeats.
    pub fn start(dir: &Path, script: Vec<(StatusCode, String)>) -> Self {
        Self::serve(
            dir,
            Script::InOrder {
                answers: script,
                next: 0,
            },
        )
    }

    /// Answers by route: each `(method, path, answers)` plays its own answers
    /// in order (the last repeats), so several objects polled in turn can
    /// each follow their own story.
    pub fn routes(dir: &Path, routes: Vec<(&str, &str, Vec<Answer>)>) -> Self {
        Self::serve(
            dir,
            Script::Routes(
                routes
                    .into_iter()
                    .map(|(method, path, answers)| Route {
                        method: method.to_string(),
                        path: path.to_string(),
                        answers,
                        next: 0,
                    })
                    .collect(),
            ),
        )
    }

    fn serve(dir: &Path, script: Script) -> Self {
        let socket = dir.join("hearthd.sock");
        let listener = UnixListener::bind(&socket).expect("bind test socket");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        let script = Arc::new(Mutex::new(script));
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let log = Arc::clone(&log);
                let script = Arc::clone(&script);
                let service = service_fn(move |req: Request<Incoming>| {
                    let log = Arc::clone(&log);
                    let script = Arc::clone(&script);
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
                        let (status, body) = script
                            .lock()
                            .expect("script lock")
                            .answer(&seen.method, &seen.path);
                        // A stream path answered with lines is JSON lines
                        // (the change stream, a backup check); anything
                        // else is plain JSON, as an older hearthd answers
                        // `?watch=true`.
                        let watch = status.is_success()
                            && (seen.path.starts_with("/v1/watch")
                                || seen.path.starts_with("/v1/backups/verify")
                                || seen.path.contains("?watch=true"))
                            && body.contains('\n');
                        if let Ok(mut l) = log.lock() {
                            l.push(seen);
                        }
                        let content_type = if watch {
                            "application/x-ndjson"
                        } else {
                            "application/json"
                        };
                        let response = Response::builder()
                            .status(status)
                            .header(header::CONTENT_TYPE, content_type)
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
