//! `docs/openapi.yaml` against the admin router: the file parses as YAML, is OpenAPI 3, documents
//! every route in [`ROUTES`] and nothing else, its `$ref`s resolve, and every route the router's
//! source declares (`.route("...")` in `src/http/`) is in [`ROUTES`] — so a new route without
//! documentation fails here.

use std::path::Path;

use yaml_rust2::{Yaml, YamlLoader};

/// Every route of the HTTP admin port, as OpenAPI writes it (`{*file}` becomes `{file}`).
/// `GET/PUT /api/v1/settings` come with the runtime settings; they are documented here
/// whether or not this build's router has them yet.
const ROUTES: &[(&str, &str)] = &[
    ("get", "/health"),
    ("get", "/metrics"),
    ("get", "/api/v1/status"),
    ("get", "/api/v1/cluster"),
    ("post", "/api/v1/cluster/nodes"),
    ("post", "/api/v1/cluster/nodes/{id}/remove"),
    ("post", "/api/v1/cluster/rebalance"),
    ("get", "/api/v1/attention"),
    ("get", "/api/v1/audit"),
    ("get", "/api/v1/queues"),
    ("get", "/api/v1/queues/{name}"),
    ("put", "/api/v1/queues/{name}/settings"),
    ("post", "/api/v1/queues/{name}/partitions/{index}/move"),
    ("get", "/api/v1/streams"),
    ("get", "/api/v1/streams/{name}"),
    ("get", "/api/v1/settings"),
    ("put", "/api/v1/settings"),
    ("post", "/api/v1/login"),
    ("post", "/api/v1/logout"),
    ("get", "/api/v1/whoami"),
    ("get", "/api/v1/users"),
    ("post", "/api/v1/users"),
    ("get", "/api/v1/users/{user}"),
    ("delete", "/api/v1/users/{user}"),
    ("put", "/api/v1/users/{user}/password"),
    ("put", "/api/v1/users/{user}/admin"),
    ("post", "/api/v1/users/{user}/grant"),
    ("post", "/api/v1/users/{user}/revoke"),
    ("put", "/api/v1/users/{user}/quota"),
    ("post", "/api/v1/users/{user}/tokens"),
    ("delete", "/api/v1/users/{user}/tokens/{token}"),
    ("get", "/"),
    ("get", "/dashboard/{file}"),
];

/// HTTP methods an OpenAPI path item may hold.
const METHODS: &[&str] = &[
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn load_openapi() -> Yaml {
    let path = manifest_dir().join("../../docs/openapi.yaml");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let mut documents = YamlLoader::load_from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", path.display()));
    assert_eq!(documents.len(), 1, "one YAML document");
    documents.remove(0)
}

fn text(yaml: &Yaml) -> String {
    yaml.as_str().map(str::to_string).unwrap_or_default()
}

#[test]
fn openapi_documents_every_route_and_nothing_else() {
    let doc = load_openapi();
    assert!(
        text(&doc["openapi"]).starts_with("3."),
        "OpenAPI 3.x: {:?}",
        doc["openapi"]
    );
    assert!(!text(&doc["info"]["title"]).is_empty(), "info.title");
    let paths = doc["paths"].as_hash().expect("paths is a mapping");

    for (method, path) in ROUTES {
        let operation = &doc["paths"][*path][*method];
        assert!(
            operation.as_hash().is_some(),
            "{} {path} is not documented",
            method.to_uppercase()
        );
        let responses = operation["responses"].as_hash();
        assert!(
            responses.is_some_and(|r| !r.is_empty()),
            "{} {path} documents no responses",
            method.to_uppercase()
        );
        assert!(
            !text(&operation["summary"]).is_empty(),
            "{} {path} has no summary",
            method.to_uppercase()
        );
    }

    for (path, item) in paths {
        let path = text(path);
        let item = item.as_hash().expect("path item is a mapping");
        for key in item.keys() {
            let key = text(key);
            if METHODS.contains(&key.as_str()) {
                assert!(
                    ROUTES.contains(&(key.as_str(), path.as_str())),
                    "{} {path} is documented but is not a route",
                    key.to_uppercase()
                );
            }
        }
    }
}

/// Every `$ref` in `yaml`, depth first.
fn collect_refs(yaml: &Yaml, refs: &mut Vec<String>) {
    match yaml {
        Yaml::Hash(hash) => {
            for (key, value) in hash {
                if key.as_str() == Some("$ref") {
                    refs.push(text(value));
                } else {
                    collect_refs(value, refs);
                }
            }
        }
        Yaml::Array(items) => items.iter().for_each(|item| collect_refs(item, refs)),
        _ => {}
    }
}

#[test]
fn openapi_references_resolve() {
    let doc = load_openapi();
    let mut refs = Vec::new();
    collect_refs(&doc, &mut refs);
    assert!(!refs.is_empty(), "the file uses components");
    for reference in refs {
        let pointer = reference
            .strip_prefix("#/")
            .unwrap_or_else(|| panic!("only local references: {reference}"));
        let target = pointer
            .split('/')
            .fold(&doc, |node, segment| &node[segment]);
        assert!(
            target.as_hash().is_some(),
            "{reference} does not resolve to a mapping"
        );
    }
}

/// The paths of `.route("...")` calls in a Rust source file.
fn declared_routes(source: &str) -> Vec<String> {
    source
        .split(".route(")
        .skip(1)
        .filter_map(|rest| {
            let rest = rest.trim_start().strip_prefix('"')?;
            Some(rest[..rest.find('"')?].replace("{*", "{"))
        })
        .collect()
}

#[test]
fn every_route_of_the_router_is_listed() {
    let dir = manifest_dir().join("src/http");
    let mut declared = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("read src/http") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "rs") {
            let source = std::fs::read_to_string(&path).expect("read source");
            declared.extend(declared_routes(&source));
        }
    }
    for must in [
        "/health",
        "/api/v1/queues/{name}/settings",
        "/",
        "/dashboard/{file}",
    ] {
        assert!(
            declared.iter().any(|d| d == must),
            "the scan of src/http finds {must}: {declared:?}"
        );
    }
    for route in &declared {
        assert!(
            ROUTES.iter().any(|(_, path)| path == route),
            "the router serves {route} but ROUTES (and so docs/openapi.yaml) lacks it"
        );
    }
}
