//! What NCCL matches, as verification models it: the one place that says which sends and
//! receives a group hands NCCL, per peer and in which order.
//!
//! NCCL 2.28 (src/enqueue.cc, `taskAppend` and `p2pTaskAppend`, at v2.28.3-1) keeps, per
//! communicator and per peer, one queue of sends and one of receives. `ncclSend` and `ncclRecv`
//! append to them; so do `ncclAlltoAll`, `ncclGather` and `ncclScatter`, which NCCL runs as
//! sends and receives:
//! - all_to_all: for each rank `r` in rank order, a send of `count` to `r`, then a receive of
//!   `count` from `r`;
//! - gather: a send of `count` to the root; then, on the root only, a receive of `count` from
//!   each rank in rank order;
//! - scatter: on the root only, a send of `count` to each rank in rank order; then a receive of
//!   `count` from the root;
//!
//! and none of them for a count of 0 ("empty collectives can be discarded") or on a one-rank
//! communicator (`ncclLaunchOneRank`, a local copy). The other collectives do not touch these
//! queues. NCCL then pairs the `i`-th send from `a` to `b` with the `i`-th receive of `b` from
//! `a`, whatever groups they were posted in (one communicator's kernels run in order), and
//! copies the sender's bytes into the receiver's buffer without comparing sizes: a send longer
//! than its receive writes past it (BENCHMARKS.md, "what NCCL 2.28 does with unmatched and
//! uneven point-to-point calls").
//!
//! So verification compares, per pair and direction, the sequence [`expand`] makes of each
//! rank's calls in the order handoff posts them ([`crate::Group`] posts in call order), every
//! element tagged with what it is part of ([`OpDesc::part`]): both ranks agree on every pairing
//! NCCL will make, or neither calls NCCL. Collectives are also checked as a whole (every rank
//! posts the same ones, in the same order), in their own ring. Group boundaries do not change
//! NCCL's pairings; a rank that groups differently from its peer can make NCCL wait for itself
//! (a send and a receive with one peer grouped on one side and posted one after the other on
//! the other side), which the watchdog bounds.
//!
//! NCCL's copy-engine collectives bypass the queues: all_gather, all_to_all, gather and scatter
//! whose buffers both lie in symmetric windows, on a one-node communicator with symmetric
//! support and the zero-CTA policy (`taskAppend`, the `ceCollTaskAppend` branch). Windows are
//! made only by the `unsafe` [`crate::Communicator::register_window`], whose contract covers
//! how every rank passes them; this model is that of every other collective.

use crate::nccl::verify::wire::{CollDesc, CollKind, Dir, NCCL_MEMORY, OpDesc, REGISTERED};

/// One call of a group, as [`expand`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    /// A send (`Dir::Send`) to or a receive (`Dir::Recv`) from `peer`, of a nonzero count
    /// (handoff posts no empty send or receive, on either side).
    P2p { peer: usize, dir: Dir, desc: OpDesc },
    /// A collective.
    Coll(CollDesc),
}

/// The sends and receives NCCL queues for one call of rank `rank` in a communicator of `world`
/// ranks, in NCCL's order, each with its peer.
pub(crate) fn expand(call: Call, rank: usize, world: usize) -> impl Iterator<Item = (usize, Dir, OpDesc)> {
    let (p2p, coll) = match call {
        Call::P2p { peer, dir, desc } => (Some((peer, dir, desc)), None),
        Call::Coll(c) => (None, Some(c).filter(|c| c.count > 0 && world > 1)),
    };
    let (kind, root, desc, memory) = match coll {
        Some(c) => (
            Some(c.kind),
            c.root as usize,
            OpDesc {
                count: c.count,
                dtype: c.dtype,
                captured: c.captured,
                nccl_memory: 0,
                part: c.kind as u8,
            },
            c.nccl_memory,
        ),
        None => (None, 0, OpDesc::default(), 0),
    };
    // How many parts the root has beyond the others'.
    let at_root = if rank == root { world } else { 0 };
    let parts = match kind {
        Some(CollKind::AllToAll) => 2 * world,
        Some(CollKind::Gather | CollKind::Scatter) => 1 + at_root,
        _ => 0,
    };
    let part = move |i: usize| {
        let (peer, dir) = match kind {
            Some(CollKind::AllToAll) => (i / 2, if i.is_multiple_of(2) { Dir::Send } else { Dir::Recv }),
            Some(CollKind::Gather) if i == 0 => (root, Dir::Send),
            Some(CollKind::Gather) => (i - 1, Dir::Recv),
            _ if i < at_root => (i, Dir::Send),
            _ => (root, Dir::Recv),
        };
        // A send part moves the input's memory (bits 0 and 2), a receive part the output's
        // (bits 1 and 3); NCCL never registers a part with oneself (`!selfSend`).
        let of = if dir == Dir::Send { memory } else { memory >> 1 };
        let nccl_memory = if peer == rank {
            0
        } else {
            ((of & 1) * NCCL_MEMORY) | (((of >> 2) & 1) * REGISTERED)
        };
        (peer, dir, OpDesc { nccl_memory, ..desc })
    };
    p2p.into_iter().chain((0..parts).map(part))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nccl::verify::wire::{NONE, P2P};

    const F32: u32 = 7;

    fn coll(kind: CollKind, count: u64, root: u32) -> CollDesc {
        CollDesc {
            kind,
            count,
            dtype: F32,
            redop: NONE,
            root,
            captured: false,
            nccl_memory: 0,
        }
    }

    fn peers(call: Call, rank: usize, world: usize) -> Vec<(usize, Dir)> {
        expand(call, rank, world).map(|(p, d, _)| (p, d)).collect()
    }

    #[test]
    fn collectives_expand_as_ncclss_task_append_does() {
        use Dir::{Recv, Send};
        let g = Call::Coll(coll(CollKind::Gather, 3, 1));
        assert_eq!(peers(g, 0, 3), [(1, Send)]);
        assert_eq!(peers(g, 1, 3), [(1, Send), (0, Recv), (1, Recv), (2, Recv)]);
        let s = Call::Coll(coll(CollKind::Scatter, 3, 1));
        assert_eq!(peers(s, 2, 3), [(1, Recv)]);
        assert_eq!(peers(s, 1, 3), [(0, Send), (1, Send), (2, Send), (1, Recv)]);
        let a = Call::Coll(coll(CollKind::AllToAll, 3, NONE));
        assert_eq!(peers(a, 1, 2), [(0, Send), (0, Recv), (1, Send), (1, Recv)]);
        let d: Vec<OpDesc> = expand(g, 0, 3).map(|(_, _, d)| d).collect();
        assert_eq!(d[0].count, 3);
        assert_eq!(d[0].part, CollKind::Gather as u8);
        // The others, empty ones and one-rank communicators queue nothing.
        assert!(peers(Call::Coll(coll(CollKind::AllReduce, 3, NONE)), 0, 2).is_empty());
        assert!(peers(Call::Coll(coll(CollKind::Gather, 0, 0)), 0, 2).is_empty());
        assert!(peers(Call::Coll(coll(CollKind::AllToAll, 4, NONE)), 0, 1).is_empty());
        // A captured collective's parts carry the kind of memory they move: the input's for
        // sends, the output's for receives, never for a part with oneself.
        let captured = CollDesc {
            captured: true,
            nccl_memory: 2,
            ..coll(CollKind::AllToAll, 3, NONE)
        };
        let bits: Vec<(usize, Dir, u8)> = expand(Call::Coll(captured), 0, 2)
            .map(|(p, d, o)| (p, d, o.nccl_memory))
            .collect();
        assert_eq!(
            bits,
            [(0, Send, 0), (0, Recv, 0), (1, Send, 0), (1, Recv, NCCL_MEMORY)]
        );
        // Registered input (bit 2) and output (bit 3): every part with a peer says so.
        let registered = CollDesc {
            nccl_memory: 4 | 8,
            ..captured
        };
        let bits: Vec<u8> = expand(Call::Coll(registered), 0, 2)
            .map(|(.., o)| o.nccl_memory)
            .collect();
        assert_eq!(bits, [0, 0, REGISTERED, REGISTERED]);
        let p = Call::P2p {
            peer: 1,
            dir: Recv,
            desc: OpDesc {
                count: 2,
                dtype: F32,
                captured: false,
                nccl_memory: 0,
                part: P2P,
            },
        };
        assert_eq!(peers(p, 0, 2), [(1, Recv)]);
    }
}

/// The model against NCCL itself, and verification against the model: for every program of up
/// to two calls per rank on two ranks (and random programs on three), verification passes if
/// and only if NCCL would pair every send with a receive of the same size meant for it.
#[cfg(test)]
mod oracle {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::nccl::verify::local::{self, TestRank as Rank};
    use crate::nccl::verify::mailbox::Region;
    use crate::nccl::verify::wire::{NONE, P2P};
    use crate::nccl::verify::{CollOps, Mailboxes, PairOps, verify};

    const F32: u32 = 7;

    /// A call as a user writes it.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum UserCall {
        Send { peer: usize, count: u64 },
        Recv { peer: usize, count: u64 },
        Gather { root: usize, count: u64 },
        Scatter { root: usize, count: u64 },
        AllToAll { count: u64 },
    }

    /// One of NCCL's per-peer tasks: its bytes, and what it belongs to (a user's send or
    /// receive: `None`; the `k`-th collective of its rank: `Some(k)`).
    #[derive(Debug, Clone, Copy, PartialEq)]
    struct Task {
        bytes: u64,
        of: Option<usize>,
    }

    /// NCCL's queues of a program, written down from v2.28.3's `taskAppend` (src/enqueue.cc)
    /// independently of [`expand`]: `queues[a][b]` is (rank a's sends to b, rank a's receives
    /// from b), and `colls[a]` rank a's collectives, as (kind, count, root).
    #[allow(clippy::type_complexity)]
    fn nccl(programs: &[Vec<UserCall>]) -> (Vec<Vec<(Vec<Task>, Vec<Task>)>>, Vec<Vec<(u8, u64, usize)>>) {
        let n = programs.len();
        let mut queues = vec![vec![(Vec::new(), Vec::new()); n]; n];
        let mut colls = vec![Vec::new(); n];
        for (rank, calls) in programs.iter().enumerate() {
            for &call in calls {
                let k = Some(colls[rank].len());
                let q = &mut queues[rank];
                let task = |count: u64, of| Task { bytes: count * 4, of };
                match call {
                    UserCall::Send { peer, count } => q[peer].0.push(task(count, None)),
                    UserCall::Recv { peer, count } => q[peer].1.push(task(count, None)),
                    // if (info->coll == ncclFuncAlltoAll) for r: Send r, Recv r
                    UserCall::AllToAll { count } => {
                        for q in q.iter_mut() {
                            q.0.push(task(count, k));
                            q.1.push(task(count, k));
                        }
                        colls[rank].push((CollKind::AllToAll as u8, count, usize::MAX));
                    }
                    // Send root; if (rank == root) for r: Recv r
                    UserCall::Gather { root, count } => {
                        q[root].0.push(task(count, k));
                        if rank == root {
                            for q in q.iter_mut() {
                                q.1.push(task(count, k));
                            }
                        }
                        colls[rank].push((CollKind::Gather as u8, count, root));
                    }
                    // if (rank == root) for r: Send r; Recv root
                    UserCall::Scatter { root, count } => {
                        if rank == root {
                            for q in q.iter_mut() {
                                q.0.push(task(count, k));
                            }
                        }
                        q[root].1.push(task(count, k));
                        colls[rank].push((CollKind::Scatter as u8, count, root));
                    }
                }
            }
        }
        (queues, colls)
    }

    /// Whether NCCL would run the program as meant: every rank posts the same collectives, and
    /// pairs each send with a receive of the same size and purpose, none left over.
    fn exact(programs: &[Vec<UserCall>]) -> bool {
        let (queues, colls) = nccl(programs);
        let n = programs.len();
        colls.iter().all(|c| *c == colls[0])
            && (0..n).all(|a| (0..n).all(|b| queues[a][b].0 == queues[b][a].1))
    }

    /// Whether NCCL would write past a receive.
    fn overruns(programs: &[Vec<UserCall>]) -> bool {
        let (queues, _) = nccl(programs);
        let n = programs.len();
        (0..n).any(|a| {
            (0..n).any(|b| {
                let (sends, recvs) = (&queues[a][b].0, &queues[b][a].1);
                sends.iter().zip(recvs).any(|(s, r)| s.bytes > r.bytes)
            })
        })
    }

    fn calls(program: &[UserCall]) -> Vec<Call> {
        let p2p = |peer, dir, count| Call::P2p {
            peer,
            dir,
            desc: OpDesc {
                count,
                dtype: F32,
                captured: false,
                nccl_memory: 0,
                part: P2P,
            },
        };
        let coll = |kind, count, root: usize| {
            Call::Coll(CollDesc {
                kind,
                count,
                dtype: F32,
                redop: NONE,
                root: root as u32,
                captured: false,
                nccl_memory: 0,
            })
        };
        program
            .iter()
            .map(|&c| match c {
                UserCall::Send { peer, count } => p2p(peer, Dir::Send, count),
                UserCall::Recv { peer, count } => p2p(peer, Dir::Recv, count),
                UserCall::AllToAll { count } => coll(CollKind::AllToAll, count, NONE as usize),
                UserCall::Gather { root, count } => coll(CollKind::Gather, count, root),
                UserCall::Scatter { root, count } => coll(CollKind::Scatter, count, root),
            })
            .collect()
    }

    /// The local match, as a group of `init_all` ranks runs it (one thread, every rank's calls
    /// in one group): `true` if it passes.
    fn matched_locally(programs: &[Vec<UserCall>]) -> bool {
        let world = programs.len();
        let members: Vec<Rank> = (0..world)
            .map(|rank| Rank {
                rank,
                world,
                clique: true,
            })
            .collect();
        let mut queued = Vec::new();
        let mut colls = Vec::new();
        for (&r, program) in members.iter().zip(programs) {
            for call in calls(program) {
                if let Call::Coll(c) = call {
                    colls.push((r, c));
                }
                queued.extend(expand(call, r.rank, world).map(|(peer, dir, desc)| (r, peer, dir, desc)));
            }
        }
        local::match_pairs(&members, &queued).is_ok() && local::match_collectives(&members, &colls).is_ok()
    }

    /// What ranks in processes of their own run: each matches its sends to itself locally,
    /// and everything else goes through the mailboxes, here with every rank's calls given at
    /// once (so a stall is final: no wait).
    fn verified(programs: &[Vec<UserCall>]) -> bool {
        let world = programs.len();
        for (rank, program) in programs.iter().enumerate() {
            let me = Rank {
                rank,
                world,
                clique: false,
            };
            let mut queued = Vec::new();
            for call in calls(program) {
                queued.extend(expand(call, rank, world).map(|(peer, dir, desc)| (me, peer, dir, desc)));
            }
            if local::match_pairs(&[me], &queued).is_err() {
                return false;
            }
        }
        let regions: Arc<[Arc<Region>]> = (0..world)
            .map(|r| Arc::new(Region::in_process(world, r)))
            .collect();
        let boxes: Vec<Mailboxes> = (0..world).map(|r| Mailboxes::new(r, regions.clone())).collect();
        let mut pairs: Vec<PairOps<'_>> = Vec::new();
        let mut colls: Vec<CollOps<'_>> = Vec::new();
        for (rank, program) in programs.iter().enumerate() {
            let mine = &boxes[rank];
            let mut coll_ops = Vec::new();
            for call in calls(program) {
                if let Call::Coll(c) = call {
                    coll_ops.push(c);
                }
                for (peer, dir, desc) in expand(call, rank, world).filter(|&(peer, ..)| peer != rank) {
                    let i = match pairs
                        .iter()
                        .position(|p| std::ptr::eq(p.boxes, mine) && p.peer == peer)
                    {
                        Some(i) => i,
                        None => {
                            pairs.push(PairOps {
                                boxes: mine,
                                peer,
                                sends: Default::default(),
                                recvs: Default::default(),
                                timeout: Duration::ZERO,
                            });
                            pairs.len() - 1
                        }
                    };
                    match dir {
                        Dir::Send => pairs[i].sends.push(desc),
                        Dir::Recv => pairs[i].recvs.push(desc),
                    }
                }
            }
            colls.push(CollOps {
                boxes: mine,
                ops: coll_ops.into(),
                timeout: Duration::ZERO,
            });
        }
        verify(&pairs, &colls).is_ok()
    }

    fn alphabet(world: usize) -> Vec<UserCall> {
        let mut a = Vec::new();
        for peer in 0..world {
            for count in [1, 2] {
                a.push(UserCall::Send { peer, count });
                a.push(UserCall::Recv { peer, count });
            }
            a.push(UserCall::Gather { root: peer, count: 1 });
            a.push(UserCall::Scatter { root: peer, count: 1 });
        }
        a.push(UserCall::AllToAll { count: 1 });
        a
    }

    /// Both ways of matching, the local match and the mailboxes', hold to what NCCL pairs.
    fn check(programs: &[Vec<UserCall>]) {
        let e = exact(programs);
        for (how, v) in [
            ("the local match", matched_locally(programs)),
            ("verification", verified(programs)),
        ] {
            assert_eq!(
                v,
                e,
                "{how} {} but NCCL would {}run it as meant: {programs:?}",
                if v { "passes" } else { "refuses" },
                if e { "" } else { "not " }
            );
        }
    }

    #[test]
    fn every_two_rank_program_of_two_calls_per_rank_is_verified_exactly_as_nccl_pairs_it() {
        let a = alphabet(2);
        let mut programs: Vec<Vec<UserCall>> = vec![Vec::new()];
        programs.extend(a.iter().map(|&c| vec![c]));
        for &x in &a {
            for &y in &a {
                programs.push(vec![x, y]);
            }
        }
        let (mut cases, mut overrunning) = (0, 0);
        for p0 in &programs {
            for p1 in &programs {
                let both = [p0.clone(), p1.clone()];
                check(&both);
                cases += 1;
                overrunning += usize::from(overruns(&both));
            }
        }
        // The programs on which NCCL would write past a receive are among those checked.
        assert!(overrunning > 0);
        println!("{cases} two-rank programs, {overrunning} of them overrunning a receive in NCCL");
    }

    #[test]
    fn random_three_rank_programs_are_verified_exactly_as_nccl_pairs_them() {
        use proptest::test_runner::{Config, TestRunner};
        let a = alphabet(3);
        let program = proptest::collection::vec(proptest::sample::select(a), 0..=3);
        let cases = 3000;
        let mut runner = TestRunner::new(Config {
            cases,
            ..Config::default()
        });
        runner
            .run(&[program.clone(), program.clone(), program], |p| {
                check(&p);
                Ok(())
            })
            .unwrap();
        println!("{cases} random three-rank programs");
    }

    #[test]
    fn the_reviewed_case_is_refused() {
        // Rank 1 groups a send of 4096 to rank 0 with a gather of 1 to root 0; rank 0 posts the
        // gather, then its receive of 4096: NCCL pairs the 4096-element send with the gather's
        // one-element receive.
        let programs = [
            vec![
                UserCall::Gather { root: 0, count: 1 },
                UserCall::Recv { peer: 1, count: 4096 },
            ],
            vec![
                UserCall::Send { peer: 0, count: 4096 },
                UserCall::Gather { root: 0, count: 1 },
            ],
        ];
        assert!(overruns(&programs));
        assert!(!verified(&programs));
    }
}
