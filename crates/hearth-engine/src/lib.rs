//! hearth's engine: the store, the reconcilers and the supervision of running
//! VMs. The HTTP API and the manifest directory drive it through `Engine`.

pub mod config;
pub mod disk;
pub mod engine;
pub mod manifest;
pub mod runtime;
pub mod snapshot;
pub mod store;
pub mod vm;

pub use config::EngineConfig;
pub use engine::{ApplyAction, ApplyOutcome, Engine, RequestError, StartError, VmAction};
