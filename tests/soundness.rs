//! The holes of issue 9 and of the 2026-12-03 review (`review3_*`), each shown closed on the
//! GPU: sequences of safe calls that used to corrupt memory, deliver wrong data or hang, and
//! now return typed errors within a bound.
//! Hole 5 (a stream shared by threads) is in `tests/threads.rs`, which also builds against the
//! crate as it was before the fix.
//!
//! Reported as ignored where too few GPUs are usable; see `tests/common/mod.rs`.

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{Gpus, assert_all_eq, two_ranks};
use handoff::kernels::{self, produced_value};
use handoff::{CommOptions, Communicator, Device, DeviceBuffer, Error, Stream, group};
use libtest_mimic::Failed;

fn main() {
    let g = Gpus::detect();
    // One at a time: the deadline tests must not see each other's GPU work.
    common::run_serial(vec![
        g.trial(
            "hole1_short_receive_in_one_process_is_refused",
            2,
            short_receive_in_one_process,
        ),
        g.ranks_trial(
            "hole1_short_receive_across_processes_is_a_mismatch_on_both",
            short_receive_across_processes,
        ),
        g.ranks_trial(
            "hostile1_a_send_against_a_gathers_part_is_a_mismatch_on_both",
            send_against_a_gathers_part,
        ),
        g.trial(
            "hostile1_a_send_against_a_gathers_part_in_one_process_is_refused",
            2,
            send_against_a_gathers_part_in_one_process,
        ),
        g.ranks_trial(
            "hole2_ranks_disagreeing_on_verification_fail_at_creation",
            disagreeing_ranks,
        ),
        g.trial(
            "init_all_groups_are_matched_in_both_directions",
            2,
            both_directions_matched,
        ),
        g.trial(
            "hole6a_init_all_ranks_driven_from_one_thread_outside_a_group",
            2,
            one_thread_outside_a_group,
        ),
        g.trial(
            "hole6b_long_kernel_before_a_transfer_is_not_a_dead_peer",
            2,
            long_kernel_before_a_transfer,
        ),
        g.ranks_trial(
            "review3_1_collectives_grouped_on_one_rank_only_are_a_mismatch_on_both",
            || grouped_collectives(false),
        ),
        g.ranks_trial(
            "review3_4_one_group_in_two_call_orders_runs_with_the_right_sums",
            || grouped_collectives(true),
        ),
        g.ranks_trial(
            "review3_2_a_forgotten_registration_is_not_inherited_by_a_later_communicator",
            forgotten_registration,
        ),
        g.ranks_trial(
            "hole6c_host_wait_behind_a_stuck_receive_is_bounded",
            stuck_receive_is_bounded,
        ),
    ]);
}

/// Runs `f` on another thread; fails if it has not returned within `limit` (it would have hung:
/// the thread is left behind, and the process ends when the tests do).
fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Failed> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .map_err(|_| format!("{what} did not return within {limit:?}: it hangs").into())
}

/// Hole 1: a send of n f32 from GPU 0 matched, in one group, with a receive of 3n/4 into the
/// front of an n-element buffer on GPU 1 (the case measured in release builds, where it
/// "succeeded" with 2,949,120 of 3,145,728 elements wrong). Now refused before NCCL, nothing
/// written, and the communicators stay usable.
fn short_receive_in_one_process() -> Result<(), Failed> {
    let devs = [Device::new(0)?, Device::new(1)?];
    let comms = Communicator::init_all(&devs)?; // default options: verified in every profile
    let (s0, s1) = (Stream::new(&devs[0])?, Stream::new(&devs[1])?);
    let n = 4_194_304;
    let mut x = DeviceBuffer::<f32>::zeros(n, &s0)?;
    kernels::produce(&mut x, 0, &s0)?;
    let mut y = DeviceBuffer::<f32>::zeros(n, &s1)?;
    let r = group(|g| {
        g.send(&comms[0], &x, 1, &s0)?;
        g.recv(&comms[1], y.slice_mut(0..3 * n / 4)?, 0, &s1)
    });
    match r {
        Err(Error::InvalidArgument(m)) => println!("refused: {m}"),
        other => return Err(format!("expected the short receive refused, got {other:?}").into()),
    }
    assert_all_eq("y after the refused transfer", &y.to_vec(&s1)?, |_| 0.0)?;
    group(|g| {
        g.send(&comms[0], &x, 1, &s0)?;
        g.recv(&comms[1], &mut y, 0, &s1)
    })?;
    assert_all_eq("y after a matching transfer", &y.to_vec(&s1)?, |i| {
        produced_value(i, 0)
    })
}

/// Within one group of `init_all` ranks, rank 0 receives from rank 1 while rank 1 only sends to
/// and receives from itself: refused before anything is published or posted (NCCL would wait
/// forever for rank 0's receive), and the communicators stay usable.
fn both_directions_matched() -> Result<(), Failed> {
    let devs = [Device::new(0)?, Device::new(1)?];
    let comms = Communicator::init_all(&devs)?;
    let (s0, s1) = (Stream::new(&devs[0])?, Stream::new(&devs[1])?);
    let a = DeviceBuffer::<f32>::zeros(16, &s1)?;
    let mut b = DeviceBuffer::<f32>::zeros(16, &s1)?;
    let mut y = DeviceBuffer::<f32>::zeros(16, &s0)?;
    let r = group(|g| {
        g.recv(&comms[0], &mut y, 1, &s0)?;
        g.send(&comms[1], &a, 1, &s1)?;
        g.recv(&comms[1], &mut b, 1, &s1)
    });
    match r {
        Err(Error::InvalidArgument(m)) => println!("refused: {m}"),
        other => return Err(format!("expected InvalidArgument, got {other:?}").into()),
    }
    for c in &comms {
        if let Some(r) = c.broken_reason() {
            return Err(format!("rank {} was broken: {r}", c.rank()).into());
        }
    }
    Ok(())
}

fn short_receive_across_processes() -> Result<(), Failed> {
    let n = 4_194_304;
    let opts = CommOptions::default().with_timeout(Duration::from_secs(20));
    let results = two_ranks([opts, opts], move |made| {
        let comm = made.map_err(|e| e.to_string())?;
        let s = Stream::new(comm.device()).map_err(|e| e.to_string())?;
        let mut x = DeviceBuffer::<f32>::zeros(n, &s).map_err(|e| e.to_string())?;
        let r = if comm.rank() == 0 {
            kernels::produce(&mut x, 0, &s).map_err(|e| e.to_string())?;
            comm.send(&x, 1, &s)
        } else {
            comm.recv(x.slice_mut(0..3 * n / 4).map_err(|e| e.to_string())?, 0, &s)
        };
        let untouched = x.to_vec(&s).map_err(|e| e.to_string())?.iter().all(|&v| v == 0.0);
        match r {
            Err(Error::Mismatch { detail }) => Ok((detail, untouched)),
            other => Err(format!(
                "rank {}: expected a mismatch, got {other:?}",
                comm.rank()
            )),
        }
    })?;
    for (rank, r) in results.into_iter().enumerate() {
        let (detail, untouched) = r?;
        println!("rank {rank}: {detail}");
        if !detail.contains("4194304") || !detail.contains("3145728") {
            return Err(format!("rank {rank}'s mismatch does not name both counts: {detail}").into());
        }
        if rank == 1 && !untouched {
            return Err("the receiver's buffer was written".into());
        }
    }
    Ok(())
}

/// Hostile-peers hole 1, as the review wrote it: rank 1 groups a send of 4096 f32 to rank 0
/// with a gather of one f32 to root 0; rank 0 posts the gather, then its receive of 4096. NCCL
/// runs a gather as sends and receives in the same per-peer queues as `ncclSend`/`ncclRecv`,
/// so it would pair the 4096-element send with the gather's one-element receive at the end of
/// rank 0's output. Now a mismatch on both ranks, and nothing written past the output (a guard
/// of 4096 elements right after it stays zero).
fn send_against_a_gathers_part() -> Result<(), Failed> {
    let opts = CommOptions::default().with_timeout(Duration::from_secs(20));
    let results = two_ranks([opts, opts], |made| {
        let comm = made.map_err(|e| e.to_string())?;
        let e = |e: Error| e.to_string();
        let s = Stream::new(comm.device()).map_err(e)?;
        let a = DeviceBuffer::<f32>::from_slice(&[7.0], &s).map_err(e)?;
        // Warm-up: a matched send/receive and a gather connect the pair first.
        let mut warm = DeviceBuffer::<f32>::zeros(2, &s).map_err(e)?;
        if comm.rank() == 1 {
            comm.send(&a, 0, &s).map_err(e)?;
        } else {
            comm.recv(warm.slice_mut(0..1).map_err(e)?, 1, &s).map_err(e)?;
        }
        comm.gather(&a, &mut warm, 0, &s).map_err(e)?;
        s.synchronize().map_err(e)?;
        let r = if comm.rank() == 1 {
            let x = DeviceBuffer::<f32>::from_slice(&[7.0; 4096], &s).map_err(e)?;
            let mut none = DeviceBuffer::<f32>::zeros(0, &s).map_err(e)?;
            group(|g| {
                g.send(&comm, &x, 0, &s)?;
                g.gather(&comm, &a, &mut none, 0, &s)
            })
            .and_then(|()| comm.wait_stream(&s))
        } else {
            // The root's output (two elements), then a guard of 4096.
            let mut out = DeviceBuffer::<f32>::zeros(2 + 4096, &s).map_err(e)?;
            let mut r = DeviceBuffer::<f32>::zeros(4096, &s).map_err(e)?;
            let (head, _) = out.split_at_mut(2).map_err(e)?;
            // The gather may be held (rank 1 not there yet): then its mismatch comes from the
            // next call or the wait.
            let r = comm
                .gather(&a, head, 0, &s)
                .and_then(|()| comm.recv(&mut r, 1, &s))
                .and_then(|()| comm.wait_stream(&s));
            // Read through a device copy: a host read of `out` itself reports the failed
            // operation that wrote it last.
            let _ = s.synchronize();
            let mut copy = DeviceBuffer::<f32>::zeros(2 + 4096, &s).map_err(e)?;
            copy.slice_mut(..).map_err(e)?.copy_from(&out, &s).map_err(e)?;
            let guard = copy.to_vec(&s).map_err(e)?;
            if guard[2..].iter().any(|&v| v != 0.0) {
                return Err("NCCL wrote past the gather's output".into());
            }
            r
        };
        match r {
            Err(Error::Mismatch { detail }) => Ok(detail),
            other => Err(format!(
                "rank {}: expected a mismatch, got {other:?}",
                comm.rank()
            )),
        }
    })?;
    for (rank, r) in results.into_iter().enumerate() {
        let detail = r?;
        println!("rank {rank}: {detail}");
        if !detail.contains("4096") || !detail.contains("gather") {
            return Err(format!("rank {rank}'s mismatch does not name the two sides: {detail}").into());
        }
    }
    Ok(())
}

/// The same in one process (ranks of one `init_all`, one group): refused before anything is
/// posted, the communicators intact.
fn send_against_a_gathers_part_in_one_process() -> Result<(), Failed> {
    let devs = [Device::new(0)?, Device::new(1)?];
    let comms = Communicator::init_all(&devs)?;
    let (s0, s1) = (Stream::new(&devs[0])?, Stream::new(&devs[1])?);
    let a0 = DeviceBuffer::<f32>::from_slice(&[1.0], &s0)?;
    let a1 = DeviceBuffer::<f32>::from_slice(&[2.0], &s1)?;
    let x = DeviceBuffer::<f32>::from_slice(&[7.0; 4096], &s1)?;
    let mut out = DeviceBuffer::<f32>::zeros(2, &s0)?;
    let mut none = DeviceBuffer::<f32>::zeros(0, &s1)?;
    let mut r = DeviceBuffer::<f32>::zeros(4096, &s0)?;
    let refused = group(|g| {
        g.gather(&comms[0], &a0, &mut out, 0, &s0)?;
        g.recv(&comms[0], &mut r, 1, &s0)?;
        g.send(&comms[1], &x, 0, &s1)?;
        g.gather(&comms[1], &a1, &mut none, 0, &s1)
    });
    match refused {
        Err(Error::InvalidArgument(m)) if m.contains("gather") => println!("refused: {m}"),
        other => return Err(format!("expected the mixed group refused, got {other:?}").into()),
    }
    for c in &comms {
        if let Some(r) = c.broken_reason() {
            return Err(format!("rank {} was broken: {r}", c.rank()).into());
        }
    }
    // In a matching order the same calls run, and deliver.
    group(|g| {
        g.gather(&comms[0], &a0, &mut out, 0, &s0)?;
        g.recv(&comms[0], &mut r, 1, &s0)?;
        g.gather(&comms[1], &a1, &mut none, 0, &s1)?;
        g.send(&comms[1], &x, 0, &s1)
    })?;
    assert_all_eq("the gather", &out.to_vec(&s0)?, |i| [1.0, 2.0][i])?;
    assert_all_eq("the receive", &r.to_vec(&s0)?, |_| 7.0)
}

/// Hole 2: one rank verifying, the other not. Both fail at creation.
fn disagreeing_ranks() -> Result<(), Failed> {
    let verified = CommOptions::default().with_timeout(Duration::from_secs(20));
    // SAFETY: the communicator must not be made; if it were, nothing is sent on it.
    let unverified = unsafe { verified.unverified() };
    let results = two_ranks([verified, unverified], |made| match made {
        Err(Error::Setup { detail }) => Ok(detail),
        other => Err(format!("expected a set-up error, got {other:?}")),
    })?;
    for (rank, r) in results.into_iter().enumerate() {
        println!("rank {rank}: {}", r?);
    }
    Ok(())
}

/// Hole 6a: ranks of one `init_all` driven by one thread, a send outside a group. NCCL's
/// `ncclGroupEnd` would wait for the peer to connect, which this thread would post next.
fn one_thread_outside_a_group() -> Result<(), Failed> {
    let r = within(Duration::from_secs(30), "a send outside a group", || {
        let devs = [Device::new(0)?, Device::new(1)?];
        let comms = Communicator::init_all(&devs)?;
        let s0 = Stream::new(&devs[0])?;
        let x = DeviceBuffer::<f32>::zeros(1024, &s0)?;
        let r = comms[0].send(&x, 1, &s0);
        let ok_after = comms[0].broken_reason().is_none();
        Ok::<_, Error>((r, ok_after))
    })??;
    match r {
        (Err(Error::InvalidArgument(m)), true) => {
            println!("refused at once: {m}");
            Ok(())
        }
        other => Err(format!("expected InvalidArgument with the communicator intact, got {other:?}").into()),
    }
}

/// Hole 6b: 3 s of GPU work queued before a transfer on a communicator whose timeout is 1 s.
/// Verification does not wait for the GPU (the exchange it replaced synchronised the stream and
/// took the kernel for a dead peer), and the watchdog counts from when the transfer can start:
/// the transfer completes, nothing is aborted.
fn long_kernel_before_a_transfer() -> Result<(), Failed> {
    let devs = [Device::new(0)?, Device::new(1)?];
    let opts = CommOptions::default().with_timeout(Duration::from_secs(1));
    let comms = Communicator::init_all_with(opts, &devs)?;
    let (s0, s1) = (Stream::new(&devs[0])?, Stream::new(&devs[1])?);
    let mut x = DeviceBuffer::<f32>::zeros(1 << 16, &s0)?;
    let mut y = DeviceBuffer::<f32>::zeros(1 << 16, &s1)?;
    // A first transfer connects the pair and loads NCCL's kernels: CUDA's lazy loading of a
    // kernel waits for work already running on the device, which would hold up the queueing
    // below for reasons that have nothing to do with handoff.
    group(|g| {
        g.send(&comms[0], &x, 1, &s0)?;
        g.recv(&comms[1], &mut y, 0, &s1)
    })?;
    let t = Instant::now();
    kernels::busy(Duration::from_secs(3), &s0)?;
    kernels::produce(&mut x, 5, &s0)?;
    group(|g| {
        g.send(&comms[0], &x, 1, &s0)?;
        g.recv(&comms[1], &mut y, 0, &s1)
    })?;
    let queued = t.elapsed();
    assert_all_eq("y", &y.to_vec(&s1)?, |i| produced_value(i, 5))?;
    println!("queued in {queued:?}, received after {:?}", t.elapsed());
    if queued > Duration::from_millis(500) {
        return Err(format!("queueing waited for the GPU: {queued:?}").into());
    }
    for c in &comms {
        if let Some(r) = c.broken_reason() {
            return Err(format!("rank {} was aborted: {r}", c.rank()).into());
        }
        c.synchronize()?;
    }
    Ok(())
}

/// Hole 6c: rank 0 posts its send (verified) behind 6 s of GPU work, then aborts its
/// communicator, so the send never runs. Rank 1's receive can never complete; its host read of
/// the buffer must still return, with an error, once the watchdog aborts rank 1 (timeout 2 s).
fn stuck_receive_is_bounded() -> Result<(), Failed> {
    let opts = CommOptions::default().with_timeout(Duration::from_secs(2));
    let results = two_ranks([opts, opts], |made| {
        let comm = made.map_err(|e| e.to_string())?;
        let s = Stream::new(comm.device()).map_err(|e| e.to_string())?;
        let mut x = DeviceBuffer::<f32>::zeros(1 << 16, &s).map_err(|e| e.to_string())?;
        if comm.rank() == 0 {
            kernels::busy(Duration::from_secs(6), &s).map_err(|e| e.to_string())?;
            comm.send(&x, 1, &s).map_err(|e| e.to_string())?;
            comm.abort().map_err(|e| e.to_string())?;
            Ok(("rank 0 sent, then aborted".to_string(), Duration::ZERO))
        } else {
            comm.recv(&mut x, 0, &s).map_err(|e| e.to_string())?;
            let t = Instant::now();
            let r = x.to_vec(&s);
            let took = t.elapsed();
            match r {
                Err(Error::CommunicatorUnusable { reason }) => Ok((reason, took)),
                Ok(v) => Err(format!(
                    "rank 1's read returned Ok ({} elements, {} nonzero) after {took:?}: data from a \
                     receive that never completed",
                    v.len(),
                    v.iter().filter(|&&x| x != 0.0).count()
                )),
                Err(e) => Err(format!("rank 1's read returned {e} after {took:?}")),
            }
        }
    });
    let results = within(
        Duration::from_secs(40),
        "the host read behind a stuck receive",
        move || results,
    )??;
    for (rank, r) in results.into_iter().enumerate() {
        let (what, took) = r?;
        println!("rank {rank}: {what} ({took:?})");
        if rank == 1 && took > Duration::from_secs(5) {
            return Err(format!("rank 1's read took {took:?} with a 2 s timeout").into());
        }
    }
    Ok(())
}

/// The 2026-12-03 review's finding 1 (and 4): NCCL 2.28 runs a group's collectives in an order
/// of its own (by size, then per function, reduction and type), so ranks that group the same
/// collectives differently pair collectives of different sizes. Rank 0 puts an all_reduce of
/// 1 Mi elements and one of 16 in one group, rank 1 calls them one after the other: a mismatch
/// on both, and neither output written (before the fix, both ranks returned Ok and NCCL then
/// paired the 16 with the 1 Mi). With `same_group`, both ranks group them, in opposite call
/// orders: NCCL runs them alike, so verification lets them through and both sums are right.
fn grouped_collectives(same_group: bool) -> Result<(), Failed> {
    const BIG: usize = 1 << 20;
    const SMALL: usize = 16;
    let opts = CommOptions::default().with_timeout(Duration::from_secs(30));
    let results = two_ranks([opts, opts], move |made| {
        let comm = made.map_err(|e| e.to_string())?;
        let r = comm.rank();
        let e = |e: Error| format!("rank {r}: {e}");
        let s = Stream::new(comm.device()).map_err(e)?;
        let big = DeviceBuffer::from_slice(&vec![1.0f32 + r as f32; BIG], &s).map_err(e)?;
        let small = DeviceBuffer::from_slice(&[10.0f32 + r as f32; SMALL], &s).map_err(e)?;
        let mut big_out = DeviceBuffer::<f32>::zeros(BIG, &s).map_err(e)?;
        let mut small_out = DeviceBuffer::<f32>::zeros(SMALL, &s).map_err(e)?;
        let got = if same_group || r == 0 {
            group(|g| {
                if r == 0 {
                    g.all_reduce(&comm, &big, &mut big_out, handoff::ReduceOp::Sum, &s)?;
                    g.all_reduce(&comm, &small, &mut small_out, handoff::ReduceOp::Sum, &s)
                } else {
                    g.all_reduce(&comm, &small, &mut small_out, handoff::ReduceOp::Sum, &s)?;
                    g.all_reduce(&comm, &big, &mut big_out, handoff::ReduceOp::Sum, &s)
                }
            })
        } else {
            comm.all_reduce(&big, &mut big_out, handoff::ReduceOp::Sum, &s)
                .and_then(|()| comm.all_reduce(&small, &mut small_out, handoff::ReduceOp::Sum, &s))
        };
        let outs = (big_out.to_vec(&s).map_err(e)?, small_out.to_vec(&s).map_err(e)?);
        match (same_group, got) {
            (false, Err(Error::Mismatch { detail })) => {
                if outs.0.iter().chain(&outs.1).any(|&v| v != 0.0) {
                    return Err(format!("rank {r}: refused, yet an output was written"));
                }
                Ok(format!("mismatch: {detail}"))
            }
            (true, Ok(())) => {
                if outs.0.iter().any(|&v| v != 3.0) || outs.1.iter().any(|&v| v != 21.0) {
                    return Err(format!(
                        "rank {r}: wrong sums: {:?} {:?}",
                        &outs.0[..4],
                        &outs.1[..4]
                    ));
                }
                Ok("both sums right".into())
            }
            (_, other) => Err(format!("rank {r}: {other:?}")),
        }
    })?;
    for (r, x) in common::both_ok(results)?.iter().enumerate() {
        println!("rank {r}: {x}");
    }
    Ok(())
}

/// The review's finding 2 on two GPUs' ranks: rank 0 registers `x` with a communicator split
/// off its own, forgets the registration (`mem::forget`, safe) and drops that communicator;
/// then it sends `x` over a second one, where rank 1 receives into a registered buffer. NCCL
/// sees the send unregistered, so verification must too: a mismatch on both (a send from one
/// side registered alone moves in other steps than its receive). Before the fix a buffer's
/// registrations were keyed by the communicator state's address, which the second communicator
/// could take: whether it did was the allocator's choice (the stub test in
/// `tests/registered_stub.rs` forces it); here the check is that the outcome is right.
fn forgotten_registration() -> Result<(), Failed> {
    let opts = CommOptions::default().with_timeout(Duration::from_secs(30));
    let results = two_ranks([opts, opts], |made| {
        let comm = made.map_err(|e| e.to_string())?;
        let r = comm.rank();
        let e = |e: Error| format!("rank {r}: {e}");
        let s = Stream::new(comm.device()).map_err(e)?;
        let mut x = DeviceBuffer::from_slice_nccl(&[5.0f32; 1024], &s).map_err(e)?;
        let first = comm
            .split(Some(0), r as i32)
            .map_err(e)?
            .ok_or("no first split")?;
        if r == 0 {
            std::mem::forget(first.register(&mut x).map_err(e)?);
        }
        drop(first);
        let second = comm
            .split(Some(0), r as i32)
            .map_err(e)?
            .ok_or("no second split")?;
        let got = if r == 0 {
            second.send(&x, 1, &s)
        } else {
            let mut reg = second.register(&mut x).map_err(e)?;
            let got = second.recv(reg.view_mut(), 0, &s);
            drop(reg);
            got
        };
        s.synchronize().map_err(e)?;
        match got {
            Err(Error::Mismatch { detail }) if detail.contains("registered") => Ok(detail),
            other => Err(format!(
                "rank {r}: {other:?}, want a mismatch naming the registration"
            )),
        }
    })?;
    for (r, x) in common::both_ok(results)?.iter().enumerate() {
        println!("rank {r}: {x}");
    }
    Ok(())
}
