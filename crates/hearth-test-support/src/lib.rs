//! What hearth's tests share: typed builders for the objects they apply
//! (serialised from the `hearth_api` types, so a test's input is always a
//! shape the API knows), a bounded wait for conditions outside the daemon,
//! readers of the process table, and OCI fixtures (layouts, a registry)
//! made with real tools.
//!
//! ```
//! use hearth_test_support::{Disk, Manifest, Vm};
//!
//! let yaml = Manifest::new()
//!     .with(Disk::blank("data", "16Mi"))
//!     .with(Vm::small("a").always_off().disk("data"))
//!     .yaml();
//! assert_eq!(hearth_api::parse_documents(&yaml, "t.yaml").unwrap().len(), 2);
//! ```

mod objects;
pub mod oci;
pub mod process;
pub mod tls;
mod wait;

pub use objects::{
    Disk, DiskSnapshot, Image, Manifest, Network, ObjectBuilder, SnapshotGroup, Vm, VmSnapshot,
};
pub use process::converters_of;
pub use wait::{eventually, eventually_every};
