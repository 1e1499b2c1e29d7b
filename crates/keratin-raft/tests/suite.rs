//! openraft's own storage test suite (`openraft::testing::log::Suite`) against [`LogStore`] and
//! [`RecordStateMachine`], each case on a fresh temporary directory and the real file system.
//! It fails if the store breaks a rule openraft's implementations share: log state, reads after
//! appends and purges, truncation, vote and committed persistence, key log ids at start, and
//! snapshot metadata (for the state machine).

use std::sync::Arc;

use keratin_log::{LogOptions, RealIo, MIN_SEGMENT_SIZE_BYTES};
use keratin_raft::{GroupLogs, LogStore, RecordStateMachine, TypeConfig};
use openraft::testing::log::{StoreBuilder, Suite};
use openraft::StorageError;

struct TempStores;

impl StoreBuilder<TypeConfig, LogStore, RecordStateMachine, tempfile::TempDir> for TempStores {
    async fn build(
        &self,
    ) -> Result<(tempfile::TempDir, LogStore, RecordStateMachine), StorageError<TypeConfig>> {
        let dir = tempfile::tempdir().expect("temporary directory");
        let options = LogOptions {
            full_segment_size_bytes: MIN_SEGMENT_SIZE_BYTES,
            ..LogOptions::default()
        };
        let logs = GroupLogs::open(Arc::new(RealIo::new()), dir.path(), options, None)
            .expect("open the group's logs");
        let store = logs.store().expect("store");
        Ok((dir, store, RecordStateMachine::new()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openraft_storage_suite() {
    Suite::test_all(TempStores).await.expect("openraft suite");
}
