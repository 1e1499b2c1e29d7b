//! `Claims`: which queue names have a declare, delete or settings change in flight, and what the
//! declares in flight will take from the node's bounds.
//!
//! The metadata operations of a node take no lock across disk I/O: each claims its queue name
//! under a short lock, writes its record and opens or removes logs with no lock held, then
//! publishes its outcome and gives the claim back. A second operation on the same name waits
//! for the first (so two declares of one name agree, and a delete that races a declare deletes
//! what the declare made); operations on different names run side by side, and their metadata
//! records share the log's group commit. The catalog, the claims and the reservations are read
//! and changed under one `std` mutex that is never held across an `await` or a disk call.

use std::collections::BTreeMap;

use tokio::sync::watch;

/// Names being changed, and the reservations of declares in flight.
#[derive(Debug, Default)]
pub(crate) struct Claims {
    /// A name's claim; dropping the sender wakes every operation waiting for that name.
    busy: BTreeMap<String, watch::Sender<()>>,
    /// Queues that declares in flight will add.
    pub(crate) reserved_queues: u64,
    /// Partitions that declares in flight will add.
    pub(crate) reserved_partitions: u64,
}

/// What claiming a name gave.
#[derive(Debug)]
pub(crate) enum Claim {
    /// The name is ours until [`Claims::release`].
    Taken,
    /// Another operation holds it: wait for this to change (it errors when the claim goes),
    /// then try again.
    Wait(watch::Receiver<()>),
}

impl Claims {
    /// Claim `name` for one operation.
    pub(crate) fn claim(&mut self, name: &str) -> Claim {
        if let Some(holder) = self.busy.get(name) {
            return Claim::Wait(holder.subscribe());
        }
        let (sender, _) = watch::channel(());
        self.busy.insert(name.to_string(), sender);
        Claim::Taken
    }

    /// Give a claim back: operations waiting for the name try again.
    pub(crate) fn release(&mut self, name: &str) {
        let released = self.busy.remove(name);
        assert!(released.is_some(), "released a claim never taken: {name:?}");
    }

    /// Reserve a declare's queue and partitions against the node's bounds.
    pub(crate) fn reserve(&mut self, partitions: u32) {
        self.reserved_queues += 1;
        self.reserved_partitions += u64::from(partitions);
    }

    /// Drop a reservation: the declare applied its record (then the catalog counts it) or
    /// failed.
    pub(crate) fn unreserve(&mut self, partitions: u32) {
        assert!(
            self.reserved_queues >= 1,
            "unreserved more queues than reserved"
        );
        assert!(
            self.reserved_partitions >= u64::from(partitions),
            "unreserved more partitions than reserved"
        );
        self.reserved_queues -= 1;
        self.reserved_partitions -= u64::from(partitions);
    }

    /// Names with an operation in flight.
    pub(crate) fn busy_count(&self) -> usize {
        self.busy.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_second_claim_waits_until_the_first_is_released() {
        let mut claims = Claims::default();
        assert!(matches!(claims.claim("a"), Claim::Taken));
        assert!(matches!(claims.claim("b"), Claim::Taken));
        let Claim::Wait(mut waiting) = claims.claim("a") else {
            panic!("a is claimed");
        };
        claims.release("a");
        assert!(
            waiting.changed().await.is_err(),
            "the release wakes the waiter"
        );
        assert!(matches!(claims.claim("a"), Claim::Taken));
        assert_eq!(claims.busy_count(), 2);
    }

    #[test]
    fn reservations_add_up_and_come_back() {
        let mut claims = Claims::default();
        claims.reserve(3);
        claims.reserve(1);
        assert_eq!((claims.reserved_queues, claims.reserved_partitions), (2, 4));
        claims.unreserve(3);
        claims.unreserve(1);
        assert_eq!((claims.reserved_queues, claims.reserved_partitions), (0, 0));
    }
}
