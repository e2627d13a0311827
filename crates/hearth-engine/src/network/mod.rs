//! hearth-managed networking.

pub mod host;
