//! Waits on hearthd's change stream (`GET /v1/{plural}?watch=true`,
//! docs/http-api.md#watching): the daemon says when an object changes, so
//! a test wakes on the change instead of asking again and again.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

/// One open watch, read a line at a time (chunked framing).
struct Watch {
    reader: BufReader<UnixStream>,
    /// Decoded body bytes not yet returned as a line.
    pending: Vec<u8>,
}

/// What a read of the stream gave.
enum Read1 {
    Line(Value),
    /// The deadline passed.
    Timeout,
    /// The daemon closed the stream (it stopped, or was killed).
    Closed,
}

impl Watch {
    fn open(socket: &Path, path: &str) -> Option<Watch> {
        let mut sock = UnixStream::connect(socket).ok()?;
        sock.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        write!(
            sock,
            "GET {path} HTTP/1.1\r\nHost: hearthd\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut reader = BufReader::new(sock);
        let mut head = String::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).ok()? == 0 {
                return None;
            }
            if line == "\r\n" {
                break;
            }
            head.push_str(&line);
        }
        if !head.starts_with("HTTP/1.1 200") {
            panic!("GET {path}: {head}");
        }
        Some(Watch {
            reader,
            pending: Vec::new(),
        })
    }

    fn next(&mut self, deadline: Instant) -> Read1 {
        loop {
            if let Some(end) = self.pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=end).collect();
                return match serde_json::from_slice(&line) {
                    Ok(v) => Read1::Line(v),
                    Err(_) => Read1::Closed,
                };
            }
            let Some(left) = deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
            else {
                return Read1::Timeout;
            };
            if self.reader.get_ref().set_read_timeout(Some(left)).is_err() {
                return Read1::Closed;
            }
            let mut size = String::new();
            match self.reader.read_line(&mut size) {
                Ok(0) => return Read1::Closed,
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Read1::Timeout;
                }
                Err(_) => return Read1::Closed,
            }
            let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
                return Read1::Closed;
            };
            if size == 0 {
                return Read1::Closed;
            }
            let mut chunk = vec![0u8; size + 2];
            if self.reader.read_exact(&mut chunk).is_err() {
                return Read1::Closed;
            }
            chunk.truncate(size);
            self.pending.extend_from_slice(&chunk);
        }
    }
}

/// What [`watch_object`] saw of the object.
pub enum Seen {
    /// `done` held on this state of the object.
    Done(Value),
    /// The object is not there: `gone` was asked for and it is gone.
    Gone,
    /// The deadline passed; the last state seen (`Null` if none).
    Timeout(Value),
}

/// Follows `plural/name` on the change stream until `done` holds on the
/// object (or, with `gone`, until it does not exist), or `timeout` passes.
/// The stream starts with the current state, so a state reached before the
/// call counts; a dropped stream (a daemon restarted under the wait) is
/// opened again and starts over from the current state.
pub fn watch_object(
    socket: &Path,
    plural: &str,
    name: &str,
    timeout: Duration,
    gone: bool,
    done: impl Fn(&Value) -> bool,
) -> Seen {
    let deadline = Instant::now() + timeout;
    let path = format!("/v1/{plural}?watch=true&name={name}");
    let mut last = Value::Null;
    while Instant::now() < deadline {
        let Some(mut watch) = Watch::open(socket, &path) else {
            // No daemon answering right now (it is restarting): try again.
            std::thread::sleep(Duration::from_millis(100));
            continue;
        };
        // Whether the object exists, as far as this stream has said.
        let mut present = false;
        loop {
            let line = match watch.next(deadline) {
                Read1::Line(line) => line,
                Read1::Timeout => return Seen::Timeout(last),
                Read1::Closed => break,
            };
            match line["type"].as_str() {
                Some("ADDED" | "MODIFIED") if line["name"] == name => {
                    present = true;
                    let object = line["object"].clone();
                    if !gone && done(&object) {
                        return Seen::Done(object);
                    }
                    last = object;
                }
                Some("DELETED") if line["name"] == name => {
                    present = false;
                    if gone {
                        return Seen::Gone;
                    }
                }
                Some("RELIST") => present = false,
                // The end of the initial list (or of a re-list), or a
                // heartbeat: with nothing listed, the object is not there.
                Some("BOOKMARK") if gone && !present => return Seen::Gone,
                _ => {}
            }
        }
    }
    Seen::Timeout(last)
}
