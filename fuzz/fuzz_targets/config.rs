//! The configuration file from arbitrary bytes (`keratin-server`): the text is written to a
//! file and loaded as `keratin serve --config FILE` loads it, with no environment and no flags.
//!
//! Properties, for any input:
//! - loading never panics: it gives a configuration or a `ConfigError`;
//! - a configuration that loads prints (`--print-config`) without panicking, and the printed
//!   text loads back as the same configuration, as `LoadedConfig::print` promises.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use keratin_server::config::{load, CliOverrides};
use libfuzzer_sys::fuzz_target;

/// A directory of this process for the file under test (fuzzing runs one input at a time).
fn scratch_dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("keratin-fuzz-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the scratch directory");
        dir
    })
}

fn load_file(name: &str, text: &[u8]) -> Result<keratin_server::config::LoadedConfig, String> {
    let path = scratch_dir().join(name);
    std::fs::write(&path, text).expect("write the scratch file");
    let cli = CliOverrides {
        config: Some(path),
        ..CliOverrides::default()
    };
    load(&cli, Vec::<(String, String)>::new()).map_err(|error| error.to_string())
}

fuzz_target!(|data: &[u8]| {
    let Ok(loaded) = load_file("input.toml", data) else {
        return;
    };
    let printed = loaded.print();
    let again = load_file("printed.toml", printed.as_bytes())
        .unwrap_or_else(|error| panic!("--print-config did not load back: {error}\n{printed}"));
    assert_eq!(
        again.config(),
        loaded.config(),
        "--print-config loaded back differently:\n{printed}"
    );
});
