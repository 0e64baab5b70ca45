//! Reliability: what NCCL really does with an unmatched send, bounded waits, dropping a
//! communicator with work pending, a soak of the article's loop with random delays, and (on two
//! GPUs) a peer killed mid-loop and sends and receives that disagree across two processes.

mod common;

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use common::{Gpus, assert_all_eq};
use handoff::kernels::{self, produced_value};
use handoff::result::nccl as raw_nccl;
use handoff::sys::nccl::ncclDataType_t;
use handoff::{CommOptions, DeviceBuffer, Error, Launch, Stream, group};
use libtest_mimic::Failed;

fn main() {
    common::run_child_role(&[
        ("dead_peer", child_dead_peer),
        ("dead_peer_of_three", child_dead_peer_of_three),
        ("mismatch_count", || child_mismatch(3, false)),
        ("mismatch_type", || child_mismatch(4, true)),
    ]);
    let g = Gpus::detect();
    common::run(vec![
        g.trial(
            "unmatched_send_to_oneself_is_bounded_by_wait_stream",
            1,
            unmatched_self_send,
        ),
        g.trial(
            "dropping_a_communicator_with_work_pending",
            1,
            drop_comm_with_pending_work,
        ),
        g.trial("soak_article_loop_with_random_delays", 1, soak),
        g.ranks_trial("dead_peer_survivor_errors_within_its_timeout", dead_peer),
        g.ranks_trial(
            "a_rank_killed_among_three_survivors_error_within_their_timeout",
            dead_peer_among_three,
        ),
        g.ranks_trial("mismatched_count_across_two_processes", || {
            mismatch_across_processes("mismatch_count")
        }),
        g.ranks_trial("mismatched_type_across_two_processes", || {
            mismatch_across_processes("mismatch_type")
        }),
    ]);
}

use common::one_rank;

/// What NCCL itself does with a send to oneself that has no receive, and with a self send and
/// receive of different counts, through the raw calls (the safe API refuses both before NCCL):
/// found out on an H200 with NCCL 2.28, it refuses the first at once ("Trying to send to self
/// without a matching recv"), and takes the second, writing all 256 sent elements into the
/// 200-element receive (past its count). Whatever it does, it must not hang this process: every
/// wait below is bounded. Then `wait_stream` on a stream that does not finish in time: a timeout within its
/// bound, the communicator aborted, later calls refused.
fn unmatched_self_send() -> Result<(), Failed> {
    let timeout = Duration::from_secs(3);
    let (dev, comm) = one_rank(CommOptions::default().with_timeout(timeout))?;
    let s = Stream::new(&dev)?;
    let x = DeviceBuffer::from_slice(&[1.0f32; 256], &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(256, &s)?;
    s.synchronize()?;
    // SAFETY: `x` and `y` are live on the communicator's device with 256 floats; the stream is
    // live. Both buffers outlive the stream's work (it is waited for below, with a bound).
    let alone = unsafe {
        raw_nccl::send(
            x.as_raw_ptr().cast(),
            256,
            ncclDataType_t::ncclFloat32,
            0,
            comm.as_raw(),
            s.as_raw(),
        )
    }?;
    println!("raw ncclSend to itself, alone: {}", describe(alone));
    // SAFETY: as above.
    let uneven = unsafe {
        raw_nccl::group_start()?;
        let a = raw_nccl::send(
            x.as_raw_ptr().cast(),
            256,
            ncclDataType_t::ncclFloat32,
            0,
            comm.as_raw(),
            s.as_raw(),
        )?;
        let b = raw_nccl::recv(
            y.as_raw_mut_ptr().cast(),
            200,
            ncclDataType_t::ncclFloat32,
            0,
            comm.as_raw(),
            s.as_raw(),
        )?;
        let end = raw_nccl::group_end();
        (a, b, end)
    };
    println!(
        "raw group of a 256-element send and a 200-element receive to itself: send {}, receive {}, group end {:?}",
        describe(uneven.0),
        describe(uneven.1),
        uneven.2.as_ref().map(|_| "ok")
    );
    match comm.wait_stream(&s) {
        Ok(()) => {
            let got = y.to_vec(&s)?;
            let filled = got.iter().filter(|v| **v == 1.0).count();
            println!(
                "the uneven pair completed; the 256-element buffer behind the 200-element receive \
                 holds {filled} of the 256 sent values"
            );
        }
        Err(e) => {
            println!("the uneven pair did not complete: {e}");
            // The raw operations are untracked: keep their buffers until the stream has drained
            // (the abort stops NCCL's kernel), or for good if it never does.
            let t = Instant::now();
            while !s.is_idle().unwrap_or(false) && t.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(10));
            }
            if !s.is_idle().unwrap_or(false) {
                std::mem::forget((x, y));
                return Err("the stream still runs 10 s after the abort".into());
            }
            println!("stream drained {:?} after the abort", t.elapsed());
        }
    }
    // A stream that outlasts the timeout: `wait_stream` gives up and aborts the communicator.
    // The abort itself waits for kernels already running on the device (NCCL frees device
    // memory, and a free synchronizes the device): seen on the H200, a 3 s timeout on a stream
    // running a 6 s kernel returned after 6.03 s. So the bound is the longer of the two.
    let timeout = Duration::from_secs(1);
    let kernel = Duration::from_secs(3);
    let (dev, comm) = one_rank(CommOptions::default().with_timeout(timeout))?;
    let s = Stream::new(&dev)?;
    kernels::busy(kernel, &s)?;
    let t = Instant::now();
    match comm.wait_stream(&s) {
        Err(Error::Timeout { what, after }) => {
            println!("after {:?}: timeout ({after:?}) waiting for {what}", t.elapsed())
        }
        other => return Err(format!("expected a timeout, got {other:?} after {:?}", t.elapsed()).into()),
    }
    if t.elapsed() > kernel + Duration::from_secs(2) {
        return Err(format!(
            "a {timeout:?} timeout on a {kernel:?} kernel took {:?}",
            t.elapsed()
        )
        .into());
    }
    let x = DeviceBuffer::from_slice(&[1.0f32; 4], &s)?;
    match comm.send(&x, 0, &s) {
        Err(Error::CommunicatorUnusable { reason }) => println!("later calls fail: {reason}"),
        other => return Err(format!("a call after the timeout gave {other:?}").into()),
    }
    Ok(())
}

fn describe(rc: handoff::sys::nccl::ncclResult_t) -> String {
    if rc.0 == 0 {
        "accepted".into()
    } else {
        format!("refused: {}", raw_nccl::error("NCCL", rc))
    }
}

/// Dropping a communicator whose transfer is still queued behind a long kernel waits for it
/// (bounded), does not hang, and leaves the received data intact.
fn drop_comm_with_pending_work() -> Result<(), Failed> {
    let (dev, comm) = one_rank(CommOptions::default().with_timeout(Duration::from_secs(10)))?;
    let s = Stream::new(&dev)?;
    let x = DeviceBuffer::from_slice(&[5u32; 4096], &s)?;
    let mut y = DeviceBuffer::<u32>::zeros(4096, &s)?;
    kernels::busy(Duration::from_millis(300), &s)?;
    group(|g| {
        g.send(&comm, &x, 0, &s)?;
        g.recv(&comm, &mut y, 0, &s)
    })?;
    let t = Instant::now();
    drop(comm);
    println!("dropping the communicator took {:?}", t.elapsed());
    if t.elapsed() > Duration::from_secs(10) {
        return Err("drop took longer than the timeout".into());
    }
    drop(x); // freed after the send, by tracking
    assert_all_eq("y", &y.to_vec(&s)?, |_| 5)
}

/// A small deterministic generator (xorshift64*), so a failing soak can be replayed by seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The article's loop, many rounds: A on a producer stream, send and receive (one rank to
/// itself) with the receive on a communication stream, B on a compute stream, every buffer
/// reused, random extra GPU delays (C) on either side, and every element of every y checked.
/// Rounds: HANDOFF_SOAK_ROUNDS (default 2000); seed: HANDOFF_SOAK_SEED.
fn soak() -> Result<(), Failed> {
    let rounds: u64 = std::env::var("HANDOFF_SOAK_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let seed: u64 = std::env::var("HANDOFF_SOAK_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_1234);
    let (dev, comm) = one_rank(CommOptions::default())?;
    let (producer, comm_s, compute) = (Stream::new(&dev)?, Stream::new(&dev)?, Stream::new(&dev)?);
    let n = 4096;
    const SLOTS: usize = 8;
    let mut x = DeviceBuffer::<f32>::zeros(n, &producer)?;
    let mut received = DeviceBuffer::<f32>::zeros(n, &comm_s)?;
    let mut ys: Vec<DeviceBuffer<f32>> = (0..SLOTS)
        .map(|_| DeviceBuffer::zeros(n, &compute))
        .collect::<handoff::Result<_>>()?;
    let mut rng = Rng(seed | 1);
    let mut mismatches = 0usize;
    let mut checked = 0u64;
    let t = Instant::now();
    let check = |y: &DeviceBuffer<f32>, round: u64, mismatches: &mut usize| -> Result<(), Failed> {
        let got = y.to_vec(&compute)?;
        let bad = (0..n)
            .filter(|&i| got[i] != 2.0 * produced_value(i, round as u32))
            .count();
        if bad > 0 && *mismatches == 0 {
            eprintln!("round {round}: {bad} of {n} elements wrong (seed {seed})");
        }
        *mismatches += bad;
        Ok(())
    };
    for round in 0..rounds {
        let slot = round as usize % SLOTS;
        if round >= SLOTS as u64 {
            // The slot is about to be reused: check the y it holds, from SLOTS rounds ago.
            check(&ys[slot], round - SLOTS as u64, &mut mismatches)?;
            checked += 1;
        }
        if rng.below(4) == 0 {
            kernels::busy(Duration::from_micros(rng.below(200)), &producer)?;
        }
        kernels::produce(&mut x, round as u32, &producer)?; // A rewrites x: waits for the last send
        group(|g| {
            g.send(&comm, &x, 0, &producer)?;
            g.recv(&comm, &mut received, 0, &comm_s) // waits for the last B to read it
        })?;
        if rng.below(4) == 0 {
            kernels::busy(Duration::from_micros(rng.below(200)), &compute)?;
        }
        kernels::twice(&received, &mut ys[slot], &compute)?; // B
    }
    for k in 0..(rounds as usize).min(SLOTS) {
        let round = rounds - 1 - k as u64;
        check(&ys[round as usize % SLOTS], round, &mut mismatches)?;
        checked += 1;
    }
    let elapsed = t.elapsed();
    println!(
        "soak: {rounds} rounds, {checked} y checked ({} elements), {mismatches} mismatched elements, {elapsed:?}, seed {seed}",
        checked * n as u64
    );
    if mismatches > 0 {
        return Err(format!("{mismatches} mismatched elements").into());
    }
    Ok(())
}

/// Rank 0 is killed in the middle of a send/receive loop; rank 1 must return an error within
/// its timeout and exit cleanly.
fn dead_peer() -> Result<(), Failed> {
    let mut job = common::spawn_ranks("dead_peer", true)?;
    let out0 = job.child_mut(0).stdout.take().ok_or("no stdout")?;
    for line in BufReader::new(out0).lines() {
        let line = line?;
        println!("rank 0: {line}");
        if line.contains("round 20") {
            break;
        }
    }
    job.kill(0)?;
    let killed = Instant::now();
    let exit = job.wait_timeout(Duration::from_secs(60))?;
    let took = killed.elapsed();
    let (r1, out1) = (&exit.ranks[1], &exit.ranks[1].stdout);
    println!("{r1}, {took:?} after the kill:\n{out1}");
    if !r1.success() || !out1.contains("peer failure detected") {
        return Err("the survivor did not report the dead peer".into());
    }
    if took > Duration::from_secs(30) {
        return Err(format!("the survivor took {took:?}").into());
    }
    Ok(())
}

/// Three ranks all-reduce in a loop; rank 2 is killed after round 20. Ranks 0 and 1 each report
/// the failure (an error from the all-reduce or its wait) within their 10 s timeout, and exit.
fn dead_peer_among_three() -> Result<(), Failed> {
    let mut job = common::spawn_n("dead_peer_of_three", 3, true)?;
    let out0 = job.child_mut(0).stdout.take().ok_or("no stdout")?;
    let mut lines0 = BufReader::new(out0).lines();
    for line in lines0.by_ref() {
        if line?.contains("round 20") {
            break;
        }
    }
    job.kill(2)?;
    let killed = Instant::now();
    // The rest of rank 0's output, read beside the wait so that its pipe never fills.
    let rest0 = std::thread::spawn(move || lines0.map_while(Result::ok).collect::<Vec<_>>().join("\n"));
    let exit = job.wait_timeout(Duration::from_secs(60))?;
    let took = killed.elapsed();
    let outs = [rest0.join().unwrap_or_default(), exit.ranks[1].stdout.clone()];
    for (rank, (r, out)) in exit.ranks.iter().zip(&outs).enumerate() {
        let last = out.lines().last().unwrap_or("");
        println!("{r}, all ended {took:?} after the kill: {last}");
        if !r.success() || !out.contains("peer failure detected") {
            return Err(format!("rank {rank} did not report the dead peer").into());
        }
    }
    if took > Duration::from_secs(30) {
        return Err(format!("the survivors took {took:?}").into());
    }
    Ok(())
}

/// A rank of [`dead_peer_among_three`].
fn child_dead_peer_of_three() -> Result<(), Failed> {
    let launch = Launch::from_env()?.ok_or("no launcher variables")?;
    let comm = launch.communicator(CommOptions::default().with_timeout(Duration::from_secs(10)))?;
    let s = Stream::new(comm.device())?;
    let mut x = DeviceBuffer::<f32>::zeros(1 << 12, &s)?;
    for round in 0.. {
        let r = comm
            .all_reduce_in_place(&mut x, handoff::ReduceOp::Sum, &s)
            .and_then(|()| comm.wait_stream(&s));
        if let Err(e) = r {
            println!("peer failure detected in round {round}: {e}");
            return Ok(());
        }
        println!("round {round}");
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

fn child_dead_peer() -> Result<(), Failed> {
    let launch = Launch::from_env()?.ok_or("no launcher variables")?;
    let comm = launch.communicator(CommOptions::default().with_timeout(Duration::from_secs(10)))?;
    let s = Stream::new(comm.device())?;
    let mut x = DeviceBuffer::<f32>::zeros(1 << 16, &s)?;
    for round in 0.. {
        if comm.rank() == 0 {
            kernels::produce(&mut x, round, &s)?;
            comm.send(&x, 1, &s)?;
            s.synchronize()?;
            println!("round {round}");
            std::thread::sleep(Duration::from_millis(10));
        } else {
            let r = comm.recv(&mut x, 0, &s).and_then(|()| comm.wait_stream(&s));
            if let Err(e) = r {
                println!("peer failure detected in round {round}: {e}");
                drop(x);
                drop(comm);
                return Ok(());
            }
        }
    }
    Ok(())
}

/// Rank 0 sends 4 f32; rank 1 receives 3 f32 (count) or 4 i32 (type), in checked mode: both
/// ranks get `Error::Mismatch` naming both sides, and nothing hangs.
fn mismatch_across_processes(role: &str) -> Result<(), Failed> {
    let exit = common::spawn_ranks(role, true)?.wait_timeout(Duration::from_secs(120))?;
    let mut failed = Vec::new();
    for r in &exit.ranks {
        println!("rank {}: {}", r.rank, r.stdout);
        if !r.success() || !r.stdout.contains("mismatch") {
            failed.push(r.rank);
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("ranks {failed:?} did not report the mismatch").into())
    }
}

fn child_mismatch(recv_count: usize, as_i32: bool) -> Result<(), Failed> {
    let launch = Launch::from_env()?.ok_or("no launcher variables")?;
    let options = CommOptions::default().with_timeout(Duration::from_secs(20));
    let comm = launch.communicator(options)?;
    let s = Stream::new(comm.device())?;
    let r = if comm.rank() == 0 {
        let x = DeviceBuffer::from_slice(&[1.0f32; 4], &s)?;
        comm.send(&x, 1, &s)
    } else if as_i32 {
        let mut y = DeviceBuffer::<i32>::zeros(recv_count, &s)?;
        comm.recv(&mut y, 0, &s)
    } else {
        let mut y = DeviceBuffer::<f32>::zeros(recv_count, &s)?;
        comm.recv(&mut y, 0, &s)
    };
    match r {
        Err(Error::Mismatch { detail }) => {
            println!("rank {}: mismatch reported: {detail}", comm.rank());
            Ok(())
        }
        other => Err(format!("expected a mismatch, got {other:?}").into()),
    }
}
