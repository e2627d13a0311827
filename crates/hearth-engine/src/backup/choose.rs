//! Full or incremental: the next backup is incremental only when what
//! changed since the previous backup's cut can be read off the disks'
//! layer chains. What a guest wrote after a cut is exactly what the layers
//! made at or after that cut hold (a cut puts a new overlay on every disk,
//! and a layer below a head is never written again), so the previous
//! backup's checkpoint snapshot, while it exists, marks where the change
//! starts: every layer above its layer in the new cut's chain. Pure.

use std::collections::BTreeMap;
use std::path::PathBuf;

use hearth_api::BackupMode;

/// A disk at the new cut.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskNow {
    pub name: String,
    pub virtual_size: u64,
    /// The new cut's layer and every layer below it, top first.
    pub chain: Vec<PathBuf>,
    /// The previous checkpoint's layer of this disk, when that snapshot
    /// still exists.
    pub previous_layer: Option<PathBuf>,
}

/// The previous point, as the manifest has it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Previous {
    pub backup: String,
    pub checkpoint: String,
    pub checkpoint_exists: bool,
    /// Disk name → its virtual size then.
    pub disks: BTreeMap<String, u64>,
    /// How many incremental points follow the newest full one (0 when the
    /// previous point is full).
    pub incrementals_since_full: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Why it is full (None: asked for, or the first).
    Full { reason: Option<String> },
    /// Per disk, how many layers of the new chain lie above the previous
    /// checkpoint's layer: extents from a depth below this changed.
    Incremental { depth: BTreeMap<String, u32> },
}

pub fn choose(
    mode: BackupMode,
    full_every: Option<u32>,
    previous: Option<&Previous>,
    now: &[DiskNow],
) -> Choice {
    let full = |why: String| Choice::Full { reason: Some(why) };
    if mode == BackupMode::Full {
        return Choice::Full { reason: None };
    }
    let Some(p) = previous else {
        return Choice::Full { reason: None };
    };
    if let Some(n) = full_every
        && p.incrementals_since_full + 1 >= n
    {
        return full(format!(
            "fullEvery {n}: {} incremental point(s) follow the last full one",
            p.incrementals_since_full
        ));
    }
    if !p.checkpoint_exists {
        return full(format!(
            "the checkpoint snapshot {:?} of backup {:?} is gone, so what changed since is unknown",
            p.checkpoint, p.backup
        ));
    }
    let names: Vec<&String> = now.iter().map(|d| &d.name).collect();
    let before: Vec<&String> = p.disks.keys().collect();
    let mut sorted = names.clone();
    sorted.sort();
    if sorted != before {
        return full(format!(
            "the VM's disks changed since backup {:?} ({} then, {} now)",
            p.backup,
            join(&before),
            join(&sorted)
        ));
    }
    let mut depth = BTreeMap::new();
    for d in now {
        if p.disks.get(&d.name) != Some(&d.virtual_size) {
            return full(format!(
                "disk {:?} was resized since backup {:?}",
                d.name, p.backup
            ));
        }
        let Some(layer) = &d.previous_layer else {
            return full(format!(
                "disk {:?} has no layer of checkpoint {:?}",
                d.name, p.checkpoint
            ));
        };
        match d.chain.iter().position(|l| l == layer) {
            Some(i) => {
                depth.insert(d.name.clone(), i as u32);
            }
            None => {
                return full(format!(
                    "disk {:?} no longer reads through checkpoint {:?} (restored from another snapshot)",
                    d.name, p.checkpoint
                ));
            }
        }
    }
    Choice::Incremental { depth }
}

fn join(v: &[&String]) -> String {
    if v.is_empty() {
        "none".into()
    } else {
        v.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(name: &str, size: u64, chain: &[&str], prev: Option<&str>) -> DiskNow {
        DiskNow {
            name: name.into(),
            virtual_size: size,
            chain: chain.iter().map(PathBuf::from).collect(),
            previous_layer: prev.map(PathBuf::from),
        }
    }

    fn prev(disks: &[(&str, u64)]) -> Previous {
        Previous {
            backup: "b1".into(),
            checkpoint: "b1-cp".into(),
            checkpoint_exists: true,
            disks: disks.iter().map(|(n, s)| (n.to_string(), *s)).collect(),
            incrementals_since_full: 0,
        }
    }

    #[test]
    fn full_every_n_makes_every_nth_point_full() {
        let ok = [disk("root", 10, &["/l/5", "/l/2"], Some("/l/2"))];
        let mut p = prev(&[("root", 10)]);
        p.incrementals_since_full = 5;
        assert!(matches!(
            choose(BackupMode::Auto, Some(7), Some(&p), &ok),
            Choice::Incremental { .. }
        ));
        p.incrementals_since_full = 6;
        match choose(BackupMode::Auto, Some(7), Some(&p), &ok) {
            Choice::Full { reason: Some(r) } => assert!(r.contains("fullEvery 7"), "{r}"),
            other => panic!("{other:?}"),
        }
        p.incrementals_since_full = 0;
        assert!(matches!(
            choose(BackupMode::Auto, Some(1), Some(&p), &ok),
            Choice::Full { .. }
        ));
    }

    #[test]
    fn incremental_when_the_previous_layer_is_in_the_chain() {
        let now = [disk(
            "root",
            10,
            &["/l/5", "/l/4", "/l/2", "/l/1"],
            Some("/l/2"),
        )];
        assert_eq!(
            choose(BackupMode::Auto, None, Some(&prev(&[("root", 10)])), &now),
            Choice::Incremental {
                depth: BTreeMap::from([("root".to_string(), 2)])
            }
        );
    }

    #[test]
    fn every_case_that_makes_it_full_says_why() {
        let ok = [disk("root", 10, &["/l/5", "/l/2"], Some("/l/2"))];
        assert_eq!(
            choose(BackupMode::Full, None, Some(&prev(&[("root", 10)])), &ok),
            Choice::Full { reason: None }
        );
        assert_eq!(
            choose(BackupMode::Auto, None, None, &ok),
            Choice::Full { reason: None }
        );
        let reason = |c: Choice| match c {
            Choice::Full { reason: Some(r) } => r,
            other => panic!("{other:?}"),
        };
        let mut gone = prev(&[("root", 10)]);
        gone.checkpoint_exists = false;
        assert!(reason(choose(BackupMode::Auto, None, Some(&gone), &ok)).contains("is gone"));
        assert!(
            reason(choose(
                BackupMode::Auto,
                None,
                Some(&prev(&[("root", 8)])),
                &ok
            ))
            .contains("resized")
        );
        assert!(
            reason(choose(
                BackupMode::Auto,
                None,
                Some(&prev(&[("root", 10), ("data", 5)])),
                &ok
            ))
            .contains("disks changed")
        );
        let restored = [disk("root", 10, &["/l/9", "/l/1"], Some("/l/2"))];
        assert!(
            reason(choose(
                BackupMode::Auto,
                None,
                Some(&prev(&[("root", 10)])),
                &restored
            ))
            .contains("restored")
        );
        let no_layer = [disk("root", 10, &["/l/5", "/l/2"], None)];
        assert!(
            reason(choose(
                BackupMode::Auto,
                None,
                Some(&prev(&[("root", 10)])),
                &no_layer
            ))
            .contains("no layer")
        );
    }
}
