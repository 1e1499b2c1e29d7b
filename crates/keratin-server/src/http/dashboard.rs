//! The web dashboard: static HTML, CSS and JavaScript compiled into the binary and served at
//! `/` (the page) and `/dashboard/{file}` (its assets). The page reads the JSON API itself
//! (`/api/v1/status`, `/queues`, `/attention`, `/settings`) every 2 s; nothing here renders data.
//!
//! The files live in `crates/keratin-server/dashboard/`. There is no build step and the page
//! loads nothing from other origins (the Content-Security-Policy below enforces it).

use axum::extract::Path;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use rust_embed::RustEmbed;

/// The dashboard's files, embedded at compile time.
#[derive(RustEmbed)]
#[folder = "dashboard/"]
struct Assets;

/// Only what the page's own files need: scripts, styles, images and fetches from this origin.
const CONTENT_SECURITY_POLICY: &str =
    "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'";

/// The dashboard's routes: `/` and `/dashboard/{file}`.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/", get(index))
        .route("/dashboard/{*file}", get(asset))
}

async fn index() -> Response {
    serve("index.html")
}

async fn asset(Path(file): Path<String>) -> Response {
    serve(&file)
}

/// One embedded file with its Content-Type; 404 for a name that is not one of them.
fn serve(file: &str) -> Response {
    let (Some(asset), Some(content_type)) = (Assets::get(file), content_type(file)) else {
        return (
            StatusCode::NOT_FOUND,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            format!("no dashboard file {file:?}; the dashboard is at /\n"),
        )
            .into_response();
    };
    (
        [
            (header::CONTENT_TYPE, content_type),
            // Small files from loopback or a LAN: always revalidate, so an upgraded broker
            // never runs with last version's script.
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        ],
        asset.data,
    )
        .into_response()
}

/// The Content-Type of a dashboard file, by extension; `None` for kinds the dashboard does not
/// ship (they are not served, even if embedded).
fn content_type(file: &str) -> Option<&'static str> {
    let extension = file.rsplit_once('.')?.1;
    Some(match extension {
        "html" => "text/html; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "js" => "text/javascript; charset=utf-8",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "ico" => "image/x-icon",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_embedded_file_has_a_content_type() {
        let files: Vec<String> = Assets::iter().map(|f| f.to_string()).collect();
        assert!(files.contains(&"index.html".to_string()), "{files:?}");
        for file in &files {
            assert!(content_type(file).is_some(), "{file} would not be served");
        }
    }

    #[test]
    fn unknown_files_are_404() {
        for file in ["missing.js", "../Cargo.toml", "index.html/x", ""] {
            assert_eq!(serve(file).status(), StatusCode::NOT_FOUND, "{file}");
        }
        assert_eq!(serve("index.html").status(), StatusCode::OK);
    }
}
