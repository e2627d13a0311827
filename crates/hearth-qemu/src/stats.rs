//! What a running QEMU uses, read when a metrics scrape asks: CPU time and
//! resident memory from `/proc`, the vCPU threads (`query-cpus-fast`) and the
//! block devices' counters (`query-blockstats`) from QMP. Nothing is cached:
//! each call reads the kernel's and QEMU's own counters.
//!
//! A pid names our process only together with its start time (see
//! [`ProcessIdentity`]): every read checks it, so a recycled pid is never
//! reported as the VM.

use std::time::Duration;

use serde_json::Value;

use crate::process::{ProcessIdentity, clock_ticks_per_second};
use crate::qmp::{QmpClient, QmpError};

/// CPU time and memory of one QEMU process.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessStats {
    /// User plus system time of every thread, seconds.
    pub cpu_seconds: f64,
    /// Resident set size (`VmRSS` of `/proc/PID/status`), bytes.
    pub rss_bytes: u64,
}

/// The fields of `/proc/PID/stat` (or `/proc/PID/task/TID/stat`) used here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CpuStat {
    state: char,
    /// Fields 14 and 15, clock ticks.
    utime: u64,
    stime: u64,
    /// Field 22, clock ticks after boot.
    start_ticks: u64,
}

fn parse_cpu_stat(text: &str) -> Option<CpuStat> {
    // The command name (field 2) is in parentheses and may contain ") ".
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3.
    Some(CpuStat {
        state: fields.first()?.chars().next()?,
        utime: fields.get(11)?.parse().ok()?,
        stime: fields.get(12)?.parse().ok()?,
        start_ticks: fields.get(19)?.parse().ok()?,
    })
}

/// `VmRSS:    123456 kB` from `/proc/PID/status`, in bytes.
fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut parts = line["VmRSS:".len()..].split_whitespace();
    let value: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") => value.checked_mul(1024),
        _ => None,
    }
}

fn read_cpu_stat(path: &str) -> Option<CpuStat> {
    parse_cpu_stat(&std::fs::read_to_string(path).ok()?)
}

fn ticks_to_seconds(ticks: u64) -> f64 {
    ticks as f64 / clock_ticks_per_second() as f64
}

/// The process's CPU time and resident memory, or `None` when `id` no longer
/// runs (gone, a zombie, or its pid now belongs to another process).
pub fn process_stats(id: &ProcessIdentity) -> Option<ProcessStats> {
    if id.pid == 0 {
        return None;
    }
    let stat = read_cpu_stat(&format!("/proc/{}/stat", id.pid))?;
    if stat.start_ticks != id.start_ticks || matches!(stat.state, 'Z' | 'X') {
        return None;
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", id.pid)).ok()?;
    let rss_bytes = parse_vm_rss(&status)?;
    // Read again: the pid could have been reused between the two reads.
    let again = read_cpu_stat(&format!("/proc/{}/stat", id.pid))?;
    if again.start_ticks != id.start_ticks {
        return None;
    }
    Some(ProcessStats {
        cpu_seconds: ticks_to_seconds(stat.utime + stat.stime),
        rss_bytes,
    })
}

/// CPU time of one thread of `id`, seconds; `None` when either is gone.
pub fn thread_cpu_seconds(id: &ProcessIdentity, tid: u32) -> Option<f64> {
    if id.pid == 0 || tid == 0 {
        return None;
    }
    let stat = read_cpu_stat(&format!("/proc/{}/task/{tid}/stat", id.pid))?;
    let owner = read_cpu_stat(&format!("/proc/{}/stat", id.pid))?;
    if owner.start_ticks != id.start_ticks {
        return None;
    }
    Some(ticks_to_seconds(stat.utime + stat.stime))
}

/// One vCPU and the host thread that runs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VcpuThread {
    pub index: u32,
    pub thread_id: u32,
}

/// The answer of `query-cpus-fast`. Entries without a usable index or thread
/// id are left out (QEMU always gives both; a reply is untrusted input).
pub fn parse_cpus_fast(reply: &Value) -> Vec<VcpuThread> {
    reply
        .as_array()
        .map(|cpus| {
            cpus.iter()
                .filter_map(|c| {
                    Some(VcpuThread {
                        index: u32::try_from(c.get("cpu-index")?.as_u64()?).ok()?,
                        thread_id: u32::try_from(c.get("thread-id")?.as_u64()?).ok()?,
                    })
                })
                .collect()
        })
        .unwrap_or_default()
}

pub async fn vcpu_threads(qmp: &QmpClient, timeout: Duration) -> Result<Vec<VcpuThread>, QmpError> {
    Ok(parse_cpus_fast(
        &qmp.execute("query-cpus-fast", None, timeout).await?,
    ))
}

/// The counters of one block device, as `query-blockstats` gives them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockDeviceStats {
    /// The guest device's qdev id or path (`vdisk0`,
    /// `/machine/peripheral/vdisk0/virtio-backend`).
    pub qdev: String,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_ops: u64,
    pub write_ops: u64,
    pub flush_ops: u64,
}

impl BlockDeviceStats {
    /// The disk number (in the VM's disk order) of a device hearth attached
    /// as [`crate::cmdline::disk_device_id`]; `None` for other devices (the
    /// cloud-init seed, firmware flash).
    pub fn disk_index(&self) -> Option<usize> {
        self.qdev.split('/').find_map(|segment| {
            let n: usize = segment.strip_prefix("vdisk")?.parse().ok()?;
            (crate::cmdline::disk_device_id(n) == segment).then_some(n)
        })
    }
}

/// The answer of `query-blockstats`: one entry per block backend attached to
/// a guest device. Backends with no device (`qdev` empty or missing) are left
/// out, and so are entries whose counters are missing.
pub fn parse_blockstats(reply: &Value) -> Vec<BlockDeviceStats> {
    let Some(entries) = reply.as_array() else {
        return Vec::new();
    };
    entries
        .iter()
        .filter_map(|e| {
            let qdev = e.get("qdev").and_then(Value::as_str).unwrap_or_default();
            if qdev.is_empty() {
                return None;
            }
            let stats = e.get("stats")?;
            let counter = |name: &str| stats.get(name).and_then(Value::as_u64);
            Some(BlockDeviceStats {
                qdev: qdev.to_string(),
                read_bytes: counter("rd_bytes")?,
                write_bytes: counter("wr_bytes")?,
                read_ops: counter("rd_operations")?,
                write_ops: counter("wr_operations")?,
                flush_ops: counter("flush_operations").unwrap_or(0),
            })
        })
        .collect()
}

pub async fn block_stats(
    qmp: &QmpClient,
    timeout: Duration,
) -> Result<Vec<BlockDeviceStats>, QmpError> {
    Ok(parse_blockstats(
        &qmp.execute("query-blockstats", None, timeout).await?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn stat_fields_are_read_after_the_last_parenthesis() {
        // A command name with ") " in it must not shift the fields.
        let text = "4242 (qemu) sys x) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 3 0 98765 1000 200 18446744073709551615";
        let s = parse_cpu_stat(text).expect("parse");
        assert_eq!(
            s,
            CpuStat {
                state: 'S',
                utime: 250,
                stime: 75,
                start_ticks: 98765
            }
        );
        assert_eq!(parse_cpu_stat("4242 (qemu) S 1 2"), None);
        assert_eq!(parse_cpu_stat("no parenthesis"), None);
    }

    #[test]
    fn vm_rss_is_read_in_kib() {
        let status = "Name:\tqemu-system-x86\nVmPeak:\t 999 kB\nVmRSS:\t  204800 kB\nThreads:\t5\n";
        assert_eq!(parse_vm_rss(status), Some(204800 * 1024));
        assert_eq!(parse_vm_rss("Name:\tkthreadd\n"), None);
        assert_eq!(parse_vm_rss("VmRSS:\t12 MB\n"), None);
    }

    #[test]
    fn this_process_has_cpu_time_and_memory() {
        let me = crate::process::identity_of(std::process::id()).expect("own identity");
        let s = process_stats(&me).expect("own stats");
        assert!(s.rss_bytes > 1 << 20, "{s:?}");
        assert!(s.cpu_seconds >= 0.0);
        let wrong = ProcessIdentity {
            pid: me.pid,
            start_ticks: me.start_ticks + 1,
        };
        assert_eq!(process_stats(&wrong), None, "a reused pid is not ours");
        assert!(thread_cpu_seconds(&me, std::process::id()).is_some());
        assert_eq!(thread_cpu_seconds(&wrong, std::process::id()), None);
    }

    #[test]
    fn vcpu_threads_come_from_query_cpus_fast() {
        let reply = json!([
            {"cpu-index": 0, "thread-id": 1001, "qom-path": "/machine/unattached/device[0]", "target": "x86_64"},
            {"cpu-index": 1, "thread-id": 1002, "qom-path": "/machine/unattached/device[1]", "target": "x86_64"},
            {"cpu-index": 2, "qom-path": "/machine/unattached/device[2]"},
            {"cpu-index": -1, "thread-id": 5},
        ]);
        assert_eq!(
            parse_cpus_fast(&reply),
            vec![
                VcpuThread {
                    index: 0,
                    thread_id: 1001
                },
                VcpuThread {
                    index: 1,
                    thread_id: 1002
                },
            ]
        );
        assert!(parse_cpus_fast(&json!({"error": "x"})).is_empty());
    }

    #[test]
    fn blockstats_keep_guest_devices_and_name_hearths_disks() {
        // Shaped as QEMU 10 answers for a -blockdev/-device VM.
        let reply = json!([
            {"device": "", "qdev": "/machine/peripheral/vdisk0/virtio-backend", "node-name": "disk0",
             "stats": {"rd_bytes": 4096, "wr_bytes": 8192, "rd_operations": 2, "wr_operations": 3,
                       "flush_operations": 1, "rd_total_time_ns": 10}},
            {"device": "", "qdev": "/machine/peripheral/vdisk1/virtio-backend",
             "stats": {"rd_bytes": 0, "wr_bytes": 0, "rd_operations": 0, "wr_operations": 0}},
            {"device": "", "qdev": "/machine/peripheral-anon/device[3]/virtio-backend",
             "stats": {"rd_bytes": 9, "wr_bytes": 0, "rd_operations": 1, "wr_operations": 0}},
            {"device": "", "node-name": "pflash0", "stats": {"rd_bytes": 1}},
            {"device": "", "qdev": "/machine/peripheral/vdisk2/virtio-backend", "stats": {"rd_bytes": 1}},
        ]);
        let stats = parse_blockstats(&reply);
        assert_eq!(stats.len(), 3, "{stats:?}");
        assert_eq!(
            stats[0],
            BlockDeviceStats {
                qdev: "/machine/peripheral/vdisk0/virtio-backend".into(),
                read_bytes: 4096,
                write_bytes: 8192,
                read_ops: 2,
                write_ops: 3,
                flush_ops: 1,
            }
        );
        assert_eq!(stats[0].disk_index(), Some(0));
        assert_eq!(stats[1].disk_index(), Some(1));
        assert_eq!(stats[2].disk_index(), None, "not one of hearth's disks");
        let bare = BlockDeviceStats {
            qdev: "vdisk7".into(),
            ..Default::default()
        };
        assert_eq!(bare.disk_index(), Some(7));
        let odd = BlockDeviceStats {
            qdev: "vdisk07".into(),
            ..Default::default()
        };
        assert_eq!(odd.disk_index(), None);
    }
}
