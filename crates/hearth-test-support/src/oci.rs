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

/// A new layout `dir/layout` with image `t` made of `layers` (tar files),
/// added verbatim by `umoci raw add-layer`.
pub fn umoci_layers(dir: &Path, layers: &[Vec<u8>]) -> PathBuf {
    let layout = dir.join("layout");
    tool("umoci", &["init", "--layout", s(&layout)]);
    let image = format!("{}:t", s(&layout));
    tool("umoci", &["new", "--image", &image]);
    for (n, bytes) in layers.iter().enumerate() {
        let f = dir.join(format!("layer{n}.tar"));
        fs::write(&f, bytes).expect("write the layer");
        tool("umoci", &["raw", "add-layer", "--image", &image, s(&f)]);
    }
    layout
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
}

impl TestRegistry {
    pub const USER: &'static str = "hearth";
    pub const PASSWORD: &'static str = "s3cret-pw";

    /// With `tls`: https with a certificate for 127.0.0.1 from a CA made
    /// here, and htpasswd auth. Without: plain http, anonymous.
    pub fn start(tls: bool) -> TestRegistry {
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
            tool(
                "openssl",
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-days",
                    "1",
                    "-subj",
                    "/CN=hearth test CA",
                    "-keyout",
                    &p("ca.key"),
                    "-out",
                    &p("ca.pem"),
                ],
            );
            tool(
                "openssl",
                &[
                    "req",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-subj",
                    "/CN=127.0.0.1",
                    "-keyout",
                    &p("server.key"),
                    "-out",
                    &p("server.csr"),
                ],
            );
            fs::write(
                d.join("ext"),
                "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
            )
            .expect("write");
            tool(
                "openssl",
                &[
                    "x509",
                    "-req",
                    "-days",
                    "1",
                    "-in",
                    &p("server.csr"),
                    "-CA",
                    &p("ca.pem"),
                    "-CAkey",
                    &p("ca.key"),
                    "-CAcreateserial",
                    "-extfile",
                    &p("ext"),
                    "-out",
                    &p("server.pem"),
                ],
            );
            fs::create_dir_all(d.join("certs")).expect("mkdir");
            fs::copy(d.join("ca.pem"), d.join("certs/ca.crt")).expect("copy");
            http.push_str(&format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                p("server.pem"),
                p("server.key")
            ));
            let line = tool("htpasswd", &["-Bbn", Self::USER, Self::PASSWORD]);
            fs::write(d.join("htpasswd"), line.trim()).expect("write");
            auth = format!(
                "auth:\n  htpasswd:\n    realm: hearth-test\n    path: {}\n",
                p("htpasswd")
            );
        }
        let config = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n{http}{auth}",
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
        if self.tls {
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
