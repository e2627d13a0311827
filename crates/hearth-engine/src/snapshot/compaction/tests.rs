//! The merge rule over a model of qcow2 chains: every layer holds some
//! blocks, a layer reads its own blocks over what its backing reads; a
//! merge is `qemu-img rebase` in safe mode (copy into the top every block
//! it does not hold that reads differently through the base, then switch).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use proptest::prelude::*;

use super::*;

const BLOCKS: u8 = 6;

#[derive(Clone, Debug, Default)]
struct Model {
    data: BTreeMap<String, BTreeMap<u8, u32>>,
    chains: Chains,
}

impl Model {
    fn view(&self, id: &str) -> Vec<Option<u32>> {
        let chain = self.chains.chain(id);
        (0..BLOCKS)
            .map(|b| {
                chain
                    .iter()
                    .find_map(|l| self.data.get(l).and_then(|d| d.get(&b)).copied())
            })
            .collect()
    }

    /// The blocks a safe rebase of `m.top` copies up.
    fn to_copy(&self, m: &Merge) -> Vec<(u8, Option<u32>)> {
        let below = self.view(&m.gone[0]);
        let base = self.view(&m.base);
        (0..BLOCKS)
            .filter(|b| !self.data[&m.top].contains_key(b))
            .filter(|&b| below[b as usize] != base[b as usize])
            .map(|b| (b, below[b as usize]))
            .collect()
    }

    /// Copies the first `n` blocks of a merge (a rebase killed midway).
    fn copy_up(&mut self, m: &Merge, n: usize) {
        for (b, v) in self.to_copy(m).into_iter().take(n) {
            // A block that reads as nothing below cannot differ from a base
            // that holds it... except as an explicit zero: model it as 0.
            self.data.get_mut(&m.top).unwrap().insert(b, v.unwrap_or(0));
        }
    }

    fn apply(&mut self, m: &Merge) {
        self.copy_up(m, usize::MAX);
        self.chains
            .backing
            .insert(m.top.clone(), Some(m.base.clone()));
        self.collect();
    }

    /// Drops every layer no root reaches (the store's garbage collection).
    fn collect(&mut self) {
        let mut live = BTreeSet::new();
        for r in &self.chains.roots {
            live.extend(self.chains.chain(r));
        }
        self.chains.backing.retain(|id, _| live.contains(id));
        self.data.retain(|id, _| live.contains(id));
    }
}

/// A random forest of layers: layer 0 is a bottom, every other one lies on
/// an earlier layer (mostly the one just before: long chains), holds some
/// blocks; every leaf is a head, some inner layers are snapshots.
fn model() -> impl Strategy<Value = (Model, Vec<String>)> {
    (2usize..40)
        .prop_flat_map(|n| {
            (
                proptest::collection::vec((0u8..4, any::<u8>()), n),
                proptest::collection::vec(
                    proptest::collection::btree_map(0..BLOCKS, 0u32..4, 0..4),
                    n,
                ),
                proptest::collection::vec(0u8..10, n),
            )
        })
        .prop_map(|(shape, data, snaps)| {
            let mut m = Model::default();
            let id = |i: usize| format!("{i:03}");
            for (i, ((kind, pick), d)) in shape.iter().zip(data).enumerate() {
                let backing = match (i, kind) {
                    (0, _) => None,
                    // A second bottom now and then (another disk).
                    (_, 0) if pick % 8 == 0 => None,
                    (_, 0) => Some(id(*pick as usize % i)),
                    _ => Some(id(i - 1)),
                };
                m.chains.backing.insert(id(i), backing);
                m.data.insert(id(i), d);
            }
            let children = m.chains.children();
            let mut heads: Vec<String> = m
                .chains
                .backing
                .keys()
                .filter(|l| !children.contains_key(l.as_str()))
                .cloned()
                .collect();
            heads.sort();
            let mut roots: BTreeSet<String> = heads.iter().cloned().collect();
            for (i, s) in snaps.iter().enumerate() {
                if *s < 2 {
                    roots.insert(id(i));
                }
            }
            m.chains.roots = roots;
            m.collect();
            (m, heads)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Every root (head, snapshot) reads exactly as before after every
    /// merge of every head's chain; no merged layer is one; afterwards each
    /// chain holds only needed layers, and a second plan finds nothing.
    #[test]
    fn merges_keep_every_referenced_view(
        (mut m, heads) in model(),
        crash_at in proptest::option::of((0usize..40, 0usize..4)),
    ) {
        let before: BTreeMap<String, Vec<Option<u32>>> =
            m.chains.roots.iter().map(|r| (r.clone(), m.view(r))).collect();
        let lengths: BTreeMap<String, usize> =
            heads.iter().map(|h| (h.clone(), m.chains.chain(h).len())).collect();
        let mut step = 0;
        for h in &heads {
            for merge in plan(&m.chains, h) {
                prop_assert!(!merge.gone.is_empty());
                for g in &merge.gone {
                    prop_assert!(!m.chains.roots.contains(g), "merged a referenced layer {g}");
                }
                prop_assert_eq!(m.chains.backing[&merge.gone[0]].as_deref(), merge.gone.get(1).or(Some(&merge.base)).map(String::as_str));
                prop_assert_eq!(m.chains.backing[&merge.top].as_deref(), Some(merge.gone[0].as_str()));
                if let Some((at, n)) = crash_at && at == step {
                    // Killed midway: some blocks copied, no switch. The
                    // header still names the layer below: abandoned.
                    m.copy_up(&merge, n);
                    for (r, v) in &before {
                        prop_assert_eq!(&m.view(r), v, "a half-done merge changed {}", r);
                    }
                    prop_assert_eq!(
                        decide(Some(Path::new(&merge.gone[0])), Path::new(&merge.base), Path::new(&merge.gone[0]), Job::Ended),
                        Settle::Abandoned
                    );
                }
                m.apply(&merge);
                step += 1;
                for (r, v) in &before {
                    prop_assert_eq!(&m.view(r), v, "merging into {} changed {}", merge.top, r);
                }
            }
        }
        let children = m.chains.children();
        for h in &heads {
            prop_assert!(plan(&m.chains, h).is_empty());
            let chain = m.chains.chain(h);
            prop_assert!(chain.len() <= lengths[h]);
            for l in &chain {
                prop_assert!(l == h || m.chains.needed(l, &children), "{l} is left in {h}'s chain");
            }
        }
    }
}

fn linear(n: usize, roots: &[usize]) -> Chains {
    let mut c = Chains::default();
    for i in 0..n {
        c.backing
            .insert(format!("{i}"), (i > 0).then(|| format!("{}", i - 1)));
    }
    c.roots = roots.iter().map(|r| format!("{r}")).collect();
    c
}

#[test]
fn a_run_of_deleted_snapshots_goes_into_the_head() {
    // 0 <- 1 <- 2 <- 3 <- 4(head): snapshots at 0 and 2 deleted, 1 kept.
    let c = linear(5, &[4, 1]);
    assert_eq!(
        plan(&c, "4"),
        vec![Merge {
            top: "4".into(),
            base: "1".into(),
            gone: vec!["3".into(), "2".into()]
        }]
    );
}

#[test]
fn a_run_below_a_kept_snapshot_goes_into_that_snapshot_and_the_bottom_stays() {
    // 0 <- 1 <- 2 <- 3 <- 4 <- 5(head): only 3 is kept.
    let c = linear(6, &[5, 3]);
    assert_eq!(
        plan(&c, "5"),
        vec![
            Merge {
                top: "5".into(),
                base: "3".into(),
                gone: vec!["4".into()]
            },
            Merge {
                top: "3".into(),
                base: "0".into(),
                gone: vec!["2".into(), "1".into()]
            },
        ]
    );
}

#[test]
fn a_layer_two_disks_read_is_never_merged() {
    // 0 <- 1 <- 2(head of d), 1 <- 3(head of a disk restored from a
    // snapshot at 1 that was deleted since).
    let mut c = linear(3, &[2]);
    c.backing.insert("3".into(), Some("1".into()));
    c.roots.insert("3".into());
    assert!(plan(&c, "2").is_empty());
    assert!(plan(&c, "3").is_empty());
}

#[test]
fn nothing_to_merge_in_a_chain_of_kept_layers() {
    assert!(plan(&linear(4, &[3, 2, 1]), "3").is_empty());
    assert!(plan(&linear(1, &[0]), "0").is_empty());
}

#[test]
fn a_recorded_merge_is_settled_by_the_top_header() {
    let (base, below) = (Path::new("/l/base"), Path::new("/l/below"));
    assert_eq!(decide(Some(base), base, below, Job::Running), Settle::Done);
    assert_eq!(decide(Some(base), base, below, Job::Ended), Settle::Done);
    assert_eq!(
        decide(Some(base), base, below, Job::Unknown("x".into())),
        Settle::Done
    );
    assert_eq!(decide(Some(below), base, below, Job::Running), Settle::Wait);
    assert_eq!(
        decide(Some(below), base, below, Job::Ended),
        Settle::Abandoned
    );
    assert!(matches!(
        decide(Some(below), base, below, Job::Unknown("qmp".into())),
        Settle::Unresolved(_)
    ));
    assert!(matches!(
        decide(Some(Path::new("/elsewhere")), base, below, Job::Ended),
        Settle::Unresolved(_)
    ));
    assert!(matches!(
        decide(None, base, below, Job::Ended),
        Settle::Unresolved(_)
    ));
}
