//! One bounded wait for conditions no API announces: a file, the process
//! table, a guest's console. Waits on hearthd's own objects belong on its
//! change stream instead.

use std::time::{Duration, Instant};

/// How often [`eventually`] looks again.
const POLL: Duration = Duration::from_millis(100);

/// Whether `f` holds within `timeout`, asked every 100 ms (and once more at
/// the deadline, so a slow first call still gets its answer). The caller
/// asserts on the result with its own message.
pub fn eventually(timeout: Duration, f: impl FnMut() -> bool) -> bool {
    eventually_every(POLL, timeout, f)
}

/// [`eventually`], asking every `interval`: slower when each look costs the
/// system under test (a program run in a guest), faster when what is looked
/// for lasts only moments (a short-lived process).
pub fn eventually_every(
    interval: Duration,
    timeout: Duration,
    mut f: impl FnMut() -> bool,
) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        std::thread::sleep(interval.min(deadline - now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eventually_returns_as_soon_as_the_condition_holds() {
        let mut calls = 0;
        let started = Instant::now();
        assert!(eventually(Duration::from_secs(10), || {
            calls += 1;
            calls == 3
        }));
        assert_eq!(calls, 3);
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn eventually_every_asks_at_its_own_pace() {
        let mut calls = 0;
        let started = Instant::now();
        assert!(!eventually_every(
            Duration::from_millis(400),
            Duration::from_millis(1000),
            || {
                calls += 1;
                false
            }
        ));
        // At 0, 400, 800 and the deadline (1000 ms); fewer on a slow machine,
        // never the ten of the default pace.
        assert!((2..=4).contains(&calls), "{calls}");
        assert!(started.elapsed() >= Duration::from_millis(1000));
    }

    #[test]
    fn eventually_gives_up_at_the_deadline() {
        let started = Instant::now();
        assert!(!eventually(Duration::from_millis(250), || false));
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(250), "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
    }
}
