//! The async waits under tokio, on a GPU: a multi-threaded runtime of two worker threads
//! awaits 256 futures at once (an event's completion, a stream's work so far, a communicator's
//! queued work, a host copy's data), spawned as tasks behind half a second of GPU work. Every
//! value is checked, none resolves before the work is done, and a timer task keeps its
//! cadence throughout: no future blocks a worker thread. A control trial shows the cadence
//! check failing when two tasks wait by blocking (`Stream::synchronize`) instead.
//!
//! Reported as ignored where no GPU is usable; see `tests/common/mod.rs`. Serial: the timings
//! are the test's, and another test's GPU work would stretch them.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Gpus, assert_all_eq};
use handoff::kernels::{self, produced_value};
use handoff::{CommOptions, DeviceBuffer, Event, HostBuffer, ReduceOp, Stream};
use libtest_mimic::Failed;

/// The GPU work every future waits behind.
const WORK: Duration = Duration::from_millis(500);
/// The timer task's period.
const TICK: Duration = Duration::from_millis(1);
/// The longest gap between two ticks that still counts as the timer's cadence kept: a tenth of
/// the work, so that a worker blocked for the work shows as five times as much.
const CADENCE: Duration = Duration::from_millis(50);

fn main() {
    let g = Gpus::detect();
    common::run_serial(vec![
        g.trial(
            "tokio_two_workers_await_256_futures_and_the_timer_keeps_its_cadence",
            1,
            many_futures_on_two_workers,
        ),
        g.trial(
            "tokio_blocking_waits_on_both_workers_stall_the_timer",
            1,
            blocking_waits_stall_the_timer,
        ),
    ]);
}

/// The runtime of the tests: two worker threads, tokio's timer.
fn runtime() -> Result<tokio::runtime::Runtime, Failed> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()?)
}

/// A task that sleeps `TICK` at a time until `stop`, and returns its ticks and the longest
/// time between two of them (or between its start and its first).
fn ticker(rt: &tokio::runtime::Runtime, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<(usize, Duration)> {
    rt.spawn(async move {
        let (mut ticks, mut worst, mut last) = (0, Duration::ZERO, Instant::now());
        while !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(TICK).await;
            let now = Instant::now();
            worst = worst.max(now - last);
            (last, ticks) = (now, ticks + 1);
        }
        (ticks, worst)
    })
}

/// 64 futures of each kind spawned on two workers behind `WORK` of GPU work; see the file's
/// docs.
fn many_futures_on_two_workers() -> Result<(), Failed> {
    let (dev, comm) = common::one_rank(CommOptions::default())?;
    let s = Stream::new(&dev)?;
    kernels::busy(Duration::ZERO, &s)?;
    s.synchronize()?;
    let n = 1 << 20;
    let mut y = DeviceBuffer::<f32>::zeros(n, &s)?;
    let mut z = DeviceBuffer::<f32>::zeros(n, &s)?;
    let mut host = HostBuffer::<f32>::zeros(n, &dev)?;
    let rt = runtime()?;
    let stop = Arc::new(AtomicBool::new(false));
    let timer = ticker(&rt, stop.clone());
    let started = Instant::now();
    kernels::busy(WORK, &s)?;
    kernels::produce(&mut y, 7, &s)?;
    host.copy_from_device(&y, &s)?;
    // One rank: the all-reduce's sum is `y` itself.
    comm.all_reduce(&y, &mut z, ReduceOp::Sum, &s)?;
    let event = Event::without_timing(&dev)?;
    s.record(&event)?;
    let host = Arc::new(host);
    // Every future is made here (a communicator is not `Sync`; its future is `Send`) and
    // awaited in a task of its own. Each task gives the wrong values it read and when it
    // resolved.
    let mut tasks = Vec::new();
    for i in 0..256 {
        let task = match i % 4 {
            0 => {
                let f = event.completed();
                rt.spawn(async move { f.await.map(|()| (0, started.elapsed())) })
            }
            1 => {
                let f = s.completion();
                rt.spawn(async move { f.await.map(|()| (0, started.elapsed())) })
            }
            2 => {
                let f = comm.wait_stream_async(&s);
                rt.spawn(async move { f.await.map(|()| (0, started.elapsed())) })
            }
            _ => {
                let host = host.clone();
                rt.spawn(async move {
                    let data = host.read_async().await?;
                    let at = started.elapsed();
                    let wrong = (0..data.len())
                        .step_by(4099)
                        .filter(|&i| data[i] != produced_value(i, 7))
                        .count();
                    Ok((wrong, at))
                })
            }
        };
        tasks.push(task);
    }
    let outs = rt.block_on(async {
        let mut outs = Vec::with_capacity(tasks.len());
        for t in tasks {
            outs.push(t.await);
        }
        outs
    });
    let all_done = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let (ticks, worst) = rt.block_on(timer)?;
    let (mut wrong, mut earliest) = (0, Duration::MAX);
    for o in outs {
        let (w, at) = o.map_err(|e| format!("a task failed: {e}"))??;
        wrong += w;
        earliest = earliest.min(at);
    }
    println!(
        "256 futures on 2 tokio workers resolved from {earliest:?} to {all_done:?} after {WORK:?} \
         of work was queued; the 1 ms timer ticked {ticks} times, its longest gap {worst:?}"
    );
    if wrong > 0 {
        return Err(format!("{wrong} wrong values read after the host copy's future resolved").into());
    }
    if earliest < WORK - Duration::from_millis(10) {
        return Err(format!("a future resolved after {earliest:?}, before the {WORK:?} of work").into());
    }
    if worst > CADENCE {
        return Err(format!(
            "the timer's longest gap was {worst:?} (over {CADENCE:?}): a future blocked a worker"
        )
        .into());
    }
    let got = z.to_vec(&s)?;
    assert_all_eq("the all-reduce of one rank", &got, |i| produced_value(i, 7))?;
    Ok(())
}

/// The control: two tasks that wait by blocking their workers (`Stream::synchronize`) behind
/// `WORK` leave the timer without a thread, and its longest gap shows it. So the cadence check
/// above can fail.
fn blocking_waits_stall_the_timer() -> Result<(), Failed> {
    let (_, s, _) = common::gpu0_two_streams()?;
    kernels::busy(Duration::ZERO, &s)?;
    s.synchronize()?;
    let s = Arc::new(s);
    let rt = runtime()?;
    let stop = Arc::new(AtomicBool::new(false));
    let timer = ticker(&rt, stop.clone());
    // The timer runs before the workers block.
    std::thread::sleep(Duration::from_millis(20));
    kernels::busy(WORK, &s)?;
    let blockers: Vec<_> = (0..2)
        .map(|_| {
            let s = s.clone();
            rt.spawn(async move { s.synchronize() })
        })
        .collect();
    rt.block_on(async {
        for b in blockers {
            b.await.map_err(|e| format!("a task failed: {e}"))??;
        }
        Ok::<(), Failed>(())
    })?;
    stop.store(true, Ordering::Relaxed);
    let (ticks, worst) = rt.block_on(timer)?;
    println!(
        "two blocking waits on 2 tokio workers: the timer ticked {ticks} times, its longest gap {worst:?}"
    );
    if worst <= CADENCE {
        return Err(format!(
            "two workers blocked for {WORK:?}, yet the timer's longest gap was {worst:?}: the \
             cadence check cannot see a blocked worker"
        )
        .into());
    }
    Ok(())
}
