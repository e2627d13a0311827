//! A buffered reader that never holds more than a bound's worth of one line.
//!
//! `tokio::io::AsyncBufReadExt::read_line` grows without limit, which would let QEMU
//! or a guest make the daemon allocate arbitrarily; this one gives up at `max`.

use tokio::io::{AsyncRead, AsyncReadExt};

const CHUNK: usize = 64 * 1024;

#[derive(Debug)]
pub(crate) enum ReadError {
    Eof,
    TooLarge,
    Io(std::io::Error),
}

pub(crate) struct BoundedReader<R> {
    inner: R,
    buf: Vec<u8>,
    /// Bytes of `buf` already searched for the delimiter, so a long line arriving in
    /// many chunks is scanned once.
    scanned: usize,
}

impl<R: AsyncRead + Unpin> BoundedReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        BoundedReader {
            inner,
            buf: Vec::new(),
            scanned: 0,
        }
    }

    /// Reads one chunk into the buffer. Cancel-safe: a cancelled read loses nothing.
    async fn fill(&mut self) -> Result<(), ReadError> {
        // Read straight into the heap buffer: a chunk array held across the await
        // would make every future that embeds this one 64 KiB larger.
        self.buf.reserve(CHUNK);
        match self.inner.read_buf(&mut self.buf).await {
            Ok(0) => Err(ReadError::Eof),
            Ok(_) => Ok(()),
            Err(e) => Err(ReadError::Io(e)),
        }
    }

    /// Returns the next line without its `\n`. A line longer than `max` bytes is
    /// `TooLarge`; what was buffered of it is dropped.
    pub(crate) async fn read_line(&mut self, max: usize) -> Result<Vec<u8>, ReadError> {
        self.read_until_any(b"\n", max).await.map(|(line, _)| line)
    }

    /// Returns the bytes before the first of `delims` and which delimiter ended them;
    /// the delimiter is consumed.
    pub(crate) async fn read_until_any(
        &mut self,
        delims: &[u8],
        max: usize,
    ) -> Result<(Vec<u8>, u8), ReadError> {
        loop {
            if let Some(offset) = self.buf[self.scanned..]
                .iter()
                .position(|b| delims.contains(b))
            {
                let end = self.scanned + offset;
                let delim = self.buf[end];
                if end > max {
                    self.discard_through(end + 1);
                    return Err(ReadError::TooLarge);
                }
                let line = self.buf[..end].to_vec();
                self.discard_through(end + 1);
                return Ok((line, delim));
            }
            self.scanned = self.buf.len();
            if self.buf.len() > max {
                self.buf.clear();
                self.scanned = 0;
                return Err(ReadError::TooLarge);
            }
            self.fill().await?;
        }
    }

    /// Drops input until (and including) the next `byte`, holding at most one chunk.
    pub(crate) async fn skip_past(&mut self, byte: u8) -> Result<(), ReadError> {
        loop {
            if let Some(pos) = self.buf.iter().position(|b| *b == byte) {
                self.discard_through(pos + 1);
                return Ok(());
            }
            self.buf.clear();
            self.scanned = 0;
            self.fill().await?;
        }
    }

    /// True if bytes are buffered that nobody asked for yet (other than whitespace).
    pub(crate) fn has_unread_data(&self) -> bool {
        self.buf.iter().any(|b| !b.is_ascii_whitespace())
    }

    pub(crate) fn get_ref(&self) -> &R {
        &self.inner
    }

    /// Forgets everything buffered.
    pub(crate) fn clear(&mut self) {
        self.buf.clear();
        self.scanned = 0;
    }

    fn discard_through(&mut self, n: usize) {
        self.buf.drain(..n);
        self.scanned = 0;
    }
}

/// Keeps untrusted text that ends up in errors and logs to a readable size.
/// A QAPI reply (QMP and the guest agent share the format), decided.
pub(crate) enum QapiReply {
    Return(serde_json::Value),
    Error {
        class: String,
        desc: String,
    },
    /// Neither `return` nor `error`; the text shows what came instead.
    Malformed(String),
}

pub(crate) fn classify_reply(mut reply: serde_json::Value) -> QapiReply {
    if let Some(ret) = reply.get_mut("return") {
        return QapiReply::Return(ret.take());
    }
    if let Some(err) = reply.get("error") {
        let text = |k: &str| {
            err.get(k)
                .and_then(serde_json::Value::as_str)
                .map(truncate)
                .unwrap_or_default()
        };
        return QapiReply::Error {
            class: text("class"),
            desc: text("desc"),
        };
    }
    QapiReply::Malformed(truncate(&reply.to_string()))
}

pub(crate) fn truncate(s: &str) -> String {
    const MAX: usize = 512;
    if s.len() <= MAX {
        return s.to_owned();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lines_split_across_reads_and_several_lines_in_one_read() {
        let (mut tx, rx) = tokio::io::duplex(16);
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            tx.write_all(b"first line is long\nsecond\nthi").await?;
            tx.write_all(b"rd\n").await
        });
        let mut r = BoundedReader::new(rx);
        assert_eq!(r.read_line(100).await.expect("1"), b"first line is long");
        assert_eq!(r.read_line(100).await.expect("2"), b"second");
        assert_eq!(r.read_line(100).await.expect("3"), b"third");
        writer.await.expect("join").expect("write");
        assert!(matches!(r.read_line(100).await, Err(ReadError::Eof)));
    }

    #[tokio::test]
    async fn a_line_over_the_bound_is_too_large_and_the_bound_itself_is_fine() {
        let data = [
            vec![b'a'; 10],
            b"\n".to_vec(),
            vec![b'b'; 11],
            b"\n".to_vec(),
        ]
        .concat();
        let mut r = BoundedReader::new(&data[..]);
        assert_eq!(r.read_line(10).await.expect("exactly max").len(), 10);
        assert!(matches!(r.read_line(10).await, Err(ReadError::TooLarge)));
    }

    #[tokio::test]
    async fn an_endless_line_stops_at_the_bound_without_buffering_it_all() {
        // 1 MiB with no newline and a 1 KiB bound: must fail, not read to the end.
        let data = vec![b'x'; 1024 * 1024];
        let mut r = BoundedReader::new(&data[..]);
        assert!(matches!(r.read_line(1024).await, Err(ReadError::TooLarge)));
        assert!(r.buf.capacity() <= 2 * (1024 + CHUNK));
    }

    #[tokio::test]
    async fn skip_past_discards_up_to_the_sentinel() {
        let data = b"junk\n{\"error\":1}\n\xff{\"return\":7}\n";
        let mut r = BoundedReader::new(&data[..]);
        r.skip_past(0xFF).await.expect("sentinel present");
        assert_eq!(r.read_line(100).await.expect("line"), b"{\"return\":7}");
    }
}
