//! hearth's engine: the store, the reconcilers and the supervision of running
//! VMs. The HTTP API and the manifest directory drive it through `Engine`.
//!
//! Layers, each calling only the ones below it: `engine` (commands, work
//! queue) → `runner` (which reconciler runs a kind, backoff, requeues) → the
//! reconcilers (`vm`, `disk`, `image`, `network`, `snapshot`, `schedule`), which see
//! only a `context::Context` → the context and the registries it holds (one
//! leaf module per subsystem) → `store` and `hearth_qemu`.
//!
//! Outside the crate the engine is `Engine`'s methods and the few types
//! re-exported here; the reconcilers, the context, its registries and the
//! rest are the crate's own. Four modules stay public, for what hearthd and
//! the integration tests name in them:
//! - `config`: hearthd fills `EngineConfig` and `ImageImportConfig` from its
//!   flags and config file, with the OVMF defaults as its flags' defaults.
//! - `watch`: `Filter` and `Options`, which hearthd's watch endpoint parses
//!   from its query.
//! - `store`: `StoredObject` and `StoreError`, which hearthd's API answers
//!   with; tests open the database to read and seed rows (`Store`,
//!   `StoredLease`).
//! - `network`: hearthd's loopback forward limits (`host::loopback`); the
//!   host-network tests drive `network::host` (links, dnsmasq, cleanup) and
//!   the admission tests `plan_leases` and `names`.

pub(crate) mod backup;
pub mod config;
pub(crate) mod context;
pub(crate) mod disk;
pub(crate) mod engine;
pub(crate) mod error;
pub(crate) mod guest;
pub(crate) mod image;
pub(crate) mod manifest;
pub(crate) mod metrics;
pub mod network;
pub(crate) mod runner;
pub(crate) mod runtime;
pub(crate) mod schedule;
pub(crate) mod snapshot;
pub mod store;
pub(crate) mod vm;
pub mod watch;

pub use backup::verify::{
    FileCheck as BackupFileCheck, Report as BackupReport, Summary as BackupCheckSummary,
    Target as BackupTarget,
};
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
pub use manifest::git::repo::{Auth as GitAuth, Signers as GitSigners};
pub use manifest::git::valid_name as valid_git_source_name;
pub use manifest::{GitConfig, GitSource, GitSources, ManifestConfig, ManifestSource};
pub use metrics::{ManifestMetrics, PREFIX as METRICS_PREFIX, Sample, encode as encode_metrics};
pub use snapshot::expedite::SCRIPT as EXPEDITE_SCRIPT;
pub use snapshot::export::{Export, ExportFormat};
pub use vm::console::data_from as console_data_from;
