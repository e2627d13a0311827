//! `hearth exec VM -- CMD ARGS...`: a program run in the guest through the
//! guest agent, with its output, its exit status and (from a pipe) its stdin.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use base64::Engine as _;
use hearth_api::Kind;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;
use tokio::time::Instant;

use crate::client::ApiClient;

/// The most stdin a program can be given (hearthd's bound: it travels in
/// the one request that starts the program).
pub const MAX_STDIN: usize = 1 << 20;
/// How long one status request may wait on hearthd for the program to end.
const LONG_POLL: Duration = Duration::from_secs(25);

#[derive(Debug, clap::Args)]
#[command(
    about = "Run a program in a VM's guest through the guest agent",
    long_about = "Run a program in a VM's guest through the guest agent (qemu-ga's \
guest-exec) and print its stdout and stderr. hearth exits with the program's exit status, \
or 128+N when a signal N ended it.\n\n\
The guest agent returns a program's output only when the program has ended, so the output \
appears then, not line by line. When stdin is not a terminal it is passed to the program \
(at most 1 MiB; use `hearth cp` for more); -n gives the program an empty stdin instead.",
    after_help = "\
Examples:
  hearth exec demo -- uname -a
  hearth exec demo -- sh -c 'echo out; echo err >&2; exit 3'; echo $?   # 3
  echo hello | hearth exec demo -- cat
  hearth exec demo --timeout 10s -- sleep 30; echo $?                 # 124

Exit status: the program's; 124 when --timeout ran out (the program keeps running in
the guest: the agent cannot stop it); 125 when hearth could not run it."
)]
pub struct Args {
    /// The VirtualMachine's name.
    #[arg(value_name = "VM", value_parser = super::parse_name)]
    pub vm: String,
    /// Stop waiting after this long (e.g. 30s, 2m) and exit 124.
    #[arg(long, value_name = "DURATION", value_parser = super::wait::parse_duration)]
    pub timeout: Option<Duration>,
    /// Do not read stdin, even when it is not a terminal.
    #[arg(short = 'n', long)]
    pub no_stdin: bool,
    /// The program and its arguments (after `--`); the guest agent looks the
    /// program up in the guest's PATH.
    #[arg(value_name = "CMD", required = true, last = true, num_args = 1..)]
    pub command: Vec<String>,
}

/// How `hearth exec` ends when it does not end with 0: the exit status, and
/// what to say first (printed as `error: ...`), if anything.
#[derive(Debug)]
pub struct Exit {
    pub code: u8,
    pub message: Option<String>,
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.message {
            Some(m) => f.write_str(m),
            None => write!(f, "exit status {}", self.code),
        }
    }
}

impl std::error::Error for Exit {}

/// hearth's own failure (`timeout` and `docker run` use the same number).
const OWN_FAILURE: u8 = 125;
const TIMED_OUT: u8 = 124;

fn failed(e: impl std::fmt::Display) -> anyhow::Error {
    Exit {
        code: OWN_FAILURE,
        message: Some(e.to_string()),
    }
    .into()
}

/// 0..=255 as is; a signal N as 128+N, as shells report it.
pub fn exit_status(exit_code: Option<i64>, signal: Option<i64>) -> u8 {
    match (exit_code, signal) {
        (Some(c), _) => u8::try_from(c.rem_euclid(256)).unwrap_or(OWN_FAILURE),
        (None, Some(s)) => u8::try_from((128 + s).clamp(0, 255)).unwrap_or(OWN_FAILURE),
        (None, None) => OWN_FAILURE,
    }
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let deadline = args.timeout.map(|t| Instant::now() + t);
    let mut body = json!({"path": args.command[0], "args": &args.command[1..]});
    if !args.no_stdin && !std::io::stdin().is_terminal() {
        let input = read_stdin(deadline, args).await?;
        if !input.is_empty() {
            body["stdinBase64"] = base64::engine::general_purpose::STANDARD
                .encode(&input)
                .into();
        }
    }
    let base = format!(
        "{}/agent/exec",
        super::object_path(Kind::VirtualMachine, &args.vm)
    );
    let started = client
        .post(&format!("{base}/start"), Some(&body))
        .await
        .map_err(failed)?;
    let (Some(id), Some(pid)) = (
        started.get("id").and_then(Value::as_u64),
        started.get("pid").and_then(Value::as_i64),
    ) else {
        return Err(failed(format!(
            "hearthd's answer to the start has no id and pid: {started}"
        )));
    };
    loop {
        let wait = match deadline {
            None => LONG_POLL,
            Some(d) => d.saturating_duration_since(Instant::now()).min(LONG_POLL),
        };
        let status = client
            .get(&format!("{base}/{id}?waitMs={}", wait.as_millis()))
            .await
            .map_err(failed)?;
        if status.get("exited").and_then(Value::as_bool) == Some(true) {
            return finish(&status);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(Exit {
                code: TIMED_OUT,
                message: Some(format!(
                    "{:?} did not end within {}; it goes on running in VM {:?} as pid {pid} (the guest agent cannot stop a program; `hearth exec {} -- kill {pid}` can)",
                    args.command.join(" "),
                    humanize(args.timeout.unwrap_or_default()),
                    args.vm,
                    args.vm,
                )),
            }
            .into());
        }
    }
}

/// Stdin, bounded by [`MAX_STDIN`] and by the timeout.
async fn read_stdin(deadline: Option<Instant>, args: &Args) -> anyhow::Result<Vec<u8>> {
    let mut input = Vec::new();
    let mut stdin = tokio::io::stdin().take(MAX_STDIN as u64 + 1);
    let read = stdin.read_to_end(&mut input);
    let outcome = match deadline {
        None => read.await,
        Some(d) => match tokio::time::timeout_at(d, read).await {
            Ok(r) => r,
            Err(_) => {
                return Err(Exit {
                    code: TIMED_OUT,
                    message: Some(format!(
                        "stdin did not end within {}; nothing was run (pass -n if the program needs no stdin)",
                        humanize(args.timeout.unwrap_or_default())
                    )),
                }
                .into());
            }
        },
    };
    outcome.map_err(|e| failed(format!("cannot read stdin: {e}")))?;
    if input.len() > MAX_STDIN {
        return Err(failed(format!(
            "stdin is larger than {} MiB, the most a program can be given through the guest agent; copy it with `hearth cp - {}:/PATH` and redirect it in the guest",
            MAX_STDIN >> 20,
            args.vm
        )));
    }
    Ok(input)
}

/// Prints what the program wrote and ends with its status.
fn finish(status: &Value) -> anyhow::Result<()> {
    let decode = |key: &str| -> anyhow::Result<Vec<u8>> {
        let text = status.get(key).and_then(Value::as_str).unwrap_or_default();
        base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(|e| failed(format!("hearthd sent {key} that is not base64: {e}")))
    };
    let (stdout, stderr) = (decode("stdoutBase64")?, decode("stderrBase64")?);
    {
        let mut out = std::io::stdout().lock();
        out.write_all(&stdout)?;
        out.flush()?;
    }
    {
        let mut err = std::io::stderr().lock();
        err.write_all(&stderr)?;
        if status.get("truncated").and_then(Value::as_bool) == Some(true) {
            writeln!(
                err,
                "hearth: the guest agent cut the program's output short (it keeps at most 16 MiB of each stream)"
            )?;
        }
        err.flush()?;
    }
    let code = exit_status(
        status.get("exitCode").and_then(Value::as_i64),
        status.get("signal").and_then(Value::as_i64),
    );
    if code == 0 {
        Ok(())
    } else {
        Err(Exit {
            code,
            message: None,
        }
        .into())
    }
}

fn humanize(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    #[test]
    fn the_command_comes_after_a_double_dash_with_its_own_flags() {
        let cli =
            Cli::try_parse_from(["exec", "demo", "--timeout", "2s", "--", "ls", "-l", "--all"])
                .expect("parses");
        assert_eq!(cli.args.vm, "demo");
        assert_eq!(cli.args.timeout, Some(Duration::from_secs(2)));
        assert_eq!(cli.args.command, ["ls", "-l", "--all"]);
        assert!(!cli.args.no_stdin);
        assert!(Cli::try_parse_from(["exec", "demo"]).is_err(), "no command");
        assert!(
            Cli::try_parse_from(["exec", "Demo", "--", "ls"]).is_err(),
            "bad name"
        );
        assert!(Cli::try_parse_from(["exec", "demo", "--timeout", "soon", "--", "ls"]).is_err());
    }

    #[test]
    fn exit_status_is_the_programs_or_128_plus_the_signal() {
        assert_eq!(exit_status(Some(0), None), 0);
        assert_eq!(exit_status(Some(3), None), 3);
        assert_eq!(exit_status(Some(255), None), 255);
        assert_eq!(exit_status(Some(256), None), 0);
        assert_eq!(exit_status(None, Some(9)), 137);
        assert_eq!(exit_status(None, Some(15)), 143);
        assert_eq!(exit_status(None, None), OWN_FAILURE);
    }
}
