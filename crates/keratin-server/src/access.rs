//! Who may connect and what they may do (issue 16): the node's side of `keratin-auth`.
//!
//! - [`Access`] holds the user table as stored (a single node's metadata log, or a cluster's
//!   metadata group, through [`UserStore`]), the login gate (argon2 verifications bounded, failing
//!   addresses slowed) and the mode (`server.auth`: `users`, or `none` for anyone).
//! - [`Access::login`] turns what a client presents (the protocol handshake's mechanism, an
//!   HTTP `Authorization` header) into an [`Identity`], or a 401 that says why.
//! - [`Grant`] is a connection's identity with its own view of the table: a permission check
//!   is a map lookup and a rule scan on a table that is swapped whole when users change (no
//!   lock held across a request).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keratin_auth::{
    AuthError, GateConfig, LoginGate, PasswordDigest, Permission, TokenDigest, UserChange,
    UserTable,
};
use keratin_broker::Broker;
use keratin_cluster::ClusterNode;
use keratin_proto::codes::{ERR_FORBIDDEN, ERR_INTERNAL, ERR_UNAUTHENTICATED};
use keratin_proto::ErrorBody;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// `server.auth`: whether clients log in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthMode {
    /// Every connection and HTTP request logs in as a user and is held to its permissions.
    #[default]
    Users,
    /// Anyone who reaches a port may do anything (a node on loopback for tests and
    /// development; off loopback only with `server.insecure`).
    None,
}

/// What a client presents to log in.
#[derive(Clone, PartialEq, Eq)]
pub enum Login {
    /// Nothing.
    Nothing,
    /// A user name and password.
    Password {
        /// The user.
        user: String,
        /// The password.
        password: String,
    },
    /// An API token.
    Token(String),
    /// The identity of the TLS client certificate (its subject's common name), or `None`
    /// when the connection presented no certificate the node verified.
    Certificate(Option<String>),
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Login::Nothing => f.write_str("Nothing"),
            Login::Password { user, .. } => write!(f, "Password {{ user: {user:?}, .. }}"),
            Login::Token(_) => f.write_str("Token(..)"),
            Login::Certificate(name) => write!(f, "Certificate({name:?})"),
        }
    }
}

/// Who a connection or request is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// `server.auth = none`: anyone, allowed everything.
    Anyone,
    /// A logged-in user.
    User(Arc<str>),
}

impl Identity {
    /// The user's name (`None` for anyone).
    pub fn user(&self) -> Option<&str> {
        match self {
            Identity::Anyone => None,
            Identity::User(name) => Some(name),
        }
    }
}

/// Where the users are stored.
#[derive(Clone)]
pub enum UserStore {
    /// A single node: its metadata log.
    Node(Broker),
    /// A cluster: its metadata group. Weak: the node's shutdown takes the cluster layer back
    /// (`Arc::try_unwrap`) to stop its transport and groups, while connections still holding
    /// this store may be ending; a change asked for after that is refused.
    Cluster(std::sync::Weak<ClusterNode>),
}

/// Why a user change was not made.
#[derive(Debug, thiserror::Error)]
pub enum UserChangeError {
    /// The change does not apply (an unknown user, a duplicate, the last admin).
    #[error("{0}")]
    Refused(String),
    /// It could not be stored (a stopped metadata log, no cluster quorum); retry.
    #[error("the user change could not be stored: {0}")]
    Store(String),
}

/// See the module docs.
pub struct Access {
    mode: AuthMode,
    store: UserStore,
    /// The table, as stored (a single node publishes its own changes here; a cluster's applier
    /// publishes every node's).
    table: watch::Receiver<Arc<UserTable>>,
    /// A single node's sender of `table`.
    local: Option<watch::Sender<Arc<UserTable>>>,
    gate: LoginGate,
    /// Orders a single node's changes with the table they are published in.
    changes: tokio::sync::Mutex<()>,
    /// The dashboard's sessions (`POST /api/v1/login`), in memory: a restart logs them out.
    sessions: std::sync::Mutex<HashMap<TokenDigest, Session>>,
    /// Passwords verified lately over HTTP basic (each request carries the password: one
    /// argon2 verification per request would let a dashboard's polling cost 19 MiB a call),
    /// by the digest of user and password, with the stored hash they matched.
    verified: std::sync::Mutex<HashMap<TokenDigest, Verified>>,
    /// Publish quotas per user on this node.
    quotas: crate::quota::Quotas,
    /// Logins accepted and refused since start (metrics).
    logins_ok: std::sync::atomic::AtomicU64,
    logins_refused: std::sync::atomic::AtomicU64,
}

/// A dashboard session.
#[derive(Debug, Clone)]
struct Session {
    user: Arc<str>,
    expires: Instant,
}

/// An HTTP basic login verified lately.
#[derive(Debug, Clone)]
struct Verified {
    /// The hash it matched: a changed password (or a deleted user) no longer matches.
    hash: PasswordDigest,
    expires: Instant,
}

/// How long a dashboard session lasts.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// Most dashboard sessions at once; the oldest goes first.
pub const SESSIONS_MAX: usize = 1024;
/// How long a verified HTTP basic login is taken without a new verification.
const VERIFIED_TTL: Duration = Duration::from_secs(60);
/// Most verified HTTP basic logins remembered.
const VERIFIED_MAX: usize = 1024;

impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("mode", &self.mode)
            .field("users", &self.table.borrow().len())
            .finish()
    }
}

impl Access {
    /// Access control over `store`'s users.
    pub fn new(mode: AuthMode, store: UserStore, gate: GateConfig) -> Access {
        let (table, local) = match &store {
            UserStore::Node(broker) => {
                let (sender, receiver) = watch::channel(broker.users());
                (receiver, Some(sender))
            }
            UserStore::Cluster(cluster) => match cluster.upgrade() {
                Some(cluster) => (cluster.users(), None),
                // Only while the node is stopping: no users, every login refused.
                None => (watch::channel(Arc::new(UserTable::default())).1, None),
            },
        };
        Access {
            mode,
            store,
            table,
            local,
            gate: LoginGate::new(gate),
            changes: tokio::sync::Mutex::new(()),
            sessions: std::sync::Mutex::new(HashMap::new()),
            verified: std::sync::Mutex::new(HashMap::new()),
            quotas: crate::quota::Quotas::default(),
            logins_ok: std::sync::atomic::AtomicU64::new(0),
            logins_refused: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The mode.
    pub fn mode(&self) -> AuthMode {
        self.mode
    }

    /// The users now.
    pub fn table(&self) -> Arc<UserTable> {
        self.table.borrow().clone()
    }

    /// Logins waiting for or in a password verification.
    pub fn logins_in_flight(&self) -> usize {
        self.gate.in_flight()
    }

    /// The publish quotas of this node.
    pub fn quotas(&self) -> &crate::quota::Quotas {
        &self.quotas
    }

    /// Logins accepted and refused since the node started (`Nothing` under `auth = none`
    /// not counted).
    pub fn login_counts(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.logins_ok.load(Relaxed),
            self.logins_refused.load(Relaxed),
        )
    }

    /// Log in with what a client presented from `from`. With `server.auth = none` anyone
    /// is let in (a presented login is checked all the same, so a wrong password is never
    /// taken silently). Errors are 401 bodies that say why, with a retry hint when the
    /// address is slowed or the gate is full.
    pub async fn login(&self, login: &Login, from: IpAddr) -> Result<Identity, ErrorBody> {
        use std::sync::atomic::Ordering::Relaxed;
        let result = self.login_uncounted(login, from).await;
        match (&result, login) {
            (Ok(_), Login::Nothing) => {}
            (Ok(_), _) => {
                self.logins_ok.fetch_add(1, Relaxed);
            }
            (Err(_), _) => {
                self.logins_refused.fetch_add(1, Relaxed);
            }
        }
        result
    }

    async fn login_uncounted(&self, login: &Login, from: IpAddr) -> Result<Identity, ErrorBody> {
        let table = self.table();
        let name = match login {
            Login::Nothing if self.mode == AuthMode::None => return Ok(Identity::Anyone),
            Login::Nothing => {
                return Err(ErrorBody::new(
                    ERR_UNAUTHENTICATED,
                    "this broker requires a login: give a user and password (--user and \
                     --password, env KERATIN_USER and KERATIN_PASSWORD) or an API token",
                ))
            }
            Login::Certificate(None) => {
                return Err(ErrorBody::new(
                    ERR_UNAUTHENTICATED,
                    "certificate login without a verified client certificate: the node needs \
                     server.tls_client_ca_file, the client a certificate that CA signed",
                ))
            }
            Login::Certificate(Some(name)) => match table.get(name) {
                Some(user) => user.name.clone(),
                None => {
                    return Err(ErrorBody::new(
                        ERR_UNAUTHENTICATED,
                        format!(
                            "login failed: the client certificate names {name:?} (its common \
                             name), which is no user here"
                        ),
                    ))
                }
            },
            Login::Token(token) => match self.session_user(token, &table) {
                Some(user) => user.to_string(),
                None => match table.user_of_token(token) {
                    Some(user) => user.name.clone(),
                    None => {
                        return Err(ErrorBody::new(
                            ERR_UNAUTHENTICATED,
                            "login failed: the API token is unknown, was deleted, or its \
                             session ended",
                        ))
                    }
                },
            },
            Login::Password { user, password } => {
                let digest = table.get(user).map(|u| u.password.clone());
                let key = TokenDigest::of(&format!("{user}\0{password}"));
                if self.verified_lately(&key, digest.as_ref()) {
                    return Ok(Identity::User(user.as_str().into()));
                }
                self.gate
                    .verify(from, digest.as_ref(), password)
                    .await
                    .map_err(login_error)?;
                if let Some(hash) = digest {
                    self.remember_verified(key, hash);
                }
                user.clone()
            }
        };
        Ok(Identity::User(name.into()))
    }

    /// Open a dashboard session for `user`: a token to send as `Authorization: Bearer`, valid
    /// for [`SESSION_TTL`] or until [`Access::close_session`]; at most [`SESSIONS_MAX`] at
    /// once (the oldest goes).
    pub fn open_session(&self, user: &str) -> Result<keratin_auth::ApiToken, ErrorBody> {
        let token = keratin_auth::ApiToken::generate()
            .map_err(|e| ErrorBody::new(ERR_INTERNAL, e.to_string()))?;
        let now = Instant::now();
        let mut sessions = lock(&self.sessions);
        sessions.retain(|_, s| s.expires > now);
        if sessions.len() >= SESSIONS_MAX {
            if let Some(oldest) = sessions
                .iter()
                .min_by_key(|(_, s)| s.expires)
                .map(|(k, _)| *k)
            {
                sessions.remove(&oldest);
            }
        }
        sessions.insert(
            token.digest(),
            Session {
                user: user.into(),
                expires: now + SESSION_TTL,
            },
        );
        Ok(token)
    }

    /// End a dashboard session (nothing happens for an unknown token).
    pub fn close_session(&self, token: &str) {
        lock(&self.sessions).remove(&TokenDigest::of(token));
    }

    /// The user of a live session token (a user deleted since has none).
    fn session_user(&self, token: &str, table: &UserTable) -> Option<Arc<str>> {
        if !TokenDigest::looks_like_token(token) {
            return None;
        }
        let sessions = lock(&self.sessions);
        let session = sessions.get(&TokenDigest::of(token))?;
        (session.expires > Instant::now() && table.get(&session.user).is_some())
            .then(|| session.user.clone())
    }

    fn verified_lately(&self, key: &TokenDigest, hash: Option<&PasswordDigest>) -> bool {
        let Some(hash) = hash else {
            return false;
        };
        lock(&self.verified)
            .get(key)
            .is_some_and(|v| &v.hash == hash && v.expires > Instant::now())
    }

    fn remember_verified(&self, key: TokenDigest, hash: PasswordDigest) {
        let now = Instant::now();
        let mut verified = lock(&self.verified);
        if verified.len() >= VERIFIED_MAX {
            verified.retain(|_, v| v.expires > now);
            if verified.len() >= VERIFIED_MAX {
                verified.clear();
            }
        }
        verified.insert(
            key,
            Verified {
                hash,
                expires: now + VERIFIED_TTL,
            },
        );
    }

    /// A connection's grant for `identity`.
    pub fn grant(&self, identity: Identity) -> Grant {
        Grant {
            identity,
            table: self.table.clone(),
        }
    }

    /// Store a change to the users (durably: the node's metadata log or the cluster's
    /// metadata group), then publish the new table; returns it.
    pub async fn change(&self, change: UserChange) -> Result<Arc<UserTable>, UserChangeError> {
        let _ordered = self.changes.lock().await;
        let user = change.user().to_string();
        let table = match &self.store {
            UserStore::Node(broker) => {
                let table = broker.change_users(change).await.map_err(|e| match e {
                    keratin_broker::BrokerError::Invalid(reason) => {
                        UserChangeError::Refused(reason)
                    }
                    other => UserChangeError::Store(other.to_string()),
                })?;
                if let Some(local) = &self.local {
                    local.send_replace(table.clone());
                }
                table
            }
            UserStore::Cluster(cluster) => {
                // Checked here first, so a refusal is told as one; the cluster checks again
                // in log order.
                self.table()
                    .changed(&change)
                    .map_err(|e| UserChangeError::Refused(e.to_string()))?;
                let Some(cluster) = cluster.upgrade() else {
                    return Err(UserChangeError::Store(
                        "the node is stopping; change the users on a running node".into(),
                    ));
                };
                cluster
                    .change_users(change)
                    .await
                    .map_err(UserChangeError::Store)?
            }
        };
        tracing::info!(user, "users changed");
        self.quotas.retain(|name| table.get(name).is_some());
        Ok(table)
    }
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Plain maps: a panic while one was held leaves nothing half-changed worth refusing over.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// The 401 of a failed login.
fn login_error(error: AuthError) -> ErrorBody {
    let retry = |after: Duration| u32::try_from(after.as_millis()).unwrap_or(u32::MAX).max(1);
    match error {
        AuthError::TooManyFailures { retry_after } | AuthError::Busy { retry_after } => {
            ErrorBody::new(ERR_UNAUTHENTICATED, error.to_string())
                .with_retry_after_ms(retry(retry_after))
        }
        AuthError::LoginFailed => ErrorBody::new(ERR_UNAUTHENTICATED, error.to_string()),
        other => ErrorBody::new(ERR_INTERNAL, other.to_string()),
    }
}

/// A connection's (or request's) identity with its view of the users: checks are lock-free
/// reads of the table as last stored.
#[derive(Debug, Clone)]
pub struct Grant {
    identity: Identity,
    table: watch::Receiver<Arc<UserTable>>,
}

impl Grant {
    /// Anyone, allowed everything (a server without access control).
    pub fn anyone() -> Grant {
        Grant {
            identity: Identity::Anyone,
            table: watch::channel(Arc::new(UserTable::new())).1,
        }
    }

    /// Who.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// True if this identity may do `permission` on `queue`. A user deleted or changed after
    /// it logged in is held to the table as it is now.
    pub fn allows(&self, queue: &str, permission: Permission) -> bool {
        match &self.identity {
            Identity::Anyone => true,
            Identity::User(user) => self.table.borrow().allows(user, queue, permission),
        }
    }

    /// True if this identity may do anything at all on `queue` (to see it listed).
    pub fn sees(&self, queue: &str) -> bool {
        [Permission::Publish, Permission::Consume, Permission::Manage]
            .into_iter()
            .any(|p| self.allows(queue, p))
    }

    /// This identity's publish quota (none for anyone, or a user without one).
    pub fn quota(&self) -> Option<(Arc<str>, keratin_auth::Quota)> {
        let Identity::User(user) = &self.identity else {
            return None;
        };
        let quota = self.table.borrow().get(user)?.quota;
        (!quota.is_unlimited()).then(|| (user.clone(), quota))
    }

    /// True if this identity is an admin (node and cluster operations, users).
    pub fn is_admin(&self) -> bool {
        match &self.identity {
            Identity::Anyone => true,
            Identity::User(user) => self.table.borrow().is_admin(user),
        }
    }

    /// Ok, or the 403 that names what is missing.
    pub fn check(&self, queue: &str, permission: Permission) -> Result<(), ErrorBody> {
        if self.allows(queue, permission) {
            return Ok(());
        }
        let user = self.identity.user().unwrap_or("anyone");
        Err(ErrorBody::new(
            ERR_FORBIDDEN,
            format!(
                "user {user} may not {} on queue {queue:?}: an admin grants it with `keratin \
                 user grant {user} {queue} {}`",
                permission.name(),
                permission.name()
            ),
        ))
    }

    /// Ok, or the 403 of an operation only admins may do (`what` names it).
    pub fn check_admin(&self, what: &str) -> Result<(), ErrorBody> {
        if self.is_admin() {
            return Ok(());
        }
        let user = self.identity.user().unwrap_or("anyone");
        Err(ErrorBody::new(
            ERR_FORBIDDEN,
            format!("user {user} may not {what}: only admins may (`keratin user list` shows them)"),
        ))
    }
}

/// The name of the file holding the first admin's password, in the first data directory.
pub const ADMIN_PASSWORD_FILE: &str = "admin-password";

/// The first start of a node (or cluster) that requires logins and has no users: create
/// `admin` with a random password, written to `<dir>/admin-password` (mode 0600) and logged
/// once. The file is written only when this node's change is the one stored (in a cluster,
/// another node may have made the first admin; its data directory holds the password). A file
/// left from before (a table that is empty again: a new metadata log) is replaced. Returns the
/// path when it wrote one.
pub async fn bootstrap_admin(
    access: &Access,
    dir: &std::path::Path,
) -> Result<Option<std::path::PathBuf>, String> {
    if access.mode != AuthMode::Users || !access.table().is_empty() {
        return Ok(None);
    }
    let password = keratin_auth::generate_password().map_err(|e| e.to_string())?;
    let hashed = {
        let password = password.clone();
        tokio::task::spawn_blocking(move || PasswordDigest::hash(&password))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?
    };
    let change = UserChange::Add {
        name: "admin".into(),
        password: hashed.clone(),
        admin: true,
    };
    let table = match access.change(change).await {
        Ok(table) => table,
        // Another node of the cluster made it first.
        Err(UserChangeError::Refused(reason)) => {
            tracing::info!(%reason, "the first admin exists already");
            return Ok(None);
        }
        Err(UserChangeError::Store(reason)) => return Err(reason),
    };
    if table.get("admin").map(|u| &u.password) != Some(&hashed) {
        tracing::info!(
            "another node created the first admin; its password is in that node's data directory"
        );
        return Ok(None);
    }
    let path = dir.join(ADMIN_PASSWORD_FILE);
    write_secret(&path, &password).map_err(|e| format!("{}: {e}", path.display()))?;
    tracing::warn!(
        user = "admin",
        %password,
        file = %path.display(),
        "created the first admin user; its password is in the file (mode 0600) and in this \
         line, once: the CLI on this machine reads the file; change it with `keratin user passwd \
         admin`"
    );
    Ok(Some(path))
}

/// Write `text` to `path` readable by its owner only (0600), replacing it atomically and
/// durably (a temporary file, synced, renamed, the directory synced).
fn write_secret(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    std::fs::create_dir_all(dir)?;
    let temporary = path.with_extension("tmp");
    let _ = std::fs::remove_file(&temporary);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temporary)?;
    file.write_all(text.as_bytes())?;
    file.write_all(b"\n")?;
    file.sync_all()?;
    std::fs::rename(&temporary, path)?;
    std::fs::File::open(dir)?.sync_all()
}
