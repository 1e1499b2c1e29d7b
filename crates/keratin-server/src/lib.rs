//! Keratin's server.
//!
//! # Layout
//! - [`config`]: the node's configuration: its sections, the four sources (defaults, TOML file,
//!   `KERATIN_` environment variables, command-line flags), validation, and `--print-config`.
#![deny(missing_docs)]

pub mod config;
