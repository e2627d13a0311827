//! What the engine's integration tests share.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hearth_engine::EngineConfig;

/// An engine under `dir` (its state and run directories), on TCG, that
/// resyncs only when told: the tests drive every reconcile they wait for.
pub fn engine_config(dir: &Path, image_roots: Vec<PathBuf>) -> EngineConfig {
    EngineConfig {
        state_dir: dir.join("state"),
        run_dir: dir.join("run"),
        image_roots,
        qemu_binary: "/usr/bin/qemu-system-x86_64".into(),
        qemu_user: None,
        accel: hearth_qemu::accel::AccelDecision {
            accel: hearth_qemu::Accel::Tcg,
            reason: "test".into(),
        },
        resync_interval: Duration::from_secs(3600),
        images: Default::default(),
        forwards: Default::default(),
        ovmf_code: dir.join("OVMF_CODE.fd"),
        ovmf_vars: dir.join("OVMF_VARS.fd"),
        compaction_speed: 0,
        dns_resolv_file: "/etc/resolv.conf".into(),
        console_log_max_bytes: hearth_engine::config::DEFAULT_CONSOLE_LOG_MAX_BYTES,
    }
}
