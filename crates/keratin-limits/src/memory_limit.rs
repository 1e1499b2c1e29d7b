//! `MemoryLimit`: discovering the memory limit the node must stay under, and where it came from.
//!
//! The limit is the smallest of: every memory cgroup limit on the process's cgroup and its
//! ancestors (v2 `memory.max`, v1 `memory.limit_in_bytes`, both hierarchies checked on hybrid
//! systems), and the configured `limit_bytes`. With neither, it is 60% of physical memory.
//!
//! Every function takes the proc and cgroup roots as [`SystemRoots`], so tests run against fake
//! trees. Reading resident memory and the levels belong to [`crate::memory`].

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::LimitsError;

/// The share of physical memory used as the limit when there is neither a cgroup limit nor a
/// configured one: the rest is left to the page cache, which the log's reads depend on, and to
/// other processes on the machine.
pub const PHYSICAL_LIMIT_PERCENT: u64 = 60;

/// Cgroup limits at or above this mean "unlimited". The kernel reports an unset v1 limit as
/// `PAGE_COUNTER_MAX × page size`, i.e. `i64::MAX` rounded down to a page (9223372036854771712
/// with 4 KiB pages, a little less with 64 KiB pages); 4 EiB is below every such value and above
/// any real machine.
pub const CGROUP_UNLIMITED_BYTES_MIN: u64 = 1 << 62;

/// Where the proc and cgroup filesystems are mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemRoots {
    /// Usually `/proc`.
    pub proc_dir: PathBuf,
    /// Usually `/sys/fs/cgroup` (the v2 mount, or the directory of v1 controller mounts).
    pub cgroup_dir: PathBuf,
}

impl SystemRoots {
    /// The host's roots: `/proc` and `/sys/fs/cgroup`.
    pub fn host() -> SystemRoots {
        SystemRoots {
            proc_dir: PathBuf::from("/proc"),
            cgroup_dir: PathBuf::from("/sys/fs/cgroup"),
        }
    }
}

/// Where the memory limit came from, for status output and log messages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LimitSource {
    /// A cgroup v2 `memory.max` file (the smallest on the path to the root).
    CgroupV2 {
        /// The limit file.
        path: PathBuf,
    },
    /// A cgroup v1 `memory.limit_in_bytes` file (the smallest on the path to the root).
    CgroupV1 {
        /// The limit file.
        path: PathBuf,
    },
    /// `limits.memory.limit_bytes`.
    Configured,
    /// [`PHYSICAL_LIMIT_PERCENT`] of `MemTotal`.
    PhysicalFraction,
}

impl LimitSource {
    /// The stable name used in status output: `cgroup_v2`, `cgroup_v1`, `configured`,
    /// `physical_fraction`.
    pub fn as_str(&self) -> &'static str {
        match self {
            LimitSource::CgroupV2 { .. } => "cgroup_v2",
            LimitSource::CgroupV1 { .. } => "cgroup_v1",
            LimitSource::Configured => "configured",
            LimitSource::PhysicalFraction => "physical_fraction",
        }
    }
}

/// The memory limit and its source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryLimit {
    /// The limit resident memory is compared with.
    pub limit_bytes: u64,
    /// Where it came from.
    pub source: LimitSource,
}

/// Discovers the limit: the smallest cgroup limit up the hierarchy, then `configured_limit_bytes`
/// (0 = none) if strictly smaller; with neither, [`PHYSICAL_LIMIT_PERCENT`] of physical memory.
///
/// A cgroup limit at or above physical memory is ignored: the machine runs out before the cgroup
/// does, so the physical fraction protects the node better.
pub fn discover_limit(
    roots: &SystemRoots,
    configured_limit_bytes: u64,
) -> Result<MemoryLimit, LimitsError> {
    let physical_bytes = read_physical_bytes(&roots.proc_dir)?;
    let cgroup = cgroup_limit(roots)?.filter(|limit| limit.limit_bytes < physical_bytes);
    let configured = (configured_limit_bytes > 0).then_some(MemoryLimit {
        limit_bytes: configured_limit_bytes,
        source: LimitSource::Configured,
    });
    Ok(match (cgroup, configured) {
        (Some(cgroup), Some(configured)) if configured.limit_bytes < cgroup.limit_bytes => {
            configured
        }
        (Some(cgroup), _) => cgroup,
        (None, Some(configured)) => configured,
        (None, None) => MemoryLimit {
            limit_bytes: physical_bytes / 100 * PHYSICAL_LIMIT_PERCENT,
            source: LimitSource::PhysicalFraction,
        },
    })
}

/// Physical memory: `MemTotal` from `<proc_dir>/meminfo`.
pub fn read_physical_bytes(proc_dir: &Path) -> Result<u64, LimitsError> {
    let path = proc_dir.join("meminfo");
    let text = read_text(&path)?;
    parse_meminfo_total(&text).map_err(|reason| LimitsError::Parse { path, reason })
}

fn parse_meminfo_total(text: &str) -> Result<u64, String> {
    let line = text
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .ok_or("no MemTotal line")?;
    let kib = line
        .trim()
        .strip_suffix("kB")
        .and_then(|kib| kib.trim().parse::<u64>().ok())
        .ok_or_else(|| format!("MemTotal is not '<number> kB': {:?}", line.trim()))?;
    kib.checked_mul(1024)
        .ok_or_else(|| format!("MemTotal {kib} kB overflows"))
}

/// The smallest memory cgroup limit that applies to this process, or `None` when there is no
/// memory cgroup (no `<proc_dir>/self/cgroup`, no memory controller) or every limit is unlimited.
pub fn cgroup_limit(roots: &SystemRoots) -> Result<Option<MemoryLimit>, LimitsError> {
    let path = roots.proc_dir.join("self").join("cgroup");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(LimitsError::Read { path, source }),
    };
    let mut smallest: Option<MemoryLimit> = None;
    for (index, line) in text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
    {
        let membership = parse_cgroup_line(line).ok_or_else(|| LimitsError::Parse {
            path: path.clone(),
            reason: format!(
                "line {}: expected 'id:controllers:path', got {line:?}",
                index + 1
            ),
        })?;
        let Some(hierarchy) = Hierarchy::of(&membership) else {
            continue;
        };
        if let Some(limit) = hierarchy.smallest_limit(&roots.cgroup_dir, membership.path)? {
            if smallest
                .as_ref()
                .is_none_or(|smallest| limit.limit_bytes < smallest.limit_bytes)
            {
                smallest = Some(limit);
            }
        }
    }
    Ok(smallest)
}

/// One line of `/proc/self/cgroup`: `hierarchy-id:controller-list:path`.
struct Membership<'a> {
    hierarchy_id: &'a str,
    controllers: &'a str,
    path: &'a str,
}

fn parse_cgroup_line(line: &str) -> Option<Membership<'_>> {
    let mut parts = line.splitn(3, ':');
    let hierarchy_id = parts.next()?;
    let controllers = parts.next()?;
    let path = parts.next()?;
    path.starts_with('/').then_some(Membership {
        hierarchy_id,
        controllers,
        path,
    })
}

/// A cgroup hierarchy that can hold a memory limit.
enum Hierarchy {
    /// The unified hierarchy (`0::/path`).
    V2,
    /// A v1 hierarchy whose controller list includes `memory`; the list names its mount
    /// directory when controllers are co-mounted (`memory,cpu`).
    V1 { controllers: String },
}

impl Hierarchy {
    fn of(membership: &Membership<'_>) -> Option<Hierarchy> {
        if membership.hierarchy_id == "0" && membership.controllers.is_empty() {
            Some(Hierarchy::V2)
        } else if membership
            .controllers
            .split(',')
            .any(|controller| controller == "memory")
        {
            Some(Hierarchy::V1 {
                controllers: membership.controllers.to_string(),
            })
        } else {
            None
        }
    }

    fn limit_file_name(&self) -> &'static str {
        match self {
            Hierarchy::V2 => "memory.max",
            Hierarchy::V1 { .. } => "memory.limit_in_bytes",
        }
    }

    /// Where this hierarchy is mounted under the cgroup root, if anywhere.
    fn mount(&self, cgroup_dir: &Path) -> Option<PathBuf> {
        match self {
            // Pure v2 mounts at the root; hybrid systems mount it at `unified` and keep v1
            // controller mounts at the root. Only a v2 mount has `cgroup.controllers`.
            Hierarchy::V2 => [cgroup_dir.to_path_buf(), cgroup_dir.join("unified")]
                .into_iter()
                .find(|dir| dir.join("cgroup.controllers").is_file()),
            // `memory` is usually a directory or a symlink to the co-mounted `cpu,memory`.
            Hierarchy::V1 { controllers } => {
                [cgroup_dir.join("memory"), cgroup_dir.join(controllers)]
                    .into_iter()
                    .find(|dir| dir.is_dir())
            }
        }
    }

    /// The smallest limit on the process's cgroup and every ancestor up to the mount root.
    fn smallest_limit(
        &self,
        cgroup_dir: &Path,
        process_path: &str,
    ) -> Result<Option<MemoryLimit>, LimitsError> {
        let Some(mount) = self.mount(cgroup_dir) else {
            return Ok(None);
        };
        let mut smallest: Option<MemoryLimit> = None;
        let mut dir = process_dir(&mount, process_path);
        loop {
            let file = dir.join(self.limit_file_name());
            if let Some(limit_bytes) = read_limit(&file)? {
                if smallest
                    .as_ref()
                    .is_none_or(|smallest| limit_bytes < smallest.limit_bytes)
                {
                    smallest = Some(MemoryLimit {
                        limit_bytes,
                        source: self.source(file),
                    });
                }
            }
            if dir == mount || !dir.pop() {
                break;
            }
        }
        Ok(smallest)
    }

    fn source(&self, path: PathBuf) -> LimitSource {
        match self {
            Hierarchy::V2 => LimitSource::CgroupV2 { path },
            Hierarchy::V1 { .. } => LimitSource::CgroupV1 { path },
        }
    }
}

/// The process's cgroup directory under `mount`.
///
/// Normally `mount/<path>`. Inside a container without a cgroup namespace, `/proc/self/cgroup`
/// shows the host path (`/docker/<id>`) while the mount's root *is* that cgroup, so the full path
/// does not exist: leading components are dropped until a directory exists, ending at the mount
/// itself. Walking up from there still stops at the mount, the highest cgroup we can see.
fn process_dir(mount: &Path, process_path: &str) -> PathBuf {
    let components: Vec<&str> = process_path
        .split('/')
        .filter(|part| !part.is_empty() && *part != "..")
        .collect();
    (0..components.len())
        .map(|skip| {
            components[skip..]
                .iter()
                .fold(mount.to_path_buf(), |dir, part| dir.join(part))
        })
        .find(|dir| dir.is_dir())
        .unwrap_or_else(|| mount.to_path_buf())
}

/// A limit file's value; `None` when the file is absent (the v2 root has none, nor does a
/// hierarchy without the memory controller enabled) or the value means unlimited.
fn read_limit(path: &Path) -> Result<Option<u64>, LimitsError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(LimitsError::Read {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let value = text.trim();
    if value == "max" {
        return Ok(None);
    }
    let limit_bytes = value.parse::<u64>().map_err(|_| LimitsError::Parse {
        path: path.to_path_buf(),
        reason: format!("expected a byte count or 'max', got {value:?}"),
    })?;
    Ok((limit_bytes < CGROUP_UNLIMITED_BYTES_MIN).then_some(limit_bytes))
}

fn read_text(path: &Path) -> Result<String, LimitsError> {
    std::fs::read_to_string(path).map_err(|source| LimitsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_total_is_parsed_in_kib() {
        let text = "MemFree: 10 kB\nMemTotal:       16318460 kB\n";
        assert_eq!(parse_meminfo_total(text), Ok(16318460 * 1024));
        assert!(parse_meminfo_total("MemFree: 10 kB\n").is_err());
        assert!(parse_meminfo_total("MemTotal: lots\n").is_err());
    }

    #[test]
    fn cgroup_lines_are_split_on_the_first_two_colons() {
        let line = parse_cgroup_line("4:memory:/a:b").expect("parses");
        assert_eq!(
            (line.hierarchy_id, line.controllers, line.path),
            ("4", "memory", "/a:b")
        );
        assert!(parse_cgroup_line("garbage").is_none());
        assert!(Hierarchy::of(&parse_cgroup_line("5:cpu,cpuacct:/").expect("parses")).is_none());
    }
}
