//! The host cost of an async wait, beside the blocking wait for the same work, on one GPU.
//!
//! `cargo bench --bench async_wait -- [--waits N] [--work-us N] [--at-once N] [--repeats N]`
//!
//! Three cases, each timed `--repeats` times and its median printed, per wait:
//! - **already complete**: the work done before the wait starts (the stream synchronized):
//!   `Event::synchronize` and `Stream::synchronize` beside `Event::completed` and
//!   `Stream::completion` made and awaited, `--waits` of each. The future's cost with no
//!   registration (ready at its first poll).
//! - **completing later**, one wait at a time: `--work-us` of GPU work (`kernels::busy`), then
//!   an event recorded and waited for, `--waits / 10` times: blocking beside the future. The
//!   wall time per wait is the work plus how late the wait sees its end (the future: up to the
//!   waking thread's 200 µs sleep); the CPU time is the whole process's, the waking thread's
//!   included.
//! - **many at once**: `--at-once` futures (events and streams, half each) made and polled
//!   once (registered) behind `--work-us` of work, then awaited together on one thread: the
//!   host time per future to make and register, the wall time from the work's end (the
//!   blocking wait of a twin stream's event marks it) to the last future's, and the CPU time
//!   per future of the whole wait.
//!
//! The futures are awaited with a minimal executor of this file (the thread parks until woken),
//! so the figures are handoff's, not a runtime's. CPU times are `CLOCK_PROCESS_CPUTIME_ID`'s.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use clap::Parser;
use handoff::{Device, Event, Stream, kernels};

#[derive(Parser)]
struct Opts {
    /// Waits per timed run of the already-complete case (a tenth of them for the later one).
    #[arg(long, default_value_t = 10_000)]
    waits: u32,
    /// GPU work each later wait and the many-at-once case wait behind, in µs.
    #[arg(long, default_value_t = 1000)]
    work_us: u64,
    /// Futures awaited together in the many-at-once case.
    #[arg(long, default_value_t = 1024)]
    at_once: usize,
    /// Timed runs per case, the median reported.
    #[arg(long, default_value_t = 7)]
    repeats: usize,
    /// Ignored (cargo bench passes it).
    #[arg(long, hide = true)]
    bench: bool,
}

/// Wakes the thread that awaits.
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls `f` on this thread until ready, parking between polls.
fn block_on<F: Future>(f: F) -> F::Output {
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = pin!(f);
    loop {
        if let Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

/// The CPU time of every thread of this process so far.
fn cpu_time() -> Duration {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    unsafe extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    /// Linux's CLOCK_PROCESS_CPUTIME_ID.
    const PROCESS_CPUTIME: i32 = 2;
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: clock_gettime writes one timespec (two 64-bit fields on the 64-bit Linux targets
    // this crate builds for) to the pointer, a live local.
    let rc = unsafe { clock_gettime(PROCESS_CPUTIME, &mut t) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID)");
    Duration::new(t.sec as u64, t.nsec as u32)
}

/// The wall and CPU time of `f`, divided by `per`, in µs.
fn timed(per: u32, f: impl FnOnce() -> handoff::Result<()>) -> handoff::Result<(f64, f64)> {
    let (wall, cpu) = (Instant::now(), cpu_time());
    f()?;
    let us = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(per);
    Ok((us(wall.elapsed()), us(cpu_time() - cpu)))
}

/// The median of each column of `runs`.
fn medians<const N: usize>(runs: &[[f64; N]]) -> [f64; N] {
    std::array::from_fn(|c| {
        let mut v: Vec<f64> = runs.iter().map(|r| r[c]).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    })
}

fn main() -> handoff::Result<()> {
    let o = Opts::parse();
    if o.waits < 10 || o.at_once == 0 || o.repeats == 0 {
        eprintln!("async_wait: need --waits >= 10, --at-once and --repeats > 0");
        std::process::exit(2);
    }
    let dev = Device::new(0)?;
    let s = Stream::new(&dev)?;
    let twin = Stream::new(&dev)?;
    let event = Event::without_timing(&dev)?;
    let work = Duration::from_micros(o.work_us);
    // The kernel loaded, the waking thread started, the pools warm.
    kernels::busy(Duration::ZERO, &s)?;
    s.record(&event)?;
    block_on(s.completion())?;
    block_on(event.completed())?;
    let mut rows: Vec<(String, [f64; 2])> = Vec::new();

    // Already complete.
    s.synchronize()?;
    s.record(&event)?;
    s.synchronize()?;
    let n = o.waits;
    let ready: [(&str, &dyn Fn() -> handoff::Result<()>); 4] = [
        ("complete: Event::synchronize", &|| event.synchronize()),
        ("complete: Event::completed, awaited", &|| {
            block_on(event.completed())
        }),
        ("complete: Stream::synchronize", &|| s.synchronize()),
        ("complete: Stream::completion, awaited", &|| {
            block_on(s.completion())
        }),
    ];
    for (name, wait) in ready {
        let runs = (0..o.repeats)
            .map(|_| timed(n, || (0..n).try_for_each(|_| wait())).map(|(w, c)| [w, c]))
            .collect::<handoff::Result<Vec<_>>>()?;
        rows.push((name.into(), medians(&runs)));
    }

    // Completing later, one wait at a time.
    let later = n / 10;
    for future in [false, true] {
        let runs = (0..o.repeats)
            .map(|_| {
                timed(later, || {
                    for _ in 0..later {
                        kernels::busy(work, &s)?;
                        s.record(&event)?;
                        if future {
                            block_on(event.completed())?;
                        } else {
                            event.synchronize()?;
                        }
                    }
                    Ok(())
                })
                .map(|(w, c)| [w, c])
            })
            .collect::<handoff::Result<Vec<_>>>()?;
        let way = if future {
            "Event::completed, awaited"
        } else {
            "Event::synchronize"
        };
        rows.push((format!("{} µs of work: {way}", o.work_us), medians(&runs)));
    }

    // Many at once: made and registered, then awaited together.
    let k = o.at_once;
    let twin_event = Event::without_timing(&dev)?;
    let mut many = Vec::new();
    for _ in 0..o.repeats {
        s.synchronize()?;
        twin.synchronize()?;
        kernels::busy(work, &s)?;
        s.record(&event)?;
        // The same work on a twin stream: its blocking wait marks when the work ended.
        kernels::busy(work, &twin)?;
        twin.record(&twin_event)?;
        let cpu = cpu_time();
        let made = Instant::now();
        let mut futures: Vec<std::pin::Pin<Box<dyn Future<Output = handoff::Result<()>>>>> = (0..k)
            .map(|i| {
                if i % 2 == 0 {
                    Box::pin(event.completed()) as std::pin::Pin<Box<dyn Future<Output = _>>>
                } else {
                    Box::pin(s.completion())
                }
            })
            .collect();
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        let mut pending: Vec<usize> = Vec::new();
        for (i, f) in futures.iter_mut().enumerate() {
            match f.as_mut().poll(&mut cx) {
                Poll::Pending => pending.push(i),
                Poll::Ready(r) => r?,
            }
        }
        let registered = made.elapsed();
        let registered_now = pending.len();
        twin_event.synchronize()?;
        let ended = Instant::now();
        while !pending.is_empty() {
            let mut left = Vec::with_capacity(pending.len());
            for i in pending {
                match futures[i].as_mut().poll(&mut cx) {
                    Poll::Pending => left.push(i),
                    Poll::Ready(r) => r?,
                }
            }
            pending = left;
            if !pending.is_empty() {
                std::thread::park();
            }
        }
        let last = ended.elapsed();
        let cpu = cpu_time() - cpu;
        let per = |d: Duration| d.as_secs_f64() * 1e6 / k as f64;
        many.push([
            per(registered),
            last.as_secs_f64() * 1e6,
            per(cpu),
            registered_now as f64,
        ]);
    }
    let [make, last, cpu, pending] = medians(&many);

    println!(
        "async_wait on {} (median of {} runs; µs per wait; CPU: the whole process's)",
        dev.name()?,
        o.repeats
    );
    println!("{:<52} {:>12} {:>12}", "wait", "wall µs", "CPU µs");
    for (name, [wall, cpu]) in &rows {
        println!("{name:<52} {wall:>12.2} {cpu:>12.2}");
    }
    println!(
        "{k} futures at once behind {} µs of work ({pending:.0} registered): made and first \
         polled {make:.2} µs each; the last ready {last:.1} µs after the work's end; CPU {cpu:.2} \
         µs per future in all",
        o.work_us
    );
    Ok(())
}
