//! Runtime settings against the real binary: `keratin settings set` moves a filesystem between
//! levels without a restart, within about one sampling interval; the change is stored in the
//! node metadata and survives a restart; a refused change (one bad value among good ones, or a
//! startup key) changes nothing; `reset` goes back to the configured value.
//!
//! No root needed: the thresholds are fractions of whatever filesystem holds the temporary
//! directory, moved across the free fraction it has (between 3% and 96% free on any machine
//! that can run the tests).

mod support;

use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::*;

const CLI_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `keratin ARGS` against the server's admin port, bounded in time.
fn cli(server: &Server, args: &[&str]) -> Output {
    let child = Command::new(env!("CARGO_BIN_EXE_keratin"))
        .args(args)
        .env("KERATIN_HTTP", server.http.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the keratin CLI starts");
    let pid = child.id();
    let (done, output) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    match output.recv_timeout(CLI_TIMEOUT) {
        Ok(output) => output.expect("the CLI's output"),
        Err(_) => {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            panic!("keratin {args:?} did not finish within {CLI_TIMEOUT:?}");
        }
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn setting(server: &Server, key: &str) -> Value {
    let out = cli(server, &["settings", "get", key, "--json"]);
    assert!(out.status.success(), "get failed: {}", text(&out.stderr));
    let document: Value = serde_json::from_slice(&out.stdout).expect("settings JSON");
    document["settings"]
        .as_array()
        .expect("a list")
        .iter()
        .find(|e| e["key"] == key)
        .cloned()
        .unwrap_or_else(|| panic!("{key} missing from {document}"))
}

fn level(server: &Server) -> String {
    status(server.http)["filesystems"][0]["level"]
        .as_str()
        .unwrap_or("?")
        .to_owned()
}

/// Waits until the first filesystem is at `want`; returns how long that took.
fn wait_level(server: &Server, want: &str, within: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let now = level(server);
        if now == want {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "still {now}, not {want}, after {within:?}: {}",
            status(server.http)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn start(config: &std::path::Path) -> Server {
    Server::start(&[
        "serve",
        "--config",
        config.to_str().expect("utf8"),
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
    ])
}

#[test]
fn a_live_threshold_change_moves_levels_survives_restart_and_refusals_change_nothing() {
    let tmp = tempfile::Builder::new()
        .prefix("keratin-settings")
        .tempdir_in("/var/tmp")
        .expect("tmp");
    let data = tmp.path().join("data");
    let (free, total) = {
        std::fs::create_dir_all(&data).expect("data dir");
        free_and_total(&data)
    };
    let free_fraction = free as f64 / total as f64;
    assert!(
        (0.03..0.96).contains(&free_fraction),
        "this test needs a filesystem between 3% and 96% free; {} is {:.1}% free",
        data.display(),
        free_fraction * 100.0
    );
    // Normal at start: thresholds far below the free fraction. Sampling every 500 ms.
    let config = small_fs_config(tmp.path(), &[&data], 0.01, 0.005, 0.001);
    let text_config = std::fs::read_to_string(&config)
        .expect("config")
        .replace("sample_interval_ms = 100", "sample_interval_ms = 500");
    std::fs::write(&config, text_config).expect("config");
    let sample_interval = Duration::from_millis(500);

    let mut server = start(&config);
    wait_level(&server, "normal", Duration::from_secs(10));
    let soft = setting(&server, "limits.disk.soft_fraction");
    assert_eq!(soft["value"], 0.01);
    assert!(
        soft["origin"].as_str().unwrap_or("").starts_with("file "),
        "{soft}"
    );
    assert_eq!(soft["live"], true);

    // Live: soft at 97% free puts this filesystem at soft within about one interval.
    let out = cli(
        &server,
        &["settings", "set", "limits.disk.soft_fraction=0.97"],
    );
    assert!(out.status.success(), "set failed: {}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("limits.disk.soft_fraction"),
        "{}",
        text(&out.stdout)
    );
    let took = wait_level(&server, "soft", Duration::from_secs(10));
    eprintln!("level moved to soft {took:?} after the set (sampling interval {sample_interval:?})");
    // Applied at once (the sampler is woken); a loaded machine gets generous slack.
    assert!(took < sample_interval + Duration::from_secs(3), "{took:?}");
    let soft = setting(&server, "limits.disk.soft_fraction");
    assert_eq!(soft["value"], 0.97);
    assert_eq!(soft["origin"], "runtime");
    assert_eq!(soft["configured_value"], 0.01);

    // Refused whole: one good value and one bad one (hard above soft) change nothing.
    let out = cli(
        &server,
        &[
            "settings",
            "set",
            "limits.max_delay_ms=7",
            "limits.disk.hard_fraction=0.99",
        ],
    );
    assert!(!out.status.success(), "a bad set must fail");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("limits.disk.hard_fraction") && stderr.contains("nothing was changed"),
        "{stderr}"
    );
    assert_eq!(setting(&server, "limits.max_delay_ms")["value"], 50);
    assert_eq!(
        setting(&server, "limits.disk.hard_fraction")["value"],
        0.005
    );
    // A value of the wrong type, a startup key and an unknown key are refused too.
    for (pair, says) in [
        ("limits.max_delay_ms=fast", "a whole number"),
        ("storage.dirs=1", "restart"),
        ("limits.disk.sotf_fraction=0.5", "unknown setting"),
    ] {
        let out = cli(&server, &["settings", "set", pair]);
        assert!(!out.status.success(), "{pair} must be refused");
        assert!(
            text(&out.stderr).contains(says),
            "{pair}: {}",
            text(&out.stderr)
        );
    }
    assert_eq!(setting(&server, "limits.max_delay_ms")["value"], 50);

    // The change survives a restart: soft from the first sample, origin runtime.
    assert!(server.terminate(Duration::from_secs(20)), "clean shutdown");
    let server = start(&config);
    assert_eq!(level(&server), "soft", "{}", status(server.http));
    assert_eq!(
        setting(&server, "limits.disk.soft_fraction")["origin"],
        "runtime"
    );

    // Reset: back to the configured value, and to normal.
    let out = cli(&server, &["settings", "reset", "limits.disk.soft_fraction"]);
    assert!(out.status.success(), "reset failed: {}", text(&out.stderr));
    wait_level(&server, "normal", Duration::from_secs(10));
    let soft = setting(&server, "limits.disk.soft_fraction");
    assert_eq!(soft["value"], 0.01);
    assert!(
        soft["origin"].as_str().unwrap_or("").starts_with("file "),
        "{soft}"
    );
}

#[test]
fn the_settings_api_refuses_a_body_that_is_not_an_object() {
    let tmp = tempfile::Builder::new()
        .prefix("keratin-settings")
        .tempdir_in("/var/tmp")
        .expect("tmp");
    let data = tmp.path().join("data");
    let config = small_fs_config(tmp.path(), &[&data], 0.01, 0.005, 0.001);
    let server = start(&config);
    let response = http_request(server.http, "PUT", "/api/v1/settings", "[1, 2]");
    assert!(response.starts_with("HTTP/1.1 400"), "{response}");
    assert!(response.contains("expected a JSON object"), "{response}");
    let response = http_request(server.http, "PUT", "/api/v1/settings", "{}");
    assert!(response.starts_with("HTTP/1.1 400"), "{response}");
    let response = http_request(
        server.http,
        "PUT",
        "/api/v1/settings",
        r#"{"limits.sample_interval_ms": 250}"#,
    );
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    let document: Value =
        serde_json::from_str(&http_get(server.http, "/api/v1/settings")).expect("settings JSON");
    assert_eq!(document["overrides"]["limits.sample_interval_ms"], 250);
}

/// One HTTP/1.1 request with a JSON body; the whole response (status line, headers, body).
fn http_request(addr: std::net::SocketAddr, method: &str, path: &str, body: &str) -> String {
    use std::io::{Read, Write};
    let mut stream =
        std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect http");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    response
}

/// The node storage budget (`storage.max_bytes`) end to end, changed live: a budget Keratin has
/// used up puts the filesystem at reserve and publishes get ERR_LIMITED reason disk while
/// consuming still works; removing the runtime override goes back to the configured budget and
/// publishes are accepted again.
#[test]
fn a_live_storage_budget_limits_publishes_and_reset_lifts_it() {
    let tmp = tempfile::Builder::new()
        .prefix("keratin-budget")
        .tempdir_in("/var/tmp")
        .expect("tmp");
    let data = tmp.path().join("data");
    let config = small_fs_config(tmp.path(), &[&data], 0.5, 0.3, 0.1);
    // Levels over a 1 GiB budget, not over the (unknown) filesystem holding /var/tmp.
    let text_config = std::fs::read_to_string(&config)
        .expect("config")
        .replace("[storage]\n", "[storage]\nmax_bytes = 1073741824\n");
    std::fs::write(&config, text_config).expect("config");
    let server = start(&config);
    wait_level(&server, "normal", Duration::from_secs(10));
    let server_arg = server.protocol.to_string();
    let run = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--server", server_arg.as_str()]);
        cli(&server, &all)
    };
    let out = run(&["queue", "declare", "q"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = run(&["publish", "q", "--count", "100", "--size", "1024"]);
    assert!(out.status.success(), "{}", text(&out.stderr));

    // The budget is now exactly what Keratin uses: nothing free, reserve. Wait for a sample
    // that counts the queue's segment (0 would mean "no budget").
    let started = Instant::now();
    let used = loop {
        let fs = &status(server.http)["filesystems"][0];
        let used =
            fs["total_bytes"].as_u64().expect("total") - fs["free_bytes"].as_u64().expect("free");
        if used > 0 {
            break used;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the queue's files never counted against the budget: {fs}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = cli(
        &server,
        &["settings", "set", &format!("storage.max_bytes={used}")],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    wait_level(&server, "reserve", Duration::from_secs(10));
    let out = run(&["publish", "q", "--count", "1", "--timeout-ms", "1000"]);
    assert!(
        !out.status.success(),
        "a publish past the budget must be refused"
    );
    let stderr = text(&out.stderr);
    assert!(stderr.contains("disk"), "{stderr}");
    // Consumers keep working at reserve.
    let out = run(&["consume", "q", "--count", "100", "--idle-exit-ms", "3000"]);
    assert!(
        out.status.success(),
        "consume at reserve: {}",
        text(&out.stderr)
    );

    // Back to the configured 1 GiB budget.
    let out = cli(&server, &["settings", "reset", "storage.max_bytes"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    wait_level(&server, "normal", Duration::from_secs(10));
    let out = run(&["publish", "q", "--count", "10"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}
