//! The guest agent's file and program-input calls: `guest-exec` with
//! `input-data`, and `guest-file-open/read/write/close`. Each method is one
//! request and one reply, so a caller that shares the channel (hearthd's
//! `hearth exec` and `hearth cp`) can let go of it between calls.
//!
//! Measured against the test guest's qemu-ga 7.2 (docs/cli.md): a
//! `guest-file-read` may ask for at most 48 MiB, a request line may be tens of
//! MiB (qemu's JSON parser takes tokens up to 64 MiB), and the time of a call
//! grows with its size (base64 and JSON are decoded by the guest's CPU), so
//! callers move data in small chunks.

use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};

use crate::agent::{AgentClient, AgentError};
use crate::lines::truncate;

/// qemu-ga refuses a `guest-file-read` of more than this many bytes.
pub const MAX_READ_COUNT: usize = 48 << 20;

/// How a guest file is opened: qemu-ga's fopen(3) modes, the two we use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenMode {
    /// `r`: read from the start.
    Read,
    /// `w`: create or truncate, then write. qemu-ga creates a new file with
    /// its own default mode (0666 from 7.2 in the test guest).
    Write,
}

impl OpenMode {
    fn as_str(self) -> &'static str {
        match self {
            OpenMode::Read => "r",
            OpenMode::Write => "w",
        }
    }
}

/// What one `guest-file-read` returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileChunk {
    pub data: Vec<u8>,
    /// qemu-ga reached the end of the file in this read.
    pub eof: bool,
}

impl AgentClient {
    /// Like [`exec_start`](Self::exec_start), with `input` written to the
    /// program's stdin (qemu-ga's `input-data`; the program sees end of file
    /// after it). `None` leaves stdin empty.
    pub async fn exec_start_input(
        &mut self,
        path: &str,
        args: &[&str],
        input: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<i64, AgentError> {
        let mut arguments = json!({"path": path, "arg": args, "capture-output": true});
        if let Some(input) = input {
            arguments["input-data"] = base64::engine::general_purpose::STANDARD
                .encode(input)
                .into();
        }
        let started = self.execute("guest-exec", Some(arguments), timeout).await?;
        started
            .get("pid")
            .and_then(Value::as_i64)
            .ok_or_else(|| AgentError::Protocol("guest-exec reply has no pid".into()))
    }

    /// `guest-file-open`: a handle for the other file calls.
    pub async fn file_open(
        &mut self,
        path: &str,
        mode: OpenMode,
        timeout: Duration,
    ) -> Result<i64, AgentError> {
        let v = self
            .execute(
                "guest-file-open",
                Some(json!({"path": path, "mode": mode.as_str()})),
                timeout,
            )
            .await?;
        v.as_i64().ok_or_else(|| {
            AgentError::Protocol(format!(
                "guest-file-open returned {} instead of a handle",
                truncate(&v.to_string())
            ))
        })
    }

    /// `guest-file-read` of at most `count` bytes (1..=[`MAX_READ_COUNT`]).
    /// A reply carrying more than was asked for is a protocol error.
    pub async fn file_read(
        &mut self,
        handle: i64,
        count: usize,
        timeout: Duration,
    ) -> Result<FileChunk, AgentError> {
        if count == 0 || count > MAX_READ_COUNT {
            return Err(AgentError::InvalidArgument(format!(
                "guest-file-read count {count} (expected 1 to {MAX_READ_COUNT})"
            )));
        }
        let v = self
            .execute(
                "guest-file-read",
                Some(json!({"handle": handle, "count": count})),
                timeout,
            )
            .await?;
        let text = v
            .get("buf-b64")
            .and_then(Value::as_str)
            .ok_or_else(|| AgentError::Protocol("guest-file-read reply has no buf-b64".into()))?;
        let data = base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(|e| AgentError::Protocol(format!("guest-file-read buf-b64: {e}")))?;
        let said = v.get("count").and_then(Value::as_u64);
        if data.len() > count || said.is_some_and(|n| n != data.len() as u64) {
            return Err(AgentError::Protocol(format!(
                "guest-file-read asked for {count} bytes, got {} (count {said:?})",
                data.len()
            )));
        }
        let eof = v.get("eof").and_then(Value::as_bool).unwrap_or(false);
        Ok(FileChunk { data, eof })
    }

    /// `guest-file-write` of `data`; how many bytes qemu-ga wrote (it may be
    /// fewer: the caller writes the rest).
    pub async fn file_write(
        &mut self,
        handle: i64,
        data: &[u8],
        timeout: Duration,
    ) -> Result<usize, AgentError> {
        let v = self
            .execute(
                "guest-file-write",
                Some(json!({
                    "handle": handle,
                    "buf-b64": base64::engine::general_purpose::STANDARD.encode(data),
                })),
                timeout,
            )
            .await?;
        let n = v.get("count").and_then(Value::as_u64).ok_or_else(|| {
            AgentError::Protocol(format!(
                "guest-file-write returned {} without a count",
                truncate(&v.to_string())
            ))
        })?;
        usize::try_from(n)
            .ok()
            .filter(|n| *n <= data.len())
            .ok_or_else(|| {
                AgentError::Protocol(format!(
                    "guest-file-write wrote {n} of {} bytes",
                    data.len()
                ))
            })
    }

    /// `guest-file-close`: flushes (fclose) and forgets the handle.
    pub async fn file_close(&mut self, handle: i64, timeout: Duration) -> Result<(), AgentError> {
        self.execute("guest-file-close", Some(json!({"handle": handle})), timeout)
            .await
            .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    use tokio::net::UnixListener;
    use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

    const T: Duration = Duration::from_secs(5);

    /// The guest side: answers the resync, then scripted replies.
    struct Guest {
        read: BufReader<OwnedReadHalf>,
        write: OwnedWriteHalf,
    }

    impl Guest {
        async fn recv(&mut self) -> Value {
            let mut line = Vec::new();
            loop {
                line.clear();
                let n = self.read.read_until(b'\n', &mut line).await.expect("read");
                assert!(n > 0, "client closed");
                // A resync starts with qemu-ga's 0xFF parser-reset byte.
                line.retain(|b| *b != 0xFF);
                let v: Value = serde_json::from_slice(&line).expect("JSON line");
                if v["execute"] == "guest-sync-delimited" {
                    let id = v["arguments"]["id"].clone();
                    let mut reply = vec![0xFF];
                    reply.extend_from_slice(format!("{}\n", json!({ "return": id })).as_bytes());
                    self.write.write_all(&reply).await.expect("sync reply");
                    continue;
                }
                return v;
            }
        }
        async fn reply(&mut self, v: Value) {
            self.write
                .write_all(format!("{v}\n").as_bytes())
                .await
                .expect("reply");
        }
    }

    async fn setup() -> (tempfile::TempDir, AgentClient, Guest) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qga.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let client = AgentClient::connect(&path).await.expect("connect");
        let (stream, _) = listener.accept().await.expect("accept");
        let (read, write) = stream.into_split();
        let guest = Guest {
            read: BufReader::new(read),
            write,
        };
        (dir, client, guest)
    }

    #[tokio::test]
    async fn exec_with_input_sends_it_base64_encoded() {
        let (_dir, mut client, mut guest) = setup().await;
        let script = tokio::spawn(async move {
            let cmd = guest.recv().await;
            assert_eq!(cmd["execute"], "guest-exec");
            assert_eq!(cmd["arguments"]["path"], "cat");
            assert_eq!(cmd["arguments"]["input-data"], "aGkK");
            assert_eq!(cmd["arguments"]["capture-output"], true);
            guest.reply(json!({"return": {"pid": 5}})).await;
            let cmd = guest.recv().await;
            assert!(cmd["arguments"].get("input-data").is_none(), "{cmd}");
            guest.reply(json!({"return": {"pid": 6}})).await;
        });
        let pid = client
            .exec_start_input("cat", &[], Some(b"hi\n"), T)
            .await
            .expect("start");
        assert_eq!(pid, 5);
        let pid = client
            .exec_start_input("true", &[], None, T)
            .await
            .expect("start");
        assert_eq!(pid, 6);
        script.await.expect("guest");
    }

    #[tokio::test]
    async fn file_calls_round_trip_and_bound_what_comes_back() {
        let (_dir, mut client, mut guest) = setup().await;
        let script = tokio::spawn(async move {
            let cmd = guest.recv().await;
            assert_eq!(cmd["execute"], "guest-file-open");
            assert_eq!(cmd["arguments"]["mode"], "w");
            guest.reply(json!({"return": 1000})).await;
            let cmd = guest.recv().await;
            assert_eq!(cmd["execute"], "guest-file-write");
            assert_eq!(cmd["arguments"]["buf-b64"], "AAEC");
            guest
                .reply(json!({"return": {"count": 2, "eof": false}}))
                .await;
            let cmd = guest.recv().await;
            assert_eq!(cmd["execute"], "guest-file-write");
            guest
                .reply(json!({"return": {"count": 9, "eof": false}}))
                .await;
            let cmd = guest.recv().await;
            assert_eq!(cmd["execute"], "guest-file-read");
            assert_eq!(cmd["arguments"]["count"], 4);
            guest
                .reply(json!({"return": {"count": 3, "buf-b64": "AAEC", "eof": true}}))
                .await;
            let _ = guest.recv().await;
            // More than was asked for.
            guest
                .reply(json!({"return": {"count": 6, "buf-b64": "AAECAwQF", "eof": false}}))
                .await;
            let cmd = guest.recv().await;
            assert_eq!(cmd["execute"], "guest-file-close");
            assert_eq!(cmd["arguments"]["handle"], 1000);
            guest.reply(json!({"return": {}})).await;
        });
        let h = client
            .file_open("/tmp/x", OpenMode::Write, T)
            .await
            .expect("open");
        assert_eq!(h, 1000);
        assert_eq!(client.file_write(h, &[0, 1, 2], T).await.expect("write"), 2);
        let err = client
            .file_write(h, &[0, 1, 2], T)
            .await
            .expect_err("wrote more than sent");
        assert!(matches!(err, AgentError::Protocol(_)), "{err}");
        let chunk = client.file_read(h, 4, T).await.expect("read");
        assert_eq!(chunk.data, vec![0, 1, 2]);
        assert!(chunk.eof);
        let err = client.file_read(h, 4, T).await.expect_err("too much");
        assert!(matches!(err, AgentError::Protocol(_)), "{err}");
        client.file_close(h, T).await.expect("close");
        let err = client
            .file_read(h, MAX_READ_COUNT + 1, T)
            .await
            .expect_err("over qemu-ga's bound");
        assert!(matches!(err, AgentError::InvalidArgument(_)), "{err}");
        script.await.expect("guest");
    }
}
