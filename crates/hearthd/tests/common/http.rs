//! A small HTTP/1.1 file server on 127.0.0.1 for image-import tests: it
//! serves files, and misbehaves on request (404, a server that hangs, a body
//! cut short), so the importer is tested against real sockets.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the server does for one path.
#[derive(Clone, Debug)]
pub enum Route {
    /// 200 with the file's bytes and its Content-Length.
    File(PathBuf),
    /// 404 Not Found.
    NotFound,
    /// Headers for a body of `len` bytes, then nothing until the client
    /// gives up (or the server is dropped).
    Hang { len: u64 },
    /// Headers for the whole file, then only its first `send` bytes, then
    /// the connection is closed.
    Truncated { file: PathBuf, send: u64 },
}

pub struct HttpServer {
    pub port: u16,
    routes: Arc<Mutex<HashMap<String, Route>>>,
    /// Requests seen per path.
    hits: Arc<Mutex<HashMap<String, usize>>>,
    stop: Arc<AtomicBool>,
    open: Arc<AtomicUsize>,
}

impl HttpServer {
    pub fn start() -> HttpServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let port = listener.local_addr().expect("local addr").port();
        let server = HttpServer {
            port,
            routes: Arc::default(),
            hits: Arc::default(),
            stop: Arc::default(),
            open: Arc::default(),
        };
        let (routes, hits, stop, open) = (
            server.routes.clone(),
            server.hits.clone(),
            server.stop.clone(),
            server.open.clone(),
        );
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                // Bounded: a test never needs more than a few at once.
                if open.load(Ordering::SeqCst) >= 32 {
                    continue;
                }
                let (routes, hits, stop, open) =
                    (routes.clone(), hits.clone(), stop.clone(), open.clone());
                open.fetch_add(1, Ordering::SeqCst);
                std::thread::spawn(move || {
                    let _ = serve(conn, &routes, &hits, &stop);
                    open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        server
    }

    /// Sets (or replaces) what `path` answers.
    pub fn route(&self, path: &str, route: Route) {
        self.routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(path.to_string(), route);
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn hits(&self, path: &str) -> usize {
        *self
            .hits
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(path)
            .unwrap_or(&0)
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn serve(
    mut conn: TcpStream,
    routes: &Mutex<HashMap<String, Route>>,
    hits: &Mutex<HashMap<String, usize>>,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    // Headers are read and ignored, up to a bound.
    for _ in 0..100 {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
    }
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("/")
        .to_string();
    *hits
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(path.clone())
        .or_insert(0) += 1;
    let route = routes
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&path)
        .cloned()
        .unwrap_or(Route::NotFound);
    let header = |len: u64| {
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
        )
    };
    match route {
        Route::NotFound => {
            conn.write_all(
                b"HTTP/1.1 404 Not Found\r\nContent-Length: 10\r\nConnection: close\r\n\r\nnot found\n",
            )?;
        }
        Route::File(p) => {
            let mut f = std::fs::File::open(&p)?;
            let len = f.metadata()?.len();
            conn.write_all(header(len).as_bytes())?;
            std::io::copy(&mut f, &mut conn)?;
        }
        Route::Truncated { file, send } => {
            let f = std::fs::File::open(&file)?;
            let len = f.metadata()?.len();
            conn.write_all(header(len).as_bytes())?;
            std::io::copy(&mut f.take(send), &mut conn)?;
        }
        Route::Hang { len } => {
            conn.write_all(header(len).as_bytes())?;
            conn.flush()?;
            // Holds the connection open, sending nothing; bounded.
            for _ in 0..1200 {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    conn.flush()?;
    let _ = conn.shutdown(std::net::Shutdown::Write);
    Ok(())
}
