//! A layer as a tar stream: decompressed as it is read (gzip or zstd, as
//! its media type says), and bounded, so a small blob that inflates to more
//! than the image may hold (a gzip bomb) stops at the bound.

use std::io::{self, Read};

use oci_spec::image::{Descriptor, MediaType};

use crate::OciError;

const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
const DOCKER_LAYER: &str = "application/vnd.docker.image.rootfs.diff.tar";

/// How a layer's tar is compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// The compression `layer`'s media type names; any media type that is
    /// not a tar layer is refused, naming it.
    pub fn of(layer: &Descriptor) -> Result<Compression, OciError> {
        match layer.media_type() {
            MediaType::ImageLayer | MediaType::ImageLayerNonDistributable => Ok(Compression::None),
            MediaType::ImageLayerGzip | MediaType::ImageLayerNonDistributableGzip => {
                Ok(Compression::Gzip)
            }
            MediaType::ImageLayerZstd | MediaType::ImageLayerNonDistributableZstd => {
                Ok(Compression::Zstd)
            }
            MediaType::Other(t) if t == DOCKER_LAYER_GZIP => Ok(Compression::Gzip),
            MediaType::Other(t) if t == DOCKER_LAYER => Ok(Compression::None),
            other => Err(OciError::MediaType {
                digest: layer.digest().to_string(),
                media_type: other.to_string(),
                wanted: "a layer (tar, tar+gzip or tar+zstd)",
            }),
        }
    }
}

/// The uncompressed tar of `layer`, read from `blob`, failing once more
/// than `limit` bytes come out.
pub fn tar_stream<'a>(
    layer: &Descriptor,
    blob: impl Read + 'a,
    limit: u64,
) -> Result<Box<dyn Read + 'a>, OciError> {
    let digest = layer.digest().to_string();
    let raw: Box<dyn Read + 'a> = match Compression::of(layer)? {
        Compression::None => Box::new(blob),
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(blob)),
        Compression::Zstd => {
            Box::new(
                zstd::stream::read::Decoder::new(blob).map_err(|e| OciError::Layer {
                    digest: digest.clone(),
                    message: format!("zstd: {e}"),
                })?,
            )
        }
    };
    Ok(Box::new(Bounded {
        inner: raw,
        left: limit,
        limit,
    }))
}

/// A reader that fails past `limit` bytes.
struct Bounded<R> {
    inner: R,
    left: u64,
    limit: u64,
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            // One byte more tells a stream that ends at the bound from one
            // that goes on.
            let mut probe = [0u8; 1];
            return match self.inner.read(&mut probe)? {
                0 => Ok(0),
                _ => Err(io::Error::other(format!(
                    "the layer inflates to more than {} bytes",
                    self.limit
                ))),
            };
        }
        let max = buf.len().min(self.left.min(usize::MAX as u64) as usize);
        let n = self.inner.read(&mut buf[..max])?;
        self.left -= n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn layer(media: &str) -> Descriptor {
        serde_json::from_value(serde_json::json!({
            "mediaType": media,
            "digest": format!("sha256:{}", "0".repeat(64)),
            "size": 1,
        }))
        .unwrap()
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(bytes).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn a_layer_that_inflates_past_the_bound_fails_at_the_bound() {
        // 64 MiB of zeros gzip to about 64 KiB.
        let bomb = gzip(&vec![0u8; 64 << 20]);
        assert!(bomb.len() < 1 << 20, "{}", bomb.len());
        let mut r = tar_stream(
            &layer("application/vnd.oci.image.layer.v1.tar+gzip"),
            &bomb[..],
            1 << 20,
        )
        .unwrap();
        let mut sink = Vec::new();
        let e = r.read_to_end(&mut sink).unwrap_err();
        assert!(e.to_string().contains("more than 1048576 bytes"), "{e}");
        assert_eq!(sink.len(), 1 << 20);
    }

    #[test]
    fn a_layer_exactly_at_the_bound_is_whole() {
        let data = vec![7u8; 4096];
        for (media, bytes) in [
            ("application/vnd.oci.image.layer.v1.tar+gzip", gzip(&data)),
            (
                "application/vnd.oci.image.layer.v1.tar+zstd",
                zstd::encode_all(&data[..], 1).unwrap(),
            ),
            ("application/vnd.oci.image.layer.v1.tar", data.clone()),
            (DOCKER_LAYER_GZIP, gzip(&data)),
        ] {
            let mut r = tar_stream(&layer(media), &bytes[..], 4096).unwrap();
            let mut out = Vec::new();
            r.read_to_end(&mut out).unwrap();
            assert_eq!(out, data, "{media}");
        }
    }

    #[test]
    fn a_media_type_that_is_no_layer_is_refused_by_name() {
        let e = Compression::of(&layer("application/vnd.example.thing")).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "sha256:{}: media type \"application/vnd.example.thing\" is not a layer (tar, tar+gzip or tar+zstd)",
                "0".repeat(64)
            )
        );
    }
}
