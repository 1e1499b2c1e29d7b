//! `keratin user ...`: users, their permissions and API tokens, through the HTTP admin port
//! (`/api/v1/users`, `keratin-server` `http/users.rs`). Admins only, except a user's own
//! password and tokens. A new password is `--new-password`, or one generated here and printed
//! once (`--password` is the login's own, like every verb's).

use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde_json::{json, Value};

use crate::admin;
use crate::connect::CommonArgs;
use crate::output::{print_json, Failure, Table};

const USERS_PATH: &str = "/api/v1/users";

/// `keratin user ...`.
#[derive(Debug, Args)]
pub struct UserArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// The HTTP admin address (default: the one the node at --server names).
    #[arg(long, env = "KERATIN_HTTP", value_name = "ADDR", global = true)]
    http: Option<String>,
    #[command(subcommand)]
    verb: UserVerb,
}

#[derive(Debug, Subcommand)]
enum UserVerb {
    /// Every user with its permissions and its tokens' names.
    List,
    /// A new user, with no permissions until granted some (or an admin with --admin).
    Add {
        /// Its name: 1 to 64 letters, digits, '.', '_', '-' or '@'.
        name: String,
        /// Its password (8 to 1,024 bytes); without it one is generated and printed once.
        #[arg(long, value_name = "PASSWORD")]
        new_password: Option<String>,
        /// Every permission on every queue, and node, cluster and user operations.
        #[arg(long)]
        admin: bool,
    },
    /// A new password for a user (an admin's, or your own).
    Passwd {
        /// The user.
        name: String,
        /// The password; without it one is generated and printed once.
        #[arg(long, value_name = "PASSWORD")]
        new_password: Option<String>,
    },
    /// Allow a user PERMISSIONS (publish, consume, manage; comma-separated) on the queues
    /// PATTERN matches (`*` matches any run of characters: `orders.*`, `*`).
    Grant {
        /// The user.
        name: String,
        /// Queue name pattern.
        pattern: String,
        /// publish,consume,manage (any of them).
        permissions: String,
    },
    /// Take PERMISSIONS on PATTERN back (the pattern as it was granted).
    Revoke {
        /// The user.
        name: String,
        /// Queue name pattern.
        pattern: String,
        /// publish,consume,manage (any of them).
        permissions: String,
    },
    /// Make a user an admin (`on`) or not (`off`); the last admin stays one.
    Admin {
        /// The user.
        name: String,
        /// on or off.
        #[arg(value_parser = ["on", "off"])]
        state: String,
    },
    /// A user's publish quota on each node: a short excess is delayed, a longer one refused
    /// (429 reason quota). `none` removes a rate's limit.
    Quota {
        /// The user.
        name: String,
        /// Message body bytes per second, or `none`.
        #[arg(long, value_name = "BYTES|none")]
        bytes_per_s: Option<String>,
        /// Messages per second, or `none`.
        #[arg(long, value_name = "COUNT|none")]
        messages_per_s: Option<String>,
    },
    /// Remove a user (its connections lose every permission at once).
    Delete {
        /// The user.
        name: String,
    },
    /// API tokens (for the HTTP API, `Authorization: Bearer`, and the protocol).
    #[command(subcommand)]
    Token(TokenVerb),
    /// Who the CLI logs in as.
    Whoami,
}

#[derive(Debug, Subcommand)]
enum TokenVerb {
    /// A new token for a user, printed once (only its digest is stored).
    Add {
        /// The user.
        name: String,
        /// The token's name, to delete it by.
        #[arg(value_name = "TOKEN_NAME")]
        token_name: String,
    },
    /// Delete a user's token.
    Delete {
        /// The user.
        name: String,
        /// The token's name.
        #[arg(value_name = "TOKEN_NAME")]
        token_name: String,
    },
}

/// Runs `keratin user`.
pub async fn run(args: UserArgs) -> Result<ExitCode, Failure> {
    let http = admin::address(&args.common, args.http.as_deref()).await?;
    let json = args.common.json;
    let user_path = |name: &str| format!("{USERS_PATH}/{}", path_segment(name));
    let document = match args.verb {
        UserVerb::List => {
            let document = admin::request(&http, "GET", USERS_PATH, None)?;
            if !json {
                out!("{}", users_text(&document));
                return Ok(ExitCode::SUCCESS);
            }
            document
        }
        UserVerb::Add {
            name,
            new_password,
            admin,
        } => {
            let (password, generated) = password_or_generated(new_password)?;
            let body = json!({ "name": name, "password": password, "admin": admin });
            let mut document = admin::request(&http, "POST", USERS_PATH, Some(&body))?;
            if generated {
                document["password"] = json!(password);
            }
            if !json {
                outln!("user {name} added{}", if admin { " (admin)" } else { "" });
                if generated {
                    outln!("password: {password}  (shown once)");
                }
                return Ok(ExitCode::SUCCESS);
            }
            document
        }
        UserVerb::Passwd { name, new_password } => {
            let (password, generated) = password_or_generated(new_password)?;
            let body = json!({ "password": password });
            let path = format!("{}/password", user_path(&name));
            let mut document = admin::request(&http, "PUT", &path, Some(&body))?;
            if generated {
                document["password"] = json!(password);
            }
            if !json {
                outln!("password of {name} changed");
                if generated {
                    outln!("password: {password}  (shown once)");
                }
                return Ok(ExitCode::SUCCESS);
            }
            document
        }
        UserVerb::Grant {
            name,
            pattern,
            permissions,
        } => {
            let body = json!({ "pattern": pattern, "permissions": permissions });
            let path = format!("{}/grant", user_path(&name));
            admin::request(&http, "POST", &path, Some(&body))?
        }
        UserVerb::Revoke {
            name,
            pattern,
            permissions,
        } => {
            let body = json!({ "pattern": pattern, "permissions": permissions });
            let path = format!("{}/revoke", user_path(&name));
            admin::request(&http, "POST", &path, Some(&body))?
        }
        UserVerb::Admin { name, state } => {
            let body = json!({ "admin": state == "on" });
            let path = format!("{}/admin", user_path(&name));
            admin::request(&http, "PUT", &path, Some(&body))?
        }
        UserVerb::Quota {
            name,
            bytes_per_s,
            messages_per_s,
        } => {
            let current = admin::request(&http, "GET", &user_path(&name), None)?;
            let rate = |given: Option<String>, key: &str| -> Result<Value, Failure> {
                match given.as_deref() {
                    None => Ok(current["quota"][key].clone()),
                    Some("none") => Ok(Value::Null),
                    Some(text) => text.parse::<u64>().map(|n| json!(n)).map_err(|_| {
                        Failure::new(format!(
                            "--{} {text:?}: a whole number or none",
                            key.replace('_', "-")
                        ))
                    }),
                }
            };
            let body = json!({
                "bytes_per_s": rate(bytes_per_s, "bytes_per_s")?,
                "messages_per_s": rate(messages_per_s, "messages_per_s")?,
            });
            let path = format!("{}/quota", user_path(&name));
            admin::request(&http, "PUT", &path, Some(&body))?
        }
        UserVerb::Delete { name } => {
            admin::request(&http, "DELETE", &user_path(&name), None)?;
            if !json {
                outln!("user {name} deleted");
                return Ok(ExitCode::SUCCESS);
            }
            json!({ "deleted": name })
        }
        UserVerb::Token(TokenVerb::Add {
            name,
            token_name: token,
        }) => {
            let body = json!({ "token": token });
            let path = format!("{}/tokens", user_path(&name));
            let document = admin::request(&http, "POST", &path, Some(&body))?;
            if !json {
                outln!(
                    "token {token} of {name}: {}  (shown once)",
                    document["token"].as_str().unwrap_or_default()
                );
                return Ok(ExitCode::SUCCESS);
            }
            document
        }
        UserVerb::Token(TokenVerb::Delete {
            name,
            token_name: token,
        }) => {
            let path = format!("{}/tokens/{}", user_path(&name), path_segment(&token));
            admin::request(&http, "DELETE", &path, None)?;
            if !json {
                outln!("token {token} of {name} deleted");
                return Ok(ExitCode::SUCCESS);
            }
            json!({ "deleted": token, "user": name })
        }
        UserVerb::Whoami => {
            let document = admin::request(&http, "GET", "/api/v1/whoami", None)?;
            if !json {
                match document["user"].as_str() {
                    Some(user) => outln!(
                        "{user}{}",
                        if document["admin"] == json!(true) {
                            " (admin)"
                        } else {
                            ""
                        }
                    ),
                    None => outln!("anyone (the node runs with server.auth = none)"),
                }
                return Ok(ExitCode::SUCCESS);
            }
            document
        }
    };
    if json {
        print_json(&document);
    } else {
        out!("{}", users_text(&json!({ "users": [document] })));
    }
    Ok(ExitCode::SUCCESS)
}

/// A quota as a table cell: `100 msg/s 1048576 B/s`, or `-`.
fn quota_text(quota: &Value) -> String {
    let mut parts = Vec::new();
    if let Some(messages) = quota["messages_per_s"].as_u64() {
        parts.push(format!("{messages} msg/s"));
    }
    if let Some(bytes) = quota["bytes_per_s"].as_u64() {
        parts.push(format!("{bytes} B/s"));
    }
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(" ")
    }
}

/// The password given, or a generated one (true).
fn password_or_generated(given: Option<String>) -> Result<(String, bool), Failure> {
    match given {
        Some(password) => Ok((password, false)),
        None => keratin_auth::generate_password()
            .map(|password| (password, true))
            .map_err(|e| Failure::new(format!("cannot generate a password: {e}"))),
    }
}

/// A user or token name in a URL path: names are letters, digits, `.`, `_`, `-` and `@`, of
/// which only `@` is escaped (the server refuses anything else).
fn path_segment(name: &str) -> String {
    name.replace('%', "%25")
        .replace('@', "%40")
        .replace('/', "%2F")
}

/// Users as a table: name, admin, grants, tokens.
fn users_text(document: &Value) -> String {
    let mut table = Table::new(&["USER", "ADMIN", "GRANTS", "TOKENS", "QUOTA"]);
    for user in document["users"].as_array().into_iter().flatten() {
        let grants: Vec<String> = user["grants"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|g| {
                let permissions: Vec<&str> = g["permissions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect();
                format!(
                    "{}:{}",
                    g["pattern"].as_str().unwrap_or_default(),
                    permissions.join(",")
                )
            })
            .collect();
        let tokens: Vec<&str> = user["tokens"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        table.row(vec![
            user["name"].as_str().unwrap_or_default().to_string(),
            if user["admin"] == json!(true) {
                "yes".into()
            } else {
                "no".into()
            },
            if grants.is_empty() {
                "-".into()
            } else {
                grants.join(" ")
            },
            if tokens.is_empty() {
                "-".into()
            } else {
                tokens.join(",")
            },
            quota_text(&user["quota"]),
        ]);
    }
    table.render()
}
