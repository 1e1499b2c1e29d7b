//! Proves the configuration contract of issues 6 and 8 through the public API: the four sources
//! override each other in order (defaults < file < env < flags) and `print()` names the winner
//! of each key; the issue-6 TOML block is exactly the defaults; `print()` reads back as the same
//! configuration; unknown keys and bad values are refused naming the key, value, expected form
//! and source. A wrong precedence, a lost origin, or an error that drops its key or source fails
//! here. The environment is passed as pairs, so these tests never touch the process environment.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use keratin_server::config::{load, CliOverrides, Config, ConfigError, LoadedConfig, Origin};
use tempfile::TempDir;

const NO_ENV: [(&str, &str); 0] = [];

/// The settings block of issue 6 ("Names"), verbatim.
const ISSUE_6_TOML: &str = r#"
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

fn write_file(dir: &TempDir, text: &str) -> PathBuf {
    let path = dir.path().join("keratin.toml");
    std::fs::write(&path, text).expect("write config file");
    path
}

fn with_file(path: &Path) -> CliOverrides {
    CliOverrides {
        config: Some(path.to_path_buf()),
        ..CliOverrides::default()
    }
}

fn addr(text: &str) -> SocketAddr {
    text.parse().expect("address")
}

/// The line of `print()` that sets `name` under `[section]`.
fn printed_line(loaded: &LoadedConfig, section: &str, name: &str) -> String {
    let text = loaded.print();
    let mut in_section = false;
    for line in text.lines() {
        if line.starts_with('[') {
            in_section = line == format!("[{section}]");
        } else if in_section && line.starts_with(&format!("{name} = ")) {
            return line.to_string();
        }
    }
    panic!("no {section}.{name} in:\n{text}");
}

fn load_error(cli: &CliOverrides, env: &[(&str, &str)]) -> ConfigError {
    load(cli, env.iter().copied()).expect_err("configuration refused")
}

#[test]
fn each_source_overrides_the_ones_below_it() {
    let dir = TempDir::new().expect("tempdir");
    let file = write_file(
        &dir,
        "[server]\nlisten = \"127.0.0.2:1001\"\n[storage]\ndirs = [\"/file\"]\n\
         [limits.disk]\nsoft_fraction = 0.2\n",
    );
    let env = [
        ("KERATIN_SERVER__LISTEN", "127.0.0.3:1002"),
        ("KERATIN_STORAGE__DIRS", r#"["/env/a","/env/b"]"#),
    ];
    let flags = CliOverrides {
        config: Some(file.clone()),
        listen: Some(addr("127.0.0.4:1003")),
        data_dirs: vec![],
        http: None,
        ..CliOverrides::default()
    };

    // Defaults only.
    let loaded = load(&CliOverrides::default(), NO_ENV).expect("defaults");
    assert_eq!(loaded.config(), &Config::default());
    assert_eq!(loaded.origin("server.listen"), Some(Origin::Default));
    assert!(printed_line(&loaded, "server", "listen").ends_with("# default"));

    // The file over the defaults.
    let loaded = load(&with_file(&file), NO_ENV).expect("file");
    assert_eq!(loaded.config().server.listen, addr("127.0.0.2:1001"));
    assert_eq!(loaded.config().limits.disk.soft_fraction, 0.2);
    assert_eq!(
        loaded.origin("server.listen"),
        Some(Origin::File(file.clone()))
    );
    let line = printed_line(&loaded, "server", "listen");
    assert!(
        line.ends_with(&format!("# file {}", file.display())),
        "{line}"
    );
    assert!(printed_line(&loaded, "server", "http").ends_with("# default"));

    // The environment over the file.
    let loaded = load(&with_file(&file), env).expect("env");
    assert_eq!(loaded.config().server.listen, addr("127.0.0.3:1002"));
    assert_eq!(
        loaded.config().storage.dirs,
        vec![PathBuf::from("/env/a"), PathBuf::from("/env/b")]
    );
    let line = printed_line(&loaded, "server", "listen");
    assert!(line.ends_with("# env KERATIN_SERVER__LISTEN"), "{line}");
    let line = printed_line(&loaded, "storage", "dirs");
    assert!(line.ends_with("# env KERATIN_STORAGE__DIRS"), "{line}");
    let line = printed_line(&loaded, "limits.disk", "soft_fraction");
    assert!(
        line.ends_with(&format!("# file {}", file.display())),
        "{line}"
    );

    // Flags over the environment.
    let flags = CliOverrides {
        data_dirs: vec!["/flag".into()],
        http: Some(addr("127.0.0.5:1004")),
        ..flags
    };
    let loaded = load(&flags, env).expect("flags");
    let config = loaded.config();
    assert_eq!(config.server.listen, addr("127.0.0.4:1003"));
    assert_eq!(config.server.http, addr("127.0.0.5:1004"));
    assert_eq!(config.storage.dirs, vec![PathBuf::from("/flag")]);
    assert_eq!(
        loaded.origin("server.listen"),
        Some(Origin::Flag("--listen".into()))
    );
    assert!(printed_line(&loaded, "server", "listen").ends_with("# flag --listen"));
    assert!(printed_line(&loaded, "server", "http").ends_with("# flag --http"));
    assert!(printed_line(&loaded, "storage", "dirs").ends_with("# flag --data-dir"));
    assert!(printed_line(&loaded, "storage", "segment_bytes").ends_with("# default"));
}

#[test]
fn env_sets_nested_limits_and_ignores_names_without_a_section() {
    let env = [
        ("KERATIN_LIMITS__DISK__SOFT_FRACTION", "0.2"),
        ("KERATIN_LIMITS__MEMORY__LIMIT_BYTES", "1073741824"),
        ("KERATIN_NODE__ID", "7"),
        ("KERATIN_SEED", "12345"),
        ("HOME", "/root"),
    ];
    let loaded = load(&CliOverrides::default(), env).expect("env");
    let config = loaded.config();
    assert_eq!(config.limits.disk.soft_fraction, 0.2);
    assert_eq!(config.limits.memory.limit_bytes, 1 << 30);
    assert_eq!(config.node.id.as_deref(), Some("7"));
    assert_eq!(
        loaded.origin("limits.memory.limit_bytes"),
        Some(Origin::Env("KERATIN_LIMITS__MEMORY__LIMIT_BYTES".into()))
    );
}

#[test]
fn issue_6_settings_are_the_defaults() {
    let dir = TempDir::new().expect("tempdir");
    let file = write_file(&dir, ISSUE_6_TOML);
    let loaded = load(&with_file(&file), NO_ENV).expect("issue 6 TOML loads");
    assert_eq!(loaded.config(), &Config::default());
    let parsed: Config = toml::from_str(ISSUE_6_TOML).expect("issue 6 TOML parses");
    assert_eq!(parsed, Config::default());
}

#[test]
fn printed_config_reads_back_as_the_same_config() {
    let dir = TempDir::new().expect("tempdir");
    let file = write_file(
        &dir,
        "[node]\nid = \"n-1\"\n[storage]\nmax_bytes = 1000000\nspare_budget_bytes = 65536\n\
         [limits]\nmax_delay_ms = 20\n[limits.memory]\nsoft_fraction = 0.7\n",
    );
    let env = [("KERATIN_LIMITS__DISK__HARD_FLOOR_BYTES", "1073741824")];
    let flags = CliOverrides {
        listen: Some(addr("[::1]:7000")),
        data_dirs: vec!["/d/a".into(), "/d/b".into()],
        ..with_file(&file)
    };
    for (cli, env) in [(CliOverrides::default(), &[][..]), (flags, &env[..])] {
        let loaded = load(&cli, env.iter().copied()).expect("load");
        let printed = loaded.print();
        let parsed: Config = toml::from_str(&printed).expect("print() output is TOML");
        assert_eq!(&parsed, loaded.config(), "{printed}");

        // The printed text is also a valid `--config` file giving the same configuration.
        let again_dir = TempDir::new().expect("tempdir");
        let again = write_file(&again_dir, &printed);
        let reloaded = load(&with_file(&again), NO_ENV).expect("printed config loads");
        assert_eq!(reloaded.config(), loaded.config());
        for line in printed.lines().filter(|l| l.contains(" = ")) {
            assert!(line.contains("  # "), "value line without origin: {line}");
        }
    }
}

#[test]
fn a_missing_config_file_is_an_error() {
    let dir = TempDir::new().expect("tempdir");
    let missing = dir.path().join("absent.toml");
    match load_error(&with_file(&missing), &[]) {
        ConfigError::File { path, .. } => assert_eq!(path, missing),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn unknown_keys_are_refused_with_key_and_source() {
    let dir = TempDir::new().expect("tempdir");
    let file = write_file(&dir, "[limits.disk]\nsoft_fractoin = 0.2\n");
    let error = load_error(&with_file(&file), &[]);
    let message = error.to_string();
    match error {
        ConfigError::UnknownKey {
            key, origin, known, ..
        } => {
            assert_eq!(key, "limits.disk.soft_fractoin");
            assert_eq!(origin, Origin::File(file.clone()));
            assert!(known.contains("soft_fraction"), "{known}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(message.contains("limits.disk.soft_fractoin"), "{message}");
    assert!(message.contains(&file.display().to_string()), "{message}");

    let file = write_file(&dir, "[nodes]\nid = \"a\"\n");
    match load_error(&with_file(&file), &[]) {
        ConfigError::UnknownKey { key, origin, .. } => {
            assert_eq!(key, "nodes");
            assert_eq!(origin, Origin::File(file));
        }
        other => panic!("unexpected {other:?}"),
    }

    let cli = CliOverrides::default();
    for (name, key) in [
        ("KERATIN_STORAGE__DIRZ", "storage.dirz"),
        ("KERATIN_STORAGES__DIRS", "storages"),
    ] {
        let error = load_error(&cli, &[(name, "[\"/x\"]")]);
        let message = error.to_string();
        assert!(message.contains(&format!("env {name}")), "{message}");
        match error {
            ConfigError::UnknownKey {
                key: got, origin, ..
            } => {
                assert_eq!(got, key);
                assert_eq!(origin, Origin::Env(name.into()));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// Asserts that `error` is `Invalid` for `key` with `value`, an expected form containing
/// `expected`, from `origin`, and that its message says all of it.
fn assert_invalid(error: ConfigError, key: &str, value: &str, expected: &str, origin: &Origin) {
    let message = error.to_string();
    for part in [key, value, expected, &origin.to_string()] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    match error {
        ConfigError::Invalid {
            key: got_key,
            value: got_value,
            expected: got_expected,
            origin: got_origin,
        } => {
            assert_eq!(got_key, key);
            assert_eq!(got_value, value);
            assert!(got_expected.contains(expected), "{got_expected}");
            assert_eq!(&got_origin, origin);
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn bad_values_in_the_file_name_key_value_form_and_file() {
    let dir = TempDir::new().expect("tempdir");
    let cases = [
        (
            "[limits.disk]\nsoft_fraction = 1.5\n",
            "limits.disk.soft_fraction",
            "1.5",
            "a fraction from 0.0 to 1.0",
        ),
        (
            "[storage]\nsegment_bytes = 1000\n",
            "storage.segment_bytes",
            "1000",
            "a multiple of 32768",
        ),
        (
            "[server]\nlisten = \"nope\"\n",
            "server.listen",
            "\"nope\"",
            "an IP address and port",
        ),
        (
            "[storage]\nsegment_bytes = \"big\"\n",
            "storage.segment_bytes",
            "\"big\"",
            "a whole number",
        ),
        (
            "[storage]\ndirs = []\n",
            "storage.dirs",
            "[]",
            "at least one directory",
        ),
        (
            "[storage]\ndirs = [\"/a\", \"/b\", \"/a\"]\n",
            "storage.dirs",
            "\"/a\"",
            "distinct directories",
        ),
        (
            "[limits]\nsample_interval_ms = 0\n",
            "limits.sample_interval_ms",
            "0",
            "from 1 to 60000",
        ),
    ];
    for (text, key, value, expected) in cases {
        let file = write_file(&dir, text);
        let error = load_error(&with_file(&file), &[]);
        assert_invalid(error, key, value, expected, &Origin::File(file));
    }
}

#[test]
fn bad_values_from_env_and_flags_name_their_source() {
    let cli = CliOverrides::default();
    let error = load_error(&cli, &[("KERATIN_SERVER__LISTEN", "nope")]);
    let origin = Origin::Env("KERATIN_SERVER__LISTEN".into());
    assert_invalid(error, "server.listen", "\"nope\"", "an IP address", &origin);

    let error = load_error(&cli, &[("KERATIN_LIMITS__DISK__SOFT_FRACTION", "1.5")]);
    let origin = Origin::Env("KERATIN_LIMITS__DISK__SOFT_FRACTION".into());
    assert_invalid(
        error,
        "limits.disk.soft_fraction",
        "1.5",
        "a fraction",
        &origin,
    );

    // Larger than TOML can hold: refused so that `print()` always reads back.
    let error = load_error(
        &cli,
        &[("KERATIN_STORAGE__MAX_BYTES", "18446744073709551615")],
    );
    let origin = Origin::Env("KERATIN_STORAGE__MAX_BYTES".into());
    assert_invalid(
        error,
        "storage.max_bytes",
        "18446744073709551615",
        "9223372036854775807",
        &origin,
    );

    let flags = CliOverrides {
        data_dirs: vec!["/x".into(), "/x/".into()],
        ..CliOverrides::default()
    };
    let error = load_error(&flags, &[]);
    let origin = Origin::Flag("--data-dir".into());
    assert_invalid(error, "storage.dirs", "\"/x/\"", "distinct", &origin);
}

#[test]
fn a_file_that_is_not_toml_names_the_file() {
    let dir = TempDir::new().expect("tempdir");
    let file = write_file(&dir, "[storage\n");
    let message = load_error(&with_file(&file), &[]).to_string();
    assert!(
        message.contains(&format!("file {}", file.display())),
        "{message}"
    );
}

#[test]
fn the_documented_example_file_is_the_defaults() {
    let doc = include_str!("../../../docs/configuration.md");
    let (_, example) = doc
        .split_once("## Example file")
        .expect("docs/configuration.md has an example file");
    let text = example
        .split("```toml\n")
        .nth(1)
        .and_then(|block| block.split("```").next())
        .expect("a toml block");
    let dir = TempDir::new().expect("tempdir");
    let file = write_file(&dir, text);
    let loaded = load(&with_file(&file), NO_ENV).expect("documented example loads");
    assert_eq!(loaded.config(), &Config::default());
}

/// `[cluster]` from the file, the environment and the flags, in that order of precedence; no
/// section means a node that runs alone; a bad peer list is refused at load, naming it.
#[test]
fn the_cluster_section_comes_from_file_environment_and_flags() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("keratin.toml");
    std::fs::write(
        &file,
        "[cluster]\nnode_id = 1\npeers = [\"1=127.0.0.1:5690\", \"2=127.0.0.2:5690\"]\n",
    )
    .expect("write");
    let alone = load(&CliOverrides::default(), NO_ENV).expect("defaults");
    assert_eq!(alone.config().cluster, None);

    let loaded = load(&with_file(&file), NO_ENV).expect("file");
    let cluster = loaded.config().cluster.clone().expect("a cluster");
    assert_eq!(cluster.node_id, 1);
    assert_eq!(cluster.peers.len(), 2);

    let env = [
        ("KERATIN_CLUSTER__NODE_ID", "2"),
        ("KERATIN_CLUSTER__NAME", "1234"),
        (
            "KERATIN_CLUSTER__PEERS",
            "1=127.0.0.1:5690,2=127.0.0.2:5690,3=127.0.0.3:5690",
        ),
    ];
    let loaded = load(&with_file(&file), env).expect("environment");
    let cluster = loaded.config().cluster.clone().expect("a cluster");
    assert_eq!((cluster.node_id, cluster.name.as_str()), (2, "1234"));
    assert_eq!(cluster.peers.len(), 3);

    let flags = CliOverrides {
        node_id: Some(3),
        cluster_listen: Some(addr("127.0.0.3:5690")),
        peers: vec!["3=127.0.0.3:5690".parse().expect("peer")],
        ..with_file(&file)
    };
    let loaded = load(&flags, env).expect("flags");
    let cluster = loaded.config().cluster.clone().expect("a cluster");
    assert_eq!(cluster.node_id, 3);
    assert_eq!(cluster.listen, Some(addr("127.0.0.3:5690")));
    assert_eq!(cluster.peers.len(), 1);
    assert!(loaded.print().contains("--node-id"), "{}", loaded.print());

    let twice = [(
        "KERATIN_CLUSTER__PEERS",
        "1=127.0.0.1:5690,1=127.0.0.9:5690",
    )];
    let error = load(&with_file(&file), twice).expect_err("a duplicate id");
    assert!(error.to_string().contains("cluster"), "{error}");
}

/// A listener off loopback needs what makes it safe there (the protocol port: logins and TLS;
/// the HTTP port, which serves HTTPS with the same certificate: the same; the cluster port:
/// mutual TLS) or `server.insecure`: without it the configuration is refused, naming the key,
/// its value and what to do; with it (flag, env or file) the node may listen anywhere.
#[test]
fn a_listener_off_loopback_needs_insecure() {
    let exposed = CliOverrides {
        listen: Some(addr("0.0.0.0:5680")),
        ..CliOverrides::default()
    };
    let error = load_error(&exposed, &[]);
    assert_invalid(
        error,
        "server.listen",
        "0.0.0.0:5680",
        "--insecure",
        &Origin::Flag("--listen".into()),
    );
    let error = load_error(
        &CliOverrides::default(),
        &[("KERATIN_SERVER__HTTP", "10.1.2.3:5681")],
    );
    assert_invalid(
        error,
        "server.http",
        "10.1.2.3:5681",
        "logins (server.auth = users, the default) with TLS",
        &Origin::Env("KERATIN_SERVER__HTTP".into()),
    );
    let clustered = CliOverrides {
        node_id: Some(1),
        cluster_listen: Some(addr("192.168.1.1:5690")),
        ..CliOverrides::default()
    };
    let error = load_error(&clustered, &[]);
    assert!(error.to_string().contains("cluster.listen"), "{error}");

    let insecure = CliOverrides {
        insecure: true,
        ..exposed.clone()
    };
    let loaded = load(&insecure, NO_ENV).expect("--insecure allows it");
    assert!(loaded.config().server.insecure);
    assert_eq!(
        loaded.origin("server.insecure"),
        Some(Origin::Flag("--insecure".into()))
    );
    load(&exposed, [("KERATIN_SERVER__INSECURE", "true")]).expect("so does the env");
    load(&clustered, [("KERATIN_SERVER__INSECURE", "true")]).expect("for the cluster port too");
    // The protocol port with logins (the default) and TLS may leave loopback; without logins
    // it may not.
    let tls = [
        ("KERATIN_SERVER__TLS_CERT_FILE", "/etc/keratin/cert.pem"),
        ("KERATIN_SERVER__TLS_KEY_FILE", "/etc/keratin/key.pem"),
    ];
    load(&exposed, tls).expect("logins and TLS");
    let error = load_error(
        &exposed,
        &[tls[0], tls[1], ("KERATIN_SERVER__AUTH", "none")],
    );
    assert!(error.to_string().contains("server.listen"), "{error}");
    // So may the HTTP port, which serves HTTPS with the same certificate; not without logins.
    let http_exposed = [("KERATIN_SERVER__HTTP", "10.1.2.3:5681"), tls[0], tls[1]];
    load(&CliOverrides::default(), http_exposed).expect("HTTPS and logins");
    let error = load_error(
        &CliOverrides::default(),
        &[
            http_exposed[0],
            http_exposed[1],
            http_exposed[2],
            ("KERATIN_SERVER__AUTH", "none"),
        ],
    );
    assert!(error.to_string().contains("server.http"), "{error}");
    // Loopback in all its forms needs nothing.
    let loopback = CliOverrides {
        listen: Some(addr("127.0.0.9:5680")),
        http: Some(addr("[::1]:5681")),
        ..CliOverrides::default()
    };
    load(&loopback, NO_ENV).expect("loopback");
}
