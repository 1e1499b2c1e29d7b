//! Consumer groups of one stream on a single node (`docs/streams.md`, "Reading"): readers that
//! subscribe with the same cursor and `group` share the stream's partitions. Each partition is
//! read by one member at a time; members get ranges of partitions in join order (range
//! assignment: with 5 partitions and 2 members, 0–2 and 3–4; members beyond the partitions get
//! none, as in Kafka).
//!
//! A handover is two steps so that two members never read a partition at once: the member
//! losing a partition commits what it sent (when it commits automatically), ends it and
//! [`GroupMember::release`]s it; only then can the member it is assigned to
//! [`GroupMember::acquire`] it and read from the cursor's committed position. A member that
//! goes (its reader ends, its connection closes) releases everything it held when dropped.
//! Every change wakes every member of the group, which then compares what it holds with what
//! it is assigned.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

use crate::error::{BrokerError, BrokerResult};

/// Most members of one group: far more than partitions (at most 64), and it bounds the table.
pub const GROUP_MEMBERS_MAX: usize = 1024;

/// The groups of one stream, by cursor name.
#[derive(Debug, Clone)]
pub struct Groups {
    inner: Arc<Mutex<BTreeMap<String, Group>>>,
    partitions: u32,
}

#[derive(Debug, Default)]
struct Group {
    next_member: u64,
    /// In join order.
    members: Vec<Slot>,
    /// Partition → the member reading it.
    holders: BTreeMap<u32, u64>,
}

#[derive(Debug)]
struct Slot {
    id: u64,
    changed: watch::Sender<u64>,
}

impl Group {
    /// Wakes every member: something changed (a join, a leave, a release).
    fn wake_all(&self) {
        for slot in &self.members {
            slot.changed.send_modify(|n| *n += 1);
        }
    }
}

/// What a group looks like now: its members in join order with what each holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupInfo {
    /// The cursor the group reads with.
    pub cursor: String,
    /// Member id → the partitions it reads now, in join order.
    pub members: Vec<(u64, Vec<u32>)>,
}

impl Groups {
    /// The groups of a stream of `partitions` partitions.
    pub fn new(partitions: u32) -> Groups {
        Groups {
            inner: Arc::new(Mutex::new(BTreeMap::new())),
            partitions,
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Group>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Joins the group of `cursor` as its newest member (the others are woken to give up
    /// what the new assignment takes from them).
    pub fn join(&self, cursor: &str) -> BrokerResult<GroupMember> {
        let mut groups = self.lock();
        let group = groups.entry(cursor.to_string()).or_default();
        if group.members.len() >= GROUP_MEMBERS_MAX {
            return Err(BrokerError::Invalid(format!(
                "the group of cursor {cursor:?} has {GROUP_MEMBERS_MAX} members, the most \
                 allowed; a member beyond the stream's partitions reads nothing"
            )));
        }
        let id = group.next_member;
        group.next_member += 1;
        let (changed, watched) = watch::channel(0);
        group.wake_all();
        group.members.push(Slot { id, changed });
        Ok(GroupMember {
            groups: self.clone(),
            cursor: cursor.to_string(),
            id,
            changed: watched,
        })
    }

    /// The member reading `partition` for `cursor`'s group, if any.
    pub fn holder(&self, cursor: &str, partition: u32) -> Option<u64> {
        self.lock()
            .get(cursor)
            .and_then(|g| g.holders.get(&partition).copied())
    }

    /// Every group with its members and what they hold.
    pub fn info(&self) -> Vec<GroupInfo> {
        self.lock()
            .iter()
            .map(|(cursor, group)| GroupInfo {
                cursor: cursor.clone(),
                members: group
                    .members
                    .iter()
                    .map(|slot| {
                        let held = group
                            .holders
                            .iter()
                            .filter(|(_, &holder)| holder == slot.id)
                            .map(|(&p, _)| p)
                            .collect();
                        (slot.id, held)
                    })
                    .collect(),
            })
            .collect()
    }
}

/// The partitions member `index` of `members` is assigned out of `partitions`: consecutive
/// ranges in join order, the first `partitions % members` one longer.
pub fn range_assignment(partitions: u32, members: usize, index: usize) -> Range<u32> {
    if members == 0 || index >= members {
        return 0..0;
    }
    let (members, index) = (members as u64, index as u64);
    let (each, extra) = (
        u64::from(partitions) / members,
        u64::from(partitions) % members,
    );
    let start = index * each + index.min(extra);
    let len = each + u64::from(index < extra);
    // Within `partitions`, so the casts back cannot truncate.
    start as u32..(start + len) as u32
}

/// One member of a group; leaving (dropping it) releases what it held and wakes the others.
#[derive(Debug)]
pub struct GroupMember {
    groups: Groups,
    cursor: String,
    id: u64,
    changed: watch::Receiver<u64>,
}

impl GroupMember {
    /// Its id within the group (unique for the stream's life on this node).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The cursor its group reads with.
    pub fn cursor(&self) -> &str {
        &self.cursor
    }

    /// The partitions the group assigns it now (it may not hold them all yet).
    pub fn assigned(&self) -> Vec<u32> {
        let groups = self.groups.lock();
        let Some(group) = groups.get(&self.cursor) else {
            return Vec::new();
        };
        let index = group.members.iter().position(|slot| slot.id == self.id);
        index.map_or_else(Vec::new, |index| {
            range_assignment(self.groups.partitions, group.members.len(), index).collect()
        })
    }

    /// Takes `partition` to read it: true when it is assigned to this member and no other
    /// member holds it (the one that had it released it).
    pub fn acquire(&self, partition: u32) -> bool {
        let mut groups = self.groups.lock();
        let Some(group) = groups.get_mut(&self.cursor) else {
            return false;
        };
        let Some(index) = group.members.iter().position(|slot| slot.id == self.id) else {
            return false;
        };
        if !range_assignment(self.groups.partitions, group.members.len(), index)
            .contains(&partition)
        {
            return false;
        }
        match group.holders.get(&partition) {
            Some(&holder) => holder == self.id,
            None => {
                group.holders.insert(partition, self.id);
                true
            }
        }
    }

    /// Gives `partition` up (after its last commit): the member it is assigned to takes it.
    pub fn release(&self, partition: u32) {
        let mut groups = self.groups.lock();
        if let Some(group) = groups.get_mut(&self.cursor) {
            if group.holders.get(&partition) == Some(&self.id) {
                group.holders.remove(&partition);
                group.wake_all();
            }
        }
    }

    /// Waits until something in the group changed since the last [`Self::seen`] (it does not
    /// mark the change seen).
    pub async fn changed(&self) {
        let mut changed = self.changed.clone();
        // The sender lives in the group as long as this member does: it cannot close first.
        if changed.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Whether something changed since the last [`Self::seen`].
    pub fn has_changed(&self) -> bool {
        self.changed.has_changed().unwrap_or(false)
    }

    /// Marks the changes so far as seen (call before comparing what it holds with
    /// [`Self::assigned`], so a change during the comparison wakes it again).
    pub fn seen(&mut self) {
        self.changed.borrow_and_update();
    }
}

impl Drop for GroupMember {
    fn drop(&mut self) {
        let mut groups = self.groups.lock();
        let Some(group) = groups.get_mut(&self.cursor) else {
            return;
        };
        group.members.retain(|slot| slot.id != self.id);
        group.holders.retain(|_, holder| *holder != self.id);
        if group.members.is_empty() {
            groups.remove(&self.cursor);
        } else {
            group.wake_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_every_partition_once_in_join_order() {
        for partitions in 0..=64u32 {
            for members in 1..=70usize {
                let mut covered = Vec::new();
                for index in 0..members {
                    let range = range_assignment(partitions, members, index);
                    assert!(range.len() as u32 <= partitions / members as u32 + 1);
                    covered.extend(range);
                }
                assert_eq!(covered, (0..partitions).collect::<Vec<_>>());
            }
        }
        assert_eq!(range_assignment(5, 2, 0), 0..3);
        assert_eq!(range_assignment(5, 2, 1), 3..5);
        assert_eq!(
            range_assignment(2, 3, 2),
            2..2,
            "beyond the partitions: none"
        );
    }

    #[test]
    fn a_partition_goes_to_its_new_member_only_once_released() {
        let groups = Groups::new(4);
        let mut a = groups.join("c").expect("join");
        assert_eq!(a.assigned(), vec![0, 1, 2, 3]);
        for p in 0..4 {
            assert!(a.acquire(p));
        }
        a.seen();
        let b = groups.join("c").expect("join");
        assert!(a.has_changed(), "the older member is woken by a join");
        assert_eq!(a.assigned(), vec![0, 1]);
        assert_eq!(b.assigned(), vec![2, 3]);
        assert!(!b.acquire(2), "still read by a");
        assert!(!a.acquire(3) || groups.holder("c", 3) == Some(a.id()));
        a.release(2);
        assert!(b.acquire(2));
        assert!(!a.acquire(2), "not a's any more");
        assert_eq!(groups.holder("c", 2), Some(b.id()));
        assert_eq!(groups.holder("c", 3), Some(a.id()));
        assert_eq!(
            groups.info(),
            vec![GroupInfo {
                cursor: "c".into(),
                members: vec![(a.id(), vec![0, 1, 3]), (b.id(), vec![2])],
            }]
        );
        // a leaves: everything it held is free, and b is assigned all of it.
        let b_id = b.id();
        drop(a);
        assert_eq!(b.assigned(), vec![0, 1, 2, 3]);
        for p in 0..4 {
            assert!(b.acquire(p));
        }
        assert_eq!(groups.holder("c", 0), Some(b_id));
        drop(b);
        assert!(groups.info().is_empty(), "an empty group is forgotten");
    }

    #[test]
    fn groups_of_different_cursors_are_independent() {
        let groups = Groups::new(2);
        let a = groups.join("x").expect("join");
        let b = groups.join("y").expect("join");
        assert!(a.acquire(0) && a.acquire(1));
        assert!(b.acquire(0) && b.acquire(1));
    }
}
