//! A small HTTP/1.1 client for hearthd's API on a unix socket.
//!
//! One connection per request: the CLI makes a handful of requests per run,
//! and a fresh connection never inherits a half-read answer from an earlier one.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::UnixStream;

pub const DEFAULT_SOCKET: &str = "/run/hearth/hearthd.sock";

/// hearthd answers are small; anything bigger than this is not hearthd.
const MAX_BODY_BYTES: usize = 64 << 20;

/// How long a plain request (not a log stream) may take, headers and body.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The socket is missing, refuses connections or is not ours to open.
    #[error("cannot reach hearthd at {}: {cause} ({hint})", .socket.display())]
    Unreachable {
        socket: PathBuf,
        cause: io::Error,
        hint: &'static str,
    },
    /// hearthd answered with an error status; `message` is its
    /// `{"error": ...}` text, verbatim.
    #[error("{message}")]
    Server { status: StatusCode, message: String },
    /// The exchange broke down or the answer was not what the API promises.
    #[error("talking to hearthd at {}: {detail}", .socket.display())]
    Protocol { socket: PathBuf, detail: String },
    #[error("hearthd at {} did not answer within {}s", .socket.display(), .after.as_secs())]
    Timeout { socket: PathBuf, after: Duration },
}

impl ApiError {
    /// True for a 404: the object does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, ApiError::Server { status, .. } if *status == StatusCode::NOT_FOUND)
    }
}

#[derive(Clone, Debug)]
pub struct ApiClient {
    socket: PathBuf,
}

impl ApiClient {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        ApiClient {
            socket: socket.into(),
        }
    }

    pub async fn get(&self, path: &str) -> Result<Value, ApiError> {
        self.json(Method::GET, path, None, REQUEST_TIMEOUT).await
    }

    pub async fn post(&self, path: &str, body: Option<&Value>) -> Result<Value, ApiError> {
        self.json(Method::POST, path, body, REQUEST_TIMEOUT).await
    }

    /// A POST that may legitimately take longer than a plain request, such
    /// as a restore that first stops the VM.
    pub async fn post_slow(
        &self,
        path: &str,
        body: Option<&Value>,
        limit: Duration,
    ) -> Result<Value, ApiError> {
        self.json(Method::POST, path, body, limit).await
    }

    pub async fn patch(&self, path: &str, body: &Value) -> Result<Value, ApiError> {
        self.json(Method::PATCH, path, Some(body), REQUEST_TIMEOUT)
            .await
    }

    pub async fn delete(&self, path: &str) -> Result<Value, ApiError> {
        self.json(Method::DELETE, path, None, REQUEST_TIMEOUT).await
    }

    /// Sends a GET and hands back the body as it arrives (for console logs).
    /// Only the wait for the headers is bounded; the body may stream forever.
    pub async fn stream(&self, path: &str) -> Result<Incoming, ApiError> {
        Ok(self.start_stream(path).await?.into_body())
    }

    /// Opens `GET path` as an HTTP/1.1 upgrade to `protocol` and hands back
    /// the raw connection once hearthd answers 101; its error otherwise.
    pub async fn upgrade(
        &self,
        path: &str,
        protocol: &str,
    ) -> Result<TokioIo<hyper::upgrade::Upgraded>, ApiError> {
        self.with_timeout(REQUEST_TIMEOUT, async {
            let stream = UnixStream::connect(&self.socket)
                .await
                .map_err(|cause| unreachable(&self.socket, cause))?;
            let (mut sender, connection) =
                hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream))
                    .await
                    .map_err(|e| self.protocol(format!("handshake failed: {e}")))?;
            tokio::spawn(async move {
                let _ = connection.with_upgrades().await;
            });
            let request = Request::builder()
                .method(Method::GET)
                .uri(path)
                .header(header::HOST, "hearthd")
                .header(header::CONNECTION, "upgrade")
                .header(header::UPGRADE, protocol)
                .body(Full::new(Bytes::new()))
                .map_err(|e| self.protocol(format!("bad request path {path:?}: {e}")))?;
            let response = sender
                .send_request(request)
                .await
                .map_err(|e| self.protocol(format!("request failed: {e}")))?;
            let status = response.status();
            if status != StatusCode::SWITCHING_PROTOCOLS {
                let bytes = self.read_body(response.into_body()).await?;
                return Err(server_error(status, &bytes));
            }
            let upgraded = hyper::upgrade::on(response)
                .await
                .map_err(|e| self.protocol(format!("upgrade to {protocol} failed: {e}")))?;
            Ok(TokioIo::new(upgraded))
        })
        .await
    }

    /// A GET whose answer streams: the response once its headers are in, or
    /// the server's error.
    async fn start_stream(&self, path: &str) -> Result<Response<Incoming>, ApiError> {
        let response = self
            .with_timeout(REQUEST_TIMEOUT, self.send(Method::GET, path, None))
            .await?;
        let status = response.status();
        if !status.is_success() {
            let bytes = self
                .with_timeout(REQUEST_TIMEOUT, self.read_body(response.into_body()))
                .await?;
            return Err(server_error(status, &bytes));
        }
        Ok(response)
    }

    /// Opens a stream of JSON lines (`GET /v1/watch...`): only the wait for
    /// the headers is bounded; then lines come as hearthd sends them. An
    /// answer that is not `application/x-ndjson` (a hearthd from before the
    /// stream answers `?watch=true` with a plain list) is refused.
    pub async fn lines(&self, path: &str) -> Result<LineStream, ApiError> {
        let response = self.start_stream(path).await?;
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("no content type")
            .to_string();
        if !content_type.starts_with("application/x-ndjson") {
            return Err(self.protocol(format!(
                "GET {path} answered {content_type}, not a stream of JSON lines \
                 (is hearthd older than this hearth?)"
            )));
        }
        Ok(LineStream {
            body: response.into_body(),
            buf: Vec::new(),
            socket: self.socket.clone(),
        })
    }

    async fn json(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        limit: Duration,
    ) -> Result<Value, ApiError> {
        self.with_timeout(limit, async {
            let response = self.send(method, path, body).await?;
            let status = response.status();
            let bytes = self.read_body(response.into_body()).await?;
            if !status.is_success() {
                return Err(server_error(status, &bytes));
            }
            if bytes.is_empty() {
                return Ok(Value::Null);
            }
            serde_json::from_slice(&bytes)
                .map_err(|e| self.protocol(format!("answer is not JSON: {e}")))
        })
        .await
    }

    async fn with_timeout<T>(
        &self,
        limit: Duration,
        fut: impl Future<Output = Result<T, ApiError>>,
    ) -> Result<T, ApiError> {
        match tokio::time::timeout(limit, fut).await {
            Ok(r) => r,
            Err(_) => Err(ApiError::Timeout {
                socket: self.socket.clone(),
                after: limit,
            }),
        }
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Response<Incoming>, ApiError> {
        let stream = UnixStream::connect(&self.socket)
            .await
            .map_err(|cause| unreachable(&self.socket, cause))?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream))
                .await
                .map_err(|e| self.protocol(format!("handshake failed: {e}")))?;
        // The connection future drives the socket; it ends when the answer
        // has been read or the peer hangs up.
        tokio::spawn(async move {
            let _ = connection.await;
        });

        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, "hearthd")
            .header(header::ACCEPT, "application/json");
        let payload = match body {
            Some(v) => {
                request = request.header(header::CONTENT_TYPE, "application/json");
                Bytes::from(
                    serde_json::to_vec(v)
                        .map_err(|e| self.protocol(format!("cannot encode the request: {e}")))?,
                )
            }
            None => Bytes::new(),
        };
        let request = request
            .body(Full::new(payload))
            .map_err(|e| self.protocol(format!("bad request path {path:?}: {e}")))?;
        sender
            .send_request(request)
            .await
            .map_err(|e| self.protocol(format!("request failed: {e}")))
    }

    async fn read_body(&self, mut body: Incoming) -> Result<Vec<u8>, ApiError> {
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame =
                frame.map_err(|e| self.protocol(format!("reading the answer failed: {e}")))?;
            if let Ok(data) = frame.into_data() {
                if out.len() + data.len() > MAX_BODY_BYTES {
                    return Err(self.protocol(format!(
                        "answer is larger than {} MiB",
                        MAX_BODY_BYTES >> 20
                    )));
                }
                out.extend_from_slice(&data);
            }
        }
        Ok(out)
    }

    fn protocol(&self, detail: String) -> ApiError {
        ApiError::Protocol {
            socket: self.socket.clone(),
            detail,
        }
    }

    /// Sends `method path` with a body that streams from `body` (an `Err`
    /// in it aborts the request, so the server never takes a cut-off body
    /// for a whole one) and returns the JSON answer. No time limit: a copy
    /// lasts as long as the data takes, and every step hearthd makes in
    /// the guest is bounded on its side.
    pub async fn send_stream(
        &self,
        method: Method,
        path: &str,
        body: tokio::sync::mpsc::Receiver<io::Result<Bytes>>,
    ) -> Result<Value, ApiError> {
        let stream = UnixStream::connect(&self.socket)
            .await
            .map_err(|cause| unreachable(&self.socket, cause))?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake::<_, ChannelBody>(TokioIo::new(stream))
                .await
                .map_err(|e| self.protocol(format!("handshake failed: {e}")))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, "hearthd")
            .header(header::ACCEPT, "application/json")
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .body(ChannelBody(body))
            .map_err(|e| self.protocol(format!("bad request path {path:?}: {e}")))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| self.protocol(format!("request failed: {e}")))?;
        let status = response.status();
        let bytes = self
            .with_timeout(REQUEST_TIMEOUT, self.read_body(response.into_body()))
            .await?;
        if !status.is_success() {
            return Err(server_error(status, &bytes));
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| self.protocol(format!("answer is not JSON: {e}")))
    }

    /// Sends a GET and hands back the headers and the body as it arrives
    /// (a file copied out of a guest). Only the wait for the headers is
    /// bounded.
    pub async fn stream_with_headers(
        &self,
        path: &str,
    ) -> Result<(hyper::HeaderMap, Incoming), ApiError> {
        self.stream_with_headers_within(path, REQUEST_TIMEOUT).await
    }

    /// [`ApiClient::stream_with_headers`], waiting up to `limit` for the
    /// headers (an export answers once its conversion is done).
    pub async fn stream_with_headers_within(
        &self,
        path: &str,
        limit: Duration,
    ) -> Result<(hyper::HeaderMap, Incoming), ApiError> {
        let response = self
            .with_timeout(limit, self.send(Method::GET, path, None))
            .await?;
        let status = response.status();
        let (parts, body) = response.into_parts();
        if !status.is_success() {
            let bytes = self
                .with_timeout(REQUEST_TIMEOUT, self.read_body(body))
                .await?;
            return Err(server_error(status, &bytes));
        }
        Ok((parts.headers, body))
    }
}

/// A request body fed from a channel, chunk by chunk.
pub struct ChannelBody(tokio::sync::mpsc::Receiver<io::Result<Bytes>>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, io::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|next| next.map(|chunk| chunk.map(hyper::body::Frame::data)))
    }
}

/// `value` for a URL query: unreserved characters as they are, every other
/// byte as `%XX`.
pub fn query_escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A response body read a line at a time.
pub struct LineStream {
    body: Incoming,
    buf: Vec<u8>,
    socket: PathBuf,
}

impl LineStream {
    /// The next line without its newline; None when hearthd ended the
    /// stream. A last line without a newline is a cut connection, not a line.
    pub async fn next_line(&mut self) -> Result<Option<Vec<u8>>, ApiError> {
        loop {
            if let Some(end) = self.buf.iter().position(|b| *b == b'\n') {
                let mut line: Vec<u8> = self.buf.drain(..=end).collect();
                line.pop();
                return Ok(Some(line));
            }
            let Some(frame) = self.body.frame().await else {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Err(self.protocol("the stream ended in the middle of a line".into()));
            };
            let frame =
                frame.map_err(|e| self.protocol(format!("reading the stream failed: {e}")))?;
            if let Ok(data) = frame.into_data() {
                if self.buf.len() + data.len() > MAX_BODY_BYTES {
                    return Err(self.protocol(format!(
                        "a line of the stream is longer than {} MiB",
                        MAX_BODY_BYTES >> 20
                    )));
                }
                self.buf.extend_from_slice(&data);
            }
        }
    }

    fn protocol(&self, detail: String) -> ApiError {
        ApiError::Protocol {
            socket: self.socket.clone(),
            detail,
        }
    }
}

fn unreachable(socket: &Path, cause: io::Error) -> ApiError {
    let hint = match cause.kind() {
        io::ErrorKind::PermissionDenied => {
            "the socket is root-only by default: run hearth as root, or pass --socket"
        }
        _ => "is hearthd running? start it with `hearthd`",
    };
    ApiError::Unreachable {
        socket: socket.to_path_buf(),
        cause,
        hint,
    }
}

/// The server's `{"error": ...}` message verbatim, or what we can say without it.
fn server_error(status: StatusCode, body: &[u8]) -> ApiError {
    let from_json = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string));
    let message = from_json.unwrap_or_else(|| {
        let text = String::from_utf8_lossy(body);
        let text = text.trim();
        let reason = status.canonical_reason().unwrap_or("error");
        if text.is_empty() {
            format!("hearthd answered {} {reason}", status.as_u16())
        } else {
            let short: String = text.chars().take(500).collect();
            format!("hearthd answered {} {reason}: {short}", status.as_u16())
        }
    });
    ApiError::Server { status, message }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_escape_everything_but_unreserved_bytes_and_slashes() {
        assert_eq!(query_escape("/data/a b&c=d"), "/data/a%20b%26c%3Dd");
        assert_eq!(query_escape("/é"), "/%C3%A9");
        assert_eq!(query_escape("/x-y_z.~"), "/x-y_z.~");
    }
    use crate::test_server::{ScriptedServer, ok};
    use serde_json::json;

    #[tokio::test]
    async fn post_sends_json_and_returns_the_answer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![ok(
                r#"{"results":[{"kind":"VirtualMachine","name":"demo","action":"created"}]}"#,
            )],
        );
        let client = ApiClient::new(&server.socket);
        let body = json!({"items": [{"kind": "VirtualMachine"}]});
        let answer = client
            .post("/v1/apply", Some(&body))
            .await
            .expect("apply answer");
        assert_eq!(answer["results"][0]["action"], "created");

        let seen = server.seen();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].method, "POST");
        assert_eq!(seen[0].path, "/v1/apply");
        assert_eq!(seen[0].content_type.as_deref(), Some("application/json"));
        let sent: Value = serde_json::from_slice(&seen[0].body).expect("request body is JSON");
        assert_eq!(sent, body);
    }

    #[tokio::test]
    async fn get_with_query_reaches_the_server_unchanged() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(dir.path(), vec![ok(r#"{"items":[]}"#)]);
        let client = ApiClient::new(&server.socket);
        let answer = client
            .get("/v1/events?kind=VirtualMachine&name=demo&limit=20")
            .await
            .expect("events");
        assert_eq!(answer, json!({"items": []}));
        let seen = server.seen();
        assert_eq!(seen[0].method, "GET");
        assert_eq!(
            seen[0].path,
            "/v1/events?kind=VirtualMachine&name=demo&limit=20"
        );
        assert!(seen[0].body.is_empty());
    }

    #[tokio::test]
    async fn server_error_message_is_passed_through_verbatim() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![(
                StatusCode::CONFLICT,
                r#"{"error": "VirtualDisk \"data\" is in use by VirtualMachine \"demo\""}"#
                    .to_string(),
            )],
        );
        let client = ApiClient::new(&server.socket);
        let err = client
            .delete("/v1/virtualdisks/data")
            .await
            .expect_err("409 is an error");
        assert_eq!(
            err.to_string(),
            "VirtualDisk \"data\" is in use by VirtualMachine \"demo\""
        );
        assert!(
            matches!(err, ApiError::Server { status, .. } if status == StatusCode::CONFLICT),
            "{err:?}"
        );
        assert!(!err.is_not_found());
        let seen = server.seen();
        assert_eq!(seen[0].method, "DELETE");
        assert_eq!(seen[0].path, "/v1/virtualdisks/data");
    }

    #[tokio::test]
    async fn not_found_is_recognised() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![(
                StatusCode::NOT_FOUND,
                r#"{"error": "VirtualMachine \"x\" not found"}"#.to_string(),
            )],
        );
        let err = ApiClient::new(&server.socket)
            .get("/v1/virtualmachines/x")
            .await
            .expect_err("404");
        assert!(err.is_not_found());
        assert_eq!(err.to_string(), "VirtualMachine \"x\" not found");
    }

    #[tokio::test]
    async fn an_error_without_json_still_says_what_happened() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![(StatusCode::BAD_GATEWAY, "upstream gone".to_string())],
        );
        let err = ApiClient::new(&server.socket)
            .get("/v1/health")
            .await
            .expect_err("502");
        assert_eq!(
            err.to_string(),
            "hearthd answered 502 Bad Gateway: upstream gone"
        );
    }

    #[tokio::test]
    async fn a_stream_delivers_the_body_and_refuses_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![
                ok("Linux version 6.1\nlogin: "),
                (
                    StatusCode::NOT_FOUND,
                    r#"{"error": "VirtualMachine \"nope\" not found"}"#.to_string(),
                ),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let body = client
            .stream("/v1/virtualmachines/demo/console?follow=true")
            .await
            .expect("stream");
        let bytes = body.collect().await.expect("body").to_bytes();
        assert_eq!(&bytes[..], b"Linux version 6.1\nlogin: ");
        let err = client
            .stream("/v1/virtualmachines/nope/console")
            .await
            .expect_err("404");
        assert!(err.is_not_found(), "{err:?}");
        assert_eq!(
            server.seen()[0].path,
            "/v1/virtualmachines/demo/console?follow=true"
        );
    }

    #[tokio::test]
    async fn lines_come_one_at_a_time_and_a_plain_answer_is_not_a_stream() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::routes(
            dir.path(),
            vec![
                (
                    "GET",
                    "/v1/watch?kinds=vm",
                    vec![ok("{\"seq\":1}\n\n{\"seq\":2}\n{\"seq\":3")],
                ),
                (
                    "GET",
                    "/v1/virtualdisks?watch=true",
                    vec![ok(r#"{"items":[]}"#)],
                ),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let mut lines = client.lines("/v1/watch?kinds=vm").await.expect("stream");
        assert_eq!(
            lines.next_line().await.expect("1"),
            Some(b"{\"seq\":1}".to_vec())
        );
        assert_eq!(lines.next_line().await.expect("blank"), Some(Vec::new()));
        assert_eq!(
            lines.next_line().await.expect("2"),
            Some(b"{\"seq\":2}".to_vec())
        );
        // The last line has no newline: the connection was cut inside it.
        let err = lines.next_line().await.expect_err("cut");
        assert!(err.to_string().contains("in the middle of a line"), "{err}");
        // An older hearthd ignores ?watch=true and answers the list.
        let err = client
            .lines("/v1/virtualdisks?watch=true")
            .await
            .err()
            .expect("not a stream");
        assert!(
            err.to_string()
                .contains("answered application/json, not a stream of JSON lines"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn missing_socket_names_it_and_says_how_to_start_hearthd() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("nothing-here.sock");
        let err = ApiClient::new(&socket)
            .get("/v1/health")
            .await
            .expect_err("no daemon");
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("cannot reach hearthd at {}: ", socket.display())),
            "{text}"
        );
        assert!(
            text.ends_with("(is hearthd running? start it with `hearthd`)"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_socket_nobody_listens_on_is_unreachable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("stale.sock");
        // Bind and drop: the file stays, nobody accepts (ECONNREFUSED).
        drop(std::os::unix::net::UnixListener::bind(&socket).expect("bind"));
        let err = ApiClient::new(&socket)
            .get("/v1/health")
            .await
            .expect_err("refused");
        assert!(matches!(err, ApiError::Unreachable { .. }), "{err:?}");
        assert!(err.to_string().contains("start it with `hearthd`"), "{err}");
    }
}
