//! `cargo bench --bench graph_family -- [--graphs N] [--replays N]`
//!
//! Graphs at serving scale (issue 32): a server captures one graph per batch-size bucket, each
//! with an all-reduce. Two ranks in two processes (sharing the GPU where there is one), each:
//! 1. **one communicator**: split from the job's communicator and connected (one send and
//!    receive, one all-reduce of each bucket's size): the unit both targets are stated in;
//! 2. **a family**: one such communicator made a [`GraphFamily`], then `--graphs` captures on
//!    it, bucket `k` an all-reduce of `1024 × (k + 1)` f32;
//! 3. **one communicator per graph** (`Graph::capture_with`): `--graphs` times a split,
//!    connected, and a capture of the same bucket.
//!
//! For each: the device memory this process holds afterwards beyond what it held before
//! (`nvidia-smi --query-compute-apps`: NCCL's and the graphs' own, the buffers made before),
//! and the wall time of making it. Then each way replays every graph `--replays` times in one
//! order on both ranks: the host time per `launch` (median), and the values checked once.
//! Rank 0 prints the table.

use std::time::{Duration, Instant};

use handoff::{CommOptions, Communicator, DeviceBuffer, Graph, GraphFamily, Launch, ReduceOp, Stream};

mod harness;

struct Opts {
    graphs: usize,
    replays: usize,
}

fn opts() -> Result<Opts, String> {
    let mut o = Opts {
        graphs: 32,
        replays: 20,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || -> Result<usize, String> {
            args.next()
                .ok_or(format!("{a} needs a value"))?
                .parse()
                .map_err(|e| format!("{a}: {e}"))
        };
        match a.as_str() {
            "--graphs" => o.graphs = value()?,
            "--replays" => o.replays = value()?,
            "--bench" => {}
            other => return Err(format!("unknown option {other}")),
        }
    }
    if o.graphs == 0 || o.replays == 0 {
        return Err("--graphs and --replays must be positive".into());
    }
    Ok(o)
}

fn main() {
    harness::two_rank_main("graph_family", opts, run);
}

/// The device memory this process holds, in MiB, as `nvidia-smi` reports it (`None` without it).
fn device_mib() -> Option<f64> {
    let out = std::process::Command::new("nvidia-smi")
        .args([
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
        ])
        .output()
        .ok()?;
    let me = std::process::id().to_string();
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        let (pid, mib) = l.split_once(',')?;
        (pid.trim() == me).then(|| mib.trim().parse().ok())?
    })
}

fn bucket(k: usize) -> usize {
    1024 * (k + 1)
}

/// One send and receive between ranks 0 and 1, and an all-reduce of each bucket's size: what
/// NCCL connects at first use, which a capture cannot.
fn connect(comm: &Communicator, graphs: usize, x: &mut DeviceBuffer<f32>, s: &Stream) -> handoff::Result<()> {
    if comm.rank() == 0 {
        comm.send(x.slice(..4)?, 1, s)?;
    } else {
        comm.recv(x.slice_mut(..4)?, 0, s)?;
    }
    for k in 0..graphs {
        comm.all_reduce_in_place(x.slice_mut(..bucket(k))?, ReduceOp::Sum, s)?;
    }
    comm.barrier_wait(s)
}

struct Made {
    mib: Option<f64>,
    took: Duration,
    /// Host time per replay, µs, median.
    replay_us: Option<f64>,
}

fn measured(before: Option<f64>, t: Instant) -> (Option<f64>, Duration) {
    let took = t.elapsed();
    (device_mib().zip(before).map(|(a, b)| a - b), took)
}

/// Replays `graphs` `replays` times in order, checks each output (every rank's input is
/// `rank + 1`: the sum is 3), returns the median host time per launch.
fn replay(
    graphs: &[Graph],
    outs: &mut [DeviceBuffer<f32>],
    replays: usize,
    s: &Stream,
) -> handoff::Result<f64> {
    for o in outs.iter_mut() {
        o.memset_zero(s)?;
    }
    let mut times = Vec::with_capacity(graphs.len() * replays);
    for _ in 0..replays {
        for g in graphs {
            let t = Instant::now();
            g.launch(s)?;
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    s.synchronize()?;
    for (k, o) in outs.iter().enumerate() {
        if o.to_vec(s)?.iter().any(|&v| v != 3.0) {
            return Err(handoff::Error::InvalidArgument(format!(
                "bucket {k}'s all-reduce gave wrong values"
            )));
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn run(o: &Opts, l: &Launch) -> handoff::Result<()> {
    let job = l.communicator(CommOptions::default())?;
    let rank = job.rank();
    let s = Stream::new(job.device())?;
    let largest = bucket(o.graphs - 1);
    let mut x = DeviceBuffer::<f32>::zeros(largest, &s)?;
    let input = DeviceBuffer::from_slice(&vec![(rank + 1) as f32; largest], &s)?;
    let mut outs: Vec<DeviceBuffer<f32>> = (0..o.graphs)
        .map(|k| DeviceBuffer::zeros(bucket(k), &s))
        .collect::<handoff::Result<_>>()?;
    s.synchronize()?;
    job.barrier_wait(&s)?;
    if rank == 0 {
        if let Some(note) = harness::shared_gpu_note(l) {
            println!("{note}");
        }
        println!(
            "# graph_family: {} graphs (all-reduces of 1024 to {largest} f32), {} replays each, on {}",
            o.graphs,
            o.replays,
            job.device().name()?
        );
    }

    // 1. One communicator, split and connected.
    let before = device_mib();
    let t = Instant::now();
    let one = job.split(Some(0), rank as i32)?.expect("colored");
    connect(&one, o.graphs, &mut x, &s)?;
    let (mib, took) = measured(before, t);
    let one_made = Made {
        mib,
        took,
        replay_us: None,
    };
    drop(one);
    job.barrier_wait(&s)?;

    // 2. A family: one communicator, every graph on it.
    let before = device_mib();
    let t = Instant::now();
    let comm = job.split(Some(0), rank as i32)?.expect("colored");
    connect(&comm, o.graphs, &mut x, &s)?;
    let family = GraphFamily::new(comm, &s)?;
    let mut graphs = Vec::with_capacity(o.graphs);
    for (k, out) in outs.iter_mut().enumerate() {
        let src = input.slice(..bucket(k))?;
        graphs.push(family.capture(&s, |s, c| c.all_reduce(src, out, ReduceOp::Sum, s))?);
    }
    let (mib, took) = measured(before, t);
    let replay_us = replay(&graphs, &mut outs, o.replays, &s)?;
    let family_made = Made {
        mib,
        took,
        replay_us: Some(replay_us),
    };
    drop(graphs);
    drop(family);
    job.barrier_wait(&s)?;

    // 3. One communicator per graph.
    let before = device_mib();
    let t = Instant::now();
    let mut graphs = Vec::with_capacity(o.graphs);
    for (k, out) in outs.iter_mut().enumerate() {
        let comm = job.split(Some(0), rank as i32)?.expect("colored");
        connect(&comm, 0, &mut x, &s)?;
        comm.all_reduce_in_place(x.slice_mut(..bucket(k))?, ReduceOp::Sum, &s)?;
        let src = input.slice(..bucket(k))?;
        graphs.push(Graph::capture_with(comm, &s, |s, c| {
            c.all_reduce(src, out, ReduceOp::Sum, s)
        })?);
    }
    let (mib, took) = measured(before, t);
    let replay_us = replay(&graphs, &mut outs, o.replays, &s)?;
    let own_made = Made {
        mib,
        took,
        replay_us: Some(replay_us),
    };
    drop(graphs);
    job.barrier_wait(&s)?;

    if rank == 0 {
        let mib = |m: &Made| m.mib.map_or("n/a".into(), |v| format!("{v:.0}"));
        let ratio = |m: &Made| match (m.mib, one_made.mib) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
            _ => "n/a".into(),
        };
        println!(
            "{:<36} {:>10} {:>9} {:>12} {:>9} {:>14}",
            "way", "MiB (rank)", "x one", "made in ms", "x one", "launch us/med"
        );
        for (name, m) in [
            ("one communicator", &one_made),
            ("a family of graphs", &family_made),
            ("one communicator per graph", &own_made),
        ] {
            println!(
                "{name:<36} {:>10} {:>9} {:>12.1} {:>8.2}x {:>14}",
                mib(m),
                ratio(m),
                m.took.as_secs_f64() * 1e3,
                m.took.as_secs_f64() / one_made.took.as_secs_f64(),
                m.replay_us.map_or("-".into(), |v| format!("{v:.1}"))
            );
        }
        println!("(every replay's values checked: the sum of both ranks' inputs)");
    }
    Ok(())
}
