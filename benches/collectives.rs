//! Collectives benchmark: handoff's verified and unverified collectives against the raw NCCL
//! calls, in the same process, on the same buffers and streams, interleaved; two ranks (GPUs 0
//! and 1) in one process (`--mode inproc`) or in two processes through the bootstrap
//! (`--mode procs`, rank 0 reports). With one GPU, `--mode procs` runs its two processes on it
//! (`HANDOFF_SHARE_GPUS=1`: NCCL's socket transport over loopback between them): a correctness
//! run of the sharing mode, every value checked as usual, whose times are not performance
//! figures (a line before each table says so).
//!
//! `cargo bench --bench collectives -- --op all-reduce [--mode procs] [--memory window]`
//! (`--help` for the options)
//!
//! `--memory` chooses the buffers' kind for every way: the pool (default), `ncclMemAlloc`
//! memory, that memory registered with each way's communicator, or symmetric windows (handoff
//! through its API, raw NCCL registered raw: see `benches/memory`). Each way has its own
//! buffers.
//!
//! For each size, after `--warmup` untimed iterations, `--repeats` timed runs of `--iters`
//! iterations of each way, rotating verified, unverified and raw; each run is timed with CUDA
//! events (both ranks' streams joined), and the median run is reported. The table follows
//! nccl-tests (size, count, type, time, algbw, busbw, with nccl-tests' bus bandwidth factors
//! from its PERFORMANCE.md); rows go to `--csv` and, with `--svg`, a plot of bus bandwidth,
//! time and handoff's time over raw NCCL's per size. Results are checked once per size.

mod harness;
mod memory;

use clap::{Parser, ValueEnum};
use handoff::result::nccl as raw;
use handoff::sys::nccl::{ncclDataType_t, ncclRedOp_t};
use handoff::{
    CommOptions, Communicator, Device, DeviceBuffer, Event, Group, Launch, NcclType, ReduceOp, Stream, group,
};
use harness::Way;
use memory::{Held, Memory};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    AllToAll,
}

impl Op {
    /// nccl-tests' bus bandwidth factor for `n` ranks.
    fn bus_factor(self, n: f64) -> f64 {
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter | Op::AllToAll => (n - 1.0) / n,
            Op::Broadcast => 1.0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// One rank sending to itself on GPU 0: handoff's own cost, where NCCL copies locally.
    #[value(name = "self")]
    SelfRank,
    /// Two ranks in this process.
    #[value(name = "inproc")]
    InProc,
    /// Two processes through the bootstrap, one rank each (sharing the GPU where there is one).
    #[value(name = "procs")]
    Procs,
}

#[derive(Parser, Debug)]
#[command(about = "handoff's collectives against raw NCCL, on two GPUs (or one rank with --mode self)")]
struct Opts {
    #[arg(long, value_enum, default_value = "inproc")]
    mode: Mode,
    /// The collectives to time.
    #[arg(long, value_enum, num_args = 1.., default_values_t = [Op::AllReduce, Op::AllGather, Op::ReduceScatter, Op::Broadcast, Op::AllToAll])]
    op: Vec<Op>,
    /// The buffers' kind, for every way.
    #[arg(long, value_enum, default_value = "pool")]
    memory: Memory,
    #[command(flatten)]
    sweep: harness::Sweep,
    /// CSV file prefix: one file per operation, PREFIX-OP.csv (PREFIX-MEMORY-OP.csv for a
    /// --memory other than pool).
    #[arg(long, default_value = "collectives")]
    csv: String,
    /// SVG file prefix: with it, one plot per operation, PREFIX-OP.svg.
    #[arg(long)]
    svg: Option<String>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// One rank's buffers as one way uses them.
struct Rank<'c, 'b> {
    stream: &'b Stream,
    input: Held<'c, 'b, f32>,
    output: Held<'c, 'b, f32>,
}

/// Input and output lengths for `count` (NCCL's count) of `op` over `world` ranks.
fn lengths(op: Op, count: usize, world: usize) -> (usize, usize) {
    match op {
        Op::AllReduce | Op::Broadcast => (count, count),
        Op::AllGather => (count, world * count),
        Op::ReduceScatter => (world * count, count),
        Op::AllToAll => (world * count, world * count),
    }
}

fn post_safe<'a>(
    g: &mut Group<'a>,
    op: Op,
    comm: &'a Communicator,
    r: &'a mut Rank<'_, '_>,
    count: usize,
) -> handoff::Result<()> {
    let (ilen, olen) = lengths(op, count, comm.world_size());
    let s = r.stream;
    let (input, output) = (
        r.input.view().slice(..ilen)?,
        r.output.view_mut().into_slice_mut(..olen)?,
    );
    match op {
        Op::AllReduce => g.all_reduce(comm, input, output, ReduceOp::Sum, s),
        Op::AllGather => g.all_gather(comm, input, output, s),
        Op::ReduceScatter => g.reduce_scatter(comm, input, output, ReduceOp::Sum, s),
        Op::Broadcast => g.broadcast(comm, output, 0, s),
        Op::AllToAll => g.all_to_all(comm, input, output, s),
    }
}

/// This process's ranks' collectives, in one group.
fn run_safe(op: Op, comms: &[Communicator], ranks: &mut [Rank<'_, '_>], count: usize) -> handoff::Result<()> {
    group(move |g| {
        for (c, r) in comms.iter().zip(ranks) {
            post_safe(g, op, c, r, count)?;
        }
        Ok(())
    })
}

fn run_raw(op: Op, comms: &[Communicator], ranks: &mut [Rank<'_, '_>], count: usize) -> handoff::Result<()> {
    let dt: ncclDataType_t = f32::DATATYPE;
    // SAFETY: every rank's buffers hold at least the lengths `op` needs for `count` (allocated for
    // the largest size), on their communicators' devices; this benchmark orders raw and safe
    // operations on the same streams, so stream order alone keeps them apart; the group is
    // closed below.
    unsafe {
        raw::group_start()?;
        for (c, r) in comms.iter().zip(ranks.iter_mut()) {
            let (i, o, s) = (
                r.input.view().as_raw_ptr().cast(),
                r.output.view_mut().as_raw_mut_ptr().cast(),
                r.stream.as_raw(),
            );
            let rc = match op {
                Op::AllReduce => raw::all_reduce(i, o, count, dt, ncclRedOp_t::ncclSum, c.as_raw(), s),
                Op::AllGather => raw::all_gather(i, o, count, dt, c.as_raw(), s),
                Op::ReduceScatter => {
                    raw::reduce_scatter(i, o, count, dt, ncclRedOp_t::ncclSum, c.as_raw(), s)
                }
                Op::Broadcast => raw::broadcast(o, o, count, dt, 0, c.as_raw(), s),
                Op::AllToAll => raw::all_to_all(i, o, count, dt, c.as_raw(), s),
            }?;
            raw::check("a raw collective", rc)?;
        }
        raw::group_end()?;
    }
    Ok(())
}

fn main() -> handoff::Result<()> {
    let o = Opts::parse();
    o.sweep.check().map_err(handoff::Error::InvalidArgument)?;
    let launch = match o.mode {
        Mode::Procs => match Launch::from_env()? {
            Some(l) => Some(l),
            None => return harness::spawn_procs([0, 1]).map_err(handoff::Error::InvalidArgument),
        },
        Mode::InProc | Mode::SelfRank => None,
    };
    // This process's ranks: both (inproc) or its own (procs).
    let mut note = None;
    let (verified, unverified, label) = match launch {
        Some(l) => {
            let v = l.communicator(CommOptions::default())?;
            // SAFETY: every rank runs this benchmark, which posts the same collectives.
            let u = l.communicator(unsafe { CommOptions::default().unverified() })?;
            note = harness::shared_gpu_note(&l);
            let label = if l.share_gpus {
                format!(
                    "two processes through the bootstrap, sharing GPUs (rank {} on GPU {} of {})",
                    l.rank,
                    v.device().ordinal(),
                    Device::count()?
                )
            } else {
                "two processes, GPU 0 and GPU 1, through the bootstrap".to_string()
            };
            (vec![v], vec![u], label)
        }
        None if o.mode == Mode::SelfRank => {
            let devs = [Device::new(0)?];
            let v = Communicator::init_all(&devs)?;
            // SAFETY: this benchmark posts the same collectives on every rank (one).
            let u = Communicator::init_all_with(unsafe { CommOptions::default().unverified() }, &devs)?;
            (v, u, "one rank on GPU 0 (NCCL copies locally)".to_string())
        }
        None => {
            let devs = [Device::new(0)?, Device::new(1)?];
            let v = Communicator::init_all(&devs)?;
            // SAFETY: this benchmark posts the same collectives on both ranks, in one group.
            let u = Communicator::init_all_with(unsafe { CommOptions::default().unverified() }, &devs)?;
            (v, u, "two ranks in one process, GPU 0 and GPU 1".to_string())
        }
    };
    let reports = verified[0].rank() == 0;
    let world = verified[0].world_size();
    let max_count = o.sweep.max_bytes / 4;
    let streams: Vec<Stream> = verified
        .iter()
        .map(|c| Stream::new(c.device()))
        .collect::<handoff::Result<_>>()?;
    // Each way's buffers, per rank: (input, output).
    let (ones, zeros) = (vec![1.0f32; world * max_count], vec![0.0f32; world * max_count]);
    let mut store: Vec<Vec<(DeviceBuffer<f32>, DeviceBuffer<f32>)>> = Way::ALL
        .iter()
        .map(|_| {
            streams
                .iter()
                .map(|s| Ok((o.memory.alloc(s, &ones)?, o.memory.alloc(s, &zeros)?)))
                .collect::<handoff::Result<_>>()
        })
        .collect::<handoff::Result<_>>()?;
    let mut ways: Vec<Vec<Rank>> = Vec::new();
    for (way, bufs) in Way::ALL.iter().zip(store.iter_mut()) {
        let comms = if *way == Way::Unverified {
            &unverified
        } else {
            &verified
        };
        let raw_way = *way == Way::Raw;
        let mut ranks = Vec::new();
        for ((c, s), (input, output)) in comms.iter().zip(&streams).zip(bufs.iter_mut()) {
            ranks.push(Rank {
                stream: s,
                input: o.memory.hold(input, c, raw_way)?,
                output: o.memory.hold(output, c, raw_way)?,
            });
        }
        ways.push(ranks);
    }
    let first = verified[0].device();
    let (start, end) = (Event::new(first)?, Event::new(first)?);
    // The other local ranks' streams join the first's at the end of each timed run.
    let joined = verified[1..]
        .iter()
        .map(|c| Event::without_timing(c.device()))
        .collect::<handoff::Result<Vec<_>>>()?;
    for op in &o.op {
        let op = *op;
        if reports {
            println!("# handoff collectives: {op:?}, {label}, {}", o.memory.describe());
            println!(
                "# f32 | iters {} | warmup {} | repeats {} (median) | rotating verified, unverified and raw | busbw factor {:.2}",
                o.sweep.iters,
                o.sweep.warmup,
                o.sweep.repeats,
                op.bus_factor(world as f64)
            );
            if let Some(note) = &note {
                println!("{note}");
            }
            println!("{}", harness::header());
        }
        if op == Op::Broadcast {
            // The root's buffer is the source (in place): ones, like the other inputs.
            for ranks in &mut ways {
                for (c, r) in verified.iter().zip(ranks.iter_mut()) {
                    if c.rank() == 0 {
                        r.output.view_mut().fill(1.0, r.stream)?;
                    }
                }
            }
        }
        let factor = op.bus_factor(world as f64);
        let mut rows = Vec::new();
        for bytes in o.sweep.sizes(4 * world) {
            // nccl-tests' size is the larger buffer per rank.
            let count = match op {
                Op::AllReduce | Op::Broadcast => bytes / 4,
                Op::AllGather | Op::ReduceScatter | Op::AllToAll => bytes / 4 / world,
            }
            .max(1);
            let call = |way: Way, ranks: &mut [Rank<'_, '_>]| match way {
                Way::Verified => run_safe(op, &verified, ranks, count),
                Way::Unverified => run_safe(op, &unverified, ranks, count),
                Way::Raw => run_raw(op, &verified, ranks, count),
            };
            let us = o.sweep.time_ways(|way, n, timed| {
                if timed {
                    streams[0].record(&start)?;
                    for s in &streams[1..] {
                        s.wait(&start)?;
                    }
                }
                for _ in 0..n {
                    call(way, &mut ways[way as usize])?;
                }
                if !timed {
                    return Ok(0.0);
                }
                for (s, j) in streams[1..].iter().zip(&joined) {
                    s.record(j)?;
                    streams[0].wait(j)?;
                }
                streams[0].record(&end)?;
                end.synchronize()?;
                Ok(f64::from(start.elapsed_ms(&end)?) * 1000.0)
            })?;
            // The result once per way: ones everywhere, so a sum is the world size and the rest 1.
            let (_, olen) = lengths(op, count, world);
            let want = if matches!(op, Op::AllReduce | Op::ReduceScatter) {
                world as f32
            } else {
                1.0
            };
            for (way, ranks) in Way::ALL.iter().zip(&ways) {
                let last = ranks.last().expect("a rank");
                let got = last.output.view().slice(..olen)?.to_vec(last.stream)?;
                if let Some(i) = got.iter().position(|&v| v != want) {
                    return Err(handoff::Error::InvalidArgument(format!(
                        "{op:?} at {bytes} B, {way:?}: element {i} is {}, want {want}",
                        got[i]
                    )));
                }
            }
            let row = harness::Row { bytes, count, us };
            if reports {
                println!("{}", harness::line(&row, factor));
            }
            rows.push(row);
        }
        if !reports {
            continue;
        }
        let name = format!("{op:?}").to_lowercase();
        let prefix = match o.memory {
            Memory::Pool => o.csv.clone(),
            m => format!("{}-{}", o.csv, format!("{m:?}").to_lowercase()),
        };
        let path = format!("{prefix}-{name}.csv");
        std::fs::write(&path, harness::csv(&name, "f32", &rows, factor))
            .map_err(|e| handoff::Error::InvalidArgument(format!("writing {path}: {e}")))?;
        println!("# wrote {path}");
        if let Some(prefix) = &o.svg {
            let path = format!("{prefix}-{name}.svg");
            let title = format!("handoff {name}: {label}, f32, {}", o.memory.describe());
            harness::plot(&path, &title, &rows, factor).map_err(handoff::Error::InvalidArgument)?;
            println!("# wrote {path}");
        }
    }
    for s in &streams {
        s.synchronize()?;
    }
    // Registrations and windows end before their buffers and communicators.
    drop(ways);
    Ok(())
}
