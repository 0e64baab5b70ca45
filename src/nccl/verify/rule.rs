//! The rule of verification, as a state machine over one group's operations: what this rank
//! may publish (a ring slot is reused only once the peer checked the entry in it), which
//! counterpart it compares next and with what, when the group may go to NCCL, and what ends it
//! (a difference, a broken peer, a timeout).
//!
//! It reads and writes entries only through a [`Transport`]'s entry operations, which are
//! memory accesses; it never waits, never touches a socket and never reads the clock (the time
//! is passed in). Whoever drives it ([`crate::nccl::verify::resume_with`] on the host,
//! [`crate::nccl::verify::held`] behind a gate) moves the entries and decides how to wait, so
//! the same rule runs over every transport, and its tests over each.

use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::nccl::verify::mailbox::RING;
use crate::nccl::verify::order;
use crate::nccl::verify::transport::Transport;
use crate::nccl::verify::wire::{CollDesc, CollEntry, Dir, compare, compare_coll};
use crate::nccl::verify::{CollOps, PairOps, Routes};

/// Why verification failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The two sides disagree (both ranks see this).
    Mismatch(String),
    /// The peer's communicator broke while this rank waited for it.
    PeerBroken(usize),
    /// The peer did not post the counterpart in time.
    Timeout {
        peer: usize,
        waited: Duration,
        what: String,
    },
}

impl Failure {
    /// The error a call returns for it; `after` is the communicator's timeout.
    pub(crate) fn into_error(self, after: Duration) -> crate::Error {
        use crate::Error;
        match self {
            Failure::Mismatch(detail) => Error::Mismatch { detail },
            Failure::PeerBroken(peer) => Error::PeerBroken { peer },
            Failure::Timeout { peer, waited, what } => Error::Timeout {
                what: format!("waiting for rank {peer}'s counterpart ({what}; waited {waited:?})"),
                after,
            },
        }
    }
}

/// Per-communicator counts of the rule, since creation: what each verification picks up from.
pub(crate) struct Counts {
    /// Per peer: this rank's sends published, receives published, sends checked, receives
    /// checked.
    pairs: Vec<[u64; 4]>,
    /// Collectives this rank published.
    colls: u64,
    /// Per peer: how many of the peer's collectives this rank checked.
    colls_checked: Vec<u64>,
}

const SENT: usize = 0;
const RECEIVED: usize = 1;
const SENDS_CHECKED: usize = 2;
const RECVS_CHECKED: usize = 3;

impl Counts {
    pub(crate) fn new(world: usize) -> Counts {
        Counts {
            pairs: vec![[0; 4]; world],
            colls: 0,
            colls_checked: vec![0; world],
        }
    }
}

#[derive(Default, Clone, Copy, PartialEq)]
struct Done {
    published: [usize; 2],
    checked: [usize; 2],
    /// The index its first send and first receive were published at: a group's operations of
    /// one direction are published one after another.
    at: [u64; 2],
}

#[derive(Default, Clone, PartialEq)]
struct CollDone {
    /// The group's collectives in NCCL's order.
    ops: SmallVec<[CollDesc; 2]>,
    published: usize,
    /// Per peer.
    checked: SmallVec<[usize; 8]>,
    /// The index its first collective was published at.
    at: u64,
}

impl CollDone {
    fn new(c: &CollOps<'_>) -> CollDone {
        let mut ops = c.ops.clone();
        order::nccl_order(&mut ops, c.boxes.regions.len());
        CollDone {
            ops,
            published: 0,
            checked: SmallVec::from_elem(0, c.boxes.regions.len()),
            at: 0,
        }
    }

    /// Entry `i` of the group, as published.
    fn entry(&self, i: usize) -> CollEntry {
        CollEntry {
            desc: self.ops[i],
            group_end: i + 1 == self.ops.len(),
        }
    }
}

/// How far one verification got: the rule's state for one group, which its driver resumes.
#[derive(Clone, PartialEq)]
pub(crate) struct Progress {
    done: SmallVec<[Done; 2]>,
    coll_done: SmallVec<[CollDone; 1]>,
    /// When it first had to wait (its driver reads the clock only then: the peer has usually
    /// posted already).
    pub(crate) started: Option<Instant>,
}

impl Progress {
    pub(crate) fn new(pairs: &[PairOps<'_>], colls: &[CollOps<'_>]) -> Progress {
        Progress {
            done: SmallVec::from_elem(Done::default(), pairs.len()),
            coll_done: colls.iter().map(CollDone::new).collect(),
            started: None,
        }
    }

    /// Publishes what the rings allow and, with `check`, compares every counterpart there.
    /// `Ok(true)` if anything moved.
    pub(crate) fn advance(
        &mut self,
        pairs: &[PairOps<'_>],
        colls: &[CollOps<'_>],
        routes: &Routes<'_>,
        check: bool,
    ) -> Result<bool, Failure> {
        let mut moved = false;
        for (p, d) in pairs.iter().zip(self.done.iter_mut()) {
            moved |= step(p, d, routes.of(p.boxes), check)?;
        }
        for (c, d) in colls.iter().zip(self.coll_done.iter_mut()) {
            moved |= step_coll(c, d, routes.of(c.boxes), check)?;
        }
        Ok(moved)
    }

    /// Every operation published and checked.
    pub(crate) fn finished(&self, pairs: &[PairOps<'_>], colls: &[CollOps<'_>]) -> bool {
        pairs.iter().zip(&self.done).all(|(p, d)| pair_finished(p, d))
            && colls
                .iter()
                .zip(&self.coll_done)
                .all(|(c, d)| coll_finished(c, d))
    }

    /// Every operation published.
    pub(crate) fn all_published(&self, pairs: &[PairOps<'_>], colls: &[CollOps<'_>]) -> bool {
        pairs
            .iter()
            .zip(&self.done)
            .all(|(p, d)| d.published == [p.sends.len(), p.recvs.len()])
            && colls
                .iter()
                .zip(&self.coll_done)
                .all(|(c, d)| d.published == c.ops.len())
    }

    /// Once [`Progress::finished`]: whether the group may go to NCCL. A peer whose entries
    /// were all there may have broken since it published them: it will not post its side, so
    /// neither does this rank.
    pub(crate) fn conclude(
        &self,
        pairs: &[PairOps<'_>],
        colls: &[CollOps<'_>],
        routes: &Routes<'_>,
    ) -> Result<(), Failure> {
        let broken_pair = pairs
            .iter()
            .find(|p| routes.of(p.boxes).broken(p.peer))
            .map(|p| p.peer);
        let broken_coll = colls.iter().find_map(|c| {
            let t = routes.of(c.boxes);
            (0..c.boxes.regions.len()).find(|&r| r != c.boxes.rank && t.broken(r))
        });
        match broken_pair.or(broken_coll) {
            Some(peer) => Err(Failure::PeerBroken(peer)),
            None => Ok(()),
        }
    }

    /// Nothing moved at `now`: a broken peer ends the verification, and so does a wait past
    /// its timeout (counted from the first stall); otherwise it goes on waiting.
    pub(crate) fn stalled(
        &mut self,
        pairs: &[PairOps<'_>],
        colls: &[CollOps<'_>],
        routes: &Routes<'_>,
        now: Instant,
    ) -> Result<(), Failure> {
        let waited = now.saturating_duration_since(*self.started.get_or_insert(now));
        for (p, d) in pairs.iter().zip(self.done.iter()) {
            if pair_finished(p, d) {
                continue;
            }
            let t = routes.of(p.boxes);
            if t.broken(p.peer) {
                // What the peer published before it broke is visible now (its status is read
                // with acquire): a mismatch in it is a mismatch here too, as on the peer.
                step(p, &mut d.clone(), t, true)?;
                return Err(Failure::PeerBroken(p.peer));
            }
            if waited >= p.timeout {
                return Err(Failure::Timeout {
                    peer: p.peer,
                    waited,
                    what: pending(p, d),
                });
            }
        }
        for (c, d) in colls.iter().zip(self.coll_done.iter()) {
            if coll_finished(c, d) {
                continue;
            }
            let me = c.boxes.rank;
            let t = routes.of(c.boxes);
            let behind = (0..c.boxes.regions.len()).find(|&r| r != me && d.checked[r] < c.ops.len());
            let broken = (0..c.boxes.regions.len()).find(|&r| r != me && t.broken(r));
            if let Some(r) = broken {
                // As for a pair: what the peer published before it broke is checked first.
                step_coll(c, &mut d.clone(), t, true)?;
                return Err(Failure::PeerBroken(r));
            }
            if waited >= c.timeout {
                let what = match behind {
                    Some(r) => format!(
                        "rank {r} has not posted the counterpart of rank {me}'s collective #{}",
                        c.boxes.counts.borrow().colls_checked[r] + 1
                    ),
                    None => "the other ranks have not yet checked this rank's earlier collectives".into(),
                };
                return Err(Failure::Timeout {
                    peer: behind.unwrap_or(me),
                    waited,
                    what,
                });
            }
        }
        Ok(())
    }

    /// Compares, without marking anything checked, this group's published entries with the
    /// counterparts already there, whatever comes before them: `Ok(true)` if every
    /// counterpart is there (and equal), a difference at once. What a rank does before it
    /// holds a group ([`crate::nccl::verify::held`]).
    pub(crate) fn peek(
        &self,
        pairs: &[PairOps<'_>],
        colls: &[CollOps<'_>],
        routes: &Routes<'_>,
    ) -> Result<bool, Failure> {
        let mut all = true;
        for (p, d) in pairs.iter().zip(&self.done) {
            let me = p.boxes.rank;
            let t = routes.of(p.boxes);
            for (dir, ops, side) in [(Dir::Send, &p.sends, 0), (Dir::Recv, &p.recvs, 1)] {
                for (j, op) in ops.iter().enumerate() {
                    let index = d.at[side] + j as u64;
                    match t.read(p.peer, dir.counterpart(), index) {
                        Some(other) => {
                            compare(me, p.peer, dir, index, *op, other).map_err(Failure::Mismatch)?
                        }
                        None => all = false,
                    }
                }
            }
        }
        for (c, d) in colls.iter().zip(&self.coll_done) {
            let me = c.boxes.rank;
            let t = routes.of(c.boxes);
            for p in (0..c.boxes.regions.len()).filter(|&p| p != me) {
                for i in 0..d.ops.len() {
                    let index = d.at + i as u64;
                    match t.read_coll(p, index) {
                        Some(theirs) => {
                            compare_coll(me, p, index, d.entry(i), theirs).map_err(Failure::Mismatch)?
                        }
                        None => all = false,
                    }
                }
            }
        }
        Ok(all)
    }

    /// The peers this verification may wait for: each pair's, and for collectives every other
    /// rank.
    #[cfg(feature = "tracing")]
    pub(crate) fn peers(pairs: &[PairOps<'_>], colls: &[CollOps<'_>]) -> SmallVec<[usize; 4]> {
        let mut peers: SmallVec<[usize; 4]> = pairs.iter().map(|p| p.peer).collect();
        for c in colls {
            peers.extend((0..c.boxes.regions.len()).filter(|&r| r != c.boxes.rank));
        }
        peers.sort_unstable();
        peers.dedup();
        peers
    }
}

/// Publishes and (with `check`) checks what it can for one pair. Ok(true) if anything moved.
fn step(p: &PairOps<'_>, d: &mut Done, t: &impl Transport, check: bool) -> Result<bool, Failure> {
    let me = p.boxes.rank;
    let mut counts = p.boxes.counts.borrow_mut();
    let c = &mut counts.pairs[p.peer];
    let mut moved = false;
    for (dir, ops, side, posted) in [(Dir::Send, &p.sends, 0, SENT), (Dir::Recv, &p.recvs, 1, RECEIVED)] {
        // Publish while the peer has checked what the slot held before.
        while d.published[side] < ops.len() && c[posted] < RING + t.checked(p.peer, dir) {
            if d.published[side] == 0 {
                d.at[side] = c[posted];
            }
            t.publish(p.peer, dir, c[posted], ops[d.published[side]]);
            c[posted] += 1;
            d.published[side] += 1;
            moved = true;
        }
    }
    if !check {
        return Ok(moved);
    }
    if moved {
        // What it published is visible before it reads: see `held`.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
    for (dir, ops, side, checked) in [
        (Dir::Send, &p.sends, 0, SENDS_CHECKED),
        (Dir::Recv, &p.recvs, 1, RECVS_CHECKED),
    ] {
        let counterpart = dir.counterpart();
        while d.checked[side] < ops.len() {
            let index = c[checked];
            let Some(other) = t.read(p.peer, counterpart, index) else {
                break;
            };
            compare(me, p.peer, dir, index, ops[d.checked[side]], other).map_err(Failure::Mismatch)?;
            c[checked] += 1;
            d.checked[side] += 1;
            // The peer may now reuse the slot that entry was in.
            t.mark_checked(p.peer, counterpart, c[checked]);
            moved = true;
        }
    }
    Ok(moved)
}

/// Publishes and (with `check`) checks what it can of one rank's collectives. Ok(true) if
/// anything moved.
fn step_coll(c: &CollOps<'_>, d: &mut CollDone, t: &impl Transport, check: bool) -> Result<bool, Failure> {
    let me = c.boxes.rank;
    let world = c.boxes.regions.len();
    let mut counts = c.boxes.counts.borrow_mut();
    let Counts {
        colls: published,
        colls_checked: checked,
        ..
    } = &mut *counts;
    let mut moved = false;
    while d.published < c.ops.len() {
        // Every peer must have checked the entry the slot held before.
        let oldest = (0..world)
            .filter(|&p| p != me)
            .map(|p| t.coll_checked(p))
            .min()
            .unwrap_or(u64::MAX);
        if *published >= RING.saturating_add(oldest) {
            break;
        }
        if d.published == 0 {
            d.at = *published;
        }
        t.publish_coll(*published, d.entry(d.published));
        *published += 1;
        d.published += 1;
        moved = true;
    }
    if !check {
        return Ok(moved);
    }
    if moved {
        // What it published is visible before it reads: see `held`.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
    for p in (0..world).filter(|&p| p != me) {
        while d.checked[p] < c.ops.len() {
            let index = checked[p];
            let Some(theirs) = t.read_coll(p, index) else {
                break;
            };
            compare_coll(me, p, index, d.entry(d.checked[p]), theirs).map_err(Failure::Mismatch)?;
            checked[p] += 1;
            d.checked[p] += 1;
            t.mark_coll_checked(p, checked[p]);
            moved = true;
        }
    }
    Ok(moved)
}

/// Every operation of the pair published and checked.
fn pair_finished(p: &PairOps<'_>, d: &Done) -> bool {
    let all = [p.sends.len(), p.recvs.len()];
    d.published == all && d.checked == all
}

fn coll_finished(c: &CollOps<'_>, d: &CollDone) -> bool {
    let me = c.boxes.rank;
    d.published == c.ops.len()
        && d.checked
            .iter()
            .enumerate()
            .all(|(p, &n)| p == me || n == c.ops.len())
}

/// What a pair that timed out still waits for.
fn pending(p: &PairOps<'_>, d: &Done) -> String {
    let me = p.boxes.rank;
    let c = p.boxes.counts.borrow().pairs[p.peer];
    if d.checked[0] < p.sends.len() {
        format!(
            "rank {me}'s send #{} to rank {} has no matching receive posted",
            c[SENDS_CHECKED] + 1,
            p.peer,
        )
    } else if d.checked[1] < p.recvs.len() {
        format!(
            "rank {me}'s receive #{} from rank {} has no matching send posted",
            c[RECVS_CHECKED] + 1,
            p.peer,
        )
    } else {
        format!(
            "rank {} has not yet checked rank {me}'s earlier operations",
            p.peer
        )
    }
}
