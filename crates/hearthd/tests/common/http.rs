//! A small HTTP/1.1 server on 127.0.0.1 for image-import tests and
//! benchmarks: it serves files or bytes, and misbehaves on request (404, a
//! server that hangs, a body cut short, no length, a slow drip), so the
//! importer is tested against real sockets.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the test server does for one path.
#[derive(Clone)]
pub enum Behaviour {
    Serve(Vec<u8>),
    /// A file's bytes, streamed, with its length.
    File(PathBuf),
    NotFound,
    /// Headers with a Content-Length, then nothing, until the client goes
    /// or the server stops.
    Hang(u64),
    /// A Content-Length of `claimed` bytes, then only `body`, then close.
    Truncate {
        body: Vec<u8>,
        claimed: u64,
    },
    /// The body with no Content-Length: it ends when the connection closes.
    NoLength(Vec<u8>),
    /// A body with no Content-Length that never ends: zeros, as fast as
    /// the client reads, until it goes or the server stops.
    Endless,
    /// The whole body, `chunk` bytes every `pause`.
    Drip {
        body: Vec<u8>,
        chunk: usize,
        pause: Duration,
    },
}

pub struct Server {
    pub port: u16,
    routes: Arc<Mutex<HashMap<String, Behaviour>>>,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    stop: Arc<AtomicBool>,
}

impl Server {
    pub fn start() -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        let port = listener.local_addr().expect("addr").port();
        listener.set_nonblocking(true).expect("nonblocking");
        let server = Server {
            port,
            routes: Arc::default(),
            hits: Arc::default(),
            stop: Arc::default(),
        };
        let (routes, hits, stop) = (
            server.routes.clone(),
            server.hits.clone(),
            server.stop.clone(),
        );
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let (routes, hits, stop) = (routes.clone(), hits.clone(), stop.clone());
                        std::thread::spawn(move || serve(conn, &routes, &hits, &stop));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        server
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn route(&self, path: &str, b: Behaviour) {
        self.routes
            .lock()
            .expect("routes")
            .insert(path.to_string(), b);
    }

    pub fn hits(&self, path: &str) -> usize {
        self.hits
            .lock()
            .expect("hits")
            .get(path)
            .copied()
            .unwrap_or(0)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn serve(
    mut conn: TcpStream,
    routes: &Mutex<HashMap<String, Behaviour>>,
    hits: &Mutex<HashMap<String, usize>>,
    stop: &AtomicBool,
) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let Ok(reader) = conn.try_clone() else { return };
    let mut reader = BufReader::new(reader);
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    loop {
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) if line == "\r\n" => break,
            Ok(_) => {}
        }
    }
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("/")
        .to_string();
    *hits.lock().expect("hits").entry(path.clone()).or_default() += 1;
    let behaviour = routes
        .lock()
        .expect("routes")
        .get(&path)
        .cloned()
        .unwrap_or(Behaviour::NotFound);
    let head = |len: u64| {
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
        )
    };
    match behaviour {
        Behaviour::Serve(body) => {
            let _ = conn.write_all(head(body.len() as u64).as_bytes());
            let _ = conn.write_all(&body);
        }
        Behaviour::File(path) => {
            let Ok(mut file) = std::fs::File::open(&path) else {
                return;
            };
            let len = file.metadata().map(|m| m.len()).unwrap_or(0);
            let _ = conn.write_all(head(len).as_bytes());
            let _ = std::io::copy(&mut file, &mut conn);
        }
        Behaviour::NotFound => {
            let _ = conn.write_all(
                b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found",
            );
        }
        Behaviour::Hang(len) => {
            let _ = conn.write_all(head(len).as_bytes());
            let _ = conn.flush();
            // Bounded: the client's read timeout ends it long before.
            let until = Instant::now() + Duration::from_secs(60);
            let _ = conn.set_read_timeout(Some(Duration::from_millis(100)));
            let mut byte = [0u8; 1];
            while Instant::now() < until && !stop.load(Ordering::SeqCst) {
                match conn.read(&mut byte) {
                    Ok(0) => return, // the client closed
                    _ => continue,
                }
            }
        }
        Behaviour::Truncate { body, claimed } => {
            let _ = conn.write_all(head(claimed).as_bytes());
            let _ = conn.write_all(&body);
        }
        Behaviour::NoLength(body) => {
            let _ = conn.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n\r\n",
            );
            let _ = conn.write_all(&body);
        }
        Behaviour::Endless => {
            let _ = conn.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n\r\n",
            );
            let zeros = vec![0u8; 1 << 20];
            while !stop.load(Ordering::SeqCst) {
                if conn.write_all(&zeros).is_err() {
                    return;
                }
            }
        }
        Behaviour::Drip { body, chunk, pause } => {
            let _ = conn.write_all(head(body.len() as u64).as_bytes());
            for piece in body.chunks(chunk) {
                if conn.write_all(piece).and_then(|()| conn.flush()).is_err() {
                    return;
                }
                // Deliberate: a slow server is the behaviour asked for.
                std::thread::sleep(pause);
            }
        }
    }
    let _ = conn.flush();
}
