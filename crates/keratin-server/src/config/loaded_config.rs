//! `LoadedConfig`: a configuration that passed every check, with the merged sources kept so
//! that each value can say where it came from (`--print-config`, error messages, and later the
//! admin API). Reading the sources is left to [`super::sources`].

use figment::value::Value;
use figment::Figment;
use keratin_limits::LimitsError;

use super::error::render_value;
use super::sections::KeyError;
use super::{Config, ConfigError, Origin};

/// Optional keys, which `--print-config` shows as a comment when unset.
const OPTIONAL_KEYS: &[&str] = &["node.id", "storage.spare_budget_bytes"];

/// The largest integer a TOML file can hold. Larger values (possible from the environment) are
/// refused so that `--print-config` output always reads back as the same configuration.
const TOML_INTEGER_MAX: u128 = i64::MAX as u128;

/// A checked configuration and where each of its values came from.
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    config: Config,
    figment: Figment,
}

impl LoadedConfig {
    /// Extracts the configuration from the merged sources and checks every key.
    pub(crate) fn from_figment(figment: Figment) -> Result<Self, ConfigError> {
        let config: Config = figment
            .extract()
            .map_err(|error| ConfigError::from_figment(error, &figment))?;
        let loaded = LoadedConfig { config, figment };
        loaded.validate()?;
        Ok(loaded)
    }

    /// Checks every key, and that no listener leaves loopback unsafely (without logins and
    /// TLS, or mutual TLS for the cluster port) unless `server.insecure`.
    fn validate(&self) -> Result<(), ConfigError> {
        let key_error = |error: KeyError| {
            ConfigError::invalid(&self.figment, error.key, error.value, error.expected)
        };
        self.config.node.validate().map_err(key_error)?;
        self.config.server.validate().map_err(key_error)?;
        self.config.storage.validate().map_err(key_error)?;
        // Each listener with what makes it safe off loopback: the protocol and HTTP ports with
        // logins and TLS (one certificate serves both), the cluster port with mutual TLS.
        let server = &self.config.server;
        let logins_and_tls =
            server.auth == crate::access::AuthMode::Users && server.tls_cert_file.is_some();
        let mut listeners = vec![
            (
                "server.listen",
                server.listen,
                logins_and_tls,
                PROTOCOL_EXPOSED,
            ),
            ("server.http", server.http, logins_and_tls, HTTP_EXPOSED),
        ];
        if let Some(cluster) = &self.config.cluster {
            let resolved = cluster.resolve().map_err(|error| ConfigError::Source {
                message: format!("[cluster]: {error}"),
            })?;
            let cluster_safe = matches!(cluster.tls.files(), Ok(Some(_)));
            listeners.push((
                "cluster.listen",
                resolved.listen,
                cluster_safe,
                CLUSTER_EXPOSED,
            ));
        }
        if !server.insecure {
            if let Some((key, addr, _, expected)) = listeners
                .iter()
                .find(|(_, addr, safe, _)| !addr.ip().is_loopback() && !safe)
            {
                return Err(ConfigError::invalid(
                    &self.figment,
                    key,
                    addr.to_string(),
                    expected,
                ));
            }
        }
        self.config.limits.validate().map_err(|error| match error {
            LimitsError::InvalidSetting {
                key,
                value,
                expected,
            } => ConfigError::invalid(&self.figment, key, value, expected),
            other => ConfigError::Source {
                message: other.to_string(),
            },
        })?;
        self.validate_toml_integers()
    }

    fn validate_toml_integers(&self) -> Result<(), ConfigError> {
        let Ok(value) = Value::serialize(&self.config) else {
            return Ok(());
        };
        match oversized_integer(&value, &mut Vec::new()) {
            None => Ok(()),
            Some((key, number)) => Err(ConfigError::invalid(
                &self.figment,
                &key,
                render_value(&number),
                "a whole number up to 9223372036854775807, the largest a TOML file can hold",
            )),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The configuration, without its origins.
    pub fn into_config(self) -> Config {
        self.config
    }

    /// Where the value of the dotted `key` came from (`"limits.disk.soft_fraction"`), or `None`
    /// for a key that no source set, such as an unknown key. `key` names a value, not a section.
    pub fn origin(&self, key: &str) -> Option<Origin> {
        Origin::of_key(&self.figment, key)
    }

    /// Where every value of the configuration came from, by dotted key (the admin API's
    /// settings document). Keys no source set are missing, which means the default.
    pub fn origins(&self) -> std::collections::BTreeMap<String, Origin> {
        let mut origins = std::collections::BTreeMap::new();
        if let Ok(value) = toml::Value::try_from(&self.config) {
            collect_origins(self, &value, "", &mut origins);
        }
        origins
    }

    /// The effective configuration as TOML (`keratin serve --print-config`). Every value line
    /// ends with a comment naming its origin: `# default`, `# file /etc/keratin.toml`,
    /// `# env KERATIN_SERVER__LISTEN`, `# flag --listen`. The text reads back as the same
    /// configuration.
    pub fn print(&self) -> String {
        let value = toml::Value::try_from(&self.config)
            .expect("every integer fits TOML: checked when the configuration was loaded");
        let mut lines = Vec::new();
        if let Some(table) = value.as_table() {
            print_table(self, &mut lines, "", table);
        }
        let width = lines
            .iter()
            .filter_map(|line| line.comment.as_ref().map(|_| line.text.len()))
            .max()
            .unwrap_or(0);
        let mut out = String::from(
            "# Keratin's effective configuration; each value says where it came from.\n",
        );
        for line in lines {
            match line.comment {
                Some(comment) => out.push_str(&format!("{:width$}  # {comment}\n", line.text)),
                None => out.push_str(&format!("{}\n", line.text)),
            }
        }
        out
    }
}

struct PrintLine {
    text: String,
    comment: Option<String>,
}

/// Appends `table`'s values, then its sub-tables, each under its own `[header]`.
fn print_table(
    loaded: &LoadedConfig,
    lines: &mut Vec<PrintLine>,
    prefix: &str,
    table: &toml::Table,
) {
    let mut leaves = Vec::new();
    for (name, value) in table {
        let key = dotted(prefix, name);
        if !value.is_table() {
            let origin = loaded.origin(&key).unwrap_or(Origin::Default);
            leaves.push(PrintLine {
                text: format!("{name} = {value}"),
                comment: Some(origin.to_string()),
            });
        }
    }
    for key in OPTIONAL_KEYS {
        if let Some(name) = key
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix('.'))
        {
            if !prefix.is_empty() && !name.contains('.') && !table.contains_key(name) {
                leaves.push(PrintLine {
                    text: format!("# {name} is not set"),
                    comment: Some(Origin::Default.to_string()),
                });
            }
        }
    }
    if !prefix.is_empty() {
        if !lines.is_empty() {
            lines.push(PrintLine {
                text: String::new(),
                comment: None,
            });
        }
        lines.push(PrintLine {
            text: format!("[{prefix}]"),
            comment: None,
        });
    }
    lines.extend(leaves);
    for (name, value) in table {
        if let Some(sub) = value.as_table() {
            print_table(loaded, lines, &dotted(prefix, name), sub);
        }
    }
}

fn collect_origins(
    loaded: &LoadedConfig,
    value: &toml::Value,
    prefix: &str,
    origins: &mut std::collections::BTreeMap<String, Origin>,
) {
    match value.as_table() {
        Some(table) => {
            for (name, inner) in table {
                collect_origins(loaded, inner, &dotted(prefix, name), origins);
            }
        }
        None => {
            if let Some(origin) = loaded.origin(prefix) {
                origins.insert(prefix.to_string(), origin);
            }
        }
    }
}

fn dotted(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// The first integer in `value` larger than TOML allows, with its dotted key.
fn oversized_integer(value: &Value, path: &mut Vec<String>) -> Option<(String, Value)> {
    match value {
        Value::Num(_, number) => number
            .to_u128()
            .filter(|n| *n > TOML_INTEGER_MAX)
            .map(|_| (path.join("."), value.clone())),
        Value::Dict(_, dict) => dict.iter().find_map(|(name, inner)| {
            path.push(name.clone());
            let found = oversized_integer(inner, path);
            path.pop();
            found
        }),
        Value::Array(_, items) => items
            .iter()
            .find_map(|inner| oversized_integer(inner, path)),
        _ => None,
    }
}

/// What the protocol port off loopback needs (see `server.insecure`).
const PROTOCOL_EXPOSED: &str = "a loopback address (127.0.0.0/8 or ::1), or logins \
     (server.auth = users, the default) with TLS (server.tls_cert_file and tls_key_file): \
     without both, passwords or everything else travel in the clear or anyone who reaches the \
     port may publish, consume and delete queues; to serve it that way anyway, set \
     server.insecure = true (flag --insecure, env KERATIN_SERVER__INSECURE=true)";

/// What the HTTP port off loopback needs (see `server.insecure`).
const HTTP_EXPOSED: &str = "a loopback address (127.0.0.0/8 or ::1), or logins \
     (server.auth = users, the default) with TLS (server.tls_cert_file and tls_key_file, which \
     serve HTTPS on this port too): without both, the admin API's passwords and tokens travel \
     in the clear or anyone who reaches the port may change settings and delete queues; to \
     serve it that way anyway, set server.insecure = true (flag --insecure, env \
     KERATIN_SERVER__INSECURE=true)";

/// What the cluster port off loopback needs.
const CLUSTER_EXPOSED: &str = "a loopback address (127.0.0.0/8 or ::1), or mutual TLS between \
     the nodes (cluster.tls_cert_file, tls_key_file and tls_ca_file): without it anyone who \
     reaches the port could pose as a node; to serve it that way anyway, set \
     server.insecure = true (flag --insecure, env KERATIN_SERVER__INSECURE=true)";
