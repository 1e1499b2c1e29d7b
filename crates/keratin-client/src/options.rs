//! Settings of a connection ([`ClientOptions`], with its login [`Credentials`]) and of a
//! buffered publisher ([`BufferedOptions`]), with their defaults and the reasoning behind them.
//!
//! Owns only numbers and their defaults; the code that honours them lives in `connection.rs`
//! (heartbeats, silence), `client.rs` (timeouts) and `publisher.rs` (buffer bound).

use std::time::Duration;

/// Default TCP connect + handshake timeout: a loopback or LAN broker answers in well under a
/// millisecond, so 5 s only ever fires for an address that does not answer at all.
pub const CONNECT_TIMEOUT_DEFAULT: Duration = Duration::from_secs(5);
/// Default timeout of one admin request (declare, delete, purge, info, list, settings, subscribe,
/// cancel). A purge or delete of a large queue is still a handful of file removals.
pub const REQUEST_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);
/// Default time a confirmed publish may take, retries after `ERR_LIMITED` included. It is the
/// time an application is willing to wait for a disk to be freed before it hears about it.
pub const PUBLISH_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// Default interval after which an idle connection sends a `Heartbeat`.
pub const HEARTBEAT_INTERVAL_DEFAULT: Duration = Duration::from_secs(5);
/// Default silence from the broker after which the connection counts as lost: six missed
/// heartbeat intervals of a broker that heartbeats as often as this client does.
pub const SERVER_SILENCE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// Default bound of a [`BufferedOptions::capacity`]: 10,000 unsettled messages of 1 KiB hold
/// about 10 MiB of bodies in the client, and cover ~1 s of a 10k msg/s producer's round trips.
pub const BUFFERED_CAPACITY_DEFAULT: usize = 10_000;

/// How a [`crate::Client`] connects and how long it waits for things.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Names this client in the broker's logs (sent in the `ClientHello`).
    pub name: String,
    /// Limit on TCP connect plus handshake.
    pub connect_timeout: Duration,
    /// Limit on each admin request (and on `subscribe`/`cancel`).
    pub request_timeout: Duration,
    /// Limit on a confirmed publish from the first send to its `Confirm`, retries after
    /// `ERR_LIMITED` included.
    pub publish_timeout: Duration,
    /// A `Heartbeat` is sent when the client has written nothing for this long.
    pub heartbeat_interval: Duration,
    /// The connection counts as lost when no frame (of any type) arrived for this long.
    pub server_silence_timeout: Duration,
    /// Publish as an idempotent producer (the default): every message carries the producer id
    /// and a sequence number, and a partition that stored a producer's sequence already
    /// confirms a retry of it without storing it again, so a publish retried after a lost
    /// connection or a lost leader is stored once (Kafka's idempotent producer, NATS
    /// `Nats-Msg-Id`). See `docs/protocol.md`, "Idempotent producers".
    pub idempotent: bool,
    /// The producer id; `None`: a random one chosen when the client connects (each client is
    /// a new producer). Set it only together with sequences of your own
    /// ([`crate::OutgoingMessage::with_sequence`]) that never repeat for this id, for
    /// example to publish again after a restart of your application what it may have
    /// published before: a sequence the partition stored already under this id is dropped.
    /// With it set, a message without a sequence is refused before it is sent
    /// ([`crate::ClientError::InvalidArgument`]): numbered by the client from 1 in every run,
    /// it would be confirmed as a retry of an earlier run's message and dropped.
    pub producer_id: Option<u64>,
    /// TLS to a broker that serves it (`server.tls_cert_file`); `None`: plain TCP.
    pub tls: Option<crate::tls::ClientTls>,
    /// How to log in (protocol version 6); `None`: no login. Every connection the client
    /// opens, to follow a leader too, logs in with these. A broker refuses a password or a
    /// token over plain TCP unless it listens on loopback or runs `--insecure`.
    pub credentials: Option<Credentials>,
}

/// How a client logs in. `Debug` never shows a password or a token.
#[derive(Clone, PartialEq, Eq)]
pub enum Credentials {
    /// A user name and its password (mechanism `plain`).
    Password {
        /// The user name, 1 to 255 bytes.
        user: String,
        /// The password, 1 to 1,024 bytes.
        password: String,
    },
    /// An API token, `kt_` and 64 hex digits (mechanism `token`).
    Token(String),
    /// The identity of the TLS client certificate (mechanism `external`): needs a
    /// [`crate::ClientTls::with_client_cert`] in [`ClientOptions::tls`].
    Certificate,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::Password { user, .. } => {
                write!(f, "Password {{ user: {user:?}, password: <redacted> }}")
            }
            Credentials::Token(_) => f.write_str("Token(<redacted>)"),
            Credentials::Certificate => f.write_str("Certificate"),
        }
    }
}

impl Credentials {
    /// The login these credentials make in a `ClientHello`.
    pub(crate) fn to_auth(&self) -> keratin_proto::Auth {
        match self {
            Credentials::Password { user, password } => keratin_proto::Auth::Plain {
                user: user.clone(),
                password: password.clone(),
            },
            Credentials::Token(token) => keratin_proto::Auth::Token(token.clone()),
            Credentials::Certificate => keratin_proto::Auth::External,
        }
    }
}

impl Default for ClientOptions {
    fn default() -> ClientOptions {
        ClientOptions {
            name: format!("keratin-client {}", env!("CARGO_PKG_VERSION")),
            connect_timeout: CONNECT_TIMEOUT_DEFAULT,
            request_timeout: REQUEST_TIMEOUT_DEFAULT,
            publish_timeout: PUBLISH_TIMEOUT_DEFAULT,
            heartbeat_interval: HEARTBEAT_INTERVAL_DEFAULT,
            server_silence_timeout: SERVER_SILENCE_TIMEOUT_DEFAULT,
            idempotent: true,
            producer_id: None,
            tls: None,
            credentials: None,
        }
    }
}

/// How a [`crate::BufferedPublisher`] buffers.
#[derive(Debug, Clone)]
pub struct BufferedOptions {
    /// Most messages handed to [`crate::BufferedPublisher::send`] that are not yet settled
    /// (see the publisher's docs for when a buffered message counts as settled). `send` waits
    /// while this many are outstanding. Also the bound of the dropped-publish channel.
    pub capacity: usize,
}

impl Default for BufferedOptions {
    fn default() -> BufferedOptions {
        BufferedOptions {
            capacity: BUFFERED_CAPACITY_DEFAULT,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_a_secret() {
        let options = ClientOptions {
            credentials: Some(Credentials::Password {
                user: "bob".into(),
                password: "hunter2".into(),
            }),
            ..ClientOptions::default()
        };
        let shown = format!("{options:?}");
        assert!(
            shown.contains("Password { user: \"bob\", password: <redacted> }"),
            "{shown}"
        );
        assert!(!shown.contains("hunter2"), "{shown}");
        let token = Credentials::Token("kt_secret".into());
        assert_eq!(format!("{token:?}"), "Token(<redacted>)");
        assert_eq!(
            token.to_auth(),
            keratin_proto::Auth::Token("kt_secret".into())
        );
        assert_eq!(
            Credentials::Certificate.to_auth(),
            keratin_proto::Auth::External
        );
    }
}
