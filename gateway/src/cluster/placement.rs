//! Where a new kernel goes: the nodes that can start its spec, the one with the most free
//! room first. Free room is a node's capacity less the kernels it runs: the load it
//! reported, and the creates this entry node placed on it since, so that creates in quick
//! succession spread out. Loads are not watched (each create and delete changes one, and a
//! watch would bring every change to every node): a create reads the loads of a few
//! candidates picked at random ([`SAMPLED`]) and tries the best of those first, then the
//! rest as the view last knew them. Among equals, a node with a warm kernel of the
//! spec goes first (its create takes milliseconds), then the node id, so that every entry
//! node orders alike. The target enforces its own limit: a full node refuses, and the entry
//! node tries the next.

use super::membership::View;

/// How many candidates a create reads the load of: the best of a few fresh loads spreads
/// kernels nearly as evenly as every node's would, for a few reads instead of a watch.
pub const SAMPLED: usize = 3;

/// Up to [`SAMPLED`] of `candidates`, picked at random.
pub fn sample(candidates: &[String]) -> Vec<String> {
    let mut picked: Vec<String> = Vec::with_capacity(SAMPLED);
    let mut left: Vec<&String> = candidates.iter().collect();
    while picked.len() < SAMPLED && !left.is_empty() {
        let i = rand::random_range(0..left.len());
        picked.push(left.swap_remove(i).clone());
    }
    picked
}

/// `candidates` with the `sampled` ones first, best first by `fresh` (a view holding their
/// loads just read; those full by now left out), then the others in their order.
pub fn with_sampled(
    fresh: &View,
    spec: &str,
    sampled: &[String],
    others: Vec<String>,
) -> Vec<String> {
    let mut ordered: Vec<String> = candidates(fresh, spec)
        .into_iter()
        .filter(|id| sampled.contains(id))
        .collect();
    ordered.extend(others.into_iter().filter(|id| !sampled.contains(id)));
    ordered
}

/// The nodes to try for a kernel of `spec`, best first; nodes that are full are left out.
pub fn candidates(view: &View, spec: &str) -> Vec<String> {
    let mut nodes: Vec<(u32, u32, &str)> = view
        .nodes
        .iter()
        .filter(|(_, n)| !n.away && n.specs.iter().any(|s| s == spec))
        .filter_map(|(id, n)| {
            let placed = view.placed.get(id).copied().unwrap_or(0);
            let used = n.load.saturating_add(placed);
            let free = n.capacity.saturating_sub(used);
            let warm = n.warm.get(spec).copied().unwrap_or(0);
            (free > 0).then_some((free, warm, id.as_str()))
        })
        .collect();
    nodes.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(b.2)));
    nodes.into_iter().map(|(_, _, id)| id.to_owned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{node_key, Entry, Event, NodeRecord};

    fn node(capacity: u32, load: u32, specs: &[&str]) -> NodeRecord {
        NodeRecord {
            address: String::new(),
            cluster_address: None,
            incarnation: String::new(),
            capacity,
            load,
            version: String::new(),
            specs: specs.iter().map(|s| s.to_string()).collect(),
            warm: Default::default(),
            away: false,
            indexed: true,
        }
    }

    #[test]
    fn most_free_room_first_and_full_nodes_left_out() {
        let mut view = View::default();
        view.nodes.insert("a".into(), node(2, 1, &["python3"]));
        view.nodes.insert("b".into(), node(2, 0, &["python3"]));
        view.nodes.insert("c".into(), node(2, 2, &["python3"]));
        view.nodes.insert("d".into(), node(9, 0, &["r"]));
        assert_eq!(candidates(&view, "python3"), ["b", "a"]);
        assert_eq!(candidates(&view, "r"), ["d"]);
        assert!(candidates(&view, "julia").is_empty());
    }

    #[test]
    fn creates_placed_count_until_the_load_is_reported_and_warm_kernels_break_ties() {
        let mut view = View::default();
        view.nodes.insert("a".into(), node(2, 0, &["python3"]));
        view.nodes.insert("b".into(), node(2, 0, &["python3"]));
        view.nodes.insert("c".into(), node(2, 0, &["python3"]));
        view.nodes
            .get_mut("c")
            .map(|c| c.warm.insert("python3".into(), 1));
        assert_eq!(candidates(&view, "python3"), ["c", "a", "b"]);
        // Six creates in a row spread 2/2/2, each counting the ones placed before.
        let mut placed = Vec::new();
        for _ in 0..6 {
            let first = candidates(&view, "python3")[0].clone();
            *view.placed.entry(first.clone()).or_default() += 1;
            placed.push(first);
        }
        placed.sort();
        assert_eq!(placed, ["a", "a", "b", "b", "c", "c"]);
        assert!(
            candidates(&view, "python3").is_empty(),
            "the cluster is full"
        );
        // Node a reports its load: its placements are in it now, and no longer counted.
        view.apply(&Event::Put(Entry {
            key: node_key("a"),
            value: serde_json::to_vec(&node(2, 1, &["python3"])).expect("json"),
            revision: 7,
        }));
        assert_eq!(candidates(&view, "python3"), ["a"]);
    }

    #[test]
    fn the_sampled_nodes_go_first_by_their_fresh_loads_and_full_ones_drop_out() {
        let mut view = View::default();
        for id in ["a", "b", "c", "d", "e"] {
            view.nodes.insert(id.into(), node(4, 0, &["python3"]));
        }
        let all = candidates(&view, "python3");
        let sampled = sample(&all);
        assert_eq!(sampled.len(), SAMPLED);
        assert!(sampled.iter().all(|s| all.contains(s)));
        assert_eq!(sample(&all[..2]).len(), 2, "fewer candidates than samples");
        // Fresh loads: b is full by now, d has the most room, c the next.
        let mut fresh = view.clone();
        for (id, load) in [("b", 4), ("c", 2), ("d", 1)] {
            if let Some(n) = fresh.nodes.get_mut(id) {
                n.load = load;
            }
        }
        let picked = ["b".to_owned(), "c".to_owned(), "d".to_owned()];
        assert_eq!(
            with_sampled(&fresh, "python3", &picked, all),
            ["d", "c", "a", "e"]
        );
    }
}
