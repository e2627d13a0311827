//! Why the manifest directory was re-listed, and how often: the counters
//! its watcher keeps and the metrics report.

use std::collections::BTreeMap;

use serde::Serialize;

/// Why a re-list ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Reason {
    Start,
    /// Debounced inotify events.
    Event,
    Periodic,
    /// The inotify queue overflowed: events were lost.
    Overflow,
    /// The watch on the directory was lost (removed, moved, unmounted).
    WatchLost,
    /// A look while the directory is missing or not watched yet.
    Missing,
    /// The core asked: a delete to confirm or a refused call to retry.
    Due,
    /// A parse that outlasted its re-list has finished.
    Parsed,
}

impl Reason {
    pub const ALL: [Reason; 8] = [
        Reason::Start,
        Reason::Event,
        Reason::Periodic,
        Reason::Overflow,
        Reason::WatchLost,
        Reason::Missing,
        Reason::Due,
        Reason::Parsed,
    ];

    /// As `GET /v1/sources` and the metrics name it.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Start => "start",
            Reason::Event => "event",
            Reason::Periodic => "periodic",
            Reason::Overflow => "overflow",
            Reason::WatchLost => "watchLost",
            Reason::Missing => "missing",
            Reason::Due => "due",
            Reason::Parsed => "parsed",
        }
    }
}

/// What the metrics report about the directory since the daemon started.
/// Kept apart from the re-list state, so a scrape never waits for a re-list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ManifestCounters {
    pub relists: BTreeMap<Reason, u64>,
    /// New file contents that did not parse (see `ScanStats::parse_errors`).
    pub parse_errors: u64,
}
