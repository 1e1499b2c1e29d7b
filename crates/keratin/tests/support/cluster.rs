//! A three-node cluster of real `keratin serve` processes on 127.0.0.1, each with its own data
//! directory under one temporary root: starting, killing and signalling nodes by PID, the CLI
//! against a node, and a node's cluster document. Tests add what they need about their queues.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;

use super::Server;

/// One node's fixed addresses and its process while it runs.
pub struct Node {
    pub id: u64,
    pub protocol: SocketAddr,
    pub http: SocketAddr,
    pub cluster: SocketAddr,
    pub dir: PathBuf,
    pub server: Option<Server>,
    /// Environment given to this node's process (over the test defaults).
    pub env: Vec<(&'static str, &'static str)>,
    /// Started with `--join` (it joins the running cluster).
    pub join: bool,
    /// A cgroup v1 memory group the process joins before it starts (it reads its memory limit
    /// from it).
    pub cgroup: Option<PathBuf>,
}

pub struct Cluster {
    pub nodes: BTreeMap<u64, Node>,
    pub root: tempfile::TempDir,
}

/// Ports the nodes listen on are picked from here: below Linux's ephemeral range (32768 on),
/// so that no outgoing connection (a client's, a peer's) holds a node's port as its local port
/// when the node restarts and binds it again (seen: a restart after the cut round failed).
pub const NODE_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A free port on 127.0.0.1 in [`NODE_PORTS`] (bound and released: another process could take
/// it meanwhile, which makes the node fail to start with a clear message).
pub fn free_addr() -> SocketAddr {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = u32::from(NODE_PORTS.end - NODE_PORTS.start);
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let port = NODE_PORTS.start + u16::try_from(offset).expect("below the span");
        if let Ok(listener) = TcpListener::bind(("127.0.0.1", port)) {
            return listener.local_addr().expect("address");
        }
    }
    panic!("no free port in {NODE_PORTS:?}");
}

impl Cluster {
    pub fn start() -> Cluster {
        Cluster::start_with_env(BTreeMap::new())
    }

    /// Three nodes, node `id` with `envs[id]` in its environment.
    pub fn start_with_env(envs: BTreeMap<u64, Vec<(&'static str, &'static str)>>) -> Cluster {
        let mut cluster = Cluster::new(envs);
        for id in 1..=3 {
            cluster.start_node(id);
        }
        cluster
    }

    /// Three nodes as [`Cluster::start_with_env`] makes them, none started yet (a test can
    /// still move a node's data directory).
    pub fn new(envs: BTreeMap<u64, Vec<(&'static str, &'static str)>>) -> Cluster {
        let root = tempfile::tempdir().expect("tempdir");
        let mut nodes = BTreeMap::new();
        for id in 1..=3u64 {
            nodes.insert(
                id,
                Node {
                    id,
                    protocol: free_addr(),
                    http: free_addr(),
                    cluster: free_addr(),
                    dir: root.path().join(format!("node-{id}")),
                    server: None,
                    env: envs.get(&id).cloned().unwrap_or_default(),
                    join: false,
                    cgroup: None,
                },
            );
        }
        Cluster { nodes, root }
    }

    pub fn start_node(&mut self, id: u64) {
        let peers: Vec<String> = self
            .nodes
            .values()
            .map(|n| format!("{}={}", n.id, n.cluster))
            .collect();
        let node = self.nodes.get_mut(&id).expect("node");
        let dir = node.dir.to_string_lossy().into_owned();
        let (protocol, http, id_text) = (
            node.protocol.to_string(),
            node.http.to_string(),
            id.to_string(),
        );
        let mut args: Vec<&str> = vec![
            "serve",
            "--data-dir",
            &dir,
            "--listen",
            &protocol,
            "--http",
            &http,
            "--node-id",
            &id_text,
        ];
        for peer in &peers {
            args.push("--peer");
            args.push(peer);
        }
        if node.join {
            args.push("--join");
        }
        let mut command = match &node.cgroup {
            // A shell joins the group, then becomes the node.
            Some(cgroup) => {
                let mut shell = std::process::Command::new("sh");
                shell.arg("-c").arg(format!(
                    "echo $$ > {}/cgroup.procs && exec {} \"$@\"",
                    cgroup.display(),
                    env!("CARGO_BIN_EXE_keratin")
                ));
                shell.arg("keratin");
                shell
            }
            None => std::process::Command::new(env!("CARGO_BIN_EXE_keratin")),
        };
        // The rounds kill, stop and cut the leader they found: leaders stay where elections
        // put them (leader balancing has its own test, keratin-server `cluster_balance.rs`).
        command.env("KERATIN_CLUSTER__LEADER_BALANCE", "false");
        command.envs(node.env.iter().copied());
        node.server = Some(Server::start_with(command, &args));
    }

    /// Start node `id`, new, with `--join` and every node in its peer list.
    pub fn start_joining(&mut self, id: u64) {
        let dir = self.root.path().join(format!("node-{id}"));
        self.nodes.insert(
            id,
            Node {
                id,
                protocol: free_addr(),
                http: free_addr(),
                cluster: free_addr(),
                dir,
                server: None,
                env: Vec::new(),
                join: true,
                cgroup: None,
            },
        );
        self.start_node(id);
    }

    /// `keratin ARGS --server <node id's address>`: exit status and output.
    pub fn cli(&self, id: u64, args: &[&str]) -> (bool, String) {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_keratin"))
            .args(args)
            .args(["--server", &self.nodes[&id].protocol.to_string()])
            .output()
            .expect("run keratin");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        (output.status.success(), text)
    }

    /// [`Cluster::cli`] until it succeeds (the cluster may still elect its metadata leader),
    /// for at most `within`; its output.
    pub fn cli_until_ok(&self, id: u64, args: &[&str], within: std::time::Duration) -> String {
        let deadline = std::time::Instant::now() + within;
        loop {
            let (ok, out) = self.cli(id, args);
            if ok {
                return out;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "keratin {args:?}: {out}"
            );
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
    }

    pub fn kill9(&mut self, id: u64) {
        if let Some(mut server) = self.nodes.get_mut(&id).and_then(|n| n.server.take()) {
            server.kill9();
        }
    }

    pub fn signal(&self, id: u64, signal: &str) {
        let pid = self.nodes[&id].server.as_ref().expect("running").pid;
        let status = std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal} {pid}");
    }

    pub fn live(&self) -> Vec<SocketAddr> {
        self.nodes
            .values()
            .filter(|n| n.server.is_some())
            .map(|n| n.protocol)
            .collect()
    }

    /// `GET /api/v1/cluster` of a running node, if it answers with JSON.
    pub fn cluster_document(&self, id: u64) -> Option<serde_json::Value> {
        let node = self.nodes.get(&id).filter(|n| n.server.is_some())?;
        let http = node.http;
        let text =
            std::panic::catch_unwind(move || super::http_get(http, "/api/v1/cluster")).ok()?;
        let json = text.find('{').map(|at| &text[at..])?;
        serde_json::from_str(json).ok()
    }
}

impl Cluster {
    /// `queue`'s partitions as running node `id` describes them in its cluster document, by
    /// index; `None` when it does not answer.
    pub fn partitions_seen_by(&self, id: u64, queue: &str) -> Option<Vec<serde_json::Value>> {
        let document = self.cluster_document(id)?;
        Some(
            document["queues"]
                .as_array()?
                .iter()
                .filter(|q| q["name"] == queue)
                .flat_map(|q| q["partitions"].as_array().cloned().unwrap_or_default())
                .collect(),
        )
    }

    /// The leader of each of `queue`'s partitions, by index: the one running node that says it
    /// leads the partition, named as its leader by every running node that holds a copy of it
    /// (a node without one may not know). `None` until every running node answers, the nodes
    /// that list the queue's partitions list the same non-zero number, and each partition has
    /// such a leader.
    pub fn leaders(&self, queue: &str) -> Option<Vec<u64>> {
        let views: Vec<(u64, Vec<serde_json::Value>)> = self
            .nodes
            .iter()
            .filter(|(_, node)| node.server.is_some())
            .map(|(id, _)| Some((*id, self.partitions_seen_by(*id, queue)?)))
            .collect::<Option<Vec<_>>>()?
            .into_iter()
            .filter(|(_, ps)| !ps.is_empty())
            .collect();
        let count = views.first()?.1.len();
        if views.iter().any(|(_, ps)| ps.len() != count) {
            return None;
        }
        (0..count)
            .map(|i| {
                let holders: Vec<(u64, &serde_json::Value)> = views
                    .iter()
                    .map(|(id, ps)| (*id, &ps[i]))
                    .filter(|(id, p)| {
                        p["replicas"]
                            .as_array()
                            .is_some_and(|r| r.contains(&serde_json::Value::from(*id)))
                    })
                    .collect();
                let leader = holders.first()?.1["leader"].as_u64()?;
                let running = holders.iter().any(|(id, _)| *id == leader);
                (running
                    && holders.iter().all(|(id, p)| {
                        p["leader"].as_u64() == Some(leader)
                            && (p["leading"] == true) == (leader == *id)
                    }))
                .then_some(leader)
            })
            .collect()
    }

    /// Waits up to `within` until [`Cluster::leaders`] of `queue` are known and `done` holds
    /// of them; the leaders by partition, or a panic naming `what` and the last leaders seen.
    pub fn wait_leaders(
        &self,
        queue: &str,
        what: &str,
        within: std::time::Duration,
        done: impl Fn(&[u64]) -> bool,
    ) -> Vec<u64> {
        let deadline = std::time::Instant::now() + within;
        let mut last = None;
        loop {
            if let Some(leaders) = self.leaders(queue) {
                if done(&leaders) {
                    return leaders;
                }
                last = Some(leaders);
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{queue}: {what} not within {within:?}; last leaders by partition: {last:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// Whether `leaders` (by partition) are on as many different nodes as there are partitions,
/// up to three.
pub fn spread(leaders: &[u64]) -> bool {
    let nodes: std::collections::BTreeSet<u64> = leaders.iter().copied().collect();
    nodes.len() == leaders.len().min(3)
}

impl Cluster {
    /// `GET /api/v1/streams/{stream}` of node `id`, if it runs and answers with JSON.
    pub fn stream_document(&self, id: u64, stream: &str) -> Option<serde_json::Value> {
        let node = self.nodes.get(&id).filter(|n| n.server.is_some())?;
        let http = node.http;
        let path = format!("/api/v1/streams/{stream}");
        let text = std::panic::catch_unwind(move || super::http_get(http, &path)).ok()?;
        let json = text.find('{').map(|at| &text[at..])?;
        serde_json::from_str(json).ok()
    }

    /// The leader of each of `stream`'s partitions, by index: the one running node whose
    /// stream document says it leads it; `None` until every running node answers, they list
    /// the same non-zero number of partitions, and each partition has exactly one.
    pub fn stream_leaders(&self, stream: &str) -> Option<Vec<u64>> {
        let mut leading: Vec<Vec<u64>> = Vec::new();
        for (id, node) in &self.nodes {
            if node.server.is_none() {
                continue;
            }
            let document = self.stream_document(*id, stream)?;
            let partitions = document["partitions"].as_array()?;
            if leading.is_empty() {
                leading = vec![Vec::new(); partitions.len()];
            }
            if partitions.is_empty() || partitions.len() != leading.len() {
                return None;
            }
            for (index, partition) in partitions.iter().enumerate() {
                if partition["leading"] == true {
                    leading[index].push(*id);
                }
            }
        }
        if leading.is_empty() {
            return None;
        }
        leading
            .into_iter()
            .map(|ids| match ids[..] {
                [id] => Some(id),
                _ => None,
            })
            .collect()
    }
}
