//! Reading a request: its JSON body, its query and its path. Every way one
//! can be wrong is answered as the API answers errors (`{"error": ...}`,
//! with the status docs/http-api.md "Errors" gives it) and names what is
//! wrong: the field, the parameter, the duplicate key and where it is.

use std::fmt;

use axum::Json;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::de::{self, DeserializeOwned, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value, json};

use super::ApiError;

/// The largest request body read whole (the objects of an apply, an exec
/// request): manifests are small. File uploads stream and have no limit.
pub const MAX_BODY: usize = 8 << 20;

fn bad(message: String) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, message)
}

/// A JSON request body read into `T`: at most [`MAX_BODY`] bytes, a JSON
/// media type (or none), valid JSON with no key twice in any object, and
/// of `T`'s shape.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, _: &S) -> Result<Self, ApiError> {
        let value = read_json(request).await?;
        serde_path_to_error::deserialize(value)
            .map(JsonBody)
            .map_err(|e| {
                let path = e.path().to_string();
                let inner = e.into_inner();
                if path == "." {
                    bad(format!("request body: {inner}"))
                } else {
                    bad(format!("request body: {path}: {inner}"))
                }
            })
    }
}

/// The body as a JSON value, checked as [`JsonBody`] says.
pub async fn read_json(request: Request) -> Result<Value, ApiError> {
    let headers = request.headers();
    if let Some(value) = headers.get(header::CONTENT_TYPE) {
        let text = value.to_str().unwrap_or("(not text)");
        if !is_json_media_type(text) {
            return Err(ApiError(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("Content-Type {text:?}: the request body must be JSON (application/json)"),
            ));
        }
    }
    let too_large = || {
        ApiError(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is larger than the {} MiB ({MAX_BODY} bytes) allowed; \
                 split the objects over several applies",
                MAX_BODY >> 20
            ),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(too_large());
    }
    let bytes = match Limited::new(request.into_body(), MAX_BODY).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => return Err(too_large()),
        Err(e) => return Err(bad(format!("the request body broke off: {e}"))),
    };
    parse_without_duplicate_keys(&bytes).map_err(|e| bad(format!("request body is not JSON: {e}")))
}

/// `application/json`, or any `+json` type, with or without parameters.
fn is_json_media_type(text: &str) -> bool {
    let essence = text
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Parses JSON as `serde_json` does, except that a key given twice in one
/// object is an error naming the key and the object's place (`items[0].
/// metadata`), where `serde_json::Value` would keep the last one silently.
pub fn parse_without_duplicate_keys(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = Node { at: &Place::Body }.deserialize(&mut de)?;
    de.end()?;
    Ok(value)
}

/// Where a value is in the body, for messages.
enum Place<'a> {
    Body,
    Key(&'a Place<'a>, &'a str),
    Index(&'a Place<'a>, usize),
}

impl fmt::Display for Place<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Place::Body => f.write_str("the body"),
            Place::Key(Place::Body, k) => f.write_str(k),
            Place::Key(p, k) => write!(f, "{p}.{k}"),
            Place::Index(Place::Body, i) => write!(f, "[{i}]"),
            Place::Index(p, i) => write!(f, "{p}[{i}]"),
        }
    }
}

/// One JSON value at `at`, read into a `serde_json::Value`.
struct Node<'a> {
    at: &'a Place<'a>,
}

impl<'de> DeserializeSeed<'de> for Node<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Node<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(Node {
            at: &Place::Index(self.at, items.len()),
        })? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(de::Error::custom(format!(
                    "duplicate key {key:?} in {}",
                    self.at
                )));
            }
            let value = map.next_value_seed(Node {
                at: &Place::Key(self.at, &key),
            })?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

/// A query string read into `T`; a parameter that does not parse is a 400
/// naming it.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        Query::<T>::try_from_uri(&parts.uri)
            .map(|Query(q)| ApiQuery(q))
            .map_err(|r| {
                let text = r.body_text();
                let detail = text
                    .strip_prefix("Failed to deserialize query string: ")
                    .unwrap_or(&text);
                bad(format!("bad query: {detail}"))
            })
    }
}

/// Path parameters read into `T`; one that does not parse is a 400 naming
/// it.
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(p)| ApiPath(p))
            .map_err(|r| bad(format!("path {}: {}", parts.uri.path(), r.body_text())))
    }
}

/// `404` for a path no route serves.
pub async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        format!(
            "no such path: {method} {} (GET /v1/openapi.json lists them all)",
            uri.path()
        ),
    )
}

/// `405` for a method a route does not serve.
pub async fn no_method(method: Method, uri: Uri) -> ApiError {
    ApiError(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{method} is not served on {} (GET /v1/openapi.json lists what is)",
            uri.path()
        ),
    )
}

/// Answers every error that is not already JSON (one a handler of this
/// crate did not make) with the same status and `{"error": its text}`.
pub async fn errors_as_json(response: Response) -> Response {
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(is_json_media_type);
    if is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 64 << 10)
        .await
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&text).trim().to_string();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        text
    };
    parts.headers.remove(header::CONTENT_TYPE);
    parts.headers.remove(header::CONTENT_LENGTH);
    (parts, Json(json!({"error": message}))).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_given_twice_is_named_with_its_place() {
        for (text, want) in [
            (r#"{"a": 1, "a": 2}"#, "duplicate key \"a\" in the body"),
            (
                r#"{"items": [{"metadata": {"name": "x", "name": "y"}}]}"#,
                "duplicate key \"name\" in items[0].metadata",
            ),
            (r#"[{}, {"k": [], "k": []}]"#, "duplicate key \"k\" in [1]"),
        ] {
            let e = parse_without_duplicate_keys(text.as_bytes())
                .expect_err(text)
                .to_string();
            assert!(e.starts_with(want), "{text}: {e}");
            assert!(e.contains("line 1"), "{e}");
        }
    }

    #[test]
    fn everything_else_reads_as_serde_json_reads_it() {
        for text in [
            r#"{"a": [1, -2, 3.5, true, null, "s\u00e9"], "b": {"c": {}}}"#,
            "[]",
            "12",
            r#""text""#,
            r#"{"same": 1, "nested": {"same": 2}}"#,
        ] {
            let ours = parse_without_duplicate_keys(text.as_bytes()).expect(text);
            let theirs: Value = serde_json::from_str(text).expect(text);
            assert_eq!(ours, theirs, "{text}");
        }
        for text in ["{", "[1,]", "{\"a\" 1}", "1 2", ""] {
            assert!(
                parse_without_duplicate_keys(text.as_bytes()).is_err(),
                "{text}"
            );
        }
    }

    #[test]
    fn json_media_types() {
        for t in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/merge-patch+json",
        ] {
            assert!(is_json_media_type(t), "{t}");
        }
        for t in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "application/jsonx",
            "",
        ] {
            assert!(!is_json_media_type(t), "{t}");
        }
    }
}
