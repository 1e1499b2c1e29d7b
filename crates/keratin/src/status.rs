//! `keratin status`: the node's filesystems and memory with their limit levels, read from the
//! HTTP admin port's `GET /api/v1/status` with one plain HTTP/1.1 request.
//!
//! Owns that request (also used by `keratin attention`) (a blocking `TcpStream`, `Connection: close`, bounded by timeouts and a
//! size cap) and the human rendering. The document itself is the server's
//! (`keratin-server` `limits.rs`, `status()`); `--json` prints it unchanged.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use serde_json::Value;

use crate::connect::CommonArgs;
use crate::output::{format_bytes, print_json, Failure, Table};

/// The HTTP admin port's default address, as `keratin serve` binds it.
pub const HTTP_DEFAULT: &str = "127.0.0.1:5681";
const STATUS_PATH: &str = "/api/v1/status";
/// Bound on connecting and on each read and write: the admin port answers from memory.
const HTTP_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on the response: a status document is a few hundred bytes per filesystem, so 4 MiB
/// means something other than a Keratin node answered.
const RESPONSE_SIZE_BYTES_MAX: u64 = 4 * 1024 * 1024;

/// Flags of `keratin status`. `--server` is accepted like on every verb but not used: the
/// status comes from the HTTP admin port.
#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// The HTTP admin address.
    #[arg(long, env = "KERATIN_HTTP", default_value = HTTP_DEFAULT, value_name = "ADDR")]
    http: String,
}

/// Runs `keratin status`.
pub fn run(args: StatusArgs) -> Result<ExitCode, Failure> {
    let document = get_json(&args.http, STATUS_PATH)?;
    if args.common.json {
        print_json(&document);
    } else {
        print!("{}", status_text(&document));
    }
    Ok(ExitCode::SUCCESS)
}

/// `GET path` (with its query) from the admin port at `http`, parsed as JSON.
pub fn get_json(http: &str, path: &str) -> Result<Value, Failure> {
    let fail = |what: String| Failure::new(format!("GET http://{http}{path}: {what}"));
    let addr = http
        .to_socket_addrs()
        .map_err(|error| fail(format!("bad address: {error}")))?
        .next()
        .ok_or_else(|| fail("the address resolves to nothing".into()))?;
    let mut stream = TcpStream::connect_timeout(&addr, HTTP_TIMEOUT)
        .map_err(|error| fail(format!("cannot connect: {error}")))?;
    let io = |error: std::io::Error| fail(error.to_string());
    stream.set_read_timeout(Some(HTTP_TIMEOUT)).map_err(io)?;
    stream.set_write_timeout(Some(HTTP_TIMEOUT)).map_err(io)?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {http}\r\nAccept: application/json\r\n\
         Connection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).map_err(io)?;
    let mut response = Vec::new();
    stream
        .take(RESPONSE_SIZE_BYTES_MAX)
        .read_to_end(&mut response)
        .map_err(io)?;
    let body = http_body(&response).map_err(fail)?;
    serde_json::from_slice(&body).map_err(|error| fail(format!("the body is not JSON: {error}")))
}

/// The body of a complete HTTP/1.1 response read until close, after checking for 200.
fn http_body(response: &[u8]) -> Result<Vec<u8>, String> {
    let split = response
        .windows(4)
        .position(|window| window == b"\r\n\r\n")
        .ok_or("the response has no end of headers")?;
    let head = String::from_utf8_lossy(&response[..split]);
    let body = &response[split + 4..];
    let status_line = head.lines().next().unwrap_or_default();
    let status = status_line.split_whitespace().nth(1).unwrap_or_default();
    if status != "200" {
        let text = String::from_utf8_lossy(body);
        return Err(format!("{status_line}: {}", text.trim()));
    }
    let chunked = head.lines().any(|line| {
        let line = line.to_ascii_lowercase();
        line.starts_with("transfer-encoding:") && line.contains("chunked")
    });
    if chunked {
        dechunk(body)
    } else {
        Ok(body.to_vec())
    }
}

/// Joins the chunks of a `Transfer-Encoding: chunked` body.
fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    loop {
        let line_end = rest
            .windows(2)
            .position(|window| window == b"\r\n")
            .ok_or("a chunk size line has no end")?;
        let size_text = String::from_utf8_lossy(&rest[..line_end]);
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| format!("bad chunk size {size_text:?}"))?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok(body);
        }
        let chunk = rest.get(..size).ok_or("a chunk is cut short")?;
        body.extend_from_slice(chunk);
        rest = rest.get(size + 2..).ok_or("a chunk has no end")?;
    }
}

fn bytes_field(value: &Value, field: &str) -> String {
    value[field]
        .as_u64()
        .map_or_else(|| "?".to_owned(), format_bytes)
}

fn text_field<'a>(value: &'a Value, field: &str) -> &'a str {
    value[field].as_str().unwrap_or("?")
}

/// The human rendering: the node, a table of filesystems, a line for memory.
fn status_text(document: &Value) -> String {
    let mut out = format!("node    {}\n\n", text_field(document, "node"));
    let mut table = Table::new(&["PATH", "LEVEL", "FREE", "TOTAL", "SPARE"]);
    let filesystems = document["filesystems"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    for fs in filesystems {
        table.row(vec![
            text_field(fs, "path").to_owned(),
            text_field(fs, "level").to_owned(),
            bytes_field(fs, "free_bytes"),
            bytes_field(fs, "total_bytes"),
            bytes_field(fs, "spare_bytes"),
        ]);
    }
    out.push_str(&table.render());
    let memory = &document["memory"];
    out.push_str(&format!(
        "\nmemory  {} resident of {} limit ({}), level {}\n",
        bytes_field(memory, "resident_bytes"),
        bytes_field(memory, "limit_bytes"),
        text_field(memory, "limit_source"),
        text_field(memory, "level"),
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_with_length_and_chunked() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(http_body(plain).unwrap(), b"{}");
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\n\r\n";
        assert_eq!(http_body(chunked).unwrap(), b"{\"a\":1}");
        let missing = b"HTTP/1.1 404 Not Found\r\n\r\nno such page";
        assert_eq!(
            http_body(missing).unwrap_err(),
            "HTTP/1.1 404 Not Found: no such page"
        );
    }

    #[test]
    fn human_status_names_every_field() {
        let document = serde_json::json!({
            "node": "n1",
            "filesystems": [{"path": "/data", "level": "soft", "free_bytes": 2048,
                             "total_bytes": 1048576, "spare_bytes": 0}],
            "memory": {"resident_bytes": 1024, "limit_bytes": 4096,
                       "limit_source": "cgroup v2", "level": "normal"},
        });
        let text = status_text(&document);
        assert!(text.contains("/data   soft"), "{text}");
        assert!(text.contains("2.0 KiB"), "{text}");
        assert!(
            text.contains("1.0 KiB resident of 4.0 KiB limit (cgroup v2), level normal"),
            "{text}"
        );
    }
}
