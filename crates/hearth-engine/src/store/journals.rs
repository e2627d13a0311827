//! Snapshot journals.
