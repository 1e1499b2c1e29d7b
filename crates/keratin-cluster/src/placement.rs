//! Where a new queue's partitions go: each partition's replicas on distinct nodes, on the nodes
//! below the soft level with the most free disk ([`eligible`], from what the nodes last said in
//! their `HELLO`), with the preferred leaders (the first node of each set) rotating over them.
//! Pure: the proposer computes it and the record carries it, so every node applies the same.

/// The replica sets of `partitions` partitions with `replicas` copies each over `nodes`
/// (node ids), rotating from `start` (a hash of the queue name spreads queues). `replicas` is
/// capped at the node count.
pub fn place(nodes: &[u64], partitions: u32, replicas: u32, start: u64) -> Vec<Vec<u64>> {
    let mut sorted: Vec<u64> = nodes.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let n = sorted.len();
    if n == 0 {
        return vec![Vec::new(); partitions as usize];
    }
    let copies = (replicas as usize).clamp(1, n);
    (0..u64::from(partitions))
        .map(|p| {
            let first = ((start + p) % n as u64) as usize;
            (0..copies).map(|k| sorted[(first + k) % n]).collect()
        })
        .collect()
}

/// The nodes that may take new replicas with their free bytes, most free first (unknown
/// last, ties by id): every node but those known to be at `soft` or worse (a node not heard
/// from yet counts as normal). Also the nodes left out, with their level.
#[allow(clippy::type_complexity)]
pub fn eligible(
    nodes: &[u64],
    health: impl Fn(u64) -> (Option<String>, Option<u64>),
) -> (Vec<(u64, Option<u64>)>, Vec<(u64, String)>) {
    let mut kept = Vec::new();
    let mut left_out = Vec::new();
    for &id in nodes {
        let (level, free) = health(id);
        match level {
            Some(level) if level != "normal" => left_out.push((id, level)),
            _ => kept.push((id, free)),
        }
    }
    let key = |free: &Option<u64>| free.map_or((0, 0), |f| (1, f));
    kept.sort_by(|(a, fa), (b, fb)| key(fb).cmp(&key(fa)).then(a.cmp(b)));
    kept.dedup_by_key(|(id, _)| *id);
    (kept, left_out)
}

/// Replica sets over the eligible nodes (see [`eligible`]): when enough of them have about as
/// much free space as the emptiest (within 10 %, or not known yet), the sets rotate over those
/// by [`place`], so queues spread; otherwise the nodes with the most free space take the
/// replicas, preferred leaders rotating over them.
pub fn place_by_space(
    eligible: &[(u64, Option<u64>)],
    partitions: u32,
    replicas: u32,
    start: u64,
) -> Vec<Vec<u64>> {
    let most = eligible.iter().filter_map(|(_, f)| *f).max().unwrap_or(0);
    let tier: Vec<u64> = eligible
        .iter()
        .filter(|(_, free)| free.is_none_or(|f| f >= most - most / 10))
        .map(|(id, _)| *id)
        .collect();
    if tier.len() >= replicas as usize {
        return place(&tier, partitions, replicas, start);
    }
    let order: Vec<u64> = eligible.iter().map(|(id, _)| *id).collect();
    if order.is_empty() {
        return vec![Vec::new(); partitions as usize];
    }
    let copies = (replicas as usize).clamp(1, order.len());
    let chosen = &order[..copies];
    (0..u64::from(partitions))
        .map(|p| {
            let first = ((start + p) % copies as u64) as usize;
            (0..copies).map(|k| chosen[(first + k) % copies]).collect()
        })
        .collect()
}

/// The replica sets of `partitions` partitions pinned to `nodes` (`keratin queue declare
/// --nodes`): every partition on every named node, partition `p`'s list starting at the
/// `p mod n`-th node, so the first named leads partition 0 and the preferred leaders rotate.
pub fn place_pinned(nodes: &[u64], partitions: u32) -> Vec<Vec<u64>> {
    if nodes.is_empty() {
        return vec![Vec::new(); partitions as usize];
    }
    (0..partitions as usize)
        .map(|p| {
            (0..nodes.len())
                .map(|k| nodes[(p + k) % nodes.len()])
                .collect()
        })
        .collect()
}

/// A stable hash of a queue name (FNV-1a), to rotate placements between queues.
pub fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_are_distinct_and_leaders_rotate() {
        let sets = place(&[3, 1, 2], 3, 3, 0);
        assert_eq!(sets, vec![vec![1, 2, 3], vec![2, 3, 1], vec![3, 1, 2]]);
        for set in place(&[1, 2, 3, 4, 5], 8, 3, 7) {
            let mut unique = set.clone();
            unique.sort_unstable();
            unique.dedup();
            assert_eq!(unique.len(), 3, "{set:?}");
        }
    }

    #[test]
    fn nodes_at_soft_or_worse_get_no_replicas_and_free_space_decides() {
        const GIB: u64 = 1 << 30;
        let health = |id: u64| match id {
            1 => (Some("normal".to_string()), Some(10 * GIB)),
            2 => (Some("soft".to_string()), Some(50 * GIB)),
            3 => (Some("normal".to_string()), Some(40 * GIB)),
            4 => (None, None),
            5 => (Some("hard".to_string()), Some(GIB)),
            _ => (Some("normal".to_string()), Some(20 * GIB)),
        };
        let (order, left_out) = eligible(&[1, 2, 3, 4, 5, 6], health);
        let ids: Vec<u64> = order.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, vec![3, 6, 1, 4], "most free first, unknown last");
        assert_eq!(
            left_out,
            vec![(2, "soft".to_string()), (5, "hard".to_string())]
        );
        // Free space differs: the three with the most take the replicas, leaders rotating.
        let sets = place_by_space(&order, 3, 3, 0);
        assert_eq!(sets, vec![vec![3, 6, 1], vec![6, 1, 3], vec![1, 3, 6]]);
        // About equal free space (and a node not heard from): queues spread over all of them.
        let even = [
            (1, Some(100 * GIB)),
            (2, Some(95 * GIB)),
            (3, None),
            (4, Some(92 * GIB)),
        ];
        let mut used = std::collections::BTreeSet::new();
        for start in 0..4 {
            let sets = place_by_space(&even, 1, 2, start);
            used.extend(sets.into_iter().flatten());
        }
        assert_eq!(used.into_iter().collect::<Vec<_>>(), vec![1, 2, 3, 4]);
        assert_eq!(place_by_space(&[], 2, 3, 0), vec![Vec::<u64>::new(); 2]);
    }

    #[test]
    fn pinned_replicas_keep_the_named_nodes_and_rotate_leaders() {
        assert_eq!(
            place_pinned(&[3, 1], 3),
            vec![vec![3, 1], vec![1, 3], vec![3, 1]]
        );
        assert_eq!(place_pinned(&[2], 2), vec![vec![2], vec![2]]);
    }

    #[test]
    fn replicas_are_capped_at_the_node_count() {
        assert_eq!(place(&[1, 2], 1, 3, 1), vec![vec![2, 1]]);
        assert_eq!(place(&[1], 2, 0, 0), vec![vec![1], vec![1]]);
    }
}
