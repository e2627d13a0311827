//! `hearth console NAME`: the VM's serial port, interactively.
//!
//! Prints the last lines of the console log, then attaches through
//! `GET .../console/attach` (an HTTP/1.1 upgrade) and pipes stdin to the
//! serial port and the serial port to stdout. On a terminal, stdin is put in
//! raw mode (every key goes to the guest, Ctrl-C too) and restored on the way
//! out, also after an error or a panic. Ctrl-] (0x1d, as in virsh) detaches,
//! on a terminal or not; so does the end of stdin.

use std::io::{IsTerminal, Read, Write};

use hearth_api::Kind;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::client::ApiClient;

/// The detach key: Ctrl-] (group separator).
pub const DETACH_BYTE: u8 = 0x1d;

/// The upgrade protocol hearthd's attach route speaks.
const PROTOCOL: &str = "hearth-console";

/// How long a detached client waits for hearthd to close the attach, so
/// that the next `hearth console` finds the console free.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Debug, clap::Args)]
#[command(
    about = "Attach to a VM's serial console (detach with Ctrl-])",
    after_help = "\
Only one client at a time: a second one is refused (409) while one is attached;
`hearth logs -f NAME` follows the output without attaching.

Examples:
  hearth console demo
  hearth console demo --tail 0     # no log lines first"
)]
pub struct Args {
    /// The VirtualMachine's name.
    #[arg(value_name = "NAME", value_parser = super::parse_name)]
    pub name: String,
    /// Lines of the console log to print before attaching.
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub tail: usize,
}

/// The last `n` lines of `log` (a trailing partial line counts as one).
pub fn last_lines(log: &[u8], n: usize) -> &[u8] {
    if n == 0 {
        return &[];
    }
    let body = log.strip_suffix(b"\n").unwrap_or(log);
    let mut seen = 0;
    for (i, b) in body.iter().enumerate().rev() {
        if *b == b'\n' {
            seen += 1;
            if seen == n {
                return &log[i + 1..];
            }
        }
    }
    log
}

/// Bytes of one read of stdin up to the detach key, and whether it came.
pub fn split_detach(buf: &[u8]) -> (&[u8], bool) {
    match buf.iter().position(|b| *b == DETACH_BYTE) {
        Some(i) => (&buf[..i], true),
        None => (buf, false),
    }
}

/// Puts the terminal on stdin in raw mode until dropped.
struct RawMode {
    saved: rustix::termios::Termios,
}

impl RawMode {
    fn enter() -> anyhow::Result<RawMode> {
        let stdin = std::io::stdin();
        let saved = rustix::termios::tcgetattr(&stdin)
            .map_err(|e| anyhow::anyhow!("cannot read the terminal settings of stdin: {e}"))?;
        let mut raw = saved.clone();
        raw.make_raw();
        rustix::termios::tcsetattr(&stdin, rustix::termios::OptionalActions::Now, &raw)
            .map_err(|e| anyhow::anyhow!("cannot put the terminal in raw mode: {e}"))?;
        Ok(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = rustix::termios::tcsetattr(
            std::io::stdin(),
            rustix::termios::OptionalActions::Now,
            &self.saved,
        );
    }
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let base = format!(
        "{}/console",
        super::object_path(Kind::VirtualMachine, &args.name)
    );
    if args.tail > 0 {
        let mut body = client.stream(&base).await?;
        let mut log = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame =
                frame.map_err(|e| anyhow::anyhow!("console log from hearthd broke: {e}"))?;
            if let Ok(data) = frame.into_data() {
                log.extend_from_slice(&data);
            }
        }
        let mut out = std::io::stdout().lock();
        out.write_all(last_lines(&log, args.tail))?;
        out.flush()?;
    }

    let conn = client.upgrade(&format!("{base}/attach"), PROTOCOL).await?;
    let tty = std::io::stdin().is_terminal();
    eprintln!(
        "Attached to the serial console of VirtualMachine {:?}. Detach with Ctrl-].",
        args.name
    );
    // Restored when this function returns or unwinds.
    let _raw = if tty { Some(RawMode::enter()?) } else { None };

    // A plain thread, not the runtime's: a read blocked on the terminal must
    // not keep the process from exiting after a detach.
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(16);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = [0u8; 4096];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        return;
                    }
                }
            }
        }
    });

    let (mut conn_rx, mut conn_tx) = tokio::io::split(conn);
    let mut output = tokio::spawn(async move {
        let mut out = tokio::io::stdout();
        let mut buf = [0u8; 4096];
        loop {
            match conn_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if out.write_all(&buf[..n]).await.is_err() || out.flush().await.is_err() {
                        return;
                    }
                }
            }
        }
    });

    let mut vm_gone = false;
    loop {
        tokio::select! {
            chunk = rx.recv() => {
                let Some(chunk) = chunk else { break };
                let (send, detach) = split_detach(&chunk);
                if !send.is_empty() {
                    conn_tx.write_all(send).await.map_err(|e| {
                        anyhow::anyhow!("console of VirtualMachine {:?}: sending failed: {e}", args.name)
                    })?;
                }
                if detach {
                    break;
                }
            }
            _ = &mut output => {
                vm_gone = true;
                break;
            }
        }
    }
    if !vm_gone {
        // Tell hearthd we are done and wait for it to let go of the console.
        let _ = conn_tx.shutdown().await;
        let _ = tokio::time::timeout(CLOSE_WAIT, &mut output).await;
    }
    drop(_raw);
    if vm_gone {
        eprintln!(
            "\r\nThe console of VirtualMachine {:?} closed (the VM stopped?).",
            args.name
        );
    } else {
        eprintln!("\r\nDetached from VirtualMachine {:?}.", args.name);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_lines_counts_from_the_end() {
        assert_eq!(last_lines(b"a\nb\nc\n", 2), b"b\nc\n");
        assert_eq!(last_lines(b"a\nb\nc", 2), b"b\nc");
        assert_eq!(last_lines(b"a\nb\n", 5), b"a\nb\n");
        assert_eq!(last_lines(b"a\nb\n", 0), b"");
        assert_eq!(last_lines(b"", 3), b"");
    }

    #[test]
    fn detach_key_cuts_the_read() {
        assert_eq!(split_detach(b"ls\r\x1dmore"), (&b"ls\r"[..], true));
        assert_eq!(split_detach(b"ls\r"), (&b"ls\r"[..], false));
        assert_eq!(split_detach(b"\x1d"), (&b""[..], true));
    }
}
