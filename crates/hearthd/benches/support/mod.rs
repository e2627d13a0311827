//! Measurement helpers shared by the VM benchmarks.

#![allow(dead_code)]

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
