//! The flags every CLI verb shares (`--server`, `--json`) and connecting to the broker with them.
//!
//! Owns the default address and the client options the CLI uses; what each verb does with
//! the connection belongs to its own module.

use std::time::Duration;

use clap::Args;
use keratin_client::{Client, ClientOptions, ClientTls};

use crate::output::Failure;

/// The broker's default protocol address, as `keratin serve` binds it.
pub const SERVER_DEFAULT: &str = "127.0.0.1:5680";

/// Flags shared by every verb. `global` so `keratin queue --json list` and
/// `keratin queue list --json` both work.
#[derive(Debug, Args)]
pub struct CommonArgs {
    /// The broker's protocol address.
    #[arg(long, env = "KERATIN_SERVER", default_value = SERVER_DEFAULT, value_name = "ADDR", global = true)]
    pub server: String,
    /// Print one JSON object on stdout instead of human-readable text.
    #[arg(long, global = true)]
    pub json: bool,
    /// Connect with TLS, verifying the broker's certificate against the CA certificates in
    /// this PEM file (for a broker with server.tls_cert_file).
    #[arg(long, env = "KERATIN_CA", value_name = "FILE", global = true)]
    pub ca: Option<std::path::PathBuf>,
}

/// Connects to `--server` with `publish_timeout` (the client's default when `None`).
pub async fn connect(
    common: &CommonArgs,
    publish_timeout: Option<Duration>,
) -> Result<Client, Failure> {
    let mut options = ClientOptions {
        name: format!("keratin-cli {}", env!("CARGO_PKG_VERSION")),
        ..ClientOptions::default()
    };
    if let Some(timeout) = publish_timeout {
        options.publish_timeout = timeout;
    }
    if let Some(ca) = &common.ca {
        let tls = ClientTls::from_ca_file(ca)
            .map_err(|error| Failure::client("cannot set up TLS".to_string(), &error))?;
        // A host name in --server is the name the certificate must carry; an IP address is
        // checked as an IP (the client's default).
        let host = common
            .server
            .rsplit_once(':')
            .map_or(common.server.as_str(), |(host, _)| host)
            .trim_start_matches('[')
            .trim_end_matches(']');
        let tls = if host.parse::<std::net::IpAddr>().is_ok() {
            tls
        } else {
            tls.with_server_name(host)
                .map_err(|error| Failure::client("cannot set up TLS".to_string(), &error))?
        };
        options.tls = Some(tls);
    }
    Client::connect(common.server.as_str(), options)
        .await
        .map_err(|error| Failure::client(format!("cannot connect to {}", common.server), &error))
}
