//! CUDA graphs through handoff (issue 12): capture, tracked replays, what a capture refuses,
//! buffers dropped under a graph, and NCCL replays on two ranks in different orders; graph
//! families (many graphs over one communicator, issue 32), whose replays are verified. The
//! hazard tests fail with tracking bypassed, and the family's mismatch test with replays not
//! verified (`--cfg handoff_bypass_replay_check`; `scripts/stage-device.sh` builds both twins).
//!
//! Reported as ignored where no GPU is usable; see `tests/common/mod.rs`.

mod common;

use std::time::{Duration, Instant};

use common::{Gpus, assert_all_eq};
use handoff::kernels::{self, produced_value};
use handoff::{
    CommOptions, Communicator, DeviceBuffer, Error, Event, Graph, GraphFamily, HostBuffer, ReduceOp, Stream,
    group,
};
use libtest_mimic::Failed;

/// Long enough that, without tracking, work queued after it on another stream runs while it
/// still waits.
const LONG: Duration = Duration::from_millis(300);

fn main() {
    let g = Gpus::detect();
    common::run(vec![
        g.trial("kernels_captured_once_replayed_100_times", 1, kernels_replayed),
        g.trial(
            "article_loop_with_self_send_recv_replayed_200_rounds",
            1,
            article_loop_replayed,
        ),
        g.trial(
            "figure3_round_across_two_streams_captured_once_replayed",
            1,
            figure3_round_replayed,
        ),
        g.trial(
            "hazard_host_read_right_after_a_replay",
            1,
            hazard_host_read_after_replay,
        ),
        g.trial(
            "hazard_replay_then_a_write_on_another_stream",
            1,
            hazard_replay_then_write,
        ),
        g.trial(
            "hazard_a_second_replay_behind_a_long_kernel_is_what_another_stream_waits_for",
            1,
            record_rule,
        ),
        g.trial(
            "a_buffer_dropped_under_a_graph_makes_its_replay_an_error",
            1,
            dropped_buffer,
        ),
        g.trial("what_a_capture_cannot_hold_is_refused", 1, refusals),
        g.trial(
            "another_thread_cannot_queue_work_into_a_capture",
            1,
            another_thread,
        ),
        g.ranks_trial(
            "an_operation_captured_on_one_rank_only_is_a_mismatch_on_both",
            captured_on_one_rank_only,
        ),
        g.ranks_trial(
            "a_rank_replaying_alone_is_stopped_within_the_timeout",
            replaying_alone,
        ),
        g.ranks_trial(
            "replays_on_two_ranks_in_different_orders_end_right_or_bounded",
            replays_in_different_orders,
        ),
        g.ranks_trial(
            "a_family_of_graphs_replayed_in_one_order_on_both_ranks_gives_the_right_data",
            family_replays,
        ),
        g.ranks_trial(
            "family_replays_of_different_graphs_are_a_mismatch_on_both_ranks_with_nothing_transferred",
            family_mismatch,
        ),
    ])
}

/// Kernel A then kernel B, captured once; between replays x and y are overwritten eagerly, so
/// every check sees what the replay itself computed.
fn kernels_replayed() -> Result<(), Failed> {
    let (_dev, s, _) = common::gpu0_two_streams()?;
    let n = 1001;
    let mut x = DeviceBuffer::<f32>::zeros(n, &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(n, &s)?;
    let graph = Graph::capture(&s, |s| {
        kernels::produce(&mut x, 7, s)?;
        kernels::twice(&x, &mut y, s)
    })?;
    // Captured, not run.
    assert_all_eq("y before any replay", &y.to_vec(&s)?, |_| 0.0)?;
    for round in 0..100 {
        kernels::produce(&mut x, 1000 + round, &s)?;
        y.memset_zero(&s)?;
        graph.launch(&s)?;
        if round % 10 == 9 {
            assert_all_eq("y after a replay", &y.to_vec(&s)?, |i| 2.0 * produced_value(i, 7))?;
            assert_all_eq("x after a replay", &x.to_vec(&s)?, |i| produced_value(i, 7))?;
        }
    }
    println!("{graph:?}");
    Ok(())
}

/// The article's round on one GPU: A writes x, x is sent to this rank itself and received into
/// r, B computes y = 2r; captured with the graph's own communicator, replayed 200 times.
fn article_loop_replayed() -> Result<(), Failed> {
    let (_dev, comm) = common::one_rank(CommOptions::default())?;
    let s = Stream::new(comm.device())?;
    let mut x = DeviceBuffer::<f32>::zeros(4, &s)?;
    let mut r = DeviceBuffer::<f32>::zeros(4, &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(4, &s)?;
    let graph = Graph::capture_with(comm, &s, |s, comm| {
        kernels::produce(&mut x, 3, s)?;
        group(|g| {
            g.send(comm, &x, 0, s)?;
            g.recv(comm, &mut r, 0, s)
        })?;
        kernels::twice(&r, &mut y, s)
    })?;
    for round in 0..200 {
        r.memset_zero(&s)?;
        y.memset_zero(&s)?;
        graph.launch(&s)?;
        if round % 20 == 19 {
            assert_all_eq("y", &y.to_vec(&s)?, |i| 2.0 * produced_value(i, 3))?;
        }
    }
    graph
        .communicator()
        .ok_or("the graph has its communicator")?
        .synchronize()?;
    println!("200 rounds replayed, y = {:?}", y.to_vec(&s)?);
    Ok(())
}

/// The article's Figure 3 round as one graph across two streams: A writes `a` on the captured
/// stream `p`; a communication stream `c` joins the capture by waiting for an event recorded on
/// `p`, copies `a` slowly into `b` (standing for a late sender), and receives `b` (sent by this
/// rank to itself) into `x`; meanwhile C runs on `p`, then B computes y = 2x there, after the
/// receive only through the edge handoff adds inside the capture (B reads `x`, written on `c`).
/// Replayed 30 times with `x` and `y` cleared eagerly in between, values checked; `c` runs
/// eagerly again after the capture, and an event recorded in the capture cannot be waited for
/// after it.
fn figure3_round_replayed() -> Result<(), Failed> {
    let (_dev, comm) = common::one_rank(CommOptions::default())?;
    let p = Stream::new(comm.device())?;
    let c = Stream::new(comm.device())?;
    let n = 1 << 16;
    let mut a = DeviceBuffer::<f32>::zeros(n, &p)?;
    let mut b = DeviceBuffer::<f32>::zeros(n, &c)?;
    let mut x = DeviceBuffer::<f32>::zeros(n, &c)?;
    let mut y = DeviceBuffer::<f32>::zeros(n, &p)?;
    let fork = Event::without_timing(comm.device())?;
    let graph = Graph::capture_with(comm, &p, |p, comm| {
        kernels::produce(&mut a, 3, p)?;
        p.record(&fork)?;
        c.wait(&fork)?;
        kernels::delayed_copy(&a, &mut b, Duration::from_millis(20), &c)?;
        group(|g| {
            g.send(comm, &b, 0, &c)?;
            g.recv(comm, &mut x, 0, &c)
        })?;
        kernels::busy(Duration::from_micros(100), p)?;
        kernels::twice(&x, &mut y, p)
    })?;
    for round in 0..30 {
        x.memset_zero(&c)?;
        y.memset_zero(&p)?;
        graph.launch(&p)?;
        if round % 10 == 9 {
            assert_all_eq("y after a replay", &y.to_vec(&p)?, |i| 2.0 * produced_value(i, 3))?;
            assert_all_eq("x after a replay", &x.to_vec(&c)?, |i| produced_value(i, 3))?;
        }
    }
    graph
        .communicator()
        .ok_or("the graph has its communicator")?
        .synchronize()?;
    // The communication stream is eager again.
    kernels::produce(&mut x, 5, &c)?;
    assert_all_eq("x written eagerly on c", &x.to_vec(&c)?, |i| produced_value(i, 5))?;
    match c.wait(&fork) {
        Err(Error::Capture { .. }) => Ok(()),
        other => Err(format!("a wait for an event recorded in an ended capture: {other:?}").into()),
    }
}

/// A replay writes y slowly (a long copy); the host reads y right after on another stream.
fn hazard_host_read_after_replay() -> Result<(), Failed> {
    let (_dev, s1, s2) = common::gpu0_two_streams()?;
    let n = 1 << 16;
    let mut x = DeviceBuffer::<f32>::zeros(n, &s1)?;
    kernels::produce(&mut x, 5, &s1)?;
    let mut y = DeviceBuffer::<f32>::zeros(n, &s1)?;
    let graph = Graph::capture(&s1, |s| kernels::delayed_copy(&x, &mut y, LONG, s))?;
    s1.synchronize()?;
    graph.launch(&s1)?;
    assert_all_eq("y read right after the replay", &y.to_vec(&s2)?, |i| {
        produced_value(i, 5)
    })
}

/// The graph record rule that tracking of replays rests on: `cudaGraphLaunch` makes the graph's
/// external event-record node the event's latest record at once, in host order, as
/// `cudaEventRecord` would. A first replay completes (its record complete); a second is queued
/// behind a long kernel and another stream reads its output at once: the read must wait for
/// the second replay, not take the first one's completed record for the event's latest.
fn record_rule() -> Result<(), Failed> {
    let (_dev, s1, s2) = common::gpu0_two_streams()?;
    let n = 1 << 16;
    let mut x = DeviceBuffer::<f32>::zeros(n, &s1)?;
    let mut y = DeviceBuffer::<f32>::zeros(n, &s1)?;
    let graph = Graph::capture(&s1, |s| kernels::twice(&x, &mut y, s))?;
    kernels::produce(&mut x, 1, &s1)?;
    graph.launch(&s1)?;
    s1.synchronize()?;
    kernels::produce(&mut x, 2, &s1)?;
    kernels::busy(LONG, &s1)?;
    graph.launch(&s1)?;
    assert_all_eq(
        "y read on another stream right after the second replay",
        &y.to_vec(&s2)?,
        |i| 2.0 * produced_value(i, 2),
    )
}

/// A replay reads x slowly; x is rewritten on another stream right after the launch.
fn hazard_replay_then_write() -> Result<(), Failed> {
    let (_dev, s1, s2) = common::gpu0_two_streams()?;
    let n = 1 << 16;
    let mut x = DeviceBuffer::<f32>::zeros(n, &s1)?;
    kernels::produce(&mut x, 0, &s1)?;
    let mut out = DeviceBuffer::<f32>::zeros(n, &s1)?;
    let graph = Graph::capture(&s1, |s| kernels::delayed_copy(&x, &mut out, LONG, s))?;
    s1.synchronize()?;
    graph.launch(&s1)?;
    kernels::produce(&mut x, 1, &s2)?;
    assert_all_eq("the replay's copy", &out.to_vec(&s1)?, |i| produced_value(i, 0))?;
    assert_all_eq("x after the write", &x.to_vec(&s2)?, |i| produced_value(i, 1))
}

/// Dropping a buffer the graph uses frees it after the replays queued so far; a later replay
/// is refused before anything is queued, and the graph's other buffers are untouched.
fn dropped_buffer() -> Result<(), Failed> {
    let (_dev, s, _) = common::gpu0_two_streams()?;
    let mut x = DeviceBuffer::<f32>::zeros(1000, &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(1000, &s)?;
    let graph = Graph::capture(&s, |s| {
        kernels::produce(&mut x, 2, s)?;
        kernels::twice(&x, &mut y, s)
    })?;
    graph.launch(&s)?;
    drop(x);
    y.memset_zero(&s)?;
    match graph.launch(&s) {
        Err(Error::InvalidArgument(m)) => println!("refused: {m}"),
        other => return Err(format!("a replay after its buffer was dropped gave {other:?}").into()),
    }
    assert_all_eq("y (not rewritten by a refused replay)", &y.to_vec(&s)?, |_| 0.0)
}

/// Inside a capture: allocation, host copies, events, other communicators and the graph's own
/// communicator on another stream are refused before any CUDA call, so the capture goes on.
fn refusals() -> Result<(), Failed> {
    let (dev, s, s2) = common::gpu0_two_streams()?;
    let mut x = DeviceBuffer::<f32>::zeros(8, &s)?;
    let mut host = HostBuffer::<f32>::zeros(8, &dev)?;
    let event = Event::new(&dev)?;
    let (_, other) = common::one_rank(CommOptions::default())?;
    let mut r = DeviceBuffer::<f32>::zeros(8, &s)?;
    let mut seen = Vec::new();
    let mut expect = |what: &str, r: handoff::Result<()>| match r {
        Err(Error::Capture { detail }) => {
            seen.push(format!("{what}: {detail}"));
            Ok(())
        }
        other => Err(Error::InvalidArgument(format!(
            "{what} in a capture gave {other:?}"
        ))),
    };
    let graph = Graph::capture(&s, |s| {
        expect("allocation", DeviceBuffer::<f32>::zeros(8, s).map(drop))?;
        expect("to_vec", x.to_vec(s).map(drop))?;
        expect("copy_from_slice", x.copy_from_slice(&[1.0; 8], s))?;
        expect("pinned copy", host.copy_from_device(&x, s))?;
        // A wait inside the capture for an event recorded outside it (here: never recorded).
        expect("wait", s.wait(&event))?;
        expect(
            "NCCL on another communicator",
            group(|g| {
                g.send(&other, &x, 0, s)?;
                g.recv(&other, &mut r, 0, s)
            }),
        )?;
        kernels::produce(&mut x, 9, s)
    })?;
    let (_, comm) = common::one_rank(CommOptions::default())?;
    let mut y = DeviceBuffer::<f32>::zeros(8, &s)?;
    let g2 = Graph::capture_with(comm, &s, |s, comm| {
        expect(
            "the graph's communicator on a stream not joined to the capture",
            group(|g| {
                g.send(comm, &x, 0, &s2)?;
                g.recv(comm, &mut y, 0, &s2)
            }),
        )?;
        kernels::twice(&x, &mut y, s)
    })?;
    for line in &seen {
        println!("{line}");
    }
    if seen.len() != 7 {
        return Err(format!("{} refusals, expected 7", seen.len()).into());
    }
    graph.launch(&s)?;
    g2.launch(&s)?;
    assert_all_eq("y after both graphs", &y.to_vec(&s)?, |i| {
        2.0 * produced_value(i, 9)
    })?;
    match g2.launch(&s2) {
        Err(Error::InvalidArgument(m)) => println!("another stream: {m}"),
        other => return Err(format!("an NCCL graph on another stream gave {other:?}").into()),
    }
    Ok(())
}

/// While thread A captures on a stream, thread B's tracked work on it is refused: it neither
/// runs nor slips into A's graph.
fn another_thread() -> Result<(), Failed> {
    let (_dev, s, _) = common::gpu0_two_streams()?;
    let mut x = DeviceBuffer::<f32>::zeros(64, &s)?;
    let mut z = DeviceBuffer::<f32>::zeros(64, &s)?;
    let mut from_b = None;
    let graph = Graph::capture(&s, |s| {
        kernels::produce(&mut x, 1, s)?;
        from_b = Some(std::thread::scope(|t| {
            t.spawn(|| kernels::produce(&mut z, 2, s))
                .join()
                .expect("no panic")
        }));
        Ok(())
    })?;
    match from_b {
        Some(Err(Error::Capture { detail })) => println!("thread B refused: {detail}"),
        other => return Err(format!("thread B's launch during A's capture gave {other:?}").into()),
    }
    graph.launch(&s)?;
    assert_all_eq("x", &x.to_vec(&s)?, |i| produced_value(i, 1))?;
    assert_all_eq("z (B's launch never ran)", &z.to_vec(&s)?, |_| 0.0)
}

/// NCCL requires an operation to be captured on both ranks of a transfer or on neither: rank 0
/// captures its send while rank 1 receives eagerly, and verification refuses both, before NCCL.
fn captured_on_one_rank_only() -> Result<(), Failed> {
    let results = common::two_ranks([CommOptions::default(); 2], move |made| {
        let comm = made.map_err(|e| e.to_string())?;
        let rank = comm.rank();
        let run = || -> handoff::Result<()> {
            let s = Stream::new(comm.device())?;
            let mut a = DeviceBuffer::<f32>::zeros(256, &s)?;
            if rank == 0 {
                Graph::capture_with(comm, &s, |s, comm| comm.send(&a, 1, s)).map(drop)
            } else {
                comm.recv(&mut a, 0, &s)
            }
        };
        match run() {
            Err(Error::Mismatch { detail }) => Ok(detail),
            other => Err(format!("rank {rank} gave {other:?}")),
        }
    })?;
    let [m0, m1] = common::both_ok(results)?;
    println!("rank 0: {m0}\nrank 1: {m1}");
    if !(m0.contains("captured into a graph") && m1.contains("captured into a graph")) {
        return Err("the mismatch does not say which side was captured".into());
    }
    Ok(())
}

/// The two-rank trials' transfer: rank 0 sends `buf` to rank 1, which receives it.
fn one_way(comm: &Communicator, buf: &mut DeviceBuffer<f32>, s: &Stream) -> handoff::Result<()> {
    if comm.rank() == 0 {
        comm.send(&*buf, 1, s)
    } else {
        comm.recv(buf, 0, s)
    }
}

/// Rank 0 replays its send graph 20 times while rank 1 never replays its receive graph: rank 0
/// is stopped (its watchdog, or the wait for its oldest replay) within a few timeouts, never
/// blocked for good inside a launch.
fn replaying_alone() -> Result<(), Failed> {
    let timeout = Duration::from_secs(2);
    let results = common::two_ranks([CommOptions::default().with_timeout(timeout); 2], move |made| {
        let comm = made.map_err(|e| e.to_string())?;
        let rank = comm.rank();
        let run = || -> handoff::Result<String> {
            let s = Stream::new(comm.device())?;
            let mut a = DeviceBuffer::<f32>::zeros(1024, &s)?;
            one_way(&comm, &mut a, &s)?;
            let graph = Graph::capture_with(comm, &s, |s, comm| one_way(comm, &mut a, s))?;
            if rank == 1 {
                return Ok("rank 1 captured and never replayed".into());
            }
            let t = Instant::now();
            for i in 0..20 {
                if let Err(e) = graph.launch(&s) {
                    let late = if t.elapsed() > timeout * 5 {
                        "UNBOUNDED "
                    } else {
                        ""
                    };
                    return Ok(format!("{late}replay {i} refused after {:?}: {e}", t.elapsed()));
                }
            }
            match s.synchronize() {
                Ok(()) => Ok(format!(
                    "WRONG: 20 replays completed with no peer in {:?}",
                    t.elapsed()
                )),
                Err(e) => Ok(format!("stopped after {:?}: {e}", t.elapsed())),
            }
        };
        run().map_err(|e| e.to_string())
    })?;
    let [r0, r1] = common::both_ok(results)?;
    println!("rank 0: {r0}\nrank 1: {r1}");
    if r0.contains("WRONG") || r0.contains("UNBOUNDED") {
        return Err(r0.into());
    }
    Ok(())
}

/// Two ranks, two graphs each, one communicator per graph (the second split from the first),
/// both captured on one stream. Rank 0 replays A then B, rank 1 B then A: each replay can
/// meet only its own verified counterpart, so the ranks either finish with the right data or
/// (the cross order deadlocks on the shared stream) the watchdog aborts within its timeout.
/// Never wrong data, never an unbounded wait.
fn replays_in_different_orders() -> Result<(), Failed> {
    let timeout = Duration::from_secs(3);
    let results = common::two_ranks([CommOptions::default().with_timeout(timeout); 2], move |made| {
        let comm_a = made.map_err(|e| e.to_string())?;
        let rank = comm_a.rank();
        let run = || -> handoff::Result<String> {
            let comm_b = comm_a.split(Some(0), rank as i32)?.expect("colored");
            let s = Stream::new(comm_a.device())?;
            let n = 4096;
            let mut a = DeviceBuffer::<f32>::zeros(n, &s)?;
            let mut b = DeviceBuffer::<f32>::zeros(n, &s)?;
            if rank == 0 {
                kernels::produce(&mut a, 11, &s)?;
                kernels::produce(&mut b, 22, &s)?;
            }
            // NCCL connects peers on their first transfer, which it cannot do in a capture.
            for (comm, buf) in [(&comm_a, &mut a), (&comm_b, &mut b)] {
                one_way(comm, buf, &s)?;
                if rank == 1 {
                    // Received again only by replays: the check below sees theirs.
                    buf.memset_zero(&s)?;
                }
            }
            let mut graphs = Vec::new();
            for (comm, buf) in [(comm_a, &mut a), (comm_b, &mut b)] {
                graphs.push(Graph::capture_with(comm, &s, |s, comm| one_way(comm, buf, s))?);
            }
            let order: [usize; 2] = if rank == 0 { [0, 1] } else { [1, 0] };
            let t = Instant::now();
            for g in order {
                graphs[g].launch(&s)?;
            }
            let done = s.synchronize();
            let took = t.elapsed();
            match done {
                Ok(()) => {
                    if rank == 1 {
                        let (va, vb) = (a.to_vec(&s)?, b.to_vec(&s)?);
                        let ok = va.iter().enumerate().all(|(i, v)| *v == produced_value(i, 11))
                            && vb.iter().enumerate().all(|(i, v)| *v == produced_value(i, 22));
                        if !ok {
                            return Ok(format!("WRONG DATA after {took:?}"));
                        }
                    }
                    Ok(format!("completed with the right data in {took:?}"))
                }
                Err(_) if took > timeout * 10 => Ok(format!("UNBOUNDED wait: {took:?}")),
                Err(e) => Ok(format!("error after {took:?}: {e}")),
            }
        };
        run().map_err(|e| e.to_string())
    })?;
    judged(results, &["WRONG", "UNBOUNDED"])
}

/// What a rank's output buffers hold before a replay writes them.
const CANARY: f32 = -1.0;

/// Connects `comm` for what the family tests capture: rank 0's send to rank 1, and all-reduces
/// of `sizes` (NCCL connects per algorithm, which it picks by size).
fn connect(comm: &Communicator, sizes: &[usize], s: &Stream) -> handoff::Result<()> {
    let mut x = DeviceBuffer::<f32>::zeros(4096, s)?;
    one_way(comm, &mut x, s)?;
    for &n in sizes {
        comm.all_reduce_in_place(x.slice_mut(..n)?, ReduceOp::Sum, s)?;
    }
    comm.barrier_wait(s)
}

/// Two ranks, one family of three graphs: all-reduces of 256 and 4096 elements and a send of
/// 1024 from rank 0 to rank 1. After the captures every output is reset to a canary; both
/// ranks replay in the order B, A, P, B; then every output holds what the replays computed.
fn family_replays() -> Result<(), Failed> {
    let results = common::two_ranks(
        [CommOptions::default().with_timeout(Duration::from_secs(20)); 2],
        |made| {
            let comm = made.map_err(|e| e.to_string())?;
            let rank = comm.rank();
            let run = || -> handoff::Result<String> {
                let s = Stream::new(comm.device())?;
                connect(&comm, &[256, 4096], &s)?;
                let me = (rank + 1) as f32;
                let in_a = DeviceBuffer::from_slice(&[me; 256], &s)?;
                let in_b = DeviceBuffer::from_slice(&vec![2.0 * me; 4096], &s)?;
                let mut out_a = DeviceBuffer::<f32>::zeros(256, &s)?;
                let mut out_b = DeviceBuffer::<f32>::zeros(4096, &s)?;
                let mut p = DeviceBuffer::from_slice(&vec![if rank == 0 { 7.0 } else { CANARY }; 1024], &s)?;
                let family = GraphFamily::new(comm, &s)?;
                let a = family.capture(&s, |s, c| c.all_reduce(&in_a, &mut out_a, ReduceOp::Sum, s))?;
                let b = family.capture(&s, |s, c| c.all_reduce(&in_b, &mut out_b, ReduceOp::Sum, s))?;
                let pg = family.capture(&s, |s, c| one_way(c, &mut p, s))?;
                out_a.copy_from_slice(&[CANARY; 256], &s)?;
                out_b.copy_from_slice(&vec![CANARY; 4096], &s)?;
                if rank == 1 {
                    p.copy_from_slice(&vec![CANARY; 1024], &s)?;
                }
                let t = Instant::now();
                for g in [&b, &a, &pg, &b] {
                    g.launch(&s)?;
                }
                let queued = t.elapsed();
                family.synchronize()?;
                let (va, vb, vp) = (out_a.to_vec(&s)?, out_b.to_vec(&s)?, p.to_vec(&s)?);
                let wrong = va.iter().any(|&v| v != 3.0)
                    || vb.iter().any(|&v| v != 6.0)
                    || vp.iter().any(|&v| v != 7.0);
                Ok(format!(
                    "{}four replays queued in {queued:?}",
                    if wrong { "WRONG DATA: " } else { "" }
                ))
            };
            run().map_err(|e| e.to_string())
        },
    )?;
    judged(results, &["WRONG"])
}

/// Two families per rank: one of all-reduces of 256 (A) and 512 (B), one of sends from rank 0
/// to rank 1 of 1024 (P) and 512 (Q). Rank 0 replays A, rank 1 B: both get `Error::Mismatch`,
/// and neither output changes. Then rank 0 replays P, rank 1 Q: the same, and none of rank 0's
/// data reaches rank 1's buffers (NCCL would write a longer send past a shorter receive).
fn family_mismatch() -> Result<(), Failed> {
    let options = CommOptions::default().with_timeout(Duration::from_secs(20));
    let results = common::two_ranks([options; 2], |made| {
        let comm = made.map_err(|e| e.to_string())?;
        let rank = comm.rank();
        let run = || -> handoff::Result<String> {
            let s = Stream::new(comm.device())?;
            let p2p = comm.split(Some(0), rank as i32)?.expect("colored");
            connect(&comm, &[256, 512], &s)?;
            connect(&p2p, &[], &s)?;
            let x = DeviceBuffer::from_slice(&vec![7.0f32; 1024], &s)?;
            let mut out_a = DeviceBuffer::from_slice(&[CANARY; 256], &s)?;
            let mut out_b = DeviceBuffer::from_slice(&[CANARY; 512], &s)?;
            let mut r_p = DeviceBuffer::from_slice(&vec![CANARY; 1024], &s)?;
            let mut r_q = DeviceBuffer::from_slice(&vec![CANARY; 1024], &s)?;
            let colls = GraphFamily::new(comm, &s)?;
            let sends = GraphFamily::new(p2p, &s)?;
            let a = colls.capture(&s, |s, c| {
                c.all_reduce(x.slice(..256)?, &mut out_a, ReduceOp::Sum, s)
            })?;
            let b = colls.capture(&s, |s, c| {
                c.all_reduce(x.slice(..512)?, &mut out_b, ReduceOp::Sum, s)
            })?;
            let transfer = |c: &Communicator, r: &mut DeviceBuffer<f32>, n: usize, s: &Stream| {
                if c.rank() == 0 {
                    c.send(x.slice(..n)?, 1, s)
                } else {
                    c.recv(r.slice_mut(..n)?, 0, s)
                }
            };
            let pg = sends.capture(&s, |s, c| transfer(c, &mut r_p, 1024, s))?;
            let qg = sends.capture(&s, |s, c| transfer(c, &mut r_q, 512, s))?;
            let mut out = String::new();
            for (what, g) in [
                ("collectives", if rank == 0 { &a } else { &b }),
                ("sends", if rank == 0 { &pg } else { &qg }),
            ] {
                match g.launch(&s) {
                    Err(Error::Mismatch { detail }) => out += &format!("{what}: mismatch ({detail}); "),
                    other => out += &format!("WRONG: {what}: the replay gave {other:?}; "),
                }
            }
            // Whatever ran has finished (or was aborted) within the timeout.
            let _ = s.synchronize();
            for (name, buf) in [("A's output", &out_a), ("B's output", &out_b)] {
                if buf.to_vec(&s)?.iter().any(|&v| v != CANARY) {
                    out += &format!("WRONG: {name} changed; ");
                }
            }
            if rank == 1 {
                for (name, buf) in [("P's receive", &r_p), ("Q's receive", &r_q)] {
                    if buf.to_vec(&s)?.iter().any(|&v| v != CANARY) {
                        out += &format!("WRONG: {name} changed; ");
                    }
                }
            }
            Ok(out)
        };
        run().map_err(|e| e.to_string())
    })?;
    judged(results, &["WRONG"])
}

/// Both ranks' reports, printed; the first that holds one of `marks` is the trial's failure.
fn judged(results: [Result<String, String>; 2], marks: &[&str]) -> Result<(), Failed> {
    let [r0, r1] = common::both_ok(results)?;
    println!("rank 0: {r0}\nrank 1: {r1}");
    match [r0, r1].into_iter().find(|r| marks.iter().any(|m| r.contains(m))) {
        Some(r) => Err(r.into()),
        None => Ok(()),
    }
}
