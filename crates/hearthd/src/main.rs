//! hearthd: wires the engine to its configuration and serves the HTTP API.

mod api;
mod config;
mod descriptors;
mod generate;
mod serve;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use hearth_engine::{Engine, EngineConfig};
use hearth_qemu::accel::{self, AccelDecision};
use hearth_qemu::cmdline::Accel;

/// The hearth daemon: keeps VirtualMachines, VirtualDisks, VirtualImages and
/// VirtualNetworks in their declared state on this host, takes consistent
/// snapshots of them, and serves the API that `hearth` talks to.
///
/// Every flag can also be set in the configuration file (its long name as the
/// key; flags > environment > file > defaults: docs/configuration.md).
#[derive(clap::Parser, Debug)]
#[command(
    version,
    after_help = "Example:\n  hearthd --image-root /srv/images\n\nVMs keep running when hearthd stops; a restarted hearthd adopts them."
)]
struct Args {
    /// The configuration file (TOML). Default /etc/hearth/hearthd.toml,
    /// which may be missing; a file named here must exist.
    #[arg(long, env = "HEARTH_CONFIG", value_name = "PATH")]
    config: Option<PathBuf>,
    /// Print the effective configuration (flags, environment and file
    /// merged) as a configuration file, and exit.
    #[arg(long)]
    print_config: bool,
    /// Log lines as text, or as one JSON object a line (for log collectors).
    #[arg(long, env = "HEARTH_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Database, disk images and console logs.
    #[arg(long, env = "HEARTH_STATE_DIR", default_value = "/var/lib/hearth")]
    state_dir: PathBuf,
    /// Sockets of running VMs.
    #[arg(long, env = "HEARTH_RUN_DIR", default_value = "/run/hearth")]
    run_dir: PathBuf,
    /// The API socket (mode 0600). Default: RUN_DIR/hearthd.sock.
    #[arg(long, env = "HEARTH_SOCKET")]
    socket: Option<PathBuf>,
    /// A directory that kernels, initrds and base images may come from.
    /// Repeat it for several; default STATE_DIR/images.
    #[arg(long = "image-root", env = "HEARTH_IMAGE_ROOTS", value_delimiter = ':')]
    image_roots: Vec<PathBuf>,
    /// The user every VM's QEMU runs as: its uid, its primary group, and
    /// `kvm` as the only supplementary group (when KVM is used and /dev/kvm
    /// belongs to it). It needs access to none of hearth's files: hearthd
    /// opens them and hands them over. `root` keeps QEMU as root (not
    /// recommended; logged as a warning).
    #[arg(long, env = "HEARTH_QEMU_USER", default_value = hearth_qemu::handover::DEFAULT_QEMU_USER)]
    qemu_user: String,
    /// Accelerator: auto (KVM if a probe VM really runs under it, else TCG), kvm or tcg.
    #[arg(long, env = "HEARTH_ACCEL", value_enum, default_value = "auto")]
    accel: AccelChoice,
    /// Seconds between full resyncs of every object.
    #[arg(long, default_value_t = 10)]
    resync_seconds: u64,
    /// How many external programs (qemu-img, nft) hearthd runs at once, for
    /// all objects together; long copies (qemu-img convert, rebase) have
    /// half as many slots of their own. 0: twice the number of CPUs.
    #[arg(long, env = "HEARTH_MAX_EXTERNAL_PROGRAMS", default_value_t = 0)]
    max_external_programs: usize,
    /// The manifest directory: VMs and disks declared in its *.yaml, *.yml and
    /// *.json files are kept in their declared state. It may be missing (it is
    /// then waited for, and nothing is deleted); hearthd never writes into it.
    #[arg(
        long,
        env = "HEARTH_MANIFESTS",
        default_value = "/etc/hearth/manifests"
    )]
    manifests: PathBuf,
    /// Seconds between full re-lists of the manifest directory even without
    /// inotify events.
    #[arg(long, default_value_t = 30)]
    manifests_resync_seconds: u64,
    /// How long (ms) a manifest file must be gone, confirmed by a second
    /// look, before its objects are deleted.
    #[arg(long, default_value_t = 2000)]
    manifests_delete_grace_ms: u64,
    /// The rate limit (bytes per second) of a running VM's chain compaction
    /// (QMP block-stream's `speed`), so merging snapshot layers does not
    /// take the guest's disk bandwidth; 0: unlimited.
    #[arg(long, env = "HEARTH_COMPACTION_BYTES_PER_SECOND", default_value_t = 0)]
    compaction_bytes_per_second: u64,
    /// The resolver file whose `nameserver`s a NAT network's DNS server
    /// forwards the guests' queries to (names of the network's own VMs are
    /// answered from its leases). Read again by dnsmasq when it changes.
    #[arg(
        long,
        env = "HEARTH_DNS_RESOLV_FILE",
        default_value = "/etc/resolv.conf"
    )]
    dns_resolv_file: PathBuf,
    // ---- firmware (see docs/guests.md) ----
    /// OVMF's code image, for VMs with `firmware: UEFI` (read-only).
    #[arg(long, env = "HEARTH_OVMF_CODE", default_value = hearth_engine::config::DEFAULT_OVMF_CODE)]
    ovmf_code: PathBuf,
    /// The UEFI variables template a UEFI VM's own variables file is copied
    /// from on its first UEFI start.
    #[arg(long, env = "HEARTH_OVMF_VARS", default_value = hearth_engine::config::DEFAULT_OVMF_VARS)]
    ovmf_vars: PathBuf,
    /// VirtualImage downloads: seconds to wait for the TCP (and TLS)
    /// connection to the image server.
    #[arg(
        long,
        env = "HEARTH_IMAGE_CONNECT_TIMEOUT_SECONDS",
        default_value_t = 30
    )]
    image_connect_timeout_seconds: u64,
    /// VirtualImage downloads: seconds the server may send nothing (before
    /// the response headers, or between two pieces of the body) before the
    /// attempt fails with reason Timeout and is retried. A slow download
    /// that keeps sending is never cut off.
    #[arg(long, env = "HEARTH_IMAGE_READ_TIMEOUT_SECONDS", default_value_t = 60)]
    image_read_timeout_seconds: u64,
    /// The largest VirtualImage accepted (download or file), e.g. 64Gi. A
    /// larger one fails with reason TooLarge as soon as its length is known.
    #[arg(long, env = "HEARTH_IMAGE_MAX_BYTES", default_value = "256Gi")]
    image_max_bytes: String,
    /// The most of a VM's console log kept on disk, e.g. 8Mi: past it, the
    /// oldest part is dropped and the newest half kept (a guest can write
    /// to its serial port without end). QEMU's own log of the VM is held to
    /// it too. 0: unbounded.
    #[arg(long, env = "HEARTH_CONSOLE_LOG_MAX_BYTES", default_value = "8Mi")]
    console_log_max_bytes: String,
    /// Free space a VirtualImage import always leaves on the state
    /// directory's filesystem (the image store, the database and every
    /// disk's layers), e.g. 4Gi. An import that would leave less stops with
    /// reason NoSpace and waits until more room comes back.
    #[arg(long, env = "HEARTH_IMAGE_FREE_SPACE_RESERVE", default_value = "1Gi")]
    image_free_space_reserve: String,
    /// A failed VirtualImage import is retried after 2 s, then 4 s, 8 s ...:
    /// this caps that delay, in seconds.
    #[arg(long, env = "HEARTH_IMAGE_RETRY_MAX_SECONDS", default_value_t = 300)]
    image_retry_max_seconds: u64,
    /// HOST[:PORT]=FILE: trust this PEM file of CA certificates for that
    /// registry, for images that name no caFile (an Ignite manifest names
    /// only its reference). Repeat for several registries.
    #[arg(
        long = "registry-ca",
        env = "HEARTH_REGISTRY_CA",
        value_delimiter = ',',
        value_name = "HOST=FILE"
    )]
    registry_ca: Vec<String>,
    /// HOST[:PORT]=FILE: the credentials file ({"username": .., "password":
    /// ..}) for that registry, for images that name no credentialsFile.
    #[arg(
        long = "registry-credentials",
        env = "HEARTH_REGISTRY_CREDENTIALS",
        value_delimiter = ',',
        value_name = "HOST=FILE"
    )]
    registry_credentials: Vec<String>,
    /// HOST[:PORT]: reach that registry over plain http, as if every image
    /// from it said `insecure: true`. Repeat for several.
    #[arg(
        long = "registry-insecure",
        env = "HEARTH_REGISTRY_INSECURE",
        value_delimiter = ',',
        value_name = "HOST"
    )]
    registry_insecure: Vec<String>,
    // ---- metrics (see docs/metrics.md) ----
    /// Also serve Prometheus metrics (`GET /metrics`, nothing else) over TCP
    /// on ADDR:PORT, e.g. 127.0.0.1:9464 (port 0: any free port, logged).
    /// They are always on the API socket too. Loopback addresses only,
    /// unless --metrics-allow-remote: the metrics name every VM, disk and
    /// snapshot, and the listener has no access control of its own.
    #[arg(long, env = "HEARTH_METRICS_LISTEN", value_name = "ADDR:PORT")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Let --metrics-listen bind a non-loopback address (put a firewall or
    /// an authenticating proxy in front of it).
    #[arg(long, env = "HEARTH_METRICS_ALLOW_REMOTE")]
    metrics_allow_remote: bool,
    // ---- connections from clients (see docs/limits.md) ----
    /// Connections the API socket serves at once; when full, the one idle
    /// longest is closed for a new one.
    #[arg(long, env = "HEARTH_API_MAX_CONNECTIONS", default_value_t = 256)]
    api_max_connections: u64,
    /// Connections the metrics listener serves at once; when full, the one
    /// idle longest is closed for a new one.
    #[arg(long, env = "HEARTH_METRICS_MAX_CONNECTIONS", default_value_t = 64)]
    metrics_max_connections: u64,
    /// Seconds a client of the API socket or the metrics listener has to
    /// send a request's headers, from when it connected or was last
    /// answered: a half-sent request, or a kept-alive connection that asks
    /// nothing, is closed after it.
    #[arg(long, env = "HEARTH_HTTP_HEADER_TIMEOUT_SECONDS", default_value_t = 30)]
    http_header_timeout_seconds: u64,
    /// Connections one loopback port forward (a TCP forward reached on
    /// 127.0.0.1) relays at once; more are closed at once.
    #[arg(long, env = "HEARTH_FORWARD_MAX_CONNECTIONS", default_value_t = 256)]
    forward_max_connections: u64,
    /// Connections all loopback port forwards together relay at once.
    #[arg(
        long,
        env = "HEARTH_FORWARD_MAX_CONNECTIONS_TOTAL",
        default_value_t = 1024
    )]
    forward_max_connections_total: u64,
    /// Seconds a loopback port forward waits for the guest to accept a
    /// connection before closing the client's.
    #[arg(
        long,
        env = "HEARTH_FORWARD_CONNECT_TIMEOUT_SECONDS",
        default_value_t = 10
    )]
    forward_connect_timeout_seconds: u64,
    /// Seconds a connection through a loopback port forward may carry no
    /// byte either way before it is closed.
    #[arg(
        long,
        env = "HEARTH_FORWARD_IDLE_TIMEOUT_SECONDS",
        default_value_t = 600
    )]
    forward_idle_timeout_seconds: u64,
    /// A git repository whose manifests declare objects, as the manifest
    /// directory's do: fetched every --git-interval-seconds (and on `hearth
    /// sources refresh`), read from git's objects, never written to. More
    /// sources: `[[git]]` tables in the configuration file
    /// (docs/sources.md).
    #[arg(long, env = "HEARTH_GIT", value_name = "URL")]
    git: Option<String>,
    /// The branch, tag or commit of --git to follow (HEAD: the remote's
    /// default branch).
    #[arg(
        long,
        env = "HEARTH_GIT_REF",
        default_value = "HEAD",
        value_name = "REF"
    )]
    git_ref: String,
    /// The folder of --git's repository whose manifests (in every folder
    /// below it too) count; empty: the whole repository.
    #[arg(
        long,
        env = "HEARTH_GIT_PATH",
        default_value = "",
        value_name = "FOLDER"
    )]
    git_path: String,
    /// Seconds between two fetches of --git.
    #[arg(long, default_value_t = 30)]
    git_interval_seconds: u64,
    /// The name of --git's source: its objects' owner is git:NAME:PATH.
    #[arg(long, default_value = "git")]
    git_name: String,
    /// https: the user --git-token-file's token goes with.
    #[arg(long, value_name = "USER")]
    git_username: Option<String>,
    /// https: a file holding the token (or password) for --git, read at
    /// each fetch.
    #[arg(long, value_name = "FILE")]
    git_token_file: Option<PathBuf>,
    /// https: the CA certificates (PEM) --git's server certificate must
    /// chain to, in place of the system's bundle (a server with a private
    /// CA); read at each fetch.
    #[arg(long, value_name = "FILE")]
    git_ca_file: Option<PathBuf>,
    /// ssh: the private key for --git.
    #[arg(long, value_name = "FILE")]
    git_ssh_key_file: Option<PathBuf>,
    /// ssh: the known_hosts file --git's host must be in (no host is
    /// trusted on first use).
    #[arg(long, value_name = "FILE")]
    git_known_hosts_file: Option<PathBuf>,
    /// Apply only commits signed by a key of this file (ssh's
    /// allowed_signers format: `EMAIL ssh-ed25519 KEY`); others leave the
    /// source Unverified at its last verified commit.
    #[arg(long, value_name = "FILE")]
    git_allowed_signers: Option<PathBuf>,
    /// Apply only commits with an OpenPGP signature by a key of this file
    /// (public keys, armored or binary: `gpg --export --armor KEYID`);
    /// with --git-allowed-signers too, either kind of signature will do.
    #[arg(long, value_name = "FILE")]
    git_allowed_keys: Option<PathBuf>,
    /// The `[[git]]` tables of the configuration file.
    #[arg(skip)]
    git_sources: Vec<config::GitSourceFile>,
}

#[derive(clap::ValueEnum, serde::Serialize, serde::Deserialize, Clone, Copy, Debug, PartialEq)]
#[serde(rename_all = "lowercase")]
enum AccelChoice {
    Auto,
    Kvm,
    Tcg,
}

#[derive(clap::ValueEnum, serde::Serialize, serde::Deserialize, Clone, Copy, Debug, PartialEq)]
#[serde(rename_all = "lowercase")]
enum LogFormat {
    Text,
    Json,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // --generate is not part of `Args`: hidden, and absent from the man page
    // and the completion scripts it writes.
    let matches = <Args as clap::CommandFactory>::command()
        .arg(generate::arg())
        .get_matches();
    if let Some(what) = matches.get_one::<generate::Generate>(generate::ID) {
        return generate::print(*what);
    }
    let (args, config_file) = config::load(&matches)?;
    if args.print_config {
        print!("{}", config::render(&args)?);
        return Ok(());
    }
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("HEARTH_LOG").unwrap_or_else(|_| "info".into());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(RedactedStderr);
    match args.log_format {
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        LogFormat::Json => logs.json().init(),
    }
    match &config_file {
        Some(path) => tracing::info!(config = %path.display(), "configuration file read"),
        None => tracing::info!(
            config = config::DEFAULT_PATH,
            "no configuration file: flags, environment and defaults"
        ),
    }
    let bounds = connection_bounds(&args);
    if let Some(addr) = args.metrics_listen
        && !addr.ip().is_loopback()
        && !args.metrics_allow_remote
    {
        bail!(
            "--metrics-listen {addr}: not a loopback address; the metrics name every VM and the listener has no access control (use 127.0.0.1:PORT, or add --metrics-allow-remote behind a firewall or proxy)"
        );
    }

    let qemu_user = hearth_qemu::handover::QemuUser::lookup(&args.qemu_user)?;
    let qemu_user = if qemu_user.is_root() {
        tracing::warn!(
            qemu_user = %args.qemu_user,
            "QEMU runs as root: a guest that takes over its QEMU can open any file of the host"
        );
        None
    } else {
        tracing::info!(
            qemu_user = %qemu_user.name,
            uid = qemu_user.uid,
            gid = qemu_user.gid,
            "QEMU runs unprivileged"
        );
        Some(qemu_user)
    };
    let programs = match args.max_external_programs {
        0 => hearth_qemu::programs::default_limit(),
        n => n,
    };
    hearth_qemu::programs::set_limit(programs);
    tracing::info!(
        max_external_programs = programs,
        copies = hearth_qemu::programs::global().copy_limit(),
        "external programs run at most this many at once"
    );
    let qemu = hearth_qemu::tools::find_binary("qemu-system-x86_64")?;
    hearth_qemu::tools::find_binary("qemu-img")?;
    let accel = choose_accel(args.accel, &qemu).await?;
    tracing::info!(accelerator = accel.accel.as_str(), reason = %accel.reason, "accelerator chosen");

    let image_roots = if args.image_roots.is_empty() {
        vec![args.state_dir.join("images")]
    } else {
        args.image_roots.clone()
    };
    let socket = args
        .socket
        .clone()
        .unwrap_or_else(|| args.run_dir.join("hearthd.sock"));
    let config = EngineConfig {
        state_dir: args.state_dir.clone(),
        run_dir: args.run_dir.clone(),
        image_roots,
        qemu_binary: qemu,
        qemu_user,
        accel,
        resync_interval: Duration::from_secs(args.resync_seconds.max(1)),
        ovmf_code: args.ovmf_code.clone(),
        ovmf_vars: args.ovmf_vars.clone(),
        compaction_speed: args.compaction_bytes_per_second,
        dns_resolv_file: args.dns_resolv_file.clone(),
        console_log_max_bytes: console_log_bound(&args.console_log_max_bytes)?,
        images: hearth_engine::config::ImageImportConfig {
            connect_timeout: Duration::from_secs(args.image_connect_timeout_seconds.max(1)),
            read_timeout: Duration::from_secs(args.image_read_timeout_seconds.max(1)),
            max_bytes: hearth_api::Quantity::parse(&args.image_max_bytes)
                .map_err(|e| anyhow::anyhow!("--image-max-bytes: {e}"))?
                .bytes(),
            free_space_reserve: hearth_api::Quantity::parse(&args.image_free_space_reserve)
                .map_err(|e| anyhow::anyhow!("--image-free-space-reserve: {e}"))?
                .bytes(),
            retry_max: Duration::from_secs(args.image_retry_max_seconds.max(1)),
            registries: registry_trust(&args)?,
            ..Default::default()
        },
        forwards: hearth_engine::network::host::loopback::ForwardLimits {
            per_listener: bounds.forwards_per_listener,
            total: bounds.forwards_total,
            connect_timeout: Duration::from_secs(args.forward_connect_timeout_seconds.max(1)),
            idle_timeout: Duration::from_secs(args.forward_idle_timeout_seconds.max(1)),
        },
    };
    let git_configs = git_sources(&args)?;
    let engine = Engine::start(config).await?;
    let manifests = std::path::absolute(&args.manifests)
        .with_context(|| format!("--manifests {}", args.manifests.display()))?;
    let source = hearth_engine::ManifestSource::start(
        engine.clone(),
        hearth_engine::ManifestConfig {
            resync: Duration::from_secs(args.manifests_resync_seconds.max(1)),
            delete_grace: Duration::from_millis(args.manifests_delete_grace_ms),
            ..hearth_engine::ManifestConfig::new(manifests)
        },
    );

    let header_timeout = Duration::from_secs(args.http_header_timeout_seconds.max(1));
    let metrics = match args.metrics_listen {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("--metrics-listen {addr}: cannot listen"))?;
            let bound = listener.local_addr().unwrap_or(addr);
            tracing::info!(metrics_listen = %bound, "serving metrics");
            let app = api::metrics::listener_router(engine.clone(), source.clone());
            let limits = serve::Limits {
                max_connections: bounds.metrics,
                header_timeout,
            };
            Some(serve::serve(listener, app, limits, "metrics"))
        }
        None => None,
    };
    let metrics = async move {
        match metrics {
            Some(serve) => serve.await,
            None => std::future::pending().await,
        }
    };

    let listener = bind_socket(&socket)?;
    tracing::info!(socket = %socket.display(), "serving the API");
    let git = std::sync::Arc::new(hearth_engine::GitSources {
        sources: git_configs
            .into_iter()
            .map(|c| hearth_engine::GitSource::start(engine.clone(), c))
            .collect(),
    });
    let app = api::router(engine)
        .layer(axum::Extension(source))
        .layer(axum::Extension(git));
    let limits = serve::Limits {
        max_connections: bounds.api,
        header_timeout,
    };
    tokio::select! {
        never = serve::serve(listener, app, limits, "api") => match never {},
        never = metrics => match never {},
        _ = shutdown_signal() => tracing::info!("stopping; running VMs keep running"),
    }
    let _ = std::fs::remove_file(&socket);
    Ok(())
}

/// Whether a `scheme://user:password@host/...` URL names a password (a
/// user alone, as in `ssh://git@host/...`, is no secret).
fn url_has_password(url: &str) -> bool {
    let Some((_, rest)) = url.split_once("://") else {
        return false;
    };
    let authority = rest.split('/').next().unwrap_or(rest);
    authority
        .rsplit_once('@')
        .is_some_and(|(userinfo, _)| userinfo.contains(':'))
}

/// The git sources: the configuration file's `[[git]]` tables and
/// `--git`, each checked (a valid, unique name; a URL), with its cache in
/// the state directory.
fn git_sources(args: &Args) -> anyhow::Result<Vec<hearth_engine::GitConfig>> {
    let all = config::all_git_sources(args);
    let mut out: Vec<hearth_engine::GitConfig> = Vec::new();
    for g in all {
        if !hearth_engine::valid_git_source_name(&g.name) {
            anyhow::bail!(
                "git source {:?}: a name is lowercase letters, digits and '-', at most 63 (--git-name or [[git]] name)",
                g.name
            );
        }
        if out.iter().any(|o| o.name == g.name) {
            anyhow::bail!("git source {:?} is configured twice", g.name);
        }
        if g.url.trim().is_empty() || g.url.starts_with('-') {
            anyhow::bail!(
                "git source {:?}: url {:?} is not a repository URL",
                g.name,
                g.url
            );
        }
        if url_has_password(&g.url) {
            anyhow::bail!(
                "git source {:?}: url {:?} carries a password: it would show in the process table (git's command line) and in the configuration; give the user as username (--git-username) and the token in a file only hearthd reads, named by token-file (--git-token-file)",
                g.name,
                hearth_api::redact::redact_credentials(&g.url)
            );
        }
        let cache = args.state_dir.join("git").join(format!("{}.git", g.name));
        let mut c = hearth_engine::GitConfig::new(&g.name, &g.url, cache);
        if let Some(r) = g.reference.filter(|r| !r.is_empty()) {
            if r.starts_with('-') || r.contains("..") || r.contains(':') {
                anyhow::bail!(
                    "git source {:?}: ref {r:?} is not a branch, tag or commit",
                    g.name
                );
            }
            c.reference = r;
        }
        if let Some(p) = g.path {
            if p.split('/').any(|c| c == "..") {
                anyhow::bail!("git source {:?}: path {p:?} leaves the repository", g.name);
            }
            c.path = p;
        }
        if let Some(i) = g.interval_seconds {
            c.interval = Duration::from_secs(i.max(1));
        }
        let absolute = |p: Option<PathBuf>, key: &str| -> anyhow::Result<Option<PathBuf>> {
            p.map(|p| {
                std::path::absolute(&p)
                    .with_context(|| format!("git source {:?}: {key} {}", g.name, p.display()))
            })
            .transpose()
        };
        c.auth = hearth_engine::GitAuth {
            username: g.username,
            token_file: absolute(g.token_file, "token-file")?,
            ssh_key: absolute(g.ssh_key_file, "ssh-key-file")?,
            known_hosts: absolute(g.known_hosts_file, "known-hosts-file")?,
            ca_file: absolute(g.ca_file, "ca-file")?,
        };
        c.signers = hearth_engine::GitSigners {
            allowed_signers: absolute(g.allowed_signers_file, "allowed-signers-file")?,
            allowed_keys: absolute(g.allowed_keys_file, "allowed-keys-file")?,
        };
        out.push(c);
    }
    Ok(out)
}

/// Raises the open-file limit and fits the listeners' connection bounds in
/// their share of it (docs/limits.md), saying both in the log.
fn connection_bounds(args: &Args) -> descriptors::ConnectionBounds {
    let to_count = |n: u64| usize::try_from(n.max(1)).unwrap_or(usize::MAX);
    let wanted = descriptors::ConnectionBounds {
        api: to_count(args.api_max_connections),
        metrics: if args.metrics_listen.is_some() {
            to_count(args.metrics_max_connections)
        } else {
            0
        },
        forwards_total: to_count(args.forward_max_connections_total),
        forwards_per_listener: to_count(args.forward_max_connections),
    };
    let limit = match descriptors::raise_open_file_limit() {
        Ok(l) => {
            if l.now > l.before {
                tracing::info!(
                    "raised the open-file limit (RLIMIT_NOFILE) from {} to {}, its hard limit",
                    l.before,
                    l.now
                );
            } else {
                tracing::info!("the open-file limit (RLIMIT_NOFILE) is {}", l.now);
            }
            l.now
        }
        Err(e) => {
            let now = rustix::process::getrlimit(rustix::process::Resource::Nofile)
                .current
                .unwrap_or(u64::MAX);
            tracing::warn!(error = %e, "cannot raise the open-file limit (RLIMIT_NOFILE); it stays {now}");
            now
        }
    };
    let bounds = descriptors::fit(wanted, limit);
    if bounds != wanted {
        tracing::warn!(
            ?wanted,
            "the connection bounds would hold more than {}% of the open-file limit: lowered",
            descriptors::CONNECTION_SHARE_PERCENT
        );
    }
    tracing::info!(
        api = bounds.api,
        metrics = bounds.metrics,
        forwards_total = bounds.forwards_total,
        forwards_per_listener = bounds.forwards_per_listener,
        "connections from clients hold at most {} of {limit} descriptors",
        bounds.descriptors()
    );
    bounds
}

/// hearthd's log goes to stderr with the credentials of URLs hidden
/// (docs/limits.md): one buffer per log line, written whole.
struct RedactedStderr;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for RedactedStderr {
    type Writer = RedactedLine;

    fn make_writer(&'a self) -> RedactedLine {
        RedactedLine(Vec::new())
    }
}

struct RedactedLine(Vec<u8>);

impl std::io::Write for RedactedLine {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for RedactedLine {
    fn drop(&mut self) {
        let text = String::from_utf8_lossy(&self.0);
        let text = hearth_api::redact::redact_credentials(&text);
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), text.as_bytes());
    }
}

async fn choose_accel(
    wanted: AccelChoice,
    qemu: &std::path::Path,
) -> anyhow::Result<AccelDecision> {
    Ok(match wanted {
        AccelChoice::Auto => accel::detect(qemu).await,
        AccelChoice::Kvm => AccelDecision {
            accel: Accel::Kvm,
            reason: "kvm: forced by --accel kvm".into(),
        },
        AccelChoice::Tcg => AccelDecision {
            accel: Accel::Tcg,
            reason: "tcg: forced by --accel tcg".into(),
        },
    })
}

/// `--console-log-max-bytes`: 0 (unbounded), or at least
/// [`MIN_CONSOLE_LOG_BYTES`]: a trim keeps half the bound, in whole 4 KiB
/// blocks, so a smaller one could never be met.
fn console_log_bound(text: &str) -> anyhow::Result<u64> {
    let bytes = hearth_api::Quantity::parse(text)
        .map_err(|e| anyhow::anyhow!("--console-log-max-bytes: {e}"))?
        .bytes();
    if bytes != 0 && bytes < MIN_CONSOLE_LOG_BYTES {
        anyhow::bail!("--console-log-max-bytes {text}: at least 64Ki (or 0 for no bound)");
    }
    Ok(bytes)
}

const MIN_CONSOLE_LOG_BYTES: u64 = 64 << 10;

/// Binds the API socket with mode 0600: the file mode is the access control.
fn bind_socket(path: &std::path::Path) -> anyhow::Result<tokio::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            bail!("{} is in use: is another hearthd running?", path.display());
        }
        std::fs::remove_file(path)
            .with_context(|| format!("cannot remove stale socket {}", path.display()))?;
    }
    // Create it private from the first moment, not chmod after the fact.
    let old = rustix_umask(0o177);
    let listener = tokio::net::UnixListener::bind(path);
    rustix_umask(old);
    let listener = listener.with_context(|| format!("cannot listen on {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

fn rustix_umask(mode: u32) -> u32 {
    use rustix::fs::Mode;
    rustix::process::umask(Mode::from_raw_mode(mode)).as_raw_mode()
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// `--registry-ca`, `--registry-credentials`, `--registry-insecure` by host.
fn registry_trust(
    args: &Args,
) -> anyhow::Result<std::collections::BTreeMap<String, hearth_engine::config::RegistryTrust>> {
    let mut out: std::collections::BTreeMap<String, hearth_engine::config::RegistryTrust> =
        Default::default();
    let pair = |flag: &str, v: &str| -> anyhow::Result<(String, PathBuf)> {
        match v.split_once('=') {
            Some((host, file)) if !host.is_empty() && file.starts_with('/') => {
                Ok((host.to_string(), PathBuf::from(file)))
            }
            _ => anyhow::bail!("--{flag}: {v:?} is not HOST[:PORT]=/absolute/file"),
        }
    };
    for v in &args.registry_ca {
        let (host, file) = pair("registry-ca", v)?;
        out.entry(host).or_default().ca_file = Some(file);
    }
    for v in &args.registry_credentials {
        let (host, file) = pair("registry-credentials", v)?;
        out.entry(host).or_default().credentials_file = Some(file);
    }
    for host in &args.registry_insecure {
        if host.is_empty() || host.contains('/') {
            anyhow::bail!("--registry-insecure: {host:?} is not HOST[:PORT]");
        }
        out.entry(host.clone()).or_default().insecure = true;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn sources(argv: &[&str]) -> anyhow::Result<Vec<hearth_engine::GitConfig>> {
        let args = Args::try_parse_from(std::iter::once("hearthd").chain(argv.iter().copied()))
            .expect("arguments parse");
        git_sources(&args)
    }

    #[test]
    fn a_git_url_with_a_password_is_refused_without_printing_it() {
        let e = sources(&["--git", "https://deploy:s3cret@git.example/vms.git"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("carries a password") && e.contains("--git-token-file"),
            "{e}"
        );
        assert!(!e.contains("s3cret"), "{e}");
        // A user alone is no secret; neither is an @ in the path.
        for url in [
            "ssh://git@git.example/vms.git",
            "https://deploy@git.example/vms.git",
            "https://git.example/a:b@c/vms.git",
            "git@git.example:infra/vms.git",
            "file:///srv/vms.git",
        ] {
            let got = sources(&["--git", url]).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(got[0].url, url);
        }
    }

    #[test]
    fn a_git_source_is_refused_naming_what_is_wrong() {
        for (argv, says) in [
            (
                &["--git", "file:///r.git", "--git-name", "Bad_Name"][..],
                "a name is lowercase",
            ),
            (&["--git=-oProxyCommand=x"][..], "is not a repository URL"),
            (
                &["--git", "file:///r.git", "--git-ref", "main..other"][..],
                "is not a branch, tag or commit",
            ),
            (
                &["--git", "file:///r.git", "--git-path", "a/../../etc"][..],
                "leaves the repository",
            ),
        ] {
            let e = sources(argv).unwrap_err().to_string();
            assert!(e.contains(says), "{argv:?}: {e}");
        }
    }
}
