//! The nemesis's fault schedule: a seeded pseudo-random sequence of faults (kind, victims,
//! durations, where a corruption lands), the same for the same seed, node count and fault list.
//! Pure: the runner (`nemesis.rs`) carries the steps out on real processes, as many as fit in
//! the run's time (how many do depends on how fast the cluster recovers, so two runs of one
//! seed play the same steps in the same order but may stop after a different number).

use std::time::Duration;

/// One kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// `kill -9` one node, restart it after a while.
    Kill,
    /// `kill -9` a majority at once, restart them all after a while.
    KillMajority,
    /// `kill -9` every node, restart them all after a while.
    KillAll,
    /// `SIGSTOP` one node, `SIGCONT` after a while.
    Pause,
    /// `kill -9` one node, remove its data directory, restart it empty.
    Wipe,
    /// `kill -9` one node, damage one segment file in its data directory, restart it.
    Corrupt,
}

impl FaultKind {
    pub const ALL: [FaultKind; 6] = [
        FaultKind::Kill,
        FaultKind::KillMajority,
        FaultKind::KillAll,
        FaultKind::Pause,
        FaultKind::Wipe,
        FaultKind::Corrupt,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::KillMajority => "kill-majority",
            FaultKind::KillAll => "kill-all",
            FaultKind::Pause => "pause",
            FaultKind::Wipe => "wipe",
            FaultKind::Corrupt => "corrupt",
        }
    }

    pub fn parse(text: &str) -> Result<FaultKind, String> {
        FaultKind::ALL
            .into_iter()
            .find(|k| k.name() == text.trim())
            .ok_or_else(|| {
                format!(
                    "unknown fault {text:?}; known: {}",
                    FaultKind::ALL.map(FaultKind::name).join(",")
                )
            })
    }
}

/// How a segment file is damaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Damage {
    /// One bit flipped somewhere in the written part.
    BitFlip,
    /// The file cut somewhere in the written part.
    Truncate,
    /// The last written bytes (up to 4 KiB) set to zero.
    ZeroTail,
}

/// One step of the schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub kind: FaultKind,
    /// Node indices (0-based) the fault hits, sorted.
    pub victims: Vec<usize>,
    /// How long the victims stay down (killed) or stopped (paused).
    pub down: Duration,
    /// The pause after the cluster recovered, before the next step.
    pub gap: Duration,
    /// Corrupt only: the damage, and a number that picks the file and the place in it.
    pub damage: Damage,
    pub pick: u64,
}

/// SplitMix64: small, seedable, and the same on every platform.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// A duration in `low..high` milliseconds.
    fn millis(&mut self, low: u64, high: u64) -> Duration {
        Duration::from_millis(low + self.below(high - low))
    }

    /// `count` distinct indices of `0..n`, sorted.
    fn pick(&mut self, n: usize, count: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (0..n).collect();
        for i in 0..count.min(n) {
            let j = i + self.below((n - i) as u64) as usize;
            all.swap(i, j);
        }
        let mut chosen = all[..count.min(n)].to_vec();
        chosen.sort_unstable();
        chosen
    }
}

/// The first `steps` steps for `seed` on `nodes` nodes over the fault kinds `faults`: the kinds
/// come in rounds, each round every kind once in a seeded order, so a run of k × (kinds) steps
/// covers every kind k times.
pub fn schedule(seed: u64, nodes: usize, faults: &[FaultKind], steps: usize) -> Vec<Step> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::with_capacity(steps);
    while out.len() < steps && !faults.is_empty() {
        let mut round = faults.to_vec();
        for i in (1..round.len()).rev() {
            round.swap(i, rng.below(i as u64 + 1) as usize);
        }
        for kind in round {
            if out.len() == steps {
                break;
            }
            let victims = match kind {
                FaultKind::Kill | FaultKind::Pause | FaultKind::Wipe => rng.pick(nodes, 1),
                FaultKind::KillMajority => rng.pick(nodes, nodes / 2 + 1),
                FaultKind::KillAll => (0..nodes).collect(),
                // One node: each partition has 3 replicas, so two damaged nodes of 5 can be a
                // majority of one partition's copies (and a node that refuses to start is wiped
                // to go on, which would then lose that partition's majority).
                FaultKind::Corrupt => rng.pick(nodes, 1),
            };
            let down = match kind {
                FaultKind::Pause => rng.millis(2_000, 6_000),
                _ => rng.millis(500, 4_000),
            };
            let damage = match rng.below(3) {
                0 => Damage::BitFlip,
                1 => Damage::Truncate,
                _ => Damage::ZeroTail,
            };
            out.push(Step {
                kind,
                victims,
                down,
                gap: rng.millis(1_000, 4_000),
                damage,
                pick: rng.next_u64(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_schedule_and_another_seed_another() {
        let a = schedule(7, 5, &FaultKind::ALL, 40);
        assert_eq!(a, schedule(7, 5, &FaultKind::ALL, 40));
        assert_ne!(a, schedule(8, 5, &FaultKind::ALL, 40));
        // A shorter schedule is a prefix of a longer one.
        assert_eq!(schedule(7, 5, &FaultKind::ALL, 10), a[..10].to_vec());
    }

    #[test]
    fn every_kind_comes_once_per_round_with_victims_of_its_size() {
        for nodes in [3, 5] {
            let steps = schedule(42, nodes, &FaultKind::ALL, 60);
            for round in steps.chunks(FaultKind::ALL.len()) {
                let mut kinds: Vec<FaultKind> = round.iter().map(|s| s.kind).collect();
                kinds.sort_unstable();
                assert_eq!(kinds, FaultKind::ALL.to_vec());
            }
            for step in &steps {
                let n = step.victims.len();
                let expected = match step.kind {
                    FaultKind::KillMajority => n == nodes / 2 + 1,
                    FaultKind::KillAll => n == nodes,
                    _ => n == 1,
                };
                assert!(expected, "{nodes} nodes: {step:?}");
                assert!(step.victims.windows(2).all(|w| w[0] < w[1]), "{step:?}");
                assert!(step.victims.iter().all(|v| *v < nodes), "{step:?}");
            }
        }
    }

    #[test]
    fn fault_names_parse_back() {
        for kind in FaultKind::ALL {
            assert_eq!(FaultKind::parse(kind.name()), Ok(kind));
        }
        assert!(FaultKind::parse("partition").is_err());
    }
}
