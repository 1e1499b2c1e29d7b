//! `keratin`: the broker (`keratin serve`) and the command-line verbs that talk to it.
//!
//! # Layout
//! - `serve`: load the configuration, start a node, stop it gracefully on SIGTERM or SIGINT.

mod serve;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Keratin, a durable message broker that never falls over because a disk or memory filled up.
#[derive(Debug, Parser)]
#[command(name = "keratin", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a broker node (by default on ./keratin-data, listening on loopback only:
    /// protocol 127.0.0.1:5680, HTTP admin 127.0.0.1:5681).
    Serve(serve::ServeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("keratin: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => serve::run(args).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(message) => {
            eprintln!("keratin: {message}");
            ExitCode::FAILURE
        }
    }
}
