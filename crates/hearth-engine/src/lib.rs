//! hearth's engine: the store, the reconcilers and the supervision of running
//! VMs. The HTTP API and the manifest directory drive it through `Engine`.
//!
//! Layers, each calling only the ones below it: `engine` (commands, work
//! queue) → `runner` (which reconciler runs a kind, backoff, requeues) → the
//! reconcilers (`vm`, `disk`, `image`, `network`, `snapshot`), which see
//! only a `context::Context` → the context and the registries it holds (one
//! leaf module per subsystem) → `store` and `hearth_qemu`.
//!
//! Outside the crate the engine is `Engine`'s methods and the few types
//! re-exported here; `context`, `guest`, `metrics`, `runner`, `runtime` and
//! `error` are the crate's own. (`disk`, `image`, `manifest`, `snapshot` and
//! `vm` stay public for now: closing them turns up code only tests use.)

pub mod config;
pub(crate) mod context;
pub mod disk;
pub(crate) mod engine;
pub(crate) mod error;
pub(crate) mod guest;
pub mod image;
pub mod manifest;
pub(crate) mod metrics;
pub mod network;
pub(crate) mod runner;
pub(crate) mod runtime;
pub mod snapshot;
pub mod store;
pub mod vm;
pub mod watch;

pub use config::EngineConfig;
pub use engine::{
    ApplyAction, ApplyMode, ApplyOutcome, Engine, MAX_APPLY_OBJECTS, RequestError, StartError,
    VmAction,
};
pub use error::{
    ApplyConflict, ExportError, GuestAccessError, NetworkConflict, Refusal, RestoreError,
};
pub use guest::exec::MAX_WAIT as EXEC_MAX_WAIT;
pub use guest::{Download, ExecStarted, ExecStatus, Upload, UploadDone};
pub use manifest::{ManifestConfig, ManifestSource};
pub use metrics::{ManifestMetrics, PREFIX as METRICS_PREFIX, Sample, encode as encode_metrics};
pub use snapshot::expedite::SCRIPT as EXPEDITE_SCRIPT;
pub use snapshot::export::{Export, ExportFormat};
