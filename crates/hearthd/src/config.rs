//! The configuration file (`/etc/hearth/hearthd.toml`, docs/configuration.md):
//! every flag of hearthd, merged under the command line and the environment.
//!
//! clap parses the command line and the environment first; `ArgMatches::
//! value_source` then tells, for every argument, whether its value came from
//! either of them. Only the arguments that did not are taken from the file,
//! so the precedence is flags > environment > file > defaults without a
//! second copy of the defaults.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow, bail};
use clap::parser::ValueSource;
use clap::{ArgMatches, FromArgMatches};
use serde::{Deserialize, Serialize};

use crate::{AccelChoice, Args, LogFormat};

/// Read when neither `--config` nor `HEARTH_CONFIG` names a file; it may be
/// missing.
pub const DEFAULT_PATH: &str = "/etc/hearth/hearthd.toml";

/// The file: every key optional, named as its flag (`state-dir` for
/// `--state-dir`, the list `image-roots` for the repeatable `--image-root`).
/// An unknown key is an error, not ignored: a misspelt key would otherwise
/// silently leave its setting at the default.
#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct FileConfig {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_dir: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_dir: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_roots: Option<Vec<PathBuf>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qemu_user: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accel: Option<AccelChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resync_seconds: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_external_programs: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub manifests: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub manifests_resync_seconds: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub manifests_delete_grace_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compaction_bytes_per_second: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dns_resolv_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ovmf_code: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ovmf_vars: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_connect_timeout_seconds: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_read_timeout_seconds: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_max_bytes: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub console_log_max_bytes: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_free_space_reserve: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_retry_max_seconds: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub registry_ca: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub registry_credentials: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub registry_insecure: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<SocketAddr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_allow_remote: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_format: Option<LogFormat>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_max_connections: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_max_connections: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http_header_timeout_seconds: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forward_max_connections: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forward_max_connections_total: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forward_connect_timeout_seconds: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forward_idle_timeout_seconds: Option<u64>,
    /// Git sources, each a `[[git]]` table (last: tables follow the keys).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub git: Option<Vec<GitSourceFile>>,
}

/// The file's `[[git]]` sources and `--git`'s, in that order.
pub fn all_git_sources(args: &Args) -> Vec<GitSourceFile> {
    let mut all = args.git_sources.clone();
    if let Some(url) = &args.git {
        all.push(GitSourceFile {
            name: args.git_name.clone(),
            url: url.clone(),
            reference: Some(args.git_ref.clone()),
            path: Some(args.git_path.clone()),
            interval_seconds: Some(args.git_interval_seconds),
            username: args.git_username.clone(),
            token_file: args.git_token_file.clone(),
            ca_file: args.git_ca_file.clone(),
            ssh_key_file: args.git_ssh_key_file.clone(),
            known_hosts_file: args.git_known_hosts_file.clone(),
            allowed_signers_file: args.git_allowed_signers.clone(),
            allowed_keys_file: args.git_allowed_keys.clone(),
        });
    }
    all
}

/// One `[[git]]` table: a repository whose manifests declare objects.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct GitSourceFile {
    pub name: String,
    pub url: String,
    #[serde(rename = "ref", default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval_seconds: Option<u64>,
    /// https: the user, and a file holding the token (read at each fetch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    /// https: the CA certificates (PEM) the server's must chain to, in
    /// place of the system's bundle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// ssh: the private key, and the known_hosts file the host must be in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_key_file: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub known_hosts_file: Option<PathBuf>,
    /// Only commits signed by a key of this file (ssh's allowed_signers
    /// format) are applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_signers_file: Option<PathBuf>,
    /// Only commits with an OpenPGP signature by a key of this file
    /// (public keys, armored or binary) are applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_keys_file: Option<PathBuf>,
}

/// Parses a configuration file's text; errors name the file and the key.
pub fn parse_file(text: &str, path: &Path) -> anyhow::Result<FileConfig> {
    let de = toml::Deserializer::parse(text).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let file: FileConfig = serde_path_to_error::deserialize(de).map_err(|e| {
        let key = e.path().to_string();
        let inner = e.into_inner();
        // The toml error carries the line and a caret under the value.
        if key.is_empty() || key == "." {
            anyhow!("{}: {inner}", path.display())
        } else {
            anyhow!("{}: {key}: {inner}", path.display())
        }
    })?;
    if let Some(q) = &file.console_log_max_bytes {
        hearth_api::Quantity::parse(q)
            .map_err(|e| anyhow!("{}: console-log-max-bytes: {e}", path.display()))?;
    }
    if let Some(q) = &file.image_max_bytes {
        hearth_api::Quantity::parse(q)
            .map_err(|e| anyhow!("{}: image-max-bytes: {e}", path.display()))?;
    }
    if let Some(q) = &file.image_free_space_reserve {
        hearth_api::Quantity::parse(q)
            .map_err(|e| anyhow!("{}: image-free-space-reserve: {e}", path.display()))?;
    }
    Ok(file)
}

/// Reads the file `--config`/`HEARTH_CONFIG` names, else the default one:
/// `None` when the default one does not exist (a named one must).
pub fn read_file(named: Option<&Path>) -> anyhow::Result<Option<(PathBuf, FileConfig)>> {
    let path = named.unwrap_or(Path::new(DEFAULT_PATH));
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && named.is_none() => return Ok(None),
        Err(e) => {
            return Err(e).with_context(|| format!("--config {}: cannot read", path.display()));
        }
    };
    Ok(Some((path.to_path_buf(), parse_file(&text, path)?)))
}

/// The effective arguments: those clap found on the command line or in the
/// environment, then the file's, then clap's defaults.
pub fn merge(matches: &ArgMatches, file: FileConfig) -> anyhow::Result<Args> {
    let mut args = Args::from_arg_matches(matches).map_err(|e| anyhow!("{e}"))?;
    let given = |id: &str| {
        matches!(
            matches.value_source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        )
    };
    // Destructured so that a key added to the file and not merged here does
    // not compile.
    let FileConfig {
        state_dir,
        run_dir,
        socket,
        image_roots,
        qemu_user,
        accel,
        resync_seconds,
        max_external_programs,
        manifests,
        manifests_resync_seconds,
        manifests_delete_grace_ms,
        compaction_bytes_per_second,
        dns_resolv_file,
        ovmf_code,
        ovmf_vars,
        image_connect_timeout_seconds,
        image_read_timeout_seconds,
        image_max_bytes,
        console_log_max_bytes,
        image_free_space_reserve,
        image_retry_max_seconds,
        registry_ca,
        registry_credentials,
        registry_insecure,
        metrics_listen,
        metrics_allow_remote,
        log_format,
        api_max_connections,
        metrics_max_connections,
        http_header_timeout_seconds,
        forward_max_connections,
        forward_max_connections_total,
        forward_connect_timeout_seconds,
        forward_idle_timeout_seconds,
        git,
    } = file;
    if let Some(g) = git {
        args.git_sources = g;
    }
    macro_rules! fill {
        ($($field:ident),* ; $($opt:ident),*) => {
            $(if let Some(v) = $field && !given(stringify!($field)) {
                args.$field = v;
            })*
            $(if let Some(v) = $opt && !given(stringify!($opt)) {
                args.$opt = Some(v);
            })*
        };
    }
    fill!(
        state_dir, run_dir, image_roots, qemu_user, accel, resync_seconds, max_external_programs, manifests,
        manifests_resync_seconds, manifests_delete_grace_ms, compaction_bytes_per_second,
        dns_resolv_file, ovmf_code, ovmf_vars, image_connect_timeout_seconds, image_read_timeout_seconds, image_max_bytes,
        console_log_max_bytes, image_free_space_reserve, image_retry_max_seconds, registry_ca, registry_credentials,
        registry_insecure, metrics_allow_remote, log_format,
        api_max_connections, metrics_max_connections, http_header_timeout_seconds,
        forward_max_connections, forward_max_connections_total, forward_connect_timeout_seconds,
        forward_idle_timeout_seconds;
        socket, metrics_listen
    );
    Ok(args)
}

/// The effective configuration in the file's format: every key with its
/// value, except the ones unset whose default is derived from others.
pub fn to_file(args: &Args) -> FileConfig {
    FileConfig {
        state_dir: Some(args.state_dir.clone()),
        run_dir: Some(args.run_dir.clone()),
        socket: args.socket.clone(),
        image_roots: (!args.image_roots.is_empty()).then(|| args.image_roots.clone()),
        qemu_user: Some(args.qemu_user.clone()),
        accel: Some(args.accel),
        resync_seconds: Some(args.resync_seconds),
        max_external_programs: Some(args.max_external_programs),
        manifests: Some(args.manifests.clone()),
        manifests_resync_seconds: Some(args.manifests_resync_seconds),
        manifests_delete_grace_ms: Some(args.manifests_delete_grace_ms),
        compaction_bytes_per_second: Some(args.compaction_bytes_per_second),
        dns_resolv_file: Some(args.dns_resolv_file.clone()),
        ovmf_code: Some(args.ovmf_code.clone()),
        ovmf_vars: Some(args.ovmf_vars.clone()),
        image_connect_timeout_seconds: Some(args.image_connect_timeout_seconds),
        image_read_timeout_seconds: Some(args.image_read_timeout_seconds),
        image_max_bytes: Some(args.image_max_bytes.clone()),
        console_log_max_bytes: Some(args.console_log_max_bytes.clone()),
        image_free_space_reserve: Some(args.image_free_space_reserve.clone()),
        image_retry_max_seconds: Some(args.image_retry_max_seconds),
        registry_ca: (!args.registry_ca.is_empty()).then(|| args.registry_ca.clone()),
        registry_credentials: (!args.registry_credentials.is_empty())
            .then(|| args.registry_credentials.clone()),
        registry_insecure: (!args.registry_insecure.is_empty())
            .then(|| args.registry_insecure.clone()),
        metrics_listen: args.metrics_listen,
        metrics_allow_remote: Some(args.metrics_allow_remote),
        log_format: Some(args.log_format),
        api_max_connections: Some(args.api_max_connections),
        metrics_max_connections: Some(args.metrics_max_connections),
        http_header_timeout_seconds: Some(args.http_header_timeout_seconds),
        forward_max_connections: Some(args.forward_max_connections),
        forward_max_connections_total: Some(args.forward_max_connections_total),
        forward_connect_timeout_seconds: Some(args.forward_connect_timeout_seconds),
        forward_idle_timeout_seconds: Some(args.forward_idle_timeout_seconds),
        git: Some(all_git_sources(args)).filter(|g| !g.is_empty()),
    }
}

/// `hearthd --print-config`: a valid file that configures what these
/// arguments do.
pub fn render(args: &Args) -> anyhow::Result<String> {
    let file = to_file(args);
    let mut out = String::from(
        "# hearthd configuration (hearthd --print-config); keys: docs/configuration.md\n",
    );
    for (unset, key, default) in [
        (file.socket.is_none(), "socket", "RUN_DIR/hearthd.sock"),
        (
            file.image_roots.is_none(),
            "image-roots",
            "[STATE_DIR/images]",
        ),
        (
            file.metrics_listen.is_none(),
            "metrics-listen",
            "no TCP listener",
        ),
        (file.registry_ca.is_none(), "registry-ca", "[]"),
        (
            file.registry_credentials.is_none(),
            "registry-credentials",
            "[]",
        ),
        (file.registry_insecure.is_none(), "registry-insecure", "[]"),
    ] {
        if unset {
            out.push_str(&format!("# {key}: unset ({default})\n"));
        }
    }
    let body = toml::to_string(&file).map_err(|e| {
        anyhow!("the configuration cannot be written as TOML (paths must be UTF-8): {e}")
    })?;
    out.push_str(&body);
    Ok(out)
}

/// The default configuration file (`hearthd --generate config`, shipped as
/// /etc/hearth/hearthd.toml): every key commented out, each under its
/// flag's help, with its default value. Built from clap's defaults alone:
/// neither the environment nor an existing file leaks into it.
pub fn render_defaults() -> anyhow::Result<String> {
    let cmd = <Args as clap::CommandFactory>::command().mut_args(|a| a.env(None));
    let matches = cmd
        .clone()
        .try_get_matches_from(["hearthd"])
        .map_err(|e| anyhow!("{e}"))?;
    let args = Args::from_arg_matches(&matches).map_err(|e| anyhow!("{e}"))?;
    let mut file = to_file(&args);
    // The keys unset by default, shown with what their default amounts to
    // (or an example), and a note saying so.
    let mut notes = vec![];
    if file.socket.is_none() {
        file.socket = Some(args.run_dir.join("hearthd.sock"));
        notes.push((
            "socket",
            "Unset by default; the value shown is what that comes to.",
        ));
    }
    if file.image_roots.is_none() {
        file.image_roots = Some(vec![args.state_dir.join("images")]);
        notes.push((
            "image-roots",
            "Unset by default; the value shown is what that comes to.",
        ));
    }
    if file.metrics_listen.is_none() {
        file.metrics_listen = Some(SocketAddr::from(([127, 0, 0, 1], 9464)));
        notes.push((
            "metrics-listen",
            "Unset by default (no TCP listener); the value shown is an example.",
        ));
    }
    const EXAMPLE: &str = "Empty by default; the value shown is an example.";
    for (list, key, example) in [
        (
            &mut file.registry_ca,
            "registry-ca",
            "registry.example:5000=/etc/hearth/registry-ca.pem",
        ),
        (
            &mut file.registry_credentials,
            "registry-credentials",
            "registry.example:5000=/etc/hearth/registry-credentials.json",
        ),
        (
            &mut file.registry_insecure,
            "registry-insecure",
            "registry.lab:5000",
        ),
    ] {
        if list.is_none() {
            *list = Some(vec![example.to_string()]);
            notes.push((key, EXAMPLE));
        }
    }
    // Tables come after every key, with a help of their own (no flag has
    // one to give).
    let git = file.git.take();
    let body = toml::to_string(&file)
        .map_err(|e| anyhow!("the default configuration cannot be written as TOML: {e}"))?;
    let mut out = String::from(
        "# hearthd configuration. Every key is shown commented out with its default;\n\
         # uncomment and change the ones to set. Flags and HEARTH_* environment\n\
         # variables win over this file (docs/configuration.md, hearthd(8)).\n",
    );
    for line in body.lines() {
        let Some((key, _)) = line.split_once(" = ") else {
            bail!("the default configuration has an unexpected line {line:?}");
        };
        let id = key.replace('-', "_");
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id() == id.as_str())
            .ok_or_else(|| anyhow!("configuration key {key}: no flag of that name"))?;
        // clap drops the doc comment's final period; the file is prose.
        let mut help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        if !help.is_empty() && !help.ends_with('.') {
            help.push('.');
        }
        out.push('\n');
        for text in std::iter::once(help.as_str())
            .chain(notes.iter().filter(|(k, _)| *k == key).map(|(_, n)| *n))
        {
            for wrapped in wrap(text, 76) {
                out.push_str("# ");
                out.push_str(&wrapped);
                out.push('\n');
            }
        }
        out.push('#');
        out.push_str(line);
        out.push('\n');
    }
    if git.is_none() {
        out.push_str(&git_example()?);
    }
    Ok(out)
}

/// The shipped file's `[[git]]` example, commented out.
fn git_example() -> anyhow::Result<String> {
    let example = FileConfig {
        git: Some(vec![example_git_source()]),
        ..FileConfig::default()
    };
    let table = toml::to_string(&example)
        .map_err(|e| anyhow!("the [[git]] example cannot be written as TOML: {e}"))?;
    let help = "A git repository whose manifests declare objects, one [[git]] table \
        each (several may run beside the manifest directory; docs/sources.md). \
        None by default; the table shown is an example. Besides name and url: \
        ref (a branch, a tag, HEAD or a commit id; default HEAD), path (the \
        folder whose manifests count; default the whole repository), \
        interval-seconds (default 30); for https username, token-file and \
        ca-file; for ssh ssh-key-file and known-hosts-file; to apply signed \
        commits only, allowed-signers-file (ssh) or allowed-keys-file \
        (OpenPGP). hearthd never writes into the repository.";
    let mut out = String::from("\n");
    for wrapped in wrap(help, 76) {
        out.push_str("# ");
        out.push_str(&wrapped);
        out.push('\n');
    }
    for line in table.lines().filter(|l| !l.is_empty()) {
        out.push('#');
        out.push_str(line);
        out.push('\n');
    }
    Ok(out)
}

fn example_git_source() -> GitSourceFile {
    GitSourceFile {
        name: "infra".into(),
        url: "https://git.example/infra/vms.git".into(),
        reference: Some("main".into()),
        path: Some("hosts".into()),
        interval_seconds: Some(30),
        username: Some("deploy".into()),
        token_file: Some("/etc/hearth/git-token".into()),
        ca_file: None,
        ssh_key_file: None,
        known_hosts_file: None,
        allowed_signers_file: Some("/etc/hearth/allowed_signers".into()),
        allowed_keys_file: None,
    }
}

/// Greedy word wrap at `width` columns.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = vec![];
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines
}

/// Reads the file and merges it under the parsed command line and
/// environment.
pub fn load(matches: &ArgMatches) -> anyhow::Result<(Args, Option<PathBuf>)> {
    let named: Option<PathBuf> = matches.get_one::<PathBuf>("config").cloned();
    let (path, file) = match read_file(named.as_deref())? {
        Some((p, f)) => (Some(p), f),
        None => (None, FileConfig::default()),
    };
    let args = merge(matches, file)?;
    if args.socket.as_deref() == Some(Path::new("")) {
        bail!("socket: must not be empty");
    }
    Ok((args, path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use std::sync::Mutex;

    /// The tests that set HEARTH_* variables run one at a time; nothing else
    /// in this binary reads them.
    static ENV: Mutex<()> = Mutex::new(());

    struct EnvVar(&'static str);
    impl EnvVar {
        fn set(name: &'static str, value: &str) -> EnvVar {
            // SAFETY: under ENV; no other thread of this test binary reads
            // or writes HEARTH_* variables.
            unsafe { std::env::set_var(name, value) };
            EnvVar(name)
        }
    }
    impl Drop for EnvVar {
        fn drop(&mut self) {
            // SAFETY: as in `set`.
            unsafe { std::env::remove_var(self.0) };
        }
    }

    fn lock() -> std::sync::MutexGuard<'static, ()> {
        ENV.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn resolve(argv: &[&str], file: &str) -> Args {
        let matches = Args::command()
            .try_get_matches_from(std::iter::once("hearthd").chain(argv.iter().copied()))
            .expect("arguments parse");
        let file = parse_file(file, Path::new("/t/hearthd.toml")).expect("file parses");
        merge(&matches, file).expect("merge")
    }

    const FILE: &str = r#"
state-dir = "/from/file/state"
accel = "tcg"
resync-seconds = 5
image-roots = ["/a", "/b"]
metrics-listen = "127.0.0.1:9464"
log-format = "json"
"#;

    #[test]
    fn the_file_fills_what_nothing_else_sets() {
        let _g = lock();
        let a = resolve(&[], FILE);
        assert_eq!(a.state_dir, PathBuf::from("/from/file/state"));
        assert_eq!(a.accel, AccelChoice::Tcg);
        assert_eq!(a.resync_seconds, 5);
        assert_eq!(
            a.image_roots,
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        assert_eq!(a.metrics_listen, Some("127.0.0.1:9464".parse().unwrap()));
        assert_eq!(a.log_format, LogFormat::Json);
        // Not in the file: clap's defaults.
        assert_eq!(a.run_dir, PathBuf::from("/run/hearth"));
        assert_eq!(a.manifests_resync_seconds, 30);
        assert_eq!(a.image_max_bytes, "256Gi");
        assert_eq!(a.image_free_space_reserve, "1Gi");
        assert_eq!(a.socket, None);
        // And no file at all: every default.
        let d = resolve(&[], "");
        assert_eq!(d.state_dir, PathBuf::from("/var/lib/hearth"));
        assert_eq!(d.accel, AccelChoice::Auto);
        assert_eq!(d.log_format, LogFormat::Text);
        assert!(d.image_roots.is_empty());
    }

    #[test]
    fn the_environment_wins_over_the_file() {
        let _g = lock();
        let _accel = EnvVar::set("HEARTH_ACCEL", "kvm");
        let _state = EnvVar::set("HEARTH_STATE_DIR", "/from/env");
        let _roots = EnvVar::set("HEARTH_IMAGE_ROOTS", "/e1:/e2");
        let a = resolve(&[], FILE);
        assert_eq!(a.accel, AccelChoice::Kvm);
        assert_eq!(a.state_dir, PathBuf::from("/from/env"));
        assert_eq!(
            a.image_roots,
            vec![PathBuf::from("/e1"), PathBuf::from("/e2")]
        );
        // What the environment does not set still comes from the file.
        assert_eq!(a.resync_seconds, 5);
    }

    #[test]
    fn a_flag_wins_over_the_environment_and_the_file() {
        let _g = lock();
        let _accel = EnvVar::set("HEARTH_ACCEL", "kvm");
        let _format = EnvVar::set("HEARTH_LOG_FORMAT", "json");
        let a = resolve(
            &[
                "--accel",
                "auto",
                "--resync-seconds",
                "9",
                "--log-format",
                "text",
                "--image-root",
                "/f",
            ],
            FILE,
        );
        assert_eq!(a.accel, AccelChoice::Auto);
        assert_eq!(a.resync_seconds, 9);
        assert_eq!(a.log_format, LogFormat::Text);
        assert_eq!(a.image_roots, vec![PathBuf::from("/f")]);
        assert_eq!(a.state_dir, PathBuf::from("/from/file/state"));
    }

    #[test]
    fn a_flag_false_by_default_is_set_by_the_file() {
        let _g = lock();
        let a = resolve(&[], "metrics-allow-remote = true");
        assert!(a.metrics_allow_remote);
    }

    #[test]
    fn an_unknown_key_is_refused_with_its_name_and_the_file() {
        let e = parse_file(
            "state-dir = \"/x\"\nresync-secs = 3\n",
            Path::new("/t/h.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("resync-secs"), "{e}");
        assert!(e.contains("/t/h.toml"), "{e}");
        // An unknown table too.
        let e = parse_file("[metrics]\nlisten = 1\n", Path::new("/t/h.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("metrics"), "{e}");
    }

    #[test]
    fn a_bad_value_is_refused_with_its_key() {
        for (text, key) in [
            ("resync-seconds = \"soon\"", "resync-seconds"),
            ("resync-seconds = -1", "resync-seconds"),
            ("accel = \"fast\"", "accel"),
            ("log-format = \"xml\"", "log-format"),
            ("metrics-listen = \"localhost\"", "metrics-listen"),
            ("image-roots = \"/one\"", "image-roots"),
            ("image-max-bytes = \"lots\"", "image-max-bytes"),
            (
                "image-free-space-reserve = \"some\"",
                "image-free-space-reserve",
            ),
            ("metrics-allow-remote = \"yes\"", "metrics-allow-remote"),
        ] {
            let e = parse_file(text, Path::new("/t/h.toml"))
                .expect_err(text)
                .to_string();
            assert!(e.starts_with(&format!("/t/h.toml: {key}: ")), "{text}: {e}");
        }
        // Not TOML at all: the file and the line.
        let e = parse_file("state-dir = ", Path::new("/t/h.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("/t/h.toml: ") && e.contains("line 1"), "{e}");
    }

    #[test]
    fn the_default_file_sets_nothing_and_uncommented_gives_the_defaults() {
        let _g = lock();
        let _state = EnvVar::set("HEARTH_STATE_DIR", "/from/env");
        let text = render_defaults().expect("renders");
        // The environment did not leak into the shipped file.
        assert!(!text.contains("/from/env"), "{text}");
        // As shipped: loads, and sets nothing.
        let file = parse_file(&text, Path::new("/etc/hearth/hearthd.toml")).expect("parses");
        assert_eq!(file, FileConfig::default());
        // Every key of the file is there, commented out.
        let uncommented: String = text
            .lines()
            .filter_map(|l| l.strip_prefix('#').filter(|l| !l.starts_with(' ')))
            .map(|l| format!("{l}\n"))
            .collect();
        let all = parse_file(&uncommented, Path::new("/t/all.toml")).expect("uncommented parses");
        drop(_state);
        let all =
            to_file(&merge(&Args::command().get_matches_from(["hearthd"]), all).expect("merge"));
        let mut expected = to_file(&resolve(&[], ""));
        expected.socket = Some("/run/hearth/hearthd.sock".into());
        expected.image_roots = Some(vec!["/var/lib/hearth/images".into()]);
        expected.metrics_listen = Some("127.0.0.1:9464".parse().unwrap());
        expected.registry_ca = Some(vec![
            "registry.example:5000=/etc/hearth/registry-ca.pem".into(),
        ]);
        expected.registry_credentials = Some(vec![
            "registry.example:5000=/etc/hearth/registry-credentials.json".into(),
        ]);
        expected.registry_insecure = Some(vec!["registry.lab:5000".into()]);
        expected.git = Some(vec![example_git_source()]);
        assert_eq!(all, expected);
        // The lists and the table under their help.
        assert!(
            text.contains("# Empty by default; the value shown is an example.\n#registry-insecure = [\"registry.lab:5000\"]\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "hearthd never writes into the repository.\n#[[git]]\n#name = \"infra\"\n"
            ),
            "{text}"
        );
        // Each key under its flag's help.
        assert!(
            text.contains(
                "# Database, disk images and console logs.\n#state-dir = \"/var/lib/hearth\"\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn a_named_file_must_exist() {
        let e = read_file(Some(Path::new("/nonexistent/hearthd.toml")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/hearthd.toml"), "{e}");
    }

    #[test]
    fn the_printed_configuration_reads_back_to_itself() {
        let _g = lock();
        for (argv, file) in [
            (&[][..], ""),
            (&[][..], FILE),
            (&["--socket", "/s.sock", "--metrics-allow-remote"][..], FILE),
        ] {
            let a = resolve(argv, file);
            let printed = render(&a).expect("render");
            let again = resolve(&[], &printed);
            assert_eq!(render(&again).expect("render"), printed);
            assert_eq!(to_file(&again), to_file(&a));
        }
    }
}
