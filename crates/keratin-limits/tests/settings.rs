//! The `[limits]` settings as operators write them.
//!
//! Fails if the TOML from issue 6 ("Names") does not parse to the defaults, if a misspelled key
//! is silently ignored, or if a bad value is accepted or rejected without naming its key.

use keratin_limits::{LimitsError, LimitsSettings};
use serde::Deserialize;

/// The settings file from issue 6, verbatim.
const ISSUE_TOML: &str = r#"
[storage]
dirs = ["./keratin-data"]        # startup field
max_bytes = 0                    # optional node storage budget; 0 = none
segment_bytes = 67108864         # startup field (choose the default); the small class is 1/8

[limits]
sample_interval_ms = 1000
max_delay_ms = 50                # slowing at hard; 0 at soft

[limits.disk]
soft_fraction = 0.10
soft_floor_bytes = 4294967296
hard_fraction = 0.05
hard_floor_bytes = 2147483648
reserve_fraction = 0.01
reserve_floor_bytes = 536870912
clear_margin_fraction = 0.01

[limits.memory]
limit_bytes = 0                  # startup field; the limit is the smaller of this and the cgroup's
soft_fraction = 0.80
hard_fraction = 0.90
clear_margin_fraction = 0.05
"#;

#[derive(Deserialize)]
struct File {
    #[expect(dead_code, reason = "the storage section belongs to the server")]
    storage: toml::Table,
    limits: LimitsSettings,
}

fn parse_limits(text: &str) -> Result<LimitsSettings, String> {
    toml::from_str::<LimitsSettings>(text).map_err(|error| error.to_string())
}

#[test]
fn the_issue_toml_parses_to_the_defaults() {
    let file: File = toml::from_str(ISSUE_TOML).expect("issue TOML parses");
    assert_eq!(file.limits, LimitsSettings::default());
    file.limits.validate().expect("defaults are valid");
}

#[test]
fn missing_keys_take_their_defaults() {
    let settings = parse_limits("[disk]\nsoft_floor_bytes = 0\n").expect("parses");
    assert_eq!(settings.disk.soft_floor_bytes, 0);
    assert_eq!(settings.disk.hard_fraction, 0.05);
    assert_eq!(settings.memory, LimitsSettings::default().memory);
    assert_eq!(
        parse_limits("").expect("empty parses"),
        LimitsSettings::default()
    );
}

#[test]
fn settings_roundtrip_through_toml() {
    let text = toml::to_string(&LimitsSettings::default()).expect("serializes");
    assert_eq!(
        parse_limits(&text).expect("parses"),
        LimitsSettings::default()
    );
}

#[test]
fn unknown_keys_are_rejected_by_name() {
    for (text, key) in [
        ("sample_interval = 5\n", "sample_interval"),
        ("[disk]\nsoft_fractoin = 0.2\n", "soft_fractoin"),
        ("[memory]\nlimit = 5\n", "limit"),
        ("[network]\n", "network"),
    ] {
        let error = parse_limits(text).expect_err(text);
        assert!(
            error.contains(&format!("unknown field `{key}`")),
            "{text}: {error}"
        );
    }
}

#[test]
fn values_of_the_wrong_type_are_rejected_at_their_key() {
    let error = parse_limits("[disk]\nsoft_fraction = \"ten percent\"\n").expect_err("string");
    assert!(error.contains("soft_fraction"), "{error}");
    let error = parse_limits("max_delay_ms = -5\n").expect_err("negative");
    assert!(error.contains("max_delay_ms"), "{error}");
}

fn invalid(text: &str) -> (String, String) {
    let settings = parse_limits(text).expect("parses");
    match settings.validate() {
        Err(LimitsError::InvalidSetting { key, value, .. }) => (key.to_string(), value),
        other => panic!("{text}: expected an invalid setting, got {other:?}"),
    }
}

#[test]
fn bad_values_are_rejected_naming_key_and_value() {
    let cases = [
        ("sample_interval_ms = 0\n", "limits.sample_interval_ms", "0"),
        (
            "sample_interval_ms = 600000\n",
            "limits.sample_interval_ms",
            "600000",
        ),
        ("max_delay_ms = 100000\n", "limits.max_delay_ms", "100000"),
        (
            "[disk]\nsoft_fraction = 1.5\n",
            "limits.disk.soft_fraction",
            "1.5",
        ),
        (
            "[disk]\nreserve_fraction = -0.1\n",
            "limits.disk.reserve_fraction",
            "-0.1",
        ),
        (
            "[disk]\nhard_fraction = 0.2\n",
            "limits.disk.hard_fraction",
            "0.2",
        ),
        (
            "[disk]\nreserve_fraction = 0.06\n",
            "limits.disk.reserve_fraction",
            "0.06",
        ),
        (
            "[disk]\nhard_floor_bytes = 5000000000\n",
            "limits.disk.hard_floor_bytes",
            "5000000000",
        ),
        (
            "[disk]\nreserve_floor_bytes = 3000000000\n",
            "limits.disk.reserve_floor_bytes",
            "3000000000",
        ),
        (
            "[disk]\nclear_margin_fraction = 0.95\n",
            "limits.disk.clear_margin_fraction",
            "0.95",
        ),
        (
            "[memory]\nsoft_fraction = 0.95\n",
            "limits.memory.soft_fraction",
            "0.95",
        ),
        (
            "[memory]\nhard_fraction = 2.0\n",
            "limits.memory.hard_fraction",
            "2",
        ),
        (
            "[memory]\nclear_margin_fraction = 0.8\n",
            "limits.memory.clear_margin_fraction",
            "0.8",
        ),
    ];
    for (text, key, value) in cases {
        assert_eq!(
            invalid(text),
            (key.to_string(), value.to_string()),
            "{text}"
        );
    }
}

#[test]
fn the_message_says_what_is_expected() {
    let settings = parse_limits("[disk]\nhard_fraction = 0.2\n").expect("parses");
    let message = settings
        .validate()
        .expect_err("hard above soft")
        .to_string();
    assert_eq!(
        message,
        "invalid setting limits.disk.hard_fraction = 0.2: \
         expected a fraction no larger than limits.disk.soft_fraction"
    );
}

#[test]
fn floors_of_zero_are_valid() {
    let text = "[disk]\nsoft_floor_bytes = 0\nhard_floor_bytes = 0\nreserve_floor_bytes = 0\n";
    parse_limits(text)
        .expect("parses")
        .validate()
        .expect("zero floors are valid");
}
