//! Groups handed to NCCL before their peers' hosts posted the counterparts, behind a gate on
//! the GPU ([`crate::engine::gate`]) that opens once verification has compared them.
//!
//! # Why a held group never runs against a different counterpart
//! Every rank publishes each operation of a group, then (after a sequentially consistent
//! fence) reads the counterpart at the same index: there, it compares; missing, it may hold the
//! group. Two ranks doing so for one pair of entries cannot both miss the other's (each store
//! precedes its fence, each read follows one: Dekker's argument). So of any two ranks that post
//! an operation pair to NCCL, at least one compared the two entries and found them equal
//! before it posted; a rank that finds a difference posts nothing, ever again, on that
//! communicator. NCCL moves data only between a rank's kernel and its peers' kernels for the
//! same operation, so an operation that differs from its peer's is never run against it,
//! whether a gate opens after a check, after an abort or after a timeout. That holds for every
//! transport NCCL picks, and needs only shared memory between the two ranks' mailboxes: a peer
//! verified through the TCP channel is never gated (its mirror is not read at the same time as
//! the peer writes), and neither is anything NCCL's own host code exchanges with the peer at
//! posting (a first connection, registered buffers): see [`Connected`].

use std::collections::VecDeque;
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use super::wire::{CollDesc, Dir, OpDesc};
use super::{CollOps, Failure, Mailboxes, PairOps, Progress, Routes, Wait, resume_with};

/// One peer's part of a held group: the peer, the sends and the receives.
type HeldPair = (usize, SmallVec<[OpDesc; 4]>, SmallVec<[OpDesc; 4]>);

/// A held group: what is left to compare.
pub(crate) struct Held {
    pairs: SmallVec<[HeldPair; 2]>,
    colls: SmallVec<[CollDesc; 2]>,
    timeout: Duration,
    progress: Progress,
    /// The gate's ticket that lets the group's NCCL work start.
    pub(crate) ticket: u32,
}

impl Held {
    fn ops<'a>(&self, boxes: &'a Mailboxes) -> (SmallVec<[PairOps<'a>; 2]>, SmallVec<[CollOps<'a>; 1]>) {
        let pairs = self
            .pairs
            .iter()
            .map(|(peer, sends, recvs)| PairOps {
                boxes,
                peer: *peer,
                sends: sends.clone(),
                recvs: recvs.clone(),
                timeout: self.timeout,
            })
            .collect();
        let mut colls = SmallVec::new();
        if !self.colls.is_empty() {
            colls.push(CollOps {
                boxes,
                ops: self.colls.clone(),
                timeout: self.timeout,
            });
        }
        (pairs, colls)
    }
}

/// Where NCCL's host code has already set up what an operation needs with its peers: NCCL
/// connects a peer at the first send or receive between them, and an algorithm's peers at the
/// first collective that uses it (`NCCL_RUNTIME_CONNECT`, on by default), in the poster's
/// `ncclGroupEnd`, waiting there for the peer's host. A group posted before its peer had
/// posted would make that wait, with this communicator locked, for a peer that may never post
/// (it found a mismatch): so only what was connected before is ever held.
#[derive(Default)]
pub(crate) struct Connected {
    /// Per peer: sends posted to it, receives posted from it.
    p2p: Vec<[bool; 2]>,
    /// The groups of collectives posted, each by its collectives in call order, with
    /// everything but the root and where the buffers live: NCCL picks an algorithm by kind,
    /// type, operator and size (and the world, fixed here), for a group's merged collectives.
    colls: Vec<SmallVec<[CollDesc; 2]>>,
}

/// How many groups of collectives [`Connected`] remembers: a serving loop repeats a few.
const SHAPES: usize = 256;

/// A group's collectives as [`Connected`] remembers them.
fn signature<'a, 'b: 'a>(colls: impl IntoIterator<Item = &'a CollOps<'b>>) -> SmallVec<[CollDesc; 2]> {
    colls
        .into_iter()
        .flat_map(|c| &c.ops)
        .map(|d| CollDesc {
            root: 0,
            captured: false,
            nccl_memory: 0,
            ..*d
        })
        .collect()
}

impl Connected {
    fn p2p(&self, peer: usize, dir: Dir) -> bool {
        self.p2p.get(peer).is_some_and(|s| s[dir as usize])
    }

    /// Notes operations posted on this communicator: NCCL set up what they needed.
    fn posted<'a, 'b: 'a>(
        &mut self,
        pairs: impl Iterator<Item = &'a PairOps<'b>>,
        colls: impl Iterator<Item = &'a CollOps<'b>>,
    ) {
        for p in pairs {
            if self.p2p.len() <= p.peer {
                self.p2p.resize(p.peer + 1, [false; 2]);
            }
            let s = &mut self.p2p[p.peer];
            s[Dir::Send as usize] |= !p.sends.is_empty();
            s[Dir::Recv as usize] |= !p.recvs.is_empty();
        }
        let k = signature(colls);
        if !k.is_empty() && self.colls.len() < SHAPES && !self.colls.contains(&k) {
            self.colls.push(k);
        }
    }
}

/// Whether a group may be held: every peer verified through shared memory, every operation
/// eager, in plain memory, and connected before.
pub(crate) fn may_hold(pairs: &[PairOps<'_>], colls: &[CollOps<'_>]) -> bool {
    let Some(boxes) = pairs.first().map(|p| p.boxes).or(colls.first().map(|c| c.boxes)) else {
        return false;
    };
    let one = pairs.iter().all(|p| std::ptr::eq(p.boxes, boxes))
        && colls.iter().all(|c| std::ptr::eq(c.boxes, boxes));
    // Only shared memory holds (`Transport::holds`): a peer reached through the channel is
    // read from a mirror. Asked without making the route, which would cork the channel.
    if !one || boxes.reaches_remote(pairs, colls) {
        return false;
    }
    let plain = |d: &OpDesc| !d.captured && d.nccl_memory == 0;
    let connected = boxes.connected.borrow();
    let pairs_ok = pairs.iter().all(|p| {
        p.sends.iter().chain(&p.recvs).all(plain)
            && (p.sends.is_empty() || connected.p2p(p.peer, Dir::Send))
            && (p.recvs.is_empty() || connected.p2p(p.peer, Dir::Recv))
    });
    let colls_ok = colls
        .iter()
        .flat_map(|c| &c.ops)
        .all(|d| !d.captured && d.nccl_memory == 0)
        && (colls.is_empty() || connected.colls.contains(&signature(colls)));
    pairs_ok && colls_ok
}

/// What [`verify_or_hold`] found.
pub(crate) enum Verdict {
    /// Every counterpart is there and equal: post as usual.
    Verified,
    /// Some counterpart is not there yet (or an earlier group is held): post behind a gate and
    /// [`Mailboxes::hold`] this.
    Hold(Box<Progress>),
    /// The ring is full before every operation is published (the peer has not checked enough
    /// of this rank's earlier ones): check on the host, from this progress on, once whatever is
    /// held has been.
    NoRoom(Box<Progress>),
}

/// Publishes a group that [`may_hold`], and compares what its peers have posted: a difference
/// is a failure at once, as in [`super::verify`].
pub(crate) fn verify_or_hold(pairs: &[PairOps<'_>], colls: &[CollOps<'_>]) -> Result<Verdict, Failure> {
    let boxes = pairs.first().map(|p| p.boxes).or(colls.first().map(|c| c.boxes));
    let behind = boxes.is_some_and(|b| !b.held.borrow().is_empty());
    let mut progress = Progress::new(pairs, colls);
    if !resume_with(pairs, colls, &mut progress, Wait::PublishOnly)? && !progress.all_published(pairs, colls)
    {
        return Ok(Verdict::NoRoom(Box::new(progress)));
    }
    fence(Ordering::SeqCst);
    if cfg!(handoff_bypass_gate_check) {
        // For the GPU tests only (scripts/stage-device.sh): held without comparing.
        progress.started.get_or_insert_with(Instant::now);
        return Ok(Verdict::Hold(Box::new(progress)));
    }
    let routes = Routes::new(pairs, colls);
    debug_assert!(
        routes.hold(),
        "may_hold let through a group whose transport cannot hold"
    );
    let all = progress.peek(pairs, colls, &routes)?;
    if all && !behind {
        // Every counterpart is there: check them in order now, as `verify` would.
        resume_with(pairs, colls, &mut progress, Wait::Block)?;
        return Ok(Verdict::Verified);
    }
    progress.started.get_or_insert_with(Instant::now);
    Ok(Verdict::Hold(Box::new(progress)))
}

impl Held {
    /// What is left of a group that [`verify_or_hold`] held.
    pub(crate) fn new(pairs: &[PairOps<'_>], colls: &[CollOps<'_>], progress: Box<Progress>) -> Held {
        let timeout = pairs
            .iter()
            .map(|p| p.timeout)
            .chain(colls.iter().map(|c| c.timeout))
            .min()
            .unwrap_or(Duration::ZERO);
        Held {
            pairs: pairs
                .iter()
                .map(|p| (p.peer, p.sends.clone(), p.recvs.clone()))
                .collect(),
            colls: colls.iter().flat_map(|c| c.ops.iter().copied()).collect(),
            timeout,
            progress: *progress,
            ticket: 0,
        }
    }
}

impl Mailboxes {
    /// Notes a group posted: of its `pairs` and `colls`, those of this communicator, whose
    /// connections NCCL has now set up (another communicator's are its own).
    pub(crate) fn note_posted(&self, pairs: &[PairOps<'_>], colls: &[CollOps<'_>]) {
        self.connected.borrow_mut().posted(
            pairs.iter().filter(|p| std::ptr::eq(p.boxes, self)),
            colls.iter().filter(|c| std::ptr::eq(c.boxes, self)),
        );
    }

    /// Queues a group posted behind gate ticket `ticket`, after every group held before.
    pub(crate) fn hold(&self, mut held: Held, ticket: u32) {
        held.ticket = ticket;
        self.held.borrow_mut().push_back(held);
    }

    /// When the oldest held group's timeout ends.
    pub(crate) fn held_deadline(&self) -> Option<Instant> {
        let held = self.held.borrow();
        let h = held.front()?;
        Some(h.progress.started? + h.timeout)
    }

    /// Whether any group is held.
    pub(crate) fn holding(&self) -> bool {
        !self.held.borrow().is_empty()
    }

    /// Compares held groups, oldest first, as far as their counterparts allow (with
    /// [`Wait::Block`]: all of them, waiting with their timeout), calling `open` with each
    /// group's ticket as it passes (its gate and every earlier one may open). Returns whether
    /// any passed, or the failure, after which nothing is held and nothing is verified here any
    /// more ([`Mailboxes::failure`]; the caller breaks the communicator, which opens the gates).
    pub(crate) fn check_held(&self, wait: Wait, open: &mut dyn FnMut(u32)) -> Result<bool, Failure> {
        if let Some(f) = self.failure() {
            return Err(f);
        }
        let mut passed = false;
        loop {
            let held = self.held.borrow();
            let Some(front) = held.front() else {
                return Ok(passed);
            };
            if cfg!(handoff_bypass_gate_check) {
                // For the GPU tests only: opened without comparing.
                let ticket = front.ticket;
                drop(held);
                self.held.borrow_mut().pop_front();
                open(ticket);
                passed = true;
                continue;
            }
            let (pairs, colls) = front.ops(self);
            // A copy: a panic below leaves the held group as it was.
            let mut progress = front.progress.clone();
            drop(held);
            match resume_with(&pairs, &colls, &mut progress, wait) {
                Ok(true) => {
                    let done = self.held.borrow_mut().pop_front().expect("held");
                    open(done.ticket);
                    passed = true;
                }
                Ok(false) => {
                    self.held.borrow_mut().front_mut().expect("held").progress = progress;
                    return Ok(passed);
                }
                Err(f) => {
                    self.held.borrow_mut().clear();
                    *self.failed.borrow_mut() = Some(f.clone());
                    return Err(f);
                }
            }
        }
    }

    /// Why a held group failed, if one did: nothing may be verified here after it.
    pub(crate) fn failure(&self) -> Option<Failure> {
        self.failed.borrow().clone()
    }

    /// Marks this rank's mailbox broken: its peers stop waiting for it.
    pub(crate) fn set_broken(&self) {
        self.mine().set_broken();
    }

    /// Drops every held group (the communicator broke: its gates open with the abort).
    pub(crate) fn forget_held(&self) {
        self.held.borrow_mut().clear();
    }
}

/// The queue of held groups, oldest first.
pub(crate) type HeldQueue = VecDeque<Held>;

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Barrier};

    use super::*;
    use crate::nccl::verify::mailbox::Region;

    /// Two ranks publish a differing send and receive at the same moment, many times: at least
    /// one of them sees the other's entry and refuses, so never do both go to NCCL unchecked.
    #[test]
    fn of_two_ranks_posting_at_once_one_always_compares() {
        let rounds = 20_000;
        let barrier = Arc::new(Barrier::new(2));
        let worlds: Vec<Vec<Mailboxes>> = (0..rounds)
            .map(|_| {
                let regions: Arc<[Arc<Region>]> =
                    (0..2).map(|r| Arc::new(Region::in_process(2, r))).collect();
                (0..2).map(|r| Mailboxes::new(r, regions.clone())).collect()
            })
            .collect();
        let (mut zeros, mut ones) = (Vec::new(), Vec::new());
        for mut w in worlds {
            ones.push(w.pop().expect("rank 1"));
            zeros.push(w.pop().expect("rank 0"));
        }
        let run = |rank: usize, boxes: Vec<Mailboxes>, barrier: Arc<Barrier>| {
            std::thread::spawn(move || {
                boxes
                    .iter()
                    .map(|b| {
                        let (sends, recvs) = if rank == 0 {
                            (vec![OpDesc::f32_p2p(8)], vec![])
                        } else {
                            (vec![], vec![OpDesc::f32_p2p(7)])
                        };
                        let p = PairOps {
                            boxes: b,
                            peer: 1 - rank,
                            sends: sends.into(),
                            recvs: recvs.into(),
                            timeout: Duration::from_secs(5),
                        };
                        barrier.wait();
                        match verify_or_hold(&[p], &[]) {
                            Ok(Verdict::Hold(_)) => 'h',
                            Ok(Verdict::Verified | Verdict::NoRoom(_)) => 'v',
                            Err(Failure::Mismatch(_)) => 'm',
                            Err(f) => panic!("{f:?}"),
                        }
                    })
                    .collect::<Vec<char>>()
            })
        };
        let a = run(0, zeros, barrier.clone());
        let b = run(1, ones, barrier);
        let (a, b) = (a.join().expect("rank 0"), b.join().expect("rank 1"));
        let both_held = a.iter().zip(&b).filter(|(x, y)| **x == 'h' && **y == 'h').count();
        let held = a.iter().chain(&b).filter(|x| **x == 'h').count();
        assert!(a.iter().chain(&b).all(|x| *x != 'v'), "a difference verified");
        assert_eq!(
            both_held, 0,
            "{both_held} of {rounds} rounds went to NCCL unchecked on both ranks"
        );
        // Both outcomes occur: one rank first (it holds), or both compare.
        println!("{held} holds in {rounds} rounds");
    }

    /// A group over two communicators notes each one's operations on that one only: NCCL
    /// connected communicator A's peer, not B's, and a first send on B must not be held (it
    /// would wait for the peer's host inside `ncclGroupEnd`).
    #[test]
    fn what_one_communicator_posted_connects_only_that_one() {
        let (a, _) = two_boxes();
        let (b, _) = two_boxes();
        let t = Duration::from_secs(1);
        let on_a = pair_of(&a, 1, &[8], &[8], t);
        a.note_posted(std::slice::from_ref(&on_a), &[]);
        b.note_posted(std::slice::from_ref(&on_a), &[]);
        assert!(
            may_hold(&[pair_of(&a, 1, &[8], &[8], t)], &[]),
            "A's peer is connected"
        );
        assert!(
            !may_hold(&[pair_of(&b, 1, &[8], &[], t)], &[]),
            "B's send was held"
        );
        assert!(
            !may_hold(&[pair_of(&b, 1, &[], &[8], t)], &[]),
            "B's receive was held"
        );
    }

    /// A peer verified through the channel is never held: its entries are read from a mirror,
    /// which the Dekker argument does not cover ([`crate::nccl::verify::transport::Transport::holds`]).
    /// The same connected send and receive may be held through shared memory.
    #[test]
    fn only_shared_memory_holds() {
        use crate::nccl::verify::Via;
        let t = Duration::from_secs(1);
        for via in Via::BOTH {
            let w = via.world(2);
            let done = pair_of(&w[0], 1, &[8], &[8], t);
            w[0].note_posted(std::slice::from_ref(&done), &[]);
            let held = may_hold(&[pair_of(&w[0], 1, &[8], &[8], t)], &[]);
            assert_eq!(held, via == Via::Memory, "{via:?}");
        }
    }

    // The review of held groups (2026-12-04): each failed before its fix.
    fn two_boxes() -> (Mailboxes, Mailboxes) {
        let regions: Arc<[Arc<Region>]> = (0..2).map(|r| Arc::new(Region::in_process(2, r))).collect();
        (Mailboxes::new(0, regions.clone()), Mailboxes::new(1, regions))
    }

    fn pair_of<'a>(b: &'a Mailboxes, peer: usize, sends: &[u64], recvs: &[u64], t: Duration) -> PairOps<'a> {
        PairOps {
            boxes: b,
            peer,
            sends: sends.iter().map(|&c| OpDesc::f32_p2p(c)).collect(),
            recvs: recvs.iter().map(|&c| OpDesc::f32_p2p(c)).collect(),
            timeout: t,
        }
    }

    /// One group of 300 sends on rank 0 and one of 300 receives on rank 1, both holdable: more
    /// than the ring, so neither can publish all before the other checks. Was a timeout on
    /// both (publishing waited for ring space, checking nothing); now each says `NoRoom`.
    #[test]
    fn one_group_each_way_longer_than_the_ring_is_checked_not_held() {
        let (b0, b1) = two_boxes();
        let counts: Vec<u64> = (1..=300).collect();
        let c1 = counts.clone();
        let t = Duration::from_secs(2);
        let a = std::thread::spawn(move || {
            let p = [pair_of(&b0, 1, &counts, &[], t)];
            outcome(&p, verify_or_hold(&p, &[]))
        });
        let b = std::thread::spawn(move || {
            let p = [pair_of(&b1, 0, &[], &c1, t)];
            outcome(&p, verify_or_hold(&p, &[]))
        });
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        println!("ring: rank 0: {a}; rank 1: {b}");
        assert!(
            a == "checked on the host" && b == "checked on the host",
            "rank 0: {a}; rank 1: {b}"
        );
    }

    /// What became of a group: a hold, a verification, or (no room) its check on the host.
    fn outcome(pairs: &[PairOps<'_>], r: Result<Verdict, Failure>) -> String {
        match r {
            Ok(Verdict::Hold(_)) => "hold".into(),
            Ok(Verdict::Verified) => "verified".into(),
            Ok(Verdict::NoRoom(mut progress)) => match resume_with(pairs, &[], &mut progress, Wait::Block) {
                Ok(_) => "checked on the host".into(),
                Err(f) => format!("{f:?}"),
            },
            Err(f) => format!("{f:?}"),
        }
    }

    /// Rank 0 holds two sends, then (a group that cannot be held) settles them with Wait::Block;
    /// rank 1 posts receive #0, waits for its data (the gate of #0 open), then posts receive #1.
    /// Was a timeout: no gate opened until every held group had passed.
    #[test]
    fn settling_on_the_host_opens_each_gate_as_its_group_passes() {
        use std::sync::atomic::AtomicU32;
        let (b0, b1) = two_boxes();
        let gate = Arc::new(AtomicU32::new(0));
        let barrier = Arc::new(Barrier::new(2));
        let t = Duration::from_secs(1);
        let (g0, bar0) = (gate.clone(), barrier.clone());
        let p = std::thread::spawn(move || {
            for ticket in 1..=2u32 {
                let pr = pair_of(&b0, 1, &[8], &[], t);
                match verify_or_hold(std::slice::from_ref(&pr), &[]) {
                    Ok(Verdict::Hold(progress)) => b0.hold(Held::new(&[pr], &[], progress), ticket),
                    _ => panic!("expected a hold"),
                }
            }
            bar0.wait();
            let r = b0.check_held(Wait::Block, &mut |t| g0.store(t, Ordering::SeqCst));
            format!("{r:?}")
        });
        let c = std::thread::spawn(move || {
            barrier.wait();
            crate::nccl::verify::verify(&[pair_of(&b1, 0, &[], &[8], Duration::from_secs(5))], &[]).unwrap();
            let start = Instant::now();
            // "synchronize" on receive #0: its sender's kernel waits for gate ticket 1.
            while gate.load(Ordering::SeqCst) < 1 {
                if start.elapsed() > Duration::from_secs(3) {
                    return "receive #0 never completed (gate 1 never opened)".to_string();
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            format!(
                "{:?}",
                crate::nccl::verify::verify(&[pair_of(&b1, 0, &[], &[8], Duration::from_secs(5))], &[])
            )
        });
        let (p, c) = (p.join().unwrap(), c.join().unwrap());
        println!("settle: producer check_held(Block): {p}; consumer: {c}");
        assert!(p.starts_with("Ok"), "producer: {p}; consumer: {c}");
    }

    /// After a held group's check fails and the queue is cleared (what the gatekeeper does
    /// before its break, which may find the state locked), the counters stop at that group: a
    /// later `verify` would compare against the wrong counterpart and pass a pair that differs
    /// while the peer holds its side unchecked. It fails with the held group's failure instead.
    #[test]
    fn after_a_held_group_fails_nothing_more_is_verified() {
        let (b0, b1) = two_boxes();
        let long = Duration::from_secs(5);
        // 1. Rank 0 holds send(8) #0 (timeout 0: it fails at its first check).
        let pr = pair_of(&b0, 1, &[8], &[], Duration::ZERO);
        let Ok(Verdict::Hold(progress)) = verify_or_hold(std::slice::from_ref(&pr), &[]) else {
            panic!("hold")
        };
        b0.hold(Held::new(&[pr], &[], progress), 1);
        // 2. The gatekeeper's check: Timeout, queue cleared (the communicator not yet broken).
        let f = b0.check_held(Wait::Publish, &mut |_| {});
        assert!(matches!(f, Err(Failure::Timeout { .. })), "{f:?}");
        assert!(!b0.holding());
        // 3. Rank 1, late: receive(8) #0 matches and is verified.
        crate::nccl::verify::verify(&[pair_of(&b1, 0, &[], &[8], long)], &[]).unwrap();
        // 4. Rank 1: receive(4) #1, before rank 0 published #1: held.
        let r1 = verify_or_hold(&[pair_of(&b1, 0, &[], &[4], long)], &[]);
        assert!(matches!(r1, Ok(Verdict::Hold(_))), "rank 1's receive #1 is held");
        // 5. Rank 0: send(8) #1 by the non-held path (registered memory, two communicators...).
        let r0 = crate::nccl::verify::verify(&[pair_of(&b0, 1, &[8], &[], long)], &[]);
        println!("misalign: rank 0's send(8) #1 against rank 1's held receive(4) #1: {r0:?}");
        assert!(
            r0.is_err(),
            "rank 0 verified send(8) #1 while rank 1 holds receive(4) #1"
        );
    }
}
