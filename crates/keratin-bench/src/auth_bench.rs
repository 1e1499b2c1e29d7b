//! The `auth` benchmark (issue 16): what logins and permission checks cost, each against a
//! node without access control (`server.auth = none`) measured in the same run.
//!
//! - Connections per second: one connector opens and closes `connections` connections one
//!   after the other (sequential, so the figure is the cost of one connect + handshake + close,
//!   not of the scheduler): with no login to an `auth = none` node (the reference), and to an
//!   `auth = users` node with a password the node has not verified yet (one argon2id
//!   verification each), with a password it verified within the last minute (the node's
//!   verified-password cache: a SHA-256 and a map lookup), and with an API token (a SHA-256).
//!   Both nodes live for the whole run; the cases rotate within each round.
//! - Permission checks per publish: confirmed publish of 1 KiB messages, `in_flight` in
//!   flight on one connection, to a fresh `auth = none` node (reference) and to a fresh
//!   `auth = users` node as a non-admin user whose only matching rule is the last of ten, so
//!   every check walks the list. Runs alternate (U N, N U, ...). Goal: at least 0.99.
//! - The same cost without the disk: `Grant::check` timed in a loop against the process's CPU
//!   time per confirmed publish (client and node together, all threads) in the reference runs.

use std::hint::black_box;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use keratin_auth::{ApiToken, PasswordDigest, Pattern, Permission, Permissions, UserChange};
use keratin_client::{Client, ClientOptions, Credentials, QueueSettings};
use keratin_server::access::{AuthMode, Identity};
use keratin_server::Node;
use serde_json::json;

use crate::broker_bench::{remove_and_settle, runtime};
use crate::contender::BenchResult;
use crate::net_bench::{node_config, publish_window, QUEUE};
use crate::report::{median, Report, Row};

/// Permission checks may cost at most 1 % of confirmed publish (issue 16).
const PUBLISH_GOAL: f64 = 0.99;
/// The publishing user and the owner of the token.
const USER: &str = "bench";
/// Rules that do not match the queue, granted before the one that does: ten rules in all.
const OTHER_RULES: usize = 9;

/// What `keratin-bench auth` runs.
#[derive(Debug, Clone)]
pub struct AuthBenchConfig {
    /// A directory of its own on the file system under test; the caller removes it.
    pub dir: std::path::PathBuf,
    /// Rounds of each part.
    pub rounds: usize,
    /// Connections per round with no login, a cached password and a token.
    pub connections: usize,
    /// Connections per round with a password not verified yet (an argon2id each).
    pub cold_connections: usize,
    /// Length of each publish run.
    pub duration: Duration,
    /// Body bytes of one message.
    pub body_bytes: usize,
    /// Most confirmed publishes in flight at once.
    pub in_flight: usize,
    /// `Grant::check` calls timed per round.
    pub check_calls: usize,
}

/// The login cases of the connection part, in the order of even rounds.
#[derive(Debug, Clone, Copy)]
enum Login {
    /// `auth = none`, no credentials.
    Nothing,
    /// A password the node has not verified before: one argon2id each.
    PasswordCold,
    /// The same password again within a minute: the node's verified-password cache.
    PasswordWarm,
    /// An API token.
    Token,
}

const LOGINS: [Login; 4] = [
    Login::Nothing,
    Login::PasswordCold,
    Login::PasswordWarm,
    Login::Token,
];

/// The two nodes of the connection part and what logs in to them.
struct LoginNodes {
    none: Node,
    users: Node,
    password: String,
    token: String,
}

/// Run both parts and gather the report.
pub fn run(config: &AuthBenchConfig) -> BenchResult<Report> {
    let password = keratin_auth::generate_password()?;
    // One argon2id hash serves every user: each still costs a verification on its first login.
    let digest = PasswordDigest::hash(&password)?;
    let mut report = Report::default();
    connection_part(config, &password, &digest, &mut report)?;
    publish_part(config, &password, &digest, &mut report)?;
    Ok(report)
}

fn credentials(user: &str, password: &str) -> Option<Credentials> {
    Some(Credentials::Password {
        user: user.into(),
        password: password.into(),
    })
}

fn connection_part(
    config: &AuthBenchConfig,
    password: &str,
    digest: &PasswordDigest,
    report: &mut Report,
) -> BenchResult<()> {
    let rt = runtime()?;
    let rates = rt.block_on(async {
        let nodes = start_login_nodes(config, password, digest).await?;
        let mut rates: [Vec<f64>; 4] = Default::default();
        for round in 0..config.rounds {
            let mut order = LOGINS.map(|l| l as usize);
            if round % 2 == 1 {
                order.reverse();
            }
            for case in order {
                rates[case].push(connect_round(&nodes, config, round, LOGINS[case]).await?);
            }
        }
        nodes.none.shutdown().await?;
        nodes.users.shutdown().await?;
        Ok::<_, crate::contender::BenchError>(rates)
    })?;
    drop(rt);
    connection_rows(config, &rates, report);
    Ok(())
}

/// The user of the `index`th first login of `round`.
fn cold_user(round: usize, index: usize) -> String {
    format!("cold-{round}-{index}")
}

async fn start_login_nodes(
    config: &AuthBenchConfig,
    password: &str,
    digest: &PasswordDigest,
) -> BenchResult<LoginNodes> {
    let none = start_node(&config.dir.join("login-none"), AuthMode::None).await?;
    let users = start_node(&config.dir.join("login-users"), AuthMode::Users).await?;
    add_user(&users, USER, digest).await?;
    for round in 0..config.rounds {
        for index in 0..config.cold_connections {
            add_user(&users, &cold_user(round, index), digest).await?;
        }
    }
    let token = ApiToken::generate()?;
    users
        .access()
        .change(UserChange::TokenAdd {
            name: USER.into(),
            token: "bench".into(),
            digest: token.digest(),
        })
        .await?;
    Ok(LoginNodes {
        none,
        users,
        password: password.into(),
        token: token.reveal().into(),
    })
}

async fn start_node(dir: &Path, auth: AuthMode) -> BenchResult<Node> {
    std::fs::create_dir_all(dir)?;
    let mut node_config = node_config(dir);
    node_config.server.auth = auth;
    Ok(Node::start(&node_config).await?)
}

async fn add_user(node: &Node, name: &str, digest: &PasswordDigest) -> BenchResult<()> {
    node.access()
        .change(UserChange::Add {
            name: name.into(),
            password: digest.clone(),
            admin: false,
        })
        .await?;
    Ok(())
}

/// One round of one case: connections per second.
async fn connect_round(
    nodes: &LoginNodes,
    config: &AuthBenchConfig,
    round: usize,
    login: Login,
) -> BenchResult<f64> {
    let (node, count) = match login {
        Login::Nothing => (&nodes.none, config.connections),
        Login::PasswordCold => (&nodes.users, config.cold_connections),
        Login::PasswordWarm | Login::Token => (&nodes.users, config.connections),
    };
    let options = |index: usize| match login {
        Login::Nothing => None,
        Login::PasswordCold => credentials(&cold_user(round, index), &nodes.password),
        Login::PasswordWarm => credentials(USER, &nodes.password),
        Login::Token => Some(Credentials::Token(nodes.token.clone())),
    };
    let addr = node.protocol_addr();
    if matches!(login, Login::PasswordWarm) {
        // The node remembers a verified password for a minute: renew it, untimed.
        connect_close(addr, options(0)).await?;
    }
    let began = Instant::now();
    for index in 0..count {
        connect_close(addr, options(index)).await?;
    }
    Ok(count as f64 / began.elapsed().as_secs_f64())
}

async fn connect_close(addr: SocketAddr, credentials: Option<Credentials>) -> BenchResult<()> {
    let options = ClientOptions {
        credentials,
        ..ClientOptions::default()
    };
    let client = Client::connect(addr, options)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    client.close().await;
    Ok(())
}

fn connection_rows(config: &AuthBenchConfig, rates: &[Vec<f64>; 4], report: &mut Report) {
    let reference = &rates[Login::Nothing as usize];
    let cases = [
        (
            Login::PasswordCold,
            "connections/s, password login (first: argon2id) / none",
            format!(
                "{} a round, each a user not verified before; at most 2 verifications run at \
                 once by design (GateConfig), so this rate is bounded",
                config.cold_connections
            ),
        ),
        (
            Login::PasswordWarm,
            "connections/s, password login (again <60 s: cached) / none",
            "the node's verified-password cache (60 s): a SHA-256 and a lookup".into(),
        ),
        (
            Login::Token,
            "connections/s, API token login / none",
            "a SHA-256 of the token".into(),
        ),
    ];
    for (login, case, note) in cases {
        let figures = &rates[login as usize];
        let ratios: Vec<f64> = figures
            .iter()
            .zip(reference)
            .map(|(a, r)| a / r.max(1e-9))
            .collect();
        report.rows.push(Row {
            case: case.into(),
            keratin: format!("{:.0} conn/s", median(figures)),
            reference: format!("{:.0} conn/s no login", median(reference)),
            ratio: median(&ratios),
            round_ratios: ratios,
            goal: None,
            note: format!(
                "sequential connect + close, {} a round without login; {note}",
                config.connections
            ),
        });
    }
    report.json_cases.push(json!({
        "case": "auth_connections",
        "none_per_s": rates[Login::Nothing as usize],
        "password_cold_per_s": rates[Login::PasswordCold as usize],
        "password_warm_per_s": rates[Login::PasswordWarm as usize],
        "token_per_s": rates[Login::Token as usize],
    }));
}

/// One publish run's figures.
#[derive(Debug, Clone, Copy)]
struct PublishRun {
    /// Confirmed publishes per second.
    rate: f64,
    /// Process CPU seconds (user + system, every thread) per confirmed publish.
    cpu_per_publish_s: f64,
    /// Nanoseconds per `Grant::check` of the publishing identity (users runs only).
    check_ns: Option<f64>,
}

fn publish_part(
    config: &AuthBenchConfig,
    password: &str,
    digest: &PasswordDigest,
    report: &mut Report,
) -> BenchResult<()> {
    let (mut users, mut none) = (Vec::new(), Vec::new());
    for round in 0..config.rounds {
        let users_dir = config.dir.join(format!("publish-users-{round}"));
        let none_dir = config.dir.join(format!("publish-none-{round}"));
        if round % 2 == 0 {
            users.push(publish_run(config, &users_dir, Some((password, digest)))?);
            none.push(publish_run(config, &none_dir, None)?);
        } else {
            none.push(publish_run(config, &none_dir, None)?);
            users.push(publish_run(config, &users_dir, Some((password, digest)))?);
        }
    }
    publish_rows(config, &users, &none, report);
    Ok(())
}

/// Give `USER` the rules of the publish part: `other0.*` ... then `bench*` last.
async fn grant_rules(node: &Node) -> BenchResult<()> {
    let patterns = (0..OTHER_RULES)
        .map(|i| format!("other{i}.*"))
        .chain(std::iter::once(format!("{QUEUE}*")));
    for pattern in patterns {
        // manage too: the user declares the queue itself.
        let permissions =
            Permissions::from(Permission::Publish).union(Permissions::from(Permission::Manage));
        node.access()
            .change(UserChange::Grant {
                name: USER.into(),
                pattern: Pattern::new(&pattern)?,
                permissions,
            })
            .await?;
    }
    Ok(())
}

/// One run: to an `auth = users` node as `USER` when `login` is given, else to `auth = none`.
fn publish_run(
    config: &AuthBenchConfig,
    dir: &Path,
    login: Option<(&str, &PasswordDigest)>,
) -> BenchResult<PublishRun> {
    let rt = runtime()?;
    let run = rt.block_on(async {
        let auth = if login.is_some() {
            AuthMode::Users
        } else {
            AuthMode::None
        };
        let node = start_node(dir, auth).await?;
        let mut options = ClientOptions::default();
        if let Some((password, digest)) = login {
            add_user(&node, USER, digest).await?;
            grant_rules(&node).await?;
            options.credentials = credentials(USER, password);
        }
        let client = Client::connect(node.protocol_addr(), options).await?;
        client.declare(QUEUE, QueueSettings::default()).await?;
        let body = Bytes::from(vec![0x5a_u8; config.body_bytes]);
        publish_window(&client, &body, config.in_flight, Duration::from_millis(100)).await?;
        let cpu_before = process_cpu_s();
        let (confirmed, elapsed) =
            publish_window(&client, &body, config.in_flight, config.duration).await?;
        let cpu = process_cpu_s() - cpu_before;
        client.close().await;
        let check_ns = login.map(|_| time_check(&node, config.check_calls));
        node.shutdown().await?;
        Ok::<_, crate::contender::BenchError>(PublishRun {
            rate: confirmed as f64 / elapsed.as_secs_f64(),
            cpu_per_publish_s: cpu / confirmed.max(1) as f64,
            check_ns,
        })
    })?;
    drop(rt);
    remove_and_settle(dir)?;
    Ok(run)
}

/// CPU nanoseconds per `Grant::check(QUEUE, Publish)` of `USER`, the call a publish frame
/// makes. The thread's CPU clock, not the wall clock: on a shared machine the loop may be
/// preempted, which is no cost of the check.
fn time_check(node: &Node, calls: usize) -> f64 {
    let grant = node.access().grant(Identity::User(USER.into()));
    let began = cpu_s(rustix::time::ClockId::ThreadCPUTime);
    for _ in 0..calls {
        let allowed = grant.check(black_box(QUEUE), black_box(Permission::Publish));
        assert!(allowed.is_ok(), "the bench user may publish to {QUEUE}");
    }
    (cpu_s(rustix::time::ClockId::ThreadCPUTime) - began) * 1e9 / calls.max(1) as f64
}

/// User + system CPU seconds of this process so far, every thread.
fn process_cpu_s() -> f64 {
    cpu_s(rustix::time::ClockId::ProcessCPUTime)
}

fn cpu_s(clock: rustix::time::ClockId) -> f64 {
    let now = rustix::time::clock_gettime(clock);
    now.tv_sec as f64 + now.tv_nsec as f64 * 1e-9
}

fn publish_rows(
    config: &AuthBenchConfig,
    users: &[PublishRun],
    none: &[PublishRun],
    report: &mut Report,
) {
    let rates = |runs: &[PublishRun]| runs.iter().map(|r| r.rate).collect::<Vec<_>>();
    let cpus = |runs: &[PublishRun]| runs.iter().map(|r| r.cpu_per_publish_s).collect::<Vec<_>>();
    let (users_rate, none_rate) = (rates(users), rates(none));
    let (users_cpu, none_cpu) = (cpus(users), cpus(none));
    let ratios: Vec<f64> = users_rate
        .iter()
        .zip(&none_rate)
        .map(|(u, n)| u / n.max(1e-9))
        .collect();
    let shape = format!(
        "{} B bodies, {} in flight, one connection",
        config.body_bytes, config.in_flight
    );
    report.rows.push(Row {
        case: "confirmed publish, user with 10 rules / auth none".into(),
        keratin: format!("{:.0} msg/s as user", median(&users_rate)),
        reference: format!("{:.0} msg/s auth none", median(&none_rate)),
        ratio: median(&ratios),
        round_ratios: ratios,
        goal: Some(PUBLISH_GOAL),
        note: format!("{shape}; the matching rule ({QUEUE}*) is the 10th"),
    });
    // CPU per publish: lower is better, so the ratio is none / users.
    let cpu_ratios: Vec<f64> = users_cpu
        .iter()
        .zip(&none_cpu)
        .map(|(u, n)| n / u.max(1e-12))
        .collect();
    report.rows.push(Row {
        case: "CPU per publish, auth none / user".into(),
        keratin: format!("{:.2} us/msg as user", median(&users_cpu) * 1e6),
        reference: format!("{:.2} us/msg auth none", median(&none_cpu) * 1e6),
        ratio: median(&cpu_ratios),
        round_ratios: cpu_ratios,
        goal: None,
        note: "process CPU clock (client + node, all threads) / confirmed".into(),
    });
    check_row(users, none, report);
    report.json_cases.push(json!({
        "case": "auth_publish",
        "users_msgs_per_s": users_rate,
        "none_msgs_per_s": none_rate,
        "users_cpu_s_per_msg": users_cpu,
        "none_cpu_s_per_msg": none_cpu,
        "check_ns": users.iter().filter_map(|r| r.check_ns).collect::<Vec<_>>(),
    }));
}

/// The CPU-only figure: one `Grant::check` per message against the CPU of a publish (an upper
/// bound: the node checks once per publish frame, and a frame may carry several messages).
fn check_row(users: &[PublishRun], none: &[PublishRun], report: &mut Report) {
    let pairs: Vec<(f64, f64)> = users
        .iter()
        .zip(none)
        .filter_map(|(u, n)| Some((u.check_ns?, n.cpu_per_publish_s * 1e9)))
        .collect();
    let kept: Vec<f64> = pairs.iter().map(|(c, p)| 1.0 - c / p.max(1e-9)).collect();
    let check_ns = median(&pairs.iter().map(|p| p.0).collect::<Vec<_>>());
    let publish_ns = median(&pairs.iter().map(|p| p.1).collect::<Vec<_>>());
    report.rows.push(Row {
        case: "1 - Grant::check / CPU per publish".into(),
        keratin: format!("{check_ns:.0} ns per check"),
        reference: format!("{publish_ns:.0} ns CPU/publish"),
        ratio: median(&kept),
        round_ratios: kept.clone(),
        goal: Some(PUBLISH_GOAL),
        note: "CPU only: the check in a loop (thread CPU clock), 10 rules, the 10th matching"
            .into(),
    });
    report.diagnostics.push(format!(
        "permission check: {check_ns:.0} ns of {publish_ns:.0} ns CPU per confirmed publish \
         = {:.3} % (median of rounds {:.3} %)",
        100.0 * check_ns / publish_ns.max(1e-9),
        100.0 * (1.0 - median(&kept)),
    ));
}
