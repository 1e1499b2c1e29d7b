//! `NodeCtl`: how `compare-cluster` reaches the nodes of a cluster it did not start. The nodes
//! belong to `bench/cluster.sh`; the harness calls it back (`--ctl "bash bench/cluster.sh ctl"`)
//! for a node's process id and to start a killed node again, and kills by that process id
//! itself, so that the kill's instant is its own. It also owns the parsing of what the peers say
//! about their leaders (rabbitmqctl's `list_queues`, NATS server names).

use std::process::Command;
use std::time::{Duration, Instant};

use crate::contender::BenchResult;

/// The node control command, and the verbs of `bench/cluster.sh ctl`.
#[derive(Debug, Clone)]
pub struct NodeCtl {
    /// The program and its first arguments; the verb and its arguments follow.
    command: Vec<String>,
}

impl NodeCtl {
    /// A control command given as words separated by spaces (no quoting: the paths of
    /// `bench/cluster.sh` and its state have none).
    pub fn parse(text: &str) -> Result<NodeCtl, String> {
        let command: Vec<String> = text.split_whitespace().map(String::from).collect();
        if command.is_empty() {
            return Err("--ctl is empty; give e.g. \"bash bench/cluster.sh ctl\"".into());
        }
        Ok(NodeCtl { command })
    }

    /// Runs one verb and returns what it printed; an exit status other than 0 is an error that
    /// quotes its standard error.
    fn run(&self, args: &[&str]) -> BenchResult<String> {
        let output = Command::new(&self.command[0])
            .args(&self.command[1..])
            .args(args)
            .output()
            .map_err(|e| format!("run {:?}: {e}", self.command))?;
        if !output.status.success() {
            return Err(format!(
                "{} {}: {} ({})",
                self.command.join(" "),
                args.join(" "),
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )
            .into());
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// The process id to kill for node `node` (1-based) of `system`.
    pub fn pid(&self, system: &str, node: usize) -> BenchResult<u32> {
        let text = self.run(&["pid", system, &node.to_string()])?;
        text.trim().parse().map_err(|_| {
            format!("ctl pid {system} {node} printed {text:?}, not a process id").into()
        })
    }

    /// Starts node `node` of `system` again; returns once the script saw it back in its
    /// cluster, with the time that took.
    pub fn restart(&self, system: &str, node: usize) -> BenchResult<Duration> {
        let began = Instant::now();
        self.run(&["restart", system, &node.to_string()])?;
        Ok(began.elapsed())
    }

    /// What a live RabbitMQ node says about `queue` (see [`rabbit_queue_status`]).
    pub fn leader_text(&self, system: &str, queue: &str) -> BenchResult<String> {
        self.run(&["leader", system, queue])
    }
}

/// Sends SIGKILL to `pid` and returns the instant the signal was sent (after `kill` returned:
/// the process cannot confirm anything after it).
pub fn kill9(pid: u32) -> BenchResult<Instant> {
    let status = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .map_err(|e| format!("run kill: {e}"))?;
    let killed = Instant::now();
    if !status.success() {
        return Err(format!("kill -KILL {pid}: {status}").into());
    }
    Ok(killed)
}

/// Whether `pid` runs: it exists and is not a zombie (PID 1 here reaps orphans late, and
/// `kill -0` succeeds on a zombie).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| process_state(&stat))
        .is_some_and(|state| state != 'Z')
}

/// The state letter of a `/proc/PID/stat` line: the field after the command name, which is in
/// parentheses and may itself hold spaces and parentheses.
fn process_state(stat: &str) -> Option<char> {
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().next()?.chars().next()
}

/// What RabbitMQ says about one quorum queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueStatus {
    /// The leader's node number (`rabbitN@host`).
    pub leader: usize,
    /// Members of the queue.
    pub members: usize,
    /// Members online.
    pub online: usize,
}

/// Parses the line of `queue` in `rabbitmqctl list_queues name leader members online -q
/// --no-table-headers`, e.g. `q\trabbit2@localhost\t[rabbit2@localhost, rabbit1@localhost,
/// rabbit3@localhost]\t[rabbit2@localhost, rabbit1@localhost]`.
pub fn rabbit_queue_status(text: &str, queue: &str) -> Option<QueueStatus> {
    let line = text
        .lines()
        .find(|l| l.split('\t').next().map(str::trim) == Some(queue))?;
    let fields: Vec<&str> = line.split('\t').map(str::trim).collect();
    let leader = rabbit_node_number(fields.get(1)?)?;
    let count = |field: Option<&&str>| {
        field.map_or(0, |f| {
            f.trim_matches(|c| c == '[' || c == ']')
                .split(',')
                .filter(|n| !n.trim().is_empty())
                .count()
        })
    };
    Some(QueueStatus {
        leader,
        members: count(fields.get(2)),
        online: count(fields.get(3)),
    })
}

/// `rabbit2@localhost` → 2.
pub fn rabbit_node_number(name: &str) -> Option<usize> {
    let (node, _host) = name.trim().split_once('@')?;
    node.strip_prefix("rabbit")?.parse().ok()
}

/// A NATS server name of `bench/cluster.sh` (`n2`) → 2.
pub fn nats_node_number(name: &str) -> Option<usize> {
    name.trim().strip_prefix('n')?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rabbit_status_reads_the_queue_line_of_list_queues() {
        let text = "other\trabbit1@localhost\t[rabbit1@localhost]\t[rabbit1@localhost]\n\
                    kbench-failover-0\trabbit2@localhost\t[rabbit2@localhost, rabbit1@localhost, rabbit3@localhost]\t[rabbit2@localhost, rabbit3@localhost]\n";
        assert_eq!(
            rabbit_queue_status(text, "kbench-failover-0"),
            Some(QueueStatus {
                leader: 2,
                members: 3,
                online: 2
            })
        );
        assert_eq!(
            rabbit_queue_status(text, "other").map(|s| s.leader),
            Some(1)
        );
        // A name that is only a prefix of the queue's is not the queue.
        assert_eq!(rabbit_queue_status(text, "kbench-failover"), None);
        // No leader yet (an election under way): no status.
        assert_eq!(rabbit_queue_status("q\t\t[]\t[]\n", "q"), None);
    }

    #[test]
    fn node_names_give_their_numbers() {
        assert_eq!(rabbit_node_number("rabbit3@localhost"), Some(3));
        assert_eq!(rabbit_node_number("rabbit@localhost"), None);
        assert_eq!(rabbit_node_number("rabbit3"), None);
        assert_eq!(nats_node_number("n2"), Some(2));
        assert_eq!(nats_node_number("nats2"), None);
    }

    #[test]
    fn process_state_skips_a_command_name_with_spaces_and_parentheses() {
        assert_eq!(process_state("42 (beam.smp) S 1 42"), Some('S'));
        assert_eq!(process_state("42 (a) (b) Z 1 42"), Some('Z'));
        assert_eq!(process_state("garbage"), None);
        assert!(alive(std::process::id()));
    }

    #[test]
    fn ctl_reads_a_pid_and_quotes_a_failing_verb() {
        assert!(NodeCtl::parse("  ").is_err());
        // `sh -c SCRIPT pid nats-r3 1`: the verb's words are the script's $0.. and ignored.
        let ctl = |script: &str| NodeCtl {
            command: vec!["sh".into(), "-c".into(), script.into()],
        };
        assert_eq!(ctl("echo 4321").pid("nats-r3", 1).unwrap(), 4321);
        assert!(ctl("echo pid of nothing").pid("nats-r3", 1).is_err());
        let error = ctl("echo no such node >&2; exit 3")
            .pid("nats-r3", 1)
            .unwrap_err()
            .to_string();
        assert!(error.contains("no such node"), "{error}");
        assert!(ctl("true").restart("nats-r3", 2).is_ok());
    }
}
