//! OCI images as hearth reads them: a blob store by digest that verifies
//! every byte as it arrives, image layouts (the directory `skopeo copy oci:`
//! and `umoci` write), the choice of the linux/amd64 image from an index,
//! and the layers' tar streams, uncompressed and bounded.
//!
//! The registry protocol and the engine's import live elsewhere; this crate
//! does blocking file I/O only, so the engine runs it on its blocking pool.

pub mod archive;
pub mod blobs;
mod error;
pub mod ext4;
pub mod kernel;
pub mod layers;
pub mod layout;
pub mod registry;
pub mod resolve;
pub mod select;
pub mod shape;
pub mod unpack;

pub use error::OciError;
pub use oci_spec::image::{Descriptor, Digest, ImageConfiguration, ImageIndex, ImageManifest};

/// The largest manifest or index read (containerd's limit too): a bigger
/// one is refused before it is parsed.
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;
/// The largest image configuration read.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
