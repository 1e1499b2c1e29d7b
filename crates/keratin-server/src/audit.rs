//! The audit trail (issue 16): who declared, deleted, purged, changed settings, users or
//! permissions, when and from where, and refused logins. [`AuditLog`] keeps the newest
//! records in memory (what `GET /api/v1/audit` and `keratin audit` read) and appends them as
//! JSON lines to `audit.log` in the node's first data directory, rotated to `audit.log.1`.
//!
//! Recording never fails and never waits: an admin action (a delete or purge on a full disk
//! above all) must not stop because its audit line cannot be written. A line the writer
//! cannot take (its channel full, the disk failing) is counted in [`AuditLog::dropped`] and
//! stays in memory. What survives: a process crash loses at most the last
//! [`AUDIT_SYNC_INTERVAL`] of lines, as does a power loss (the writer `fdatasync`s).
//!
//! What goes in a record is the caller's job: never a password, hash or token
//! ([`AuditEntry::user_change`] leaves them out). The HTTP and protocol hooks are in
//! `http/audit.rs` and `tcp/connection.rs`.

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use keratin_auth::UserChange;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

/// The audit file's name in the first data directory.
pub const AUDIT_FILE: &str = "audit.log";

/// The rotated audit file's name: the lines before `audit.log`'s.
pub const AUDIT_FILE_ROTATED: &str = "audit.log.1";

/// The most bytes `audit.log` holds before it is rotated. Two files are kept: the trail takes
/// at most 2 MiB of disk, about 8,000 records of ~250 bytes each.
pub const AUDIT_FILE_BYTES_MAX: u64 = 1 << 20;

/// The most records kept in memory (served by the API), newest kept: ~250 bytes each, about
/// 250 KiB.
pub const AUDIT_MEMORY_MAX: usize = 1_000;

/// The most lines waiting for the writer. At the 100 ms sync interval this is 10,000 admin
/// actions a second before a line is dropped; each waiting line is a few hundred bytes.
pub const AUDIT_CHANNEL_MAX: usize = 1_024;

/// The writer syncs at most this often, grouping the lines that arrived meanwhile.
pub const AUDIT_SYNC_INTERVAL: Duration = Duration::from_millis(100);

/// The longest line written: a record whose `detail` would make it longer keeps
/// `{"truncated": true}` instead. Far above a real record (names are at most a few hundred
/// bytes); it keeps one record from taking a file.
pub const AUDIT_LINE_BYTES_MAX: usize = 16 << 10;

const _: () = assert!((AUDIT_LINE_BYTES_MAX as u64) < AUDIT_FILE_BYTES_MAX);

/// At most one `login.refused` record per source IP per this interval; the others are counted
/// in the next one's `detail.folded`.
pub const LOGIN_REFUSED_INTERVAL: Duration = Duration::from_secs(10);

/// The most source IPs whose refused logins are folded separately: 4,096 entries of ~64
/// bytes. Past it (a flood from many addresses), the others share one entry under `0.0.0.0`.
pub const LOGIN_SOURCES_MAX: usize = 4_096;

/// A dropped line is warned about at most this often.
const DROPPED_WARN_INTERVAL: Duration = Duration::from_secs(10);

/// Which port an action came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Via {
    /// The binary protocol port.
    Protocol,
    /// The HTTP admin port.
    Http,
}

/// One audit record, as stored (a JSON line) and served.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// When, in milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// Who: the logged-in user, `None` for anyone (`server.auth = none`) or a refused login.
    pub user: Option<String>,
    /// The peer's `IP:port`, if known.
    pub from: Option<String>,
    /// Through which port.
    pub via: Via,
    /// What, for example `queue.delete` or `user.grant`.
    pub action: String,
    /// The queue or user acted on.
    pub target: Option<String>,
    /// A small JSON value with what changed: never a password, hash or token.
    pub detail: Value,
    /// `ok`, `refused: <message>` or `failed: <message>`.
    pub outcome: String,
}

impl AuditEntry {
    /// A record of `action` on `target` now, by anyone from nowhere, with no detail, `ok`.
    pub fn new(via: Via, action: &str, target: Option<&str>) -> AuditEntry {
        AuditEntry {
            time_ms: now_ms(),
            user: None,
            from: None,
            via,
            action: action.to_string(),
            target: target.map(str::to_string),
            detail: Value::Null,
            outcome: "ok".into(),
        }
    }

    /// The same record by `user` from `from`.
    pub fn by(mut self, user: Option<&str>, from: Option<SocketAddr>) -> AuditEntry {
        self.user = user.map(str::to_string);
        self.from = from.map(|addr| addr.to_string());
        self
    }

    /// The same record with `detail`.
    pub fn with_detail(mut self, detail: Value) -> AuditEntry {
        self.detail = detail;
        self
    }

    /// The same record with its outcome: `ok`, or `refused: message` for a 4xx error code
    /// (the request was not accepted), `failed: message` for any other.
    pub fn with_outcome(mut self, outcome: Result<(), (u16, &str)>) -> AuditEntry {
        self.outcome = match outcome {
            Ok(()) => "ok".into(),
            Err((code, message)) if (400..500).contains(&code) => format!("refused: {message}"),
            Err((_, message)) => format!("failed: {message}"),
        };
        self
    }

    /// The record of a user change over HTTP: its action (`user.add`, `user.grant`, ...), the
    /// user, and what changed, leaving out password hashes and token digests.
    pub fn user_change(change: &UserChange) -> AuditEntry {
        let (action, detail) = match change {
            UserChange::Add { admin, .. } => ("user.add", json!({ "admin": admin })),
            UserChange::Password { .. } => ("user.password", Value::Null),
            UserChange::Admin { admin, .. } => ("user.admin", json!({ "admin": admin })),
            UserChange::Grant {
                pattern,
                permissions,
                ..
            } => (
                "user.grant",
                json!({ "pattern": pattern.as_str(), "permissions": permissions.to_string() }),
            ),
            UserChange::Revoke {
                pattern,
                permissions,
                ..
            } => (
                "user.revoke",
                json!({ "pattern": pattern.as_str(), "permissions": permissions.to_string() }),
            ),
            UserChange::Delete { .. } => ("user.delete", Value::Null),
            UserChange::Quota { quota, .. } => ("user.quota", json!(quota)),
            UserChange::TokenAdd { token, .. } => ("user.token_add", json!({ "token": token })),
            UserChange::TokenDelete { token, .. } => {
                ("user.token_delete", json!({ "token": token }))
            }
        };
        AuditEntry::new(Via::Http, action, Some(change.user())).with_detail(detail)
    }

    /// Its JSON line (with the newline), `detail` cut to `{"truncated": true}` past
    /// [`AUDIT_LINE_BYTES_MAX`].
    fn line(&self) -> Vec<u8> {
        let mut line = serde_json::to_vec(self).unwrap_or_default();
        if line.len() >= AUDIT_LINE_BYTES_MAX {
            let mut cut = self.clone();
            cut.detail = json!({ "truncated": true });
            cut.target = cut.target.map(|t| t.chars().take(256).collect());
            cut.outcome = cut.outcome.chars().take(1024).collect();
            line = serde_json::to_vec(&cut).unwrap_or_default();
        }
        line.push(b'\n');
        line
    }
}

/// Milliseconds since the Unix epoch.
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What the writer thread is sent.
enum Message {
    /// A record to append.
    Line(Vec<u8>),
    /// Answer once every line before it is synced (or dropped).
    Flush(oneshot::Sender<()>),
}

/// Refused logins from one source: when the last record was made and how many were folded
/// since.
#[derive(Debug, Clone, Copy)]
struct LoginFold {
    recorded: Instant,
    folded: u64,
}

/// The count of dropped lines and when it was last warned about, shared with the writer.
#[derive(Debug, Default)]
struct Dropped {
    count: AtomicU64,
    warned: Mutex<Option<Instant>>,
}

impl Dropped {
    fn add(&self, lines: u64, why: &dyn std::fmt::Display) {
        let total = self.count.fetch_add(lines, Ordering::Relaxed) + lines;
        let mut warned = lock(&self.warned);
        if warned.is_none_or(|at| at.elapsed() >= DROPPED_WARN_INTERVAL) {
            *warned = Some(Instant::now());
            tracing::warn!(
                dropped_total = total,
                "audit lines not written ({why}); they stay in memory only \
                 (GET /api/v1/audit shows them until the node restarts)"
            );
        }
    }
}

#[derive(Debug)]
struct Inner {
    memory: Mutex<VecDeque<AuditEntry>>,
    /// `None`: in memory only.
    writer: Option<mpsc::Sender<Message>>,
    dropped: Arc<Dropped>,
    logins: Mutex<HashMap<IpAddr, LoginFold>>,
}

/// The node's audit trail: cheap to clone (one `Arc`).
#[derive(Debug, Clone)]
pub struct AuditLog {
    inner: Arc<Inner>,
}

impl AuditLog {
    /// Open the trail in `dir` (created if missing): the newest [`AUDIT_MEMORY_MAX`] records
    /// of `audit.log.1` and `audit.log` are read back (a torn or bad line is skipped), and a
    /// writer thread appends from here on.
    pub fn open(dir: &Path) -> io::Result<AuditLog> {
        std::fs::create_dir_all(dir)?;
        let mut memory = VecDeque::with_capacity(AUDIT_MEMORY_MAX);
        for name in [AUDIT_FILE_ROTATED, AUDIT_FILE] {
            read_records(&dir.join(name), &mut memory)?;
        }
        let writer = Writer::open(dir)?;
        let dropped = Arc::new(Dropped::default());
        let (sender, receiver) = mpsc::channel(AUDIT_CHANNEL_MAX);
        let thread_dropped = dropped.clone();
        std::thread::Builder::new()
            .name("keratin-audit".into())
            .spawn(move || writer.run(receiver, &thread_dropped))?;
        Ok(AuditLog::with(memory, Some(sender), dropped))
    }

    /// A trail in memory only (a node whose audit file cannot be opened, or a test).
    pub fn in_memory() -> AuditLog {
        AuditLog::with(VecDeque::new(), None, Arc::default())
    }

    fn with(
        memory: VecDeque<AuditEntry>,
        writer: Option<mpsc::Sender<Message>>,
        dropped: Arc<Dropped>,
    ) -> AuditLog {
        AuditLog {
            inner: Arc::new(Inner {
                memory: Mutex::new(memory),
                writer,
                dropped,
                logins: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Record `entry`: in memory at once, on disk soon. Never waits and never fails.
    pub fn record(&self, entry: AuditEntry) {
        let line = entry.line();
        {
            let mut memory = lock(&self.inner.memory);
            if memory.len() >= AUDIT_MEMORY_MAX {
                memory.pop_front();
            }
            memory.push_back(entry);
        }
        if let Some(writer) = &self.inner.writer {
            if let Err(error) = writer.try_send(Message::Line(line)) {
                let why = match error {
                    mpsc::error::TrySendError::Full(_) => "the audit writer is behind",
                    mpsc::error::TrySendError::Closed(_) => "the audit writer stopped",
                };
                self.inner.dropped.add(1, &why);
            }
        }
    }

    /// Record a refused login from `from` (`user`: the name it presented), at most one per
    /// source IP per [`LOGIN_REFUSED_INTERVAL`]: the record's `detail.folded` counts the
    /// refusals from that IP left out since the previous one.
    pub fn login_refused(
        &self,
        via: Via,
        from: Option<SocketAddr>,
        user: Option<&str>,
        message: &str,
    ) {
        let ip = from.map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |addr| addr.ip());
        let Some(folded) = self.login_fold(ip) else {
            return;
        };
        let entry = AuditEntry::new(via, "login.refused", user)
            .by(None, from)
            .with_detail(json!({ "folded": folded }))
            .with_outcome(Err((401, message)));
        self.record(entry);
    }

    /// `Some(folded)` when a refused login from `ip` is to be recorded now, `None` when it is
    /// folded into the next record.
    fn login_fold(&self, ip: IpAddr) -> Option<u64> {
        let mut logins = lock(&self.inner.logins);
        let now = Instant::now();
        if logins.len() >= LOGIN_SOURCES_MAX && !logins.contains_key(&ip) {
            logins.retain(|_, fold| now.duration_since(fold.recorded) < LOGIN_REFUSED_INTERVAL);
        }
        let ip = if logins.len() >= LOGIN_SOURCES_MAX && !logins.contains_key(&ip) {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        } else {
            ip
        };
        match logins.get_mut(&ip) {
            Some(fold) if now.duration_since(fold.recorded) < LOGIN_REFUSED_INTERVAL => {
                fold.folded = fold.folded.saturating_add(1);
                None
            }
            Some(fold) => {
                let folded = fold.folded;
                *fold = LoginFold {
                    recorded: now,
                    folded: 0,
                };
                Some(folded)
            }
            None => {
                logins.insert(
                    ip,
                    LoginFold {
                        recorded: now,
                        folded: 0,
                    },
                );
                Some(0)
            }
        }
    }

    /// Up to `limit` records older than `before_ms` (all, if `None`), newest first.
    pub fn recent(&self, limit: usize, before_ms: Option<u64>) -> Vec<AuditEntry> {
        let memory = lock(&self.inner.memory);
        memory
            .iter()
            .rev()
            .filter(|entry| before_ms.is_none_or(|before| entry.time_ms < before))
            .take(limit)
            .cloned()
            .collect()
    }

    /// How many records could not be written to disk since the node started.
    pub fn dropped(&self) -> u64 {
        self.inner.dropped.count.load(Ordering::Relaxed)
    }

    /// Wait until every record so far is synced to disk (or dropped); at once in memory only.
    pub async fn flush(&self) {
        let Some(writer) = &self.inner.writer else {
            return;
        };
        let (done, wait) = oneshot::channel();
        if writer.send(Message::Flush(done)).await.is_ok() {
            let _ = wait.await;
        }
    }
}

/// Append the records of the file at `path` (if any) to `memory`, keeping the newest
/// [`AUDIT_MEMORY_MAX`].
fn read_records(path: &Path, memory: &mut VecDeque<AuditEntry>) -> io::Result<()> {
    let file = match File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(error),
    };
    for line in io::BufReader::new(file).split(b'\n') {
        let Ok(entry) = serde_json::from_slice::<AuditEntry>(&line?) else {
            continue;
        };
        if memory.len() >= AUDIT_MEMORY_MAX {
            memory.pop_front();
        }
        memory.push_back(entry);
    }
    Ok(())
}

/// The writer thread's file: appends, syncs and rotates.
struct Writer {
    dir: PathBuf,
    /// `None` after a failure: opened again with the next lines.
    file: Option<File>,
    size_bytes: u64,
    last_sync: Option<Instant>,
}

impl Writer {
    fn open(dir: &Path) -> io::Result<Writer> {
        let mut writer = Writer {
            dir: dir.to_path_buf(),
            file: None,
            size_bytes: 0,
            last_sync: None,
        };
        writer.reopen()?;
        Ok(writer)
    }

    /// Open `audit.log` for appending; a torn last line (a crash mid-write) is ended first,
    /// so that the next record starts on its own line.
    fn reopen(&mut self) -> io::Result<()> {
        let path = self.dir.join(AUDIT_FILE);
        let mut file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(&path)?;
        let mut size_bytes = file.metadata()?.len();
        if size_bytes > 0 {
            use std::os::unix::fs::FileExt;
            let mut last = [0u8; 1];
            file.read_exact_at(&mut last, size_bytes - 1)?;
            if last[0] != b'\n' {
                file.write_all(b"\n")?;
                size_bytes += 1;
            }
        }
        self.file = Some(file);
        self.size_bytes = size_bytes;
        Ok(())
    }

    /// Until every sender is gone: take the lines waiting, write them, sync at most every
    /// [`AUDIT_SYNC_INTERVAL`].
    fn run(mut self, mut receiver: mpsc::Receiver<Message>, dropped: &Dropped) {
        let mut lines: Vec<Vec<u8>> = Vec::new();
        let mut flushes: Vec<oneshot::Sender<()>> = Vec::new();
        while let Some(first) = receiver.blocking_recv() {
            let mut next = Some(first);
            loop {
                match next.take() {
                    Some(Message::Line(line)) => lines.push(line),
                    Some(Message::Flush(done)) => flushes.push(done),
                    None => {}
                }
                match receiver.try_recv() {
                    Ok(message) => next = Some(message),
                    Err(_) => break,
                }
                if lines.len() >= AUDIT_CHANNEL_MAX {
                    break;
                }
            }
            if let Some(at) = self.last_sync {
                if let Some(wait) = AUDIT_SYNC_INTERVAL.checked_sub(at.elapsed()) {
                    // Group: the lines arriving while this sync waits go with it.
                    std::thread::sleep(wait);
                    while lines.len() < AUDIT_CHANNEL_MAX {
                        match receiver.try_recv() {
                            Ok(Message::Line(line)) => lines.push(line),
                            Ok(Message::Flush(done)) => flushes.push(done),
                            Err(_) => break,
                        }
                    }
                }
            }
            let count = lines.len() as u64;
            if let Err(error) = self.write(&lines) {
                self.file = None;
                dropped.add(count, &error);
            }
            self.last_sync = Some(Instant::now());
            lines.clear();
            for done in flushes.drain(..) {
                let _ = done.send(());
            }
        }
    }

    /// Append `lines` (rotating first when one would take `audit.log` past the bound) and sync.
    fn write(&mut self, lines: &[Vec<u8>]) -> io::Result<()> {
        if lines.is_empty() {
            return Ok(());
        }
        if self.file.is_none() {
            self.reopen()?;
        }
        let mut batch = Vec::new();
        for line in lines {
            let len = line.len() as u64;
            if self.size_bytes + batch.len() as u64 + len > AUDIT_FILE_BYTES_MAX {
                self.append(&batch)?;
                batch.clear();
                self.rotate()?;
            }
            batch.extend_from_slice(line);
        }
        self.append(&batch)?;
        match &self.file {
            Some(file) => file.sync_data(),
            None => Ok(()),
        }
    }

    fn append(&mut self, bytes: &[u8]) -> io::Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let file = self
            .file
            .as_mut()
            .ok_or_else(|| io::Error::other("no file"))?;
        file.write_all(bytes)?;
        self.size_bytes += bytes.len() as u64;
        Ok(())
    }

    /// `audit.log` becomes `audit.log.1` (the previous one is gone) and a new `audit.log`
    /// starts.
    fn rotate(&mut self) -> io::Result<()> {
        if let Some(file) = self.file.take() {
            file.sync_data()?;
        }
        std::fs::rename(self.dir.join(AUDIT_FILE), self.dir.join(AUDIT_FILE_ROTATED))?;
        self.reopen()?;
        // The rename and the new file's entry must reach the disk with the lines after them.
        File::open(&self.dir)?.sync_all()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use keratin_auth::{ApiToken, PasswordDigest};

    fn entry(action: &str, target: &str) -> AuditEntry {
        AuditEntry::new(Via::Protocol, action, Some(target))
            .by(Some("alice"), Some("10.0.0.1:4000".parse().unwrap()))
    }

    fn disk_bytes(dir: &Path) -> u64 {
        [AUDIT_FILE, AUDIT_FILE_ROTATED]
            .iter()
            .filter_map(|name| std::fs::metadata(dir.join(name)).ok())
            .map(|m| m.len())
            .sum()
    }

    #[tokio::test]
    async fn records_survive_a_reopen_newest_first() {
        let dir = tempfile::tempdir().unwrap();
        let log = AuditLog::open(dir.path()).unwrap();
        for i in 0..5 {
            log.record(entry("queue.declare", &format!("q{i}")));
        }
        log.flush().await;
        drop(log);
        let log = AuditLog::open(dir.path()).unwrap();
        let targets: Vec<_> = log
            .recent(10, None)
            .into_iter()
            .map(|e| e.target.unwrap())
            .collect();
        assert_eq!(targets, ["q4", "q3", "q2", "q1", "q0"]);
        assert_eq!(log.recent(2, None).len(), 2);
        assert_eq!(log.dropped(), 0);
    }

    #[tokio::test]
    async fn before_ms_pages_back() {
        let log = AuditLog::in_memory();
        for i in 0..3u64 {
            let mut e = entry("queue.purge", &format!("q{i}"));
            e.time_ms = 1_000 + i;
            log.record(e);
        }
        let page = log.recent(10, Some(1_002));
        assert_eq!(page.len(), 2);
        assert_eq!(page[0].target.as_deref(), Some("q1"));
    }

    #[tokio::test]
    async fn memory_and_disk_stay_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let log = AuditLog::open(dir.path()).unwrap();
        let detail = json!({ "pad": "x".repeat(500) });
        let mut written = 0u64;
        let mut i = 0;
        while written < 3 * AUDIT_FILE_BYTES_MAX {
            let e = entry("queue.delete", &format!("q{i}")).with_detail(detail.clone());
            written += e.line().len() as u64;
            log.record(e);
            i += 1;
            if i % 512 == 0 {
                log.flush().await;
                assert!(disk_bytes(dir.path()) <= 2 * AUDIT_FILE_BYTES_MAX);
            }
        }
        log.flush().await;
        assert_eq!(log.dropped(), 0);
        assert!(disk_bytes(dir.path()) <= 2 * AUDIT_FILE_BYTES_MAX);
        assert!(std::fs::metadata(dir.path().join(AUDIT_FILE_ROTATED)).is_ok());
        assert_eq!(log.recent(usize::MAX, None).len(), AUDIT_MEMORY_MAX);
        drop(log);
        let log = AuditLog::open(dir.path()).unwrap();
        let newest = log.recent(1, None);
        assert_eq!(newest[0].target, Some(format!("q{}", i - 1)));
        assert_eq!(log.recent(usize::MAX, None).len(), AUDIT_MEMORY_MAX);
    }

    #[tokio::test]
    async fn a_torn_last_line_is_skipped_and_ended() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(AUDIT_FILE), b"{\"time_ms\":1,\"us").unwrap();
        let log = AuditLog::open(dir.path()).unwrap();
        assert!(log.recent(10, None).is_empty());
        log.record(entry("queue.declare", "after"));
        log.flush().await;
        drop(log);
        let log = AuditLog::open(dir.path()).unwrap();
        assert_eq!(log.recent(10, None)[0].target.as_deref(), Some("after"));
    }

    #[tokio::test]
    async fn refused_logins_fold_per_source() {
        let log = AuditLog::in_memory();
        let from: SocketAddr = "10.0.0.9:5000".parse().unwrap();
        for _ in 0..100 {
            log.login_refused(Via::Http, Some(from), Some("bob"), "bad password");
        }
        log.login_refused(Via::Http, Some("10.0.0.10:1".parse().unwrap()), None, "no");
        let recent = log.recent(10, None);
        assert_eq!(recent.len(), 2, "one per source IP: {recent:?}");
        assert_eq!(recent[1].action, "login.refused");
        assert_eq!(recent[1].outcome, "refused: bad password");
        assert_eq!(recent[1].target.as_deref(), Some("bob"));
        // The next record after the interval counts the 99 folded.
        lock(&log.inner.logins)
            .get_mut(&from.ip())
            .unwrap()
            .recorded -= LOGIN_REFUSED_INTERVAL;
        log.login_refused(Via::Http, Some(from), Some("bob"), "bad password");
        assert_eq!(log.recent(1, None)[0].detail["folded"], 99);
    }

    #[test]
    fn a_user_change_record_holds_no_secret() {
        let password = PasswordDigest::hash("correct horse battery").unwrap();
        let hash = serde_json::to_string(&password).unwrap();
        let token = ApiToken::generate().unwrap();
        let digest = token.digest();
        let digest_text = serde_json::to_string(&digest).unwrap();
        let changes = [
            UserChange::Add {
                name: "carol".into(),
                password: password.clone(),
                admin: true,
            },
            UserChange::Password {
                name: "carol".into(),
                password,
            },
            UserChange::TokenAdd {
                name: "carol".into(),
                token: "ci".into(),
                digest,
            },
        ];
        for change in &changes {
            let line = String::from_utf8(AuditEntry::user_change(change).line()).unwrap();
            assert!(!line.contains(hash.trim_matches('"')), "{line}");
            assert!(!line.contains(digest_text.trim_matches('"')), "{line}");
            assert!(!line.contains(token.reveal()), "{line}");
            assert!(!line.contains("argon2"), "{line}");
            assert!(line.contains("\"target\":\"carol\""), "{line}");
        }
        let add = AuditEntry::user_change(&changes[0]);
        assert_eq!(add.action, "user.add");
        assert_eq!(add.detail, json!({ "admin": true }));
    }
}
