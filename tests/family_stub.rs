//! Graph families (`GraphFamily`: many graphs over one communicator), on a CPU, against the
//! stub libraries of tests/stubs. Each replay of a family's graph is compared with every
//! peer's before it is launched. Two ranks, each a thread of this process with a verified
//! communicator of its own, first exchange one send and receive and one all-reduce, then make
//! a family and capture three graphs in it: an all-reduce of 8, one of 16, and a send of 4 from
//! rank 0 to rank 1. Then:
//! - replays in one order on both ranks are each launched once (`cudaGraphLaunch` counted);
//! - rank 0 replaying one graph while rank 1 replays another: `Error::Mismatch` on both, and
//!   neither launches it; the family's graphs are refused from then on;
//! - a capture's body that replays or synchronizes its own family is refused, not deadlocked;
//! - two threads each capturing one family while replaying the other's graph end in
//!   `Error::Timeout` within the timeout, not in a deadlock;
//! - a replay of a graph whose buffer was dropped is refused before it is verified: the
//!   family's communicator stays usable.

use std::path::PathBuf;
use std::sync::{Arc, Barrier, OnceLock};
use std::time::Duration;

use handoff::{
    CommOptions, Communicator, Device, DeviceBuffer, Error, Graph, GraphFamily, ReduceOp, Stream, UniqueId,
};
use libtest_mimic::{Arguments, Failed, Trial};

mod stubs;

static CUDART: OnceLock<PathBuf> = OnceLock::new();

/// This thread's calls of the stub's `cudaGraphLaunch`.
fn launches() -> i64 {
    stubs::count(CUDART.get().expect("built"), "cudart", "cudaGraphLaunch", false)
}

/// One rank's family and its graphs: all-reduces of 8 and of 16, and rank 0's send of 4 to
/// rank 1 (rank 1's receive).
struct Ranked {
    stream: Stream,
    family: GraphFamily,
    graphs: Vec<Graph>,
    _buffers: Vec<DeviceBuffer<f32>>,
}

fn made(rank: usize, comm: Communicator, stream: Stream) -> handoff::Result<Ranked> {
    let s = &stream;
    let mut x = DeviceBuffer::<f32>::zeros(16, s)?;
    // NCCL connects at first use, which it cannot do inside a capture.
    if rank == 0 {
        comm.send(x.slice(..4)?, 1, s)?;
    } else {
        comm.recv(x.slice_mut(..4)?, 0, s)?;
    }
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, s)?;
    s.synchronize()?;
    let family = GraphFamily::new(comm, s)?;
    let mut a = DeviceBuffer::<f32>::zeros(8, s)?;
    let mut b = DeviceBuffer::<f32>::zeros(16, s)?;
    let mut c = DeviceBuffer::<f32>::zeros(4, s)?;
    let graphs = vec![
        family.capture(s, |s, comm| comm.all_reduce_in_place(&mut a, ReduceOp::Sum, s))?,
        family.capture(s, |s, comm| comm.all_reduce_in_place(&mut b, ReduceOp::Sum, s))?,
        family.capture(s, |s, comm| {
            if rank == 0 {
                comm.send(&c, 1, s)
            } else {
                comm.recv(&mut c, 0, s)
            }
        })?,
    ];
    Ok(Ranked {
        stream,
        family,
        graphs,
        _buffers: vec![a, b, c, x],
    })
}

/// Two ranks on two threads, each with its family (timeout `timeout`), running
/// `body(rank, ranked, barrier)`.
fn two_ranks(
    timeout: Duration,
    body: impl Fn(usize, &Ranked, &Barrier) -> Result<(), String> + Send + Sync + 'static,
) -> Result<(), Failed> {
    Ok(stubs::rank_threads(2, timeout, made, body)?)
}

fn replays_in_one_order_are_launched() -> Result<(), Failed> {
    two_ranks(Duration::from_secs(10), |_, r, _| {
        let before = launches();
        for g in [0, 2, 1, 0, 2, 2] {
            r.graphs[g]
                .launch(&r.stream)
                .map_err(|e| format!("replay of graph {g}: {e}"))?;
        }
        r.family.synchronize().map_err(|e| e.to_string())?;
        let n = launches() - before;
        if n != 6 {
            return Err(format!("{n} graph launches, want 6"));
        }
        Ok(())
    })
}

fn replays_of_different_graphs_are_a_mismatch_on_both_ranks_and_not_launched() -> Result<(), Failed> {
    two_ranks(Duration::from_secs(10), |rank, r, barrier| {
        // Both replay graph 2 (the send), then rank 0 the all-reduce of 8, rank 1 that of 16.
        r.graphs[2].launch(&r.stream).map_err(|e| e.to_string())?;
        let before = launches();
        let replayed = r.graphs[rank].launch(&r.stream);
        let launched = launches() - before;
        barrier.wait();
        let after = r.graphs[2].launch(&r.stream);
        println!("rank {rank}: {replayed:?}; next replay: {after:?}");
        match replayed {
            Err(Error::Mismatch { detail }) if detail.contains("replay of a graph") => {}
            other => return Err(format!("the replay gave {other:?}, want Error::Mismatch")),
        }
        if launched != 0 {
            return Err(format!(
                "the mismatched replay was launched ({launched} launches)"
            ));
        }
        if after.is_ok() {
            return Err("a replay after the mismatch was accepted".into());
        }
        Ok(())
    })
}

fn a_capture_that_replays_its_own_family_is_refused() -> Result<(), Failed> {
    let id = UniqueId::new()?;
    let device = Device::new(0)?;
    let comm = Communicator::with_options(1, 0, &id, CommOptions::default(), &device)?;
    let s = Stream::new(&device)?;
    let mut x = DeviceBuffer::<f32>::zeros(8, &s)?;
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &s)?;
    let family = GraphFamily::new(comm, &s)?;
    let first = family.capture(&s, |s, comm| comm.all_reduce_in_place(&mut x, ReduceOp::Sum, s))?;
    let mut inside = Vec::new();
    let second = family.capture(&s, |_, _| {
        inside.push(first.launch(&s).map(drop));
        inside.push(family.synchronize());
        Ok(())
    });
    println!(
        "inside the capture: {inside:?}; the capture: {:?}",
        second.as_ref().map(drop)
    );
    for r in inside {
        if !matches!(r, Err(Error::Capture { .. })) {
            return Err(format!("inside the capture: {r:?}, want Error::Capture").into());
        }
    }
    // Outside, both work.
    first.launch(&s)?;
    family.synchronize()?;
    Ok(())
}

/// A one-rank family on `device` with one graph (an all-reduce of 8), on a stream of its own.
fn one_rank_family(device: &Device, timeout: Duration) -> handoff::Result<(Arc<Stream>, GraphFamily, Graph)> {
    let id = UniqueId::new()?;
    let comm = Communicator::with_options(1, 0, &id, CommOptions::default().with_timeout(timeout), device)?;
    let s = Arc::new(Stream::new(device)?);
    let mut x = DeviceBuffer::<f32>::zeros(8, &s)?;
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &s)?;
    let family = GraphFamily::new(comm, &s)?;
    let graph = family.capture(&s, |s, comm| comm.all_reduce_in_place(&mut x, ReduceOp::Sum, s))?;
    Ok((s, family, graph))
}

fn two_captures_replaying_each_others_family_time_out() -> Result<(), Failed> {
    let timeout = Duration::from_millis(500);
    let device = Device::new(0)?;
    let (sa, fa, ga) = one_rank_family(&device, timeout)?;
    let (sb, fb, gb) = one_rank_family(&device, timeout)?;
    let barrier = Arc::new(Barrier::new(2));
    let (done, results) = std::sync::mpsc::channel();
    for (s, family, theirs, their_stream) in [(sa.clone(), fa, gb, sb.clone()), (sb, fb, ga, sa)] {
        let (barrier, done) = (barrier.clone(), done.clone());
        std::thread::spawn(move || {
            let t = std::time::Instant::now();
            let mut inside = None;
            let _ = family.capture(&s, |_, _| {
                barrier.wait();
                // The other thread holds the other family, capturing it, until both tried.
                inside = Some(theirs.launch(&their_stream).map(drop));
                barrier.wait();
                Ok(())
            });
            let _ = done.send((inside, t.elapsed()));
        });
    }
    for _ in 0..2 {
        let (inside, took) = results
            .recv_timeout(timeout * 10)
            .map_err(|_| "a capture replaying the other family's graph did not end: a deadlock")?;
        println!("replay inside the other's capture: {inside:?} after {took:?}");
        if !matches!(inside, Some(Err(Error::Timeout { .. }))) {
            return Err(format!("the replay gave {inside:?}, want Error::Timeout").into());
        }
    }
    Ok(())
}

fn a_replay_refused_before_verification_leaves_the_family_usable() -> Result<(), Failed> {
    let device = Device::new(0)?;
    let (s, family, _) = one_rank_family(&device, Duration::from_secs(5))?;
    let mut x = DeviceBuffer::<f32>::zeros(8, &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(8, &s)?;
    let doomed = family.capture(&s, |s, comm| comm.all_reduce_in_place(&mut x, ReduceOp::Sum, s))?;
    let kept = family.capture(&s, |s, comm| comm.all_reduce_in_place(&mut y, ReduceOp::Sum, s))?;
    drop(x);
    let refused = doomed.launch(&s);
    let after = kept.launch(&s).and_then(|()| family.synchronize());
    println!("the replay over a dropped buffer: {refused:?}; another graph's after it: {after:?}");
    if !matches!(refused, Err(Error::InvalidArgument(_))) {
        return Err(format!("the replay gave {refused:?}, want Error::InvalidArgument").into());
    }
    after.map_err(|e| format!("the family's communicator broke: {e}").into())
}

fn main() {
    let mut args = Arguments::from_args();
    // The stub NCCL gathers between the threads of one communicator at a time.
    args.test_threads = Some(1);
    // SAFETY: no other thread exists yet, and nothing has read the environment.
    let Some((_, cudart, _)) = (unsafe { stubs::install_gathering_pair("family_stub") }) else {
        return;
    };
    CUDART.set(cudart).expect("once");
    let trials = vec![
        Trial::test(
            "family_replays_in_one_order_on_both_ranks_are_launched",
            replays_in_one_order_are_launched,
        ),
        Trial::test(
            "family_replays_of_different_graphs_are_a_mismatch_on_both_ranks_and_not_launched",
            replays_of_different_graphs_are_a_mismatch_on_both_ranks_and_not_launched,
        ),
        Trial::test(
            "a_capture_that_replays_its_own_family_is_refused_not_deadlocked",
            a_capture_that_replays_its_own_family_is_refused,
        ),
        Trial::test(
            "a_replay_refused_before_verification_leaves_the_family_usable",
            a_replay_refused_before_verification_leaves_the_family_usable,
        ),
        Trial::test(
            "two_captures_replaying_each_others_family_time_out_not_deadlock",
            two_captures_replaying_each_others_family_time_out,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}
