//! Pulls from an OCI distribution registry.
//!
//! `oci-client` speaks the protocol where it is hard: the auth dance (a
//! 401's `WWW-Authenticate`, basic credentials or a bearer token fetched
//! from the realm it names, cached per scope) and streaming blobs.
//! Manifests and indexes hearth fetches itself, with the same credentials,
//! because `oci-client` reads a manifest body whole, unbounded; here a
//! manifest over [`crate::MAX_MANIFEST_BYTES`] stops at the bound. Every
//! byte is verified as elsewhere: documents by the [`Resolver`], blobs by
//! the [`BlobStore`] writer as they stream.
//!
//! TLS is rustls with its ring provider (installed once per process by
//! [`install_crypto`]); a CA file adds to the system's roots; plain http
//! only when asked (`insecure`).

use std::path::PathBuf;
use std::time::Duration;

use futures_util::StreamExt;
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Reference, RegistryOperation};
use oci_spec::image::Descriptor;
use sha2::{Digest as _, Sha256};

use crate::blobs::BlobStore;
use crate::layout::{Image, Need, Resolver};
use crate::select::{DOCKER_MANIFEST, DOCKER_MANIFEST_LIST};
use crate::{MAX_MANIFEST_BYTES, OciError};

const ACCEPT: [&str; 4] = [
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
    DOCKER_MANIFEST_LIST,
    DOCKER_MANIFEST,
];

/// How to reach a registry.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// A PEM file of CA certificates the registry's certificate chains to.
    pub ca_file: Option<PathBuf>,
    /// Credentials, or none for anonymous pulls.
    pub credentials: Option<Credentials>,
    /// Plain http: only when the manifest says `insecure: true`.
    pub insecure: bool,
    /// Bound on connecting and on each read.
    pub timeout: Option<Duration>,
}

/// A user name and password (or token) for the registry.
#[derive(Clone, serde::Deserialize)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({:?}, <hidden>)", self.username)
    }
}

/// Installs rustls's ring provider for this process (once; later calls
/// and a provider someone else installed are fine).
pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// One image reference at one registry.
pub struct Registry {
    client: oci_client::Client,
    http: reqwest::Client,
    auth: RegistryAuth,
    reference: Reference,
    scheme: &'static str,
    text: String,
}

impl Registry {
    /// A puller of `reference` (`HOST[:PORT]/REPO:TAG` or `...@sha256:HEX`).
    pub fn new(reference: &str, options: &Options) -> Result<Registry, OciError> {
        install_crypto();
        let text = reference.to_string();
        let bad = |message: String| OciError::Registry {
            reference: text.clone(),
            message,
        };
        let parsed: Reference = reference
            .parse()
            .map_err(|e| bad(format!("not an image reference: {e}")))?;
        let mut roots = Vec::new();
        let mut http = reqwest::Client::builder();
        if let Some(ca) = &options.ca_file {
            let pem = std::fs::read(ca).map_err(|e| OciError::io("reading the CA file", ca, e))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| bad(format!("the CA file {}: {e}", ca.display())))?;
            if certs.is_empty() {
                return Err(bad(format!(
                    "the CA file {} holds no certificate",
                    ca.display()
                )));
            }
            http = http.tls_certs_merge(certs);
            roots.push(Certificate {
                encoding: CertificateEncoding::Pem,
                data: pem,
            });
        }
        if let Some(t) = options.timeout {
            http = http.connect_timeout(t).read_timeout(t);
        }
        let http = http
            .build()
            .map_err(|e| bad(format!("making the http client: {e}")))?;
        let config = ClientConfig {
            protocol: if options.insecure {
                ClientProtocol::Http
            } else {
                ClientProtocol::Https
            },
            extra_root_certificates: roots,
            connect_timeout: options.timeout,
            read_timeout: options.timeout,
            ..ClientConfig::default()
        };
        let auth = match &options.credentials {
            Some(c) => RegistryAuth::Basic(c.username.clone(), c.password.clone()),
            None => RegistryAuth::Anonymous,
        };
        Ok(Registry {
            client: oci_client::Client::new(config),
            http,
            auth,
            reference: parsed,
            scheme: if options.insecure { "http" } else { "https" },
            text,
        })
    }

    fn fail(&self, message: String) -> OciError {
        OciError::Registry {
            reference: self.text.clone(),
            message,
        }
    }

    /// A failure to reach or read from the registry (`what` says which
    /// request): [`OciError::Timeout`] when the cause is a timeout.
    fn transport(&self, what: &str, e: &(dyn std::error::Error + 'static)) -> OciError {
        let message = format!("{what}: {}", chain(e));
        if is_timeout(e) {
            OciError::Timeout {
                reference: self.text.clone(),
                message: format!("{message} (nothing received within the read timeout)"),
            }
        } else {
            self.fail(message)
        }
    }

    /// The `Authorization` header for pulls: a bearer token the registry's
    /// realm gave, or the basic credentials, or none.
    async fn authorization(&self) -> Result<Option<String>, OciError> {
        let token = self
            .client
            .auth(&self.reference, &self.auth, RegistryOperation::Pull)
            .await
            .map_err(|e| self.refused(e))?;
        Ok(match (token, &self.auth) {
            (Some(t), _) => Some(format!("Bearer {t}")),
            (None, RegistryAuth::Basic(user, password)) => {
                use base64::Engine as _;
                let pair =
                    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
                Some(format!("Basic {pair}"))
            }
            (None, _) => None,
        })
    }

    fn refused(&self, e: oci_client::errors::OciDistributionError) -> OciError {
        use oci_client::errors::OciDistributionError as E;
        match &e {
            E::AuthenticationFailure(_) | E::UnauthorizedError { .. } => OciError::Denied {
                reference: self.text.clone(),
                message: e.to_string(),
            },
            _ => self.transport("the registry", &e),
        }
    }

    /// Resolves the reference to its linux/amd64 image.
    pub async fn image(&self) -> Result<Image, OciError> {
        let authorization = self.authorization().await?;
        let by = self
            .reference
            .digest()
            .or(self.reference.tag())
            .unwrap_or("latest")
            .to_string();
        let (bytes, media_type) = self.manifest(&by, authorization.as_deref()).await?;
        let digest = format!("sha256:{:x}", Sha256::digest(&bytes));
        if let Some(pinned) = self.reference.digest()
            && pinned != digest
        {
            return Err(OciError::DigestMismatch {
                expected: pinned.to_string(),
                actual: digest.trim_start_matches("sha256:").to_string(),
            });
        }
        let top: Descriptor = serde_json::from_value(serde_json::json!({
            "mediaType": media_type,
            "digest": digest,
            "size": bytes.len(),
        }))
        .map_err(|e| self.fail(format!("the manifest's descriptor: {e}")))?;
        let mut resolver = Resolver::new(top);
        let mut first = Some(bytes);
        loop {
            match resolver.need()? {
                Need::Nothing(image) => return Ok(*image),
                Need::Read {
                    descriptor,
                    limit,
                    what,
                } => {
                    let bytes = match first.take() {
                        Some(b) => b,
                        None if what == "image configuration" => {
                            self.small_blob(&descriptor, limit).await?
                        }
                        None => {
                            self.manifest(descriptor.digest().as_ref(), authorization.as_deref())
                                .await?
                                .0
                        }
                    };
                    resolver.feed(bytes)?;
                }
            }
        }
    }

    /// GETs a manifest or index by tag or digest, bounded; returns its
    /// bytes and media type.
    async fn manifest(
        &self,
        by: &str,
        authorization: Option<&str>,
    ) -> Result<(Vec<u8>, String), OciError> {
        let url = format!(
            "{}://{}/v2/{}/manifests/{by}",
            self.scheme,
            self.reference.resolve_registry(),
            self.reference.repository()
        );
        let mut req = self.http.get(&url).header("Accept", ACCEPT.join(", "));
        if let Some(a) = authorization {
            req = req.header("Authorization", a);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| self.transport(&format!("GET {url}"), &e))?;
        let status = resp.status();
        if status == reqwest::StatusCode::UNAUTHORIZED || status == reqwest::StatusCode::FORBIDDEN {
            return Err(OciError::Denied {
                reference: self.text.clone(),
                message: format!("GET {url}: {status}"),
            });
        }
        if !status.is_success() {
            return Err(self.fail(format!("GET {url}: {status}")));
        }
        let media_type = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or(v).trim().to_string())
            .unwrap_or_default();
        if let Some(len) = resp.content_length()
            && len > MAX_MANIFEST_BYTES
        {
            return Err(OciError::TooLarge {
                what: "manifest",
                name: by.to_string(),
                size: len,
                limit: MAX_MANIFEST_BYTES,
            });
        }
        let mut body = Vec::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.transport(&format!("GET {url}"), &e))?;
            body.extend_from_slice(&chunk);
            if body.len() as u64 > MAX_MANIFEST_BYTES {
                return Err(OciError::TooLarge {
                    what: "manifest",
                    name: by.to_string(),
                    size: body.len() as u64,
                    limit: MAX_MANIFEST_BYTES,
                });
            }
        }
        // A registry that names no type: the document's own mediaType.
        let media_type = if media_type.is_empty() || media_type == "application/json" {
            serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["mediaType"].as_str().map(str::to_string))
                .unwrap_or_else(|| "application/vnd.oci.image.manifest.v1+json".to_string())
        } else {
            media_type
        };
        Ok((body, media_type))
    }

    async fn small_blob(&self, d: &Descriptor, limit: u64) -> Result<Vec<u8>, OciError> {
        if d.size() > limit {
            return Err(OciError::TooLarge {
                what: "blob",
                name: d.digest().to_string(),
                size: d.size(),
                limit,
            });
        }
        let mut stream = self.blob_stream(d).await?;
        let mut out = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.transport(&format!("blob {}", d.digest()), &e))?;
            out.extend_from_slice(&chunk);
            if out.len() as u64 > d.size() {
                break;
            }
        }
        Ok(out)
    }

    async fn blob_stream(
        &self,
        d: &Descriptor,
    ) -> Result<
        futures_util::stream::BoxStream<'static, Result<bytes::Bytes, std::io::Error>>,
        OciError,
    > {
        let digest = d.digest().to_string();
        let s = self
            .client
            .pull_blob_stream(&self.reference, digest.as_str())
            .await
            .map_err(|e| self.refused(e))?;
        Ok(s.stream)
    }

    /// Streams the image's config and layers into `store` (what it holds
    /// already is not fetched again), each verified as it arrives. The
    /// documents read by [`Registry::image`] are stored too. `progress`
    /// hears the bytes fetched so far.
    pub async fn copy_into(
        &self,
        image: &Image,
        store: &BlobStore,
        mut progress: impl FnMut(u64),
    ) -> Result<u64, OciError> {
        for (d, bytes) in &image.documents {
            store.put(d.digest(), d.size(), &mut bytes.as_slice())?;
        }
        let mut fetched = 0u64;
        for layer in image.layers() {
            if store.contains(layer.digest()) {
                continue;
            }
            let mut w = store.writer(layer.digest(), layer.size())?;
            let mut stream = self.blob_stream(layer).await?;
            while let Some(chunk) = stream.next().await {
                let chunk =
                    chunk.map_err(|e| self.transport(&format!("blob {}", layer.digest()), &e))?;
                w.take(&chunk)?;
                fetched += chunk.len() as u64;
                progress(fetched);
            }
            w.finish()?;
        }
        Ok(fetched)
    }
}

/// Whether `e`, or an error it was caused by, is a timeout (reqwest's, or
/// an I/O error of kind `TimedOut`, as oci-client's blob streams carry).
fn is_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut at = Some(e);
    while let Some(e) = at {
        if let Some(r) = e.downcast_ref::<reqwest::Error>()
            && r.is_timeout()
        {
            return true;
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::TimedOut {
                return true;
            }
            if let Some(inner) = io.get_ref()
                && is_timeout(inner)
            {
                return true;
            }
        }
        at = e.source();
    }
    false
}

/// An error with its causes, as one line.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut at = e.source();
    while let Some(s) = at {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        at = s.source();
    }
    text
}
