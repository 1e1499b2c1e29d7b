//! `Origin`: which source a configuration value came from, as `--print-config` and error messages
//! name it. It is read back from the figment metadata that [`super::sources`] attaches to each
//! layer; this file owns both the names given to those layers and the way back.

use std::fmt;
use std::path::PathBuf;

use figment::{Figment, Metadata, Profile};

/// The metadata name of the built-in defaults layer.
pub(crate) const DEFAULT_LAYER: &str = "default";
/// The metadata name of the environment layer; its interpolater gives the variable's name.
pub(crate) const ENV_LAYER: &str = "environment variable";
/// The metadata name of the command-line layer; its interpolater gives the flag.
pub(crate) const FLAG_LAYER: &str = "command-line flag";

/// Where a configuration value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The built-in default.
    Default,
    /// The TOML file given with `--config`.
    File(PathBuf),
    /// An environment variable, by its name (`KERATIN_LIMITS__DISK__SOFT_FRACTION`).
    Env(String),
    /// A command-line flag, with its dashes (`--listen`).
    Flag(String),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Default => write!(f, "default"),
            Origin::File(path) => write!(f, "file {}", path.display()),
            Origin::Env(name) => write!(f, "env {name}"),
            Origin::Flag(flag) => write!(f, "flag {flag}"),
        }
    }
}

impl Origin {
    /// The origin of the value at the dotted `key`, or `None` if no layer set that key.
    pub(crate) fn of_key(figment: &Figment, key: &str) -> Option<Origin> {
        let metadata = figment.find_metadata(key)?;
        Some(Origin::from_metadata(metadata, key))
    }

    fn from_metadata(metadata: &Metadata, key: &str) -> Origin {
        let keys: Vec<&str> = key.split('.').collect();
        let interpolated = || metadata.interpolate(&Profile::Default, &keys);
        if let Some(path) = metadata.source.as_ref().and_then(|s| s.file_path()) {
            return Origin::File(path.to_path_buf());
        }
        match metadata.name.as_ref() {
            ENV_LAYER => Origin::Env(interpolated()),
            FLAG_LAYER => Origin::Flag(interpolated()),
            // The defaults layer, and any layer this module did not name (none today), which
            // can only be code in this crate: report it as built in.
            _ => Origin::Default,
        }
    }
}
