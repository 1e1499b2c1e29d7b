//! The HTTP admin port from the command line: finding it, then one HTTP/1.1 request per call
//! (a blocking `TcpStream`, `Connection: close`, bounded by timeouts and a size cap), JSON in
//! and out. With `--ca` the request goes over TLS: a node with `server.tls_cert_file` serves
//! HTTPS on its admin port with the protocol port's certificate, so the CA that verifies one
//! verifies the other; the certificate must name the admin address's host (or its IP). `keratin status`, `keratin settings` and `keratin attention` use it; the
//! documents are the server's (`keratin-server` `http`).
//!
//! The admin address is `--http` (env `KERATIN_HTTP`) when given; otherwise the CLI asks the
//! node at `--server`, whose handshake names its admin address (protocol version 3), so one
//! address of a node is enough for every verb.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use keratin_client::ClientTls;

use serde_json::Value;

use crate::connect::{self, CommonArgs, SERVER_DEFAULT};
use crate::output::Failure;

/// The HTTP admin port's default address, as `keratin serve` binds it.
pub const HTTP_DEFAULT: &str = "127.0.0.1:5681";
/// Bound on connecting and on each read and write: the admin port answers from memory.
const HTTP_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on the response: admin documents are kilobytes, so 4 MiB means something other than
/// a Keratin node answered.
const RESPONSE_SIZE_BYTES_MAX: u64 = 4 * 1024 * 1024;

/// HTTPS to the admin port for this run (from `--ca`), set by [`address`]; `None`: plain HTTP.
static ADMIN_TLS: OnceLock<Option<Arc<rustls::ClientConfig>>> = OnceLock::new();

/// The admin address to use: `http` when given, else the one the node at `--server` names in
/// its handshake. A node that cannot be reached at the default `--server` is looked for at the
/// default admin address (the same machine's node may refuse protocol connections at its bound
/// and still answer `status`); elsewhere the failure says to pass `--http`.
pub async fn address(common: &CommonArgs, http: Option<&str>) -> Result<String, Failure> {
    connect::login(common)?;
    if ADMIN_TLS.get().is_none() {
        let tls = match &common.ca {
            Some(ca) => Some(
                ClientTls::from_ca_file(ca)
                    .map_err(|error| Failure::client("cannot set up TLS".to_string(), &error))?
                    .rustls_config(),
            ),
            None => None,
        };
        let _ = ADMIN_TLS.set(tls);
    }
    if let Some(http) = http {
        return Ok(http.to_owned());
    }
    let server = common.server.as_str();
    let client = match connect::connect(common, None).await {
        Ok(client) => client,
        Err(_) if server == SERVER_DEFAULT => return Ok(HTTP_DEFAULT.to_owned()),
        Err(failure) => {
            return Err(Failure {
                message: format!(
                    "{}; the admin address is learned from the node, or pass --http ADDR",
                    failure.message
                ),
                code: failure.code,
            })
        }
    };
    let admin = client.server_info().admin.clone();
    client.close().await;
    admin.ok_or_else(|| {
        Failure::new(format!(
            "the node at {server} did not name its HTTP admin address (it speaks protocol \
             version {}, older than 3): pass --http ADDR",
            client.protocol_version()
        ))
    })
}

/// `method path` on the admin port at `http`, with an optional JSON body; the parsed JSON
/// answer, or a failure naming the request and the server's message.
pub fn request(
    http: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<Value, Failure> {
    let tls = ADMIN_TLS.get().cloned().flatten();
    let scheme = if tls.is_some() { "https" } else { "http" };
    let fail = |what: String| Failure::new(format!("{method} {scheme}://{http}{path}: {what}"));
    let addr = http
        .to_socket_addrs()
        .map_err(|error| fail(format!("bad address: {error}")))?
        .next()
        .ok_or_else(|| fail("the address resolves to nothing".into()))?;
    let stream = TcpStream::connect_timeout(&addr, HTTP_TIMEOUT).map_err(|error| {
        fail(format!(
            "cannot connect: {error}; is the node running, and is --http its admin address?"
        ))
    })?;
    let io = |error: std::io::Error| fail(error.to_string());
    stream.set_read_timeout(Some(HTTP_TIMEOUT)).map_err(io)?;
    stream.set_write_timeout(Some(HTTP_TIMEOUT)).map_err(io)?;
    let payload = body.map(Value::to_string).unwrap_or_default();
    let content = if body.is_some() {
        format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            payload.len()
        )
    } else {
        String::new()
    };
    let authorization = connect::current_login()
        .map(|login| format!("Authorization: {}\r\n", login.authorization()))
        .unwrap_or_default();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {http}\r\nAccept: application/json\r\n{content}\
         {authorization}Connection: close\r\n\r\n{payload}"
    );
    let response = match tls {
        None => exchange(stream, &request).map_err(io)?,
        Some(config) => {
            let connection = rustls::ClientConnection::new(config, tls_server_name(http)?)
                .map_err(|error| fail(format!("TLS: {error}")))?;
            exchange(rustls::StreamOwned::new(connection, stream), &request).map_err(|error| {
                fail(format!(
                    "{error}; does the node's admin port serve HTTPS (server.tls_cert_file), \
                     and does --ca hold the CA that signed its certificate?"
                ))
            })?
        }
    };
    // A TLS record (an alert, 0x15) or a bare close: the port serves HTTPS.
    if response.is_empty() || response.first() == Some(&0x15) {
        return Err(fail(
            "no HTTP answer (the node closed the connection); if its admin port serves HTTPS \
             (server.tls_cert_file), pass --ca FILE (env KERATIN_CA) with the CA that signed \
             its certificate"
                .into(),
        ));
    }
    let body = http_body(&response).map_err(|(status, message)| {
        let failure = fail(message);
        match status {
            401 => connect::with_login_hint(Failure {
                code: Some(401),
                ..failure
            }),
            _ => failure,
        }
    })?;
    if body.is_empty() {
        // 204: done, nothing to show.
        return Ok(Value::Null);
    }
    serde_json::from_slice(&body).map_err(|error| fail(format!("the body is not JSON: {error}")))
}

/// Write `request`, then read the response until the server closes (at most
/// [`RESPONSE_SIZE_BYTES_MAX`]). A TLS server that closes without `close_notify` after a
/// complete response is taken as a close: the response is whole (`Connection: close`).
fn exchange(mut stream: impl Read + Write, request: &str) -> std::io::Result<Vec<u8>> {
    stream.write_all(request.as_bytes())?;
    stream.flush()?;
    let mut response = Vec::new();
    match stream
        .take(RESPONSE_SIZE_BYTES_MAX)
        .read_to_end(&mut response)
    {
        Ok(_) => Ok(response),
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof && !response.is_empty() => {
            Ok(response)
        }
        Err(error) => Err(error),
    }
}

/// The name the admin port's certificate must carry: the host of `http` (an IP address is
/// checked as an IP).
fn tls_server_name(http: &str) -> Result<rustls::pki_types::ServerName<'static>, Failure> {
    let host = http
        .rsplit_once(':')
        .map_or(http, |(host, _)| host)
        .trim_start_matches('[')
        .trim_end_matches(']');
    rustls::pki_types::ServerName::try_from(host.to_owned())
        .map_err(|error| Failure::new(format!("TLS server name {host:?}: {error}")))
}

/// The body of a complete HTTP/1.1 response read until close, after checking for 2xx. For any
/// other status the error is the status (0 when there is none) and the status line with the
/// server's message (the `message` of a JSON error body, or the body's text).
fn http_body(response: &[u8]) -> Result<Vec<u8>, (u16, String)> {
    let split = response
        .windows(4)
        .position(|window| window == b"\r\n\r\n")
        .ok_or((0, "the response has no end of headers".to_owned()))?;
    let head = String::from_utf8_lossy(&response[..split]);
    let body = &response[split + 4..];
    let status_line = head.lines().next().unwrap_or_default();
    let status = status_line.split_whitespace().nth(1).unwrap_or_default();
    let chunked = head.lines().any(|line| {
        let line = line.to_ascii_lowercase();
        line.starts_with("transfer-encoding:") && line.contains("chunked")
    });
    let body = if chunked {
        dechunk(body).map_err(|message| (0, message))?
    } else {
        body.to_vec()
    };
    if !(status.len() == 3 && status.starts_with('2')) {
        let message = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_owned))
            .unwrap_or_else(|| String::from_utf8_lossy(&body).trim().to_owned());
        return Err((
            status.parse().unwrap_or(0),
            format!("{status_line}: {message}"),
        ));
    }
    Ok(body)
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
            (404, "HTTP/1.1 404 Not Found: no such page".to_owned())
        );
        let refused = b"HTTP/1.1 400 Bad Request\r\n\r\n{\"code\":400,\"message\":\"bad key\"}";
        assert_eq!(
            http_body(refused).unwrap_err(),
            (400, "HTTP/1.1 400 Bad Request: bad key".to_owned())
        );
    }
}
