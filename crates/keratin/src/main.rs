//! `keratin`: the broker (`keratin serve`) and the command-line verbs that talk to it.
//!
//! # Layout
//! - `serve`: load the configuration, start a node, stop it gracefully on SIGTERM or SIGINT.
//! - `queue`: `keratin queue declare|list|info|purge|delete`.
//! - `stream`: `keratin stream declare|list|info|set|delete|read` (issue 18).
//! - `publish`: `keratin publish`, confirmed (bounded in flight) or buffered, with a summary.
//! - `consume`: `keratin consume`, ack/reject, idle exit, body verification.
//! - `cluster`: `keratin cluster status`, the nodes and partition leaders from
//!   `GET /api/v1/cluster`.
//! - `status`: `keratin status`, the node's disk and memory levels from `GET /api/v1/status`.
//! - `settings`: `keratin settings get|set|reset`, runtime settings via `/api/v1/settings`.
//! - `admin`: one HTTP/1.1 request to the admin port (JSON in, JSON out).
//! - `attention`: `keratin attention`, what needs an operator, from `GET /api/v1/attention`.
//! - `audit`: `keratin audit`, the audit trail from `GET /api/v1/audit`.
//! - `user`: `keratin user list|add|passwd|grant|revoke|admin|delete|token|whoami` via
//!   `/api/v1/users`.
//! - `connect`: the flags every verb shares (`--server`, `--json`, `--ca`, the login:
//!   `--user`/`--password`, `--token`, or the admin password a node on this machine wrote)
//!   and connecting with them.
//! - `output`: tables, sizes, error keys, JSON printing and the progress bar.
//! - `units`: sizes, durations and times as flags spell them and `read` prints them.
//! - `body`: the self-checking test body (sequence number + filler + CRC32C) that `publish`
//!   writes and `consume --verify` checks.
//!
//! # Exit status
//! 0 only when the verb did everything asked; 1 for any failure (the message, which always
//! carries the broker's text when the broker sent one, goes to stderr, and with `--json` an
//! `{"error": ..., "code": ...}` object goes to stdout); 2 for bad usage (clap).

#[macro_use]
mod output;
mod admin;
mod attention;
mod audit;
mod body;
mod cluster;
mod connect;
mod consume;
mod publish;
mod queue;
mod serve;
mod settings;
mod status;
mod stream;
mod units;
mod user;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::output::Failure;

/// Keratin, a durable message broker that never falls over because a disk or memory filled up.
#[derive(Debug, Parser)]
#[command(
    name = "keratin",
    version,
    about,
    after_help = "The connection options (--server, --json, --ca, --user, --password, --token, \
                  --cert, --key) may go before the verb or after it: \
                  `keratin --server 127.0.0.1:5682 cluster status`."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a broker node (by default on ./keratin-data, listening on loopback only:
    /// protocol 127.0.0.1:5680, HTTP admin 127.0.0.1:5681).
    Serve(serve::ServeArgs),
    /// Declare, list, inspect, purge and delete queues.
    Queue(queue::QueueArgs),
    /// Declare, list, inspect, change, delete and read streams (messages kept after they are
    /// read, until retention removes them).
    Stream(stream::StreamArgs),
    /// Publish numbered, checksummed test messages (confirmed by default) and summarize.
    Publish(publish::PublishArgs),
    /// Consume messages, acknowledge or reject them, optionally verify their checksums.
    Consume(consume::ConsumeArgs),
    /// Show the node's filesystems and memory with their limit levels.
    Status(status::StatusArgs),
    /// Show the cluster: its nodes, which are reachable, and who leads each partition.
    Cluster(cluster::ClusterArgs),
    /// Read and change the node's runtime settings (limits, budgets) without a restart.
    Settings(settings::SettingsArgs),
    /// Show what needs an operator: level changes, full queues, stopped and healed logs
    /// (active items and recent history; `--all` for everything kept).
    Attention(attention::AttentionArgs),
    /// Show the audit trail (admins): who declared, deleted, purged, changed settings,
    /// users or the cluster, and refused logins, newest first.
    Audit(audit::AuditArgs),
    /// Users, their permissions and API tokens (admins; a user changes its own password and
    /// tokens).
    User(user::UserArgs),
}

impl Command {
    /// Whether failures should also be reported as JSON on stdout.
    fn json(&self) -> bool {
        match self {
            Command::Serve(_) => false,
            Command::Queue(args) => args.common.json,
            Command::Stream(args) => args.common.json,
            Command::Publish(args) => args.common.json,
            Command::Consume(args) => args.common.json,
            Command::Status(args) => args.common.json,
            Command::Cluster(args) => args.json(),
            Command::Settings(args) => args.common.json,
            Command::Attention(args) => args.common.json,
            Command::Audit(args) => args.common.json,
            Command::User(args) => args.common.json,
        }
    }
}

/// The options every verb shares that take a value; `--json` is the one without. A user may
/// put them before the verb (`keratin --server ADDR cluster status`): they are defined on each
/// verb (`connect::CommonArgs`, global below it), so [`connection_options_last`] moves them
/// after it.
const CONNECTION_OPTIONS_WITH_VALUE: &[&str] = &[
    "--server",
    "--ca",
    "--user",
    "--password",
    "--token",
    "--cert",
    "--key",
];

/// `args` (the program name first) with the connection options written before the verb moved
/// to the end, where the verb (and any subcommand of it) reads them. Anything else before the
/// verb (`--help`, `--version`, an unknown option) stops the move and is left to clap.
fn connection_options_last(args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let mut rest = args.into_iter();
    let mut head: Vec<std::ffi::OsString> = rest.next().into_iter().collect();
    let mut moved: Vec<std::ffi::OsString> = Vec::new();
    let mut rest = rest.peekable();
    while let Some(arg) = rest.peek() {
        let text = arg.to_string_lossy();
        let name = text.split_once('=').map_or(text.as_ref(), |(name, _)| name);
        let takes_value = CONNECTION_OPTIONS_WITH_VALUE.contains(&name);
        if !(takes_value || name == "--json") {
            break;
        }
        let inline_value = text.contains('=');
        if let Some(arg) = rest.next() {
            moved.push(arg);
        }
        if takes_value && !inline_value {
            match rest.next() {
                Some(value) => moved.push(value),
                None => break,
            }
        }
    }
    head.extend(rest);
    head.extend(moved);
    head
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(connection_options_last(std::env::args_os().collect()));
    let json = cli.command.json();
    let result = match cli.command {
        Command::Serve(args) => serve_main(args),
        verb => run_verb(verb),
    };
    match result {
        Ok(code) => code,
        Err(failure) => {
            eprintln!("keratin: {}", failure.message);
            if json {
                output::print_json(&failure.to_json());
            }
            ExitCode::FAILURE
        }
    }
}

/// `keratin serve`: the configuration first, then a runtime sized by it.
fn serve_main(args: serve::ServeArgs) -> Result<ExitCode, Failure> {
    let loaded = match serve::prepare(args).map_err(Failure::from)? {
        serve::Prepared::Print(text) => {
            out!("{text}");
            return Ok(ExitCode::SUCCESS);
        }
        serve::Prepared::Serve(loaded) => loaded,
    };
    let runtime = serve::runtime(&loaded)
        .map_err(|e| Failure::from(format!("cannot start the async runtime: {e}")))?;
    runtime.block_on(serve::run(*loaded)).map_err(Failure::from)
}

/// A CLI verb: a client, on a small runtime.
fn run_verb(verb: Command) -> Result<ExitCode, Failure> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Failure::from(format!("cannot start the async runtime: {e}")))?;
    runtime.block_on(async {
        match verb {
            Command::Serve(_) => Err(Failure::new("serve runs on its own runtime")),
            Command::Queue(args) => queue::run(args).await,
            Command::Stream(args) => stream::run(args).await,
            Command::Publish(args) => publish::run(args).await,
            Command::Consume(args) => consume::run(args).await,
            Command::Status(args) => status::run(args).await,
            Command::Cluster(args) => cluster::run(args).await,
            Command::Settings(args) => settings::run(args).await,
            Command::Attention(args) => attention::run(args).await,
            Command::Audit(args) => audit::run(args).await,
            Command::User(args) => user::run(args).await,
        }
    })
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// clap checks at run time that flag names are unique (a verb's own flag against the
    /// global ones): this makes a clash fail here instead of in every CLI run.
    #[test]
    fn the_command_line_is_consistent() {
        super::Cli::command().debug_assert();
    }

    fn moved(args: &[&str]) -> Vec<String> {
        super::connection_options_last(args.iter().map(Into::into).collect())
            .into_iter()
            .map(|arg| arg.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn connection_options_before_the_verb_go_after_it() {
        assert_eq!(
            moved(&["keratin", "--server", "a:1", "--json", "cluster", "status"]),
            ["keratin", "cluster", "status", "--server", "a:1", "--json"]
        );
        assert_eq!(
            moved(&["keratin", "--server=a:1", "queue", "list", "--user", "u"]),
            ["keratin", "queue", "list", "--user", "u", "--server=a:1"]
        );
        assert_eq!(
            moved(&["keratin", "--help", "--server", "a:1"]),
            ["keratin", "--help", "--server", "a:1"]
        );
        assert_eq!(moved(&["keratin", "--server"]), ["keratin", "--server"]);
        let parsed = <super::Cli as clap::Parser>::try_parse_from(super::connection_options_last(
            ["keratin", "--server", "a:1", "cluster", "status"]
                .iter()
                .map(Into::into)
                .collect(),
        ));
        assert!(parsed.is_ok(), "{parsed:?}");
    }
}
