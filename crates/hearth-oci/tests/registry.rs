//! Pulls from a real registry on 127.0.0.1: Debian's docker-registry (the
//! CNCF distribution registry) with TLS from a CA this test makes and
//! htpasswd auth, and one without either for plain http. Images are pushed
//! by skopeo from layouts umoci writes.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hearth_oci::OciError;
use hearth_oci::blobs::BlobStore;
use hearth_oci::registry::{Credentials, Options, Registry};
use hearth_oci::shape::{self, Shape};

fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().unwrap_or_else(|e| {
        panic!("{program}: {e}; install it with .ci/install-deps.sh (apt-get install -y umoci skopeo docker-registry apache2-utils openssl)")
    });
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

fn sha256sum(file: &Path) -> String {
    run("sha256sum", &[s(file)])
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// A registry process, stopped when dropped.
struct TestRegistry {
    dir: tempfile::TempDir,
    child: Child,
    addr: String,
    tls: bool,
}

const USER: &str = "hearth";
const PASSWORD: &str = "s3cret-pw";

impl TestRegistry {
    fn start(tls: bool) -> TestRegistry {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let mut http = format!("http:\n  addr: {addr}\n");
        let mut auth = String::new();
        if tls {
            // A CA, and a certificate for 127.0.0.1 it signs.
            run(
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
                    s(&d.join("ca.key")),
                    "-out",
                    s(&d.join("ca.pem")),
                ],
            );
            run(
                "openssl",
                &[
                    "req",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-subj",
                    "/CN=127.0.0.1",
                    "-keyout",
                    s(&d.join("server.key")),
                    "-out",
                    s(&d.join("server.csr")),
                ],
            );
            fs::write(
                d.join("ext"),
                "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
            )
            .unwrap();
            run(
                "openssl",
                &[
                    "x509",
                    "-req",
                    "-days",
                    "1",
                    "-in",
                    s(&d.join("server.csr")),
                    "-CA",
                    s(&d.join("ca.pem")),
                    "-CAkey",
                    s(&d.join("ca.key")),
                    "-CAcreateserial",
                    "-extfile",
                    s(&d.join("ext")),
                    "-out",
                    s(&d.join("server.pem")),
                ],
            );
            fs::create_dir_all(d.join("certs")).unwrap();
            fs::copy(d.join("ca.pem"), d.join("certs/ca.crt")).unwrap();
            http.push_str(&format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                s(&d.join("server.pem")),
                s(&d.join("server.key"))
            ));
            let line = run("htpasswd", &["-Bbn", USER, PASSWORD]);
            fs::write(d.join("htpasswd"), line.trim()).unwrap();
            auth = format!(
                "auth:\n  htpasswd:\n    realm: hearth-test\n    path: {}\n",
                s(&d.join("htpasswd"))
            );
        }
        let config = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n{http}{auth}",
            s(&d.join("data"))
        );
        fs::write(d.join("config.yml"), config).unwrap();
        let child = Command::new("docker-registry")
            .args(["serve", s(&d.join("config.yml"))])
            .stdout(Stdio::null())
            .stderr(fs::File::create(d.join("registry.log")).unwrap())
            .spawn()
            .expect("docker-registry (apt-get install -y docker-registry)");
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

    fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default()
    }

    fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// skopeo's flags to reach this registry (`dest` or `src`).
    fn flags(&self, side: &str) -> Vec<String> {
        if self.tls {
            vec![
                format!("--{side}-cert-dir={}", s(&self.dir.path().join("certs"))),
                format!("--{side}-creds={USER}:{PASSWORD}"),
            ]
        } else {
            vec![format!("--{side}-tls-verify=false")]
        }
    }

    fn push(&self, layout: &Path, tag: &str, repo: &str) -> String {
        let to = format!("docker://{}/{repo}", self.addr);
        let mut args = vec!["copy".to_string(), "-q".to_string()];
        args.extend(self.flags("dest"));
        args.push(format!("oci:{}:{tag}", s(layout)));
        args.push(to.clone());
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        run("skopeo", &refs);
        format!("{}/{repo}", self.addr)
    }

    /// The manifest digest skopeo reads at the registry.
    fn digest(&self, reference: &str) -> String {
        let flags = self
            .flags("src")
            .into_iter()
            .map(|f| f.replace("--src-", "--"))
            .collect::<Vec<_>>();
        let mut args = vec!["inspect".to_string(), "--raw".to_string()];
        args.extend(flags);
        args.push(format!("docker://{reference}"));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let raw = run("skopeo", &refs);
        let f = self.dir.path().join("raw-manifest");
        fs::write(&f, raw.as_bytes()).unwrap();
        format!("sha256:{}", sha256sum(&f))
    }
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn layout_with_rootfs(dir: &Path) -> PathBuf {
    let layout = dir.join("layout");
    run("umoci", &["init", "--layout", s(&layout)]);
    let img = format!("{}:t", s(&layout));
    run("umoci", &["new", "--image", &img]);
    let bundle = dir.join("bundle");
    run("umoci", &["unpack", "--image", &img, s(&bundle)]);
    fs::create_dir_all(bundle.join("rootfs/etc")).unwrap();
    fs::write(bundle.join("rootfs/etc/hostname"), b"pulled\n").unwrap();
    fs::write(bundle.join("rootfs/big"), vec![7u8; 2 << 20]).unwrap();
    run("umoci", &["repack", "--image", &img, s(&bundle)]);
    layout
}

fn options(r: &TestRegistry, credentials: Option<(&str, &str)>) -> Options {
    Options {
        ca_file: r.tls.then(|| r.ca()),
        credentials: credentials.map(|(u, p)| Credentials {
            username: u.into(),
            password: p.into(),
        }),
        insecure: !r.tls,
        timeout: Some(Duration::from_secs(20)),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pull_over_tls_with_basic_auth_verifies_every_blob_and_names_the_manifest_skopeo_sees() {
    let r = TestRegistry::start(true);
    let work = tempfile::tempdir().unwrap();
    let repo = r.push(&layout_with_rootfs(work.path()), "t", "hearth/box:1");
    let want = r.digest(&repo);

    let reg = Registry::new(&repo, &options(&r, Some((USER, PASSWORD)))).unwrap();
    let image = reg.image().await.unwrap();
    assert_eq!(image.digest.to_string(), want);
    let store = BlobStore::open(work.path().join("store")).unwrap();
    let mut seen = Vec::new();
    let fetched = reg
        .copy_into(&image, &store, |n| seen.push(n))
        .await
        .unwrap();
    assert_eq!(fetched, image.layer_bytes());
    assert!(
        seen.windows(2).all(|w| w[0] <= w[1]) && seen.last() == Some(&fetched),
        "{seen:?}"
    );
    for entry in fs::read_dir(store.root().join("sha256")).unwrap() {
        let p = entry.unwrap().path();
        assert_eq!(sha256sum(&p), p.file_name().unwrap().to_str().unwrap());
    }
    let layers = image
        .layers()
        .iter()
        .map(|d| (d.clone(), store.open_blob(d.digest()).unwrap()));
    assert_eq!(shape::detect(layers, 1 << 30).unwrap(), Shape::Rootfs);
    // Stored once: a second pull fetches no layer.
    assert_eq!(reg.copy_into(&image, &store, |_| {}).await.unwrap(), 0);

    // Pinned by digest: the same image; pinned to another: refused.
    let pinned = format!("{}@{want}", repo.rsplit_once(':').unwrap().0);
    let by_digest = Registry::new(&pinned, &options(&r, Some((USER, PASSWORD)))).unwrap();
    assert_eq!(by_digest.image().await.unwrap().digest.to_string(), want);
    let other = pinned.replace(&want, &format!("sha256:{}", "e".repeat(64)));
    let e = Registry::new(&other, &options(&r, Some((USER, PASSWORD))))
        .unwrap()
        .image()
        .await
        .unwrap_err();
    assert!(matches!(e, OciError::Registry { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread")]
async fn wrong_or_missing_credentials_and_an_unknown_ca_are_refused_with_the_reason() {
    let r = TestRegistry::start(true);
    let work = tempfile::tempdir().unwrap();
    let repo = r.push(&layout_with_rootfs(work.path()), "t", "hearth/box:1");

    let e = Registry::new(&repo, &options(&r, Some((USER, "wrong"))))
        .unwrap()
        .image()
        .await
        .unwrap_err();
    eprintln!("refused: {e}");
    assert!(matches!(e, OciError::Denied { .. }), "{e}");
    assert!(e.to_string().contains(&repo), "{e}");
    let e = Registry::new(&repo, &options(&r, None))
        .unwrap()
        .image()
        .await
        .unwrap_err();
    eprintln!("refused: {e}");
    assert!(matches!(e, OciError::Denied { .. }), "{e}");

    let mut no_ca = options(&r, Some((USER, PASSWORD)));
    no_ca.ca_file = None;
    let e = Registry::new(&repo, &no_ca)
        .unwrap()
        .image()
        .await
        .unwrap_err();
    eprintln!("refused: {e}");
    let text = e.to_string().to_lowercase();
    assert!(
        text.contains("certificate") || text.contains("unknownissuer"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn plain_http_is_used_only_when_insecure_is_set() {
    let r = TestRegistry::start(false);
    let work = tempfile::tempdir().unwrap();
    let repo = r.push(&layout_with_rootfs(work.path()), "t", "hearth/plain:1");
    let want = r.digest(&repo);
    let image = Registry::new(&repo, &options(&r, None))
        .unwrap()
        .image()
        .await
        .unwrap();
    assert_eq!(image.digest.to_string(), want);

    let mut tls = options(&r, None);
    tls.insecure = false;
    assert!(Registry::new(&repo, &tls).unwrap().image().await.is_err());
}
