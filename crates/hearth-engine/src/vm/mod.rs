//! VirtualMachine lifecycle: a pure decision core and the async shell that
//! carries its steps out against QEMU.

pub mod decide;
pub mod launches;
pub mod live;
mod reconcile;

pub use reconcile::{fingerprint, reconcile};
