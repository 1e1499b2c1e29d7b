//! `Node`: a running broker with its protocol and admin listeners, started from a [`Config`]
//! and stopped gracefully. The binary's `serve` and the end-to-end tests both use it, and
//! several nodes can run in one process (nothing in them is static).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use keratin_broker::{Broker, BrokerConfig};
use keratin_log::{Io, RealIo};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use keratin_cluster::{ClusterNode, NodeInfo, PreparedCluster};

use crate::access::{bootstrap_admin, Access, AuthMode, UserStore};
use crate::config::{Config, LoadedConfig, Origin};
use crate::limits::NodeLimits;
use crate::settings::NodeSettings;
use crate::tcp::TcpOptions;
use crate::tls::ServerTls;
use keratin_auth::GateConfig;

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// A listener could not bind.
    #[error("cannot listen on {addr}: {source}; is another broker running there? choose another address with --listen / --http")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
    /// The resource limits could not be set up.
    #[error("resource limits: {0}")]
    Limits(String),
    /// The storage could not be opened.
    #[error("cannot open the storage: {0}")]
    Storage(#[from] keratin_broker::BrokerError),
    /// The node could not join its cluster.
    #[error("cluster: {0}")]
    Cluster(String),
    /// The first admin could not be created.
    #[error("creating the first admin user: {0}")]
    Users(String),
    /// The protocol port's certificate or key cannot be used.
    #[error("{0}; fix server.tls_cert_file / server.tls_key_file")]
    Tls(#[from] crate::tls::TlsError),
    /// A storage directory is another node's, or cannot be locked.
    #[error("{0}")]
    StorageLock(#[from] crate::storage_lock::StorageLockError),
}

/// A running node.
#[derive(Debug)]
pub struct Node {
    broker: Broker,
    protocol_addr: SocketAddr,
    http_addr: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<std::io::Result<()>>>,
    limits: Arc<NodeLimits>,
    /// The node's cluster membership (`[cluster]`); `None` when it runs alone.
    cluster: Option<Arc<ClusterNode>>,
    /// The protocol port's TLS, if configured.
    tls: Option<Arc<ServerTls>>,
    /// Logins and permissions.
    access: Arc<Access>,
    /// The cluster port's mutual TLS, if configured.
    cluster_tls: Option<keratin_net::ClusterTls>,
    /// The audit trail.
    audit: crate::audit::AuditLog,
    /// Every storage directory's lock, released when the node is dropped (after
    /// [`Node::shutdown`] closed its logs).
    storage_lock: crate::storage_lock::StorageLock,
}

impl Node {
    /// Open the storage and start listening, on the real file system.
    pub async fn start(config: &Config) -> Result<Node, NodeError> {
        Node::start_with_io(config, Arc::new(RealIo::new())).await
    }

    /// Start from a loaded configuration: like [`Node::start`], and the settings API names
    /// where each value came from.
    pub async fn start_loaded(loaded: &LoadedConfig) -> Result<Node, NodeError> {
        Node::start_inner(loaded.config(), Arc::new(RealIo::new()), loaded.origins()).await
    }

    /// Open the storage through `io` and start listening.
    pub async fn start_with_io(config: &Config, io: Arc<dyn Io>) -> Result<Node, NodeError> {
        Node::start_inner(config, io, BTreeMap::new()).await
    }

    async fn start_inner(
        config: &Config,
        io: Arc<dyn Io>,
        origins: BTreeMap<String, Origin>,
    ) -> Result<Node, NodeError> {
        // First of all: a directory another node holds is left exactly as it is.
        let storage_lock = crate::storage_lock::StorageLock::acquire(&config.storage.dirs)?;
        // Before anything is opened: a bad certificate stops the start at once.
        let tls = match (&config.server.tls_cert_file, &config.server.tls_key_file) {
            (Some(cert), Some(key)) => Some(Arc::new(ServerTls::load_with_client_ca(
                cert,
                key,
                config.server.tls_client_ca_file.as_deref(),
            )?)),
            _ => None,
        };
        let limits = Arc::new(
            NodeLimits::new(
                &config.storage.dirs,
                config.limits.clone(),
                config.storage.max_bytes,
            )
            .map_err(NodeError::Limits)?,
        );
        // Sample before anything is served: a node that starts on a full disk rejects
        // publishes from its first request.
        limits.sample();
        let mut broker_config = BrokerConfig::new(config.storage.dirs.clone());
        broker_config.segment_size_bytes = config.storage.segment_bytes;
        broker_config.spare_budget_bytes = config.storage.spare_budget_bytes;
        broker_config.io = io;
        broker_config.gate = limits.clone();
        let budgets = DeliveryBudgets::of(config, limits.memory_limit_bytes());
        broker_config.delivery_bytes_max = budgets.node_bytes;
        let count = |value: u64| u32::try_from(value).unwrap_or(u32::MAX);
        broker_config.queues_max = count(config.server.queues_max);
        broker_config.partitions_max = count(config.server.partitions_max);
        broker_config.consumers_max = count(config.server.consumers_max);
        broker_config.publish_timeout =
            std::time::Duration::from_millis(config.server.publish_timeout_ms);
        broker_config.idle_release_after =
            std::time::Duration::from_millis(config.storage.idle_release_after_ms);
        broker_config.commit_workers_per_filesystem = config.storage.commit_workers as usize;
        let cluster_tls = match &config.cluster {
            Some(cluster) => load_cluster_tls(cluster)?,
            None => None,
        };
        let prepared = match &config.cluster {
            Some(cluster) => Some(prepare_cluster(cluster, cluster_tls.clone()).await?),
            None => None,
        };
        if let Some(prepared) = &prepared {
            limits.attach_cluster(prepared.levels().clone());
            broker_config.partition_logs = Some(prepared.partition_logs.clone());
            broker_config.cluster_metadata = Some(prepared.metadata.clone());
            broker_config.dead_letters = Some(prepared.dead_letters.clone());
        }
        let broker = Broker::open(broker_config).await?;
        limits.attach(&broker);
        let settings = Arc::new(NodeSettings::new(config.clone(), origins));
        settings
            .load(&broker, &limits)
            .await
            .map_err(|e| NodeError::Limits(e.to_string()))?;
        limits.sample();
        limits.settle_attention();
        let bind = |addr: SocketAddr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| NodeError::Bind { addr, source })
        };
        let protocol = bind(config.server.listen).await?;
        let http = bind(config.server.http).await?;
        let protocol_addr = protocol.local_addr().map_err(|source| NodeError::Bind {
            addr: config.server.listen,
            source,
        })?;
        let http_addr = http.local_addr().map_err(|source| NodeError::Bind {
            addr: config.server.http,
            source,
        })?;
        let node_name = config
            .node
            .id
            .clone()
            .unwrap_or_else(|| format!("keratin@{protocol_addr}"));
        let cluster = match prepared {
            Some(prepared) => {
                let own = NodeInfo {
                    id: config.cluster.as_ref().map_or(0, |c| c.node_id),
                    client: protocol_addr.to_string(),
                    admin: http_addr.to_string(),
                    name: Some(node_name.clone()),
                    level: None,
                    free_bytes: None,
                };
                // `cluster.leader_balance` is a runtime setting: the balancer follows it.
                let prepared = prepared.leader_balance(settings.leader_balance());
                let node = ClusterNode::start(prepared, broker.clone(), own)
                    .await
                    .map_err(NodeError::Cluster)?;
                Some(Arc::new(node))
            }
            None => None,
        };
        let store = match &cluster {
            Some(cluster) => UserStore::Cluster(Arc::downgrade(cluster)),
            None => UserStore::Node(broker.clone()),
        };
        let access = Arc::new(Access::new(
            config.server.auth,
            store,
            GateConfig::default(),
        ));
        let admin_dir = config.storage.dirs.first().cloned().unwrap_or_default();
        if cluster.is_none() {
            bootstrap_admin(&access, &admin_dir)
                .await
                .map_err(NodeError::Users)?;
        }
        let audit = open_audit(&admin_dir);
        let (stop, stopped) = watch::channel(false);
        // Each unanswered publish byte is held about twice (the decoded message, the encoded
        // record) until its sync: an eighth of the limit keeps that under a quarter of it.
        let memory_eighth = (limits.memory_limit_bytes() / 8) as usize;
        let publish_bytes_inflight_max =
            crate::tcp::PUBLISH_BYTES_INFLIGHT_DEFAULT.min(memory_eighth.max(8 << 20));
        // Claims fit beside what the fixed budgets may take: publish and delivery bytes are
        // each held about twice, relocation reads once.
        limits.memory_claims().set_budgets(
            (publish_bytes_inflight_max as u64)
                .saturating_add(budgets.node_bytes)
                .saturating_mul(2)
                .saturating_add(keratin_broker::RELOCATION_BYTES_MAX),
        );
        let options = TcpOptions {
            publish_bytes_inflight_max,
            outbound_bytes_max: usize::try_from(budgets.connection_bytes).unwrap_or(usize::MAX),
            connections_max: usize::try_from(config.server.connections_max.max(1))
                .unwrap_or(usize::MAX),
            node_id: node_name,
            server_addr: Some(protocol_addr),
            admin_addr: Some(http_addr),
            peers: cluster
                .as_ref()
                .map(|cluster| cluster_peers(cluster.clone())),
            tls: tls.clone(),
            access: Some(access.clone()),
            insecure: config.server.insecure,
            audit: Some(audit.clone()),
            memory_claims: limits.memory_claims().clone(),
            ..TcpOptions::default()
        };
        let node_id = options.node_id.clone();
        let sampler = tokio::spawn(limits.clone().run_sampler(stopped.clone()));
        let health = cluster
            .clone()
            .map(|cluster| tokio::spawn(report_levels(cluster, limits.clone(), stopped.clone())));
        let settings_for_cluster = settings.clone();
        let admin = crate::http::Admin {
            broker: broker.clone(),
            limits: limits.clone(),
            settings,
            node_id,
            cluster: cluster.clone(),
            access: access.clone(),
            audit: audit.clone(),
        };
        let mut tasks = vec![
            tokio::spawn(crate::tcp::serve(
                protocol,
                broker.clone(),
                options,
                wait_stop(stopped.clone()),
            )),
            tokio::spawn(crate::http::serve(
                http,
                admin,
                tls.clone(),
                wait_stop(stopped),
            )),
            tokio::spawn(async move {
                let _ = sampler.await;
                if let Some(health) = health {
                    let _ = health.await;
                }
                Ok(())
            }),
        ];
        if let Some(cluster) = &cluster {
            tasks.push(tokio::spawn(bootstrap_cluster_admin(
                access.clone(),
                admin_dir,
                stop.subscribe(),
            )));
            tasks.push(tokio::spawn(follow_cluster_settings(
                cluster.runtime_settings(),
                settings_for_cluster,
                broker.clone(),
                limits.clone(),
                stop.subscribe(),
            )));
            let watch = crate::cluster_watch::run(
                cluster.clone(),
                broker.clone(),
                limits.clone(),
                stop.subscribe(),
            );
            tasks.push(tokio::spawn(async move {
                watch.await;
                Ok(())
            }));
        }
        tracing::info!(%protocol_addr, %http_addr, "keratin is serving");
        Ok(Node {
            broker,
            protocol_addr,
            http_addr,
            stop,
            tasks,
            limits,
            cluster,
            tls,
            access,
            cluster_tls,
            audit,
            storage_lock,
        })
    }

    /// Read the cluster port's certificate, key and CA files again (SIGHUP): connections to
    /// and from peers made from now on use them, open ones keep theirs. Nothing changes on an
    /// error; `Ok(false)` when the cluster port serves no TLS (or the node is alone).
    pub fn reload_cluster_tls(&self) -> Result<bool, keratin_net::NetError> {
        match &self.cluster_tls {
            Some(tls) => tls.reload().map(|()| true),
            None => Ok(false),
        }
    }

    /// Logins and permissions.
    pub fn access(&self) -> &Arc<Access> {
        &self.access
    }

    /// The audit trail.
    pub fn audit(&self) -> &crate::audit::AuditLog {
        &self.audit
    }

    /// Read the protocol port's certificate and key files again (SIGHUP): connections made
    /// from now on get them, open ones keep theirs. Nothing changes on an error; `Ok(false)`
    /// when the node serves no TLS.
    pub fn reload_tls(&self) -> Result<bool, crate::tls::TlsError> {
        match &self.tls {
            Some(tls) => tls.reload().map(|()| true),
            None => Ok(false),
        }
    }

    /// The node's cluster membership, if it is in a cluster.
    pub fn cluster(&self) -> Option<&Arc<ClusterNode>> {
        self.cluster.as_ref()
    }

    /// The protocol listener's address (with the port chosen, when 0 was asked).
    pub fn protocol_addr(&self) -> SocketAddr {
        self.protocol_addr
    }

    /// The admin listener's address.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// The node's resource limits.
    pub fn limits(&self) -> &Arc<NodeLimits> {
        &self.limits
    }

    /// The broker.
    pub fn broker(&self) -> &Broker {
        &self.broker
    }

    /// Stop accepting, let connections deliver outstanding confirms, then close every log
    /// cleanly (pending syncs finish, seals are written).
    pub async fn shutdown(self) -> Result<(), NodeError> {
        let _ = self.stop.send(true);
        for task in self.tasks {
            match task.await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(%error, "listener ended with an error"),
                Err(error) => tracing::warn!(%error, "listener task failed"),
            }
        }
        // The last records on disk before the next start reads them back.
        self.audit.flush().await;
        self.broker.shutdown().await?;
        if let Some(cluster) = self.cluster {
            match Arc::try_unwrap(cluster) {
                Ok(cluster) => cluster.shutdown().await,
                Err(_) => tracing::warn!("the cluster layer is still in use at shutdown"),
            }
        }
        // Only now may another node open the directories.
        drop(self.storage_lock);
        Ok(())
    }
}

/// A cluster node's first start with logins: the users live in the metadata group, which needs
/// a leader and this node's copy of its records before it can tell whether the cluster has
/// users. Tries every second until the cluster has users (made here or by another node) or
/// the node stops.
async fn bootstrap_cluster_admin(
    access: Arc<Access>,
    dir: std::path::PathBuf,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    if access.mode() != AuthMode::Users {
        return Ok(());
    }
    // Let the node catch up with the records it has before it decides the table is empty.
    let mut pause = std::time::Duration::from_secs(2);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stop.changed() => return Ok(()),
        }
        if !access.table().is_empty() {
            return Ok(());
        }
        match bootstrap_admin(&access, &dir).await {
            Ok(_) => return Ok(()),
            Err(error) => {
                tracing::info!(%error, "the first admin is not made yet; retrying");
                pause = std::time::Duration::from_secs(1);
            }
        }
    }
}

/// The cluster port's mutual TLS (`[cluster]` `tls_*`), if configured; refused at once when the
/// files cannot be used or this node's certificate does not name it (`node-<id>.keratin`).
fn load_cluster_tls(
    cluster: &keratin_net::ClusterConfig,
) -> Result<Option<keratin_net::ClusterTls>, NodeError> {
    let Some(files) = cluster
        .tls
        .files()
        .map_err(|e| NodeError::Cluster(e.to_string()))?
    else {
        return Ok(None);
    };
    let tls = keratin_net::ClusterTls::load(files).map_err(|e| {
        NodeError::Cluster(format!(
            "{e}; fix cluster.tls_cert_file / tls_key_file / tls_ca_file"
        ))
    })?;
    if !tls.names(cluster.node_id) {
        return Err(NodeError::Cluster(format!(
            "the certificate in cluster.tls_cert_file does not name this node: it must carry \
             the DNS name {} (peers check it)",
            keratin_net::tls::node_name(cluster.node_id)
        )));
    }
    Ok(Some(tls))
}

/// Start the transport of a cluster node and build the broker's hooks.
async fn prepare_cluster(
    cluster: &keratin_net::ClusterConfig,
    tls: Option<keratin_net::ClusterTls>,
) -> Result<PreparedCluster, NodeError> {
    let resolved = cluster
        .resolve()
        .map_err(|e| NodeError::Cluster(e.to_string()))?;
    let node_id = resolved.node_id;
    let cluster_for_logs = resolved.clone();
    let config = keratin_raft::replica::replica_config(&resolved.name)
        .map_err(|e| NodeError::Cluster(e.to_string()))?;
    let make_logs: keratin_cluster::MakePartitionLogs =
        Box::new(move |transport, groups, directory| {
            let directory = directory.clone();
            Arc::new(keratin_raft::partition_log::ReplicatedLogs::new(
                keratin_raft::partition_log::ReplicatedLogsSetup {
                    node_id,
                    transport: transport.clone(),
                    groups: groups.clone(),
                    raft_config: config,
                    cluster: cluster_for_logs,
                    // A redirect never names this node (`docs/cluster.md`, "Redirects never
                    // loop"); `role_of` already leaves it out, this keeps it so.
                    client_addrs: Arc::new(move |id| {
                        (id != node_id).then(|| directory.client_addr(id)).flatten()
                    }),
                },
            ))
        });
    ClusterNode::prepare(
        resolved,
        keratin_net::TransportOptions {
            tls,
            ..keratin_net::TransportOptions::default()
        },
        make_logs,
    )
    .await
    .map(|prepared| prepared.joining(cluster.join))
    .map_err(NodeError::Cluster)
}

async fn wait_stop(mut stopped: watch::Receiver<bool>) {
    while !*stopped.borrow() {
        if stopped.changed().await.is_err() {
            return;
        }
    }
}

/// The delivery byte budgets: node-wide (`server.delivery_bytes_max`) and per connection
/// (`server.outbound_bytes_max`); 0 in the configuration means "sized from the memory limit".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeliveryBudgets {
    pub(crate) node_bytes: u64,
    pub(crate) connection_bytes: u64,
}

/// The smallest derived budget: room for a few large messages even on a tiny memory limit.
const DELIVERY_BUDGET_FLOOR_BYTES: u64 = 8 << 20;

impl DeliveryBudgets {
    /// Like the publish budget: each delivery byte is held about twice (the payload read, the
    /// encoded frame) until it is flushed, so an eighth of the memory limit keeps deliveries
    /// under a quarter of it, beside the publishes' quarter. A connection gets a sixteenth of
    /// the node's budget, so that sixteen stalled connections are needed to take it all.
    pub(crate) fn of(config: &Config, memory_limit_bytes: u64) -> DeliveryBudgets {
        let node_bytes = match config.server.delivery_bytes_max {
            0 => keratin_broker::DELIVERY_BYTES_DEFAULT
                .min((memory_limit_bytes / 8).max(DELIVERY_BUDGET_FLOOR_BYTES)),
            set => set,
        };
        let connection_bytes = match config.server.outbound_bytes_max {
            0 => (crate::tcp::OUTBOUND_BYTES_DEFAULT as u64)
                .min(node_bytes / 16)
                .max(1 << 20),
            set => set,
        };
        DeliveryBudgets {
            node_bytes,
            connection_bytes,
        }
    }
}

/// A cluster node reports its levels at least this often, even if no sample round ends (its
/// label also goes with every ping; this keeps the report's figures fresh).
const REPORT_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// Tell the cluster this node's resources after every sample round (and at least every
/// [`REPORT_EVERY`]) until stopped: its label carries them to every peer at once, where the
/// leaders of the partitions with a copy here judge their publishes by them, and placement
/// gives new replicas only to nodes below soft, the emptiest first.
async fn report_levels(
    cluster: Arc<ClusterNode>,
    limits: Arc<NodeLimits>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut samples = limits.samples();
    loop {
        cluster.set_levels(limits.node_report());
        tokio::select! {
            _ = tokio::time::timeout(REPORT_EVERY, samples.changed()) => {}
            _ = stopped.wait_for(|stop| *stop) => return,
        }
    }
}

/// Apply the cluster-wide runtime settings as this node's copy of the metadata group says,
/// at start (once the records are replayed) and after every change, until `stop`.
async fn follow_cluster_settings(
    mut values: watch::Receiver<BTreeMap<String, serde_json::Value>>,
    settings: Arc<NodeSettings>,
    broker: Broker,
    limits: Arc<NodeLimits>,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    loop {
        let current = values.borrow_and_update().clone();
        settings.set_cluster(current, &broker, &limits).await;
        tokio::select! {
            changed = values.changed() => if changed.is_err() { return Ok(()) },
            _ = stop.changed() => return Ok(()),
        }
    }
}

/// The handshake's list of the other nodes: what the cluster's directory learned from them
/// (their addresses told as this node reaches them).
fn cluster_peers(cluster: Arc<ClusterNode>) -> crate::tcp::ClusterPeers {
    crate::tcp::ClusterPeers(Arc::new(move || {
        cluster
            .directory()
            .others(cluster.node_id())
            .into_iter()
            .map(|info| keratin_proto::NodeAddress {
                node_id: info.name.unwrap_or_else(|| format!("node-{}", info.id)),
                server: info.client,
                admin: Some(info.admin),
            })
            .collect()
    }))
}

/// The audit trail in `dir`; in memory only (logged) if its files cannot be opened: a node
/// never refuses to start over its audit file.
fn open_audit(dir: &std::path::Path) -> crate::audit::AuditLog {
    match crate::audit::AuditLog::open(dir) {
        Ok(audit) => audit,
        Err(error) => {
            tracing::error!(
                dir = %dir.display(),
                %error,
                "cannot open the audit trail's file; recording in memory only until a restart"
            );
            crate::audit::AuditLog::in_memory()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivery_budgets_follow_the_memory_limit_unless_set() {
        let mut config = Config::default();
        let at_512_mib = DeliveryBudgets::of(&config, 512 << 20);
        assert_eq!(at_512_mib.node_bytes, 64 << 20);
        assert_eq!(at_512_mib.connection_bytes, 4 << 20);
        let at_128_mib = DeliveryBudgets::of(&config, 128 << 20);
        assert_eq!(at_128_mib.node_bytes, 16 << 20);
        assert_eq!(at_128_mib.connection_bytes, 1 << 20);
        let large = DeliveryBudgets::of(&config, 64 << 30);
        assert_eq!(large.node_bytes, keratin_broker::DELIVERY_BYTES_DEFAULT);
        config.server.delivery_bytes_max = 1 << 30;
        config.server.outbound_bytes_max = 32 << 20;
        let set = DeliveryBudgets::of(&config, 512 << 20);
        assert_eq!(set.node_bytes, 1 << 30);
        assert_eq!(set.connection_bytes, 32 << 20);
    }
}
