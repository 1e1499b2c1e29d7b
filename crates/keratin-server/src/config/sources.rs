//! The four sources and their order: built-in defaults, the TOML file (`--config`), `KERATIN_`
//! environment variables, then command-line flags; a later source wins key by key. Each source is
//! one figment layer whose metadata lets [`super::Origin`] name it. Checking the merged result is
//! left to [`super::LoadedConfig`]'s constructor.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use figment::providers::{Format, Toml};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};

use super::origin::{DEFAULT_LAYER, ENV_LAYER, FLAG_LAYER};
use super::{Config, ConfigError, LoadedConfig};

/// Only environment variables with this prefix are read.
pub const ENV_PREFIX: &str = "KERATIN_";

/// Separates a section from its key in an environment variable's name:
/// `KERATIN_LIMITS__DISK__SOFT_FRACTION` is `limits.disk.soft_fraction`.
pub const ENV_SEPARATOR: &str = "__";

/// Keys whose environment value is taken as text even when it looks like a number
/// (`KERATIN_NODE__ID=7` is the name `"7"`); every other value is parsed like a TOML value.
const ENV_TEXT_KEYS: &[&str] = &["node.id", "cluster.name"];

/// The command-line flags that override configuration keys; the binary's clap flags fill it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CliOverrides {
    /// `--config FILE`: the TOML file. When given, it must exist.
    pub config: Option<PathBuf>,
    /// `--data-dir DIR`, repeatable: replaces `storage.dirs` when not empty.
    pub data_dirs: Vec<PathBuf>,
    /// `--listen ADDR`: replaces `server.listen`.
    pub listen: Option<SocketAddr>,
    /// `--http ADDR`: replaces `server.http`.
    pub http: Option<SocketAddr>,
    /// `--node-id N`: replaces `cluster.node_id` (and makes the node a cluster member).
    pub node_id: Option<u64>,
    /// `--cluster-listen ADDR`: replaces `cluster.listen`.
    pub cluster_listen: Option<SocketAddr>,
    /// `--peer ID=ADDR`, repeatable: replaces `cluster.peers` when not empty.
    pub peers: Vec<keratin_net::PeerSpec>,
    /// `--join`: sets `cluster.join` (the node joins a running cluster).
    pub join: bool,
    /// `--insecure`: sets `server.insecure` (listeners off loopback with no TLS or login).
    pub insecure: bool,
}

/// Loads the configuration from every source, with `env` as the environment (pairs of name and
/// value; names without the `KERATIN_` prefix are ignored), then checks it.
///
/// Tests pass their own pairs so they never touch the process environment;
/// [`load_from_process_env`] passes the real one.
pub fn load<I, K, V>(cli: &CliOverrides, env: I) -> Result<LoadedConfig, ConfigError>
where
    I: IntoIterator<Item = (K, V)>,
    K: Into<String>,
    V: Into<String>,
{
    let mut figment = Figment::new().merge(defaults_layer());
    if let Some(path) = &cli.config {
        // figment treats a missing file as an error too, but with a bare I/O message; checking
        // first names the path and the flag.
        if let Err(source) = std::fs::metadata(path) {
            return Err(ConfigError::File {
                path: path.clone(),
                source,
            });
        }
        // `file_exact`: a relative path is relative to the working directory; `file` would also
        // search parent directories and could pick up some other node's file.
        figment = figment.merge(Toml::file_exact(path));
    }
    let figment = figment.merge(env_layer(env)).merge(flag_layer(cli));
    LoadedConfig::from_figment(figment)
}

/// [`load`] with the process environment. A `KERATIN_` variable that is not valid UTF-8 is an
/// error, not skipped, so that a setting is never silently ignored.
pub fn load_from_process_env(cli: &CliOverrides) -> Result<LoadedConfig, ConfigError> {
    let mut env = Vec::new();
    for (name, value) in std::env::vars_os() {
        let name_lossy = name.to_string_lossy();
        if !name_lossy.starts_with(ENV_PREFIX) {
            continue;
        }
        match (name.clone().into_string(), value.into_string()) {
            (Ok(name), Ok(value)) => env.push((name, value)),
            _ => return Err(env_not_unicode(name)),
        }
    }
    load(cli, env)
}

fn env_not_unicode(name: OsString) -> ConfigError {
    ConfigError::EnvNotUnicode {
        name: name.to_string_lossy().into_owned(),
    }
}

/// One figment layer: a dictionary and the metadata that names its source.
struct Layer {
    metadata: Metadata,
    dict: Dict,
}

impl Provider for Layer {
    fn metadata(&self) -> Metadata {
        self.metadata.clone()
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        Ok(Profile::Default.collect(self.dict.clone()))
    }
}

fn defaults_layer() -> Layer {
    let dict = Value::serialize(Config::default())
        .ok()
        .and_then(|value| value.into_dict())
        .expect("the defaults are plain values, a struct of structs serializes to a dictionary");
    Layer {
        metadata: Metadata::named(DEFAULT_LAYER),
        dict,
    }
}

/// The `KERATIN_` variables as a layer. Only names with the section separator are read: every
/// key lives in a section, and it leaves other `KERATIN_` variables (`KERATIN_SEED` in tests)
/// alone. A misspelled section or key is then rejected like one in the file.
fn env_layer<I, K, V>(env: I) -> Layer
where
    I: IntoIterator<Item = (K, V)>,
    K: Into<String>,
    V: Into<String>,
{
    let mut dict = Dict::new();
    // Dotted key -> variable name, for error messages and `--print-config`.
    let mut names = BTreeMap::new();
    for (name, value) in env {
        let (name, value) = (name.into(), value.into());
        let Some(rest) = name.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        if !rest.contains(ENV_SEPARATOR) {
            continue;
        }
        let path: Vec<String> = rest
            .split(ENV_SEPARATOR)
            .map(|part| part.to_ascii_lowercase())
            .collect();
        let key = path.join(".");
        let value = if ENV_TEXT_KEYS.contains(&key.as_str()) {
            Value::from(value)
        } else {
            // Text that is no other value is a string, so parsing cannot fail.
            match value.parse::<Value>() {
                Ok(parsed) => parsed,
                Err(never) => match never {},
            }
        };
        insert_at(&mut dict, &path, value);
        names.insert(key, name);
    }
    let names = Arc::new(names);
    let metadata = Metadata::named(ENV_LAYER).interpolater(move |_: &Profile, keys: &[&str]| {
        name_for_key(&names, keys, |key| {
            format!(
                "{ENV_PREFIX}{}",
                key.to_ascii_uppercase().replace('.', ENV_SEPARATOR)
            )
        })
    });
    Layer { metadata, dict }
}

fn flag_layer(cli: &CliOverrides) -> Layer {
    let mut dict = Dict::new();
    let mut names = BTreeMap::new();
    let mut set = |key: &str, flag: &str, value: Value| {
        let path: Vec<String> = key.split('.').map(str::to_string).collect();
        insert_at(&mut dict, &path, value);
        names.insert(key.to_string(), flag.to_string());
    };
    if !cli.data_dirs.is_empty() {
        let dirs = cli
            .data_dirs
            .iter()
            .map(|dir| Value::from(dir.to_string_lossy().into_owned()))
            .collect::<Vec<_>>();
        set("storage.dirs", "--data-dir", Value::from(dirs));
    }
    if let Some(listen) = cli.listen {
        set("server.listen", "--listen", Value::from(listen.to_string()));
    }
    if let Some(http) = cli.http {
        set("server.http", "--http", Value::from(http.to_string()));
    }
    if cli.insecure {
        set("server.insecure", "--insecure", Value::from(true));
    }
    if let Some(node_id) = cli.node_id {
        set("cluster.node_id", "--node-id", Value::from(node_id));
    }
    if let Some(listen) = cli.cluster_listen {
        set(
            "cluster.listen",
            "--cluster-listen",
            Value::from(listen.to_string()),
        );
    }
    if !cli.peers.is_empty() {
        let peers = cli
            .peers
            .iter()
            .map(|peer| Value::from(peer.to_string()))
            .collect::<Vec<_>>();
        set("cluster.peers", "--peer", Value::from(peers));
    }
    if cli.join {
        set("cluster.join", "--join", Value::from(true));
    }
    let names = Arc::new(names);
    let metadata = Metadata::named(FLAG_LAYER).interpolater(move |_: &Profile, keys: &[&str]| {
        name_for_key(&names, keys, |key| format!("--{key}"))
    });
    Layer { metadata, dict }
}

/// The name a layer used for `keys`: exact, else the first name under it (an unknown section
/// `foo` set by `KERATIN_FOO__BAR` is reported with that variable), else `fallback`.
fn name_for_key(
    names: &BTreeMap<String, String>,
    keys: &[&str],
    fallback: impl Fn(&str) -> String,
) -> String {
    let key = keys.join(".");
    if let Some(name) = names.get(&key) {
        return name.clone();
    }
    let prefix = format!("{key}.");
    names
        .range(prefix.clone()..)
        .next()
        .filter(|(k, _)| k.starts_with(&prefix))
        .map(|(_, name)| name.clone())
        .unwrap_or_else(|| fallback(&key))
}

/// Puts `value` at `path` in `dict`, making sections as needed. A later value replaces an earlier
/// one, including a section that the same source also set key by key.
fn insert_at(dict: &mut Dict, path: &[String], value: Value) {
    match path {
        [] => {}
        [last] => {
            dict.insert(last.clone(), value);
        }
        [first, rest @ ..] => {
            let entry = dict
                .entry(first.clone())
                .or_insert_with(|| Value::from(Dict::new()));
            if entry.as_dict().is_none() {
                *entry = Value::from(Dict::new());
            }
            if let Value::Dict(_, inner) = entry {
                insert_at(inner, rest, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_names_map_to_dotted_keys() {
        let layer = env_layer([
            ("KERATIN_LIMITS__DISK__SOFT_FRACTION", "0.2"),
            ("KERATIN_STORAGE__DIRS", r#"["/a","/b"]"#),
            ("KERATIN_NODE__ID", "7"),
            ("KERATIN_SEED", "42"),
            ("PATH", "/bin"),
        ]);
        let figment = Figment::from(layer);
        assert_eq!(
            figment
                .extract_inner::<f64>("limits.disk.soft_fraction")
                .expect("fraction"),
            0.2
        );
        assert_eq!(
            figment
                .extract_inner::<Vec<PathBuf>>("storage.dirs")
                .expect("dirs"),
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        assert_eq!(figment.extract_inner::<String>("node.id").expect("id"), "7");
        assert!(!figment.contains("seed"), "names without __ are not read");
    }

    #[test]
    fn names_fall_back_to_a_key_under_a_section() {
        let names = BTreeMap::from([("foo.bar".to_string(), "KERATIN_FOO__BAR".to_string())]);
        let fallback = |key: &str| format!("?{key}");
        assert_eq!(name_for_key(&names, &["foo"], fallback), "KERATIN_FOO__BAR");
        assert_eq!(name_for_key(&names, &["fo"], fallback), "?fo");
    }

    #[test]
    fn insert_at_replaces_a_leaf_with_a_section() {
        let mut dict = Dict::new();
        insert_at(&mut dict, &["a".into()], Value::from(1u64));
        insert_at(&mut dict, &["a".into(), "b".into()], Value::from(2u64));
        let value = Value::from(dict);
        assert_eq!(
            value.find_ref("a.b").and_then(|v| v.to_u128()),
            Some(2),
            "{value:?}"
        );
    }
}
