//! `ConfigError`: why a configuration was refused. Every error about a key names the key (dotted),
//! the value, the expected form and the source it came from, whether figment found it while
//! reading a value or a `validate()` found it afterwards.

use std::io;
use std::path::PathBuf;

use figment::error::Kind;
use figment::value::Value;
use figment::Figment;

use super::Origin;

/// A configuration that cannot be used; the node does not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file given with `--config` cannot be read (missing, not permitted, ...).
    #[error("cannot read configuration file {path} given with --config: {source}; check the path")]
    File {
        /// The path as given.
        path: PathBuf,
        /// Why it cannot be read.
        #[source]
        source: io::Error,
    },
    /// A `KERATIN_` environment variable whose name or value is not UTF-8.
    #[error("environment variable {name} is not valid UTF-8; fix or unset it")]
    EnvNotUnicode {
        /// The variable's name, with invalid bytes replaced.
        name: String,
    },
    /// A key that no section has: a typo, or a key of another version.
    #[error("unknown key {key} (from {origin}); {section} accepts: {known}")]
    UnknownKey {
        /// The dotted key, e.g. `limits.disk.soft_fractoin`.
        key: String,
        /// Where it was set.
        origin: Origin,
        /// The section holding it (`[limits.disk]`, or `the top level`).
        section: String,
        /// The keys that section accepts, comma-separated.
        known: String,
    },
    /// A value of the wrong type or out of range.
    #[error("invalid setting {key} = {value} (from {origin}): expected {expected}")]
    Invalid {
        /// The dotted key.
        key: String,
        /// The value as the source gave it, in TOML form.
        value: String,
        /// The accepted form.
        expected: String,
        /// Where it was set.
        origin: Origin,
    },
    /// A source that cannot be read as a whole (a TOML syntax error, say).
    #[error("cannot read the configuration: {message}")]
    Source {
        /// figment's description, naming the source.
        message: String,
    },
}

impl ConfigError {
    /// The error for `key`, whose value failed a check after loading.
    pub(crate) fn invalid(figment: &Figment, key: &str, value: String, expected: &str) -> Self {
        ConfigError::Invalid {
            key: key.to_string(),
            value,
            expected: expected.to_string(),
            origin: origin_of(figment, key),
        }
    }

    /// Turns figment's first error into one that names key, value, form and source.
    pub(crate) fn from_figment(error: figment::Error, figment: &Figment) -> Self {
        let Some(error) = error.into_iter().next() else {
            return ConfigError::Source {
                message: "no error details".to_string(),
            };
        };
        // Array elements appear as indices; the key is the array.
        let path: Vec<&str> = error
            .path
            .iter()
            .map(String::as_str)
            .filter(|part| part.parse::<usize>().is_err())
            .collect();
        match &error.kind {
            Kind::UnknownField(field, known) => {
                // figment's path already ends with the unknown field; serde's would not.
                let section_path = match path.split_last() {
                    Some((last, section)) if last == field => section,
                    _ => &path[..],
                };
                let key = section_path
                    .iter()
                    .copied()
                    .chain([field.as_str()])
                    .collect::<Vec<_>>()
                    .join(".");
                let section = if section_path.is_empty() {
                    "the top level".to_string()
                } else {
                    format!("[{}]", section_path.join("."))
                };
                ConfigError::UnknownKey {
                    origin: origin_of(figment, &key),
                    key,
                    section,
                    known: known.join(", "),
                }
            }
            Kind::InvalidType(actual, expected) | Kind::InvalidValue(actual, expected)
                if !path.is_empty() =>
            {
                let key = path.join(".");
                let value = figment
                    .find_value(&key)
                    .map(|v| render_value(&v))
                    .unwrap_or_else(|_| actual.to_string());
                let expected = expected_form(&key, expected);
                ConfigError::invalid(figment, &key, value, &expected)
            }
            Kind::Message(message) if !path.is_empty() => {
                let key = path.join(".");
                let value = figment
                    .find_value(&key)
                    .map(|v| render_value(&v))
                    .unwrap_or_else(|_| "?".to_string());
                let expected = expected_form(&key, message);
                ConfigError::invalid(figment, &key, value, &expected)
            }
            // A source that failed as a whole: a TOML syntax error names the file in full.
            Kind::Message(message) => {
                let file = error
                    .metadata
                    .as_ref()
                    .and_then(|metadata| metadata.source.as_ref())
                    .and_then(|source| source.file_path());
                let message = match file {
                    Some(path) => format!("{}: {message}", Origin::File(path.to_path_buf())),
                    None => error.to_string(),
                };
                ConfigError::Source { message }
            }
            _ => ConfigError::Source {
                message: error.to_string(),
            },
        }
    }
}

fn origin_of(figment: &Figment, key: &str) -> Origin {
    // Every key that reaches a check was set by some layer; the defaults layer sets them all.
    Origin::of_key(figment, key).unwrap_or(Origin::Default)
}

/// The accepted form of `key` in words. Keys with a form serde cannot describe get their own;
/// the rest translate serde's type name.
fn expected_form(key: &str, serde_expected: &str) -> String {
    let form = match key {
        "server.listen" | "server.http" => "an IP address and port, like \"127.0.0.1:5680\"",
        "storage.dirs" => "an array of directory paths, like [\"/data/a\", \"/data/b\"]",
        "node.id" => "a name in quotes, like \"node-1\"",
        _ => match serde_expected {
            "u64" => "a whole number from 0 to 9223372036854775807",
            "f64" => "a number, like 0.25",
            "a string" => "text in quotes",
            other => other,
        },
    };
    form.to_string()
}

/// `value` as it would be written in TOML, for messages.
pub(crate) fn render_value(value: &Value) -> String {
    match toml::Value::try_from(value) {
        Ok(value) => value.to_string(),
        // Only integers above TOML's range get here; show them as digits all the same.
        Err(_) => match value {
            Value::Num(_, number) => number
                .to_u128()
                .map(|n| n.to_string())
                .unwrap_or_else(|| value.to_actual().to_string()),
            _ => value.to_actual().to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_render_as_toml() {
        assert_eq!(render_value(&Value::from("nope")), "\"nope\"");
        assert_eq!(render_value(&Value::from(1.5)), "1.5");
        assert_eq!(
            render_value(&Value::from(vec!["/a", "/b"])),
            "[\"/a\", \"/b\"]"
        );
    }
}
