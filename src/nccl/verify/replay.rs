//! What a [`crate::GraphFamily`]'s replays are verified against: the NCCL operations of each
//! of its graphs as their capture verified them, hashed (see `nccl/family.rs`).

use std::collections::BTreeMap;

use sha2::{Digest as _, Sha256};
use smallvec::SmallVec;

use crate::engine::tracking::StreamId;
use crate::error::Result;
use crate::nccl::verify::order;
use crate::nccl::verify::wire::{CollDesc, CollEntry, CollKind, Dir, OpDesc};

/// What a family's communicator keeps of its graphs.
pub(crate) struct Replays {
    /// The family's stream: its only one.
    stream: StreamId,
    /// The operations of the capture under way.
    capturing: Option<Noted>,
    /// What each graph's replay publishes, by the id its graph holds.
    graphs: Vec<ReplayDesc>,
}

impl Replays {
    pub(crate) fn new(stream: StreamId) -> Replays {
        Replays {
            stream,
            capturing: None,
            graphs: Vec::new(),
        }
    }

    /// What graph `id`'s replays publish.
    pub(crate) fn graph(&self, id: u64) -> Option<&ReplayDesc> {
        self.graphs.get(usize::try_from(id).ok()?)
    }

    /// How many graphs were captured.
    pub(crate) fn len(&self) -> usize {
        self.graphs.len()
    }

    /// Notes a verified group of the capture under way, if one is: its sends and receives to
    /// peers other than `me`, and its collectives in call order.
    pub(crate) fn note(
        &mut self,
        me: usize,
        p2p: impl Iterator<Item = (usize, Dir, OpDesc)>,
        colls: impl Iterator<Item = CollDesc>,
    ) {
        let Some(noted) = self.capturing.as_mut() else {
            return;
        };
        for (peer, dir, desc) in p2p.filter(|&(peer, _, _)| peer != me) {
            let d = u8::from(dir == Dir::Recv);
            let h = noted.pairs.entry((peer, d)).or_insert_with(|| {
                let mut h = Sha256::new();
                h.update(b"handoff graph replay: one peer, one direction v1");
                h
            });
            for w in desc.encode() {
                h.update(w.to_le_bytes());
            }
        }
        let group: SmallVec<[CollDesc; 2]> = colls.collect();
        if !group.is_empty() {
            noted.colls.push(group);
        }
    }

    pub(crate) fn begin_capture(&mut self, stream: StreamId) -> Result<()> {
        if stream != self.stream {
            return Err(crate::engine::capture_error(
                "a graph family captures and replays on the one stream it was made with: capture \
                 there",
            ));
        }
        // A capture that panicked left its notes: they are not a graph's.
        self.capturing = Some(Noted::default());
        Ok(())
    }

    pub(crate) fn end_capture(&mut self, ok: bool, world: usize) -> u64 {
        let noted = self.capturing.take().unwrap_or_default();
        if !ok {
            return u64::MAX;
        }
        self.graphs.push(noted.finish(world));
        self.graphs.len() as u64 - 1
    }
}

/// The NCCL operations of one capture, as verification compared them, hashed.
#[derive(Default)]
struct Noted {
    /// Per peer and direction (0 send, 1 receive).
    pairs: BTreeMap<(usize, u8), Sha256>,
    /// Each group's collectives, in NCCL's order, group by group.
    colls: Vec<SmallVec<[CollDesc; 2]>>,
}

impl Noted {
    fn finish(self, world: usize) -> ReplayDesc {
        let word = |h: &[u8], at: usize| u64::from_le_bytes(h[at..at + 8].try_into().expect("8 bytes"));
        let half = |h: &[u8], at: usize| u32::from_le_bytes(h[at..at + 4].try_into().expect("4 bytes"));
        let pairs = self
            .pairs
            .into_iter()
            .map(|((peer, dir), h)| {
                let h = h.finalize();
                let desc = OpDesc {
                    count: word(&h, 0),
                    dtype: half(&h, 8),
                    captured: false,
                    nccl_memory: 0,
                    part: CollKind::Replay as u8,
                };
                (peer, if dir == 0 { Dir::Send } else { Dir::Recv }, desc)
            })
            .collect();
        let coll = (!self.colls.is_empty()).then(|| {
            let mut h = Sha256::new();
            h.update(b"handoff graph replay: collectives v1");
            for mut group in self.colls {
                order::nccl_order(&mut group, world);
                let last = group.len() - 1;
                for (i, desc) in group.into_iter().enumerate() {
                    for w in (CollEntry {
                        desc,
                        group_end: i == last,
                    })
                    .encode()
                    {
                        h.update(w.to_le_bytes());
                    }
                }
            }
            let h = h.finalize();
            CollDesc {
                kind: CollKind::Replay,
                count: word(&h, 0),
                dtype: 0,
                redop: half(&h, 8),
                root: half(&h, 12),
                captured: false,
                nccl_memory: 0,
            }
        });
        ReplayDesc { pairs, coll }
    }
}

/// What one replay of a graph publishes for verification: per peer and direction, the digest
/// of its sends or receives; the digest of its collectives.
pub(crate) struct ReplayDesc {
    pub(crate) pairs: SmallVec<[(usize, Dir, OpDesc); 4]>,
    pub(crate) coll: Option<CollDesc>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn captured(me: usize, p2p: &[&[(usize, Dir, OpDesc)]], colls: &[&[CollDesc]]) -> ReplayDesc {
        let mut r = Replays::new(StreamId(1));
        r.begin_capture(StreamId(1)).unwrap();
        for group in p2p {
            r.note(me, group.iter().copied(), std::iter::empty());
        }
        for group in colls {
            r.note(me, std::iter::empty(), group.iter().copied());
        }
        let id = r.end_capture(true, 2);
        r.graphs.swap_remove(id as usize)
    }

    #[test]
    fn a_send_list_and_its_receive_list_have_one_digest_whatever_the_groups() {
        let (four, eight) = (OpDesc::f32_p2p(4), OpDesc::f32_p2p(8));
        let sender = captured(0, &[&[(1, Dir::Send, four), (1, Dir::Send, eight)]], &[]);
        let receiver = captured(1, &[&[(0, Dir::Recv, four)], &[(0, Dir::Recv, eight)]], &[]);
        assert_eq!(sender.pairs.len(), 1);
        assert_eq!(sender.pairs[0].2, receiver.pairs[0].2);
        assert_eq!((sender.pairs[0].1, receiver.pairs[0].1), (Dir::Send, Dir::Recv));
        let other = captured(1, &[&[(0, Dir::Recv, four), (0, Dir::Recv, four)]], &[]);
        assert_ne!(sender.pairs[0].2, other.pairs[0].2);
        let reversed = captured(1, &[&[(0, Dir::Recv, eight), (0, Dir::Recv, four)]], &[]);
        assert_ne!(sender.pairs[0].2, reversed.pairs[0].2);
    }

    #[test]
    fn sends_to_oneself_are_left_out_and_each_peer_and_direction_has_its_own() {
        let four = OpDesc::f32_p2p(4);
        let r = captured(
            0,
            &[&[
                (0, Dir::Send, four),
                (0, Dir::Recv, four),
                (1, Dir::Send, four),
                (1, Dir::Recv, four),
                (2, Dir::Send, four),
            ]],
            &[],
        );
        let keys: Vec<_> = r.pairs.iter().map(|&(p, d, _)| (p, d)).collect();
        assert_eq!(keys, [(1, Dir::Send), (1, Dir::Recv), (2, Dir::Send)]);
        assert!(r.coll.is_none());
    }

    #[test]
    fn collectives_differ_by_count_and_by_grouping() {
        let (a, b) = (CollDesc::f32_sum(4), CollDesc::f32_sum(8));
        let one = captured(0, &[], &[&[a, b]]).coll.unwrap();
        assert_eq!(one.kind, CollKind::Replay);
        assert_eq!(one, captured(1, &[], &[&[a, b]]).coll.unwrap());
        assert_ne!(one, captured(0, &[], &[&[a], &[b]]).coll.unwrap());
        assert_ne!(one, captured(0, &[], &[&[a, a]]).coll.unwrap());
    }

    #[test]
    fn a_failed_capture_makes_no_graph_and_the_next_starts_clean() {
        let mut r = Replays::new(StreamId(1));
        assert!(r.begin_capture(StreamId(2)).is_err());
        r.begin_capture(StreamId(1)).unwrap();
        r.note(
            0,
            [(1, Dir::Send, OpDesc::f32_p2p(4))].into_iter(),
            std::iter::empty(),
        );
        assert_eq!(r.end_capture(false, 2), u64::MAX);
        assert_eq!(r.len(), 0);
        r.begin_capture(StreamId(1)).unwrap();
        assert_eq!(r.end_capture(true, 2), 0);
        let g = r.graph(0).unwrap();
        assert!(g.pairs.is_empty() && g.coll.is_none());
    }
}
