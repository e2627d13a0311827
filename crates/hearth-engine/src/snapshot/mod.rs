//! Consistent snapshots: the pure freeze coordinator and its async shell.

pub mod coordinator;
