//! The histograms and counters the engine observes as things happen
//! (reconciles, freeze windows, forced stops), for the daemon's life. Plain
//! data the reconcilers write to; a scrape reads it in `metrics`.

use std::collections::BTreeMap;
use std::time::Duration;

use hearth_api::Kind;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

impl KindLabel {
    fn of(kind: Kind) -> KindLabel {
        KindLabel {
            kind: kind.as_str().to_string(),
        }
    }
}

type Histograms = Family<KindLabel, Histogram, fn() -> Histogram>;

fn reconcile_buckets() -> Histogram {
    // 1 ms .. ~65 s: a reconcile that only reads is fast, a VM start under
    // TCG or an image import is not.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.001, 2.0, 17,
    ))
}

fn freeze_buckets() -> Histogram {
    // The freeze window is bounded by the freeze deadline (3..300 s, 10 by
    // default); a healthy one is tens of milliseconds.
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
    ])
}

fn ready_buckets() -> Histogram {
    // From the request to Ready: the cut waits for the VM's operations lock
    // and for earlier cuts.
    Histogram::new([
        0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    ])
}

/// The histograms and counters of things that happen, for the daemon's life.
pub struct EngineMetrics {
    reconcile_duration: Histograms,
    reconcile_errors: Family<KindLabel, Counter>,
    freeze_window: Histograms,
    request_to_ready: Histograms,
    /// Stops that had to quit or kill QEMU, by VM. Written per VM that
    /// exists at scrape time (0 for one never forced), so each VM has its
    /// series from its creation and loses it with its deletion.
    forced_stops: std::sync::Mutex<BTreeMap<String, u64>>,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        let m = EngineMetrics {
            reconcile_duration: Family::new_with_constructor(reconcile_buckets),
            reconcile_errors: Family::default(),
            freeze_window: Family::new_with_constructor(freeze_buckets),
            request_to_ready: Family::new_with_constructor(ready_buckets),
            forced_stops: Default::default(),
        };
        // Every series exists from the start, at zero: a rate over a series
        // that appears only at its first event misses that event.
        for kind in Kind::ALL {
            let _ = m.reconcile_duration.get_or_create(&KindLabel::of(kind));
            let _ = m.reconcile_errors.get_or_create(&KindLabel::of(kind));
        }
        for kind in [
            Kind::VirtualDiskSnapshot,
            Kind::VirtualMachineSnapshot,
            Kind::VirtualMachineSnapshotGroup,
        ] {
            let _ = m.freeze_window.get_or_create(&KindLabel::of(kind));
            let _ = m.request_to_ready.get_or_create(&KindLabel::of(kind));
        }
        m
    }
}

impl EngineMetrics {
    /// One reconcile of one object ran for `took`; `failed` if it returned an
    /// error (it is then retried with backoff).
    pub fn reconcile_done(&self, kind: Kind, took: Duration, failed: bool) {
        self.reconcile_duration
            .get_or_create(&KindLabel::of(kind))
            .observe(took.as_secs_f64());
        if failed {
            self.reconcile_errors
                .get_or_create(&KindLabel::of(kind))
                .inc();
        }
    }

    /// A snapshot's cut recorded a freeze window (Ready or Failed).
    pub fn freeze_window(&self, kind: Kind, window_ms: u64) {
        self.freeze_window
            .get_or_create(&KindLabel::of(kind))
            .observe(window_ms as f64 / 1000.0);
    }

    /// A snapshot became Ready `took` after it was created.
    pub fn snapshot_ready(&self, kind: Kind, took: Duration) {
        self.request_to_ready
            .get_or_create(&KindLabel::of(kind))
            .observe(took.as_secs_f64());
    }

    /// A stop of `vm` ran out of its grace period and stopped QEMU without
    /// the guest.
    pub fn forced_stop(&self, vm: &str) {
        *self.forced_stops_map().entry(vm.to_string()).or_insert(0) += 1;
    }

    /// How many stops of `vm` were forced since hearthd started.
    pub fn forced_stops_of(&self, vm: &str) -> u64 {
        self.forced_stops_map().get(vm).copied().unwrap_or(0)
    }

    /// `vm` is deleted: its count goes with it (a new VM of that name starts
    /// from zero, which a scraper sees as a counter reset).
    pub fn forget_vm(&self, vm: &str) {
        self.forced_stops_map().remove(vm);
    }

    fn forced_stops_map(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, u64>> {
        self.forced_stops.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds these metrics (shared, not copied) to a scrape's registry.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "reconcile_duration_seconds",
            "Time one reconcile of one object took, by kind",
            self.reconcile_duration.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Reconciles that returned an error (retried with backoff), by kind",
            self.reconcile_errors.clone(),
        );
        registry.register(
            "snapshot_freeze_window_seconds",
            "Host-side time from the freeze request to the thaw reply of the cut that took a snapshot, observed when the snapshot's cut was recorded",
            self.freeze_window.clone(),
        );
        registry.register(
            "snapshot_ready_seconds",
            "Time from a snapshot's creation to its Ready phase",
            self.request_to_ready.clone(),
        );
    }
}
