//! Snapshot layer tables.
