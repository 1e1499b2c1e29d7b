//! Keratin's server: the TCP protocol server, the HTTP admin API, and configuration loading.
//!
//! # Layout
//! - [`config`]: the node's configuration: its sections, the four sources (defaults, TOML file,
//!   `KERATIN_` environment variables, command-line flags), validation, and `--print-config`.
//! - [`node`]: [`Node`], a running broker with its listeners, started from a [`config::Config`].
//! - [`tcp`]: the protocol server: handshake, one task per connection, bounded queues,
//!   heartbeats, graceful shutdown.
//! - [`http`]: the admin API (axum): `/health`, `/api/v1/queues`, `/api/v1/status`,
//!   `/api/v1/attention`, `/api/v1/settings`, `/metrics`, and the dashboard at `/`.
//! - [`audit`]: [`audit::AuditLog`], the audit trail: who changed queues, settings, users and
//!   the cluster, and refused logins, bounded in memory and in `audit.log` (`GET /api/v1/audit`).
//! - [`attention`]: [`attention::Attention`], the persisted list of what needs an operator.
//! - [`cluster_watch`]: [`cluster_watch::ClusterWatch`], a cluster node's attention items
//!   (partitions below a majority in sync or without a leader, unreachable or limited nodes).
//! - [`limits`]: [`limits::NodeLimits`], the sampler and the publish gate over `keratin-limits`.
//! - [`metrics`]: `/metrics` in the Prometheus text format.
//! - [`settings`]: runtime settings: overrides stored in the node metadata, checked whole and
//!   applied live (`GET/PUT /api/v1/settings`).
//! - [`storage_lock`]: [`storage_lock::StorageLock`], one node per storage directory (`flock`
//!   on `keratin.lock`, held for the node's life).
//! - [`history`]: the recent free space of each file system, for the dashboard's plot.
//! - [`time_to_full`]: each file system's projected time to its hard and reserve levels.
//! - [`convert`]: wire types to broker types and back.
//! - [`tls`]: TLS on the protocol port, its certificate reloaded on SIGHUP.
#![deny(missing_docs)]

pub mod access;
pub mod attention;
pub mod audit;
pub mod cluster_watch;
pub mod config;
pub mod convert;
pub mod history;
pub mod http;
pub mod limits;
pub mod metrics;
pub mod node;
pub mod quota;
pub mod settings;
pub mod storage_lock;
pub mod tcp;
pub mod time_to_full;
pub mod tls;

pub use node::{Node, NodeError};
