//! Held groups on the GPU (issue 30): a verified operation whose peer's host has not posted
//! yet goes to NCCL at once, behind a gate (`cuStreamWaitValue32` on a word of mapped host
//! memory) that opens once verification has compared it. Two ranks in two processes (sharing
//! the GPU where there is one), each first exchanging one send and receive and one all-reduce
//! (NCCL connects at the first; only what was connected is held). Then one rank's host is late:
//! - by 300 ms, with matching operations: the other rank's call returns at once and the data
//!   arrives;
//! - by 300 ms, with a different count: the late rank gets `Error::Mismatch` at once, the held
//!   rank from its next call; no byte of the peer's data reaches either rank's buffer, and
//!   nothing past a buffer's end changes. Once for a held send, once for a held receive, once
//!   for a held all-reduce.
//!
//! Built with `--cfg handoff_bypass_gate_check` (scripts/stage-device.sh), a held group is
//! neither compared when posted nor when its gate opens: the mismatch cases must then FAIL.

mod common;

use std::time::{Duration, Instant};

use common::Gpus;
use handoff::{CommOptions, Communicator, DeviceBuffer, Error, ReduceOp, Stream};
use libtest_mimic::Failed;

const LATE: Duration = Duration::from_millis(300);
/// What a rank's buffers hold before: no rank sends it.
const CANARY: f32 = -1.0;
/// What the sender sends.
const SENT: f32 = 7.0;

fn options() -> CommOptions {
    CommOptions::default().with_timeout(Duration::from_secs(20))
}

/// One send and receive of 4, rank 0 to rank 1, and an all-reduce of every size the tests
/// use (NCCL connects per algorithm, which it picks by size: only a size seen before is
/// held), waited for.
fn connect(comm: &Communicator, s: &Stream) -> handoff::Result<()> {
    let mut x = DeviceBuffer::<f32>::zeros(1 << 20, s)?;
    if comm.rank() == 0 {
        comm.send(x.slice(..4)?, 1, s)?;
    } else {
        comm.recv(x.slice_mut(..4)?, 0, s)?;
    }
    for n in [200, 256, 1 << 20] {
        comm.all_reduce_in_place(x.slice_mut(..n)?, ReduceOp::Sum, s)?;
    }
    comm.barrier_wait(s)
}

fn held_operations_deliver() -> Result<(), Failed> {
    let results = common::two_ranks([options(), options()], |made| {
        let run = || -> handoff::Result<String> {
            let comm = made?;
            let s = Stream::new(comm.device())?;
            connect(&comm, &s)?;
            let n = 1 << 20;
            let x = DeviceBuffer::from_slice(&vec![SENT; n], &s)?;
            let mut y = DeviceBuffer::from_slice(&vec![CANARY; n], &s)?;
            let mut r = DeviceBuffer::<f32>::zeros(n, &s)?;
            let (send, reduce) = if comm.rank() == 0 {
                let t = Instant::now();
                comm.send(&x, 1, &s)?;
                let send = t.elapsed();
                let t = Instant::now();
                comm.all_reduce(&x, &mut r, ReduceOp::Sum, &s)?;
                (send, t.elapsed())
            } else {
                std::thread::sleep(LATE);
                comm.recv(&mut y, 0, &s)?;
                std::thread::sleep(LATE);
                comm.all_reduce(&x, &mut r, ReduceOp::Sum, &s)?;
                (Duration::ZERO, Duration::ZERO)
            };
            comm.wait_stream(&s)?;
            let sums = r.to_vec(&s)?;
            let got = y.to_vec(&s)?;
            if sums.iter().any(|&v| v != 2.0 * SENT) {
                return Err(Error::InvalidArgument("the all-reduce's values are wrong".into()));
            }
            if comm.rank() == 1 && got.iter().any(|&v| v != SENT) {
                return Err(Error::InvalidArgument("the received values are wrong".into()));
            }
            Ok(format!(
                "send returned after {send:?}, all_reduce after {reduce:?}"
            ))
        };
        let said = run().map_err(|e| e.to_string())?;
        Ok(said)
    })?;
    let [a, b] = common::both_ok(results)?;
    println!("rank 0: {a}; rank 1: {b}");
    Ok(())
}

/// Which rank's operation is held (posted first) in a mismatch.
#[derive(Clone, Copy, Debug)]
enum HeldSide {
    Send,
    Recv,
    AllReduce,
}

/// What a rank saw: its error (from the call or, held, from its next), and how many elements
/// of its buffer, and of the canary past it, changed, and whether any holds the peer's value.
#[derive(Debug)]
struct Seen {
    error: String,
    mismatch: bool,
    changed: usize,
    canary_changed: usize,
    peer_data: bool,
}

/// [`Seen`] as the rank processes send it back (JSON of a tuple).
type SeenWire = (String, bool, usize, usize, bool);

fn mismatch(side: HeldSide) -> Result<(), Failed> {
    let results = common::two_ranks([options(), options()], move |made| {
        let run = || -> handoff::Result<SeenWire> {
            let comm = made?;
            let s = Stream::new(comm.device())?;
            connect(&comm, &s)?;
            let rank = comm.rank();
            // The held rank posts at once; the other 300 ms later, with a different count.
            let held = match side {
                HeldSide::Send | HeldSide::AllReduce => rank == 0,
                HeldSide::Recv => rank == 1,
            };
            let (mine, theirs) = (256usize, 200usize);
            let n = if held { mine } else { theirs };
            let len = mine.max(theirs) + 64;
            // Each rank's input its own: rank 0's is SENT, rank 1's SENT + 2.
            let mine_in = SENT + 2.0 * rank as f32;
            let peer_in = SENT + 2.0 * (1 - rank) as f32;
            let x = DeviceBuffer::from_slice(&vec![mine_in; len], &s)?;
            let mut y = DeviceBuffer::from_slice(&vec![CANARY; len], &s)?;
            if !held {
                std::thread::sleep(LATE);
            }
            let first = match (side, rank) {
                (HeldSide::AllReduce, _) => {
                    comm.all_reduce(x.slice(..n)?, y.slice_mut(..n)?, ReduceOp::Sum, &s)
                }
                (_, 0) => comm.send(x.slice(..n)?, 1, &s),
                _ => comm.recv(y.slice_mut(..n)?, 0, &s),
            };
            let error = match (held, first) {
                (false, r) => r,
                // Held: it returned; its failure comes with the next call.
                (true, Ok(())) => comm.wait_stream(&s).and_then(|()| comm.barrier(&s)),
                (true, Err(e)) => Err(e),
            };
            let error = match error {
                Ok(()) => "no error".to_string(),
                Err(e) => format!("{e:?}"),
            };
            // The buffer as it is once the GPU is done with it (an abort ends the kernels), read
            // through a device copy: a host read of the buffer itself reports the failed
            // operation that wrote it last.
            let _ = s.synchronize();
            let mut copy = DeviceBuffer::<f32>::zeros(len, &s)?;
            copy.slice_mut(..)?.copy_from(&y, &s)?;
            let after = copy.to_vec(&s)?;
            Ok((
                error.clone(),
                error.starts_with("Mismatch"),
                after[..n].iter().filter(|&&v| v != CANARY).count(),
                after[n..].iter().filter(|&&v| v != CANARY).count(),
                after.iter().any(|&v| v == peer_in || v == mine_in + peer_in),
            ))
        };
        run().map_err(|e| e.to_string())
    })?;
    let seen = common::both_ok(results)?.map(|(error, mismatch, changed, canary_changed, peer_data)| Seen {
        error,
        mismatch,
        changed,
        canary_changed,
        peer_data,
    });
    let mut wrong = Vec::new();
    for (rank, s) in seen.iter().enumerate() {
        println!(
            "{side:?} held, rank {rank}: {}; {} elements of its buffer changed, {} past its end; \
             the peer's data there: {}",
            s.error, s.changed, s.canary_changed, s.peer_data
        );
        if !s.mismatch {
            wrong.push(format!("rank {rank} got {}, want Error::Mismatch", s.error));
        }
        if s.peer_data || s.canary_changed > 0 {
            wrong.push(format!(
                "rank {rank}: the peer's data arrived ({}) or {} elements past the buffer changed",
                s.peer_data, s.canary_changed
            ));
        }
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(wrong.join("; ").into())
    }
}

fn main() {
    let g = Gpus::detect();
    common::run(vec![
        g.ranks_trial(
            "held_send_and_all_reduce_deliver_once_the_late_peer_posts",
            held_operations_deliver,
        ),
        g.ranks_trial("a_held_send_whose_late_receive_differs_transfers_nothing", || {
            mismatch(HeldSide::Send)
        }),
        g.ranks_trial("a_held_receive_whose_late_send_differs_transfers_nothing", || {
            mismatch(HeldSide::Recv)
        }),
        g.ranks_trial(
            "a_held_all_reduce_whose_late_peer_differs_transfers_nothing",
            || mismatch(HeldSide::AllReduce),
        ),
    ]);
}
