//! The walk from what a tag names to the image hearth runs, as a pure
//! state machine: it says which document it needs next, takes its bytes,
//! verifies them against the descriptor, and moves on. A manifest is the
//! end; an index leads to its linux/amd64 entry (one nested index at most);
//! the manifest's config must say linux/amd64 as well. Every source (a
//! layout, an archive, a registry) drives the same walk.

use oci_spec::image::{Arch, Descriptor, ImageConfiguration, ImageManifest, Os};

use crate::layers::Compression;
use crate::layout::{Image, verify};
use crate::select::{self, Points};
use crate::{MAX_CONFIG_BYTES, MAX_MANIFEST_BYTES, OciError};

/// What the walk needs next.
#[derive(Debug)]
pub enum Need {
    /// The bytes of `descriptor`, at most `limit` of them.
    Read {
        descriptor: Box<Descriptor>,
        limit: u64,
        what: &'static str,
    },
    /// Nothing more: here is the image.
    Nothing(Box<Image>),
}

#[derive(Debug)]
enum At {
    Document {
        depth: u8,
    },
    Config {
        manifest: Box<ImageManifest>,
        digest: Box<Descriptor>,
    },
    Done(Box<Image>),
    Taken,
}

/// The walk's state.
#[derive(Debug)]
pub struct Resolver {
    wanted: Descriptor,
    at: At,
    documents: Vec<(Descriptor, Vec<u8>)>,
}

impl Resolver {
    pub fn new(top: Descriptor) -> Resolver {
        Resolver {
            wanted: top,
            at: At::Document { depth: 0 },
            documents: Vec::new(),
        }
    }

    /// What to read next, or the image.
    pub fn need(&mut self) -> Result<Need, OciError> {
        let (limit, what) = match &self.at {
            At::Document { depth } => match select::points_at(self.wanted.media_type()) {
                Some(Points::Manifest) => (MAX_MANIFEST_BYTES, "manifest"),
                Some(Points::Index) if *depth < 2 => (MAX_MANIFEST_BYTES, "index"),
                Some(Points::Index) => {
                    return Err(OciError::NestedTooDeep {
                        digest: self.wanted.digest().to_string(),
                    });
                }
                None => {
                    return Err(OciError::MediaType {
                        digest: self.wanted.digest().to_string(),
                        media_type: self.wanted.media_type().to_string(),
                        wanted: "an image manifest or index",
                    });
                }
            },
            At::Config { .. } => (MAX_CONFIG_BYTES, "image configuration"),
            At::Done(_) => match std::mem::replace(&mut self.at, At::Taken) {
                At::Done(image) => return Ok(Need::Nothing(image)),
                _ => unreachable!("matched Done"),
            },
            At::Taken => panic!("the image was taken already"),
        };
        Ok(Need::Read {
            descriptor: Box::new(self.wanted.clone()),
            limit,
            what,
        })
    }

    /// The bytes of what [`Resolver::need`] asked for.
    pub fn feed(&mut self, bytes: Vec<u8>) -> Result<(), OciError> {
        verify(&self.wanted, &bytes)?;
        let d = self.wanted.clone();
        match std::mem::replace(&mut self.at, At::Taken) {
            At::Document { depth } => match select::points_at(d.media_type()) {
                Some(Points::Manifest) => {
                    let m = select::parse_manifest(d.digest(), &bytes)?;
                    for layer in m.layers() {
                        Compression::of(layer)?;
                    }
                    self.documents.push((d.clone(), bytes));
                    self.wanted = m.config().clone();
                    self.at = At::Config {
                        manifest: Box::new(m),
                        digest: Box::new(d),
                    };
                }
                _ => {
                    let index = select::parse_index(d.digest(), &bytes)?;
                    let next = select::linux_amd64(d.digest(), &index)?.clone();
                    self.documents.push((d, bytes));
                    self.wanted = next;
                    self.at = At::Document { depth: depth + 1 };
                }
            },
            At::Config { manifest, digest } => {
                let config = ImageConfiguration::from_reader(bytes.as_slice()).map_err(|e| {
                    OciError::Json {
                        what: "image configuration",
                        digest: d.digest().to_string(),
                        message: e.to_string(),
                    }
                })?;
                if *config.os() != Os::Linux || *config.architecture() != Arch::Amd64 {
                    return Err(OciError::NoPlatform {
                        digest: digest.digest().to_string(),
                        have: vec![format!("{}/{}", config.os(), config.architecture())],
                    });
                }
                self.documents.push((d, bytes));
                self.at = At::Done(Box::new(Image {
                    digest: digest.digest().clone(),
                    manifest: *manifest,
                    config,
                    documents: std::mem::take(&mut self.documents),
                }));
            }
            At::Done(_) | At::Taken => panic!("fed after the end"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest as _, Sha256};

    fn descriptor(media: &str, bytes: &[u8]) -> Descriptor {
        serde_json::from_value(serde_json::json!({
            "mediaType": media,
            "digest": format!("sha256:{:x}", Sha256::digest(bytes)),
            "size": bytes.len(),
        }))
        .unwrap()
    }

    const INDEX: &str = "application/vnd.oci.image.index.v1+json";
    const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
    const CONFIG: &str = "application/vnd.oci.image.config.v1+json";

    fn config(arch: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "architecture": arch, "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": []},
        }))
        .unwrap()
    }

    fn manifest(config: &[u8]) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2, "mediaType": MANIFEST,
            "config": descriptor(CONFIG, config),
            "layers": [],
        }))
        .unwrap()
    }

    fn index(entries: &[(&str, &[u8], &str)]) -> Vec<u8> {
        let manifests: Vec<serde_json::Value> = entries
            .iter()
            .map(|(media, bytes, arch)| {
                let mut d = serde_json::to_value(descriptor(media, bytes)).unwrap();
                d["platform"] = serde_json::json!({"os": "linux", "architecture": arch});
                d
            })
            .collect();
        serde_json::to_vec(
            &serde_json::json!({"schemaVersion": 2, "mediaType": INDEX, "manifests": manifests}),
        )
        .unwrap()
    }

    /// Drives the walk over `docs` (by digest), recording what it asked for.
    fn walk(top: Descriptor, docs: &[Vec<u8>]) -> (Result<Image, OciError>, Vec<&'static str>) {
        let mut r = Resolver::new(top);
        let mut asked = Vec::new();
        loop {
            match r.need() {
                Err(e) => return (Err(e), asked),
                Ok(Need::Nothing(image)) => return (Ok(*image), asked),
                Ok(Need::Read {
                    descriptor, what, ..
                }) => {
                    asked.push(what);
                    let bytes = docs
                        .iter()
                        .find(|b| {
                            format!("sha256:{:x}", Sha256::digest(b))
                                == descriptor.digest().to_string()
                        })
                        .cloned()
                        .unwrap_or_default();
                    if let Err(e) = r.feed(bytes) {
                        return (Err(e), asked);
                    }
                }
            }
        }
    }

    #[test]
    fn an_index_leads_to_the_amd64_manifest_then_its_config() {
        let (c64, carm) = (config("amd64"), config("arm64"));
        let (m64, marm) = (manifest(&c64), manifest(&carm));
        let i = index(&[(MANIFEST, &marm, "arm64"), (MANIFEST, &m64, "amd64")]);
        let (image, asked) = walk(
            descriptor(INDEX, &i),
            &[i.clone(), m64.clone(), marm, c64, carm],
        );
        let image = image.unwrap();
        assert_eq!(asked, ["index", "manifest", "image configuration"]);
        assert_eq!(image.digest, *descriptor(MANIFEST, &m64).digest());
        assert_eq!(image.documents.len(), 3);
    }

    #[test]
    fn bytes_that_are_not_the_named_document_are_refused() {
        let c = config("amd64");
        let m = manifest(&c);
        // The config the manifest names is not there: the walk gets
        // nothing for it, which does not hash to its digest.
        let (image, asked) = walk(descriptor(MANIFEST, &m), std::slice::from_ref(&m));
        assert_eq!(asked, ["manifest", "image configuration"]);
        assert!(
            matches!(image, Err(OciError::SizeMismatch { .. })),
            "{image:?}"
        );
        // A manifest whose config says arm64 is not run.
        let carm = config("arm64");
        let marm = manifest(&carm);
        let (image, _) = walk(descriptor(MANIFEST, &marm), &[marm.clone(), carm]);
        let e = image.unwrap_err();
        assert!(e.to_string().contains("(it has: linux/arm64)"), "{e}");
    }

    #[test]
    fn an_index_three_deep_is_refused() {
        let c = config("amd64");
        let m = manifest(&c);
        let i1 = index(&[(MANIFEST, &m, "amd64")]);
        let i2 = index(&[(INDEX, &i1, "amd64")]);
        let i3 = index(&[(INDEX, &i2, "amd64")]);
        let (image, asked) = walk(
            descriptor(INDEX, &i3),
            &[i3.clone(), i2.clone(), i1.clone(), m.clone(), c.clone()],
        );
        assert_eq!(asked, ["index", "index"]);
        assert!(
            matches!(image, Err(OciError::NestedTooDeep { .. })),
            "{image:?}"
        );
        let (image, _) = walk(descriptor(INDEX, &i2), &[i2, i1, m, c]);
        assert!(image.is_ok(), "{image:?}");
    }
}
