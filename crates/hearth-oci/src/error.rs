//! Why an image could not be read. Each case names the blob (by digest) or
//! the file it is about.

use std::path::PathBuf;

/// Why an image could not be read, stored or chosen.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "blob {expected}: its content hashes to sha256:{actual}; the blob is corrupt or not the one named"
    )]
    DigestMismatch { expected: String, actual: String },
    #[error("blob {digest}: {actual} bytes, but its descriptor says {expected}")]
    SizeMismatch {
        digest: String,
        expected: u64,
        actual: u64,
    },
    #[error("{what} {name} is {size} bytes, more than the limit of {limit}")]
    TooLarge {
        what: &'static str,
        name: String,
        size: u64,
        limit: u64,
    },
    #[error("digest {digest:?}: hearth verifies sha256 digests only")]
    UnsupportedDigest { digest: String },
    #[error("{what} {digest}: not valid JSON of its kind: {message}")]
    Json {
        what: &'static str,
        digest: String,
        message: String,
    },
    #[error("{} is not an OCI image layout: {why}", path.display())]
    NotALayout { path: PathBuf, why: String },
    #[error("blob {digest} is missing from the image layout {}", layout.display())]
    MissingBlob { layout: PathBuf, digest: String },
    #[error("blob {digest} in the image layout {} is not a regular file", layout.display())]
    NotAFile { layout: PathBuf, digest: String },
    #[error("the image layout {} has no image tagged {tag:?} (tags: {})", layout.display(), list(tags))]
    TagNotFound {
        layout: PathBuf,
        tag: String,
        tags: Vec<String>,
    },
    #[error("the image layout {} holds {count} images; name one with tag (tags: {})", layout.display(), list(tags))]
    TagNeeded {
        layout: PathBuf,
        count: usize,
        tags: Vec<String>,
    },
    #[error("{digest} has no image for linux/amd64 (it has: {})", list(have))]
    NoPlatform { digest: String, have: Vec<String> },
    #[error("{digest}: media type {media_type:?} is not {wanted}")]
    MediaType {
        digest: String,
        media_type: String,
        wanted: &'static str,
    },
    #[error(
        "{digest}: an index inside an index inside an index; hearth follows one level of nesting"
    )]
    NestedTooDeep { digest: String },
    #[error("layer {digest}: {message}")]
    Layer { digest: String, message: String },
    /// The registry could not be reached, or answered wrongly.
    #[error("{reference}: {message}")]
    Registry { reference: String, message: String },
    /// The registry sent nothing for longer than the read timeout (or
    /// could not be connected to within it).
    #[error("{reference}: {message}")]
    Timeout { reference: String, message: String },
    /// The registry refused the credentials (or their absence).
    #[error("{reference}: the registry refused access: {message}")]
    Denied { reference: String, message: String },
    /// The root filesystem could not be finished (after every layer).
    #[error("building the root filesystem: {0}")]
    Build(String),
    /// The caller's room check (its free-space reserve) stopped a write
    /// before it began: `needs` bytes in all would have been written.
    #[error("{message}")]
    NoRoom { needs: u64, message: String },
}

fn list(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_string()
    } else {
        items.join(", ")
    }
}

impl OciError {
    pub fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        OciError::Io {
            what,
            path: path.into(),
            source,
        }
    }
}
