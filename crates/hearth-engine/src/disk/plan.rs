//! Compaction planning: a disk's chain is planned again only when its
//! shape changed, on the part of the layer graph around its head, and the
//! disks hinted meanwhile share one reading of the graph.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use crate::context::Context;
use crate::snapshot::compaction::{self, Chains};
use crate::snapshot::storage;
use crate::store::StoreError;

/// How long the planner waits after a batch, so that the hints arriving
/// meanwhile share the next one (and its one reading of the layer graph).
const PLAN_PAUSE: Duration = Duration::from_millis(200);

pub(super) use super::registry::Shape;

impl Shape {
    pub(super) fn of(sub: &Chains, head: &str) -> Shape {
        let mut children: HashMap<&str, usize> = HashMap::new();
        for b in sub.backing.values().flatten() {
            *children.entry(b.as_str()).or_default() += 1;
        }
        Shape(
            sub.chain(head)
                .into_iter()
                .map(|id| {
                    let backing = sub.backing.get(&id).cloned().flatten();
                    let root = sub.roots.contains(&id);
                    let on_it = children.get(id.as_str()).copied().unwrap_or(0);
                    (id, backing, root, on_it)
                })
                .collect(),
        )
    }
}

/// For each layer, the layers that lie directly on it.
pub(super) fn children_of(chains: &Chains) -> HashMap<&str, Vec<&str>> {
    let mut out: HashMap<&str, Vec<&str>> = HashMap::new();
    for (id, backing) in &chains.backing {
        if let Some(b) = backing {
            out.entry(b.as_str()).or_default().push(id.as_str());
        }
    }
    out
}

/// The part of the layer graph that `head`'s chain and its compaction plan
/// read: the chain's layers, every layer lying on one of them, and the
/// roots among those. `Chains::chain` and `compaction::plan` answer the
/// same for `head` on it as on the whole graph (a property tested below),
/// at the cost of the chain instead of the graph.
pub(super) fn around(chains: &Chains, children: &HashMap<&str, Vec<&str>>, head: &str) -> Chains {
    let mut sub = Chains::default();
    for id in chains.chain(head) {
        for c in children.get(id.as_str()).into_iter().flatten() {
            sub.backing
                .insert(c.to_string(), chains.backing.get(*c).cloned().flatten());
        }
        sub.backing
            .insert(id.clone(), chains.backing.get(&id).cloned().flatten());
    }
    sub.roots = sub
        .backing
        .keys()
        .filter(|id| chains.roots.contains(*id))
        .cloned()
        .collect();
    sub
}

/// Plans `disk`'s chain soon, with the other disks hinted meanwhile: the
/// layer graph is read once per batch, however many disks it has.
pub(super) fn plan_soon(ctx: &Arc<Context>, disk: &str) {
    let mut planner = ctx.disks.planner.lock().unwrap_or_else(|p| p.into_inner());
    planner.waiting.insert(disk.to_string());
    if planner.running {
        return;
    }
    planner.running = true;
    let weak = Arc::downgrade(ctx);
    tokio::spawn(async move {
        loop {
            let Some(ctx) = weak.upgrade() else { return };
            let batch = {
                let mut planner = ctx.disks.planner.lock().unwrap_or_else(|p| p.into_inner());
                if planner.waiting.is_empty() {
                    planner.running = false;
                    return;
                }
                std::mem::take(&mut planner.waiting)
            };
            if let Err(e) = plan_batch(&ctx, &batch) {
                tracing::warn!(error = %e, "cannot read the layer graph to plan compactions");
            }
            drop(ctx);
            tokio::time::sleep(PLAN_PAUSE).await;
        }
    });
}

/// Asks the actor serving each disk of `disks` to compact it when its chain
/// has layers nobody needs (a snapshot deleted while the VM ran, merged
/// once it stopped) or a merge a restart interrupted; the actor merges
/// them, or says why it cannot yet.
fn plan_batch(ctx: &Arc<Context>, disks: &BTreeSet<String>) -> Result<(), StoreError> {
    let chains = compaction::chains(&ctx.store)?;
    let children = children_of(&chains);
    let compacting: HashSet<String> = ctx.store.with_tx(|tx| {
        let mut stmt = tx.prepare("SELECT DISTINCT disk FROM compactions")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        Ok(rows.collect::<Result<HashSet<_>, _>>()?)
    })?;
    let mut to_compact = Vec::new();
    for d in disks {
        let Some(head) = storage::head(&ctx.store, d)? else {
            continue;
        };
        let sub = around(&chains, &children, &head.id);
        let work = !compaction::plan(&sub, &head.id).is_empty() || compacting.contains(d);
        if work {
            to_compact.push(d.clone());
        }
        ctx.disks
            .planned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(d.clone(), (Shape::of(&sub, &head.id), work));
    }
    for d in to_compact {
        ctx.snapshots.compact(ctx, &d);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn graph(backing: &[(&str, Option<&str>)], roots: &[&str]) -> Chains {
        Chains {
            backing: backing
                .iter()
                .map(|(id, b)| (id.to_string(), b.map(str::to_string)))
                .collect(),
            roots: roots.iter().map(|r| r.to_string()).collect(),
        }
    }

    #[test]
    fn the_part_around_a_head_is_its_chain_and_what_lies_on_it() {
        // h -> m -> b, with a restored disk r on m and an unrelated x.
        let g = graph(
            &[
                ("h", Some("m")),
                ("m", Some("b")),
                ("b", None),
                ("r", Some("m")),
                ("x", None),
            ],
            &["h", "r", "b"],
        );
        let sub = around(&g, &children_of(&g), "h");
        let ids: Vec<&String> = sub.backing.keys().collect();
        assert_eq!(ids, ["b", "h", "m", "r"]);
        assert_eq!(sub.roots.len(), 3);
        assert_eq!(sub.chain("h"), ["h", "m", "b"]);
    }

    /// A random layer graph: each layer's backing is nothing, another layer,
    /// itself, or a layer the store does not know; some layers are roots.
    fn any_graph() -> impl Strategy<Value = Chains> {
        (1usize..9).prop_flat_map(|n| {
            (
                proptest::collection::vec(proptest::option::of(0usize..n + 2), n),
                proptest::collection::vec(any::<bool>(), n),
            )
                .prop_map(move |(backing, roots)| {
                    let name = |i: usize| format!("l{i}");
                    Chains {
                        backing: backing
                            .iter()
                            .enumerate()
                            .map(|(i, b)| (name(i), b.map(name)))
                            .collect(),
                        roots: roots
                            .iter()
                            .enumerate()
                            .filter(|(_, r)| **r)
                            .map(|(i, _)| name(i))
                            .collect(),
                    }
                })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn the_part_around_a_head_plans_as_the_whole_graph_does(g in any_graph()) {
            let children = children_of(&g);
            for head in g.backing.keys() {
                let sub = around(&g, &children, head);
                prop_assert_eq!(sub.chain(head), g.chain(head));
                prop_assert_eq!(compaction::plan(&sub, head), compaction::plan(&g, head));
                // The shape the plan is remembered by is the same too.
                prop_assert_eq!(Shape::of(&sub, head), Shape::of(&g, head));
            }
        }
    }
}
