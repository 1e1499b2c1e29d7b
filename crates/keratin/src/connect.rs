//! The flags every CLI verb shares (`--server`, `--json`) and connecting to the broker with them.
//!
//! Owns the default address and the client options the CLI uses; what each verb does with
//! the connection belongs to its own module.

use std::sync::OnceLock;
use std::time::Duration;

use clap::Args;
use keratin_client::{Client, ClientOptions, ClientTls, Credentials};

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
    /// Log in as this user (with --password). Without --user or --token, the CLI logs in as
    /// `admin` with the password a node on this machine wrote at its first start
    /// (`<data dir>/admin-password`, the data directory from KERATIN_DATA_DIR or
    /// ./keratin-data), when it can read that file.
    #[arg(long, env = "KERATIN_USER", value_name = "NAME", global = true)]
    pub user: Option<String>,
    /// The user's password.
    #[arg(
        long,
        env = "KERATIN_PASSWORD",
        value_name = "PASSWORD",
        global = true,
        hide_env_values = true
    )]
    pub password: Option<String>,
    /// Log in with an API token (`keratin user token add`) instead of a password.
    #[arg(
        long,
        env = "KERATIN_TOKEN",
        value_name = "TOKEN",
        global = true,
        hide_env_values = true,
        conflicts_with = "user"
    )]
    pub token: Option<String>,
    /// Log in with this client certificate (PEM; with --key and --ca) as the user its common
    /// name names, on a node with server.tls_client_ca_file. Protocol verbs only: the HTTP
    /// admin port takes a password or token.
    #[arg(
        long,
        env = "KERATIN_CERT",
        value_name = "FILE",
        global = true,
        requires = "key"
    )]
    pub cert: Option<std::path::PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(
        long,
        env = "KERATIN_KEY",
        value_name = "FILE",
        global = true,
        requires = "cert"
    )]
    pub key: Option<std::path::PathBuf>,
}

/// Who the CLI logs in as.
#[derive(Clone)]
pub enum CliLogin {
    /// A user and password.
    Password {
        /// The user.
        user: String,
        /// The password.
        password: String,
        /// The file the password was read from (the admin password a node wrote), to name
        /// when the node refuses it; `None`: given on the command line or in the environment.
        file: Option<std::path::PathBuf>,
    },
    /// An API token.
    Token(String),
}

impl std::fmt::Debug for CliLogin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CliLogin::Password { user, .. } => write!(f, "Password {{ user: {user:?}, .. }}"),
            CliLogin::Token(_) => f.write_str("Token(..)"),
        }
    }
}

impl CliLogin {
    /// The value of an HTTP `Authorization` header for it.
    pub fn authorization(&self) -> String {
        use base64::Engine;
        match self {
            CliLogin::Password { user, password, .. } => format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
            ),
            CliLogin::Token(token) => format!("Bearer {token}"),
        }
    }

    /// The protocol client's credentials for it.
    fn credentials(&self) -> Credentials {
        match self {
            CliLogin::Password { user, password, .. } => Credentials::Password {
                user: user.clone(),
                password: password.clone(),
            },
            CliLogin::Token(token) => Credentials::Token(token.clone()),
        }
    }
}

/// The login of this run, resolved once from the first verb's flags (a CLI run is one verb).
static LOGIN: OnceLock<Option<CliLogin>> = OnceLock::new();

/// The file a node writes its first admin's password to, in its first data directory.
const ADMIN_PASSWORD_FILE: &str = "admin-password";

/// The login the flags give (see [`CommonArgs::user`]); resolved once per run.
pub fn login(common: &CommonArgs) -> Result<Option<CliLogin>, Failure> {
    if let Some(login) = LOGIN.get() {
        return Ok(login.clone());
    }
    let login = resolve_login(common)?;
    Ok(LOGIN.get_or_init(|| login).clone())
}

/// The login resolved by [`login`] (none before it ran).
pub fn current_login() -> Option<CliLogin> {
    LOGIN.get().cloned().flatten()
}

fn resolve_login(common: &CommonArgs) -> Result<Option<CliLogin>, Failure> {
    if let Some(token) = &common.token {
        return Ok(Some(CliLogin::Token(token.clone())));
    }
    if let Some(user) = &common.user {
        let Some(password) = &common.password else {
            return Err(Failure::new(format!(
                "--user {user} needs --password (or KERATIN_PASSWORD)"
            )));
        };
        return Ok(Some(CliLogin::Password {
            user: user.clone(),
            password: password.clone(),
            file: None,
        }));
    }
    let dir = std::env::var_os("KERATIN_DATA_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("keratin-data"));
    // Unreadable or absent: no login (a node with `server.auth = none` needs none; one that
    // needs it says so).
    let file = dir.join(ADMIN_PASSWORD_FILE);
    Ok(std::fs::read_to_string(&file)
        .ok()
        .map(|text| text.trim().to_string())
        .filter(|password| !password.is_empty())
        .map(|password| CliLogin::Password {
            user: "admin".into(),
            password,
            file: Some(file),
        }))
}

/// What to add to a refused login (401): where the password came from when the CLI read it
/// from a node's `admin-password` file (which may be stale, or another cluster's), and what
/// to do; `None` when the login was given.
pub fn refused_login_hint() -> Option<String> {
    match current_login()? {
        CliLogin::Password {
            file: Some(file), ..
        } => Some(format!(
            "the CLI logged in as admin with the password in {} (the file the first node of a \
             cluster writes in its data directory; this one may be stale, or another \
             cluster's): pass --user and --password (KERATIN_USER, KERATIN_PASSWORD), or set \
             KERATIN_DATA_DIR to the data directory of the node that wrote the cluster's \
             admin password",
            file.display()
        )),
        _ => None,
    }
}

/// `failure` with [`refused_login_hint`] when it is a refused login (401).
pub fn with_login_hint(mut failure: Failure) -> Failure {
    if failure.code == Some(401) {
        if let Some(hint) = refused_login_hint() {
            failure.message = format!("{}; {hint}", failure.message);
        }
    }
    failure
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
    options.credentials = login(common)?.map(|login| login.credentials());
    let client_cert = common.cert.as_deref().zip(common.key.as_deref());
    if client_cert.is_some() && common.ca.is_none() {
        return Err(Failure::new(
            "--cert needs --ca: a certificate login is over TLS".to_string(),
        ));
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
        let tls = match client_cert {
            Some((cert, key)) => {
                // The certificate is the login unless a user or token was given.
                if common.user.is_none() && common.token.is_none() {
                    options.credentials = Some(Credentials::Certificate);
                }
                tls.with_client_cert(cert, key)
                    .map_err(|error| Failure::client("cannot set up TLS".to_string(), &error))?
            }
            None => tls,
        };
        options.tls = Some(tls);
    }
    Client::connect(common.server.as_str(), options)
        .await
        .map_err(|error| {
            with_login_hint(Failure::client(
                format!("cannot connect to {}", common.server),
                &error,
            ))
        })
}
