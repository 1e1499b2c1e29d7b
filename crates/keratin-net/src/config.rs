//! [`ClusterConfig`]: who this node is, where it listens for peers, and who its peers are, as the
//! `[cluster]` section of the node's configuration deserializes it; [`PeerSpec`] and its
//! `ID=ADDR` parser; [`ClusterConfig::resolve`], the checks that turn it into a
//! [`ResolvedCluster`] the transport runs on. Loading the file, the environment and the flags
//! belongs to `keratin-server`'s config module, which embeds this type.
//!
//! # Fields
//!
//! | key | type | default | meaning |
//! |---|---|---|---|
//! | `node_id` | integer | required | this node's id, at least 1, unique in the cluster |
//! | `listen` | `"IP:PORT"` | this node's entry in `peers` | the address peers dial (`--cluster-listen`) |
//! | `peers` | list of `"ID=IP:PORT"` (or one comma-separated string) | `[]` | every node of the cluster (`--peer ID=ADDR`, repeatable); this node may be listed too |
//! | `name` | string | `"keratin"` | the cluster's name; nodes of another cluster are refused at the handshake |
//!
//! In TOML: `[cluster]` with `node_id = 1`, `listen = "10.0.0.1:5690"`,
//! `peers = ["1=10.0.0.1:5690", "2=10.0.0.2:5690", "3=10.0.0.3:5690"]`, `name = "prod"`.
//! From the environment: `KERATIN_CLUSTER__NODE_ID=1`, and
//! `KERATIN_CLUSTER__PEERS='["2=10.0.0.2:5690"]'` or
//! `KERATIN_CLUSTER__PEERS=2=10.0.0.2:5690,3=10.0.0.3:5690` (text that is not a TOML value is a
//! string). Listing every node, this one included, lets every node share one `peers` list; this
//! node's own entry must then match `listen`, or stands for it when `listen` is absent.
//! [`parse_peer_list`] parses the comma-separated form for flags.
//!
//! # Mutual TLS: [`ClusterTlsConfig`]
//!
//! | key | type | default | meaning |
//! |---|---|---|---|
//! | `tls_cert_file` | path | unset | this node's certificate chain (PEM, its own first); it must name `node-<node_id>.keratin` |
//! | `tls_key_file` | path | unset | its private key (PEM: PKCS#8, PKCS#1 or SEC1) |
//! | `tls_ca_file` | path | unset | the CA that signs every node's certificate (PEM) |
//!
//! All three or none ([`ClusterTlsConfig::files`]); with them every cluster connection is
//! mutual TLS (`crate::tls`). These keys belong in the `[cluster]` section, but they are a
//! type of their own rather than fields of [`ClusterConfig`], whose struct literals other crates
//! build: the embedder reads them from the same table (they flatten into it, see the tests) and
//! hands [`ClusterTlsConfig::files`] to [`crate::ClusterTls::load`].

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::handshake::CLUSTER_NAME_BYTES_MAX;
use crate::NodeId;

/// The default cluster name.
pub const DEFAULT_CLUSTER_NAME: &str = "keratin";

/// The `[cluster]` section as written by the operator. Check it with [`ClusterConfig::resolve`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// This node's id (at least 1; 0 is reserved).
    pub node_id: u64,
    /// The address to listen on for peers; defaults to this node's entry in `peers`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
    /// The cluster's nodes, as a list of `ID=ADDR` strings, or one string of them separated by
    /// commas (`"1=10.0.0.1:5690,2=10.0.0.2:5690"`, handy in an environment variable).
    #[serde(default, deserialize_with = "deserialize_peers")]
    pub peers: Vec<PeerSpec>,
    /// The cluster's name, compared at every handshake.
    #[serde(default = "default_name")]
    pub name: String,
    /// This node joins a running cluster (`keratin cluster add-node` admits it): it never
    /// forms the cluster's metadata group with `peers`, it waits to be added. `false`: the
    /// node is one of the nodes the cluster was formed with.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub join: bool,
    /// A partition's leader hands it back to its preferred leader (the first of its replicas
    /// as placed) once that one is caught up, so leaders stay spread after failovers
    /// (`docs/cluster.md`, "Leader balancing"). `false`: leaders stay where elections put
    /// them.
    #[serde(default = "default_leader_balance")]
    pub leader_balance: bool,
    /// Mutual TLS between the nodes (`tls_cert_file`, `tls_key_file`, `tls_ca_file`, all
    /// three or none).
    #[serde(flatten)]
    pub tls: ClusterTlsConfig,
}

fn default_name() -> String {
    DEFAULT_CLUSTER_NAME.to_string()
}

fn default_leader_balance() -> bool {
    true
}

/// One `ID=ADDR` peer entry, for example `2=10.0.0.2:5690`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerSpec {
    /// The peer's node id.
    pub id: NodeId,
    /// The address its cluster listener is on.
    pub addr: SocketAddr,
}

impl FromStr for PeerSpec {
    type Err = ConfigError;

    fn from_str(input: &str) -> Result<PeerSpec, ConfigError> {
        let bad = |reason: &str| ConfigError::BadPeer {
            input: input.to_string(),
            reason: reason.to_string(),
        };
        let (id, addr) = input
            .split_once('=')
            .ok_or_else(|| bad("expected ID=ADDR, for example 2=10.0.0.2:5690"))?;
        let id: NodeId = id
            .trim()
            .parse()
            .map_err(|_| bad("the id before '=' is not a whole number"))?;
        if id == 0 {
            return Err(bad("node ids start at 1 (0 is reserved)"));
        }
        let addr: SocketAddr = addr.trim().parse().map_err(|_| {
            bad("the address after '=' is not IP:PORT (host names are not resolved here)")
        })?;
        Ok(PeerSpec { id, addr })
    }
}

impl fmt::Display for PeerSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.id, self.addr)
    }
}

impl Serialize for PeerSpec {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PeerSpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<PeerSpec, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Parses `ID=ADDR,ID=ADDR,...` (spaces around entries allowed; empty entries skipped).
pub fn parse_peer_list(text: &str) -> Result<Vec<PeerSpec>, ConfigError> {
    text.split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(str::parse)
        .collect()
}

/// `peers` as a list of `ID=ADDR` strings or one comma-separated string.
#[derive(Deserialize)]
#[serde(untagged)]
enum PeersInput {
    List(Vec<String>),
    Text(String),
}

fn deserialize_peers<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<PeerSpec>, D::Error> {
    let parsed = match PeersInput::deserialize(deserializer)? {
        PeersInput::List(entries) => entries.iter().map(|entry| entry.parse()).collect(),
        PeersInput::Text(text) => parse_peer_list(&text),
    };
    parsed.map_err(serde::de::Error::custom)
}

/// The mutual-TLS keys of the `[cluster]` section (see the module docs). No
/// `deny_unknown_fields`: it is read from a table that holds [`ClusterConfig`]'s keys too, and
/// flattens into a struct that denies them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct ClusterTlsConfig {
    /// This node's certificate chain, PEM, its own certificate first; the certificate must
    /// carry the DNS name `node-<node_id>.keratin` ([`crate::tls::node_name`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert_file: Option<PathBuf>,
    /// The private key of `tls_cert_file`, PEM (PKCS#8, PKCS#1 or SEC1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key_file: Option<PathBuf>,
    /// The CA certificates (PEM) that sign every node's certificate; a peer's certificate must
    /// chain to one of them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_ca_file: Option<PathBuf>,
}

/// The three files of mutual TLS, all given: what [`crate::ClusterTls::load`] reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterTlsFiles {
    /// This node's certificate chain.
    pub cert_file: PathBuf,
    /// Its private key.
    pub key_file: PathBuf,
    /// The cluster's CA.
    pub ca_file: PathBuf,
}

impl ClusterTlsConfig {
    /// `None` when no key is set (plain TCP), the files when all three are, and
    /// [`ConfigError::TlsIncomplete`] naming the missing keys otherwise.
    pub fn files(&self) -> Result<Option<ClusterTlsFiles>, ConfigError> {
        match (&self.tls_cert_file, &self.tls_key_file, &self.tls_ca_file) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Ok(Some(ClusterTlsFiles {
                cert_file: cert.clone(),
                key_file: key.clone(),
                ca_file: ca.clone(),
            })),
            (cert, key, ca) => {
                let missing = [
                    (cert.is_none(), "cluster.tls_cert_file"),
                    (key.is_none(), "cluster.tls_key_file"),
                    (ca.is_none(), "cluster.tls_ca_file"),
                ]
                .into_iter()
                .filter_map(|(missing, key)| missing.then_some(key))
                .collect::<Vec<_>>()
                .join(", ");
                Err(ConfigError::TlsIncomplete { missing })
            }
        }
    }
}

/// A checked cluster configuration: what [`crate::Transport`] runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedCluster {
    /// This node's id.
    pub node_id: NodeId,
    /// Where this node listens for peers.
    pub listen: SocketAddr,
    /// Every other node, by id.
    pub peers: BTreeMap<NodeId, SocketAddr>,
    /// The cluster's name.
    pub name: String,
}

impl ClusterConfig {
    /// Checks the configuration: ids at least 1 and unique, addresses unique, this node's own
    /// entry (if listed) matching `listen` or standing for it, a usable cluster name.
    pub fn resolve(&self) -> Result<ResolvedCluster, ConfigError> {
        if self.node_id == 0 {
            return Err(ConfigError::ZeroNodeId);
        }
        check_name(&self.name)?;
        let mut peers = BTreeMap::new();
        let mut own_entry = None;
        let mut addrs = BTreeMap::new();
        for peer in &self.peers {
            if let Some(first) = addrs.insert(peer.addr, peer.id) {
                return Err(ConfigError::DuplicateAddress {
                    addr: peer.addr,
                    first,
                    second: peer.id,
                });
            }
            let duplicate = if peer.id == self.node_id {
                own_entry.replace(peer.addr).is_some()
            } else {
                peers.insert(peer.id, peer.addr).is_some()
            };
            if duplicate {
                return Err(ConfigError::DuplicateId { id: peer.id });
            }
        }
        let listen = match (self.listen, own_entry) {
            (Some(listen), Some(listed)) if listen != listed => {
                return Err(ConfigError::OwnAddressMismatch {
                    id: self.node_id,
                    listed,
                    listen,
                })
            }
            (Some(listen), _) => listen,
            (None, Some(listed)) => listed,
            (None, None) => return Err(ConfigError::NoListen { id: self.node_id }),
        };
        if let Some((&id, _)) = peers.iter().find(|(_, addr)| **addr == listen) {
            return Err(ConfigError::DuplicateAddress {
                addr: listen,
                first: self.node_id,
                second: id,
            });
        }
        Ok(ResolvedCluster {
            node_id: self.node_id,
            listen,
            peers,
            name: self.name.clone(),
        })
    }
}

fn check_name(name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.len() > CLUSTER_NAME_BYTES_MAX {
        return Err(ConfigError::BadName {
            name: name.to_string(),
        });
    }
    Ok(())
}

/// Why a cluster configuration is refused. Each message names the entry and what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A peer entry that is not `ID=ADDR`.
    #[error("cluster peer '{input}': {reason}")]
    BadPeer {
        /// The entry as given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// `node_id` is 0.
    #[error("cluster.node_id must be at least 1 (0 is reserved); set --node-id")]
    ZeroNodeId,
    /// Two entries with the same id.
    #[error("cluster peer id {id} is listed twice; each node id must appear once")]
    DuplicateId {
        /// The id.
        id: NodeId,
    },
    /// Two nodes with the same address.
    #[error("nodes {first} and {second} both use {addr}; each node needs its own address")]
    DuplicateAddress {
        /// The address.
        addr: SocketAddr,
        /// The first node using it.
        first: NodeId,
        /// The second node using it.
        second: NodeId,
    },
    /// This node is listed in `peers` with another address than `listen`.
    #[error("this node ({id}) is listed in peers as {listed} but cluster.listen is {listen}; make them equal or drop one")]
    OwnAddressMismatch {
        /// This node's id.
        id: NodeId,
        /// Its address in `peers`.
        listed: SocketAddr,
        /// `listen`.
        listen: SocketAddr,
    },
    /// Neither `listen` nor an own entry in `peers`.
    #[error("no cluster listen address for node {id}: set --cluster-listen, or list {id}=ADDR among the peers")]
    NoListen {
        /// This node's id.
        id: NodeId,
    },
    /// The cluster name is empty or too long.
    #[error("cluster name '{name}' must be 1 to 255 bytes")]
    BadName {
        /// The name.
        name: String,
    },
    /// Some of the mutual-TLS keys are set, not all three.
    #[error("cluster TLS needs tls_cert_file, tls_key_file and tls_ca_file together; missing {missing} (set all three, or none for plain TCP)")]
    TlsIncomplete {
        /// The keys not set, comma-separated.
        missing: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(node_id: u64, listen: Option<&str>, peers: &[&str]) -> ClusterConfig {
        ClusterConfig {
            node_id,
            listen: listen.map(|addr| addr.parse().unwrap()),
            peers: peers.iter().map(|peer| peer.parse().unwrap()).collect(),
            name: DEFAULT_CLUSTER_NAME.to_string(),
            join: false,
            leader_balance: true,
            tls: ClusterTlsConfig::default(),
        }
    }

    #[test]
    fn peer_strings_parse_with_clear_errors() {
        let peer: PeerSpec = "2=10.0.0.2:5690".parse().unwrap();
        assert_eq!((peer.id, peer.addr.port()), (2, 5690));
        assert_eq!(peer.to_string(), "2=10.0.0.2:5690");
        let peer: PeerSpec = "3=[::1]:5690".parse().unwrap();
        assert_eq!(peer.id, 3);
        for (input, needle) in [
            ("10.0.0.2:5690", "expected ID=ADDR"),
            ("x=10.0.0.2:5690", "not a whole number"),
            ("0=10.0.0.2:5690", "start at 1"),
            ("2=node2:5690", "not IP:PORT"),
            ("2=10.0.0.2", "not IP:PORT"),
        ] {
            let error = input.parse::<PeerSpec>().unwrap_err().to_string();
            assert!(error.contains(needle), "{input}: {error}");
            assert!(error.contains(input), "{input}: {error}");
        }
    }

    #[test]
    fn own_entry_stands_for_listen_or_must_match_it() {
        let peers = ["1=127.0.0.1:7001", "2=127.0.0.1:7002"];
        let resolved = config(1, None, &peers).resolve().unwrap();
        assert_eq!(resolved.listen, "127.0.0.1:7001".parse().unwrap());
        assert_eq!(resolved.peers.len(), 1);
        let resolved = config(1, Some("127.0.0.1:7001"), &peers).resolve().unwrap();
        assert_eq!(resolved.peers.keys().copied().collect::<Vec<_>>(), vec![2]);
        let error = config(1, Some("127.0.0.1:7009"), &peers)
            .resolve()
            .unwrap_err();
        assert!(
            matches!(error, ConfigError::OwnAddressMismatch { .. }),
            "{error}"
        );
        let error = config(3, None, &peers).resolve().unwrap_err();
        assert_eq!(error, ConfigError::NoListen { id: 3 });
    }

    #[test]
    fn duplicates_and_zero_ids_are_refused() {
        let error = config(
            1,
            None,
            &["1=127.0.0.1:1", "2=127.0.0.1:2", "2=127.0.0.1:3"],
        )
        .resolve()
        .unwrap_err();
        assert_eq!(error, ConfigError::DuplicateId { id: 2 });
        let error = config(1, None, &["1=127.0.0.1:1", "2=127.0.0.1:1"])
            .resolve()
            .unwrap_err();
        assert!(
            matches!(error, ConfigError::DuplicateAddress { .. }),
            "{error}"
        );
        let error = config(1, Some("127.0.0.1:2"), &["2=127.0.0.1:2"])
            .resolve()
            .unwrap_err();
        assert!(
            matches!(error, ConfigError::DuplicateAddress { .. }),
            "{error}"
        );
        assert_eq!(
            config(0, Some("127.0.0.1:1"), &[]).resolve().unwrap_err(),
            ConfigError::ZeroNodeId
        );
    }

    #[test]
    fn deserializes_from_the_cluster_section() {
        let text = r#"
            node_id = 2
            listen = "127.0.0.1:7002"
            peers = ["1=127.0.0.1:7001", "2=127.0.0.1:7002", "3=127.0.0.1:7003"]
            name = "prod"
        "#;
        let config: ClusterConfig = toml::from_str(text).unwrap();
        let resolved = config.resolve().unwrap();
        assert_eq!(resolved.name, "prod");
        assert_eq!(
            resolved.peers.keys().copied().collect::<Vec<_>>(),
            vec![1, 3]
        );
        let error = toml::from_str::<ClusterConfig>("node_id = 1\npeers = [\"1:127.0.0.1:1\"]")
            .unwrap_err()
            .to_string();
        assert!(error.contains("expected ID=ADDR"), "{error}");
        let config: ClusterConfig =
            toml::from_str("node_id = 1\npeers = \"1=127.0.0.1:1, 2=127.0.0.1:2\"").unwrap();
        assert_eq!(config.resolve().unwrap().peers.len(), 1);
        let error = parse_peer_list("1=127.0.0.1:1,x").unwrap_err().to_string();
        assert!(error.contains("'x'"), "{error}");
        let config: ClusterConfig =
            toml::from_str("node_id = 1\nlisten = \"127.0.0.1:1\"").unwrap();
        assert_eq!(config.name, DEFAULT_CLUSTER_NAME);
    }

    #[test]
    fn tls_keys_come_all_three_or_none() {
        let none = ClusterTlsConfig::default();
        assert_eq!(none.files(), Ok(None));
        let all: ClusterTlsConfig = toml::from_str(
            "tls_cert_file = \"n.pem\"\ntls_key_file = \"n.key\"\ntls_ca_file = \"ca.pem\"",
        )
        .unwrap();
        let files = all.files().unwrap().unwrap();
        assert_eq!(files.ca_file, PathBuf::from("ca.pem"));
        let some = ClusterTlsConfig {
            tls_cert_file: Some("n.pem".into()),
            ..ClusterTlsConfig::default()
        };
        let error = some.files().unwrap_err().to_string();
        assert!(
            error.contains("missing cluster.tls_key_file, cluster.tls_ca_file"),
            "{error}"
        );
    }

    /// The `[cluster]` table holds `ClusterConfig`'s keys and the TLS keys: `ClusterTlsConfig`
    /// reads its own and ignores the rest, and flattens into a struct that denies unknown keys
    /// (how an embedder can read both from one table and still catch typos).
    #[test]
    fn tls_keys_read_from_the_cluster_table() {
        let text = r#"
            node_id = 1
            listen = "127.0.0.1:7001"
            tls_cert_file = "node-1.pem"
            tls_key_file = "node-1.key"
            tls_ca_file = "ca.pem"
        "#;
        let tls: ClusterTlsConfig = toml::from_str(text).unwrap();
        assert_eq!(tls.tls_cert_file, Some(PathBuf::from("node-1.pem")));

        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Section {
            #[expect(dead_code, reason = "only deserialized")]
            node_id: u64,
            #[expect(dead_code, reason = "only deserialized")]
            listen: SocketAddr,
            #[serde(flatten)]
            tls: ClusterTlsConfig,
        }
        let section: Section = toml::from_str(text).unwrap();
        assert!(section.tls.files().unwrap().is_some());
        let error = toml::from_str::<Section>(&format!("{text}\ntls_ca_flie = \"x\""))
            .unwrap_err()
            .to_string();
        assert!(error.contains("tls_ca_flie"), "{error}");
    }
}
