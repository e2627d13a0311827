//! What `GET /metrics` reports (docs/metrics.md).
//!
//! Two sources, on purpose:
//! - Things that happen (a reconcile ran, a snapshot became Ready) are
//!   observed when they happen, into histograms and counters that live as long
//!   as the daemon ([`EngineMetrics`]): a count of events cannot be read back
//!   later from the store.
//! - Things that are (a VM's phase, its QEMU's CPU time and memory, its block
//!   devices' counters, how many snapshots are in each phase) are read at
//!   scrape time from the store, `/proc` and QMP ([`sample`]), never cached:
//!   the answer is what the kernel and QEMU say now.

use std::collections::BTreeMap;
use std::time::Duration;

use hearth_api::{Kind, Object, SnapshotPhase, SnapshotStatus, VirtualMachineStatus, VmPhase};
use hearth_qemu::stats::{BlockDeviceStats, ProcessStats};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

pub mod registry;

use crate::context::Context;
use crate::manifest::counters::{ManifestCounters, Reason};
pub use registry::EngineMetrics;

/// How long one scrape waits for one VM's QMP answers.
const QMP_TIMEOUT: Duration = Duration::from_secs(2);

/// Every metric name starts with this.
pub const PREFIX: &str = "hearth";

/// A snapshot's result was just recorded: observes its cut's freeze window
/// (when the guest was frozen for it) and, when it is Ready, the time since
/// it was created. Called once per result, right after the store has it.
pub fn snapshot_settled(
    ctx: &Context,
    kind: Kind,
    name: &str,
    ready: bool,
    freeze_window_ms: Option<u64>,
) {
    if let Some(ms) = freeze_window_ms {
        ctx.metrics.freeze_window(kind, ms);
    }
    if !ready {
        return;
    }
    let created = match ctx.store.get(kind, name) {
        Ok(Some(stored)) => stored.object.metadata().creation_timestamp,
        _ => None,
    };
    if let Some(took) = created.and_then(|c| (chrono::Utc::now() - c).to_std().ok()) {
        ctx.metrics.snapshot_ready(kind, took);
    }
}

// ------------------------------------------------------------ scrape time

/// What one scrape read: the store's VMs and snapshots, and for each running
/// VM what `/proc` and QMP say about its QEMU now.
#[derive(Debug, Default)]
pub struct Sample {
    vms: Vec<VmSample>,
    snapshots: BTreeMap<(Kind, PhaseName), u64>,
    /// Per VM, its newest Ready backup.
    backups: BTreeMap<String, BackupSample>,
}

#[derive(Debug, Default)]
struct BackupSample {
    cut_unix: f64,
    bytes_read: u64,
    bytes_written: u64,
    duration_seconds: f64,
}

type PhaseName = &'static str;

#[derive(Debug)]
struct VmSample {
    name: String,
    phase: VmPhase,
    agent_connected: bool,
    /// Stops of this VM that were forced since hearthd started.
    forced_stops: u64,
    process: Option<ProcessStats>,
    /// (vCPU index, CPU seconds of its thread).
    vcpus: Vec<(u32, f64)>,
    /// (VirtualDisk, device id, counters).
    disks: Vec<(String, String, BlockDeviceStats)>,
}

const VM_PHASES: [VmPhase; 6] = [
    VmPhase::Pending,
    VmPhase::Starting,
    VmPhase::Running,
    VmPhase::Stopping,
    VmPhase::Stopped,
    VmPhase::Failed,
];

const SNAPSHOT_PHASES: [SnapshotPhase; 5] = [
    SnapshotPhase::Pending,
    SnapshotPhase::InProgress,
    SnapshotPhase::Ready,
    SnapshotPhase::Failed,
    SnapshotPhase::Terminating,
];

fn snapshot_phase_name(p: SnapshotPhase) -> PhaseName {
    match p {
        SnapshotPhase::Pending => "Pending",
        SnapshotPhase::InProgress => "InProgress",
        SnapshotPhase::Ready => "Ready",
        SnapshotPhase::Failed => "Failed",
        SnapshotPhase::Terminating => "Terminating",
    }
}

fn vm_phase_name(p: VmPhase) -> PhaseName {
    match p {
        VmPhase::Pending => "Pending",
        VmPhase::Starting => "Starting",
        VmPhase::Running => "Running",
        VmPhase::Stopping => "Stopping",
        VmPhase::Stopped => "Stopped",
        VmPhase::Failed => "Failed",
    }
}

/// Reads everything a scrape reports now. A VM whose QEMU does not answer
/// QMP in time still has its phase, agent and `/proc` figures; its vCPU and
/// disk series are left out of this scrape (absent, not zero).
pub async fn sample(ctx: &Context) -> Sample {
    let mut out = Sample::default();
    for kind in [
        Kind::VirtualDiskSnapshot,
        Kind::VirtualMachineSnapshot,
        Kind::VirtualMachineSnapshotGroup,
    ] {
        for phase in SNAPSHOT_PHASES {
            out.snapshots.insert((kind, snapshot_phase_name(phase)), 0);
        }
        match ctx.store.list(kind) {
            Ok(objects) => {
                for o in objects {
                    let status: SnapshotStatus =
                        serde_json::from_value(o.status.clone()).unwrap_or_default();
                    // A snapshot being deleted is Terminating whatever its
                    // status last said.
                    let phase = if o.deleting {
                        SnapshotPhase::Terminating
                    } else {
                        status.phase
                    };
                    *out.snapshots
                        .entry((kind, snapshot_phase_name(phase)))
                        .or_insert(0) += 1;
                }
            }
            Err(e) => tracing::warn!(error = %e, "metrics: cannot list {kind}s"),
        }
    }
    match ctx.store.list(Kind::VirtualMachineBackup) {
        Ok(objects) => {
            for o in objects {
                let Object::VirtualMachineBackup(b) = &o.object else {
                    continue;
                };
                let st: hearth_api::BackupStatus =
                    serde_json::from_value(o.status.clone()).unwrap_or_default();
                let Some(cut) = st
                    .cut_time
                    .filter(|_| st.phase == hearth_api::BackupPhase::Ready)
                else {
                    continue;
                };
                let cut_unix = cut.timestamp_millis() as f64 / 1000.0;
                let entry = out
                    .backups
                    .entry(b.spec.virtual_machine_name.clone())
                    .or_default();
                if cut_unix >= entry.cut_unix {
                    *entry = BackupSample {
                        cut_unix,
                        bytes_read: st.bytes_read.unwrap_or(0),
                        bytes_written: st.bytes_written.unwrap_or(0),
                        duration_seconds: st.duration_ms.unwrap_or(0) as f64 / 1000.0,
                    };
                }
            }
        }
        Err(e) => tracing::warn!(error = %e, "metrics: cannot list backups"),
    }
    let vms = match ctx.store.list(Kind::VirtualMachine) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(error = %e, "metrics: cannot list VirtualMachines");
            Vec::new()
        }
    };
    let reads = vms.into_iter().filter_map(|stored| {
        let Object::VirtualMachine(vm) = &stored.object else {
            return None;
        };
        let name = vm.metadata.name.clone();
        let status: VirtualMachineStatus =
            serde_json::from_value(stored.status.clone()).unwrap_or_default();
        Some(sample_vm(ctx, name, status))
    });
    out.vms = futures_util::future::join_all(reads).await;
    out
}

async fn sample_vm(ctx: &Context, name: String, status: VirtualMachineStatus) -> VmSample {
    let mut s = VmSample {
        agent_connected: ctx.live_agent_connected(&name),
        forced_stops: ctx.metrics.forced_stops_of(&name),
        name,
        phase: status.phase,
        process: None,
        vcpus: Vec::new(),
        disks: Vec::new(),
    };
    let Some(live) = ctx.live_get(&s.name) else {
        return s;
    };
    let id = live.record.process.clone();
    s.process = hearth_qemu::stats::process_stats(&id);
    if s.process.is_none() {
        // Not running any more: nothing more to read.
        return s;
    }
    let Some(qmp) = live.qmp.as_ref() else {
        return s;
    };
    match hearth_qemu::stats::vcpu_threads(qmp, QMP_TIMEOUT).await {
        Ok(threads) => {
            s.vcpus = threads
                .iter()
                .filter_map(|t| {
                    hearth_qemu::stats::thread_cpu_seconds(&id, t.thread_id)
                        .map(|secs| (t.index, secs))
                })
                .collect();
        }
        Err(e) => tracing::debug!(vm = s.name, error = %e, "metrics: query-cpus-fast"),
    }
    match hearth_qemu::stats::block_stats(qmp, QMP_TIMEOUT).await {
        Ok(devices) => {
            for d in devices {
                // The disks this QEMU was started with, in device order.
                if let Some(disk) = d
                    .disk_index()
                    .and_then(|i| live.record.disk_names.get(i))
                    .cloned()
                {
                    let device = d.disk_index().map(hearth_qemu::cmdline::disk_device_id);
                    s.disks.push((disk, device.unwrap_or_default(), d));
                }
            }
        }
        Err(e) => tracing::debug!(vm = s.name, error = %e, "metrics: query-blockstats"),
    }
    s
}

/// Writes one family of constant values under one descriptor.
fn family<M: EncodeMetric, L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric_type: MetricType,
    series: impl IntoIterator<Item = (L, M)>,
) -> Result<(), std::fmt::Error> {
    // As the registry writes its own metrics' help: a sentence.
    let help = format!("{help}.");
    let mut metric = encoder.encode_descriptor(name, &help, None, metric_type)?;
    for (labels, value) in series {
        value.encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

fn vm_label(vm: &VmSample) -> [(&'static str, String); 1] {
    [("vm", vm.name.clone())]
}

impl Collector for Sample {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let e = &mut encoder;
        family(
            e,
            "vm_phase",
            "1 for the VM's current phase (status.phase), 0 for the others",
            MetricType::Gauge,
            self.vms.iter().flat_map(|vm| {
                VM_PHASES.into_iter().map(move |p| {
                    (
                        [("vm", vm.name.clone()), ("phase", vm_phase_name(p).into())],
                        ConstGauge::new(i64::from(vm.phase == p)),
                    )
                })
            }),
        )?;
        family(
            e,
            "vm_agent_connected",
            "1 while hearthd holds a working connection to the VM's guest agent",
            MetricType::Gauge,
            self.vms
                .iter()
                .map(|vm| (vm_label(vm), ConstGauge::new(i64::from(vm.agent_connected)))),
        )?;
        family(
            e,
            "vm_forced_stops",
            "Stops of the VM whose guest did not power off within spec.stopTimeoutSeconds, so that QEMU was made to quit (an unclean shutdown for the guest), since hearthd started",
            MetricType::Counter,
            self.vms
                .iter()
                .map(|vm| (vm_label(vm), ConstCounter::new(vm.forced_stops))),
        )?;
        family(
            e,
            "vm_cpu_seconds",
            "User and system CPU time of the VM's QEMU process, all threads (from /proc/PID/stat)",
            MetricType::Counter,
            self.vms.iter().filter_map(|vm| {
                let p = vm.process.as_ref()?;
                Some((vm_label(vm), ConstCounter::new(p.cpu_seconds)))
            }),
        )?;
        family(
            e,
            "vm_vcpu_seconds",
            "CPU time of each vCPU thread of the VM's QEMU (query-cpus-fast thread ids, /proc/PID/task/TID/stat)",
            MetricType::Counter,
            self.vms.iter().flat_map(|vm| {
                vm.vcpus.iter().map(move |(index, secs)| {
                    (
                        [("vm", vm.name.clone()), ("vcpu", index.to_string())],
                        ConstCounter::new(*secs),
                    )
                })
            }),
        )?;
        family(
            e,
            "vm_memory_rss_bytes",
            "Resident memory of the VM's QEMU process (VmRSS of /proc/PID/status)",
            MetricType::Gauge,
            self.vms.iter().filter_map(|vm| {
                let p = vm.process.as_ref()?;
                Some((
                    vm_label(vm),
                    ConstGauge::new(i64::try_from(p.rss_bytes).unwrap_or(i64::MAX)),
                ))
            }),
        )?;
        type Pick = fn(&BlockDeviceStats) -> u64;
        let disk_counters: [(&str, &str, Pick); 5] = [
            (
                "vm_disk_read_bytes",
                "Bytes the guest read from the disk (query-blockstats rd_bytes)",
                |d| d.read_bytes,
            ),
            (
                "vm_disk_write_bytes",
                "Bytes the guest wrote to the disk (query-blockstats wr_bytes)",
                |d| d.write_bytes,
            ),
            (
                "vm_disk_read_ops",
                "Read requests the guest made to the disk (query-blockstats rd_operations)",
                |d| d.read_ops,
            ),
            (
                "vm_disk_write_ops",
                "Write requests the guest made to the disk (query-blockstats wr_operations)",
                |d| d.write_ops,
            ),
            (
                "vm_disk_flush_ops",
                "Flush requests the guest made to the disk (query-blockstats flush_operations)",
                |d| d.flush_ops,
            ),
        ];
        for (name, help, pick) in disk_counters {
            family(
                e,
                name,
                help,
                MetricType::Counter,
                self.vms.iter().flat_map(|vm| {
                    vm.disks.iter().map(move |(disk, device, stats)| {
                        (
                            [
                                ("vm", vm.name.clone()),
                                ("disk", disk.clone()),
                                ("device", device.clone()),
                            ],
                            ConstCounter::new(pick(stats)),
                        )
                    })
                }),
            )?;
        }
        type PickBackup = fn(&BackupSample) -> f64;
        let backup_gauges: [(&str, &str, PickBackup); 4] = [
            (
                "backup_last_success_timestamp_seconds",
                "Cut time of the VM's newest Ready VirtualMachineBackup (Unix seconds)",
                |b| b.cut_unix,
            ),
            (
                "backup_last_bytes_read",
                "Bytes the VM's newest Ready backup read from its checkpoint's layers",
                |b| b.bytes_read as f64,
            ),
            (
                "backup_last_bytes_written",
                "Bytes of the files the VM's newest Ready backup wrote into its target",
                |b| b.bytes_written as f64,
            ),
            (
                "backup_last_duration_seconds",
                "How long the VM's newest Ready backup took from its cut to its commit",
                |b| b.duration_seconds,
            ),
        ];
        for (name, help, pick) in backup_gauges {
            family(
                e,
                name,
                help,
                MetricType::Gauge,
                self.backups
                    .iter()
                    .map(move |(vm, b)| ([("vm", vm.clone())], ConstGauge::new(pick(b)))),
            )?;
        }
        family(
            e,
            "snapshots",
            "Snapshots in each phase, by kind (a snapshot being deleted counts as Terminating)",
            MetricType::Gauge,
            self.snapshots.iter().map(|((kind, phase), n)| {
                (
                    [
                        ("kind", kind.as_str().to_string()),
                        ("phase", phase.to_string()),
                    ],
                    ConstGauge::new(i64::try_from(*n).unwrap_or(i64::MAX)),
                )
            }),
        )?;
        Ok(())
    }
}

/// The manifest directory's counters as metrics.
#[derive(Debug)]
pub struct ManifestMetrics(pub ManifestCounters);

impl Collector for ManifestMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        family(
            &mut encoder,
            "manifest_relists",
            "Full re-lists of the manifest directory, by what triggered them",
            MetricType::Counter,
            Reason::ALL.into_iter().map(|r| {
                (
                    [("reason", r.as_str())],
                    ConstCounter::new(self.0.relists.get(&r).copied().unwrap_or(0)),
                )
            }),
        )?;
        let counter = ConstCounter::new(self.0.parse_errors);
        let metric = encoder.encode_descriptor(
            "manifest_parse_errors",
            "New contents of manifest files that did not parse (each bad version of a file counts once; the last good state is kept).",
            None,
            counter.metric_type(),
        )?;
        counter.encode(metric)
    }
}

/// The text of one scrape, in the Prometheus text format (0.0.4) or, with
/// `openmetrics`, OpenMetrics 1.0.
pub fn encode(registry: &Registry, openmetrics: bool) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    if openmetrics {
        prometheus_client::encoding::text::encode(&mut out, registry)?;
    } else {
        prometheus_client::encoding::prometheus_text::encode(&mut out, registry)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(sample: Sample, engine: &EngineMetrics, manifest: ManifestCounters) -> String {
        let mut r = Registry::with_prefix(PREFIX);
        engine.register(&mut r);
        r.register_collector(Box::new(sample));
        r.register_collector(Box::new(ManifestMetrics(manifest)));
        encode(&r, false).expect("encode")
    }

    fn line_value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find(|l| l.split_once(' ').is_some_and(|(s, _)| s == series))
            .and_then(|l| l.rsplit_once(' '))
            .and_then(|(_, v)| v.parse().ok())
    }

    #[test]
    fn a_sample_is_written_with_one_series_per_phase_and_device() {
        let sample = Sample {
            vms: vec![VmSample {
                name: "web".into(),
                phase: VmPhase::Running,
                agent_connected: true,
                forced_stops: 2,
                process: Some(ProcessStats {
                    cpu_seconds: 12.5,
                    rss_bytes: 300 << 20,
                }),
                vcpus: vec![(0, 10.25), (1, 1.5)],
                disks: vec![(
                    "web-root".into(),
                    "vdisk0".into(),
                    BlockDeviceStats {
                        qdev: "/machine/peripheral/vdisk0/virtio-backend".into(),
                        read_bytes: 4096,
                        write_bytes: 1 << 22,
                        read_ops: 1,
                        write_ops: 32,
                        flush_ops: 2,
                    },
                )],
            }],
            snapshots: [((Kind::VirtualDiskSnapshot, "Ready"), 2)]
                .into_iter()
                .collect(),
            backups: [(
                "web".to_string(),
                BackupSample {
                    cut_unix: 1_800_000_000.5,
                    bytes_read: 1 << 20,
                    bytes_written: 3 << 20,
                    duration_seconds: 1.25,
                },
            )]
            .into_iter()
            .collect(),
        };
        let engine = EngineMetrics::default();
        engine.reconcile_done(Kind::VirtualMachine, Duration::from_millis(30), false);
        engine.reconcile_done(Kind::VirtualMachine, Duration::from_millis(3), true);
        engine.freeze_window(Kind::VirtualDiskSnapshot, 40);
        engine.snapshot_ready(Kind::VirtualDiskSnapshot, Duration::from_secs(2));
        let mut manifest = ManifestCounters::default();
        manifest.relists.insert(Reason::Start, 1);
        manifest.parse_errors = 3;
        let t = text(sample, &engine, manifest);

        let v = |s: &str| line_value(&t, s).unwrap_or_else(|| panic!("{s} missing in:\n{t}"));
        assert_eq!(v(r#"hearth_vm_phase{vm="web",phase="Running"}"#), 1.0);
        assert_eq!(v(r#"hearth_vm_phase{vm="web",phase="Stopped"}"#), 0.0);
        assert_eq!(v(r#"hearth_vm_agent_connected{vm="web"}"#), 1.0);
        assert_eq!(v(r#"hearth_vm_forced_stops_total{vm="web"}"#), 2.0);
        assert_eq!(v(r#"hearth_vm_cpu_seconds_total{vm="web"}"#), 12.5);
        assert_eq!(v(r#"hearth_vm_vcpu_seconds_total{vm="web",vcpu="1"}"#), 1.5);
        assert_eq!(
            v(r#"hearth_vm_memory_rss_bytes{vm="web"}"#),
            (300 << 20) as f64
        );
        assert_eq!(
            v(r#"hearth_vm_disk_write_bytes_total{vm="web",disk="web-root",device="vdisk0"}"#),
            (1 << 22) as f64
        );
        assert_eq!(
            v(r#"hearth_vm_disk_flush_ops_total{vm="web",disk="web-root",device="vdisk0"}"#),
            2.0
        );
        assert_eq!(
            v(r#"hearth_snapshots{kind="VirtualDiskSnapshot",phase="Ready"}"#),
            2.0
        );
        assert_eq!(
            v(r#"hearth_backup_last_success_timestamp_seconds{vm="web"}"#),
            1_800_000_000.5
        );
        assert_eq!(
            v(r#"hearth_backup_last_bytes_written{vm="web"}"#),
            (3 << 20) as f64
        );
        assert_eq!(v(r#"hearth_backup_last_duration_seconds{vm="web"}"#), 1.25);
        assert_eq!(
            v(r#"hearth_reconcile_errors_total{kind="VirtualMachine"}"#),
            1.0
        );
        assert_eq!(
            v(r#"hearth_reconcile_errors_total{kind="VirtualDisk"}"#),
            0.0,
            "every kind's series exists from the start"
        );
        assert_eq!(
            v(r#"hearth_reconcile_duration_seconds_count{kind="VirtualMachine"}"#),
            2.0
        );
        assert_eq!(
            v(
                r#"hearth_snapshot_freeze_window_seconds_bucket{kind="VirtualDiskSnapshot",le="0.05"}"#
            ),
            1.0
        );
        assert_eq!(
            v(
                r#"hearth_snapshot_freeze_window_seconds_bucket{kind="VirtualDiskSnapshot",le="0.025"}"#
            ),
            0.0
        );
        assert_eq!(
            v(r#"hearth_snapshot_ready_seconds_sum{kind="VirtualDiskSnapshot"}"#),
            2.0
        );
        assert_eq!(v(r#"hearth_manifest_relists_total{reason="start"}"#), 1.0);
        assert_eq!(
            v(r#"hearth_manifest_relists_total{reason="watchLost"}"#),
            0.0
        );
        assert_eq!(v("hearth_manifest_parse_errors_total"), 3.0);
    }

    #[test]
    fn forced_stops_are_counted_per_vm_and_forgotten_with_it() {
        let engine = EngineMetrics::default();
        assert_eq!(engine.forced_stops_of("web"), 0);
        engine.forced_stop("web");
        engine.forced_stop("web");
        engine.forced_stop("db");
        assert_eq!(engine.forced_stops_of("web"), 2);
        assert_eq!(engine.forced_stops_of("db"), 1);
        engine.forget_vm("web");
        assert_eq!(engine.forced_stops_of("web"), 0);
        assert_eq!(engine.forced_stops_of("db"), 1);
    }

    #[test]
    fn openmetrics_is_offered_too() {
        let engine = EngineMetrics::default();
        let mut r = Registry::with_prefix(PREFIX);
        engine.register(&mut r);
        let t = encode(&r, true).expect("encode");
        assert!(t.ends_with("# EOF\n"), "{t}");
        let t = encode(&r, false).expect("encode");
        assert!(!t.contains("# EOF"), "{t}");
    }
}
