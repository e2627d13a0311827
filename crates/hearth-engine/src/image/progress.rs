//! The arithmetic of an import: how far it is, how fast it goes, when the
//! status is written, how long to wait before the next attempt. Pure, so it
//! is tested without a clock or a server.

use std::time::{Duration, Instant};

/// How often the stored status of a running import is written: often enough
/// to watch, rarely enough not to write the database for every chunk.
pub const STATUS_INTERVAL: Duration = Duration::from_millis(500);

/// `42%` of a known length (never `100%` before the last byte), or the
/// bytes so far when the source did not say its length.
pub fn format_progress(done: u64, total: Option<u64>) -> String {
    match total {
        Some(0) => "100%".into(),
        Some(t) if done >= t => "100%".into(),
        Some(t) => format!("{}%", (u128::from(done) * 100 / u128::from(t)).min(99)),
        None => format_bytes(done),
    }
}

/// `1.5 MiB`: for messages and progress without a length.
pub fn format_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// The delay before attempt `failures + 1`: `base`, doubling per failure,
/// at most `max`.
pub fn retry_delay(failures: u32, base: Duration, max: Duration) -> Duration {
    let doublings = failures.saturating_sub(1).min(30);
    base.saturating_mul(1u32 << doublings).min(max)
}

/// What the status shows of a running import.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub done: u64,
    pub total: Option<u64>,
    pub bytes_per_second: u64,
    pub progress: String,
}

/// Counts the bytes of an import and says when the status is due.
#[derive(Debug)]
pub struct Progress {
    pub total: Option<u64>,
    pub done: u64,
    started: Instant,
    last_report: Instant,
    last_done: u64,
    rate: u64,
}

impl Progress {
    pub fn new(total: Option<u64>, now: Instant) -> Progress {
        Progress {
            total,
            done: 0,
            started: now,
            last_report: now,
            last_done: 0,
            rate: 0,
        }
    }

    /// Adds `n` bytes; a report when [`STATUS_INTERVAL`] has passed since the
    /// last one. The rate is over that last interval.
    pub fn add(&mut self, n: u64, now: Instant) -> Option<Report> {
        self.done = self.done.saturating_add(n);
        let since = now.saturating_duration_since(self.last_report);
        if since < STATUS_INTERVAL {
            return None;
        }
        self.rate = per_second(self.done - self.last_done, since);
        self.last_report = now;
        self.last_done = self.done;
        Some(self.report())
    }

    pub fn report(&self) -> Report {
        Report {
            done: self.done,
            total: self.total,
            bytes_per_second: self.rate,
            progress: format_progress(self.done, self.total),
        }
    }

    /// The mean rate of the whole import.
    pub fn mean_rate(&self, now: Instant) -> u64 {
        per_second(self.done, now.saturating_duration_since(self.started))
    }

    pub fn elapsed(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.started)
    }
}

fn per_second(bytes: u64, over: Duration) -> u64 {
    let micros = over.as_micros().max(1);
    (u128::from(bytes) * 1_000_000 / micros).min(u128::from(u64::MAX)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_a_percentage_of_a_known_length_and_bytes_otherwise() {
        assert_eq!(format_progress(0, Some(1000)), "0%");
        assert_eq!(format_progress(420, Some(1000)), "42%");
        // Rounded down: 100% only once the last byte is in.
        assert_eq!(format_progress(999, Some(1000)), "99%");
        assert_eq!(format_progress(1000, Some(1000)), "100%");
        assert_eq!(format_progress(0, Some(0)), "100%");
        assert_eq!(format_progress(u64::MAX - 1, Some(u64::MAX)), "99%");
        assert_eq!(format_progress(512, None), "512 B");
        assert_eq!(format_progress(3 << 19, None), "1.5 MiB");
        assert_eq!(format_bytes(5 << 30), "5.0 GiB");
    }

    #[test]
    fn retries_wait_twice_as_long_each_time_up_to_the_cap() {
        let base = Duration::from_secs(2);
        let max = Duration::from_secs(60);
        let delays: Vec<u64> = (1..=7)
            .map(|n| retry_delay(n, base, max).as_secs())
            .collect();
        assert_eq!(delays, vec![2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(retry_delay(0, base, max), base);
        assert_eq!(retry_delay(u32::MAX, base, max), max);
        // A cap below the base wins: tests make retries short that way.
        assert_eq!(
            retry_delay(1, base, Duration::from_millis(300)),
            Duration::from_millis(300)
        );
    }

    #[test]
    fn the_status_is_due_twice_a_second_not_per_chunk() {
        let t0 = Instant::now();
        let mut p = Progress::new(Some(10 << 20), t0);
        let mut reports = Vec::new();
        // 100 chunks of 64 KiB over 2 s.
        for i in 1..=100u64 {
            if let Some(r) = p.add(64 << 10, t0 + Duration::from_millis(i * 20)) {
                reports.push(r);
            }
        }
        assert_eq!(reports.len(), 4, "{reports:?}");
        // 25 chunks of 64 KiB per 500 ms: 3.2 MiB/s.
        assert_eq!(reports[0].bytes_per_second, 25 * (64 << 10) * 2);
        assert_eq!(reports[0].progress, "15%");
        assert_eq!(p.done, 100 * (64 << 10));
        assert_eq!(p.mean_rate(t0 + Duration::from_secs(2)), p.done / 2);
    }
}
