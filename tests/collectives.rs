//! NCCL's collectives through handoff (issue 11, first part): values checked element by element
//! against a host computation on two GPUs, in one process and in two; in-place forms; sizes and
//! roots refused before NCCL; verification catching a collective that differs on one rank; and
//! a collective's input rewritten, and its output read, on other streams right after it (these
//! fail with tracking bypassed); splitting a communicator into sub-communicators and back.

mod common;

use std::time::Duration;

use common::{Gpus, assert_all_eq};
use handoff::kernels::{self, produced_value};
use handoff::{CommOptions, Communicator, Device, DeviceBuffer, Error, Launch, ReduceOp, Stream, group};
use libtest_mimic::Failed;

/// Not a power of two.
const N: usize = 1001;

fn main() {
    common::run_child_role(&[("collectives", child_collectives)]);
    let g = Gpus::detect();
    common::run(vec![
        g.trial("sizes_and_roots_are_refused_before_nccl", 1, bad_arguments),
        g.trial("every_collective_and_reduction_in_one_process", 2, in_one_process),
        g.ranks_trial("every_collective_in_two_processes", || in_processes(2)),
        g.ranks_trial("every_collective_among_three_processes", || in_processes(3)),
        g.ranks_trial(
            "three_processes_split_by_parity_and_reduce_in_each_part",
            split_three,
        ),
        g.ranks_trial(
            "a_count_that_differs_on_one_of_three_ranks_is_refused_on_all",
            mismatch_three,
        ),
        g.ranks_trial(
            "every_collective_in_two_processes_over_the_network_transport",
            over_the_network,
        ),
        g.ranks_trial("an_op_that_differs_on_one_rank_is_a_mismatch_on_both", || {
            mismatch(Case::Op)
        }),
        g.ranks_trial("a_count_that_differs_on_one_rank_is_a_mismatch_on_both", || {
            mismatch(Case::Count)
        }),
        g.ranks_trial("a_root_that_differs_on_one_rank_is_a_mismatch_on_both", || {
            mismatch(Case::Root)
        }),
        g.ranks_trial(
            "a_collective_that_differs_on_one_rank_is_a_mismatch_on_both",
            || mismatch(Case::Kind),
        ),
        g.ranks_trial("a_pre_mul_sum_against_a_sum_is_a_mismatch_on_both", || {
            mismatch(Case::PreMulSum)
        }),
        g.trial(
            "hazard_collective_input_rewritten_and_output_read_on_other_streams",
            2,
            hazards,
        ),
        g.ranks_trial(
            "hazard_collective_input_rewritten_and_output_read_on_other_streams_in_two_processes",
            hazards_in_processes,
        ),
        g.ranks_trial(
            "a_barrier_holds_every_rank_until_the_work_queued_before_it_everywhere_is_done",
            barrier_in_processes,
        ),
        g.trial("pre_mul_sum_scales_each_rank_before_summing", 2, pre_mul_sum),
        g.trial(
            "a_rank_made_by_init_all_splits_only_with_split_all",
            1,
            split_alone,
        ),
        g.trial("split_all_into_single_rank_halves_and_back", 2, split_halves),
        g.trial("split_all_with_keys_reversed_reorders_the_ranks", 2, || {
            split_reordered(true)
        }),
        g.ranks_trial("split_leaves_a_rank_out_and_verifies_the_child", || {
            split_in_processes(true)
        }),
        g.ranks_trial(
            "non_blocking_split_leaves_a_rank_out_and_verifies_the_child",
            || split_in_processes(false),
        ),
        g.ranks_trial("a_non_blocking_split_a_rank_never_joins_times_out", || {
            split_times_out(Some(0))
        }),
        g.ranks_trial(
            "a_non_blocking_split_a_rank_never_joins_times_out_for_a_rank_left_out",
            || split_times_out(None),
        ),
        g.trial(
            "non_blocking_split_all_with_keys_reversed_reorders_the_ranks",
            2,
            || split_reordered(false),
        ),
    ]);
}

/// Rank `r`'s input: small integers, exact in f32 whatever the reduction.
fn input(r: usize, i: usize) -> f32 {
    ((i % 7) + r + 1) as f32
}

fn reduce_host(op: ReduceOp, world: usize, i: usize) -> f32 {
    let vals = (0..world).map(|r| input(r, i));
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Prod => vals.product(),
        ReduceOp::Max => vals.fold(f32::MIN, f32::max),
        ReduceOp::Min => vals.fold(f32::MAX, f32::min),
        ReduceOp::Avg => vals.sum::<f32>() / world as f32,
    }
}

const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Avg,
];

fn bad_arguments() -> Result<(), Failed> {
    let dev = Device::new(0)?;
    let comm = Communicator::init_all(std::slice::from_ref(&dev))?
        .pop()
        .ok_or("no communicator")?;
    let s = Stream::new(&dev)?;
    let x = DeviceBuffer::<f32>::zeros(8, &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(7, &s)?;
    for (what, r) in [
        (
            "all_reduce of 8 into 7",
            comm.all_reduce(&x, &mut y, ReduceOp::Sum, &s),
        ),
        (
            "all_gather of 8 into 7 (world 1)",
            comm.all_gather(&x, &mut y, &s),
        ),
        (
            "reduce_scatter of 8 into 7 (world 1)",
            comm.reduce_scatter(&x, &mut y, ReduceOp::Sum, &s),
        ),
        ("broadcast from root 1 of 1", comm.broadcast(&mut y, 1, &s)),
        (
            "reduce to root 3 of 1",
            comm.reduce(x.slice(..7)?, &mut y, ReduceOp::Max, 3, &s),
        ),
    ] {
        match r {
            Err(Error::InvalidArgument(m)) => println!("{what}: refused: {m}"),
            other => return Err(format!("{what}: {other:?}").into()),
        }
    }
    if let Some(r) = comm.broken_reason() {
        return Err(format!("the communicator broke: {r}").into());
    }
    // A one-rank all-reduce in place works.
    let mut z = DeviceBuffer::from_slice(&[1.5f32; 8], &s)?;
    comm.all_reduce_in_place(&mut z, ReduceOp::Sum, &s)?;
    assert_all_eq("z", &z.to_vec(&s)?, |_| 1.5)
}

/// Each rank's buffers for one round of every collective.
struct Bufs {
    x: DeviceBuffer<f32>,
    y: DeviceBuffer<f32>,
    gathered: DeviceBuffer<f32>,
    scattered: DeviceBuffer<f32>,
    wide: DeviceBuffer<f32>,
}

fn bufs(r: usize, world: usize, s: &Stream) -> handoff::Result<Bufs> {
    let host: Vec<f32> = (0..N).map(|i| input(r, i)).collect();
    let wide: Vec<f32> = (0..world * N).map(|i| input(r, i % N) + (i / N) as f32).collect();
    Ok(Bufs {
        x: DeviceBuffer::from_slice(&host, s)?,
        y: DeviceBuffer::zeros(N, s)?,
        gathered: DeviceBuffer::zeros(world * N, s)?,
        scattered: DeviceBuffer::zeros(N, s)?,
        wide: DeviceBuffer::from_slice(&wide, s)?,
    })
}

/// Checks rank `r`'s results after one round: all_reduce (`op`) into y, all_gather, a sum
/// reduce_scatter of `wide`, then an in-place sum all-reduce of x and a broadcast of it from
/// rank 1.
fn check(r: usize, world: usize, b: &Bufs, s: &Stream, op: ReduceOp) -> Result<(), Failed> {
    let mut y = b.y.to_vec(s)?;
    if op == ReduceOp::Avg {
        // NCCL averages as a sum of each rank's value times 1/world, which rounds where 1/world
        // is not a power of two: a value within a few ulps counts as the mean.
        for (i, v) in y.iter_mut().enumerate() {
            let want = reduce_host(op, world, i);
            if (*v - want).abs() <= 4.0 * f32::EPSILON * want.abs() {
                *v = want;
            }
        }
    }
    assert_all_eq(&format!("rank {r} all_reduce {op:?}"), &y, |i| {
        reduce_host(op, world, i)
    })?;
    assert_all_eq(&format!("rank {r} all_gather"), &b.gathered.to_vec(s)?, |i| {
        input(i / N, i % N)
    })?;
    // reduce_scatter (sum) of `wide`: block r of every rank's wide, summed.
    assert_all_eq(
        &format!("rank {r} reduce_scatter"),
        &b.scattered.to_vec(s)?,
        |i| (0..world).map(|q| input(q, i) + r as f32).sum(),
    )?;
    // x: the in-place all-reduce (sum), then the broadcast from rank 1 of that: unchanged.
    assert_all_eq(&format!("rank {r} in place + broadcast"), &b.x.to_vec(s)?, |i| {
        reduce_host(ReduceOp::Sum, world, i)
    })
}

/// Elements per block of all_to_all, gather (to rank 1) and scatter (from rank 0).
const M: usize = 333;

/// Element `i` of block `b` of sender `from`'s buffer.
fn piece(from: usize, b: usize, i: usize) -> f32 {
    (from * 100 + b * 10 + i % 7) as f32
}

struct Spread {
    a2a_in: DeviceBuffer<f32>,
    a2a_out: DeviceBuffer<f32>,
    mine: DeviceBuffer<f32>,
    gathered: DeviceBuffer<f32>,
    scatter_in: DeviceBuffer<f32>,
    scattered: DeviceBuffer<f32>,
}

fn spread(r: usize, world: usize, s: &Stream) -> handoff::Result<Spread> {
    let a2a: Vec<f32> = (0..world * M).map(|k| piece(r, k / M, k % M)).collect();
    let mine: Vec<f32> = (0..M).map(|i| piece(r, 0, i)).collect();
    let root0: Vec<f32> = (0..world * M).map(|k| piece(9, k / M, k % M)).collect();
    Ok(Spread {
        a2a_in: DeviceBuffer::from_slice(&a2a, s)?,
        a2a_out: DeviceBuffer::zeros(world * M, s)?,
        mine: DeviceBuffer::from_slice(&mine, s)?,
        // Only the root (rank 1) needs the whole output; the others pass none.
        gathered: DeviceBuffer::zeros(if r == 1 { world * M } else { 0 }, s)?,
        scatter_in: if r == 0 {
            DeviceBuffer::from_slice(&root0, s)?
        } else {
            DeviceBuffer::zeros(0, s)?
        },
        scattered: DeviceBuffer::zeros(M, s)?,
    })
}

fn check_spread(r: usize, b: &Spread, s: &Stream) -> Result<(), Failed> {
    // Block j of my output is rank j's block r.
    assert_all_eq(&format!("rank {r} all_to_all"), &b.a2a_out.to_vec(s)?, |k| {
        piece(k / M, r, k % M)
    })?;
    if r == 1 {
        assert_all_eq("root's gather", &b.gathered.to_vec(s)?, |k| {
            piece(k / M, 0, k % M)
        })?;
    }
    assert_all_eq(&format!("rank {r} scatter"), &b.scattered.to_vec(s)?, |i| {
        piece(9, r, i)
    })
}

fn in_one_process() -> Result<(), Failed> {
    let devs = [Device::new(0)?, Device::new(1)?];
    let comms = Communicator::init_all(&devs)?;
    let ss = [Stream::new(&devs[0])?, Stream::new(&devs[1])?];
    for op in OPS {
        let mut bs = [bufs(0, 2, &ss[0])?, bufs(1, 2, &ss[1])?];
        let [b0, b1] = &mut bs;
        group(|g| {
            for (r, b) in [(0, &mut *b0), (1, &mut *b1)] {
                g.all_reduce(&comms[r], &b.x, &mut b.y, op, &ss[r])?;
                g.all_gather(&comms[r], &b.x, &mut b.gathered, &ss[r])?;
                g.reduce_scatter(&comms[r], &b.wide, &mut b.scattered, ReduceOp::Sum, &ss[r])?;
            }
            Ok(())
        })?;
        group(|g| {
            for (r, b) in [(0, &mut *b0), (1, &mut *b1)] {
                g.all_reduce_in_place(&comms[r], &mut b.x, ReduceOp::Sum, &ss[r])?;
            }
            Ok(())
        })?;
        group(|g| {
            for (r, b) in [(0, &mut *b0), (1, &mut *b1)] {
                g.broadcast(&comms[r], &mut b.x, 1, &ss[r])?;
            }
            Ok(())
        })?;
        for (r, b) in bs.iter().enumerate() {
            check(r, 2, b, &ss[r], op)?;
        }
    }
    let mut sp = [spread(0, 2, &ss[0])?, spread(1, 2, &ss[1])?];
    {
        let [p0, p1] = &mut sp;
        group(|g| {
            for (r, p) in [(0, &mut *p0), (1, &mut *p1)] {
                g.all_to_all(&comms[r], &p.a2a_in, &mut p.a2a_out, &ss[r])?;
                g.gather(&comms[r], &p.mine, &mut p.gathered, 1, &ss[r])?;
                g.scatter(&comms[r], &p.scatter_in, &mut p.scattered, 0, &ss[r])?;
            }
            Ok(())
        })?;
    }
    for (r, p) in sp.iter().enumerate() {
        check_spread(r, p, &ss[r])?;
    }
    // reduce to root 0 (max): only the root's output is written.
    let mut bs = [bufs(0, 2, &ss[0])?, bufs(1, 2, &ss[1])?];
    let [b0, b1] = &mut bs;
    group(|g| {
        g.reduce(&comms[0], &b0.x, &mut b0.y, ReduceOp::Max, 0, &ss[0])?;
        g.reduce(&comms[1], &b1.x, &mut b1.y, ReduceOp::Max, 0, &ss[1])
    })?;
    assert_all_eq("root's reduce", &b0.y.to_vec(&ss[0])?, |i| {
        reduce_host(ReduceOp::Max, 2, i)
    })?;
    assert_all_eq("non-root's output", &b1.y.to_vec(&ss[1])?, |_| 0.0)
}

fn in_processes(world: usize) -> Result<(), Failed> {
    let job = common::spawn_n("collectives", world, false)?;
    Ok(job.wait_timeout(Duration::from_secs(240))?.check()?)
}

/// The path a job across hosts takes: NCCL's network transport (sockets, on the loopback
/// interface), with its peer-to-peer and shared-memory transports off; the unique id through
/// the bootstrap. NCCL's own log must show the socket transport.
fn over_the_network() -> Result<(), Failed> {
    let sharing = handoff::nccl::bootstrap::GpuSharing::WhenFewerGpus;
    let job = handoff::nccl::bootstrap::spawn_local_with(2, sharing, |_, cmd| {
        cmd.env(common::CHILD_VAR, "collectives")
            .env("NCCL_P2P_DISABLE", "1")
            .env("NCCL_SHM_DISABLE", "1")
            .env("NCCL_NET", "Socket")
            .env("NCCL_IB_DISABLE", "1")
            .env("NCCL_SOCKET_IFNAME", "lo")
            .env("NCCL_DEBUG", "INFO")
            .env("NCCL_DEBUG_SUBSYS", "INIT,NET")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
    })?;
    let exit = job.wait_timeout(Duration::from_secs(240))?;
    let failed = exit.failed();
    let log: String = exit
        .ranks
        .iter()
        .map(|r| format!("{}{}", r.stdout, r.stderr))
        .collect();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("NET/Socket") || l.contains("via NET"))
        .collect();
    println!(
        "{} lines of NCCL's log name the socket transport, e.g.:",
        lines.len()
    );
    for l in lines.iter().take(3) {
        println!("  {l}");
    }
    if !failed.is_empty() {
        return Err(format!(
            "ranks {failed:?} failed:\n{}",
            log.lines().rev().take(20).collect::<Vec<_>>().join("\n")
        )
        .into());
    }
    if lines.is_empty() {
        return Err("NCCL's log does not show the socket transport".into());
    }
    Ok(())
}

fn child_collectives() -> Result<(), Failed> {
    let launch = Launch::from_env()?.ok_or("no launcher variables")?;
    let comm = launch.communicator(CommOptions::default().with_timeout(Duration::from_secs(60)))?;
    let (r, world) = (comm.rank(), comm.world_size());
    let s = Stream::new(comm.device())?;
    for op in OPS {
        let mut b = bufs(r, world, &s)?;
        comm.all_reduce(&b.x, &mut b.y, op, &s)?;
        comm.all_gather(&b.x, &mut b.gathered, &s)?;
        comm.reduce_scatter(&b.wide, &mut b.scattered, ReduceOp::Sum, &s)?;
        comm.all_reduce_in_place(&mut b.x, ReduceOp::Sum, &s)?;
        comm.broadcast(&mut b.x, 1, &s)?;
        check(r, world, &b, &s, op)?;
    }
    let mut p = spread(r, world, &s)?;
    comm.all_to_all(&p.a2a_in, &mut p.a2a_out, &s)?;
    comm.gather(&p.mine, &mut p.gathered, 1, &s)?;
    comm.scatter(&p.scatter_in, &mut p.scattered, 0, &s)?;
    check_spread(r, &p, &s)?;
    let mut b = bufs(r, world, &s)?;
    comm.reduce(&b.x, &mut b.y, ReduceOp::Min, 1, &s)?;
    if r == 1 {
        assert_all_eq("root's reduce", &b.y.to_vec(&s)?, |i| {
            reduce_host(ReduceOp::Min, world, i)
        })?;
    }
    s.synchronize()?;
    comm.finalize()?;
    Ok(())
}

/// How a collective differs on rank 1 in [`mismatch`].
#[derive(Clone, Copy, Debug)]
enum Case {
    Op,
    Count,
    Root,
    Kind,
    PreMulSum,
}

/// Two ranks in two processes: rank 1 posts a collective that differs from rank 0's as `case`
/// says; both ranks get `Error::Mismatch`, nothing transferred.
fn mismatch(case: Case) -> Result<(), Failed> {
    let opts = CommOptions::default().with_timeout(Duration::from_secs(20));
    let results = common::two_ranks([opts, opts], move |made| {
        let run = || -> handoff::Result<handoff::Result<()>> {
            let comm = made?;
            let s = Stream::new(comm.device())?;
            let x = DeviceBuffer::from_slice(&[1.0f32; 8], &s)?;
            let mut y = DeviceBuffer::<f32>::zeros(8, &s)?;
            let odd = comm.rank() == 1;
            Ok(match case {
                Case::Op => comm.all_reduce(&x, &mut y, if odd { ReduceOp::Max } else { ReduceOp::Sum }, &s),
                Case::Count => comm.all_reduce(
                    x.slice(..if odd { 7 } else { 8 })?,
                    y.slice_mut(..if odd { 7 } else { 8 })?,
                    ReduceOp::Sum,
                    &s,
                ),
                Case::Root => comm.broadcast(&mut y, if odd { 0 } else { 1 }, &s),
                Case::Kind => {
                    if odd {
                        comm.all_reduce(&x, &mut y, ReduceOp::Sum, &s)
                    } else {
                        comm.broadcast(&mut y, 0, &s)
                    }
                }
                Case::PreMulSum => {
                    if odd {
                        comm.all_reduce_pre_mul_sum(&x, &mut y, 2.0, &s)
                    } else {
                        comm.all_reduce(&x, &mut y, ReduceOp::Sum, &s)
                    }
                }
            })
        };
        match run() {
            Ok(Err(Error::Mismatch { detail })) => Ok(detail),
            other => Err(format!("expected a mismatch, got {other:?}")),
        }
    })?;
    for (rank, detail) in common::both_ok(results)?.iter().enumerate() {
        println!("{case:?}, rank {rank}: {detail}");
    }
    Ok(())
}

/// An all-reduce queued behind 300 ms of GPU work on its stream; right after, another stream
/// rewrites its input and another reads its output on the host. With tracking, the rewrite
/// waits for the all-reduce's read and the host read for its write.
fn hazards() -> Result<(), Failed> {
    let devs = [Device::new(0)?, Device::new(1)?];
    let comms = Communicator::init_all(&devs)?;
    let ss = [Stream::new(&devs[0])?, Stream::new(&devs[1])?];
    let others = [Stream::new(&devs[0])?, Stream::new(&devs[1])?];
    let mut xs = [
        DeviceBuffer::<f32>::zeros(N, &ss[0])?,
        DeviceBuffer::<f32>::zeros(N, &ss[1])?,
    ];
    let mut ys = [
        DeviceBuffer::<f32>::zeros(N, &ss[0])?,
        DeviceBuffer::<f32>::zeros(N, &ss[1])?,
    ];
    // Warm the pair up (connections, NCCL's kernels loaded).
    {
        let [x0, x1] = &mut xs;
        group(|g| {
            g.all_reduce_in_place(&comms[0], &mut *x0, ReduceOp::Sum, &ss[0])?;
            g.all_reduce_in_place(&comms[1], &mut *x1, ReduceOp::Sum, &ss[1])
        })?;
    }
    for (r, x) in xs.iter_mut().enumerate() {
        kernels::produce(x, 1, &ss[r])?;
    }
    for s in &ss {
        s.synchronize()?;
        kernels::busy(Duration::from_millis(300), s)?;
    }
    {
        let [x0, x1] = &xs;
        let [y0, y1] = &mut ys;
        group(|g| {
            g.all_reduce(&comms[0], x0, &mut *y0, ReduceOp::Sum, &ss[0])?;
            g.all_reduce(&comms[1], x1, &mut *y1, ReduceOp::Sum, &ss[1])
        })?;
    }
    for (r, x) in xs.iter_mut().enumerate() {
        kernels::produce(x, 50, &others[r])?; // must wait for the all-reduce's read
    }
    for (r, y) in ys.iter().enumerate() {
        assert_all_eq(
            &format!("rank {r}'s output read on another stream"),
            &y.to_vec(&others[r])?,
            |i| 2.0 * produced_value(i, 1),
        )?;
    }
    Ok(())
}

/// [`hazards`] with each rank a process of its own: the same all-reduce behind 300 ms of GPU
/// work, its input rewritten on another stream and its output read there right after.
fn hazards_in_processes() -> Result<(), Failed> {
    let opts = CommOptions::default().with_timeout(Duration::from_secs(60));
    let results = common::two_ranks([opts, opts], |made| {
        let run = || -> Result<(), Failed> {
            let comm = made?;
            let (r, dev) = (comm.rank(), comm.device());
            let (s, other) = (Stream::new(dev)?, Stream::new(dev)?);
            let mut x = DeviceBuffer::<f32>::zeros(N, &s)?;
            let mut y = DeviceBuffer::<f32>::zeros(N, &s)?;
            // Warm the pair up (connections, NCCL's kernels loaded).
            comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &s)?;
            kernels::produce(&mut x, 1, &s)?;
            s.synchronize()?;
            kernels::busy(Duration::from_millis(300), &s)?;
            comm.all_reduce(&x, &mut y, ReduceOp::Sum, &s)?;
            kernels::produce(&mut x, 50, &other)?; // must wait for the all-reduce's read
            assert_all_eq(
                &format!("rank {r}'s output read on another stream"),
                &y.to_vec(&other)?,
                |i| 2.0 * produced_value(i, 1),
            )?;
            s.synchronize()?;
            Ok(())
        };
        run().map_err(|e| e.message().unwrap_or("failed").to_string())
    })?;
    common::both_ok(results).map(|_| ())
}

/// Two ranks in two processes: after a first barrier (which lines the hosts up), rank 0 queues
/// 600 ms of GPU work before its second barrier and rank 1 none. Rank 1's `barrier_wait` must
/// still take most of those 600 ms, as its barrier cannot complete before rank 0's work has;
/// and a following all-reduce still sums correctly (the barrier left the order of collectives
/// intact).
fn barrier_in_processes() -> Result<(), Failed> {
    const BUSY: Duration = Duration::from_millis(600);
    let opts = CommOptions::default().with_timeout(Duration::from_secs(60));
    let results = common::two_ranks([opts, opts], |made| {
        let run = || -> Result<u64, Failed> {
            let comm = made?;
            let s = Stream::new(comm.device())?;
            // Warms the pair up (connections, NCCL's kernels) and lines the hosts up.
            comm.barrier_wait(&s)?;
            comm.barrier_wait(&s)?;
            if comm.rank() == 0 {
                kernels::busy(BUSY, &s)?;
            }
            let start = std::time::Instant::now();
            comm.barrier_wait(&s)?;
            let waited = start.elapsed();
            let mut x = DeviceBuffer::from_slice(&[comm.rank() as f32 + 1.0], &s)?;
            comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &s)?;
            assert_all_eq("the all-reduce after the barrier", &x.to_vec(&s)?, |_| 3.0)?;
            Ok(waited.as_millis() as u64)
        };
        run().map_err(|e| e.message().unwrap_or("failed").to_string())
    })?;
    let [w0, w1] = common::both_ok(results)?;
    println!("barrier_wait took {w0} ms on rank 0 (600 ms of work before it), {w1} ms on rank 1");
    // The hosts left the previous barrier within a few milliseconds of each other.
    if w1 < 400 {
        return Err(
            format!("rank 1 passed the barrier after {w1} ms, before rank 0's 600 ms of work").into(),
        );
    }
    Ok(())
}

/// Three ranks in three processes split by parity (ranks 0 and 2 into one communicator, rank 1
/// alone into another); each part all-reduces its ranks' inputs, checked element by element.
fn split_three() -> Result<(), Failed> {
    let opts = CommOptions::default().with_timeout(Duration::from_secs(60));
    let results = common::ranks(&[opts; 3], |made| {
        let run = || -> Result<(), Failed> {
            let comm = made?;
            let r = comm.rank();
            let part = comm
                .split(Some((r % 2) as u32), r as i32)?
                .ok_or("no communicator")?;
            let members: Vec<usize> = (0..3).filter(|q| q % 2 == r % 2).collect();
            if (part.rank(), part.world_size()) != (r / 2, members.len()) {
                return Err(format!("rank {r} is rank {} of {}", part.rank(), part.world_size()).into());
            }
            let s = Stream::new(comm.device())?;
            let (x, mut y) = x_and_y(r, &s)?;
            part.all_reduce(&x, &mut y, ReduceOp::Sum, &s)?;
            // The whole communicator still works beside its part.
            let (x3, mut y3) = x_and_y(r, &s)?;
            comm.all_reduce(&x3, &mut y3, ReduceOp::Max, &s)?;
            assert_all_eq(&format!("rank {r}'s part's sum"), &y.to_vec(&s)?, |i| {
                members.iter().map(|&q| input(q, i)).sum()
            })?;
            assert_all_eq(&format!("rank {r}'s max of three"), &y3.to_vec(&s)?, |i| {
                reduce_host(ReduceOp::Max, 3, i)
            })?;
            Ok(())
        };
        run().map_err(|e| e.message().unwrap_or("failed").to_string())
    })?;
    let failed: Vec<String> = results
        .into_iter()
        .enumerate()
        .filter_map(|(r, x)| x.err().map(|e| format!("rank {r}: {e}")))
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; ").into())
    }
}

/// Three ranks in three processes: rank 2 all-reduces 7 elements where ranks 0 and 1 reduce 8.
/// Every rank is refused before NCCL (rank 2 with a mismatch, the others with a mismatch or,
/// where rank 2's refusal reached them first, its broken communicator), none waits past its
/// timeout, and no output was written.
fn mismatch_three() -> Result<(), Failed> {
    let opts = CommOptions::default().with_timeout(Duration::from_secs(20));
    let results = common::ranks(&[opts; 3], |made| {
        let comm = made.map_err(|e| e.to_string())?;
        let r = comm.rank();
        let e = |e: Error| format!("rank {r}: {e}");
        let s = Stream::new(comm.device()).map_err(e)?;
        let x = DeviceBuffer::from_slice(&[1.0f32; 8], &s).map_err(e)?;
        let mut y = DeviceBuffer::<f32>::zeros(8, &s).map_err(e)?;
        let n = if r == 2 { 7 } else { 8 };
        let got = comm.all_reduce(
            x.slice(..n).map_err(e)?,
            y.slice_mut(..n).map_err(e)?,
            ReduceOp::Sum,
            &s,
        );
        let untouched = y.to_vec(&s).map(|v| v.iter().all(|&v| v == 0.0));
        match (got, untouched) {
            (Err(Error::Mismatch { detail }), Ok(true)) => Ok(format!("mismatch: {detail}")),
            (Err(Error::PeerBroken { peer }), Ok(true)) if r != 2 => Ok(format!("peer {peer} broke")),
            (other, untouched) => Err(format!("rank {r}: {other:?}, output untouched: {untouched:?}")),
        }
    })?;
    for (r, x) in results.iter().enumerate() {
        println!("rank {r}: {x:?}");
    }
    let refused: Vec<String> = results.into_iter().collect::<Result<_, _>>()?;
    if !refused[2].starts_with("mismatch:") {
        return Err(format!(
            "rank 2, the odd one, was not told of the mismatch: {}",
            refused[2]
        )
        .into());
    }
    Ok(())
}

/// `x` of rank `r`, and a zeroed `y`, on `s`.
fn x_and_y(r: usize, s: &Stream) -> handoff::Result<(DeviceBuffer<f32>, DeviceBuffer<f32>)> {
    let host: Vec<f32> = (0..N).map(|i| input(r, i)).collect();
    Ok((DeviceBuffer::from_slice(&host, s)?, DeviceBuffer::zeros(N, s)?))
}

/// A rank of `init_all` cannot split alone (it would wait for the others forever);
/// `split_all` checks its arguments; a one-rank split gives a one-rank communicator that
/// works, or none for no color.
fn split_alone() -> Result<(), Failed> {
    let dev = Device::new(0)?;
    let comms = Communicator::init_all(std::slice::from_ref(&dev))?;
    for (what, r) in [
        ("split alone", comms[0].split(Some(0), 0).map(|_| ())),
        ("no splits", Communicator::split_all(&comms, &[]).map(|_| ())),
        (
            "color above i32::MAX",
            Communicator::split_all(&comms, &[(Some(u32::MAX), 0)]).map(|_| ()),
        ),
        ("no communicators", Communicator::split_all(&[], &[]).map(|_| ())),
    ] {
        match r {
            Err(Error::InvalidArgument(m)) => println!("{what}: {m}"),
            other => return Err(format!("{what}: expected InvalidArgument, got {other:?}").into()),
        }
    }
    let mut kids = Communicator::split_all(&comms, &[(Some(5), 0)])?;
    let kid = kids.pop().flatten().ok_or("no child for color 5")?;
    if (kid.rank(), kid.world_size()) != (0, 1) {
        return Err(format!("child is rank {} of {}", kid.rank(), kid.world_size()).into());
    }
    let s = Stream::new(&dev)?;
    let (x, mut y) = x_and_y(0, &s)?;
    kid.all_reduce(&x, &mut y, ReduceOp::Sum, &s)?;
    assert_all_eq("one rank's all_reduce", &y.to_vec(&s)?, |i| input(0, i))?;
    let none = Communicator::split_all(&comms, &[(None, 0)])?;
    if none.iter().any(Option::is_some) {
        return Err("a rank with no color got a communicator".into());
    }
    Ok(())
}

/// Two ranks split into two single-rank halves (each reduces alone), then the parent, still
/// whole, reduces over both.
fn split_halves() -> Result<(), Failed> {
    let devs = [Device::new(0)?, Device::new(1)?];
    let comms = Communicator::init_all(&devs)?;
    let ss = [Stream::new(&devs[0])?, Stream::new(&devs[1])?];
    let halves = Communicator::split_all(&comms, &[(Some(0), 0), (Some(1), 0)])?;
    for (r, h) in halves.iter().enumerate() {
        let h = h.as_ref().ok_or("a half is missing")?;
        if (h.rank(), h.world_size(), h.device().ordinal()) != (0, 1, devs[r].ordinal()) {
            return Err(format!("half {r}: {h:?}").into());
        }
        let (x, mut y) = x_and_y(r, &ss[r])?;
        h.all_reduce(&x, &mut y, ReduceOp::Sum, &ss[r])?;
        assert_all_eq("a half's all_reduce", &y.to_vec(&ss[r])?, |i| input(r, i))?;
    }
    drop(halves);
    let mut bs = [x_and_y(0, &ss[0])?, x_and_y(1, &ss[1])?];
    let [b0, b1] = &mut bs;
    group(|g| {
        g.all_reduce(&comms[0], &b0.0, &mut b0.1, ReduceOp::Sum, &ss[0])?;
        g.all_reduce(&comms[1], &b1.0, &mut b1.1, ReduceOp::Sum, &ss[1])
    })?;
    for (r, (_, y)) in bs.iter().enumerate() {
        assert_all_eq("the parent's all_reduce", &y.to_vec(&ss[r])?, |i| {
            reduce_host(ReduceOp::Sum, 2, i)
        })?;
    }
    Ok(())
}

/// One color, keys reversed: the child's rank 0 is the parent's rank 1, which an all_gather's
/// order shows; the children of one color are driven together, like `init_all`'s.
fn split_reordered(blocking: bool) -> Result<(), Failed> {
    let devs = [Device::new(0)?, Device::new(1)?];
    let comms = Communicator::init_all_with(CommOptions::default().with_blocking(blocking), &devs)?;
    let ss = [Stream::new(&devs[0])?, Stream::new(&devs[1])?];
    let kids = Communicator::split_all(&comms, &[(Some(2), 10), (Some(2), 5)])?;
    let kids: Vec<&Communicator> = kids.iter().flatten().collect();
    let ranks: Vec<usize> = kids.iter().map(|k| k.rank()).collect();
    if ranks != [1, 0] || kids.iter().any(|k| k.world_size() != 2) {
        return Err(format!("children: {kids:?}").into());
    }
    // Parent rank p's input is input(p, i); gathered in the children's order: parent 1 first.
    let xs = [x_and_y(0, &ss[0])?.0, x_and_y(1, &ss[1])?.0];
    let mut outs = [
        DeviceBuffer::<f32>::zeros(2 * N, &ss[0])?,
        DeviceBuffer::<f32>::zeros(2 * N, &ss[1])?,
    ];
    let [o0, o1] = &mut outs;
    group(|g| {
        g.all_gather(kids[0], &xs[0], o0, &ss[0])?;
        g.all_gather(kids[1], &xs[1], o1, &ss[1])
    })?;
    for (p, o) in outs.iter().enumerate() {
        assert_all_eq("the child's all_gather", &o.to_vec(&ss[p])?, |i| {
            input(1 - i / N, i % N)
        })?;
    }
    Ok(())
}

/// Two ranks in two processes: rank 1 is left out of the first split (rank 0 gets a one-rank
/// communicator, rank 1 none); both join the second, whose verification catches a collective
/// that differs on one rank, and the third, whose all_reduce works. Non-blocking, NCCL writes
/// the children's handles after `ncclCommSplit` returns.
fn split_in_processes(blocking: bool) -> Result<(), Failed> {
    let opts = CommOptions::default()
        .with_timeout(Duration::from_secs(20))
        .with_blocking(blocking);
    let results = common::two_ranks([opts, opts], |made| {
        let run = || -> handoff::Result<Result<(), String>> {
            let comm = made?;
            let (rank, dev) = (comm.rank(), comm.device().clone());
            let first = comm.split((rank == 0).then_some(0), 0)?;
            match (&first, rank) {
                (Some(c), 0) if c.world_size() == 1 => {}
                (None, 1) => {}
                _ => return Ok(Err(format!("first split gave {first:?}"))),
            }
            let both = comm.split(Some(1), 0)?.ok_or("no communicator".to_string());
            let both = match both {
                Ok(b) => b,
                Err(e) => return Ok(Err(e)),
            };
            if (both.rank(), both.world_size()) != (rank, 2) {
                return Ok(Err(format!("second split gave {both:?}")));
            }
            let s = Stream::new(&dev)?;
            let (x, mut y) = x_and_y(rank, &s)?;
            let op = if rank == 1 { ReduceOp::Max } else { ReduceOp::Sum };
            match both.all_reduce(&x, &mut y, op, &s) {
                Err(Error::Mismatch { .. }) => {}
                other => return Ok(Err(format!("expected a mismatch, got {other:?}"))),
            }
            drop(both);
            let again = comm
                .split(Some(1), 0)?
                .ok_or(Error::InvalidArgument("none".into()))?;
            again.all_reduce(&x, &mut y, ReduceOp::Sum, &s)?;
            let got = y.to_vec(&s)?;
            Ok((0..N)
                .find(|&i| got[i] != reduce_host(ReduceOp::Sum, 2, i))
                .map_or(Ok(()), |i| Err(format!("element {i} is {}", got[i]))))
        };
        run().map_err(|e| e.to_string()).and_then(|r| r)
    })?;
    common::both_ok(results).map(|_| ())
}

/// Non-blocking: rank 0 splits (into `color`), rank 1 never does. Rank 0's split times out
/// within its timeout, and its parent, which the split may have half used, is aborted. Left
/// out (`None`), NCCL 2.28 would crash here if handed its "no color".
fn split_times_out(color: Option<u32>) -> Result<(), Failed> {
    let timeout = Duration::from_secs(2);
    // Made with a long timeout (tests run in parallel), split with a short one.
    let opts = CommOptions::default()
        .with_timeout(Duration::from_secs(20))
        .with_blocking(false);
    let results = common::two_ranks([opts, opts], move |made| {
        let run = || -> handoff::Result<Result<(), String>> {
            let mut comm = made?;
            let rank = comm.rank();
            comm.set_timeout(timeout);
            if rank == 1 {
                std::thread::sleep(3 * timeout);
                return Ok(Ok(()));
            }
            let t = std::time::Instant::now();
            let r = comm.split(color, 0);
            let took = t.elapsed();
            println!("rank 0's split returned after {took:?}: {r:?}");
            Ok(match r {
                Err(Error::Timeout { .. }) if took < 2 * timeout && comm.broken_reason().is_some() => Ok(()),
                other => Err(format!(
                    "expected a timeout within {:?} and the parent broken, got {other:?} after \
                             {took:?}, broken: {:?}",
                    2 * timeout,
                    comm.broken_reason()
                )),
            })
        };
        run().map_err(|e| e.to_string()).and_then(|r| r)
    })?;
    common::both_ok(results).map(|_| ())
}

/// PreMulSum with a different scalar on each rank (2 and 3), all-reduce and reduce-scatter, two
/// ranks in one process: each output element is the sum of scalar × input over the ranks.
fn pre_mul_sum() -> Result<(), Failed> {
    let devs = [Device::new(0)?, Device::new(1)?];
    let comms = Communicator::init_all(&devs)?;
    let ss = [Stream::new(&devs[0])?, Stream::new(&devs[1])?];
    let scalar = |r: usize| (r + 2) as f32;
    // Three rounds: each group makes its operators and destroys them after it.
    for _ in 0..3 {
        let mut bs = [bufs(0, 2, &ss[0])?, bufs(1, 2, &ss[1])?];
        let [b0, b1] = &mut bs;
        group(|g| {
            for (r, b) in [(0, &mut *b0), (1, &mut *b1)] {
                g.all_reduce_pre_mul_sum(&comms[r], &b.x, &mut b.y, scalar(r), &ss[r])?;
                g.reduce_scatter_pre_mul_sum(&comms[r], &b.wide, &mut b.scattered, scalar(r), &ss[r])?;
            }
            Ok(())
        })?;
        for (q, b) in bs.iter().enumerate() {
            assert_all_eq("all_reduce_pre_mul_sum", &b.y.to_vec(&ss[q])?, |i| {
                (0..2).map(|r| scalar(r) * input(r, i)).sum()
            })?;
            // Rank r's wide input at q·N + i is input(r, i) + q.
            assert_all_eq("reduce_scatter_pre_mul_sum", &b.scattered.to_vec(&ss[q])?, |i| {
                (0..2).map(|r| scalar(r) * (input(r, i) + q as f32)).sum()
            })?;
        }
    }
    // An integer type: its scalar is an i32.
    let xs = [0, 1].map(|r| (0..N).map(|i| (i % 5) as i32 - r).collect::<Vec<i32>>());
    let mut ins = Vec::new();
    let mut outs = Vec::new();
    for r in 0..2 {
        ins.push(DeviceBuffer::from_slice(&xs[r], &ss[r])?);
        outs.push(DeviceBuffer::<i32>::zeros(N, &ss[r])?);
    }
    let [o0, o1] = &mut outs[..] else {
        unreachable!("two ranks")
    };
    group(|g| {
        g.all_reduce_pre_mul_sum(&comms[0], &ins[0], o0, -2, &ss[0])?;
        g.all_reduce_pre_mul_sum(&comms[1], &ins[1], o1, 7, &ss[1])
    })?;
    for (q, o) in outs.iter().enumerate() {
        assert_all_eq("i32 all_reduce_pre_mul_sum", &o.to_vec(&ss[q])?, |i| {
            -2 * xs[0][i] + 7 * xs[1][i]
        })?;
    }
    Ok(())
}
