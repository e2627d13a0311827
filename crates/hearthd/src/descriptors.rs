//! hearthd's file descriptors: the open-file limit it raises at start, and
//! the share of it that connections from outside may hold (docs/limits.md).
//!
//! Every VM's QMP and agent sockets, the layer files hearthd opens and hands
//! to QEMU, the store, dnsmasq's pipes and the programs it runs need
//! descriptors too, and they must never be starved by clients: so the
//! listeners (the API socket, the metrics listener and the loopback port
//! forwards) together may hold at most [`CONNECTION_SHARE_PERCENT`] of the
//! limit, and their bounds are lowered to fit when they are configured
//! higher.

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// The part of RLIMIT_NOFILE, in percent, that connections from outside
/// may hold together; the rest is hearthd's own.
pub const CONNECTION_SHARE_PERCENT: u64 = 50;

/// The open-file limit before and after [`raise_open_file_limit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFileLimit {
    pub before: u64,
    pub now: u64,
}

/// Raises the soft RLIMIT_NOFILE to the hard one (the soft limit is
/// commonly 1024, for programs that still use `select`; hearthd does not).
/// A hard limit of "unlimited" leaves the soft one as it is.
pub fn raise_open_file_limit() -> std::io::Result<OpenFileLimit> {
    let current = getrlimit(Resource::Nofile);
    let before = current.current.unwrap_or(u64::MAX);
    let Some(hard) = current.maximum else {
        return Ok(OpenFileLimit {
            before,
            now: before,
        });
    };
    if before < hard {
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(hard),
                maximum: Some(hard),
            },
        )?;
    }
    Ok(OpenFileLimit {
        before,
        now: before.max(hard),
    })
}

/// How many connections each listener may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionBounds {
    /// The API socket.
    pub api: usize,
    /// The metrics listener (0 when there is none).
    pub metrics: usize,
    /// All loopback port forwards together.
    pub forwards_total: usize,
    /// One loopback port forward.
    pub forwards_per_listener: usize,
}

impl ConnectionBounds {
    /// The descriptors these connections hold at most: one per HTTP
    /// connection, two per forwarded one (the client's and the guest's).
    pub fn descriptors(&self) -> u64 {
        self.api as u64 + self.metrics as u64 + 2 * self.forwards_total as u64
    }
}

/// The descriptors the listeners may hold under an open-file limit.
pub fn connection_share(open_file_limit: u64) -> u64 {
    open_file_limit / 100 * CONNECTION_SHARE_PERCENT
        + open_file_limit % 100 * CONNECTION_SHARE_PERCENT / 100
}

/// `wanted`, or when its connections would hold more than the share of
/// `open_file_limit`, each bound lowered in proportion (to one at least) so
/// that they fit.
pub fn fit(wanted: ConnectionBounds, open_file_limit: u64) -> ConnectionBounds {
    let share = connection_share(open_file_limit);
    let need = wanted.descriptors();
    let wanted = ConnectionBounds {
        forwards_per_listener: wanted.forwards_per_listener.min(wanted.forwards_total),
        ..wanted
    };
    if need <= share {
        return wanted;
    }
    let scale = |n: usize| -> usize {
        if n == 0 {
            return 0;
        }
        let scaled = (n as u128 * share as u128 / need as u128) as usize;
        scaled.max(1)
    };
    let forwards_total = scale(wanted.forwards_total);
    ConnectionBounds {
        api: scale(wanted.api),
        metrics: scale(wanted.metrics),
        forwards_total,
        forwards_per_listener: wanted.forwards_per_listener.min(forwards_total),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const DEFAULTS: ConnectionBounds = ConnectionBounds {
        api: 256,
        metrics: 64,
        forwards_total: 1024,
        forwards_per_listener: 256,
    };

    #[test]
    fn bounds_that_fit_are_kept() {
        // 256 + 64 + 2 * 1024 = 2368 descriptors: within half of 1048576
        // (systemd's default hard limit) and of 8192, not of 1024.
        assert_eq!(fit(DEFAULTS, 1 << 20), DEFAULTS);
        assert_eq!(fit(DEFAULTS, 8192), DEFAULTS);
        let small = fit(DEFAULTS, 1024);
        assert!(small.descriptors() <= 512, "{small:?}");
        assert_eq!(small.api, 256 * 512 / 2368);
        assert_eq!(small.forwards_total, 1024 * 512 / 2368);
        assert!(small.forwards_per_listener <= small.forwards_total);
    }

    #[test]
    fn no_metrics_listener_costs_nothing() {
        let b = fit(
            ConnectionBounds {
                metrics: 0,
                ..DEFAULTS
            },
            1024,
        );
        assert_eq!(b.metrics, 0);
    }

    proptest! {
        #[test]
        fn the_fitted_bounds_stay_in_the_share_and_never_grow(
            api in 1usize..100_000,
            metrics in 0usize..100_000,
            forwards_total in 1usize..100_000,
            forwards_per_listener in 1usize..100_000,
            limit in 16u64..10_000_000,
        ) {
            let wanted = ConnectionBounds { api, metrics, forwards_total, forwards_per_listener };
            let got = fit(wanted, limit);
            prop_assert!(got.descriptors() <= connection_share(limit), "{got:?}");
            prop_assert!(got.api <= api && got.metrics <= metrics);
            prop_assert!(got.forwards_total <= forwards_total);
            prop_assert!(got.forwards_per_listener <= got.forwards_total);
            prop_assert!(got.api >= 1 && got.forwards_total >= 1);
            prop_assert_eq!(got.metrics == 0, metrics == 0);
            if wanted.descriptors() <= connection_share(limit) {
                prop_assert_eq!(got.forwards_total, forwards_total);
                prop_assert_eq!(got.api, api);
            }
        }
    }
}
