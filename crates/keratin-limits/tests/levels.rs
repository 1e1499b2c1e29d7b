//! Levels, hysteresis, the delay curve and the admission decision, through the public API.
//!
//! Fails if a level flaps around its threshold, clears before free space passes the margin,
//! cannot jump several levels in one sample, if the publish delay is not 0 at soft, the maximum at
//! hard and linear and monotone in between, or if an operation class is blocked (or let through)
//! at the wrong level. Randomized tests replay with `KERATIN_SEED=<n>`.

use keratin_limits::{
    Admission, Decision, DeviceId, DiskLevels, DiskSample, DiskSettings, Level, LevelChange,
    LevelInput, LimitSource, LimitsSettings, MemorySample, Monitor, OperationClass, Reason,
    Thresholds,
};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;

/// Floors at 0 on a 10 000-byte filesystem: soft 1000, hard 500, reserve 100, margin 100.
fn small_disk_settings() -> DiskSettings {
    DiskSettings {
        soft_floor_bytes: 0,
        hard_floor_bytes: 0,
        reserve_floor_bytes: 0,
        ..DiskSettings::default()
    }
}

const TOTAL_BYTES: u64 = 10_000;

fn sample(free_bytes: u64) -> DiskSample {
    DiskSample {
        total_bytes: TOTAL_BYTES,
        free_bytes,
        spare_bytes: 0,
    }
}

fn levels_after(free_bytes: &[u64]) -> Vec<Level> {
    let mut levels = DiskLevels::new(small_disk_settings(), sample(TOTAL_BYTES));
    free_bytes
        .iter()
        .map(|free| levels.observe(sample(*free)))
        .collect()
}

fn proptest_config() -> ProptestConfig {
    let mut config = ProptestConfig::with_cases(512);
    // Replays go through KERATIN_SEED, not regression files left in the source tree.
    config.failure_persistence = None;
    let seed = match std::env::var("KERATIN_SEED") {
        Ok(seed) => seed.parse().expect("KERATIN_SEED is a u64"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock after 1970")
            .as_nanos() as u64,
    };
    config.rng_seed = RngSeed::Fixed(seed);
    eprintln!("proptest seed: replay with KERATIN_SEED={seed}");
    config
}

#[test]
fn thresholds_follow_fractions_when_floors_are_zero() {
    let thresholds = small_disk_settings().thresholds(TOTAL_BYTES);
    assert_eq!(thresholds, Thresholds::new(1000, 500, Some(100), 100));
}

#[test]
fn a_level_is_entered_at_its_threshold_not_above() {
    assert_eq!(levels_after(&[1001, 1000]), [Level::Normal, Level::Soft]);
    assert_eq!(levels_after(&[501, 500]), [Level::Soft, Level::Hard]);
    assert_eq!(levels_after(&[101, 100]), [Level::Hard, Level::Reserve]);
}

#[test]
fn no_flapping_around_a_threshold() {
    let free_bytes = [1000, 1001, 999, 1050, 998, 1100, 1000, 1099, 1100];
    let levels = levels_after(&free_bytes);
    assert!(
        levels.iter().all(|level| *level == Level::Soft),
        "{levels:?}"
    );
}

#[test]
fn a_level_clears_only_past_its_margin() {
    assert_eq!(
        levels_after(&[1000, 1100, 1101]),
        [Level::Soft, Level::Soft, Level::Normal]
    );
    assert_eq!(
        levels_after(&[500, 600, 601]),
        [Level::Hard, Level::Hard, Level::Soft]
    );
    assert_eq!(
        levels_after(&[100, 200, 201]),
        [Level::Reserve, Level::Reserve, Level::Hard]
    );
}

#[test]
fn one_sample_jumps_several_levels_both_ways() {
    assert_eq!(
        levels_after(&[0, TOTAL_BYTES]),
        [Level::Reserve, Level::Normal]
    );
    assert_eq!(levels_after(&[2000, 50]), [Level::Normal, Level::Reserve]);
    // Reserve and hard clear, but 1050 is not past soft's margin (1100): stops at soft.
    assert_eq!(levels_after(&[50, 1050]), [Level::Reserve, Level::Soft]);
    // Reserve clears, hard's margin (600) is not passed: stops at hard.
    assert_eq!(levels_after(&[50, 550]), [Level::Reserve, Level::Hard]);
}

#[test]
fn spares_count_as_free() {
    let mut levels = DiskLevels::new(small_disk_settings(), sample(TOTAL_BYTES));
    let with_spares = DiskSample {
        total_bytes: TOTAL_BYTES,
        free_bytes: 400,
        spare_bytes: 800,
    };
    assert_eq!(levels.observe(with_spares), Level::Normal);
    assert_eq!(
        levels.observe(DiskSample {
            spare_bytes: 0,
            ..with_spares
        }),
        Level::Hard
    );
}

#[test]
fn the_budget_is_a_smaller_filesystem() {
    // 10 GB disk, half free, but a 10 000-byte budget of which 9 600 are used: hard.
    let disk = DiskSample {
        total_bytes: 10_000_000_000,
        free_bytes: 5_000_000_000,
        spare_bytes: 0,
    };
    let levels = DiskLevels::new(
        small_disk_settings(),
        disk.within_budget(TOTAL_BYTES, 9_600),
    );
    assert_eq!(levels.level(), Level::Hard);
    assert_eq!(
        levels.thresholds(),
        small_disk_settings().thresholds(TOTAL_BYTES)
    );
}

proptest! {
    #![proptest_config(proptest_config())]

    /// Hysteresis characterised: the level is never shallower than the thresholds say; it gets
    /// shallower only when every cleared level's margin is passed, and stops at the first level
    /// whose margin is not.
    #[test]
    fn hysteresis_holds_for_any_sequence(free_bytes in prop::collection::vec(0..=TOTAL_BYTES, 1..64)) {
        let thresholds = small_disk_settings().thresholds(TOTAL_BYTES);
        let mut levels = DiskLevels::new(small_disk_settings(), sample(TOTAL_BYTES));
        for free in free_bytes {
            let before = levels.level();
            let after = levels.observe(sample(free));
            let entered = thresholds.entered(free);
            prop_assert!(after >= entered);
            if after < before {
                for cleared in Level::ALL.into_iter().filter(|level| *level > after && *level <= before) {
                    let threshold = thresholds.threshold_bytes(cleared).expect("disk level");
                    prop_assert!(free > threshold + thresholds.clear_margin_bytes);
                }
            }
            if after > entered {
                // Held by hysteresis: only a level already reached can be held.
                prop_assert!(after <= before);
                let threshold = thresholds.threshold_bytes(after).expect("disk level");
                prop_assert!(free <= threshold + thresholds.clear_margin_bytes);
            }
            if after > before {
                prop_assert_eq!(after, entered);
            }
        }
    }

    /// 0 at soft, max at hard, linear (within rounding) and monotone in between.
    #[test]
    fn delay_curve_is_linear_and_monotone(
        hard_bytes in 0u64..1 << 40,
        span_bytes in 1u64..1 << 40,
        max_delay_ms in 0u64..=60_000,
        depth_a in 0.0f64..=1.0,
        depth_b in 0.0f64..=1.0,
    ) {
        let soft_bytes = hard_bytes + span_bytes;
        let admission = Admission::new(&LimitsSettings { max_delay_ms, ..LimitsSettings::default() });
        let delay = |headroom_bytes: u64| {
            let thresholds = Thresholds::new(soft_bytes, hard_bytes, Some(0), 0);
            admission.delay_ms(&LevelInput { level: Level::Soft, headroom_bytes, thresholds }, 0)
        };
        prop_assert_eq!(delay(soft_bytes), 0);
        prop_assert_eq!(delay(hard_bytes), max_delay_ms);
        let headroom = |depth: f64| soft_bytes - (depth * span_bytes as f64) as u64;
        let (a, b) = (headroom(depth_a), headroom(depth_b));
        if a <= b {
            prop_assert!(delay(a) >= delay(b));
        }
        let exact = max_delay_ms as f64 * (soft_bytes - a) as f64 / span_bytes as f64;
        prop_assert!((delay(a) as f64 - exact).abs() <= 1.0, "{} vs {}", delay(a), exact);
    }
}

fn input(level: Level, headroom_bytes: u64) -> LevelInput {
    LevelInput {
        level,
        headroom_bytes,
        thresholds: Thresholds::new(1000, 500, Some(100), 100),
    }
}

#[test]
fn the_batch_counts_against_the_headroom() {
    let admission = Admission::new(&LimitsSettings::default());
    assert_eq!(admission.delay_ms(&input(Level::Soft, 1000), 250), 25);
    assert_eq!(admission.delay_ms(&input(Level::Soft, 750), 0), 25);
    assert_eq!(admission.delay_ms(&input(Level::Soft, 600), 10_000), 50);
    // Only soft slows: normal admits even with the position below soft.
    assert_eq!(admission.delay_ms(&input(Level::Normal, 900), 0), 0);
}

#[test]
fn every_operation_class_at_every_level() {
    use OperationClass::*;
    for class in OperationClass::ALL {
        let allowed: Vec<bool> = Level::ALL
            .iter()
            .map(|level| class.allowed_at(*level))
            .collect();
        let expected = match class {
            Publish => [true, true, false, false],
            ReplicaCatchUp => [true, true, true, false],
            Consume | Settle | Purge | Delete | Metadata | Recovery | Reclaim => [true; 4],
        };
        assert_eq!(allowed, expected, "{class:?}");
    }
}

#[test]
fn publish_decision_at_every_disk_level() {
    let admission = Admission::new(&LimitsSettings::default());
    let decide = |level, headroom_bytes| admission.decide([input(level, headroom_bytes)], None, 0);
    assert_eq!(decide(Level::Normal, 5000), Decision::Admit);
    assert_eq!(decide(Level::Soft, 1050), Decision::Admit);
    assert_eq!(decide(Level::Soft, 750), Decision::Slow { delay_ms: 25 });
    let reject = |level, retry_after_ms| Decision::Reject {
        reason: Reason::Disk,
        level,
        retry_after_ms,
    };
    assert_eq!(decide(Level::Hard, 400), reject(Level::Hard, 1000));
    assert_eq!(decide(Level::Reserve, 50), reject(Level::Reserve, 2000));
}

#[test]
fn memory_rejects_with_a_longer_hint_and_disk_wins_over_memory() {
    let admission = Admission::new(&LimitsSettings::default());
    let memory_hard = input(Level::Hard, 400);
    let memory_reject = Decision::Reject {
        reason: Reason::Memory,
        level: Level::Hard,
        retry_after_ms: 2000,
    };
    assert_eq!(admission.decide([], Some(memory_hard), 0), memory_reject);
    assert_eq!(
        admission.decide([input(Level::Soft, 750)], Some(memory_hard), 0),
        memory_reject
    );
    let both = admission.decide([input(Level::Hard, 400)], Some(memory_hard), 0);
    let disk_reject = Decision::Reject {
        reason: Reason::Disk,
        level: Level::Hard,
        retry_after_ms: 2000,
    };
    assert_eq!(both, disk_reject, "disk reason, longest hint");
    // Two disks at soft: the longer delay applies; one at reserve: the deeper level is reported.
    let slow = admission.decide([input(Level::Soft, 900), input(Level::Soft, 600)], None, 0);
    assert_eq!(slow, Decision::Slow { delay_ms: 40 });
    let deep = admission.decide(
        [input(Level::Hard, 400), input(Level::Reserve, 50)],
        None,
        0,
    );
    assert_eq!(
        deep,
        Decision::Reject {
            reason: Reason::Disk,
            level: Level::Reserve,
            retry_after_ms: 2000
        }
    );
}

#[test]
fn retry_hint_has_a_floor() {
    let settings = LimitsSettings {
        sample_interval_ms: 10,
        ..LimitsSettings::default()
    };
    let admission = Admission::new(&settings);
    assert_eq!(admission.retry_after_ms(Reason::Disk, Level::Hard), 100);
}

fn monitor() -> Monitor {
    let settings = LimitsSettings {
        disk: small_disk_settings(),
        ..LimitsSettings::default()
    };
    Monitor::new(settings).expect("valid settings")
}

#[test]
fn monitor_reports_changes_only() {
    let mut monitor = monitor();
    let device = DeviceId(7);
    assert_eq!(monitor.observe_disk(device, sample(5000), 0), None);
    assert_eq!(monitor.observe_disk(device, sample(4000), 1000), None);
    let change = monitor
        .observe_disk(device, sample(400), 2000)
        .expect("changed");
    let expected = LevelChange::Disk {
        device,
        from: Level::Normal,
        to: Level::Hard,
        free_bytes: 400,
        total_bytes: TOTAL_BYTES,
        at_ms: 2000,
    };
    assert_eq!(change, expected);
    assert_eq!(monitor.observe_disk(device, sample(550), 3000), None);
    let cleared = monitor
        .observe_disk(device, sample(2000), 4000)
        .expect("cleared");
    assert_eq!((cleared.from(), cleared.to()), (Level::Hard, Level::Normal));
    assert!(
        cleared.to_string().contains("from hard to normal"),
        "{cleared}"
    );
}

#[test]
fn monitor_first_sample_past_a_threshold_is_a_change() {
    let mut monitor = monitor();
    let change = monitor
        .observe_disk(DeviceId(1), sample(50), 0)
        .expect("starts at reserve");
    assert_eq!(
        (change.from(), change.to()),
        (Level::Normal, Level::Reserve)
    );
    let memory = MemorySample {
        resident_bytes: 950,
        limit_bytes: 1000,
    };
    let change = monitor
        .observe_memory(memory, LimitSource::Configured, 0)
        .expect("hard");
    assert_eq!((change.from(), change.to()), (Level::Normal, Level::Hard));
}

#[test]
fn monitor_limits_only_partitions_on_the_full_device() {
    let mut monitor = monitor();
    let (full, roomy, unknown) = (DeviceId(1), DeviceId(2), DeviceId(3));
    monitor.observe_disk(full, sample(400), 0);
    monitor.observe_disk(roomy, sample(9000), 0);
    assert_eq!(monitor.decide(&[roomy], 100), Decision::Admit);
    assert_eq!(monitor.decide(&[unknown], 100), Decision::Admit);
    assert!(matches!(
        monitor.decide(&[roomy, full], 100),
        Decision::Reject {
            reason: Reason::Disk,
            ..
        }
    ));
    assert!(monitor.allows(OperationClass::Settle, &[full]));
    assert!(!monitor.allows(OperationClass::Publish, &[full]));
    assert!(monitor.allows(OperationClass::Publish, &[roomy]));

    let memory = MemorySample {
        resident_bytes: 950,
        limit_bytes: 1000,
    };
    monitor.observe_memory(memory, LimitSource::PhysicalFraction, 0);
    let decision = monitor.decide(&[roomy], 100);
    assert!(
        matches!(
            decision,
            Decision::Reject {
                reason: Reason::Memory,
                ..
            }
        ),
        "{decision:?}"
    );
    assert_eq!(monitor.level(&[roomy]), Level::Hard);
}

#[test]
fn monitor_rejects_invalid_settings_and_applies_new_thresholds_on_the_next_sample() {
    let bad = LimitsSettings {
        sample_interval_ms: 0,
        ..LimitsSettings::default()
    };
    assert!(Monitor::new(bad).is_err());
    let mut monitor = monitor();
    monitor.observe_disk(DeviceId(1), sample(1500), 0);
    assert_eq!(monitor.disk_level(DeviceId(1)), Some(Level::Normal));
    let mut settings = monitor.settings().clone();
    settings.disk.soft_fraction = 0.20;
    monitor.set_settings(settings).expect("valid");
    assert_eq!(monitor.disk_level(DeviceId(1)), Some(Level::Normal));
    monitor.observe_disk(DeviceId(1), sample(1500), 1000);
    assert_eq!(monitor.disk_level(DeviceId(1)), Some(Level::Soft));
}
