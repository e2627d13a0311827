//! hearth's engine: the store, the reconcilers and the supervision of running
//! VMs. The HTTP API and the manifest directory drive it through `Engine`.
//!
//! Layers, each calling only the ones below it: `engine` (commands, work
//! queue) → `runner` (which reconciler runs a kind, backoff, requeues) → the
//! reconcilers (`vm`, `disk`, `image`, `network`, `snapshot`), which see
//! only a `context::Context` → the context and the registries it holds (one
//! leaf module per subsystem) → `store` and `hearth_qemu`.

pub mod config;
pub mod context;
pub mod disk;
pub mod engine;
pub mod error;
pub mod guest;
pub mod image;
pub mod manifest;
pub mod metrics;
pub mod network;
pub mod runner;
pub mod runtime;
pub mod snapshot;
pub mod store;
pub mod vm;
pub mod watch;

pub use config::EngineConfig;
pub use engine::{
    ApplyAction, ApplyOutcome, Engine, MAX_APPLY_OBJECTS, RequestError, StartError, VmAction,
};
