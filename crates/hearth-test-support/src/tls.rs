//! A certificate authority of a test's own, made by `openssl`: a CA and a
//! server certificate for 127.0.0.1 signed by it, for servers a test runs
//! with TLS (the registry, a git server behind a TLS terminator).

use std::fs;
use std::path::{Path, PathBuf};

fn openssl(args: &[&str]) {
    crate::oci::tool("openssl", args);
}

/// A new RSA key at `key` and a certificate for it, signed by itself,
/// named `CN=<name>`, at `pem`: a CA, or a token signer.
pub fn self_signed(name: &str, key: &Path, pem: &Path) {
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        &format!("/CN={name}"),
        "-keyout",
        key.to_str().expect("utf-8 path"),
        "-out",
        pem.to_str().expect("utf-8 path"),
    ]);
}

/// `ca.pem`, `server.pem` and `server.key` in a folder.
pub struct TestCa {
    dir: PathBuf,
}

impl TestCa {
    /// A new CA in `dir` (named `CN=<name>`, so two CAs of one test can be
    /// told apart) and a certificate for `IP:127.0.0.1` it signed.
    pub fn new(dir: &Path, name: &str) -> TestCa {
        fs::create_dir_all(dir).expect("mkdir");
        let p = |n: &str| dir.join(n).to_str().expect("utf-8 path").to_string();
        self_signed(name, &dir.join("ca.key"), &dir.join("ca.pem"));
        openssl(&[
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
        ]);
        fs::write(
            dir.join("ext"),
            "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
        )
        .expect("write");
        openssl(&[
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
        ]);
        TestCa {
            dir: dir.to_path_buf(),
        }
    }

    /// The CA's certificate (PEM): what a client trusts.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// The server's certificate (PEM), for 127.0.0.1.
    pub fn certificate(&self) -> PathBuf {
        self.dir.join("server.pem")
    }

    /// The server's private key (PEM).
    pub fn key(&self) -> PathBuf {
        self.dir.join("server.key")
    }
}
