//! `keratin serve`: load the configuration from its four sources, start a node, and stop it
//! gracefully on SIGTERM or SIGINT (stop accepting, let in-flight syncs finish, close logs).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use keratin_server::config::{load_from_process_env, CliOverrides};
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
    /// Print the effective configuration, with where each value came from, and exit.
    #[arg(long)]
    print_config: bool,
}

pub async fn run(args: ServeArgs) -> Result<ExitCode, String> {
    let cli = CliOverrides {
        config: args.config,
        data_dirs: args.data_dirs,
        listen: args.listen,
        http: args.http,
    };
    let loaded = load_from_process_env(&cli).map_err(|e| e.to_string())?;
    if args.print_config {
        print!("{}", loaded.print());
        return Ok(ExitCode::SUCCESS);
    }
    init_logging();
    let node = Node::start_loaded(&loaded)
        .await
        .map_err(|e| e.to_string())?;
    // Scripts and tests read this line to learn the ports (useful with port 0).
    println!(
        "keratin listening protocol={} http={}",
        node.protocol_addr(),
        node.http_addr()
    );
    wait_for_signal().await?;
    tracing::info!("shutting down");
    node.shutdown().await.map_err(|e| e.to_string())?;
    tracing::info!("stopped cleanly");
    Ok(ExitCode::SUCCESS)
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KERATIN_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

async fn wait_for_signal() -> Result<(), String> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(|e| format!("SIGTERM handler: {e}"))?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| format!("SIGINT handler: {e}"))?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}
