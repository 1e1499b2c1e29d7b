//! The node's configuration: its sections and defaults, the four sources and their precedence
//! (defaults < TOML file < `KERATIN_` environment < command-line flags), the checks, and
//! `--print-config` with the origin of every value. Applying runtime changes (the admin API) and
//! parsing the command line (the binary's clap flags) are left to others. `docs/configuration.md`
//! documents every key.
//!
//! - [`sections`]: `Config` and its sections, defaults, `startup_fields()`, storage checks.
//! - [`sources`]: `CliOverrides`, `load`, `load_from_process_env`: the layers and their order.
//! - [`loaded_config`]: `LoadedConfig`: the checked result, `origin(key)` and `print()`.
//! - [`origin`]: `Origin`: default, file, env or flag.
//! - [`error`]: `ConfigError`, why a configuration is refused.

pub mod error;
pub mod loaded_config;
pub mod origin;
pub mod sections;
pub mod sources;

pub use error::ConfigError;
pub use loaded_config::LoadedConfig;
pub use origin::Origin;
pub use sections::{startup_fields, Config, NodeSection, ServerSection, StorageSection};
pub use sources::{load, load_from_process_env, CliOverrides};
