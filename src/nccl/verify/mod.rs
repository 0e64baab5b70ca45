//! Verification: before a send or receive reaches NCCL, both ranks of the pair have seen each
//! other's operation and agree on its element count and type, in the order issued (NCCL
//! matches a pair's sends and receives in that order and leaves a disagreement undefined: on
//! the H200 it writes past a shorter receive, delivers wrong data, or hangs).
//!
//! What counts as a send or a receive, and in which order, is NCCL's own matching, written down
//! in [`model`]: the per-peer parts of all_to_all, gather and scatter count too.
//!
//! Each rank publishes every operation it is about to post into its mailbox
//! ([`mailbox::Region`]), then waits, on the host, until the peer's counterpart is there, and
//! compares. Nothing waits for the GPU: on one host a mailbox is shared memory, so a check
//! costs a few memory accesses once the peer has posted; across hosts a rank reads a mirror of
//! its peer's mailbox that the verification channel fills ([`channel`]), reading the peer's
//! socket itself while it waits. The only wait is for the peer's host to get there, bounded by
//! the communicator's timeout. A mismatch is [`Error::Mismatch`] on both ranks (each compares
//! the same two entries) before either calls NCCL.
//!
//! The rule (what may be published, what is compared with what, what fails) is [`rule`], a
//! state machine that reads and writes entries through a [`transport::Transport`] and reads no
//! clock; shared memory ([`mailbox::SharedMemory`]) and the channel ([`channel::Channelled`])
//! are its two transports, and [`resume_with`] drives it over them.
//!
//! A rank's own sends to itself, and operations between ranks made together by
//! [`Communicator::init_all`](crate::Communicator::init_all) (driven by one thread), must have
//! their counterparts in the same group: they are matched within it ([`local`], verified or
//! not), a missing one is an error at once, never a wait, and nothing of theirs is published.

mod auth;
mod channel;
#[cfg(test)]
mod channel_tests;
pub(crate) mod held;
#[cfg(test)]
mod hostile;
pub(crate) mod local;
pub(crate) mod mailbox;
pub(crate) mod model;
pub(crate) mod order;
pub mod rehearsal;
pub(crate) mod replay;
pub(crate) mod rule;
pub(crate) mod setup;
pub(crate) mod transport;
pub(crate) mod wire;

use std::cell::RefCell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::trace;

use channel::Channelled;
use mailbox::{Region, SharedMemory};
use transport::{Transport, wait_in_memory};
use wire::{CollDesc, CollEntry, Dir, OpDesc};

pub(crate) use rule::{Failure, Progress};

/// One rank's view of the mailboxes of its communicator.
pub(crate) struct Mailboxes {
    rank: usize,
    /// Every rank's mailbox, this rank's own included (written by this rank only).
    regions: Arc<[Arc<Region>]>,
    /// Where verification picks up ([`rule::Counts`]).
    counts: RefCell<rule::Counts>,
    /// Groups posted behind a gate, not yet checked ([`held`]).
    held: RefCell<held::HeldQueue>,
    /// Why a held group failed: once set, nothing is verified here any more (the checked
    /// counters stop at the failed group).
    failed: RefCell<Option<Failure>>,
    /// What NCCL has connected ([`held::Connected`]).
    connected: RefCell<held::Connected>,
}

impl Mailboxes {
    /// `regions[rank]` is this rank's own.
    pub(crate) fn new(rank: usize, regions: Arc<[Arc<Region>]>) -> Mailboxes {
        let world = regions.len();
        Mailboxes {
            rank,
            regions,
            counts: RefCell::new(rule::Counts::new(world)),
            held: RefCell::default(),
            failed: RefCell::default(),
            connected: RefCell::default(),
        }
    }

    fn mine(&self) -> &Region {
        &self.regions[self.rank]
    }

    /// The peers of this communicator that `pairs` and `colls` (of any communicators)
    /// involve.
    fn peers(&self, pairs: &[PairOps<'_>], colls: &[CollOps<'_>]) -> SmallVec<[usize; 4]> {
        let mut peers: SmallVec<[usize; 4]> = pairs
            .iter()
            .filter(|p| std::ptr::eq(p.boxes, self))
            .map(|p| p.peer)
            .collect();
        if colls.iter().any(|c| std::ptr::eq(c.boxes, self)) {
            peers.extend((0..self.regions.len()).filter(|&r| r != self.rank));
        }
        peers.sort_unstable();
        peers.dedup();
        peers
    }

    /// Whether the channel reaches one of the peers `pairs` and `colls` involve, asked without
    /// touching it (what [`Mailboxes::route`] would pick, with none of its corking).
    pub(crate) fn reaches_remote(&self, pairs: &[PairOps<'_>], colls: &[CollOps<'_>]) -> bool {
        channel::of(self.mine()).is_some_and(|c| self.peers(pairs, colls).iter().any(|&p| c.reaches(p)))
    }

    /// The transport to the peers of this communicator that `pairs` and `colls` (of any
    /// communicators) involve: the channel if it reaches one of them, else shared memory.
    fn route<'a>(&'a self, pairs: &[PairOps<'a>], colls: &[CollOps<'a>]) -> Route<'a> {
        let memory = SharedMemory {
            rank: self.rank,
            regions: &self.regions,
        };
        let Some(c) = channel::of(self.mine()) else {
            return Route::Memory(memory);
        };
        let peers = self.peers(pairs, colls);
        if peers.iter().any(|&p| c.reaches(p)) {
            Route::Channel(Channelled::new(memory, c, &peers))
        } else {
            Route::Memory(memory)
        }
    }
}

/// The operations of one group between one rank and one peer, in the order issued.
pub(crate) struct PairOps<'a> {
    pub(crate) boxes: &'a Mailboxes,
    pub(crate) peer: usize,
    pub(crate) sends: SmallVec<[OpDesc; 4]>,
    pub(crate) recvs: SmallVec<[OpDesc; 4]>,
    /// The deadline of waiting for the peer (the communicator's timeout).
    pub(crate) timeout: Duration,
}

/// The collectives of one group on one rank, in the order issued: every rank of the
/// communicator must post the same ones in the same groups, and each group must run in the
/// same order in NCCL ([`order::nccl_order`]); verification publishes and compares them in
/// that order, the group's last one marked ([`wire::CollEntry`]).
pub(crate) struct CollOps<'a> {
    pub(crate) boxes: &'a Mailboxes,
    pub(crate) ops: SmallVec<[CollDesc; 2]>,
    pub(crate) timeout: Duration,
}

/// One communicator's transport for one verification.
enum Route<'a> {
    Memory(SharedMemory<'a>),
    Channel(Channelled<'a>),
}

/// Calls `$call` on whichever transport `$route` is.
macro_rules! either {
    ($route:expr, $t:ident => $call:expr) => {
        match $route {
            Route::Memory($t) => $call,
            Route::Channel($t) => $call,
        }
    };
}

impl Transport for Route<'_> {
    #[inline]
    fn publish(&self, peer: usize, dir: Dir, index: u64, op: OpDesc) {
        either!(self, t => t.publish(peer, dir, index, op))
    }

    #[inline]
    fn read(&self, peer: usize, dir: Dir, index: u64) -> Option<OpDesc> {
        either!(self, t => t.read(peer, dir, index))
    }

    #[inline]
    fn checked(&self, peer: usize, dir: Dir) -> u64 {
        either!(self, t => t.checked(peer, dir))
    }

    #[inline]
    fn mark_checked(&self, peer: usize, dir: Dir, n: u64) {
        either!(self, t => t.mark_checked(peer, dir, n))
    }

    #[inline]
    fn publish_coll(&self, index: u64, entry: CollEntry) {
        either!(self, t => t.publish_coll(index, entry))
    }

    #[inline]
    fn read_coll(&self, peer: usize, index: u64) -> Option<Option<CollEntry>> {
        either!(self, t => t.read_coll(peer, index))
    }

    #[inline]
    fn coll_checked(&self, peer: usize) -> u64 {
        either!(self, t => t.coll_checked(peer))
    }

    #[inline]
    fn mark_coll_checked(&self, peer: usize, n: u64) {
        either!(self, t => t.mark_coll_checked(peer, n))
    }

    #[inline]
    fn broken(&self, peer: usize) -> bool {
        either!(self, t => t.broken(peer))
    }

    #[inline]
    fn pump(&mut self) -> bool {
        either!(self, t => t.pump())
    }

    #[inline]
    fn flush(&mut self) {
        either!(self, t => t.flush())
    }

    #[inline]
    fn wait(&mut self, looks: u32, timeout: Duration) {
        either!(self, t => t.wait(looks, timeout))
    }

    #[inline]
    fn holds(&self) -> bool {
        either!(self, t => t.holds())
    }
}

/// The transports of one verification: one per communicator its operations are on.
pub(crate) struct Routes<'a> {
    each: SmallVec<[(&'a Mailboxes, Route<'a>); 1]>,
}

impl<'a> Routes<'a> {
    pub(crate) fn new(pairs: &[PairOps<'a>], colls: &[CollOps<'a>]) -> Routes<'a> {
        let mut each: SmallVec<[(&'a Mailboxes, Route<'a>); 1]> = SmallVec::new();
        for b in pairs.iter().map(|p| p.boxes).chain(colls.iter().map(|c| c.boxes)) {
            if !each.iter().any(|(d, _)| std::ptr::eq(*d, b)) {
                each.push((b, b.route(pairs, colls)));
            }
        }
        Routes { each }
    }

    /// The transport of `boxes`' operations.
    fn of(&self, boxes: &Mailboxes) -> &Route<'a> {
        &self
            .each
            .iter()
            .find(|(b, _)| std::ptr::eq(*b, boxes))
            .expect("a route for every communicator of the verification")
            .1
    }

    /// Whether every transport may hold ([`Transport::holds`]).
    pub(crate) fn hold(&self) -> bool {
        self.each.iter().all(|(_, r)| r.holds())
    }

    fn pump(&mut self) -> bool {
        let mut any = false;
        for (_, r) in &mut self.each {
            any |= r.pump();
        }
        any
    }

    fn flush(&mut self) {
        for (_, r) in &mut self.each {
            r.flush();
        }
    }

    fn wait(&mut self, looks: u32, timeout: Duration) {
        match self.each.as_mut_slice() {
            [(_, one)] => one.wait(looks, timeout),
            // Several communicators' peers: no one transport says when to look.
            _ => wait_in_memory(looks, timeout),
        }
    }
}

/// How long a verification waiting for its peers waits at a time, once it has spun: a frame
/// on a socket wakes it at once; this bounds how late it sees a timeout.
const WAIT: Duration = Duration::from_millis(5);

/// Publishes every operation of `pairs` and checks each against its counterpart, waiting (with
/// each pair's timeout) for peers in other threads or processes. On success every operation
/// may be posted to NCCL.
pub(crate) fn verify(pairs: &[PairOps<'_>], colls: &[CollOps<'_>]) -> Result<(), Failure> {
    let mut progress = Progress::new(pairs, colls);
    let r = resume(pairs, colls, &mut progress);
    traced(&r, &progress, pairs, colls);
    r
}

/// The tracing events of one verification's end (feature `tracing`).
fn traced(r: &Result<(), Failure>, progress: &Progress, pairs: &[PairOps<'_>], colls: &[CollOps<'_>]) {
    trace::with_tracing! {
        report(r, progress, pairs, colls);
    }
    #[cfg(not(feature = "tracing"))]
    let _ = (r, progress, pairs, colls);
}

/// The events of one verification (feature `tracing`): a wait, if it had to wait, and a
/// failure.
#[cfg(feature = "tracing")]
fn report(r: &Result<(), Failure>, progress: &Progress, pairs: &[PairOps<'_>], colls: &[CollOps<'_>]) {
    match r {
        Err(Failure::Mismatch(detail)) => {
            trace::event!(warn, detail = %detail, "handoff: verification mismatch");
        }
        Err(Failure::PeerBroken(peer)) => {
            trace::event!(
                warn,
                peer,
                "handoff: verification ended: the peer's communicator broke"
            );
        }
        Err(Failure::Timeout { peer, waited, what }) => {
            trace::event!(
                warn,
                peer,
                waited = ?waited,
                what = %what,
                "handoff: verification timed out waiting for a peer"
            );
        }
        Ok(()) => {}
    }
    if let Some(started) = progress.started {
        let peers = Progress::peers(pairs, colls);
        trace::event!(
            debug,
            peers = ?peers.as_slice(),
            waited = ?started.elapsed(),
            ok = r.is_ok(),
            "handoff: verification waited for a peer"
        );
    }
}

/// [`verify`] from `progress` on, which it updates: the model's tests run ranks' groups on one
/// thread, each until it has to wait (a timeout of zero), then the next.
pub(crate) fn resume(
    pairs: &[PairOps<'_>],
    colls: &[CollOps<'_>],
    progress: &mut Progress,
) -> Result<(), Failure> {
    resume_with(pairs, colls, progress, Wait::Block).map(drop)
}

/// How far [`resume_with`] goes before it returns.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Wait {
    /// Until every operation is published and checked (or a failure).
    Block,
    /// Until every operation is published, then as far as the counterparts there allow:
    /// `Ok(false)` when one is missing.
    Publish,
    /// As far as the ring lets it publish, checking nothing (what comes before it is not
    /// checked yet): `Ok(false)` if the ring is full before every operation is published.
    PublishOnly,
}

/// [`resume`] as far as `wait` says: `Ok(true)` once every operation is checked. The rule
/// ([`rule`]) decides; this moves its entries through each communicator's transport, reads the
/// clock when it stalls, and waits.
pub(crate) fn resume_with(
    pairs: &[PairOps<'_>],
    colls: &[CollOps<'_>],
    progress: &mut Progress,
    wait: Wait,
) -> Result<bool, Failure> {
    // After a held group failed, nothing is verified on its communicator: its counters stop
    // at that group, and a later group would be compared with that group's counterparts.
    for b in pairs.iter().map(|p| p.boxes).chain(colls.iter().map(|c| c.boxes)) {
        if let Some(f) = b.failure() {
            return Err(f);
        }
    }
    let mut routes = Routes::new(pairs, colls);
    let check = wait != Wait::PublishOnly;
    let mut pumped = false;
    let mut looks = 0u32;
    loop {
        let mut moved = progress.advance(pairs, colls, &routes, check)?;
        let published = progress.all_published(pairs, colls);
        if wait == Wait::PublishOnly && published {
            return Ok(false);
        }
        if progress.finished(pairs, colls) {
            // A remote peer's note that it broke may be in its socket still, if this call has
            // not read it yet.
            if !pumped {
                routes.pump();
            }
            return progress.conclude(pairs, colls, &routes).map(|()| true);
        }
        // What this step published and checked goes out before this rank waits, and what
        // remote peers sent since comes in.
        routes.flush();
        moved |= routes.pump();
        pumped = true;
        if moved {
            looks = 0;
            continue;
        }
        // Stalled: waiting for a peer, or for a counterpart that will never come.
        progress.stalled(pairs, colls, &routes, Instant::now())?;
        if wait == Wait::Publish && published || wait == Wait::PublishOnly {
            // PublishOnly stalled: the ring is full; the caller checks on the host instead.
            return Ok(false);
        }
        looks += 1;
        routes.wait(looks, WAIT);
    }
}

/// How the ranks of a test reach each other: every transport runs the same tests.
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Via {
    /// Regions in this process's memory, as ranks of one host share them.
    Memory,
    /// Each rank's own region, and mirrors of its peers' that the channel fills over loopback
    /// TCP, as ranks of different hosts see them.
    Channel,
}

#[cfg(test)]
impl Via {
    pub(crate) const BOTH: [Via; 2] = [Via::Memory, Via::Channel];

    /// The mailboxes of `n` ranks of this process, rank `r` at `r`.
    pub(crate) fn world(self, n: usize) -> Vec<Mailboxes> {
        match self {
            Via::Memory => {
                let regions: Arc<[Arc<Region>]> =
                    (0..n).map(|r| Arc::new(Region::in_process(n, r))).collect();
                (0..n).map(|r| Mailboxes::new(r, regions.clone())).collect()
            }
            Via::Channel => channel_tests::world(n, Duration::from_secs(5)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const F32: u32 = 7;

    /// The mailboxes of `n` ranks in one process, through `via`.
    fn world(via: Via, n: usize) -> Vec<Mailboxes> {
        via.world(n)
    }

    fn verify_pairs(pairs: &[PairOps<'_>]) -> Result<(), Failure> {
        verify(pairs, &[])
    }

    fn coll<'a>(boxes: &'a Mailboxes, ops: &[CollDesc]) -> CollOps<'a> {
        CollOps {
            boxes,
            ops: ops.into(),
            timeout: Duration::from_secs(5),
        }
    }

    #[test]
    fn collectives_agree_across_three_ranks_on_threads_and_refuse_a_difference() {
        for via in Via::BOTH {
            eprintln!("through {via:?}");
            use wire::{CollKind, NONE};
            let sum = CollDesc::f32_sum(1001);
            let bcast = CollDesc {
                kind: CollKind::Broadcast,
                count: 5,
                dtype: F32,
                redop: NONE,
                root: 2,
                captured: false,
                nccl_memory: 0,
            };
            // Mailboxes are not Sync (their counters are per communicator, used by its one
            // thread): each rank's moves to its thread, and the three agree.
            let spawn = |b: Mailboxes, ops: Vec<CollDesc>| {
                std::thread::spawn(move || (verify(&[], &[coll(&b, &ops)]), b))
            };
            let mut ranks = world(via, 3);
            let c = ranks.pop().unwrap();
            let b = ranks.pop().unwrap();
            let a = ranks.pop().unwrap();
            let hs = [
                spawn(a, vec![sum, bcast]),
                spawn(b, vec![sum, bcast]),
                spawn(c, vec![sum, bcast]),
            ];
            let mut boxes = Vec::new();
            for h in hs {
                let (r, b) = h.join().unwrap();
                r.unwrap();
                boxes.push(b);
            }
            // Then rank 2 posts a broadcast from another root: every rank fails, naming both.
            let other = CollDesc { root: 0, ..bcast };
            let c = boxes.pop().unwrap();
            let b = boxes.pop().unwrap();
            let a = boxes.pop().unwrap();
            let hs = [
                spawn(a, vec![bcast]),
                spawn(b, vec![bcast]),
                spawn(c, vec![other]),
            ];
            for (r, h) in hs.into_iter().enumerate() {
                match h.join().unwrap().0 {
                    Err(Failure::Mismatch(m)) => {
                        assert!(m.contains("root 2") && m.contains("root 0"), "rank {r}: {m}")
                    }
                    other => panic!("rank {r}: {other:?}"),
                }
            }
        }
    }

    /// Rank 0's groups and rank 1's, each rank on its thread: each group's verification.
    fn grouped(via: Via, r0: Vec<Vec<CollDesc>>, r1: Vec<Vec<CollDesc>>) -> [Vec<Result<(), Failure>>; 2] {
        let [a, b] = two(via);
        let run = |boxes: Mailboxes, groups: Vec<Vec<CollDesc>>| {
            std::thread::spawn(move || {
                let mut out = Vec::new();
                for g in groups {
                    let r = verify(&[], &[coll(&boxes, &g)]);
                    let failed = r.is_err();
                    out.push(r);
                    if failed {
                        // As a communicator does: its peers stop waiting for it.
                        boxes.mine().set_broken();
                        break;
                    }
                }
                // Kept until both ranks are done: through the channel, a rank's end closes its
                // connection, which its peer reads as the rank broken.
                (out, boxes)
            })
        };
        let (ta, tb) = (run(a, r0), run(b, r1));
        let ((ra, _a), (rb, _b)) = (ta.join().unwrap(), tb.join().unwrap());
        [ra, rb]
    }

    #[test]
    fn differently_grouped_collectives_are_a_mismatch_on_both_ranks() {
        for via in Via::BOTH {
            eprintln!("through {via:?}");
            // The review of 2026-12-03, finding 1 (its CPU reproduction): rank 0 groups all_reduce
            // of 1 Mi with all_reduce of 16, which NCCL 2.28 runs small first; rank 1 posts them
            // one group each, big first. Verification passed, and NCCL paired 16 with 1 Mi.
            let (big, small) = (CollDesc::f32_sum(1 << 20), CollDesc::f32_sum(16));
            let [r0, r1] = grouped(via, vec![vec![big, small]], vec![vec![big], vec![small]]);
            eprintln!("rank 0 (one group): {r0:?}; rank 1 (two groups): {r1:?}");
            for (rank, r) in [(0, &r0[0]), (1, &r1[0])] {
                assert!(matches!(r, Err(Failure::Mismatch(_))), "rank {rank}: {r:?}");
            }
        }
    }

    #[test]
    fn one_group_in_two_call_orders_passes() {
        for via in Via::BOTH {
            eprintln!("through {via:?}");
            // Finding 4: NCCL runs both groups alike (16 first), so both ranks pass; an all_reduce
            // of 4097 and one of 4096 fall in one bin of NCCL's sorter, which keeps their call
            // order, so those two in opposite orders are a mismatch.
            let (big, small) = (CollDesc::f32_sum(1 << 20), CollDesc::f32_sum(16));
            let [r0, r1] = grouped(via, vec![vec![big, small]], vec![vec![small, big]]);
            assert!(r0[0].is_ok() && r1[0].is_ok(), "{r0:?} {r1:?}");
            let (a, b) = (CollDesc::f32_sum(4096), CollDesc::f32_sum(4097));
            let [r0, r1] = grouped(via, vec![vec![a, b]], vec![vec![b, a]]);
            assert!(
                matches!(&r0[0], Err(Failure::Mismatch(_))) && matches!(&r1[0], Err(Failure::Mismatch(_))),
                "{r0:?} {r1:?}"
            );
        }
    }

    #[test]
    fn many_more_collectives_than_ring_slots() {
        for via in Via::BOTH {
            eprintln!("through {via:?}");
            use wire::{CollKind, NONE};
            let ops: Vec<CollDesc> = (1..=300)
                .map(|n| CollDesc {
                    kind: CollKind::AllGather,
                    count: n,
                    dtype: F32,
                    redop: NONE,
                    root: NONE,
                    captured: false,
                    nccl_memory: 0,
                })
                .collect();
            // One group of them on both ranks, then one group each.
            let ranks = two(via).map(|boxes| {
                let ops = ops.clone();
                std::thread::spawn(move || {
                    let r = verify(&[], &[coll(&boxes, &ops)]).and_then(|()| {
                        ops.iter()
                            .try_for_each(|o| verify(&[], &[coll(&boxes, std::slice::from_ref(o))]))
                    });
                    (r, boxes)
                })
            });
            // Each rank's boxes kept until both are done (see `grouped`).
            let done = ranks.map(|r| r.join().unwrap());
            for (r, _) in &done {
                r.clone().unwrap();
            }
        }
    }

    #[test]
    fn a_missing_collective_is_a_timeout() {
        for via in Via::BOTH {
            eprintln!("through {via:?}");
            let d = CollDesc::f32_sum(4);
            let w = world(via, 2);
            let mut c = coll(&w[0], &[d]);
            c.timeout = Duration::from_millis(200);
            assert!(matches!(verify(&[], &[c]), Err(Failure::Timeout { peer: 1, .. })));
        }
    }

    fn two(via: Via) -> [Mailboxes; 2] {
        let mut w = world(via, 2);
        let w1 = w.pop().unwrap();
        [w.pop().unwrap(), w1]
    }

    fn pair<'a>(boxes: &'a Mailboxes, peer: usize, sends: &[u64], recvs: &[u64]) -> PairOps<'a> {
        PairOps {
            boxes,
            peer,
            sends: sends.iter().map(|&c| OpDesc::f32_p2p(c)).collect(),
            recvs: recvs.iter().map(|&c| OpDesc::f32_p2p(c)).collect(),
            timeout: Duration::from_secs(5),
        }
    }

    #[test]
    fn a_send_and_its_receive_in_one_group_pass() {
        for via in Via::BOTH {
            eprintln!("through {via:?}");
            let w = world(via, 2);
            verify_pairs(&[pair(&w[0], 1, &[4], &[]), pair(&w[1], 0, &[], &[4])]).unwrap();
            // And again: the counters moved on together.
            verify_pairs(&[pair(&w[0], 1, &[8, 2], &[1]), pair(&w[1], 0, &[1], &[8, 2])]).unwrap();
        }
    }

    #[test]
    fn the_measured_mismatch_is_refused_on_both_ranks() {
        for via in Via::BOTH {
            eprintln!("through {via:?}");
            // Issue 9, hole 1: a send of n f32 matched with a receive of 3n/4, ranks on two threads.
            let [w0, w1] = two(via);
            let n = 4_194_304;
            let sender = std::thread::spawn(move || (verify_pairs(&[pair(&w0, 1, &[n], &[])]), w0));
            let receiver = std::thread::spawn(move || (verify_pairs(&[pair(&w1, 0, &[], &[3 * n / 4])]), w1));
            // Each rank's boxes kept until both are done (see `grouped`).
            let ((sent, _w0), (received, _w1)) = (sender.join().unwrap(), receiver.join().unwrap());
            for (who, r) in [("sender", sent), ("receiver", received)] {
                assert!(
                    matches!(&r, Err(Failure::Mismatch(m)) if m.contains("4194304") && m.contains("3145728")),
                    "{who}: {r:?}"
                );
            }
        }
    }

    #[test]
    fn ranks_in_threads_wait_for_each_other() {
        for via in Via::BOTH {
            eprintln!("through {via:?}");
            let [w0, w1] = two(via);
            let a = std::thread::spawn(move || (verify_pairs(&[pair(&w0, 1, &[4], &[])]), w0));
            std::thread::sleep(Duration::from_millis(50));
            let b = std::thread::spawn(move || (verify_pairs(&[pair(&w1, 0, &[], &[4])]), w1));
            // Each rank's boxes kept until both are done (see `grouped`).
            let ((ra, _w0), (rb, _w1)) = (a.join().unwrap(), b.join().unwrap());
            ra.unwrap();
            rb.unwrap();
        }
    }

    #[test]
    fn a_peer_that_never_posts_is_a_timeout_within_the_bound() {
        for via in Via::BOTH {
            eprintln!("through {via:?}");
            let w = world(via, 2);
            let mut p = pair(&w[0], 1, &[4], &[]);
            p.timeout = Duration::from_millis(200);
            let t = Instant::now();
            let e = verify_pairs(&[p]).unwrap_err();
            assert!(matches!(e, Failure::Timeout { peer: 1, .. }), "{e:?}");
            assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        }
    }

    #[test]
    fn a_broken_peer_ends_the_wait_at_once() {
        for via in Via::BOTH {
            eprintln!("through {via:?}");
            let w = world(via, 2);
            w[1].regions[1].set_broken();
            let e = verify_pairs(&[pair(&w[0], 1, &[4], &[])]).unwrap_err();
            assert_eq!(e, Failure::PeerBroken(1));
        }
    }

    #[test]
    fn many_more_operations_than_ring_slots_with_uneven_grouping() {
        for via in Via::BOTH {
            eprintln!("through {via:?}");
            // One rank posts 1000 sends in one group; the other receives them one group at a time.
            // Neither may overwrite a slot its peer has not checked, and neither deadlocks.
            let [w0, w1] = two(via);
            let counts: Vec<u64> = (1..=1000).collect();
            let sent = counts.clone();
            let a = std::thread::spawn(move || (verify_pairs(&[pair(&w0, 1, &sent, &[])]), w0));
            let b = std::thread::spawn(move || {
                let r = counts
                    .iter()
                    .try_for_each(|&c| verify_pairs(&[pair(&w1, 0, &[], &[c])]));
                (r, w1)
            });
            // Each rank's boxes kept until both are done (see `grouped`).
            let ((ra, _w0), (rb, _w1)) = (a.join().unwrap(), b.join().unwrap());
            ra.unwrap();
            rb.unwrap();
        }
    }

    #[test]
    fn two_processes_share_file_mailboxes() {
        // The mailbox files as two processes use them: this test maps both files twice, as two
        // ranks would, and runs the ranks on two threads with no memory shared otherwise.
        let dir = std::env::temp_dir();
        let (r0, p0) = Region::create_file(&dir, 2, 0, 11).unwrap();
        let (r1, p1) = Region::create_file(&dir, 2, 1, 22).unwrap();
        let rank0 = Mailboxes::new(
            0,
            Arc::new([Arc::new(r0), Arc::new(Region::open_file(&p1, 2, 1, 22).unwrap())]),
        );
        let rank1 = Mailboxes::new(
            1,
            Arc::new([Arc::new(Region::open_file(&p0, 2, 0, 11).unwrap()), Arc::new(r1)]),
        );
        std::fs::remove_file(p0).unwrap();
        std::fs::remove_file(p1).unwrap();
        let counts: Vec<u64> = (1..=300).collect();
        let sent = counts.clone();
        let a = std::thread::spawn(move || verify_pairs(&[pair(&rank0, 1, &sent, &[7])]));
        let b = std::thread::spawn(move || verify_pairs(&[pair(&rank1, 0, &[7], &counts)]));
        a.join().unwrap().unwrap();
        b.join().unwrap().unwrap();
    }
}
