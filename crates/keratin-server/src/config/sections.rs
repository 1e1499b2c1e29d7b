//! `Config` and its sections: the TOML names, the defaults, which keys are startup fields, and
//! the checks of the keys this crate owns. The `[limits]` section is `keratin_limits::LimitsSettings`
//! and is checked by its own `validate()`. Where values come from is left to [`super::sources`].
//!
//! The TOML names are what operators and scripts rely on (issue 6, "Names"): renaming a key is a
//! breaking change. `docs/configuration.md` documents every key.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use keratin_limits::LimitsSettings;
use serde::{Deserialize, Serialize};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const GIB: u64 = 1024 * MIB;

/// The default client (TCP) port. Near AMQP's 5672 so that firewall rules for brokers are easy
/// to write, but distinct from it and from RabbitMQ's other ports, so both can run on one host.
pub const LISTEN_PORT_DEFAULT: u16 = 5680;

/// The default HTTP port (admin API, metrics, dashboard): the client port plus one.
pub const HTTP_PORT_DEFAULT: u16 = 5681;

/// The default full segment size, 64 MiB; matches `keratin_log::DEFAULT_SEGMENT_SIZE_BYTES`.
pub const SEGMENT_BYTES_DEFAULT: u64 = 64 * MIB;

/// The smallest `storage.segment_bytes`; matches `keratin_log::MIN_SEGMENT_SIZE_BYTES`.
pub const SEGMENT_BYTES_MIN: u64 = 256 * KIB;

/// The largest `storage.segment_bytes`: byte positions in the log's sparse index are `u32`;
/// matches `keratin_log::MAX_SEGMENT_SIZE_BYTES`.
pub const SEGMENT_BYTES_MAX: u64 = 4 * GIB;

/// `storage.segment_bytes` is a multiple of this, so that the small size class (one eighth of
/// a full segment, used by cursor and metadata logs) is a whole number of 4 KiB pages.
pub const SEGMENT_BYTES_ALIGN: u64 = 32 * KIB;

const _: () = assert!(SEGMENT_BYTES_ALIGN / 8 == 4 * KIB);
const _: () = assert!(SEGMENT_BYTES_MIN.is_multiple_of(SEGMENT_BYTES_ALIGN));
const _: () = assert!(SEGMENT_BYTES_MAX.is_multiple_of(SEGMENT_BYTES_ALIGN));
const _: () = assert!(SEGMENT_BYTES_DEFAULT.is_multiple_of(SEGMENT_BYTES_ALIGN));
const _: () = assert!(SEGMENT_BYTES_MIN <= SEGMENT_BYTES_DEFAULT);
const _: () = assert!(SEGMENT_BYTES_DEFAULT <= SEGMENT_BYTES_MAX);

/// The dotted keys that take effect only at startup: changing them needs a restart.
///
/// Every other key under `limits.*` is a runtime setting: it is read at startup too, and later
/// changed live through the admin API (`PUT /api/v1/settings`, issue 8). `limits.memory.limit_bytes`
/// is the exception because it describes the node's machine. The remaining `storage.*` keys
/// (`max_bytes`, `spare_budget_bytes`) are read at startup until the admin API can change them.
pub fn startup_fields() -> &'static [&'static str] {
    &[
        "node.id",
        "server.listen",
        "server.http",
        "server.delivery_bytes_max",
        "server.outbound_bytes_max",
        "server.connections_max",
        "server.queues_max",
        "server.partitions_max",
        "server.consumers_max",
        "server.worker_threads",
        "server.blocking_threads_max",
        "storage.dirs",
        "server.publish_timeout_ms",
        "storage.segment_bytes",
        "storage.commit_workers",
        "storage.idle_release_after_ms",
        "limits.memory.limit_bytes",
    ]
}

/// The whole configuration of a node, as read from every source.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `[node]`.
    pub node: NodeSection,
    /// `[server]`.
    pub server: ServerSection,
    /// `[storage]`.
    pub storage: StorageSection,
    /// `[limits]`: the resource-limit thresholds (issue 6), owned by `keratin-limits`.
    pub limits: LimitsSettings,
    /// `[cluster]`: this node's id, its cluster listener and the cluster's nodes (owned by
    /// `keratin-net`, fields in its `config` module). Absent: the node runs alone. Startup
    /// section.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<keratin_net::ClusterConfig>,
}

/// The `[node]` section.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeSection {
    /// The node's name in status output and, later, in the cluster. Unset: the server derives
    /// one when it starts (that is the server's job, not the configuration's). Startup field.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

/// The `[server]` section: where the node listens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSection {
    /// The client protocol (TCP) address. Startup field.
    pub listen: SocketAddr,
    /// The HTTP address: admin API, `/metrics` and the dashboard. Startup field.
    pub http: SocketAddr,
    /// Node-wide bound on delivery bytes held in memory (read for consumers, not yet flushed to
    /// their sockets); 0 = sized from the memory limit. Startup field.
    pub delivery_bytes_max: u64,
    /// Bound on one connection's delivery bytes not yet flushed to its socket; 0 = a
    /// sixteenth of the node's delivery budget, at most 16 MiB. Startup field.
    pub outbound_bytes_max: u64,
    /// Most open protocol connections; past it a new one is refused (429 `connections` in the
    /// handshake) and closed. Startup field.
    pub connections_max: u64,
    /// Most queues of the node; past it a declare is refused with 409. Startup field.
    pub queues_max: u64,
    /// Most partitions over all queues of the node; past it a declare is refused with 409.
    /// Startup field.
    pub partitions_max: u64,
    /// Most consumers over all connections of the node; past it a subscribe is refused with
    /// 429 `consumers`. Startup field.
    pub consumers_max: u64,
    /// Threads of the async runtime (connections, HTTP, partition owners); 0 = one per CPU
    /// the process may use. Startup field.
    pub worker_threads: u64,
    /// Most threads of the runtime's blocking pool (log opens, reads for deliveries, heals,
    /// metadata appends, samples); work past it waits in the pool's queue. Startup field.
    pub blocking_threads_max: u64,
    /// A publish not confirmed within this many milliseconds is answered 504 (outcome
    /// unknown) instead of waiting on for a stalled disk. Startup field.
    pub publish_timeout_ms: u64,
    /// Serve on addresses other than loopback although this version has neither TLS nor
    /// logins: anyone who reaches such a port may publish, consume, delete queues and change
    /// settings. Without it, a `server.listen`, `server.http` or `cluster.listen` off loopback
    /// refuses to start. Startup field.
    pub insecure: bool,
    /// TLS on the protocol port: the PEM certificate chain (server certificate first). With
    /// `tls_key_file`; both or neither. Read again on SIGHUP. Startup field.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert_file: Option<PathBuf>,
    /// The certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1). Startup field.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key_file: Option<PathBuf>,
    /// Certificate logins on the protocol port: the CA certificates (PEM) that sign client
    /// certificates. With it the node asks TLS clients for a certificate (optional: password
    /// and token logins still work), and a client that logs in by certificate (mechanism
    /// EXTERNAL) is the user named by its certificate's subject common name. Needs
    /// `tls_cert_file`. Read at start only (SIGHUP reloads the node's own certificate, not
    /// this CA). Startup field.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_client_ca_file: Option<PathBuf>,
    /// Whether clients log in: `users` (the default: every connection and HTTP request logs
    /// in as a user and is held to its permissions; the first start creates `admin`) or
    /// `none` (anyone who reaches a port may do anything: loopback only, unless
    /// `server.insecure`). Startup field.
    pub auth: crate::access::AuthMode,
}

/// Default `server.blocking_threads_max`: blocking work is disk work, which a few threads keep
/// busy; 64 covers a burst of log opens and delivery reads on several disks while a stalled
/// disk holds some of them, and bounds the threads (each has a 2 MiB stack reserved, mostly
/// not resident).
pub const BLOCKING_THREADS_MAX_DEFAULT: u64 = 64;

/// Largest `server.worker_threads` and `server.blocking_threads_max`: far above any useful
/// value, and below the kernel's usual per-process thread limits.
pub const THREADS_MAX: u64 = 4096;

/// Largest `server.publish_timeout_ms`: an hour.
pub const PUBLISH_TIMEOUT_MAX_MS: u64 = 3_600_000;

/// Largest `storage.commit_workers`: each is a thread that mostly waits in `fdatasync`.
pub const COMMIT_WORKERS_MAX: u64 = 256;

/// The `[storage]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StorageSection {
    /// Directories that hold the logs; partitions are spread over them. Startup field.
    pub dirs: Vec<PathBuf>,
    /// A storage budget for the whole node, acting as a smaller filesystem; 0 = none.
    pub max_bytes: u64,
    /// The size of a full segment file. Startup field: existing segments keep their size.
    pub segment_bytes: u64,
    /// The byte budget of spare segment files per filesystem. Unset: the segment pool's
    /// default (2% of the filesystem, at most 1 GiB).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spare_budget_bytes: Option<u64>,
    /// Commit workers (threads that write and sync the logs) per file system the storage
    /// directories are on, shared by all its logs. Startup field.
    pub commit_workers: u64,
    /// A partition that holds nothing and saw no append for this many milliseconds hands its
    /// segment back to the node's pool. Startup field.
    pub idle_release_after_ms: u64,
}

impl Default for ServerSection {
    fn default() -> Self {
        let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
        ServerSection {
            listen: SocketAddr::new(loopback, LISTEN_PORT_DEFAULT),
            http: SocketAddr::new(loopback, HTTP_PORT_DEFAULT),
            delivery_bytes_max: 0,
            outbound_bytes_max: 0,
            connections_max: crate::tcp::CONNECTIONS_MAX_DEFAULT as u64,
            queues_max: u64::from(keratin_broker::QUEUES_MAX_DEFAULT),
            partitions_max: u64::from(keratin_broker::PARTITIONS_MAX_DEFAULT),
            consumers_max: u64::from(keratin_broker::CONSUMERS_MAX_DEFAULT),
            worker_threads: 0,
            blocking_threads_max: BLOCKING_THREADS_MAX_DEFAULT,
            publish_timeout_ms: keratin_broker::PUBLISH_TIMEOUT_DEFAULT.as_millis() as u64,
            insecure: false,
            tls_cert_file: None,
            tls_key_file: None,
            tls_client_ca_file: None,
            auth: crate::access::AuthMode::Users,
        }
    }
}

impl Default for StorageSection {
    fn default() -> Self {
        StorageSection {
            dirs: vec![PathBuf::from("./keratin-data")],
            max_bytes: 0,
            segment_bytes: SEGMENT_BYTES_DEFAULT,
            spare_budget_bytes: None,
            commit_workers: keratin_log::PoolOptions::default().commit_workers_per_filesystem
                as u64,
            idle_release_after_ms: keratin_broker::IDLE_RELEASE_AFTER_DEFAULT.as_millis() as u64,
        }
    }
}

/// A key of this crate's sections that failed its check; [`super::ConfigError::Invalid`] adds
/// where the value came from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct KeyError {
    pub key: &'static str,
    pub value: String,
    pub expected: &'static str,
}

impl NodeSection {
    pub(crate) fn validate(&self) -> Result<(), KeyError> {
        match &self.id {
            Some(id) if id.trim().is_empty() => Err(KeyError {
                key: "node.id",
                value: format!("{id:?}"),
                expected: "a non-empty name, or no key at all to let the server choose",
            }),
            _ => Ok(()),
        }
    }
}

impl ServerSection {
    pub(crate) fn validate(&self) -> Result<(), KeyError> {
        let counts: [(&'static str, u64); 3] = [
            ("server.queues_max", self.queues_max),
            ("server.partitions_max", self.partitions_max),
            ("server.consumers_max", self.consumers_max),
        ];
        for (key, value) in counts {
            if value == 0 || value > u64::from(u32::MAX) {
                return Err(KeyError {
                    key,
                    value: value.to_string(),
                    expected: "a count from 1 to 4294967295",
                });
            }
        }
        if self.worker_threads > THREADS_MAX {
            return Err(KeyError {
                key: "server.worker_threads",
                value: self.worker_threads.to_string(),
                expected: "0 (one per CPU) or a count up to 4096",
            });
        }
        if self.publish_timeout_ms == 0 || self.publish_timeout_ms > PUBLISH_TIMEOUT_MAX_MS {
            return Err(KeyError {
                key: "server.publish_timeout_ms",
                value: self.publish_timeout_ms.to_string(),
                expected: "milliseconds from 1 to 3600000 (an hour)",
            });
        }
        if self.tls_client_ca_file.is_some() && self.tls_cert_file.is_none() {
            return Err(KeyError {
                key: "server.tls_client_ca_file",
                value: "set without server.tls_cert_file".into(),
                expected: "certificate logins need TLS on the protocol port: set \
                           server.tls_cert_file and server.tls_key_file too",
            });
        }
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(_), None) => {
                return Err(KeyError {
                    key: "server.tls_key_file",
                    value: "not set".into(),
                    expected:
                        "the private key of server.tls_cert_file (a PEM file): TLS needs both",
                })
            }
            (None, Some(_)) => {
                return Err(KeyError {
                    key: "server.tls_cert_file",
                    value: "not set".into(),
                    expected:
                        "the certificate chain for server.tls_key_file (a PEM file): TLS needs both",
                })
            }
            _ => {}
        }
        if self.blocking_threads_max == 0 || self.blocking_threads_max > THREADS_MAX {
            return Err(KeyError {
                key: "server.blocking_threads_max",
                value: self.blocking_threads_max.to_string(),
                expected: "a count from 1 to 4096",
            });
        }
        Ok(())
    }

    /// The runtime's worker threads: `worker_threads`, or one per CPU the process may use.
    pub fn worker_threads_effective(&self) -> usize {
        match self.worker_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => usize::try_from(n).unwrap_or(1),
        }
    }
}

impl StorageSection {
    pub(crate) fn validate(&self) -> Result<(), KeyError> {
        let segment_ok = (SEGMENT_BYTES_MIN..=SEGMENT_BYTES_MAX).contains(&self.segment_bytes)
            && self.segment_bytes.is_multiple_of(SEGMENT_BYTES_ALIGN);
        if !segment_ok {
            return Err(KeyError {
                key: "storage.segment_bytes",
                value: self.segment_bytes.to_string(),
                expected:
                    "a multiple of 32768 (32 KiB) from 262144 (256 KiB) to 4294967296 (4 GiB)",
            });
        }
        if self.commit_workers == 0 || self.commit_workers > COMMIT_WORKERS_MAX {
            return Err(KeyError {
                key: "storage.commit_workers",
                value: self.commit_workers.to_string(),
                expected: "a count from 1 to 256",
            });
        }
        if self.idle_release_after_ms == 0 {
            return Err(KeyError {
                key: "storage.idle_release_after_ms",
                value: "0".to_string(),
                expected: "milliseconds, at least 1",
            });
        }
        if self.dirs.is_empty() {
            return Err(KeyError {
                key: "storage.dirs",
                value: "[]".to_string(),
                expected: "at least one directory",
            });
        }
        let mut seen = BTreeSet::new();
        for dir in &self.dirs {
            if dir.as_os_str().is_empty() {
                return Err(KeyError {
                    key: "storage.dirs",
                    value: "\"\"".to_string(),
                    expected: "non-empty directory paths",
                });
            }
            // `Path` equality compares components, so `/data/a/` and `/data/a` are one dir.
            if !seen.insert(dir.as_path()) {
                return Err(KeyError {
                    key: "storage.dirs",
                    value: format!("{:?}", dir.display().to_string()),
                    expected: "distinct directories (this one is listed twice)",
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_workers_idle_release_and_publish_timeout_are_checked() {
        let mut storage = StorageSection {
            commit_workers: 0,
            ..StorageSection::default()
        };
        assert_eq!(
            storage.validate().expect_err("0 workers").key,
            "storage.commit_workers"
        );
        storage.commit_workers = COMMIT_WORKERS_MAX + 1;
        assert_eq!(
            storage.validate().expect_err("too many").key,
            "storage.commit_workers"
        );
        storage.commit_workers = 16;
        storage.idle_release_after_ms = 0;
        assert_eq!(
            storage.validate().expect_err("0 ms").key,
            "storage.idle_release_after_ms"
        );
        storage.idle_release_after_ms = 1;
        storage.validate().expect("valid");
        let mut server = ServerSection {
            publish_timeout_ms: 0,
            ..ServerSection::default()
        };
        assert_eq!(
            server.validate().expect_err("0 ms").key,
            "server.publish_timeout_ms"
        );
        server.publish_timeout_ms = PUBLISH_TIMEOUT_MAX_MS + 1;
        assert_eq!(
            server.validate().expect_err("too long").key,
            "server.publish_timeout_ms"
        );
    }

    #[test]
    fn defaults_are_valid() {
        let config = Config::default();
        config.node.validate().expect("node defaults");
        config.server.validate().expect("server defaults");
        config.storage.validate().expect("storage defaults");
        config.limits.validate().expect("limits defaults");
    }

    #[test]
    fn segment_bytes_bounds_and_alignment() {
        let mut storage = StorageSection::default();
        for ok in [SEGMENT_BYTES_MIN, SEGMENT_BYTES_MAX, 96 * KIB * 8] {
            storage.segment_bytes = ok;
            storage.validate().expect("accepted");
        }
        for bad in [
            0,
            1000,
            SEGMENT_BYTES_MIN - SEGMENT_BYTES_ALIGN,
            SEGMENT_BYTES_MIN + 4096,
        ]
        .into_iter()
        .chain([SEGMENT_BYTES_MAX + SEGMENT_BYTES_ALIGN])
        {
            storage.segment_bytes = bad;
            let error = storage.validate().expect_err("rejected");
            assert_eq!(error.key, "storage.segment_bytes");
            assert_eq!(error.value, bad.to_string());
        }
    }

    #[test]
    fn server_bounds_are_counts() {
        let mut server = ServerSection {
            queues_max: 0,
            ..ServerSection::default()
        };
        assert_eq!(server.validate().expect_err("0").key, "server.queues_max");
        server = ServerSection {
            consumers_max: 1 << 40,
            ..ServerSection::default()
        };
        assert_eq!(
            server.validate().expect_err("big").key,
            "server.consumers_max"
        );
        server = ServerSection {
            blocking_threads_max: 0,
            ..ServerSection::default()
        };
        assert_eq!(
            server.validate().expect_err("0").key,
            "server.blocking_threads_max"
        );
        server = ServerSection {
            worker_threads: 3,
            ..ServerSection::default()
        };
        assert_eq!(server.worker_threads_effective(), 3);
        server.worker_threads = 0;
        assert!(server.worker_threads_effective() >= 1);
    }

    #[test]
    fn dirs_must_be_present_and_distinct() {
        let mut storage = StorageSection {
            dirs: vec![],
            ..StorageSection::default()
        };
        assert_eq!(storage.validate().expect_err("empty").key, "storage.dirs");
        storage.dirs = vec!["/data/a".into(), "/data/b".into(), "/data/a/".into()];
        let error = storage.validate().expect_err("duplicate");
        assert!(error.value.contains("/data/a"), "{error:?}");
        assert!(error.expected.starts_with("distinct directories"));
    }

    #[test]
    fn startup_fields_name_real_keys() {
        let text = toml::to_string(&Config {
            node: NodeSection {
                id: Some("n1".into()),
            },
            ..Config::default()
        })
        .expect("serialize");
        let table: toml::Table = text.parse().expect("parse");
        for key in startup_fields() {
            let mut value = table.get(key.split('.').next().expect("section"));
            for part in key.split('.').skip(1) {
                value = value.and_then(|v| v.get(part));
            }
            assert!(value.is_some(), "{key} is not a key of Config");
        }
    }
}
