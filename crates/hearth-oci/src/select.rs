//! What a manifest or index is, and which image of an index hearth runs:
//! linux/amd64 (the only platform hearth's QEMU runs), the plain `amd64`
//! variant before any other.

use oci_spec::image::{Arch, Descriptor, Digest, ImageIndex, ImageManifest, MediaType, Os};

use crate::OciError;

pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// What a descriptor of an index or a layout points at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Points {
    Manifest,
    Index,
}

/// What `media_type` (of a descriptor, or the `mediaType` inside the
/// document) says the document is; `None` for anything else.
pub fn points_at(media_type: &MediaType) -> Option<Points> {
    match media_type {
        MediaType::ImageManifest => Some(Points::Manifest),
        MediaType::ImageIndex => Some(Points::Index),
        MediaType::Other(t) if t == DOCKER_MANIFEST => Some(Points::Manifest),
        MediaType::Other(t) if t == DOCKER_MANIFEST_LIST => Some(Points::Index),
        _ => None,
    }
}

/// Parses a manifest, refusing one whose own `mediaType` says otherwise.
pub fn parse_manifest(digest: &Digest, bytes: &[u8]) -> Result<ImageManifest, OciError> {
    let m = ImageManifest::from_reader(bytes).map_err(|e| OciError::Json {
        what: "manifest",
        digest: digest.to_string(),
        message: e.to_string(),
    })?;
    if let Some(t) = m.media_type()
        && points_at(t) != Some(Points::Manifest)
    {
        return Err(OciError::MediaType {
            digest: digest.to_string(),
            media_type: t.to_string(),
            wanted: "an image manifest",
        });
    }
    Ok(m)
}

/// Parses an index (or a Docker manifest list).
pub fn parse_index(digest: &Digest, bytes: &[u8]) -> Result<ImageIndex, OciError> {
    let i = ImageIndex::from_reader(bytes).map_err(|e| OciError::Json {
        what: "index",
        digest: digest.to_string(),
        message: e.to_string(),
    })?;
    if let Some(t) = i.media_type()
        && points_at(t) != Some(Points::Index)
    {
        return Err(OciError::MediaType {
            digest: digest.to_string(),
            media_type: t.to_string(),
            wanted: "an image index",
        });
    }
    Ok(i)
}

/// The entry of `index` (named `digest`) for linux/amd64. An entry with no
/// platform counts only when it is the index's only image.
pub fn linux_amd64<'a>(digest: &Digest, index: &'a ImageIndex) -> Result<&'a Descriptor, OciError> {
    let images: Vec<&Descriptor> = index
        .manifests()
        .iter()
        .filter(|d| points_at(d.media_type()).is_some())
        .collect();
    let fits = |d: &&Descriptor| {
        d.platform()
            .as_ref()
            .is_some_and(|p| *p.os() == Os::Linux && *p.architecture() == Arch::Amd64)
    };
    let plain = images.iter().find(|d| {
        fits(d)
            && d.platform()
                .as_ref()
                .and_then(|p| p.variant().as_deref())
                .is_none_or(|v| v == "v1")
    });
    if let Some(d) = plain.or_else(|| images.iter().find(|d| fits(d))) {
        return Ok(d);
    }
    if let [only] = images.as_slice()
        && only.platform().is_none()
    {
        return Ok(only);
    }
    Err(OciError::NoPlatform {
        digest: digest.to_string(),
        have: images
            .iter()
            .map(|d| match d.platform() {
                Some(p) => match p.variant() {
                    Some(v) => format!("{}/{}/{v}", p.os(), p.architecture()),
                    None => format!("{}/{}", p.os(), p.architecture()),
                },
                None => "no platform".to_string(),
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// os, architecture, variant.
    type Platform<'a> = (&'a str, &'a str, Option<&'a str>);

    fn index(entries: &[(&str, Option<Platform>)]) -> ImageIndex {
        let manifests: Vec<serde_json::Value> = entries
            .iter()
            .enumerate()
            .map(|(n, (media, platform))| {
                let mut d = serde_json::json!({
                    "mediaType": media,
                    "digest": format!("sha256:{:064x}", n),
                    "size": 100,
                });
                if let Some((os, arch, variant)) = platform {
                    d["platform"] = serde_json::json!({"os": os, "architecture": arch});
                    if let Some(v) = variant {
                        d["platform"]["variant"] = serde_json::json!(v);
                    }
                }
                d
            })
            .collect();
        let doc = serde_json::json!({"schemaVersion": 2, "manifests": manifests});
        ImageIndex::from_reader(doc.to_string().as_bytes()).unwrap()
    }

    fn digest() -> Digest {
        format!("sha256:{}", "f".repeat(64)).parse().unwrap()
    }

    const OCI: &str = "application/vnd.oci.image.manifest.v1+json";

    #[test]
    fn linux_amd64_is_chosen_among_others() {
        let i = index(&[
            (OCI, Some(("linux", "arm64", Some("v8")))),
            (OCI, Some(("linux", "amd64", Some("v3")))),
            (DOCKER_MANIFEST, Some(("linux", "amd64", None))),
            (OCI, Some(("windows", "amd64", None))),
        ]);
        let d = linux_amd64(&digest(), &i).unwrap();
        assert_eq!(d.digest().to_string(), format!("sha256:{:064x}", 2));
    }

    #[test]
    fn a_variant_is_taken_when_it_is_the_only_amd64() {
        let i = index(&[
            (OCI, Some(("linux", "arm64", None))),
            (OCI, Some(("linux", "amd64", Some("v2")))),
        ]);
        let d = linux_amd64(&digest(), &i).unwrap();
        assert_eq!(d.digest().to_string(), format!("sha256:{:064x}", 1));
    }

    #[test]
    fn no_linux_amd64_names_what_there_is() {
        let i = index(&[
            (OCI, Some(("linux", "arm64", Some("v8")))),
            (OCI, Some(("linux", "s390x", None))),
            // Not an image: an attestation or other artifact.
            (
                "application/vnd.oci.image.layer.v1.tar",
                Some(("linux", "amd64", None)),
            ),
        ]);
        let e = linux_amd64(&digest(), &i).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "sha256:{} has no image for linux/amd64 (it has: linux/arm64/v8, linux/s390x)",
                "f".repeat(64)
            )
        );
    }

    #[test]
    fn a_lone_image_without_a_platform_is_taken_two_are_not() {
        let one = index(&[(OCI, None)]);
        assert!(linux_amd64(&digest(), &one).is_ok());
        let two = index(&[(OCI, None), (OCI, None)]);
        assert!(matches!(
            linux_amd64(&digest(), &two),
            Err(OciError::NoPlatform { .. })
        ));
    }

    #[test]
    fn a_document_whose_own_media_type_disagrees_is_refused() {
        let doc = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": format!("sha256:{}", "a".repeat(64)), "size": 2},
            "layers": [],
        });
        let e = parse_manifest(&digest(), doc.to_string().as_bytes()).unwrap_err();
        assert!(matches!(e, OciError::MediaType { .. }), "{e}");
    }
}
