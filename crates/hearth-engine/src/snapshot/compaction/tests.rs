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
                    let header = Header::of(Some(Path::new(&merge.gone[0])), Path::new(&merge.base), Path::new(&merge.gone[0]));
                    prop_assert_eq!(decide(&header, &Writer::Exited { ok: false }), Settle::Abandoned);
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

/// Every header against every writer: done only with proof (a qemu-img
/// seen to exit 0, or a flush the job's QEMU answered); a header naming the
/// base without that proof is undone once nothing writes the top.
#[test]
fn a_recorded_merge_is_done_only_with_proof_of_its_writer() {
    let headers = [Header::Base, Header::FirstGone, Header::Other("x".into())];
    let mut writers = vec![
        Writer::Exited { ok: true },
        Writer::Exited { ok: false },
        Writer::Running,
        Writer::Gone,
        Writer::Unknown("qmp".into()),
    ];
    for job_running in [false, true] {
        for flushed in [false, true] {
            writers.push(Writer::Qemu {
                job_running,
                flushed,
            });
        }
    }
    for h in &headers {
        for w in &writers {
            let expected = match (h, w) {
                (_, Writer::Unknown(_)) => Settle::Unresolved("qmp".into()),
                (_, Writer::Running) => Settle::Wait,
                (
                    _,
                    Writer::Qemu {
                        job_running: true, ..
                    },
                ) => Settle::Wait,
                (Header::Other(_), _) => Settle::Unresolved("x".into()),
                (Header::Base, Writer::Exited { ok: true }) => Settle::Done,
                (Header::Base, Writer::Qemu { flushed: true, .. }) => Settle::Done,
                (Header::Base, Writer::Qemu { flushed: false, .. }) => Settle::Flush,
                (Header::Base, _) => Settle::Undo,
                (Header::FirstGone, _) => Settle::Abandoned,
            };
            assert_eq!(decide(h, w), expected, "{h:?} with {w:?}");
        }
    }
}

#[test]
fn the_header_is_read_against_the_record() {
    let (base, below) = (Path::new("/l/base"), Path::new("/l/below"));
    assert_eq!(Header::of(Some(base), base, below), Header::Base);
    assert_eq!(Header::of(Some(below), base, below), Header::FirstGone);
    assert!(matches!(
        Header::of(Some(Path::new("/elsewhere")), base, below),
        Header::Other(_)
    ));
    assert!(matches!(Header::of(None, base, below), Header::Other(_)));
}

// ------------------------------------------------- a merge, step by step

/// What may happen while one merge is recorded. The writers' steps are the
/// real tools' write order, each step on its own: `qemu-img rebase` writes
/// the copied clusters, then the header, then the L2 tables that reference
/// the copies, and syncs at its exit; QEMU's stream job copies into its
/// metadata cache (written back only when evicted or flushed), then writes
/// the header and switches its graph, then the job goes.
#[derive(Clone, Copy, Debug)]
enum Ev {
    /// The writer does its next step, if it still runs.
    Step,
    /// hearthd kills the `qemu-img` it runs (a start or restore asks for
    /// the VM's locks), and sees it exit.
    KillWriter,
    /// hearthd dies and comes back: it no longer knows how its `qemu-img`
    /// ends (which runs on without it).
    DaemonCrash,
    /// QEMU dies uncleanly (crash, OOM kill, SIGKILL): its cache and its
    /// job are gone.
    QemuCrash,
    /// QEMU writes one cached L2 entry back (cache pressure).
    Evict,
    /// The guest flushes its disk: QEMU writes its whole cache back.
    GuestFlush,
    /// hearthd settles the merge from what it can observe.
    Settle,
}

#[derive(Clone, Debug)]
enum Step {
    /// A copied cluster's data: written, referenced by nothing yet (so
    /// nothing reads it).
    Data,
    /// Offline: an L2 entry referencing a copy, on disk.
    Reference(u8, u32),
    /// Online: an L2 entry referencing a copy, in QEMU's cache only.
    Cached(u8, u32),
    /// The header names the base (online: QEMU's graph switches too).
    Header,
    /// The writer ends: qemu-img exits 0 (after syncing); the job goes.
    End,
}

/// One disk: `L0 <- L1 <- ... <- top`, the merge taking the run below the
/// top. `disk` is what is on disk (referenced clusters, headers); QEMU's
/// view adds its cache.
/// A rule of the merge protocol the simulation saw broken.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Violation(String);

#[derive(Clone, Debug)]
struct Sim {
    online: bool,
    merge: Merge,
    disk: BTreeMap<String, BTreeMap<u8, u32>>,
    header: BTreeMap<String, Option<String>>,
    cache: BTreeMap<u8, u32>,
    /// QEMU's graph: the top reads through this layer.
    graph_below: String,
    qemu_alive: bool,
    steps: Vec<Step>,
    next: usize,
    writer_alive: bool,
    /// The running hearthd started the qemu-img (it will see its exit).
    parent: bool,
    exited: Option<bool>,
    recorded: bool,
    unlinked: bool,
    expected: Vec<Option<u32>>,
}

impl Sim {
    fn new(online: bool, layers: Vec<BTreeMap<u8, u32>>, gone: usize) -> Sim {
        let n = layers.len();
        let id = |i: usize| format!("{i:03}");
        let mut chains = Chains::default();
        let mut disk = BTreeMap::new();
        let mut header = BTreeMap::new();
        for (i, d) in layers.into_iter().enumerate() {
            let backing = (i > 0).then(|| id(i - 1));
            chains.backing.insert(id(i), backing.clone());
            header.insert(id(i), backing);
            disk.insert(id(i), d);
        }
        let top = id(n - 1);
        let merge = Merge {
            top: top.clone(),
            base: id(n - 2 - gone),
            gone: (0..gone).map(|g| id(n - 2 - g)).collect(),
        };
        let mut sim = Sim {
            online,
            graph_below: merge.gone[0].clone(),
            merge,
            disk,
            header,
            cache: BTreeMap::new(),
            qemu_alive: online,
            steps: Vec::new(),
            next: 0,
            writer_alive: true,
            parent: true,
            exited: None,
            recorded: true,
            unlinked: false,
            expected: Vec::new(),
        };
        sim.expected = sim.disk_view();
        let below = sim.view_through(&sim.merge.gone[0]);
        let base = sim.view_through(&sim.merge.base);
        let top_holds = sim.disk[&top].clone();
        let copies: Vec<(u8, u32)> = (0..BLOCKS)
            .filter(|b| !top_holds.contains_key(b))
            .filter(|&b| below[b as usize] != base[b as usize])
            .map(|b| (b, below[b as usize].unwrap_or(0)))
            .collect();
        sim.steps.extend(copies.iter().map(|_| Step::Data));
        if online {
            sim.steps
                .extend(copies.iter().map(|&(b, v)| Step::Cached(b, v)));
            sim.steps.push(Step::Header);
        } else {
            sim.steps.push(Step::Header);
            sim.steps
                .extend(copies.iter().map(|&(b, v)| Step::Reference(b, v)));
        }
        sim.steps.push(Step::End);
        sim
    }

    /// What `from` and everything below it read on disk; a layer that is
    /// gone reads as 99 (never a real value).
    fn view_through(&self, from: &str) -> Vec<Option<u32>> {
        (0..BLOCKS)
            .map(|b| {
                let mut cur = Some(from.to_string());
                while let Some(l) = cur {
                    let Some(d) = self.disk.get(&l) else {
                        return Some(99);
                    };
                    if let Some(v) = d.get(&b) {
                        return Some(*v);
                    }
                    cur = self.header.get(&l).cloned().flatten();
                }
                None
            })
            .collect()
    }

    /// What the top reads from disk alone (after QEMU is gone).
    fn disk_view(&self) -> Vec<Option<u32>> {
        self.view_through(&self.merge.top)
    }

    /// What the guest reads through QEMU.
    fn qemu_view(&self) -> Vec<Option<u32>> {
        let below = self.view_through(&self.graph_below);
        (0..BLOCKS)
            .map(|b| {
                self.cache
                    .get(&b)
                    .or_else(|| self.disk[&self.merge.top].get(&b))
                    .copied()
                    .or(below[b as usize])
            })
            .collect()
    }

    fn writer_ends(&mut self, ok: bool) {
        self.writer_alive = false;
        if !self.online && self.parent {
            self.exited = Some(ok);
        }
    }

    fn step(&mut self) {
        if !self.writer_alive {
            return;
        }
        let top = self.merge.top.clone();
        match self.steps[self.next].clone() {
            Step::Data => {}
            Step::Reference(b, v) => {
                self.disk.get_mut(&top).unwrap().insert(b, v);
            }
            Step::Cached(b, v) => {
                self.cache.insert(b, v);
            }
            Step::Header => {
                self.header.insert(top, Some(self.merge.base.clone()));
                self.graph_below = self.merge.base.clone();
            }
            Step::End => self.writer_ends(true),
        }
        self.next += 1;
    }

    fn write_back(&mut self, all: bool) {
        let top = self.merge.top.clone();
        while let Some((b, v)) = self.cache.pop_first() {
            self.disk.get_mut(&top).unwrap().insert(b, v);
            if !all {
                break;
            }
        }
    }

    /// What hearthd can observe of the writer (`compaction::writer_of`).
    fn writer(&self) -> Writer {
        if let Some(ok) = self.exited {
            return Writer::Exited { ok };
        }
        if self.online {
            if self.qemu_alive {
                Writer::Qemu {
                    job_running: self.writer_alive,
                    flushed: false,
                }
            } else {
                Writer::Gone
            }
        } else if self.writer_alive {
            Writer::Running
        } else {
            Writer::Gone
        }
    }

    fn header(&self) -> Header {
        let b = self.header[&self.merge.top].clone().unwrap_or_default();
        Header::of(
            Some(Path::new(&b)),
            Path::new(&self.merge.base),
            Path::new(&self.merge.gone[0]),
        )
    }

    /// `compaction::settle`, acting on the model. Err: a broken promise.
    fn settle(&mut self) -> Result<(), Violation> {
        if !self.recorded {
            return Ok(());
        }
        let header = self.header();
        let mut writer = self.writer();
        let mut settled = decide(&header, &writer);
        if settled == Settle::Flush {
            // A flush QEMU answers: its cache is on disk.
            self.write_back(true);
            writer = Writer::Qemu {
                job_running: false,
                flushed: true,
            };
            settled = decide(&header, &writer);
        }
        match settled {
            Settle::Done => {
                self.recorded = false;
                // The store backs the top by the base; the merged layers'
                // files are unlinked.
                for g in &self.merge.gone {
                    self.disk.remove(g);
                    self.header.remove(g);
                }
                self.unlinked = true;
                if self.disk_view() != self.expected {
                    return Err(Violation(format!(
                        "settled as done ({writer:?}) but the top reads {:?} on disk, not {:?}",
                        self.disk_view(),
                        self.expected
                    )));
                }
            }
            Settle::Undo => {
                if self.writer_alive && !self.online {
                    return Err(Violation("undone while qemu-img still writes".into()));
                }
                if self.qemu_alive {
                    return Err(Violation("undone under a running QEMU".into()));
                }
                self.header
                    .insert(self.merge.top.clone(), Some(self.merge.gone[0].clone()));
                self.recorded = false;
            }
            Settle::Abandoned => self.recorded = false,
            Settle::Flush | Settle::Wait | Settle::Unresolved(_) => {}
        }
        Ok(())
    }

    fn handle(&mut self, ev: Ev) -> Result<(), Violation> {
        match ev {
            Ev::Step => self.step(),
            Ev::KillWriter => {
                if !self.online && self.writer_alive && self.parent {
                    self.writer_ends(false);
                }
            }
            Ev::DaemonCrash => {
                self.parent = false;
                self.exited = None;
            }
            Ev::QemuCrash => {
                if self.qemu_alive {
                    self.qemu_alive = false;
                    self.cache.clear();
                    self.writer_alive = false;
                }
            }
            Ev::Evict => {
                if self.qemu_alive {
                    self.write_back(false);
                }
            }
            Ev::GuestFlush => {
                if self.qemu_alive {
                    self.write_back(true);
                }
            }
            Ev::Settle => self.settle()?,
        }
        if self.qemu_alive && self.qemu_view() != self.expected {
            return Err(Violation(format!(
                "the guest reads {:?}, not {:?}",
                self.qemu_view(),
                self.expected
            )));
        }
        Ok(())
    }

    /// The end of the world: QEMU dies uncleanly, hearthd restarts, a
    /// qemu-img left running finishes on its own; then hearthd settles.
    fn finish(&mut self) -> Result<(), Violation> {
        self.handle(Ev::QemuCrash)?;
        self.handle(Ev::DaemonCrash)?;
        while self.writer_alive {
            self.step();
        }
        for _ in 0..3 {
            self.settle()?;
        }
        if self.recorded {
            return Err(Violation(format!(
                "still recorded: {:?} with {:?}",
                self.header(),
                self.writer()
            )));
        }
        if self.disk_view() != self.expected {
            return Err(Violation(format!(
                "after the merge settled the top reads {:?} on disk, not {:?}",
                self.disk_view(),
                self.expected
            )));
        }
        Ok(())
    }
}

fn event() -> impl Strategy<Value = Ev> {
    prop_oneof![
        6 => Just(Ev::Step),
        1 => Just(Ev::KillWriter),
        1 => Just(Ev::DaemonCrash),
        1 => Just(Ev::QemuCrash),
        2 => Just(Ev::Evict),
        1 => Just(Ev::GuestFlush),
        3 => Just(Ev::Settle),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// A merge killed, crashed or left unflushed at any step, with the
    /// daemon settling at any moment: the top reads as before on disk
    /// after every settle that calls it done, the guest always reads as
    /// before, and in the end, after an unclean QEMU exit and a daemon
    /// restart, the merge is settled and the top reads as before on disk.
    #[test]
    fn a_merge_interrupted_at_any_step_never_changes_what_the_top_reads(
        online in any::<bool>(),
        layers in proptest::collection::vec(
            proptest::collection::btree_map(0..BLOCKS, 0u32..4, 0..5), 3..7),
        gone_pick in any::<usize>(),
        events in proptest::collection::vec(event(), 0..40),
    ) {
        let gone = 1 + gone_pick % (layers.len() - 2);
        let mut sim = Sim::new(online, layers, gone);
        for ev in events {
            if let Err(e) = sim.handle(ev) {
                return Err(TestCaseError::fail(format!("after {ev:?}: {e}")));
            }
        }
        if let Err(e) = sim.finish() {
            return Err(TestCaseError::fail(e.to_string()));
        }
    }
}
