//! The hearth object model: kinds, validation and (de)serialisation.
//!
//! No I/O here: the daemon, the CLI and (later) a Kubernetes controller all
//! share these types, so they must stay free of any host assumption.

pub mod cron;
pub mod ignite;
mod kinds;
pub mod limits;
pub mod manifest;
mod meta;
pub mod net;
mod object;
#[cfg(feature = "openapi")]
pub mod openapi;
mod quantity;
pub mod redact;
pub mod watch;

pub use kinds::*;
pub use meta::*;
pub use object::{
    ApplyRequestError, FieldError, Object, ParseError, RawDocument, apply_request, check_dns_label,
    object_from_value, parse_documents, parse_documents_in, parse_file_mode, raw_documents,
    resolve_relative_paths,
};
pub use quantity::{Quantity, QuantityError};
pub use watch::{WatchLine, WatchType};

#[cfg(test)]
mod tests;
