//! [`Auth`], the login a client offers in its `ClientHello` (protocol version 6 on), its
//! mechanism numbers, the bounds of its fields and their encoding.
//!
//! Owns the wire form only: which user a password or token belongs to, whether a certificate is
//! trusted and what a user may do belong to the server (`keratin-auth`). The layout is
//! `docs/protocol.md`, "Authentication".

use std::fmt;

use bytes::{BufMut, BytesMut};

use crate::error::ProtoError;
use crate::wire::{put_string, Reader};

/// Longest user name: as long as a host name, and as long as the `user` a server names back in
/// its hello ([`crate::handshake::SERVER_HELLO_USER_BYTES_MAX`]).
pub const AUTH_USER_BYTES_MAX: usize = 255;
/// Longest password: far beyond any passphrase, small enough that a hello stays a few KiB.
pub const AUTH_PASSWORD_BYTES_MAX: usize = 1024;
/// Longest API token. Keratin's tokens are `kt_` and 64 hex digits (67 bytes); the bound leaves
/// room for another format without a new protocol version.
pub const AUTH_TOKEN_BYTES_MAX: usize = 255;

/// Mechanism 0: no login.
pub const MECHANISM_NONE: u8 = 0;
/// Mechanism 1: a user name and a password.
pub const MECHANISM_PLAIN: u8 = 1;
/// Mechanism 2: the identity of the TLS client certificate.
pub const MECHANISM_EXTERNAL: u8 = 2;
/// Mechanism 3: an API token.
pub const MECHANISM_TOKEN: u8 = 3;
/// Number of mechanisms this version defines; a receiver refuses any other tag.
const MECHANISM_COUNT: u8 = 4;

/// Largest encoded [`Auth`]: the mechanism byte, then the largest of its fields (a user and a
/// password, each behind its u16 length).
pub(crate) const AUTH_SIZE_MAX: usize =
    1 + (2 + AUTH_USER_BYTES_MAX) + (2 + AUTH_PASSWORD_BYTES_MAX);
const _: () = assert!(AUTH_SIZE_MAX >= 1 + 2 + AUTH_TOKEN_BYTES_MAX);

/// How a client logs in. `Debug` never shows a password or a token.
#[derive(Clone, PartialEq, Eq)]
pub enum Auth {
    /// Mechanism 0: no login. What every client before version 6 sends, by having no field.
    None,
    /// Mechanism 1: a user name (1 to 255 bytes) and a password (1 to 1,024 bytes). A server
    /// accepts it only over TLS, or on loopback (`docs/protocol.md`, "Authentication").
    Plain {
        /// The user name.
        user: String,
        /// The password, sent as it is: TLS protects it on the way.
        password: String,
    },
    /// Mechanism 2: the identity of the certificate the client presented in the TLS handshake.
    External,
    /// Mechanism 3: an API token (1 to 255 bytes; Keratin issues `kt_` and 64 hex digits).
    Token(String),
}

/// Prints in place of a secret.
struct Redacted;

impl fmt::Debug for Redacted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Auth::None => f.write_str("None"),
            Auth::Plain { user, .. } => f
                .debug_struct("Plain")
                .field("user", user)
                .field("password", &Redacted)
                .finish(),
            Auth::External => f.write_str("External"),
            Auth::Token(_) => f.debug_tuple("Token").field(&Redacted).finish(),
        }
    }
}

impl Auth {
    /// The mechanism number on the wire.
    pub fn mechanism(&self) -> u8 {
        match self {
            Auth::None => MECHANISM_NONE,
            Auth::Plain { .. } => MECHANISM_PLAIN,
            Auth::External => MECHANISM_EXTERNAL,
            Auth::Token(_) => MECHANISM_TOKEN,
        }
    }

    /// The mechanism's name for logs and messages: `none`, `plain`, `external` or `token`.
    pub fn mechanism_name(&self) -> &'static str {
        match self {
            Auth::None => "none",
            Auth::Plain { .. } => "plain",
            Auth::External => "external",
            Auth::Token(_) => "token",
        }
    }

    /// Checks the bounds of every field, as an encoder must before writing anything.
    pub fn validate(&self) -> Result<(), ProtoError> {
        match self {
            Auth::None | Auth::External => Ok(()),
            Auth::Plain { user, password } => {
                check_size("auth.user", user, AUTH_USER_BYTES_MAX)?;
                check_size("auth.password", password, AUTH_PASSWORD_BYTES_MAX)
            }
            Auth::Token(token) => check_size("auth.token", token, AUTH_TOKEN_BYTES_MAX),
        }
    }
}

fn check_size(field: &'static str, text: &str, size_max: usize) -> Result<(), ProtoError> {
    if text.is_empty() {
        return Err(ProtoError::InvalidValue {
            field,
            reason: "must not be empty",
        });
    }
    if text.len() > size_max {
        return Err(ProtoError::FieldTooLong {
            field,
            size: text.len(),
            limit: size_max,
        });
    }
    Ok(())
}

/// Writes the mechanism and its fields. The caller restores `dst` on an error.
pub(crate) fn put_auth(dst: &mut BytesMut, auth: &Auth) -> Result<(), ProtoError> {
    auth.validate()?;
    dst.put_u8(auth.mechanism());
    match auth {
        Auth::None | Auth::External => Ok(()),
        Auth::Plain { user, password } => {
            put_string(dst, "auth.user", user)?;
            put_string(dst, "auth.password", password)
        }
        Auth::Token(token) => put_string(dst, "auth.token", token),
    }
}

/// Reads the mechanism and its fields, refusing an unknown mechanism and out-of-bound fields.
pub(crate) fn read_auth(r: &mut Reader) -> Result<Auth, ProtoError> {
    match r.tag("auth.mechanism", MECHANISM_COUNT)? {
        MECHANISM_NONE => Ok(Auth::None),
        MECHANISM_PLAIN => Ok(Auth::Plain {
            user: r.string_sized("auth.user", 1, AUTH_USER_BYTES_MAX)?,
            password: r.string_sized("auth.password", 1, AUTH_PASSWORD_BYTES_MAX)?,
        }),
        MECHANISM_EXTERNAL => Ok(Auth::External),
        _ => Ok(Auth::Token(r.string_sized(
            "auth.token",
            1,
            AUTH_TOKEN_BYTES_MAX,
        )?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Problem;
    use bytes::Bytes;

    fn read(bytes: &[u8]) -> Result<Auth, ProtoError> {
        read_auth(&mut Reader::new(Bytes::copy_from_slice(bytes), 0, "test"))
    }

    #[test]
    fn debug_hides_secrets() {
        let plain = Auth::Plain {
            user: "bob".into(),
            password: "hunter2".into(),
        };
        assert_eq!(
            format!("{plain:?}"),
            "Plain { user: \"bob\", password: <redacted> }"
        );
        let token = Auth::Token("kt_secret".into());
        assert_eq!(format!("{token:?}"), "Token(<redacted>)");
        assert!(!format!("{plain:#?}{token:#?}").contains("hunter2"));
    }

    #[test]
    fn bad_fields_point_at_their_length() {
        // Plain with an empty user: refused at the user's length (offset 1).
        let error = read(b"\x01\x00\x00\x01\x00p").unwrap_err();
        assert!(
            matches!(
                error,
                ProtoError::Malformed {
                    offset: 1,
                    field: "auth.user",
                    ..
                }
            ),
            "{error}"
        );
        let error = read(b"\x04").unwrap_err();
        assert!(matches!(
            error,
            ProtoError::Malformed {
                problem: Problem::InvalidTag(4),
                ..
            }
        ));
    }
}
