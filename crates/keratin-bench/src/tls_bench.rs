//! The `tls` benchmark (issue 16): confirmed publish of 1 KiB messages over TLS against the
//! same over plain TCP, in the same run. Each run starts a node in process (real TCP on
//! 127.0.0.1, real storage directory, certificates made here by rcgen: a CA and an ECDSA P-256
//! certificate for 127.0.0.1), connects the Rust client (with `ClientTls` trusting the CA, or
//! without TLS), and keeps `in_flight` single-message confirmed publishes in flight for
//! `duration`. TLS and plain alternate (T P in even rounds, P T in odd ones); the ratio is the
//! median of the per-round ratios TLS / plain. Goal: at least 0.8.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use keratin_client::{Client, ClientOptions, ClientTls, QueueSettings};
use keratin_log::RealIo;
use serde_json::json;

use crate::broker_bench::{remove_and_settle, runtime};
use crate::contender::BenchResult;
use crate::net_bench::{node_config, publish_window, QUEUE};
use crate::report::{median, Report, Row};

/// TLS must keep this fraction of plaintext's confirmed publish rate (issue 16).
const TLS_GOAL: f64 = 0.8;

/// What `keratin-bench tls` runs.
#[derive(Debug, Clone)]
pub struct TlsBenchConfig {
    /// A directory of its own on the file system under test; the caller removes it.
    pub dir: std::path::PathBuf,
    /// Length of each publish run.
    pub duration: Duration,
    /// Rounds; TLS and plain alternate within them.
    pub rounds: usize,
    /// Body bytes of one message.
    pub body_bytes: usize,
    /// Most confirmed publishes in flight at once.
    pub in_flight: usize,
}

/// Files of the node's certificate and the CA that signed it.
struct Pki {
    ca: std::path::PathBuf,
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
}

fn make_pki(dir: &Path) -> BenchResult<Pki> {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
    std::fs::create_dir_all(dir)?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "keratin-bench CA");
    let ca = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string()])?.signed_by(&key, &ca)?;
    let pki = Pki {
        ca: dir.join("ca.pem"),
        cert: dir.join("node.pem"),
        key: dir.join("node.key"),
    };
    std::fs::write(&pki.ca, ca.pem())?;
    std::fs::write(&pki.cert, cert.pem())?;
    std::fs::write(&pki.key, key.serialize_pem())?;
    Ok(pki)
}

/// One run: confirmed publishes per second, over TLS when `pki` is given.
fn publish_run(config: &TlsBenchConfig, dir: &Path, pki: Option<&Pki>) -> BenchResult<f64> {
    let rt = runtime()?;
    let rate = rt.block_on(async {
        std::fs::create_dir_all(dir)?;
        let mut node_config = node_config(dir);
        let mut options = ClientOptions::default();
        if let Some(pki) = pki {
            node_config.server.tls_cert_file = Some(pki.cert.clone());
            node_config.server.tls_key_file = Some(pki.key.clone());
            options.tls = Some(ClientTls::from_ca_file(&pki.ca)?);
        }
        let node =
            keratin_server::Node::start_with_io(&node_config, Arc::new(RealIo::new())).await?;
        let client = Client::connect(node.protocol_addr(), options).await?;
        client.declare(QUEUE, QueueSettings::default()).await?;
        let body = Bytes::from(vec![0x5a_u8; config.body_bytes]);
        publish_window(&client, &body, config.in_flight, Duration::from_millis(100)).await?;
        let (confirmed, elapsed) =
            publish_window(&client, &body, config.in_flight, config.duration).await?;
        client.close().await;
        node.shutdown().await?;
        Ok::<_, crate::contender::BenchError>(confirmed as f64 / elapsed.as_secs_f64())
    })?;
    drop(rt);
    remove_and_settle(dir)?;
    Ok(rate)
}

/// Run the rounds and gather the report.
pub fn run(config: &TlsBenchConfig) -> BenchResult<Report> {
    let pki = make_pki(&config.dir.join("pki"))?;
    let (mut tls, mut plain, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..config.rounds {
        let tls_dir = config.dir.join(format!("tls-{round}"));
        let plain_dir = config.dir.join(format!("plain-{round}"));
        let (t, p) = if round % 2 == 0 {
            let t = publish_run(config, &tls_dir, Some(&pki))?;
            (t, publish_run(config, &plain_dir, None)?)
        } else {
            let p = publish_run(config, &plain_dir, None)?;
            (publish_run(config, &tls_dir, Some(&pki))?, p)
        };
        tls.push(t);
        plain.push(p);
        ratios.push(t / p.max(1e-9));
    }
    let mut report = Report::default();
    report.rows.push(Row {
        case: "confirmed publish, TLS / plain".into(),
        keratin: format!("{:.0} msg/s over TLS", median(&tls)),
        reference: format!("{:.0} msg/s plain", median(&plain)),
        ratio: median(&ratios),
        round_ratios: ratios.clone(),
        goal: Some(TLS_GOAL),
        note: format!(
            "{} B bodies, {} in flight, one connection; TLS 1.3, ECDSA P-256, ring",
            config.body_bytes, config.in_flight
        ),
    });
    report.json_cases.push(json!({
        "case": "tls_publish",
        "tls_msgs_per_s": tls,
        "plain_msgs_per_s": plain,
        "ratios": ratios,
    }));
    Ok(report)
}
