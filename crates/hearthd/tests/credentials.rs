//! Credentials in an image URL (`http://user:password@host/...`) are used
//! to download and shown nowhere: not in events, status, errors, the CLI's
//! tables, YAML and `describe`, nor in hearthd's log. A real hearthd
//! downloads from a server of the test's own on 127.0.0.1 that serves only
//! with the right `Authorization` header.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use common::*;
use serde_json::Value;

const USER: &str = "puller";
const PASSWORD: &str = "hunter2-Tr0ub4dor";
const IMPORT: Duration = Duration::from_secs(60);

/// Serves `body` on `/good.qcow2` to requests with Basic credentials
/// `USER:PASSWORD`, 401 without them and 404 for any other path; keeps the
/// `Authorization` header of every request.
fn start_server(body: Vec<u8>) -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
    let port = listener.local_addr().expect("addr").port();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen_by_server = seen.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
            let Ok(reader) = conn.try_clone() else {
                continue;
            };
            let mut reader = BufReader::new(reader);
            let mut request_line = String::new();
            let _ = reader.read_line(&mut request_line);
            let mut auth = String::new();
            loop {
                let mut line = String::new();
                match reader.read_line(&mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) if line == "\r\n" => break,
                    Ok(_) => {
                        if let Some(v) = line.to_ascii_lowercase().strip_prefix("authorization:") {
                            auth = line[line.len() - v.len()..].trim().to_string();
                        }
                    }
                }
            }
            seen_by_server.lock().expect("seen").push(auth.clone());
            let want = format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASSWORD}"))
            );
            let path = request_line.split_whitespace().nth(1).unwrap_or("/");
            let head = |status: &str, len: usize| {
                format!("HTTP/1.1 {status}\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n")
            };
            if path != "/good.qcow2" {
                let _ = conn.write_all(head("404 Not Found", 0).as_bytes());
            } else if auth != want {
                let _ = conn.write_all(head("401 Unauthorized", 0).as_bytes());
            } else {
                let _ = conn.write_all(head("200 OK", body.len()).as_bytes());
                let _ = conn.write_all(&body);
            }
        }
    });
    (port, seen)
}

fn image(name: &str, url: &str, sha256: &str) -> Value {
    Image::http(name, url, sha256).json()
}

#[test]
fn credentials_in_an_image_url_download_and_are_shown_nowhere() {
    let _serial = serial();
    let src = tempfile::tempdir().expect("tempdir");
    let qcow2 = src.path().join("good.qcow2");
    let bytes = make_qcow2(&qcow2);
    let digest = sha256_file(&qcow2);
    let (port, seen) = start_server(bytes);
    let d = Daemon::start_without_guest(&[src.path()], &["--image-retry-max-seconds", "2"]);

    let good = format!("http://{USER}:{PASSWORD}@127.0.0.1:{port}/good.qcow2");
    let missing = format!("http://{USER}:{PASSWORD}@127.0.0.1:{port}/missing.qcow2");
    let (status, v) = d.apply_json(vec![
        image("good", &good, &digest),
        image("missing", &missing, &digest),
    ]);
    assert_eq!(status, 200, "{v}");
    // Downloaded with the credentials: the server served only to them.
    let ready = d.wait_object("virtualimages", "good", "Ready", IMPORT, |v| {
        v["status"]["phase"] == "Ready"
    });
    let stored = ready["status"]["path"].as_str().expect("path");
    assert_eq!(sha256_file(Path::new(stored)), digest);
    assert!(
        seen.lock()
            .expect("seen")
            .iter()
            .any(|a| a.starts_with("Basic ")),
        "the server never saw the credentials"
    );
    // The other one failed, with a message and events that name its URL.
    let failed = d.wait_object("virtualimages", "missing", "Failed", IMPORT, |v| {
        v["status"]["phase"] == "Failed"
    });
    let message = failed["status"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("127.0.0.1") && message.contains("404"),
        "{failed}"
    );
    // A refused apply repeats the URL in its error, from the API and from
    // the CLI's own checks.
    let ftp = format!("ftp://{USER}:{PASSWORD}@127.0.0.1:{port}/good.qcow2");
    let (status, v) = d.apply_json(vec![image("ftp", &ftp, &digest)]);
    assert_eq!(status, 400, "{v}");
    let m = manifest(&d, "ftp.yaml", &Image::http("ftp", &ftp, &digest).yaml());
    let cli_refusal = d.cli_err(&["apply", "-f", m.to_str().expect("utf8")]);

    let mut shown: Vec<(String, String)> = vec![
        ("refused apply".into(), v.to_string()),
        ("hearth apply of a bad URL".into(), cli_refusal),
    ];
    for name in ["good", "missing"] {
        let (_, object) = d.request("GET", &format!("/v1/virtualimages/{name}"), None);
        // The URL is there, its user and password are not.
        let url = object["spec"]["source"]["http"]["url"]
            .as_str()
            .unwrap_or_default();
        assert!(url.contains(&format!("127.0.0.1:{port}")), "{object}");
        shown.push((format!("GET {name}"), object.to_string()));
        shown.push((
            format!("events of {name}"),
            Value::Array(d.events("VirtualImage", name)).to_string(),
        ));
        shown.push((
            format!("hearth describe image {name}"),
            d.cli_ok(&["describe", "image", name]),
        ));
        shown.push((
            format!("hearth get image {name} -o yaml"),
            d.cli_ok(&["get", "image", name, "-o", "yaml"]),
        ));
    }
    shown.push((
        "hearth get images -o wide".into(),
        d.cli_ok(&["get", "images", "-o", "wide"]),
    ));
    shown.push((
        "GET /v1/virtualimages".into(),
        d.request("GET", "/v1/virtualimages", None).1.to_string(),
    ));
    shown.push((
        "GET /v1/events".into(),
        d.request("GET", "/v1/events?limit=1000", None)
            .1
            .to_string(),
    ));
    let (_, watch) = raw_request_with_timeout(&d, "/v1/watch?events=true&limit=1000");
    shown.push(("GET /v1/watch".into(), watch));
    shown.push(("hearthd's log".into(), d.log()));
    let mut leaks = Vec::new();
    for (what, text) in &shown {
        assert!(
            text.contains("127.0.0.1"),
            "{what} shows no URL at all, so it proves nothing:\n{text}"
        );
        let user = format!("{USER}:");
        if let Some(at) = [PASSWORD, &user].iter().filter_map(|s| text.find(s)).min() {
            {
                let line = text[..at].rfind('\n').map_or(0, |i| i + 1);
                let end = text[at..].find('\n').map_or(text.len(), |i| at + i);
                leaks.push(format!("{what}: {}", &text[line..end]));
            }
        }
    }
    assert!(leaks.is_empty(), "credentials shown:\n{}", leaks.join("\n"));

    // Applying what GET showed changes nothing: the stored credentials stay.
    let (_, object) = d.request("GET", "/v1/virtualimages/good", None);
    let (status, v) = d.apply_json(vec![object]);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["results"][0]["action"], "unchanged", "{v}");
}

/// The first lines of a watch: reads for two seconds, then hangs up.
fn raw_request_with_timeout(d: &Daemon, path: &str) -> (u16, String) {
    use std::io::Read;
    let mut s = std::os::unix::net::UnixStream::connect(d.socket()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    write!(s, "GET {path} HTTP/1.1\r\nHost: hearthd\r\n\r\n").expect("write");
    let mut buf = Vec::new();
    let mut chunk = [0u8; 65536];
    while let Ok(n) = s.read(&mut chunk) {
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}
