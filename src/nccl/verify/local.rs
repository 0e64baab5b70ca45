//! The local match: operations whose counterpart the same thread posts (a send to oneself, and
//! anything between ranks of one [`crate::Communicator::init_all`], which one thread drives)
//! are matched within their group, before anything is published or posted, whether or not the
//! communicator verifies. Their counterparts can only be in the same group: NCCL would
//! otherwise wait forever for the other half, or pair it with another operation. Nothing of
//! theirs goes through a mailbox (see [`crate::nccl::verify::verify`], which is for peers that
//! post on their own).
//!
//! Plain data: [`LocalRank`] is a communicator in the crate, a rank number in the model tests
//! ([`crate::nccl::verify::model`]), which hold this rule to what NCCL pairs.

use smallvec::SmallVec;

use crate::nccl::verify::order::nccl_order;
use crate::nccl::verify::wire::{CollDesc, Dir, OpDesc};

/// A rank of a group, as the local match sees it.
pub(crate) trait LocalRank: Copy {
    fn rank(self) -> usize;
    fn world(self) -> usize;
    /// The same for one rank (one communicator) and no other.
    fn key(self) -> usize;
    /// This thread drives every rank of the communicator (one made by `init_all`).
    fn drives_all(self) -> bool;
    /// Whether `other` is rank `peer` of this rank's communicator, driven by this thread.
    fn is_rank(self, other: Self, peer: usize) -> bool;
}

/// One send or receive NCCL queues for a group (a collective's per-peer parts included): the
/// rank that posts it, its peer, which way, and what.
pub(crate) type Queued<K> = (K, usize, Dir, OpDesc);

/// Matches every local operation of `queued` (in NCCL's order) with its counterpart among
/// `members`, the group's ranks: the `i`-th send from `a` to `b` with the `i`-th receive of `b`
/// from `a`, each equal (see [`crate::nccl::verify::wire::compare`]). `Err` says what is
/// missing or differs.
pub(crate) fn match_pairs<K: LocalRank>(members: &[K], queued: &[Queued<K>]) -> Result<(), String> {
    // Each pair once (as (from, to) with the lower key first).
    let mut checked: SmallVec<[(usize, usize); 4]> = SmallVec::new();
    for &(rank, peer, dir, _) in queued {
        let me = rank.rank();
        if peer != me && !rank.drives_all() {
            continue;
        }
        let Some(&other) = members.iter().find(|&&m| rank.is_rank(m, peer)) else {
            return Err(format!(
                "rank {me} {} rank {peer}, made by the same Communicator::init_all, outside a \
                 group that holds rank {peer}'s counterpart: ranks made together are driven by \
                 one thread, so put the send and the receive in one group (or make each rank \
                 with Communicator::new on its own thread)",
                if dir == Dir::Send {
                    "sends to"
                } else {
                    "receives from"
                }
            ));
        };
        let pair = (rank.key().min(other.key()), rank.key().max(other.key()));
        if checked.contains(&pair) {
            continue;
        }
        checked.push(pair);
        let side = |from: K, to: usize, d: Dir| {
            queued
                .iter()
                .filter(move |&&(r, p, e, _)| r.key() == from.key() && p == to && e == d)
                .map(|&(.., desc)| desc)
        };
        // Both directions of the pair: my sends with its receives, its sends with mine (one
        // and the same for a rank and itself).
        let directions = if other.key() == rank.key() { 1 } else { 2 };
        for (from, to, a, b) in [(rank, other, me, peer), (other, rank, peer, me)]
            .into_iter()
            .take(directions)
        {
            if !side(from, b, Dir::Send).eq(side(to, a, Dir::Recv)) {
                let list = |l: &mut dyn Iterator<Item = OpDesc>| {
                    l.map(|d| d.describe()).collect::<Vec<_>>().join("; ")
                };
                return Err(format!(
                    "rank {a}'s sends to rank {b} [{}] and rank {b}'s receives from rank {a} \
                     [{}], in the order NCCL queues them (collectives' parts included), must \
                     match one to one in the same group, or NCCL waits forever or writes past a \
                     receive",
                    list(&mut side(from, b, Dir::Send)),
                    list(&mut side(to, a, Dir::Recv))
                ));
            }
        }
    }
    Ok(())
}

/// Checks that every rank of one `init_all` among `members` that posts collectives in this
/// group (`colls`, in call order) posts the same ones as every other rank of it, to run in the
/// same order in NCCL: one thread drives them all, so a collective missing from one rank's
/// part of the group would never come.
pub(crate) fn match_collectives<K: LocalRank>(members: &[K], colls: &[(K, CollDesc)]) -> Result<(), String> {
    for &c in members {
        // One rank alone agrees with itself.
        if !c.drives_all() || c.world() == 1 {
            continue;
        }
        // A rank's collectives in the order NCCL runs them: the same group in another call
        // order may run alike (see `order::nccl_order`).
        let seq = |of: Option<K>| {
            let mut s: SmallVec<[CollDesc; 4]> = colls
                .iter()
                .filter(|(r, _)| of.is_some_and(|of| r.key() == of.key()))
                .map(|&(_, d)| d)
                .collect();
            nccl_order(&mut s, c.world());
            s
        };
        let mine = seq(Some(c));
        if mine.is_empty() {
            continue;
        }
        for r in 0..c.world() {
            let other = members.iter().copied().find(|&d| c.is_rank(d, r));
            let theirs = seq(other);
            if theirs != mine {
                let list = |s: &[CollDesc]| s.iter().map(|d| d.describe()).collect::<Vec<_>>().join(", ");
                return Err(format!(
                    "rank {}'s collectives [{}] and rank {r}'s [{}] in this group, in the order \
                     NCCL runs them (call order with an NCCL other than 2.28.3-2.28.9), differ: \
                     ranks made together by Communicator::init_all are \
                     driven by one thread, so every one of them posts the same collectives in one \
                     group",
                    c.rank(),
                    list(&mine),
                    list(&theirs)
                ));
            }
        }
    }
    Ok(())
}

/// A rank of the CPU tests (here and the model's): rank `rank` of `world`, made by one
/// `init_all` with the others (`clique`), or alone in its process.
#[cfg(test)]
#[derive(Clone, Copy)]
pub(crate) struct TestRank {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) clique: bool,
}

#[cfg(test)]
impl LocalRank for TestRank {
    fn rank(self) -> usize {
        self.rank
    }
    fn world(self) -> usize {
        self.world
    }
    fn key(self) -> usize {
        self.rank
    }
    fn drives_all(self) -> bool {
        self.clique
    }
    fn is_rank(self, other: Self, peer: usize) -> bool {
        other.rank == peer && (self.clique || peer == self.rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use TestRank as R;

    #[test]
    fn sends_to_oneself_match_the_receives_in_order() {
        let me = R {
            rank: 0,
            world: 1,
            clique: false,
        };
        let q = |a: u64, b: u64| {
            [
                (me, 0, Dir::Send, OpDesc::f32_p2p(3)),
                (me, 0, Dir::Send, OpDesc::f32_p2p(5)),
                (me, 0, Dir::Recv, OpDesc::f32_p2p(a)),
                (me, 0, Dir::Recv, OpDesc::f32_p2p(b)),
            ]
        };
        match_pairs(&[me], &q(3, 5)).unwrap();
        let e = match_pairs(&[me], &q(5, 3)).unwrap_err();
        assert!(e.contains("must match one to one"), "{e}");
        let e = match_pairs(&[me], &[(me, 0, Dir::Send, OpDesc::f32_p2p(4))]).unwrap_err();
        assert!(e.contains("[4 elements") && e.contains("[]"), "{e}");
    }

    #[test]
    fn a_rank_of_the_same_init_all_outside_the_group_is_refused() {
        let r = |rank| R {
            rank,
            world: 2,
            clique: true,
        };
        let e = match_pairs(&[r(0)], &[(r(0), 1, Dir::Send, OpDesc::f32_p2p(4))]).unwrap_err();
        assert!(
            e.contains("outside a group that holds rank 1's counterpart"),
            "{e}"
        );
        match_pairs(
            &[r(0), r(1)],
            &[
                (r(0), 1, Dir::Send, OpDesc::f32_p2p(4)),
                (r(1), 0, Dir::Recv, OpDesc::f32_p2p(4)),
            ],
        )
        .unwrap();
        // A peer in another process is not matched here (verification waits for it).
        let alone = R {
            rank: 0,
            world: 2,
            clique: false,
        };
        match_pairs(&[alone], &[(alone, 1, Dir::Send, OpDesc::f32_p2p(4))]).unwrap();
    }

    #[test]
    fn ranks_of_one_init_all_post_the_same_collectives() {
        let r = |rank| R {
            rank,
            world: 2,
            clique: true,
        };
        let sum = CollDesc::f32_sum;
        let both = [r(0), r(1)];
        match_collectives(&both, &[(r(0), sum(4)), (r(1), sum(4))]).unwrap();
        let e = match_collectives(&both, &[(r(0), sum(4)), (r(1), sum(8))]).unwrap_err();
        assert!(e.contains("differ"), "{e}");
        let e = match_collectives(&both, &[(r(0), sum(4))]).unwrap_err();
        assert!(e.contains("differ"), "{e}");
    }
}
