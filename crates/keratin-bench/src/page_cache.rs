//! `PageCache`: dropping the kernel's page cache before a read, so that reads measure the disk
//! rather than memory. Only root can (`sync` then `echo 3 > /proc/sys/vm/drop_caches`); anyone
//! else reads from a warm cache, and the report says which it was.

use crate::contender::BenchResult;

const DROP_CACHES_PATH: &str = "/proc/sys/vm/drop_caches";

/// Whether reads start from a cold cache.
#[derive(Debug, Clone)]
pub struct PageCache {
    dropping: bool,
    why: String,
}

impl PageCache {
    /// Try once to drop the cache; if that works, every [`PageCache::drop_caches`] drops it.
    /// `allowed == false` never drops (a shared machine where that would hurt others).
    pub fn detect(allowed: bool) -> PageCache {
        if !allowed {
            return PageCache {
                dropping: false,
                why: "warm: dropping was turned off (--no-drop-caches)".into(),
            };
        }
        match drop_now() {
            Ok(()) => PageCache {
                dropping: true,
                why: format!("cold: `sync` + `echo 3 > {DROP_CACHES_PATH}` before each read"),
            },
            Err(error) => PageCache {
                dropping: false,
                why: format!("warm: could not drop the page cache ({error}); run as root"),
            },
        }
    }

    /// Whether reads start from a cold cache.
    pub fn dropping(&self) -> bool {
        self.dropping
    }

    /// One line for the report.
    pub fn describe(&self) -> &str {
        &self.why
    }

    /// Drop the cache if this process can; otherwise do nothing.
    pub fn drop_caches(&self) -> BenchResult<()> {
        if self.dropping {
            drop_now()?;
        }
        Ok(())
    }
}

fn drop_now() -> BenchResult<()> {
    // Dirty pages are not dropped: write them back first.
    rustix::fs::sync();
    std::fs::write(DROP_CACHES_PATH, "3")?;
    Ok(())
}
