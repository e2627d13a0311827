//! QEMU driver for hearth.
//!
//! Everything that talks to QEMU, its guest agent or `qemu-img` lives here, behind
//! small typed APIs. Nothing in this crate trusts what comes back: replies are
//! size-bounded, every wait has a timeout, and malformed input becomes an error
//! value, never a panic. Decisions and their reasons: `docs/qemu-driver.md`.

pub mod accel;
pub mod agent;
pub mod agent_io;
pub mod chain;
pub mod cmdline;
pub mod fsmap;
pub mod handover;
pub mod img;
pub mod probe;
pub mod process;
pub mod programs;
pub mod qcow2;
pub mod qmp;
pub mod seam;
pub mod stats;
pub mod storage_daemon;
pub mod tools;

mod lines;

pub use cmdline::{Accel, DiskAttachment, LaunchSpec};
pub use process::ProcessIdentity;
