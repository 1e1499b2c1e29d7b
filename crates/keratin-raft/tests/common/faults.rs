//! Network faults with exact timing, on the receiving side of a node: [`FaultyGroups`] wraps
//! the node's `Groups` handler and applies, per sending node, the [`Rule`] a test set, to every
//! request and to every coalesced heartbeat. A test cuts one direction of one link (the node
//! stops hearing a peer), lets a follower take only part of an append, or acknowledges a
//! leader's heartbeats without its `Raft` hearing them (the leader keeps its quorum lease while
//! the follower's own lease on the leader runs out), so that a sequence of leadership changes
//! happens in the order the test needs, on real transports.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use keratin_net::handler::BoxFuture;
use keratin_net::{GroupId, Handler, NodeId, RemoteError};
use keratin_raft::network::rpc::{self, KIND_APPEND};
use keratin_raft::network::Groups;
use keratin_raft::{Entry, Payload};
use openraft::raft::AppendEntriesResponse;

/// What a node does with the requests of one peer.
pub enum Rule {
    /// Serve them.
    Pass,
    /// Refuse every one (the peer sees the node as unreachable).
    Deaf,
    /// Serve an append only up to the entry before the first one `cut` picks (the rest is
    /// dropped and the reply names the last entry kept, as a follower that took part of an
    /// append does); serve everything else.
    TakeBefore(Box<dyn Fn(&Entry) -> bool + Send + Sync>),
    /// Answer appends without entries (heartbeats) with success without serving them, refuse
    /// appends with entries; serve everything else (votes).
    FakeHeartbeats,
    /// Serve appends without entries (heartbeats) and everything else but appends with
    /// entries, which are refused: the peer leads (or stays leader) but commits nothing.
    HeartbeatsOnly,
    /// Like `Pass`, and once `after` picked an entry of a served append, [`Rule::Deaf`].
    DeafAfter(Box<dyn Fn(&Entry) -> bool + Send + Sync>),
}

/// The rules of one node, by sending node (none: [`Rule::Pass`]).
#[derive(Default, Clone)]
pub struct Faults {
    rules: Arc<Mutex<BTreeMap<NodeId, Rule>>>,
}

impl Faults {
    /// Apply `rule` to node `from`'s requests from now on.
    pub fn set(&self, from: u64, rule: Rule) {
        self.rules.lock().expect("faults").insert(from, rule);
    }

    /// Serve every node again.
    pub fn clear(&self) {
        self.rules.lock().expect("faults").clear();
    }
}

/// The node's handler: `Groups` behind the rules of [`Faults`].
pub struct FaultyGroups {
    pub groups: Arc<Groups>,
    pub faults: Faults,
}

/// What to do with one request.
enum Action {
    Serve(Bytes),
    /// Serve `body` (an append cut short) and answer a success as partial, up to `kept`.
    ServePartly(Bytes, Option<keratin_raft::LogId>),
    Refuse,
    Succeed,
}

fn refused() -> RemoteError {
    RemoteError::new(9_999, "refused by the test's network fault")
}

impl FaultyGroups {
    fn action(&self, from: NodeId, kind: u8, body: Bytes) -> Action {
        let mut rules = self.faults.rules.lock().expect("faults");
        let Some(rule) = rules.get(&from) else {
            return Action::Serve(body);
        };
        let append = (kind == KIND_APPEND)
            .then(|| rpc::decode_append(&body).ok())
            .flatten();
        match rule {
            Rule::Pass => Action::Serve(body),
            Rule::Deaf => Action::Refuse,
            Rule::FakeHeartbeats => match append {
                Some(request) if request.entries.is_empty() => Action::Succeed,
                Some(_) => Action::Refuse,
                None => Action::Serve(body),
            },
            Rule::HeartbeatsOnly => match append {
                Some(request) if !request.entries.is_empty() => Action::Refuse,
                _ => Action::Serve(body),
            },
            Rule::TakeBefore(cut) => {
                let Some(mut request) = append else {
                    return Action::Serve(body);
                };
                let Some(at) = request.entries.iter().position(cut) else {
                    return Action::Serve(body);
                };
                request.entries.truncate(at);
                let kept = request
                    .entries
                    .last()
                    .map(|e| e.log_id)
                    .or(request.prev_log_id);
                let to = rpc::addressed_to(&body).expect("the cut append names its copy");
                let body = rpc::encode_append(&request, to).expect("encode a cut append");
                Action::ServePartly(Bytes::from(body), kept)
            }
            Rule::DeafAfter(after) => {
                let seen = append.is_some_and(|request| request.entries.iter().any(after));
                if seen {
                    rules.insert(from, Rule::Deaf);
                }
                Action::Serve(body)
            }
        }
    }

    fn serve(
        &self,
        from: NodeId,
        group: GroupId,
        kind: u8,
        body: Bytes,
    ) -> BoxFuture<Result<Bytes, RemoteError>> {
        match self.action(from, kind, body) {
            Action::Serve(body) => self.groups.call(from, group, kind, body),
            Action::Refuse => Box::pin(std::future::ready(Err(refused()))),
            Action::Succeed => {
                let reply = rpc::encode_append_reply(&AppendEntriesResponse::Success);
                Box::pin(std::future::ready(Ok(Bytes::from(reply))))
            }
            Action::ServePartly(body, kept) => {
                let served = self.groups.call(from, group, kind, body);
                Box::pin(async move {
                    let reply = served.await?;
                    match rpc::decode_append_reply(&reply) {
                        Ok(AppendEntriesResponse::Success) => Ok(Bytes::from(
                            rpc::encode_append_reply(&AppendEntriesResponse::PartialSuccess(kept)),
                        )),
                        _ => Ok(reply),
                    }
                })
            }
        }
    }
}

impl Handler for FaultyGroups {
    fn call(
        &self,
        from: NodeId,
        group: GroupId,
        kind: u8,
        body: Bytes,
    ) -> BoxFuture<Result<Bytes, RemoteError>> {
        self.serve(from, group, kind, body)
    }

    fn heartbeats(
        &self,
        from: NodeId,
        batch: Vec<(GroupId, Bytes)>,
    ) -> BoxFuture<Vec<(GroupId, Result<Bytes, RemoteError>)>> {
        let served: Vec<_> = batch
            .into_iter()
            .map(|(group, body)| {
                let reply = self.serve(from, group, KIND_APPEND, body);
                async move { (group, reply.await) }
            })
            .collect();
        Box::pin(futures_util::future::join_all(served))
    }

    fn label(&self, from: NodeId, label: Bytes) {
        self.groups.label(from, label)
    }
}

/// Whether `entry` carries a partition record of `record_type` whose payload holds `marker`.
pub fn carries(entry: &Entry, record_type: u8, marker: &[u8]) -> bool {
    match &entry.payload {
        Payload::Normal(record) => {
            record.record_type() == record_type
                && (marker.is_empty()
                    || record.payload().windows(marker.len()).any(|w| w == marker))
        }
        _ => false,
    }
}
