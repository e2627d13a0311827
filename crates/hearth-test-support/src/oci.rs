//! OCI fixtures made with real tools: image layouts written by `umoci`,
//! digests as `skopeo` reads them, and a real registry on 127.0.0.1
//! (Debian's `docker-registry`, optionally with TLS from a CA made here by
//! `openssl` and htpasswd auth from `htpasswd`). A missing tool fails the
//! test with the command that installs it.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const INSTALL: &str = "apt-get install -y umoci skopeo docker-registry apache2-utils openssl (.ci/install-deps.sh does)";

/// Runs `program`; panics with its stderr when it fails, and with the
/// install command when it is missing. Returns its stdout.
pub fn tool(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}; {INSTALL}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The sha256 of a file, by `sha256sum`.
pub fn sha256sum(file: &Path) -> String {
    tool("sha256sum", &[s(file)])
        .split_whitespace()
        .next()
        .expect("a digest")
        .to_string()
}

/// Adds image `tag` to the layout at `layout` (made if needed): one layer
/// holding what `fill` puts into the root, made by `umoci repack`.
pub fn umoci_image(layout: &Path, tag: &str, fill: impl FnOnce(&Path)) {
    if !layout.join("oci-layout").exists() {
        tool("umoci", &["init", "--layout", s(layout)]);
    }
    let image = format!("{}:{tag}", s(layout));
    tool("umoci", &["new", "--image", &image]);
    let bundle = layout.with_extension(format!("bundle-{tag}"));
    tool("umoci", &["unpack", "--image", &image, s(&bundle)]);
    fill(&bundle.join("rootfs"));
    tool("umoci", &["repack", "--image", &image, s(&bundle)]);
    fs::remove_dir_all(&bundle).expect("remove the bundle");
}

/// A containerDisk image tagged `tag` in `layout`: a qcow2 of `size_mib`
/// MiB whose first `data_mib` MiB hold `pattern` (qemu-io), under
/// `/disk/disk.qcow2`. Returns the qcow2 made in `dir` (the bytes the
/// image must become).
pub fn container_disk_image(
    layout: &Path,
    tag: &str,
    dir: &Path,
    size_mib: u64,
    pattern: u8,
    data_mib: u64,
) -> PathBuf {
    let qcow2 = dir.join(format!("{tag}.qcow2"));
    let path = qcow2.to_str().expect("utf-8 path");
    tool(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", path, &format!("{size_mib}M")],
    );
    tool(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            &format!("write -q -P {pattern:#x} 0 {data_mib}M"),
            path,
        ],
    );
    umoci_image(layout, tag, |root| {
        std::fs::create_dir_all(root.join("disk")).unwrap();
        std::fs::copy(&qcow2, root.join("disk/disk.qcow2")).unwrap();
    });
    qcow2
}

/// A new layout `dir/layout` with image `t` made of `layers` (tar files),
/// added verbatim by `umoci raw add-layer`.
pub fn umoci_layers(dir: &Path, layers: &[Vec<u8>]) -> PathBuf {
    let layout = dir.join("layout");
    let files: Vec<PathBuf> = layers
        .iter()
        .enumerate()
        .map(|(n, bytes)| {
            let f = dir.join(format!("layer{n}.tar"));
            fs::write(&f, bytes).expect("write the layer");
            f
        })
        .collect();
    let refs: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    umoci_tag(&layout, "t", &refs);
    layout
}

/// Adds image `tag` of `layers` (tar files, in order, added verbatim by
/// `umoci raw add-layer`) to `layout`, made first if it is not there.
pub fn umoci_tag(layout: &Path, tag: &str, layers: &[&Path]) {
    if !layout.join("oci-layout").exists() {
        tool("umoci", &["init", "--layout", s(layout)]);
    }
    let image = format!("{}:{tag}", s(layout));
    tool("umoci", &["new", "--image", &image]);
    for l in layers {
        tool("umoci", &["raw", "add-layer", "--image", &image, s(l)]);
    }
}

/// The digest of the manifest `skopeo inspect --raw` reads at `reference`
/// (`oci:DIR:TAG`, `oci-archive:FILE:TAG`, `docker://...`).
pub fn skopeo_digest(reference: &str, flags: &[String]) -> String {
    let mut args: Vec<&str> = vec!["inspect", "--raw"];
    args.extend(flags.iter().map(String::as_str));
    args.push(reference);
    let raw = tool("skopeo", &args);
    let file = tempfile::NamedTempFile::new().expect("tempfile");
    fs::write(file.path(), raw.as_bytes()).expect("write");
    format!("sha256:{}", sha256sum(file.path()))
}

/// A registry process, stopped when dropped.
pub struct TestRegistry {
    dir: tempfile::TempDir,
    child: Child,
    addr: String,
    tls: bool,
    token: Option<TokenServer>,
}

impl TestRegistry {
    pub const USER: &'static str = "hearth";
    pub const PASSWORD: &'static str = "s3cret-pw";

    /// With `tls`: https with a certificate for 127.0.0.1 from a CA made
    /// here, and htpasswd auth. Without: plain http, anonymous.
    pub fn start(tls: bool) -> TestRegistry {
        Self::start_with(tls, false)
    }

    /// Plain http with bearer-token auth: the registry trusts tokens
    /// signed by a key made here, which a token server on 127.0.0.1
    /// ([`TokenServer`]) hands out for [`Self::USER`]'s password.
    pub fn start_token() -> TestRegistry {
        Self::start_with(false, true)
    }

    fn start_with(tls: bool, token: bool) -> TestRegistry {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let addr = format!("127.0.0.1:{port}");
        let mut http = format!("http:\n  addr: {addr}\n");
        let mut auth = String::new();
        if tls {
            let p = |n: &str| d.join(n).to_str().expect("utf-8").to_string();
            let ca = crate::tls::TestCa::new(d, "hearth test CA");
            fs::create_dir_all(d.join("certs")).expect("mkdir");
            fs::copy(ca.ca(), d.join("certs/ca.crt")).expect("copy");
            http.push_str(&format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                s(&ca.certificate()),
                s(&ca.key())
            ));
            let line = tool("htpasswd", &["-Bbn", Self::USER, Self::PASSWORD]);
            fs::write(d.join("htpasswd"), line.trim()).expect("write");
            auth = format!(
                "auth:\n  htpasswd:\n    realm: hearth-test\n    path: {}\n",
                p("htpasswd")
            );
        }
        let token = token.then(|| {
            let t = TokenServer::start(d);
            auth = format!(
                "auth:\n  token:\n    realm: http://{}/token\n    service: {}\n    issuer: {}\n    rootcertbundle: {}\n",
                t.addr,
                TokenServer::SERVICE,
                TokenServer::ISSUER,
                s(&d.join("token.pem"))
            );
            t
        });
        let config = format!(
            "version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n    rootdirectory: {}\n{http}{auth}",
            s(&d.join("data"))
        );
        fs::write(d.join("config.yml"), config).expect("write");
        let child = Command::new("docker-registry")
            .args(["serve", s(&d.join("config.yml"))])
            .stdout(Stdio::null())
            .stderr(fs::File::create(d.join("registry.log")).expect("log"))
            .spawn()
            .unwrap_or_else(|e| panic!("docker-registry: {e}; {INSTALL}"));
        let r = TestRegistry {
            dir,
            child,
            addr,
            tls,
            token,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(&r.addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "the registry did not listen: {}",
                r.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        r
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default()
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub fn tls(&self) -> bool {
        self.tls
    }

    /// The CA's certificate (PEM), with TLS.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A credentials file `{"username", "password"}` with `password`.
    pub fn credentials_file(&self, password: &str) -> PathBuf {
        let p = self
            .dir
            .path()
            .join(format!("credentials-{}.json", password.len()));
        let doc = serde_json::json!({"username": Self::USER, "password": password});
        fs::write(&p, doc.to_string()).expect("write");
        p
    }

    /// skopeo's flags to reach it, for `side` `dest` or `src` (`""` for
    /// `inspect`).
    pub fn flags(&self, side: &str) -> Vec<String> {
        let prefix = if side.is_empty() {
            "--".to_string()
        } else {
            format!("--{side}-")
        };
        if self.token.is_some() {
            vec![
                format!("{prefix}tls-verify=false"),
                format!("{prefix}creds={}:{}", Self::USER, Self::PASSWORD),
            ]
        } else if self.tls {
            vec![
                format!("{prefix}cert-dir={}", s(&self.dir.path().join("certs"))),
                format!("{prefix}creds={}:{}", Self::USER, Self::PASSWORD),
            ]
        } else {
            vec![format!("{prefix}tls-verify=false")]
        }
    }

    /// Pushes `oci:LAYOUT:TAG` as `repo` (`NAME:TAG`); returns the
    /// reference to pull it by (`127.0.0.1:PORT/NAME:TAG`).
    pub fn push(&self, layout: &Path, tag: &str, repo: &str) -> String {
        let mut args = vec!["copy".to_string(), "-q".to_string()];
        args.extend(self.flags("dest"));
        args.push(format!("oci:{}:{tag}", s(layout)));
        args.push(format!("docker://{}/{repo}", self.addr));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        tool("skopeo", &refs);
        format!("{}/{repo}", self.addr)
    }

    /// The token server, with bearer-token auth.
    pub fn token_server(&self) -> Option<&TokenServer> {
        self.token.as_ref()
    }

    /// The manifest digest skopeo reads for `reference` at this registry.
    pub fn digest(&self, reference: &str) -> String {
        skopeo_digest(&format!("docker://{reference}"), &self.flags(""))
    }
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP proxy on 127.0.0.1 in front of `upstream` (a plain-http
/// registry) that can stop passing the upstream's bytes on: with
/// [`StallingProxy::stall_after`] set, each connection's response bytes
/// stop after that many and the connection stays open, sending nothing,
/// as a registry hung mid-blob does. Both sockets close when the client
/// closes its end or the proxy is dropped.
pub struct StallingProxy {
    addr: String,
    shared: std::sync::Arc<ProxyShared>,
}

#[derive(Default)]
struct ProxyShared {
    /// Bytes of a connection's responses passed before it stalls;
    /// `u64::MAX`: never.
    stall_after: std::sync::atomic::AtomicU64,
    stop: std::sync::atomic::AtomicBool,
    /// Connections that are stalled now.
    stalled: std::sync::atomic::AtomicUsize,
    /// Connections accepted so far.
    accepted: std::sync::atomic::AtomicUsize,
}

impl StallingProxy {
    pub fn start(upstream: &str) -> StallingProxy {
        use std::sync::atomic::Ordering::SeqCst;
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let shared = std::sync::Arc::new(ProxyShared::default());
        shared.stall_after.store(u64::MAX, SeqCst);
        let (sh, up) = (shared.clone(), upstream.to_string());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if sh.stop.load(SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                sh.accepted.fetch_add(1, SeqCst);
                let (sh, up) = (sh.clone(), up.clone());
                std::thread::spawn(move || proxy_one(client, &up, &sh));
            }
        });
        StallingProxy { addr, shared }
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// From now on, each new or running connection stops after `n`
    /// response bytes (`None`: passes everything, and stalled connections
    /// stay stalled).
    pub fn stall_after(&self, n: Option<u64>) {
        self.shared
            .stall_after
            .store(n.unwrap_or(u64::MAX), std::sync::atomic::Ordering::SeqCst);
    }

    /// How many connections are stalled now.
    pub fn stalled(&self) -> usize {
        self.shared
            .stalled
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many connections were accepted so far.
    pub fn accepted(&self) -> usize {
        self.shared
            .accepted
            .load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for StallingProxy {
    fn drop(&mut self) {
        self.shared
            .stop
            .store(true, std::sync::atomic::Ordering::SeqCst);
        // Wakes the accept loop so it sees the stop.
        let _ = std::net::TcpStream::connect(&self.addr);
    }
}

fn proxy_one(client: std::net::TcpStream, upstream: &str, sh: &ProxyShared) {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let Ok(server) = std::net::TcpStream::connect(upstream) else {
        return;
    };
    let closed = std::sync::Arc::new(AtomicBool::new(false));
    let (mut c_in, mut s_out) = (
        client.try_clone().expect("clone"),
        server.try_clone().expect("clone"),
    );
    let c2 = closed.clone();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut c_in, &mut s_out);
        c2.store(true, SeqCst);
        let _ = s_out.shutdown(std::net::Shutdown::Write);
    });
    let (mut s_in, mut c_out) = (server, client);
    let _ = s_in.set_read_timeout(Some(Duration::from_millis(100)));
    let mut sent = 0u64;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        if sh.stop.load(SeqCst) || closed.load(SeqCst) {
            break;
        }
        let limit = sh.stall_after.load(SeqCst);
        if sent >= limit {
            sh.stalled.fetch_add(1, SeqCst);
            while !sh.stop.load(SeqCst) && !closed.load(SeqCst) {
                std::thread::sleep(Duration::from_millis(20));
            }
            sh.stalled.fetch_sub(1, SeqCst);
            break;
        }
        let want = buf.len().min((limit - sent).min(buf.len() as u64) as usize);
        match s_in.read(&mut buf[..want]) {
            Ok(0) => break,
            Ok(n) => {
                if c_out.write_all(&buf[..n]).is_err() {
                    break;
                }
                sent += n as u64;
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => break,
        }
    }
    let _ = c_out.shutdown(std::net::Shutdown::Both);
    let _ = s_in.shutdown(std::net::Shutdown::Both);
}

/// A registry on 127.0.0.1 (plain http) whose every manifest is `size`
/// bytes of JSON whitespace: with `content_length`, the response says so
/// up front; without, the body is sent chunked and only its bytes tell.
/// Answers `/v2/` with 200 and counts the manifest bytes it sent.
pub struct HugeManifestRegistry {
    addr: String,
    sent: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl HugeManifestRegistry {
    pub fn start(size: u64, content_length: bool) -> HugeManifestRegistry {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = sent.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let counter = counter.clone();
                std::thread::spawn(move || {
                    let _ = serve_huge(conn, size, content_length, &counter);
                });
            }
        });
        HugeManifestRegistry { addr, sent }
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Manifest body bytes written to clients so far.
    pub fn sent(&self) -> u64 {
        self.sent.load(std::sync::atomic::Ordering::SeqCst)
    }
}

fn serve_huge(
    mut conn: std::net::TcpStream,
    size: u64,
    content_length: bool,
    sent: &std::sync::atomic::AtomicU64,
) -> std::io::Result<()> {
    use std::io::{BufRead, BufReader, Write};
    let mut reader = BufReader::new(conn.try_clone()?);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
                break;
            }
        }
        if !path.contains("/manifests/") {
            let body = if path == "/v2/" || path == "/v2" {
                "{}"
            } else {
                ""
            };
            let status = if body.is_empty() {
                "404 Not Found"
            } else {
                "200 OK"
            };
            write!(
                conn,
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )?;
            continue;
        }
        let head = if content_length {
            format!("Content-Length: {size}\r\n")
        } else {
            "Transfer-Encoding: chunked\r\n".to_string()
        };
        write!(
            conn,
            "HTTP/1.1 200 OK\r\nContent-Type: application/vnd.oci.image.manifest.v1+json\r\n{head}\r\n"
        )?;
        let piece = vec![b' '; 64 << 10];
        let mut left = size;
        while left > 0 {
            let n = left.min(piece.len() as u64) as usize;
            if content_length {
                conn.write_all(&piece[..n])?;
            } else {
                write!(conn, "{n:x}\r\n")?;
                conn.write_all(&piece[..n])?;
                conn.write_all(b"\r\n")?;
            }
            sent.fetch_add(n as u64, std::sync::atomic::Ordering::SeqCst);
            left -= n as u64;
        }
        if !content_length {
            conn.write_all(b"0\r\n\r\n")?;
        }
    }
}

/// A token server for a registry's bearer-token auth (the distribution
/// spec's token flow): `GET /token?service=..&scope=..` with
/// [`TestRegistry::USER`]'s basic credentials answers a JWT (RS256, signed
/// by `openssl dgst` with a key whose self-signed certificate is the
/// registry's `rootcertbundle` and rides in the token's `x5c`) granting the
/// actions the scope asks; anything else is 401.
pub struct TokenServer {
    addr: String,
    issued: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    refused: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl TokenServer {
    pub const SERVICE: &'static str = "hearth-test-registry";
    pub const ISSUER: &'static str = "hearth-test-issuer";

    fn start(dir: &Path) -> TokenServer {
        let key = dir.join("token.key");
        let pem = dir.join("token.pem");
        crate::tls::self_signed("hearth token signer", &key, &pem);
        let der = dir.join("token.der");
        tool(
            "openssl",
            &["x509", "-in", s(&pem), "-outform", "DER", "-out", s(&der)],
        );
        let cert = base64(&fs::read(&der).expect("read"), false);
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let issued = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let refused = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (i, r, work) = (issued.clone(), refused.clone(), dir.to_path_buf());
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let _ = serve_token(conn, &work, &key, &cert, &i, &r);
            }
        });
        TokenServer {
            addr,
            issued,
            refused,
        }
    }

    /// Tokens handed out so far.
    pub fn issued(&self) -> usize {
        self.issued.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Requests refused (no or wrong credentials) so far.
    pub fn refused(&self) -> usize {
        self.refused.load(std::sync::atomic::Ordering::SeqCst)
    }
}

fn serve_token(
    mut conn: std::net::TcpStream,
    dir: &Path,
    key: &Path,
    cert: &str,
    issued: &std::sync::atomic::AtomicUsize,
    refused: &std::sync::atomic::AtomicUsize,
) -> std::io::Result<()> {
    use std::io::{BufRead, BufReader, Write};
    use std::sync::atomic::Ordering::SeqCst;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let target = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut authorization = String::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':')
            && k.eq_ignore_ascii_case("authorization")
        {
            authorization = v.trim().to_string();
        }
    }
    let want = format!(
        "Basic {}",
        base64(
            format!("{}:{}", TestRegistry::USER, TestRegistry::PASSWORD).as_bytes(),
            false
        )
    );
    if authorization != want || !target.starts_with("/token") {
        refused.fetch_add(1, SeqCst);
        let body = r#"{"errors":[{"code":"UNAUTHORIZED","message":"bad credentials"}]}"#;
        return write!(
            conn,
            "HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
    }
    let query = target.split_once('?').map(|(_, q)| q).unwrap_or("");
    let mut access = Vec::new();
    for pair in query.split('&') {
        let Some(("scope", v)) = pair.split_once('=') else {
            continue;
        };
        let v = unescape(v);
        // repository:NAME:ACTIONS
        let mut parts = v.splitn(3, ':');
        if let (Some(kind), Some(name), Some(actions)) = (parts.next(), parts.next(), parts.next())
        {
            let actions: Vec<&str> = actions.split(',').collect();
            access.push(serde_json::json!({"type": kind, "name": name, "actions": actions}));
        }
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let n = issued.fetch_add(1, SeqCst);
    let header = serde_json::json!({"alg": "RS256", "typ": "JWT", "x5c": [cert]});
    let claims = serde_json::json!({
        "iss": TokenServer::ISSUER,
        "sub": TestRegistry::USER,
        "aud": TokenServer::SERVICE,
        "exp": now + 600,
        "nbf": now - 60,
        "iat": now,
        "jti": format!("hearth-{now}-{n}"),
        "access": access,
    });
    let signing = format!(
        "{}.{}",
        base64(header.to_string().as_bytes(), true),
        base64(claims.to_string().as_bytes(), true)
    );
    let input = dir.join(format!("jwt-{n}"));
    fs::write(&input, &signing)?;
    let sig = Command::new("openssl")
        .args(["dgst", "-sha256", "-sign", s(key), s(&input)])
        .output()?;
    let _ = fs::remove_file(&input);
    let token = format!("{signing}.{}", base64(&sig.stdout, true));
    let body =
        serde_json::json!({"token": token, "access_token": token, "expires_in": 600}).to_string();
    write!(
        conn,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

fn unescape(v: &str) -> String {
    let b = v.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("00");
                out.push(u8::from_str_radix(hex, 16).unwrap_or(b'?'));
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Base64 (`url`: the URL-safe alphabet without padding, as JWTs use).
fn base64(bytes: &[u8], url: bool) -> String {
    let table: &[u8; 64] = if url {
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    } else {
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    };
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = (chunk[0] as u32) << 16
            | (*chunk.get(1).unwrap_or(&0) as u32) << 8
            | *chunk.get(2).unwrap_or(&0) as u32;
        let chars = chunk.len() + 1;
        for k in 0..4 {
            if k < chars {
                out.push(table[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else if !url {
                out.push('=');
            }
        }
    }
    out
}
