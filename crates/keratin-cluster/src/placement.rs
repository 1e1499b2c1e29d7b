//! Where a new queue's partitions go: each partition's replicas on distinct nodes, spread so
//! that replicas and preferred leaders (the first node of each set) rotate over the nodes.
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
    fn replicas_are_capped_at_the_node_count() {
        assert_eq!(place(&[1, 2], 1, 3, 1), vec![vec![2, 1]]);
        assert_eq!(place(&[1], 2, 0, 0), vec![vec![1], vec![1]]);
    }
}
