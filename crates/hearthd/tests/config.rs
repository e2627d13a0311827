//! The configuration file, `--print-config` and `--log-format json` against
//! the real hearthd binary (docs/configuration.md).

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::hearthd_bin;

/// hearthd with only the given environment (none of the caller's HEARTH_*).
fn hearthd(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(hearthd_bin())
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .output()
        .expect("run hearthd")
}

/// hearthd with its own run and state directories under `dir` (which a
/// test checks it did not get as far as), TCG, and `extra`.
fn hearthd_in(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let (run, state) = (dir.join("run"), dir.join("state"));
    let mut args = vec![
        "--run-dir",
        run.to_str().unwrap(),
        "--state-dir",
        state.to_str().unwrap(),
        "--accel",
        "tcg",
    ];
    args.extend_from_slice(extra);
    hearthd(&args, env)
}

fn print_config(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut argv = vec!["--print-config"];
    argv.extend_from_slice(args);
    let out = hearthd(&argv, env);
    assert!(
        out.status.success(),
        "hearthd {argv:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write config");
    p.to_str().expect("UTF-8 temp path").to_string()
}

#[test]
fn print_config_merges_flags_environment_and_file_and_round_trips() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write(
        dir.path(),
        "hearthd.toml",
        r#"
state-dir = "/file/state"
run-dir = "/file/run"
accel = "kvm"
resync-seconds = 7
image-roots = ["/file/images"]
log-format = "json"
"#,
    );
    let printed = print_config(
        &["--state-dir", "/flag/state"],
        &[
            ("HEARTH_CONFIG", &file),
            ("HEARTH_STATE_DIR", "/env/state"),
            ("HEARTH_ACCEL", "tcg"),
        ],
    );
    let t: toml::Table = printed
        .parse()
        .unwrap_or_else(|e| panic!("--print-config is not TOML: {e}\n{printed}"));
    let s = |k: &str| t[k].as_str().unwrap_or_else(|| panic!("{k} in {printed}"));
    assert_eq!(s("state-dir"), "/flag/state", "flag over env and file");
    assert_eq!(s("accel"), "tcg", "env over file");
    assert_eq!(s("run-dir"), "/file/run", "file over default");
    assert_eq!(t["resync-seconds"].as_integer(), Some(7));
    assert_eq!(s("log-format"), "json");
    assert_eq!(t["image-roots"].as_array().map(Vec::len), Some(1));
    assert_eq!(s("manifests"), "/etc/hearth/manifests", "default");
    assert_eq!(t["metrics-allow-remote"].as_bool(), Some(false));

    // Fed back as the file, alone, it configures the same.
    let again = write(dir.path(), "printed.toml", &printed);
    assert_eq!(print_config(&["--config", &again], &[]), printed);
}

#[test]
fn a_named_file_that_is_missing_or_has_an_unknown_key_stops_hearthd() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("nope.toml");
    let out = hearthd(&["--config", missing.to_str().unwrap()], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started without its file: {err}");
    assert!(err.contains("nope.toml"), "{err}");

    let bad = write(
        dir.path(),
        "bad.toml",
        "state-dir = \"/x\"\nmetrics-listen-addr = \"127.0.0.1:1\"\n",
    );
    // Not only --print-config: a start fails before anything else.
    let run = dir.path().join("run");
    let out = hearthd(
        &["--run-dir", run.to_str().unwrap(), "--accel", "tcg"],
        &[("HEARTH_CONFIG", &bad)],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started with an unknown key: {err}");
    assert!(err.contains("metrics-listen-addr"), "{err}");
    assert!(err.contains("bad.toml"), "{err}");
    assert!(!run.exists(), "it got as far as creating its run directory");

    let bad = write(dir.path(), "value.toml", "resync-seconds = \"often\"\n");
    let out = hearthd(&["--print-config", "--config", &bad], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("value.toml: resync-seconds: "), "{err}");
}

#[test]
fn log_format_json_writes_one_json_object_a_line() {
    let _serial = common::serial();
    let images = tempfile::tempdir().expect("tempdir");
    let mut d = common::Daemon::start_without_guest(&[images.path()], &["--log-format", "json"]);
    d.kill();
    let log = d.log();
    let mut messages = Vec::new();
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}\nlog:\n{log}"));
        assert!(v["level"].is_string(), "no level: {line}");
        assert!(v["timestamp"].is_string(), "no timestamp: {line}");
        let msg = v["fields"]["message"]
            .as_str()
            .unwrap_or_else(|| panic!("no fields.message: {line}"));
        messages.push(msg.to_string());
        if msg == "accelerator chosen" {
            assert_eq!(v["fields"]["accelerator"], "tcg", "{line}");
        }
    }
    for want in [
        "configuration file read",
        "accelerator chosen",
        "serving the API",
    ] {
        assert!(
            messages.iter().any(|m| m == want),
            "no {want:?} among {messages:?}"
        );
    }
}

#[test]
fn a_qemu_user_that_does_not_exist_stops_hearthd_naming_the_command_that_creates_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write(
        dir.path(),
        "user.toml",
        "qemu-user = \"hearth-no-such-user\"\n",
    );
    let (run, state) = (dir.path().join("run"), dir.path().join("state"));
    let out = hearthd_in(dir.path(), &[], &[("HEARTH_CONFIG", &file)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "started without its QEMU user: {err}"
    );
    assert!(
        err.contains("\"hearth-no-such-user\": no such user"),
        "{err}"
    );
    assert!(
        err.contains(
            "useradd --system --user-group --no-create-home --shell /usr/sbin/nologin hearth-no-such-user"
        ),
        "{err}"
    );
    assert!(err.contains("usermod -aG kvm hearth-no-such-user"), "{err}");
    assert!(
        !run.exists() && !state.exists(),
        "it got as far as its directories"
    );
    // The flag wins over the file; the default is hearth-qemu.
    let printed = print_config(&["--qemu-user", "root", "--config", &file], &[]);
    assert!(printed.contains("qemu-user = \"root\""), "{printed}");
    let printed = print_config(&[], &[]);
    assert!(printed.contains("qemu-user = \"hearth-qemu\""), "{printed}");
}

#[test]
fn qemu_user_root_is_allowed_with_a_warning() {
    let _serial = common::serial();
    let images = tempfile::tempdir().expect("tempdir");
    let mut d = common::Daemon::start_without_guest(&[images.path()], &["--qemu-user", "root"]);
    d.kill();
    let log = d.log();
    assert!(
        log.contains(
            "QEMU runs as root: a guest that takes over its QEMU can open any file of the host"
        ),
        "{log}"
    );
    assert!(log.contains("WARN"), "{log}");
}

#[test]
fn a_console_log_bound_too_small_to_keep_stops_hearthd_naming_the_flag() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = hearthd_in(
        dir.path(),
        &["--qemu-user", "root", "--console-log-max-bytes", "1Ki"],
        &[],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started with a 1 KiB bound: {err}");
    assert!(
        err.contains("--console-log-max-bytes 1Ki: at least 64Ki (or 0 for no bound)"),
        "{err}"
    );
    let printed = print_config(&[], &[]);
    assert!(
        printed.contains("console-log-max-bytes = \"8Mi\""),
        "{printed}"
    );
}
