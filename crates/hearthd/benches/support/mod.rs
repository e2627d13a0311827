//! Measurement helpers shared by the VM benchmarks.

#![allow(dead_code)]

pub mod libvirt;

/// Whether `cargo bench` runs this benchmark (it passes `--bench`); when
/// not (`cargo test --benches`), says how to run it.
pub fn asked_to_run(name: &str) -> bool {
    let asked = std::env::args().any(|a| a == "--bench");
    if !asked {
        eprintln!("{name}: a benchmark; run it with `cargo bench -p hearthd --bench {name}`");
    }
    asked
}

/// A count from the environment variable `key`, else `default`.
pub fn env_num(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Median (mean of the middle two for an even count), min, max.
pub fn stats(xs: &[f64]) -> (f64, f64, f64) {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let n = v.len();
    let med = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    (med, v[0], v[n - 1])
}

/// The 1-minute load average.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

/// Every qemu-system process on the host (ours and other users').
pub fn all_qemus() -> usize {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name().to_string_lossy().parse::<u32>().is_ok()
                && std::fs::read(e.path().join("cmdline")).is_ok_and(|c| {
                    let argv0 = c.split(|b| *b == 0).next().unwrap_or_default();
                    String::from_utf8_lossy(argv0)
                        .rsplit('/')
                        .next()
                        .is_some_and(|n| n.starts_with("qemu-system"))
                })
        })
        .count()
}

/// Guest CLOCK_MONOTONIC → host time: an interval `(lo, hi)` such that
/// `host_ms = guest_ms + offset` for some offset in it (host ms counted from
/// `epoch`). Each probe brackets one guest clock reading (`stallwatch -t`,
/// run by `exec`, which answers exit code and output) between two host
/// readings; the intersection of three probes is kept, or the narrowest
/// probe when they do not intersect.
pub fn clock_offset(
    epoch: std::time::Instant,
    mut exec: impl FnMut(&str) -> (i64, String),
) -> (f64, f64) {
    let ms = |i: std::time::Instant| i.duration_since(epoch).as_secs_f64() * 1e3;
    let mut best = (f64::NEG_INFINITY, f64::INFINITY);
    let mut narrowest = (f64::NEG_INFINITY, f64::INFINITY);
    for _ in 0..3 {
        let before = ms(std::time::Instant::now());
        let (code, out) = exec("/bin/stallwatch -t");
        let after = ms(std::time::Instant::now());
        assert_eq!(code, 0, "stallwatch -t: {out}");
        let g: f64 = out
            .trim()
            .strip_prefix("now_ms=")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("stallwatch -t printed: {out}"));
        let probe = (before - g, after - g);
        best = (best.0.max(probe.0), best.1.min(probe.1));
        if probe.1 - probe.0 < narrowest.1 - narrowest.0 {
            narrowest = probe;
        }
    }
    if best.0 <= best.1 { best } else { narrowest }
}

/// `median (min–max)` of `xs` with `decimals`; `–` for none.
pub fn fmt(xs: &[f64], decimals: usize) -> String {
    if xs.is_empty() {
        return "–".into();
    }
    let (m, lo, hi) = stats(xs);
    format!("{m:.decimals$} ({lo:.decimals$}–{hi:.decimals$})")
}

/// Milliseconds since the epoch.
pub fn unix_ms(t: std::time::SystemTime) -> f64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1e3)
        .unwrap_or(0.0)
}

/// An RFC 3339 time (as hearthd writes them) in milliseconds since the epoch.
pub fn rfc3339_ms(v: &serde_json::Value) -> Option<f64> {
    let t: chrono::DateTime<chrono::Utc> = v.as_str()?.parse().ok()?;
    Some(t.timestamp_micros() as f64 / 1e3)
}

pub fn chmod(path: &std::path::Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}
