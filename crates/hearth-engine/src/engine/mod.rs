//! The engine: the one command surface (apply, delete, VM actions) that the
//! HTTP API and the manifest directory both drive, plus the work queue that
//! runs reconciles — never two at once for one object. Reconcilers get the
//! engine's `Context` (store, config, live VMs, locks, a way to wake), never
//! the engine itself; their wakes come back to the queue over a channel.
//!
//! Here: the struct, start-up, the reads and the work queue. The commands
//! live beside it: `apply` (apply, delete, VM actions and their checks),
//! `restore`, `guest` (agent calls, exec, file copies) and `export`.

use std::collections::HashMap;
use std::fs::File;
use std::sync::{Arc, Mutex};

use hearth_api::{Event, EventType, Kind};
use serde_json::Value;

use crate::config::EngineConfig;
use crate::context::{Context, Key};
use crate::runner::Runner;
use crate::store::{Store, StoreError, StoredObject};

mod apply;
pub(crate) mod errors;
mod export;
mod guest;
mod restore;

pub use crate::error::{MAX_APPLY_OBJECTS, RequestError};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot create {path}: {source}")]
    Dir {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("another hearthd already uses the state directory {0} (only one daemon may manage it)")]
    Locked(std::path::PathBuf),
    #[error("cannot open the store {path}: {source}")]
    Store {
        path: std::path::PathBuf,
        source: StoreError,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ApplyAction {
    Created,
    Configured,
    Unchanged,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ApplyOutcome {
    pub kind: Kind,
    pub name: String,
    pub action: ApplyAction,
}

/// What an apply may do to an object that already exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyMode {
    /// Create what is new, update what changed (`POST /v1/apply`).
    CreateOrUpdate,
    /// Create only: an object that exists refuses the whole apply
    /// (`POST /v1/apply?create=true`).
    CreateOnly,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmAction {
    Start,
    Stop,
    Restart,
}

pub struct Engine {
    /// What the reconcilers get: store, config, live VMs, operations locks,
    /// snapshot actors, and a sender whose wakes land in `queue`.
    ctx: Arc<Context>,
    /// Keys with a running worker; `true` means "changed while running: go again".
    queue: Mutex<HashMap<Key, bool>>,
    /// Runs each reconcile: timing, metrics, backoff, requeues.
    runner: Runner,
    /// Serialises apply/delete so their checks and writes are one step.
    writes: Mutex<()>,
    _lock: File,
}

impl Engine {
    /// Opens the store, takes the state-directory lock, adopts running VMs and
    /// starts reconciling everything.
    pub async fn start(config: EngineConfig) -> Result<Arc<Engine>, StartError> {
        // The run directory is 0711: dnsmasq, once it has dropped to
        // `nobody`, must pass through it to reread its hosts file under
        // `networks/`. Nothing in it can be listed, and the VMs' sockets sit
        // one level down in `vms/`, which stays 0700.
        let vms_run_dir = config.run_dir.join("vms");
        for (dir, mode) in [
            (&config.state_dir, 0o700),
            (&config.run_dir, 0o711),
            (&vms_run_dir, 0o700),
        ] {
            std::fs::create_dir_all(dir).map_err(|source| StartError::Dir {
                path: dir.clone(),
                source,
            })?;
            let _ =
                std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(mode));
        }
        let lock_path = config.state_dir.join("hearthd.lock");
        let lock = File::create(&lock_path).map_err(|source| StartError::Dir {
            path: lock_path.clone(),
            source,
        })?;
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive)
            .map_err(|_| StartError::Locked(config.state_dir.clone()))?;
        let db = config.database_path();
        let store = Store::open(&db).map_err(|source| StartError::Store { path: db, source })?;
        let (wakes, mut woken) = tokio::sync::mpsc::unbounded_channel::<Key>();
        let engine = Arc::new(Engine {
            ctx: Arc::new(Context::new(config, store, wakes)),
            queue: Mutex::new(HashMap::new()),
            runner: Runner::default(),
            writes: Mutex::new(()),
            _lock: lock,
        });
        // Wakes sent by reconcilers, live VMs and snapshot actors go through
        // the same queue as the commands' own.
        let weak = Arc::downgrade(&engine);
        tokio::spawn(async move {
            while let Some((kind, name)) = woken.recv().await {
                let Some(engine) = weak.upgrade() else { return };
                engine.wake(kind, &name);
            }
        });

        // Adopt what a previous daemon started: connect to the QEMU processes
        // that still run, so no reconcile ever starts a second one.
        if let Ok(records) = engine.ctx.store.runtimes() {
            for mut r in records {
                if hearth_qemu::process::is_alive(&r.process) {
                    if r.disk_names.is_empty() && !r.disks.is_empty() {
                        // A record from before the devices' disks were
                        // recorded: the launch-time files name them.
                        match crate::snapshot::storage::disks_of_layer_files(
                            &engine.ctx.store,
                            &r.disks,
                        ) {
                            Ok(Some(names)) => {
                                r.disk_names = names;
                                if let Err(e) = engine.ctx.store.put_runtime(&r) {
                                    tracing::warn!(vm = %r.vm, error = %e, "cannot update the runtime record");
                                }
                            }
                            Ok(None) => {
                                tracing::warn!(vm = %r.vm, "cannot tell which VirtualDisk each device of the running QEMU holds; snapshots of it wait for a restart")
                            }
                            Err(e) => {
                                tracing::warn!(vm = %r.vm, error = %e, "cannot read the layers")
                            }
                        }
                    }
                    engine.ctx.ensure_live(&r).await;
                    engine.ctx.event(
                        Kind::VirtualMachine,
                        &r.vm,
                        EventType::Normal,
                        "Adopted",
                        &format!(
                            "hearthd restarted; adopted running QEMU pid {}",
                            r.process.pid
                        ),
                    );
                }
            }
        }
        // Launches a crashed daemon spawned but never recorded: their QEMUs
        // are found from the process table and adopted or stopped, before
        // any reconcile could start a second one.
        for r in crate::vm::launches::settle_all(&engine.ctx).await {
            engine.ctx.ensure_live(&r).await;
        }
        // Disk preparations a crash cut short: their storage daemons and
        // FUSE mounts go first, so no layer file is held open for the sweep.
        crate::disk::prepare::sweep(&engine.ctx.config.state_dir);
        crate::backup::copy::sweep(&engine.ctx.config.state_dir);
        match crate::snapshot::storage::sweep_orphans(
            &engine.ctx.store,
            &engine.ctx.config.state_dir,
        ) {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(
                    count = removed.len(),
                    "removed layer files a crash left behind"
                )
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot sweep orphan layer files"),
        }
        // Conversions a crash cut short (docs/snapshots.md "Export").
        let n = crate::snapshot::export::sweep(&engine.ctx.config.state_dir);
        if n > 0 {
            tracing::info!(count = n, "removed export files a crash left behind");
        }
        // Before any import starts: temporaries of cut-short imports, and
        // image files nothing refers to.
        match crate::image::sweep(&engine.ctx.store, &engine.ctx.config.images_dir()) {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(count = removed.len(), "removed image files no image needs")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot sweep the image store"),
        }
        // Before any VM starts: bridges, taps, dnsmasqs and the table as the
        // store says, and nothing a crash left behind.
        crate::network::sync::startup(&engine.ctx).await;
        engine.wake_all();
        // Guests a crashed daemon left frozen are thawed right away.
        engine.ctx.snapshots.resume_all(&engine.ctx);
        let weak = Arc::downgrade(&engine);
        let interval = engine.ctx.config.resync_interval;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                let Some(engine) = weak.upgrade() else { return };
                engine.wake_all();
            }
        });
        Ok(engine)
    }

    // ------------------------------------------------------------ accessors

    /// What the reconcilers see; for the engine's own subsystems.
    pub(crate) fn ctx(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub fn config(&self) -> &EngineConfig {
        &self.ctx.config
    }

    pub fn metrics(&self) -> &crate::metrics::EngineMetrics {
        &self.ctx.metrics
    }

    /// What `/metrics` shows of the VMs, disks and host as they are now.
    pub async fn sample_metrics(&self) -> crate::metrics::Sample {
        crate::metrics::sample(&self.ctx).await
    }

    /// One object as the store holds it now, `None` when there is none.
    pub fn find(&self, kind: Kind, name: &str) -> Result<Option<StoredObject>, StoreError> {
        self.ctx.store.get(kind, name)
    }

    /// The change stream from `options`' position (docs/http-api.md "Watch").
    pub fn watch(
        &self,
        filter: crate::watch::Filter,
        options: crate::watch::Options,
    ) -> Result<crate::watch::Watch, StoreError> {
        crate::watch::Watch::start(&self.ctx.store, filter, options)
    }

    /// The pin an export of `snapshot` holds while it reads the layers
    /// (`snapshot::export`): held for writing, it keeps exports waiting.
    pub fn export_pin(&self, snapshot: &str) -> Arc<tokio::sync::RwLock<()>> {
        self.ctx.exports.of(snapshot)
    }

    // ------------------------------------------------------------ queries

    // The API's reads use the store's reading connection: they never wait
    // for a reconciler's write.

    pub fn get(&self, kind: Kind, name: &str) -> Result<StoredObject, RequestError> {
        self.ctx
            .store
            .reader()
            .get(kind, name)?
            .ok_or_else(|| RequestError::not_found(kind, name))
    }

    pub fn list(&self, kind: Kind) -> Result<Vec<StoredObject>, RequestError> {
        Ok(self.ctx.store.reader().list(kind)?)
    }

    pub fn events(
        &self,
        kind: Option<Kind>,
        name: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Event>, RequestError> {
        Ok(self.ctx.store.reader().events(kind, name, limit)?)
    }

    /// The console log of a VM that exists.
    pub fn console_path(&self, name: &str) -> Result<std::path::PathBuf, RequestError> {
        self.get(Kind::VirtualMachine, name)?;
        Ok(self.ctx.config.serial_log(name))
    }

    /// The console log of a VM's previous start (its QEMU is gone), if the
    /// VM exists; the file is there once the VM has started twice.
    pub fn previous_console_path(&self, name: &str) -> Result<std::path::PathBuf, RequestError> {
        self.get(Kind::VirtualMachine, name)?;
        Ok(self.ctx.config.serial_log_previous(name))
    }

    /// The serial console socket of a VM that exists (QEMU serves it while
    /// the VM runs).
    pub fn console_socket(&self, name: &str) -> Result<std::path::PathBuf, RequestError> {
        self.get(Kind::VirtualMachine, name)?;
        Ok(self.ctx.config.serial_socket(name))
    }

    // ------------------------------------------------------------ work queue

    /// Asks for a reconcile of one object. Level-triggered: a hint, not a
    /// command; many wakes while a reconcile runs collapse into one rerun.
    pub fn wake(self: &Arc<Self>, kind: Kind, name: &str) {
        let key = (kind, name.to_string());
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(dirty) = q.get_mut(&key) {
            *dirty = true;
            return;
        }
        q.insert(key.clone(), false);
        drop(q);
        let engine = self.clone();
        tokio::spawn(async move { engine.worker(key).await });
    }

    /// The resync: every object is woken, except the disks, which are
    /// looked at in one pass that wakes only those it finds out of date
    /// (`disk::resync`, docs/reconciler.md "Disks").
    pub fn wake_all(self: &Arc<Self>) {
        for kind in Kind::ALL {
            if kind == Kind::VirtualDisk {
                match crate::disk::resync(&self.ctx) {
                    Ok(names) => {
                        for n in names {
                            self.wake(kind, &n);
                        }
                        continue;
                    }
                    // Each disk then looks for itself.
                    Err(e) => tracing::warn!(error = %e, "cannot resync the disks in one pass"),
                }
            }
            if let Ok(objs) = self.ctx.store.list(kind) {
                for o in objs {
                    self.wake(kind, o.object.name());
                }
            }
        }
    }

    async fn worker(self: Arc<Self>, key: Key) {
        loop {
            self.runner.run(&self.ctx, &key).await;
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            match q.get_mut(&key) {
                Some(dirty) if *dirty => *dirty = false,
                _ => {
                    q.remove(&key);
                    return;
                }
            }
        }
    }

    pub fn status_json(&self, stored: &StoredObject) -> Value {
        stored.to_json()
    }
}
