//! `cargo bench --bench late_peer -- [--late-us N] [--iters N] [--count N]`
//!
//! What verification costs the sender's host when its peer's host is late, and when it is not
//! (issue 30's targets). Two ranks in two processes (sharing the GPU where there is one, as
//! `sendrecv --mode procs` does), each with a verified and an unverified communicator. Per
//! communicator, after one untimed exchange (NCCL connects the pair at its first):
//! - **late**: rank 1's host sleeps `--late-us` before posting each of `--iters` receives of
//!   `--count` f32; rank 0's host times each `send` call;
//! - **prompt**: rank 0's host sleeps `--late-us` before each send, rank 1 posts each receive
//!   at once: rank 0's host times each `send`, whose counterpart is there;
//! - **all_reduce late**: rank 1's host sleeps `--late-us` before each of `--iters` all-reduces
//!   of `--count` f32; rank 0's host times each call.
//!
//! Rank 0 prints one line per case and communicator: the median and 90th percentile of the host
//! time per call, in µs; then every received value is checked. The times are host times of
//! the call alone: what a pipeline stage pays to queue.

use std::time::{Duration, Instant};

use handoff::Launch;
use handoff::{CommOptions, DeviceBuffer, ReduceOp, Stream};

mod harness;

struct Opts {
    late: Duration,
    iters: usize,
    count: usize,
}

fn opts() -> Result<Opts, String> {
    let mut o = Opts {
        late: Duration::from_micros(1000),
        iters: 200,
        count: 2,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || -> Result<u64, String> {
            args.next()
                .ok_or(format!("{a} needs a value"))?
                .parse()
                .map_err(|e| format!("{a}: {e}"))
        };
        match a.as_str() {
            "--late-us" => o.late = Duration::from_micros(value()?),
            "--iters" => o.iters = value()? as usize,
            "--count" => o.count = value()? as usize,
            "--bench" => {}
            other => return Err(format!("unknown option {other}")),
        }
    }
    if o.iters == 0 || o.count == 0 {
        return Err("--iters and --count must be positive".into());
    }
    Ok(o)
}

fn main() {
    harness::two_rank_main("late_peer", opts, run);
}

/// Median and 90th percentile, in µs.
fn stats(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[(v.len() * 9 / 10).min(v.len() - 1)])
}

fn run(o: &Opts, l: &Launch) -> handoff::Result<()> {
    let verified = l.communicator(CommOptions::default())?;
    // SAFETY: both ranks run this benchmark, which posts matching operations on both.
    let unverified = l.communicator(unsafe { CommOptions::default().unverified() })?;
    let rank = verified.rank();
    if rank == 0 {
        if let Some(note) = harness::shared_gpu_note(l) {
            println!("{note}");
        }
        println!(
            "# late_peer: {} f32 per operation, {} iterations, late peer {:?}, on {}",
            o.count,
            o.iters,
            o.late,
            verified.device().name()?
        );
    }
    for (name, comm) in [("verified", &verified), ("unverified", &unverified)] {
        let s = Stream::new(comm.device())?;
        let x = DeviceBuffer::from_slice(&vec![1.0f32; o.count], &s)?;
        let mut ys: Vec<DeviceBuffer<f32>> = (0..o.iters)
            .map(|_| DeviceBuffer::zeros(o.count, &s))
            .collect::<handoff::Result<_>>()?;
        // NCCL connects the pair (and the all-reduce's peers) at the first use: untimed.
        if rank == 0 {
            comm.send(&x, 1, &s)?;
        } else {
            comm.recv(&mut ys[0], 0, &s)?;
        }
        let mut r = DeviceBuffer::<f32>::zeros(o.count, &s)?;
        comm.all_reduce(&x, &mut r, ReduceOp::Sum, &s)?;
        comm.barrier_wait(&s)?;

        let mut late = Vec::with_capacity(o.iters);
        for y in ys.iter_mut() {
            if rank == 0 {
                let t = Instant::now();
                comm.send(&x, 1, &s)?;
                late.push(t.elapsed().as_secs_f64() * 1e6);
            } else {
                std::thread::sleep(o.late);
                comm.recv(y, 0, &s)?;
            }
        }
        comm.barrier_wait(&s)?;
        let got_late = if rank == 1 { check(&ys, &s, 1.0)? } else { 0 };

        let mut prompt = Vec::with_capacity(o.iters);
        for y in ys.iter_mut() {
            if rank == 1 {
                y.memset_zero(&s)?;
                comm.recv(y, 0, &s)?;
            } else {
                // Rank 1 posts as soon as it can: after this, its receive is there.
                std::thread::sleep(o.late);
                let t = Instant::now();
                comm.send(&x, 1, &s)?;
                prompt.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        comm.barrier_wait(&s)?;
        let got_prompt = if rank == 1 { check(&ys, &s, 1.0)? } else { 0 };

        let mut reduce = Vec::with_capacity(o.iters);
        for _ in 0..o.iters {
            if rank == 1 {
                std::thread::sleep(o.late);
                comm.all_reduce(&x, &mut r, ReduceOp::Sum, &s)?;
            } else {
                let t = Instant::now();
                comm.all_reduce(&x, &mut r, ReduceOp::Sum, &s)?;
                reduce.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        comm.barrier_wait(&s)?;
        let sums = r.to_vec(&s)?;
        if sums.iter().any(|&v| v != 2.0) {
            return Err(handoff::Error::InvalidArgument(format!(
                "rank {rank}: the all-reduce gave {sums:?}, want 2.0 each"
            )));
        }
        if rank == 0 {
            for (case, v) in [
                ("send, peer late", late),
                ("send, peer prompt", prompt),
                ("all_reduce, peer late", reduce),
            ] {
                let (median, p90) = stats(v);
                println!("{name:>10} {case:<24} host µs per call: median {median:>9.2}  p90 {p90:>9.2}");
            }
        } else {
            println!("rank 1 ({name}): {got_late} + {got_prompt} received values checked");
        }
    }
    Ok(())
}

/// Every element of every buffer equals `want`; returns how many were checked.
fn check(ys: &[DeviceBuffer<f32>], s: &Stream, want: f32) -> handoff::Result<usize> {
    let mut n = 0;
    for (i, y) in ys.iter().enumerate() {
        let v = y.to_vec(s)?;
        if let Some(bad) = v.iter().find(|&&e| e != want) {
            return Err(handoff::Error::InvalidArgument(format!(
                "receive {i} holds {bad}, want {want}"
            )));
        }
        n += v.len();
    }
    Ok(n)
}
