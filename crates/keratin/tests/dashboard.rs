//! The web dashboard against the real binary. Without root: `/` is the page, its files come with
//! the right Content-Type, unknown files are 404, and the status document carries what the page
//! plots (`history`, `top_queues`). With root and Debian's `chromium`: a broker whose 64 MiB
//! tmpfs is past the soft level is loaded in headless Chromium, the rendered page shows the
//! filesystem banner at that level, and a screenshot is kept as a test artifact
//! (`$CARGO_TARGET_DIR/test-artifacts/dashboard.png`, or `target/` without the variable). A
//! three-node cluster's overview, in the status document and on the page, with a node killed.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::*;

/// Chromium gets this long per run before it is killed: a cold start on a loaded two-core CI
/// machine takes a few seconds; a hang must not hold the test suite.
const CHROMIUM_TIMEOUT: Duration = Duration::from_secs(90);

/// Virtual time Chromium gives the page before dumping or capturing it: the page's first
/// refresh needs one round of four API requests; a few polls (2 s apart) fit easily.
const VIRTUAL_TIME_BUDGET_MS: u64 = 5_000;

/// A response: status code, lower-cased headers, body.
struct Response {
    code: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }
}

/// A plain HTTP/1.1 GET on loopback, keeping the status and headers.
fn get(addr: SocketAddr, path: &str) -> Response {
    let mut stream =
        TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect http");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no end of headers in the answer to {path}"));
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut lines = head.lines();
    let code = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {head:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let body = raw[split + 4..].to_vec();
    assert!(
        !head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "static files come with a length, not chunked"
    );
    Response {
        code,
        headers,
        body,
    }
}

#[test]
fn the_dashboard_and_its_files_are_served() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let server = Server::start(&[
        "serve",
        "--data-dir",
        data.to_str().expect("utf8"),
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
    ]);

    let page = get(server.http, "/");
    assert_eq!(page.code, 200);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    let html = String::from_utf8(page.body.clone()).expect("utf8 page");
    for needle in [
        "<!doctype html>",
        "/dashboard/dashboard.js",
        "/dashboard/dashboard.css",
        "id=\"filesystems\"",
        "id=\"streams\"",
    ] {
        assert!(html.contains(needle), "page lacks {needle}: {html}");
    }
    let policy = page.header("content-security-policy").unwrap_or_default();
    assert!(
        policy.contains("default-src 'self'"),
        "the page may load nothing from elsewhere: {policy:?}"
    );

    for (file, content_type, needle) in [
        (
            "/dashboard/dashboard.js",
            "text/javascript; charset=utf-8",
            "/api/v1/status",
        ),
        (
            "/dashboard/dashboard.css",
            "text/css; charset=utf-8",
            ".level-soft",
        ),
        ("/dashboard/favicon.svg", "image/svg+xml", "<svg"),
    ] {
        let response = get(server.http, file);
        assert_eq!(response.code, 200, "{file}");
        assert_eq!(
            response.header("content-type"),
            Some(content_type),
            "{file}"
        );
        assert_eq!(
            response.header("content-length"),
            Some(response.body.len().to_string().as_str()),
            "{file}"
        );
        assert!(
            String::from_utf8_lossy(&response.body).contains(needle),
            "{file} lacks {needle}"
        );
    }
    // The streams table is filled from its own route, beside the queues'.
    let script = get(server.http, "/dashboard/dashboard.js");
    assert!(
        String::from_utf8_lossy(&script.body).contains("/api/v1/streams"),
        "dashboard.js does not poll /api/v1/streams"
    );
    for missing in [
        "/dashboard/missing.js",
        "/dashboard/",
        "/dashboard/../Cargo.toml",
        "/dashboard/%2e%2e/Cargo.toml",
        "/index.html",
    ] {
        assert_eq!(get(server.http, missing).code, 404, "{missing}");
    }

    // What the page plots: a history that grows with samples (one per 2 s bucket at most) and
    // the largest queues (none yet).
    let deadline = Instant::now() + Duration::from_secs(30);
    let filesystem = loop {
        let doc = status(server.http);
        let filesystem = doc["filesystems"][0].clone();
        let points = filesystem["history"].as_array().map_or(0, Vec::len);
        if points >= 2 || Instant::now() > deadline {
            break filesystem;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let history = filesystem["history"].as_array().expect("history array");
    assert!(history.len() >= 2, "history grows: {filesystem}");
    let times: Vec<u64> = history
        .iter()
        .map(|p| p[0].as_u64().expect("at_ms"))
        .collect();
    assert!(
        times.windows(2).all(|w| w[0] < w[1]),
        "oldest first: {times:?}"
    );
    for point in history {
        let free = point[1].as_u64().expect("free_bytes");
        assert!(free <= filesystem["total_bytes"].as_u64().expect("total"));
    }
    assert_eq!(filesystem["top_queues"], serde_json::json!([]));

    // A stream's data counts as a queue's: the largest here is the stream (before: streams
    // were left out, and the page said "No queue data on this file system").
    let cli = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_keratin"))
            .args(args)
            .args(["--server", &server.protocol.to_string()])
            .env("KERATIN_DATA_DIR", &data)
            .env_remove("KERATIN_SERVER")
            .stdin(Stdio::null())
            .output()
            .expect("run the CLI");
        assert!(output.status.success(), "keratin {args:?}: {output:?}");
    };
    cli(&["stream", "declare", "events"]);
    cli(&["publish", "events", "--count", "100"]);
    let top = status(server.http)["filesystems"][0]["top_queues"].clone();
    assert_eq!(top[0]["name"], "events", "{top}");
    assert_eq!(top[0]["kind"], "stream", "{top}");
}

/// The directory for artifacts: `$CARGO_TARGET_DIR/test-artifacts`, or the workspace's
/// `target/test-artifacts`.
fn artifacts_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"));
    target.join("test-artifacts")
}

/// Debian's `chromium` (or `chromium-browser` elsewhere), from PATH.
fn find_chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|dir| [dir.join("chromium"), dir.join("chromium-browser")])
        .find(|candidate| candidate.is_file())
}

/// Debian's Chromium for the browser part of `test`, or `None` after saying loudly why that
/// part is skipped (not root, or no `chromium`); with `KERATIN_REQUIRE_PRIVILEGED_TESTS=1` a
/// missing `chromium` fails the test instead.
fn chromium_for(test: &str) -> Option<PathBuf> {
    if !privileged(test) {
        return None;
    }
    let chromium = find_chromium();
    if chromium.is_none() {
        if std::env::var("KERATIN_REQUIRE_PRIVILEGED_TESTS").as_deref() == Ok("1") {
            panic!(
                "chromium is not installed and KERATIN_REQUIRE_PRIVILEGED_TESTS=1 forbids \
                 skipping; install it with `apt-get install -y chromium`"
            );
        }
        eprintln!(
            "!!! SKIPPING {test}: no `chromium` on PATH; install it with `apt-get install -y \
             chromium`"
        );
    }
    chromium
}

/// Run headless Chromium on `url` with `args`, in its own process group with a throw-away
/// profile; kill the group if it outlives [`CHROMIUM_TIMEOUT`]. Returns its stdout.
fn run_chromium(chromium: &Path, url: &str, args: &[String]) -> String {
    use std::os::unix::process::CommandExt;

    let profile = tempfile::tempdir().expect("profile dir");
    let output = tempfile::NamedTempFile::new().expect("stdout file");
    let mut child = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            // The test talks to loopback only: no update checks, sync or other background
            // requests, and nothing but 127.0.0.1 resolves.
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-default-apps",
            "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}"))
        .args(args)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(output.reopen().expect("stdout file"))
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("start chromium");
    let group = i32::try_from(child.id()).expect("pid fits i32");
    let deadline = Instant::now() + CHROMIUM_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait chromium") {
            break Some(status);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // Chromium's helpers (zygote, renderer) share its group: end them all, whatever happened.
    // SAFETY: signalling the process group we created; ESRCH when it is already gone is fine.
    unsafe {
        libc::kill(-group, libc::SIGKILL);
    }
    let _ = child.wait();
    let status = status.unwrap_or_else(|| {
        panic!(
            "chromium {args:?} did not finish within {} s",
            CHROMIUM_TIMEOUT.as_secs()
        )
    });
    assert!(status.success(), "chromium {args:?} failed: {status}");
    std::fs::read_to_string(output.path()).expect("read chromium's output")
}

/// A broker with logins (`server.auth = users`): the page shows its login form instead of the
/// figures, and the API it polls answered 401.
#[test]
fn chromium_shows_the_login_form_of_a_broker_with_logins() {
    let Some(chromium) = chromium_for("chromium_shows_the_login_form_of_a_broker_with_logins")
    else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let mut command = Command::new(env!("CARGO_BIN_EXE_keratin"));
    command.env("KERATIN_SERVER__AUTH", "users");
    let server = Server::start_with(
        command,
        &[
            "serve",
            "--data-dir",
            data.to_str().expect("utf8"),
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
        ],
    );
    assert_eq!(get(server.http, "/api/v1/status").code, 401);
    let url = format!("http://{}/", server.http);
    let dom = run_chromium(&chromium, &url, &["--dump-dom".to_string()]);
    assert_eq!(
        attribute_of(&dom, "login", "hidden"),
        None,
        "the login form shows: {dom}"
    );
    assert_eq!(
        attribute_of(&dom, "main", "hidden").as_deref(),
        Some(""),
        "the figures are hidden: {dom}"
    );
}

/// The attribute `name` of the element with `id` in a dumped DOM.
fn attribute_of(dom: &str, id: &str, name: &str) -> Option<String> {
    let start = dom.find(&format!("id=\"{id}\""))?;
    let tag_start = dom[..start].rfind('<')?;
    let tag_end = start + dom[start..].find('>')?;
    let tag = &dom[tag_start..tag_end];
    let key = format!("{name}=\"");
    let value_start = tag.find(&key)? + key.len();
    let value_len = tag[value_start..].find('"')?;
    Some(tag[value_start..value_start + value_len].to_string())
}

/// The text of the first `class="level"` span after the element with `id`.
fn level_text_after(dom: &str, id: &str) -> Option<String> {
    let start = dom.find(&format!("id=\"{id}\""))?;
    let rest = &dom[start..];
    let span = rest.find("class=\"level\">")? + "class=\"level\">".len();
    let end = rest[span..].find('<')?;
    Some(rest[span..span + end].to_string())
}

fn level_rank(level: &str) -> u8 {
    match level {
        "normal" => 0,
        "soft" => 1,
        "hard" => 2,
        "reserve" => 3,
        _ => 9,
    }
}

#[test]
fn chromium_shows_the_soft_banner_of_a_filling_tmpfs() {
    let Some(chromium) = chromium_for("chromium_shows_the_soft_banner_of_a_filling_tmpfs") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let fs = Tmpfs::mount(&data, 64);
    let config = small_fs_config(tmp.path(), &[&data], 0.40, 0.25, 0.10);
    let server = Server::start(&[
        "serve",
        "--config",
        config.to_str().expect("utf8"),
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
    ]);
    let cli = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_keratin"))
            .args(args)
            .env("KERATIN_SERVER", server.protocol.to_string())
            .output()
            .expect("run keratin");
        assert!(
            output.status.success(),
            "keratin {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    // A queue with a few MiB of messages, so the banner has a largest queue to name.
    cli(&["queue", "declare", "orders"]);
    cli(&[
        "publish",
        "orders",
        "--count",
        "600",
        "--size",
        "8192",
        "--in-flight",
        "64",
    ]);

    // A few 2 s history buckets before and after the fill, so the plot in the screenshot shows
    // the drop rather than a single point.
    std::thread::sleep(Duration::from_secs(5));

    // Another program fills the tmpfs until a third of it is free: below soft (40 %), well
    // above hard (25 %). Spare files count as free, so they are part of what is left.
    let (free, total) = free_and_total(&fs.path);
    let spare = status(server.http)["filesystems"][0]["spare_bytes"]
        .as_u64()
        .unwrap_or(0);
    let target_free = total / 3;
    let fill_bytes = (free + spare).saturating_sub(target_free);
    let filler = fs.path.join("filler");
    let fill = Command::new("fallocate")
        .args(["-l", &fill_bytes.to_string()])
        .arg(&filler)
        .status()
        .expect("run fallocate");
    assert!(fill.success(), "fallocate {fill_bytes} bytes");

    let deadline = Instant::now() + Duration::from_secs(30);
    let level = loop {
        let level = status(server.http)["filesystems"][0]["level"]
            .as_str()
            .unwrap_or("?")
            .to_string();
        if level_rank(&level) >= 1 || Instant::now() > deadline {
            break level;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(level, "soft", "the fill leaves a third free: soft level");
    let doc = status(server.http);
    assert_eq!(
        doc["filesystems"][0]["top_queues"][0]["name"], "orders",
        "{doc}"
    );

    std::thread::sleep(Duration::from_secs(5));
    let history = status(server.http)["filesystems"][0]["history"].clone();
    let last_free = history
        .as_array()
        .and_then(|points| points.last())
        .and_then(|point| point[1].as_u64())
        .unwrap_or(u64::MAX);
    assert!(
        last_free <= total * 2 / 5,
        "the history's newest point shows the fill: {history}"
    );

    let url = format!("http://{}/", server.http);
    let dom = run_chromium(&chromium, &url, &["--dump-dom".to_string()]);
    let banner_level = attribute_of(&dom, "fs-banner-0", "data-level")
        .unwrap_or_else(|| panic!("no fs-banner-0 with data-level in the page: {dom}"));
    assert!(
        level_rank(&banner_level) >= 1 && level_rank(&banner_level) <= 3,
        "banner at soft or deeper, got {banner_level:?}"
    );
    assert_eq!(
        level_text_after(&dom, "fs-banner-0").as_deref(),
        Some(banner_level.as_str()),
        "the banner's visible text names the level"
    );
    assert!(
        attribute_of(&dom, "fs-banner-0", "class")
            .is_some_and(|c| c.contains(&format!("level-{banner_level}"))),
        "the banner is coloured by level"
    );
    assert!(
        dom.contains("<span class=\"name\">orders</span>"),
        "the largest queue is named"
    );
    assert!(
        dom.contains("class=\"free\" points=\""),
        "the free-space plot is drawn"
    );
    assert!(
        dom.contains("data-state=\"ok\""),
        "the page read the status"
    );

    let dir = artifacts_dir();
    std::fs::create_dir_all(&dir).expect("artifacts dir");
    let screenshot = dir.join("dashboard.png");
    let _ = std::fs::remove_file(&screenshot);
    run_chromium(
        &chromium,
        &url,
        &[
            format!("--screenshot={}", screenshot.display()),
            "--window-size=1280,1600".to_string(),
        ],
    );
    let png = std::fs::read(&screenshot).expect("screenshot written");
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n"),
        "the screenshot is a PNG"
    );
    assert!(png.len() > 10_000, "a rendered page, not a blank one");
    eprintln!("dashboard screenshot: {}", screenshot.display());
}

/// Node `id`'s overview of the cluster (`cluster` of `GET /api/v1/status`): its nodes by id.
fn overview_nodes(
    cluster: &support::cluster::Cluster,
    id: u64,
) -> std::collections::BTreeMap<u64, serde_json::Value> {
    let doc = status(cluster.nodes[&id].http);
    doc["cluster"]["nodes"]
        .as_array()
        .unwrap_or_else(|| panic!("no cluster.nodes in node {id}'s status: {doc}"))
        .iter()
        .map(|n| (n["id"].as_u64().expect("a node id"), n.clone()))
        .collect()
}

/// The dashboard of a cluster node shows every node: three nodes, a queue of 3 partitions led
/// by 3 different nodes; node 1's status names each node reachable, leading one partition and
/// preferred for one. Node 3 killed: node 1 shows it unreachable, leading nothing, and the 3
/// partitions led by nodes 1 and 2. With root and Chromium, the rendered page has a row per
/// node with those states and counts (screenshot `dashboard-cluster.png` beside the other).
/// Fails if a node is missing, a count is wrong, or a dead node shows as reachable.
#[test]
fn the_dashboard_of_a_cluster_node_shows_every_node_and_what_it_leads() {
    use support::cluster::{spread, Cluster};

    let mut cluster = Cluster::start();
    cluster.cli_until_ok(
        1,
        &[
            "queue",
            "declare",
            "z",
            "--replicas",
            "3",
            "--partitions",
            "3",
        ],
        Duration::from_secs(30),
    );
    cluster.wait_leaders("z", "leaders spread", Duration::from_secs(30), spread);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let nodes = overview_nodes(&cluster, 1);
        let settled = nodes.len() == 3
            && nodes.values().all(|n| {
                n["reachable"] == true
                    && n["removed"] == false
                    && n["leads"] == 1
                    && n["preferred"] == 1
                    && n["client_addr"].is_string()
                    && n["admin_addr"].is_string()
            });
        if settled {
            assert_eq!(nodes[&1]["this_node"], true);
            assert_eq!(nodes[&2]["this_node"], false);
            assert_eq!(nodes[&2]["admin_addr"], cluster.nodes[&2].http.to_string());
            assert_eq!(
                nodes.values().filter(|n| n["meta_leader"] == true).count(),
                1,
                "one metadata leader: {nodes:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node 1's overview never showed 3 reachable nodes leading one partition each: {nodes:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    cluster.kill9(3);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let doc = status(cluster.nodes[&1].http);
        let nodes = overview_nodes(&cluster, 1);
        let settled = nodes[&3]["reachable"] == false
            && nodes[&3]["leads"] == 0
            && nodes[&1]["leads"].as_u64().unwrap_or(0) + nodes[&2]["leads"].as_u64().unwrap_or(0)
                == 3
            && doc["cluster"]["leaderless"] == 0;
        if settled {
            assert_eq!(
                nodes[&3]["preferred"], 1,
                "node 3 is still preferred for one"
            );
            assert_eq!(doc["cluster"]["partitions"], 3, "{doc}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node 1 never showed node 3 unreachable with its partition led elsewhere: {doc}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    let test = "the_dashboard_of_a_cluster_node_shows_every_node_and_what_it_leads (its page)";
    let Some(chromium) = chromium_for(test) else {
        return;
    };
    let url = format!("http://{}/", cluster.nodes[&1].http);
    let dom = run_chromium(&chromium, &url, &["--dump-dom".to_string()]);
    assert_eq!(
        attribute_of(&dom, "cluster-section", "hidden"),
        None,
        "the cluster section shows: {dom}"
    );
    let row = |id: u64| -> &str {
        let start = dom
            .find(&format!("<tr data-node=\"{id}\""))
            .unwrap_or_else(|| panic!("no row for node {id}: {dom}"));
        let end = start + dom[start..].find("</tr>").expect("the row ends");
        &dom[start..end]
    };
    assert!(row(1).contains("data-state=\"reachable\""), "{}", row(1));
    assert!(row(1).contains("(this node)"), "{}", row(1));
    assert!(row(2).contains("data-state=\"reachable\""), "{}", row(2));
    assert!(row(3).contains("data-state=\"unreachable\""), "{}", row(3));
    assert!(row(3).contains("data-leads=\"0\""), "{}", row(3));
    let leads = |id: u64| -> u64 {
        let row = row(id);
        let at = row.find("data-leads=\"").expect("a leads cell") + "data-leads=\"".len();
        row[at..at + row[at..].find('"').expect("quoted")]
            .parse()
            .expect("a count")
    };
    assert_eq!(leads(1) + leads(2), 3, "{}\n{}", row(1), row(2));

    let dir = artifacts_dir();
    std::fs::create_dir_all(&dir).expect("artifacts dir");
    let screenshot = dir.join("dashboard-cluster.png");
    let _ = std::fs::remove_file(&screenshot);
    run_chromium(
        &chromium,
        &url,
        &[
            format!("--screenshot={}", screenshot.display()),
            "--window-size=1280,1400".to_string(),
        ],
    );
    assert!(
        screenshot.is_file(),
        "no screenshot at {}",
        screenshot.display()
    );
}
