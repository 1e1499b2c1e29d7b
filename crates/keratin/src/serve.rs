//! `keratin serve`: load the configuration from its four sources, start a node, and stop it
//! gracefully on SIGTERM or SIGINT (stop accepting, let in-flight syncs finish, close logs).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use keratin_server::config::{load_from_process_env, CliOverrides, LoadedConfig};
use keratin_server::Node;

/// Flags of `keratin serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A TOML configuration file (see docs/configuration.md).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// A storage directory; repeat for several (replaces storage.dirs). Default ./keratin-data.
    #[arg(long = "data-dir", value_name = "DIR")]
    data_dirs: Vec<PathBuf>,
    /// Protocol listen address. Default 127.0.0.1:5680.
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// HTTP admin listen address. Default 127.0.0.1:5681.
    #[arg(long, value_name = "ADDR")]
    http: Option<SocketAddr>,
    /// This node's id in a cluster (cluster.node_id); with --peer, the node joins the cluster.
    #[arg(long = "node-id", value_name = "N")]
    node_id: Option<u64>,
    /// The address peers reach this node on (cluster.listen). Default: this node's --peer entry.
    #[arg(long = "cluster-listen", value_name = "ADDR")]
    cluster_listen: Option<SocketAddr>,
    /// A node of the cluster as ID=ADDR (its cluster address); repeat for each node, this one
    /// may be listed too (cluster.peers).
    #[arg(long = "peer", value_name = "ID=ADDR")]
    peers: Vec<keratin_net::PeerSpec>,
    /// Join a running cluster (cluster.join): list its nodes with --peer, start this node,
    /// then admit it with `keratin cluster add-node ID=ADDR` on any node. Never forms the
    /// cluster's metadata group.
    #[arg(long)]
    join: bool,
    /// Serve on addresses off loopback without what makes each port safe there (the protocol
    /// and HTTP ports: logins and TLS; the cluster port: mutual TLS) (server.insecure).
    #[arg(long)]
    insecure: bool,
    /// Print the effective configuration, with where each value came from, and exit.
    #[arg(long)]
    print_config: bool,
}

/// What `keratin serve` does once its flags are read.
pub enum Prepared {
    /// `--print-config`: print this and exit.
    Print(String),
    /// Serve with this configuration.
    Serve(Box<LoadedConfig>),
}

/// Read the configuration from its four sources, before the async runtime exists: the runtime's
/// thread counts come from it.
pub fn prepare(args: ServeArgs) -> Result<Prepared, String> {
    let cli = CliOverrides {
        config: args.config,
        data_dirs: args.data_dirs,
        listen: args.listen,
        http: args.http,
        node_id: args.node_id,
        cluster_listen: args.cluster_listen,
        peers: args.peers,
        join: args.join,
        insecure: args.insecure,
    };
    let loaded = load_from_process_env(&cli).map_err(|e| e.to_string())?;
    if args.print_config {
        return Ok(Prepared::Print(loaded.print()));
    }
    Ok(Prepared::Serve(Box::new(loaded)))
}

/// The async runtime of a node: `server.worker_threads` workers and at most
/// `server.blocking_threads_max` blocking threads (docs/ARCHITECTURE.md, "Threads").
pub fn runtime(loaded: &LoadedConfig) -> std::io::Result<tokio::runtime::Runtime> {
    let server = &loaded.config().server;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(server.worker_threads_effective())
        .max_blocking_threads(usize::try_from(server.blocking_threads_max).unwrap_or(64))
        .thread_name("keratin-worker")
        .enable_all()
        .build()
}

/// Run a node until SIGTERM or SIGINT, then stop it gracefully.
pub async fn run(loaded: LoadedConfig) -> Result<ExitCode, String> {
    init_logging();
    raise_open_files_limit(&loaded);
    let node = Node::start_loaded(&loaded)
        .await
        .map_err(|e| e.to_string())?;
    // Scripts and tests read this line to learn the ports (useful with port 0).
    outln!(
        "keratin listening protocol={} http={}",
        node.protocol_addr(),
        node.http_addr()
    );
    wait_for_signal(&node).await?;
    tracing::info!("shutting down");
    node.shutdown().await.map_err(|e| e.to_string())?;
    tracing::info!("stopped cleanly");
    Ok(ExitCode::SUCCESS)
}

/// Descriptors a node may need at its bounds: one per connection, one per partition holding a
/// segment (an idle empty log holds none), a few per storage directory and listener.
fn open_files_wanted(loaded: &LoadedConfig) -> u64 {
    let server = &loaded.config().server;
    server
        .connections_max
        .saturating_add(server.partitions_max)
        .saturating_add(256)
}

/// Raise the soft limit on open files to the hard limit, as Go programs (NATS) and the JVM
/// (Kafka) do at start: the soft default (often 1,024) is far below what many queues with
/// messages and many connections need, and the hard limit is what the operator allowed. Warn
/// when even the hard limit is below what the configured bounds may need.
fn raise_open_files_limit(loaded: &LoadedConfig) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    if got != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot read the open files limit");
        return;
    }
    let before = limit.rlim_cur;
    if limit.rlim_cur < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "cannot raise the open files limit");
            limit.rlim_cur = before;
        }
    }
    let wanted = open_files_wanted(loaded);
    let now: u64 = limit.rlim_cur;
    if now < wanted {
        tracing::warn!(open_files_max = now, wanted, "the open files limit is below what server.connections_max + server.partitions_max may need; raise it (ulimit -n, LimitNOFILE=) or lower those bounds");
    } else {
        tracing::info!(
            open_files_max = now,
            raised_from = before,
            "open files limit"
        );
    }
}

/// Without `KERATIN_LOG`: Keratin at info; openraft's own messages only at error, since it
/// warns on every retry to an unreachable peer (several per second per group). Keratin's
/// transport logs each peer going up or down once.
const DEFAULT_LOG_FILTER: &str = "info,openraft=error";

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KERATIN_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

async fn wait_for_signal(node: &Node) -> Result<(), String> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(|e| format!("SIGTERM handler: {e}"))?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| format!("SIGINT handler: {e}"))?;
    let mut hup = signal(SignalKind::hangup()).map_err(|e| format!("SIGHUP handler: {e}"))?;
    loop {
        tokio::select! {
            _ = term.recv() => return Ok(()),
            _ = int.recv() => return Ok(()),
            _ = hup.recv() => {
                match node.reload_tls() {
                    Ok(true) => tracing::info!("SIGHUP: the TLS certificate and key of the protocol and HTTP admin ports were read again; new connections get them"),
                    Ok(false) => tracing::info!("SIGHUP: no TLS on the protocol port, nothing to reload"),
                    Err(error) => tracing::error!(%error, "SIGHUP: the TLS certificate of the protocol and HTTP admin ports was not reloaded; connections keep getting the one before"),
                }
                match node.reload_cluster_tls() {
                    Ok(true) => tracing::info!("SIGHUP: the cluster port's certificate, key and CA were read again; new peer connections use them"),
                    Ok(false) => {}
                    Err(error) => tracing::error!(%error, "SIGHUP: the cluster port's TLS files were not reloaded; peer connections keep the ones before"),
                }
            }
        }
    }
}
