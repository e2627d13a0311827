//! Pulls from a real registry on 127.0.0.1: Debian's docker-registry (the
//! CNCF distribution registry) with TLS from a CA this test makes and
//! htpasswd auth, and one without either for plain http. Images are pushed
//! by skopeo from layouts umoci writes.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hearth_oci::OciError;
use hearth_oci::blobs::BlobStore;
use hearth_oci::registry::{Credentials, Options, Registry};
use hearth_oci::shape::{self, Shape};
use hearth_test_support::oci::{TestRegistry, sha256sum, tool};

const USER: &str = TestRegistry::USER;
const PASSWORD: &str = TestRegistry::PASSWORD;

fn run(program: &str, args: &[&str]) -> String {
    tool(program, args)
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
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
        ca_file: r.tls().then(|| r.ca()),
        credentials: credentials.map(|(u, p)| Credentials {
            username: u.into(),
            password: p.into(),
        }),
        insecure: !r.tls(),
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
