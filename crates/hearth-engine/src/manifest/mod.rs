//! The manifest directory: a watched directory of YAML/JSON files as a
//! source of desired state, safe against every way editors and tools write
//! files. See docs/manifest-directory.md for the design and its reasons.
//!
//! - `names`: which directory entries are manifests (pure).
//! - `parse`: a file's bytes to objects or an error with line and column (pure).
//! - `core`: listings in, apply/delete/report commands out (pure, the hard part).
//! - `scan`: one re-list of the directory, reading only what changed.
//! - `watch`: the async shell: inotify, debounce, periodic re-list, engine calls.

pub mod apply;
pub mod core;
pub mod counters;
pub mod git;
pub mod names;
pub mod owner;
pub mod parse;
pub mod scan;
pub mod watch;

#[cfg(test)]
mod tests;

pub use git::{GitConfig, GitSource, GitSources};
pub use watch::{ManifestConfig, ManifestSource};
