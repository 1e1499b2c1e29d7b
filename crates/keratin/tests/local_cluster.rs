//! Logging in to a cluster as a new user does: `scripts/local-cluster.sh start` (this build's
//! binary, free ports, a temporary directory), then every command the script prints, as
//! printed, in one shell: each must succeed. It fails when a printed command does not parse
//! (`keratin --server ADDR cluster status`: "unexpected argument '--server'" while the
//! connection options were accepted only after the verb), or logs in with no or the wrong
//! password (the script does not say which node's data directory holds it).
//!
//! Then a stale `./keratin-data/admin-password` in the working directory: the CLI logs in with
//! it and is refused; the 401, from the protocol port (`queue list`) and from the admin port
//! (`cluster status`), names the file it read. It fails when the refusal does not say where
//! the wrong password came from.
//!
//! Bounded: the script waits at most 30 s for its nodes, every CLI run has a deadline, and the
//! nodes are stopped by the script (by PID) and, should that fail, killed by PID here.

mod support;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The ports the script uses from its base: protocol and HTTP `base + 2(n-1)` and `+1`, the
/// cluster port `base + 10 + (n-1)`.
const SCRIPT_PORTS_SPAN: u16 = 13;

fn script() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/local-cluster.sh")
}

/// A base port whose span of ports is free now, in the test nodes' range.
fn free_base() -> u16 {
    let span = support::cluster::NODE_PORTS;
    let start = (std::process::id() % 997) as u16 * 11;
    for step in 0..500u16 {
        let base = span.start + (start + step * 17) % (span.end - span.start - SCRIPT_PORTS_SPAN);
        let free = (base..base + SCRIPT_PORTS_SPAN)
            .all(|port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok());
        if free {
            return base;
        }
    }
    panic!("no free span of {SCRIPT_PORTS_SPAN} ports in {span:?}");
}

/// Runs `command` with a deadline; its output.
fn run(mut command: Command, within: Duration) -> Output {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let deadline = Instant::now() + within;
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let output = child.wait_with_output().expect("output");
            panic!(
                "{command:?} ran past {within:?}: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("output")
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Stops the script's nodes when dropped: by the script, then by the PIDs it recorded.
struct Nodes<'a> {
    dir: &'a Path,
    base: u16,
}

impl Nodes<'_> {
    fn script(&self, verb: &str) -> Command {
        let mut command = Command::new("bash");
        command
            .arg(script())
            .arg(verb)
            .arg(self.dir)
            .env("KERATIN_BIN", env!("CARGO_BIN_EXE_keratin"))
            .env("KERATIN_PORT_BASE", self.base.to_string())
            .env("KERATIN_LOG", support::node_log_filter())
            .env_remove("KERATIN_DATA_DIR")
            .env_remove("KERATIN_SERVER")
            .env_remove("KERATIN_USER")
            .env_remove("KERATIN_PASSWORD")
            .env_remove("KERATIN_TOKEN");
        for (key, value) in support::HOST_DISK_LIMITS {
            command.env(key, value);
        }
        command
    }
}

impl Drop for Nodes<'_> {
    fn drop(&mut self) {
        let _ = self.script("stop").output();
        for n in 1..=3 {
            if let Ok(pid) = std::fs::read_to_string(self.dir.join(format!("node-{n}.pid"))) {
                let _ = Command::new("kill").args(["-9", pid.trim()]).status();
            }
        }
    }
}

#[test]
fn every_command_the_local_cluster_script_prints_works() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("cluster");
    let nodes = Nodes {
        dir: &dir,
        base: free_base(),
    };
    let started = run(nodes.script("start"), Duration::from_secs(60));
    let printed = text(&started);
    eprintln!("{printed}");
    assert!(started.status.success(), "the script started the nodes");

    // The commands: the indented lines after "cluster up".
    let commands: Vec<&str> = printed
        .lines()
        .skip_while(|line| !line.starts_with("cluster up"))
        .filter(|line| line.starts_with("  "))
        .map(str::trim)
        .collect();
    assert!(
        commands.iter().any(|c| c.contains("cluster status")),
        "the script prints how to see the cluster: {printed}"
    );
    // In one shell, as a user pastes them, from an unrelated directory; each must succeed
    // (the nodes may still elect the metadata leader: the first is retried for 20 s).
    let work = root.path().join("elsewhere");
    std::fs::create_dir_all(&work).expect("mkdir");
    let mut shell = String::from("set -e\n");
    for (index, line) in commands.iter().enumerate() {
        if index
            == commands
                .iter()
                .position(|c| !c.starts_with("export "))
                .unwrap_or(0)
        {
            shell.push_str(&format!(
                "for i in $(seq 1 40); do {line} >/dev/null 2>&1 && break; sleep 0.5; done\n"
            ));
        }
        shell.push_str(line);
        shell.push('\n');
    }
    let mut command = Command::new("bash");
    command.arg("-c").arg(&shell).current_dir(&work);
    for key in [
        "KERATIN_DATA_DIR",
        "KERATIN_SERVER",
        "KERATIN_USER",
        "KERATIN_PASSWORD",
        "KERATIN_TOKEN",
    ] {
        command.env_remove(key);
    }
    let output = run(command, Duration::from_secs(60));
    assert!(
        output.status.success(),
        "the printed commands:\n{shell}\nfailed: {}",
        text(&output)
    );

    // A stale password file where the CLI looks by default.
    let stale = work.join("keratin-data");
    std::fs::create_dir_all(&stale).expect("mkdir");
    std::fs::write(stale.join("admin-password"), "not-the-password\n").expect("write");
    let server = format!("127.0.0.1:{}", nodes.base);
    for verb in [&["queue", "list"][..], &["cluster", "status"][..]] {
        let mut command = Command::new(env!("CARGO_BIN_EXE_keratin"));
        command
            .args(verb)
            .args(["--server", &server])
            .current_dir(&work)
            .env_remove("KERATIN_DATA_DIR")
            .env_remove("KERATIN_USER")
            .env_remove("KERATIN_PASSWORD");
        let output = run(command, Duration::from_secs(20));
        let said = text(&output);
        assert!(
            !output.status.success(),
            "a stale password is refused: {said}"
        );
        assert!(
            said.contains("keratin-data/admin-password"),
            "the refusal of {verb:?} names the password file it read: {said}"
        );
    }
    drop(nodes);
}
