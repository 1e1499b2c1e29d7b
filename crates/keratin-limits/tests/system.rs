//! Reading the system: memory limits from fake cgroup trees (v1, v2, nested, unlimited, mixed,
//! containers), resident memory from `statm`, and a real `statvfs`.
//!
//! Fails if a cgroup limit is missed (the kernel would kill the node before it rejects a
//! publish), if an unlimited value is taken as a limit, if an ancestor's smaller limit is
//! ignored, or if the samplers return nonsense on this machine.

use std::fs;
use std::path::{Path, PathBuf};

use keratin_limits::memory::{page_size_bytes, parse_statm_resident_bytes};
use keratin_limits::memory_limit::{cgroup_limit, read_physical_bytes, PHYSICAL_LIMIT_PERCENT};
use keratin_limits::{
    discover_limit, read_resident_bytes, sample_filesystem, LimitSource, LimitsError, MemoryLimit,
    SystemRoots,
};
use tempfile::TempDir;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
/// The fake machine has 16 GiB.
const PHYSICAL_BYTES: u64 = 16 * GIB;
/// How the kernel reports an unset v1 limit with 4 KiB pages.
const V1_UNLIMITED: &str = "9223372036854771712";

/// A fake `/proc` and `/sys/fs/cgroup` under a tempdir.
struct Tree {
    _dir: TempDir,
    roots: SystemRoots,
}

impl Tree {
    /// `self_cgroup` is the content of `/proc/self/cgroup`, `None` for no such file.
    fn new(self_cgroup: Option<&str>) -> Tree {
        let dir = tempfile::tempdir().expect("tempdir");
        let roots = SystemRoots {
            proc_dir: dir.path().join("proc"),
            cgroup_dir: dir.path().join("cgroup"),
        };
        let meminfo = format!(
            "MemTotal:       {} kB\nMemFree: 1 kB\n",
            PHYSICAL_BYTES / 1024
        );
        write(&roots.proc_dir.join("meminfo"), &meminfo);
        fs::create_dir_all(&roots.cgroup_dir).expect("cgroup dir");
        if let Some(self_cgroup) = self_cgroup {
            write(&roots.proc_dir.join("self/cgroup"), self_cgroup);
        }
        Tree { _dir: dir, roots }
    }

    /// Writes `content` to `relative` under the cgroup root, creating directories.
    fn cgroup(self, relative: &str, content: &str) -> Tree {
        write(&self.roots.cgroup_dir.join(relative), content);
        self
    }

    /// Marks `relative` as the root of a v2 mount.
    fn v2_mount(self, relative: &str) -> Tree {
        let file = if relative.is_empty() {
            "cgroup.controllers".to_string()
        } else {
            format!("{relative}/cgroup.controllers")
        };
        self.cgroup(&file, "cpu io memory pids\n")
    }

    fn path(&self, relative: &str) -> PathBuf {
        self.roots.cgroup_dir.join(relative)
    }

    fn limit(&self, configured_limit_bytes: u64) -> MemoryLimit {
        discover_limit(&self.roots, configured_limit_bytes).expect("limit discovered")
    }
}

fn write(path: &Path, content: &str) {
    fs::create_dir_all(path.parent().expect("has a parent")).expect("create dirs");
    fs::write(path, content).expect("write");
}

fn physical_fraction() -> MemoryLimit {
    MemoryLimit {
        limit_bytes: PHYSICAL_BYTES / 100 * PHYSICAL_LIMIT_PERCENT,
        source: LimitSource::PhysicalFraction,
    }
}

#[test]
fn v2_limit_of_the_process_cgroup() {
    let tree = Tree::new(Some("0::/system.slice/keratin.service\n"))
        .v2_mount("")
        .cgroup("system.slice/memory.max", "max\n")
        .cgroup("system.slice/keratin.service/memory.max", "1073741824\n");
    let path = tree.path("system.slice/keratin.service/memory.max");
    assert_eq!(
        tree.limit(0),
        MemoryLimit {
            limit_bytes: GIB,
            source: LimitSource::CgroupV2 { path }
        }
    );
}

#[test]
fn v1_limit_of_the_process_cgroup() {
    let self_cgroup = "12:memory:/keratin\n11:cpu,cpuacct:/keratin\n1:name=systemd:/\n";
    let tree = Tree::new(Some(self_cgroup))
        .cgroup("memory/memory.limit_in_bytes", V1_UNLIMITED)
        .cgroup("memory/keratin/memory.limit_in_bytes", "536870912\n");
    let path = tree.path("memory/keratin/memory.limit_in_bytes");
    let expected = MemoryLimit {
        limit_bytes: 512 * MIB,
        source: LimitSource::CgroupV1 { path },
    };
    assert_eq!(tree.limit(0), expected);
}

#[test]
fn v1_co_mounted_controllers() {
    let tree = Tree::new(Some("3:cpu,memory:/job\n"))
        .cgroup("cpu,memory/job/memory.limit_in_bytes", "1073741824");
    assert_eq!(tree.limit(0).limit_bytes, GIB);
}

#[test]
fn nested_cgroup_with_a_smaller_ancestor_limit() {
    let tree = Tree::new(Some("0::/a/b/c\n"))
        .v2_mount("")
        .cgroup("a/memory.max", "1073741824\n")
        .cgroup("a/b/memory.max", "268435456\n")
        .cgroup("a/b/c/memory.max", "max\n");
    let path = tree.path("a/b/memory.max");
    let expected = MemoryLimit {
        limit_bytes: 256 * MIB,
        source: LimitSource::CgroupV2 { path },
    };
    assert_eq!(tree.limit(0), expected);
}

#[test]
fn nested_v1_with_a_smaller_ancestor_limit() {
    let tree = Tree::new(Some("4:memory:/outer/inner\n"))
        .cgroup("memory/memory.limit_in_bytes", V1_UNLIMITED)
        .cgroup("memory/outer/memory.limit_in_bytes", "134217728")
        .cgroup("memory/outer/inner/memory.limit_in_bytes", V1_UNLIMITED);
    assert_eq!(tree.limit(0).limit_bytes, 128 * MIB);
}

#[test]
fn unlimited_cgroups_fall_back_to_the_physical_fraction() {
    let v2 = Tree::new(Some("0::/a\n"))
        .v2_mount("")
        .cgroup("a/memory.max", "max\n");
    assert_eq!(v2.limit(0), physical_fraction());
    let v1 =
        Tree::new(Some("4:memory:/a\n")).cgroup("memory/a/memory.limit_in_bytes", V1_UNLIMITED);
    assert_eq!(v1.limit(0), physical_fraction());
    // 64 KiB pages round i64::MAX down further; still unlimited.
    let v1_64k = Tree::new(Some("4:memory:/a\n"))
        .cgroup("memory/a/memory.limit_in_bytes", "9223372036854710272");
    assert_eq!(v1_64k.limit(0), physical_fraction());
    // Unlimited is decided by the value itself, not only by comparison with physical memory.
    for tree in [v2, v1, v1_64k] {
        assert_eq!(cgroup_limit(&tree.roots).expect("readable"), None);
    }
}

#[test]
fn a_cgroup_limit_above_physical_memory_is_ignored() {
    let tree = Tree::new(Some("0::/a\n"))
        .v2_mount("")
        .cgroup("a/memory.max", "34359738368\n");
    assert_eq!(tree.limit(0), physical_fraction());
}

#[test]
fn configured_limit_applies_only_when_smaller() {
    let tree = Tree::new(Some("0::/a\n"))
        .v2_mount("")
        .cgroup("a/memory.max", "1073741824\n");
    let configured = MemoryLimit {
        limit_bytes: 512 * MIB,
        source: LimitSource::Configured,
    };
    assert_eq!(tree.limit(512 * MIB), configured);
    assert_eq!(tree.limit(2 * GIB).limit_bytes, GIB);
    assert!(matches!(
        tree.limit(2 * GIB).source,
        LimitSource::CgroupV2 { .. }
    ));
}

#[test]
fn no_cgroup_gives_configured_or_physical_fraction() {
    let tree = Tree::new(None);
    assert_eq!(tree.limit(0), physical_fraction());
    let configured = MemoryLimit {
        limit_bytes: GIB,
        source: LimitSource::Configured,
    };
    assert_eq!(tree.limit(GIB), configured);
    // A configured limit above physical memory is the operator's word: it is kept.
    assert_eq!(tree.limit(64 * GIB).source, LimitSource::Configured);
}

#[test]
fn hybrid_takes_the_smaller_of_v1_and_v2() {
    let self_cgroup = "5:memory:/svc\n0::/svc\n";
    // The memory controller lives on v1; the unified hierarchy has no memory.max.
    let v1_only = Tree::new(Some(self_cgroup))
        .v2_mount("unified")
        .cgroup("unified/svc/cgroup.procs", "")
        .cgroup("memory/svc/memory.limit_in_bytes", "2147483648");
    assert_eq!(v1_only.limit(0).limit_bytes, 2 * GIB);
    // Both carry a limit: the smaller wins, whichever hierarchy it is on.
    let both = Tree::new(Some(self_cgroup))
        .v2_mount("unified")
        .cgroup("unified/svc/memory.max", "1073741824")
        .cgroup("memory/svc/memory.limit_in_bytes", "2147483648");
    assert_eq!(both.limit(0).limit_bytes, GIB);
    assert!(matches!(both.limit(0).source, LimitSource::CgroupV2 { .. }));
}

#[test]
fn container_without_cgroup_namespace_uses_the_mount_root() {
    // /proc/self/cgroup shows the host path, but the container's mount root is that cgroup.
    let tree = Tree::new(Some("4:memory:/docker/0123abcd\n"))
        .cgroup("memory/memory.limit_in_bytes", "1073741824");
    assert_eq!(tree.limit(0).limit_bytes, GIB);
}

#[test]
fn v2_root_without_memory_max_means_no_limit() {
    let tree = Tree::new(Some("0::/\n")).v2_mount("");
    assert_eq!(tree.limit(0), physical_fraction());
}

#[test]
fn garbage_in_a_limit_file_is_an_error_naming_the_file() {
    let tree = Tree::new(Some("0::/a\n"))
        .v2_mount("")
        .cgroup("a/memory.max", "lots\n");
    match discover_limit(&tree.roots, 0) {
        Err(LimitsError::Parse { path, .. }) => assert_eq!(path, tree.path("a/memory.max")),
        other => panic!("expected a parse error, got {other:?}"),
    }
    let tree = Tree::new(Some("not a cgroup line\n"));
    assert!(matches!(
        discover_limit(&tree.roots, 0),
        Err(LimitsError::Parse { .. })
    ));
}

#[test]
fn statm_resident_pages_times_page_size() {
    let tree = Tree::new(None);
    write(
        &tree.roots.proc_dir.join("self/statm"),
        "52000 1234 900 300 0 4000 0\n",
    );
    assert_eq!(
        read_resident_bytes(&tree.roots.proc_dir, 4096).expect("reads"),
        1234 * 4096
    );
    assert!(parse_statm_resident_bytes("", 4096).is_err());
    let missing = read_resident_bytes(&tree.roots.proc_dir.join("nowhere"), 4096);
    assert!(matches!(missing, Err(LimitsError::Read { .. })));
}

#[test]
fn this_process_has_sane_memory_numbers() {
    let host = SystemRoots::host();
    let physical_bytes = read_physical_bytes(&host.proc_dir).expect("meminfo");
    let resident_bytes = read_resident_bytes(&host.proc_dir, page_size_bytes()).expect("statm");
    assert!(
        resident_bytes > 0 && resident_bytes < physical_bytes,
        "{resident_bytes}"
    );
    let limit = discover_limit(&host, 0).expect("limit");
    assert!(
        limit.limit_bytes > 0 && limit.limit_bytes <= physical_bytes,
        "{limit:?}"
    );
}

#[test]
fn statvfs_of_root_is_sane() {
    let root = sample_filesystem(Path::new("/")).expect("statvfs /");
    assert!(root.total_bytes > 0);
    assert!(root.free_bytes <= root.total_bytes, "{root:?}");
    let dir = tempfile::tempdir().expect("tempdir");
    let again = sample_filesystem(dir.path()).expect("statvfs tempdir");
    assert!(again.free_bytes <= again.total_bytes, "{again:?}");
    let missing = sample_filesystem(&dir.path().join("missing"));
    assert!(matches!(missing, Err(LimitsError::Filesystem { .. })));
}
