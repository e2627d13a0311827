//! A manifest file's bytes to objects, or an error with line and column:
//! `hearth_api::manifest`, which is pure, so the fuzz targets (`fuzz/`)
//! build it without the engine.

pub use hearth_api::manifest::{FileError, parse_manifest};
