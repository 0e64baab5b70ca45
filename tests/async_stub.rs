//! The async waits (`Event::completed`, `Stream::completion`, `HostBuffer::read_async`,
//! `Communicator::wait_stream_async`) on a CPU, against the stub libraries of tests/stubs (built
//! here with the system's C compiler): the stub runtime's `cudaEventQuery` answers "not ready"
//! (600) or done (0) for every event as the test says (`cudart_stub_set_event_query`), so a
//! future is shown pending while the work "runs", woken and ready once it is done, ended by its
//! timeout (the communicator's aborted then, as by the blocking form), dropped while pending
//! with nothing left registered, and many at once on several threads.
//!
//! The executor is this file's own (`block_on` parks the thread and counts the wakes), and
//! tokio's for one test: a runtime of two workers, whose timer keeps its cadence while 256
//! futures wait. The stub
//! state (the answer of every query, the registered futures) is the process's, so the tests
//! run one at a time, under [`serial`].
//!
//! `cost_per_future` prints the host cost of one future (made, polled pending, woken, polled
//! ready) on the stubs: `cargo test --test async_stub -- --nocapture cost`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use handoff::cuda::completion::registered;
use handoff::{CommOptions, Communicator, Device, DeviceBuffer, Error, Event, HostBuffer, Stream};

mod stubs;

/// Counts the calling thread's heap allocations.
struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; counting touches only a
// const-initialised thread-local without a destructor, which allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|a| a.set(a.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|a| a.set(a.get() + 1));
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// cudaErrorNotReady.
const NOT_READY: i32 = 600;

struct Stubs {
    cudart: libloading::Library,
    nccl: libloading::Library,
}

impl Stubs {
    /// Makes every event pending (the work "runs") or done.
    fn pending(&self, pending: bool) {
        // SAFETY: `void set(int)`.
        unsafe {
            let set: libloading::Symbol<unsafe extern "C" fn(i32)> =
                self.cudart.get(b"cudart_stub_set_event_query\0").expect("setter");
            set(if pending { NOT_READY } else { 0 });
        }
    }

    /// What the stub's `ncclCommGetAsyncError` reports from now on.
    fn async_error(&self, rc: i32) {
        // SAFETY: `void set(int)`.
        unsafe {
            let set: libloading::Symbol<unsafe extern "C" fn(i32)> =
                self.nccl.get(b"nccl_stub_set_async_error\0").expect("setter");
            set(rc);
        }
    }

    /// Every thread's calls of the stub runtime's `name` so far.
    fn count(&self, name: &str) -> i64 {
        let name = std::ffi::CString::new(name).expect("name");
        // SAFETY: `long count(const char *name, int all)`.
        unsafe {
            let count: libloading::Symbol<unsafe extern "C" fn(*const std::ffi::c_char, i32) -> i64> =
                self.cudart.get(b"cudart_stub_count\0").expect("count");
            count(name.as_ptr(), 1)
        }
    }
}

/// The stubs, built and chosen once, and this test's turn: the stub state is the process's.
/// `None` (the test then passes without running) on the GPU machine without a C compiler, as
/// `stubs::build_pair` says.
fn serial() -> Option<(MutexGuard<'static, ()>, &'static Stubs)> {
    static STUBS: OnceLock<Option<Stubs>> = OnceLock::new();
    static TURN: Mutex<()> = Mutex::new(());
    let turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let stubs = STUBS
        .get_or_init(|| {
            let (_, cudart, nccl) = stubs::build_pair("async-stub", "nccl.c")?;
            // SAFETY: every test takes its turn here before anything else, so no other thread
            // of this binary reads the environment now, and nothing has opened a library yet.
            unsafe {
                std::env::set_var("HANDOFF_CUDART_PATH", &cudart);
                std::env::set_var("HANDOFF_NCCL_PATH", &nccl);
            }
            // SAFETY: the stubs just built: plain C with no initialisers.
            Some(unsafe {
                Stubs {
                    cudart: libloading::Library::new(&cudart).expect("stub runtime"),
                    nccl: libloading::Library::new(&nccl).expect("stub NCCL"),
                }
            })
        })
        .as_ref()?;
    stubs.pending(false);
    stubs.async_error(0);
    Some((turn, stubs))
}

/// A waker that counts its wakes and unparks its thread.
struct Counter {
    wakes: AtomicUsize,
    thread: Thread,
}

impl Wake for Counter {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        self.thread.unpark();
    }
}

fn counter() -> Arc<Counter> {
    Arc::new(Counter {
        wakes: AtomicUsize::new(0),
        thread: std::thread::current(),
    })
}

/// Runs `f` to completion on this thread, parking between polls; `None` if it is not done
/// within `limit` (a test failure rather than a hang). Returns the output and the polls made.
fn block_on<F: Future>(f: F, limit: Duration) -> (Option<F::Output>, usize) {
    let count = counter();
    let waker = Waker::from(count.clone());
    let mut cx = Context::from_waker(&waker);
    let mut f = pin!(f);
    let end = Instant::now() + limit;
    let mut polls = 0;
    loop {
        polls += 1;
        if let Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return (Some(out), polls);
        }
        let now = Instant::now();
        if now >= end {
            return (None, polls);
        }
        std::thread::park_timeout(end - now);
    }
}

/// Waits until `cond`, for up to two seconds.
fn eventually(cond: impl Fn() -> bool) -> bool {
    let end = Instant::now() + Duration::from_secs(2);
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    cond()
}

/// Polls `f` once with `count`'s waker.
fn poll_once<F: Future + Unpin>(f: &mut F, count: &Arc<Counter>) -> Poll<F::Output> {
    let waker = Waker::from(count.clone());
    std::pin::Pin::new(f).poll(&mut Context::from_waker(&waker))
}

#[test]
fn an_event_future_is_pending_while_the_work_runs_and_woken_once_it_is_done() {
    let Some((_turn, stubs)) = serial() else {
        return;
    };
    let dev = Device::new(0).expect("device");
    let stream = Stream::new(&dev).expect("stream");
    let event = Event::new(&dev).expect("event");
    stream.record(&event).expect("record");
    stubs.pending(true);
    let count = counter();
    let mut f = event.completed();
    assert!(poll_once(&mut f, &count).is_pending());
    assert_eq!(registered(), 1);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        count.wakes.load(Ordering::SeqCst),
        0,
        "not woken while the work runs"
    );
    assert!(
        poll_once(&mut f, &count).is_pending(),
        "a spurious poll stays pending"
    );
    assert_eq!(registered(), 1, "polled again: registered once");
    // The Event itself may go first: the future holds its handle.
    drop(event);
    stubs.pending(false);
    assert!(
        eventually(|| count.wakes.load(Ordering::SeqCst) >= 1),
        "woken once done"
    );
    match poll_once(&mut f, &count) {
        Poll::Ready(Ok(())) => {}
        other => panic!("expected ready, got {other:?}"),
    }
    assert_eq!(registered(), 0);
    assert_eq!(count.wakes.load(Ordering::SeqCst), 1, "one wake");
    // Work already done: ready at the first poll, with nothing registered.
    let event = Event::new(&dev).expect("event");
    stream.record(&event).expect("record");
    let mut f = event.completed();
    assert!(matches!(poll_once(&mut f, &count), Poll::Ready(Ok(()))));
    assert_eq!(registered(), 0);
}

#[test]
fn a_stream_future_and_a_host_read_resolve_once_the_copies_are_done() {
    let Some((_turn, stubs)) = serial() else {
        return;
    };
    let dev = Device::new(0).expect("device");
    let stream = Stream::new(&dev).expect("stream");
    let x = DeviceBuffer::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &stream).expect("buffer");
    let mut host = HostBuffer::<f32>::zeros(4, &dev).expect("host buffer");
    host.copy_from_device(&x, &stream).expect("copy");
    stubs.pending(true);
    let done = std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let (stream_done, _) = block_on(stream.completion(), Duration::from_secs(5));
            let (read, polls) = block_on(host.read_async(), Duration::from_secs(5));
            let read = read.expect("read in time").expect("read");
            (stream_done, read.to_vec(), polls)
        });
        std::thread::sleep(Duration::from_millis(30));
        assert!(!waiter.is_finished(), "pending while the copy runs");
        stubs.pending(false);
        waiter.join().expect("waiter")
    });
    assert!(matches!(done.0, Some(Ok(()))), "{:?}", done.0);
    assert_eq!(done.1, [1.0, 2.0, 3.0, 4.0]);
    assert_eq!(registered(), 0);
    // With a timeout that passes: Error::Timeout, and nothing left registered.
    host.copy_from_device(&x, &stream).expect("copy");
    stubs.pending(true);
    let started = Instant::now();
    let (out, _) = block_on(
        host.read_async().with_timeout(Duration::from_millis(50)),
        Duration::from_secs(5),
    );
    let err = out.expect("ended in time").expect_err("timed out");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(started.elapsed() >= Duration::from_millis(50));
    let (out, _) = block_on(
        stream.completion().with_timeout(Duration::from_millis(20)),
        Duration::from_secs(5),
    );
    assert!(matches!(out, Some(Err(Error::Timeout { .. }))), "{out:?}");
    assert_eq!(registered(), 0);
    stubs.pending(false);
}

#[test]
fn a_communicators_wait_times_out_as_the_blocking_one_and_aborts_it() {
    let Some((_turn, stubs)) = serial() else {
        return;
    };
    let dev = Device::new(0).expect("device");
    let timeout = Duration::from_millis(150);
    let options = CommOptions::default().with_timeout(timeout);
    let comm = Communicator::init_all_with(options, std::slice::from_ref(&dev))
        .expect("communicator")
        .pop()
        .expect("one");
    let stream = Stream::new(&dev).expect("stream");
    stubs.pending(true);
    let started = Instant::now();
    let (out, polls) = block_on(comm.wait_stream_async(&stream), Duration::from_secs(10));
    let waited = started.elapsed();
    let err = out.expect("ended by its deadline").expect_err("timed out");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(
        waited >= timeout && waited < timeout + Duration::from_secs(2),
        "{waited:?}"
    );
    assert!(polls >= 2, "rechecked while pending ({polls} polls)");
    let reason = comm.broken_reason().expect("aborted, as by the blocking form");
    assert!(reason.contains("did not complete"), "{reason}");
    assert_eq!(registered(), 0);
    // An unusable communicator: refused at the first poll.
    let (out, _) = block_on(comm.wait_stream_async(&stream), Duration::from_secs(1));
    assert!(
        matches!(out, Some(Err(Error::CommunicatorUnusable { .. }))),
        "{out:?}"
    );
    stubs.pending(false);
    drop(comm);
    // The blocking form, for comparison: the same bound.
    let comm = Communicator::init_all_with(options, std::slice::from_ref(&dev))
        .expect("communicator")
        .pop()
        .expect("one");
    stubs.pending(true);
    let started = Instant::now();
    let blocking = comm.wait_stream(&stream);
    assert!(matches!(blocking, Err(Error::Timeout { .. })), "{blocking:?}");
    assert!(started.elapsed() >= timeout);
    stubs.pending(false);
}

#[test]
fn a_communicators_async_error_ends_the_wait_and_aborts_it() {
    let Some((_turn, stubs)) = serial() else {
        return;
    };
    let dev = Device::new(0).expect("device");
    let options = CommOptions::default().with_timeout(Duration::from_secs(30));
    let comm = Communicator::init_all_with(options, std::slice::from_ref(&dev))
        .expect("communicator")
        .pop()
        .expect("one");
    let stream = Stream::new(&dev).expect("stream");
    stubs.pending(true);
    // Made here (a communicator is not `Sync`), awaited on another thread: the future is
    // `Send`.
    let fut = comm.wait_stream_async(&stream);
    std::thread::scope(|s| {
        let waiter = s.spawn(move || block_on(fut, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        assert!(!waiter.is_finished());
        // ncclSystemError, reported by ncclCommGetAsyncError.
        stubs.async_error(2);
        let (out, _) = waiter.join().expect("waiter");
        let err = out.expect("ended by the error").expect_err("an error");
        assert!(!matches!(err, Error::Timeout { .. }), "{err}");
    });
    assert!(comm.broken_reason().is_some(), "aborted");
    stubs.async_error(0);
    stubs.pending(false);
}

#[test]
fn dropping_pending_futures_leaves_nothing_registered() {
    let Some((_turn, stubs)) = serial() else {
        return;
    };
    let dev = Device::new(0).expect("device");
    let stream = Stream::new(&dev).expect("stream");
    let mut x = DeviceBuffer::<f32>::zeros(16, &stream).expect("buffer");
    let mut host = HostBuffer::<f32>::zeros(16, &dev).expect("host buffer");
    host.copy_from_device(&x, &stream).expect("copy");
    stubs.pending(true);
    let count = counter();
    let event = Event::new(&dev).expect("event");
    stream.record(&event).expect("record");
    let mut events: Vec<_> = (0..100).map(|_| event.completed()).collect();
    let mut streams: Vec<_> = (0..100).map(|_| stream.completion()).collect();
    for f in &mut events {
        assert!(poll_once(f, &count).is_pending());
    }
    for f in &mut streams {
        assert!(poll_once(f, &count).is_pending());
    }
    {
        let mut read = Box::pin(host.read_async());
        let waker = Waker::from(count.clone());
        assert!(read.as_mut().poll(&mut Context::from_waker(&waker)).is_pending());
        assert_eq!(registered(), 201);
        // Dropped while pending: the buffer is still tracked, and can be written only after
        // its copy (here the write waits for it: done below, on another thread).
    }
    drop(events);
    drop(event);
    streams.truncate(50);
    assert_eq!(registered(), 50);
    drop(streams);
    assert_eq!(registered(), 0, "every drop removed its registration");
    // The copy is still tracked by the buffer (a future held none of it): the host read
    // still waits for its event.
    assert!(host.read_async().with_timeout(Duration::ZERO).poll_ready_err());
    stubs.pending(false);
    host.write().expect("write")[0] = 9.0;
    // Nothing was woken after its future went.
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(count.wakes.load(Ordering::SeqCst), 0);
    host.copy_from_device(&x, &stream).expect("copy");
    x.copy_from_host(&host, &stream).expect("copy back");
    assert_eq!(registered(), 0);
}

#[test]
fn many_futures_on_several_threads_are_all_woken() {
    let Some((_turn, stubs)) = serial() else {
        return;
    };
    let dev = Device::new(0).expect("device");
    let stream = Stream::new(&dev).expect("stream");
    let event = Event::without_timing(&dev).expect("event");
    stream.record(&event).expect("record");
    stubs.pending(true);
    const THREADS: usize = 8;
    const EACH: usize = 250;
    let all_polls = std::thread::scope(|s| {
        let waiters: Vec<_> = (0..THREADS)
            .map(|t| {
                let (stream, event) = (&stream, &event);
                s.spawn(move || {
                    // Each thread drives EACH futures at once, as one executor task would
                    // join them.
                    let futures: Vec<_> = (0..EACH)
                        .map(|i| {
                            if (t + i) % 2 == 0 {
                                Box::pin(event.completed())
                                    as std::pin::Pin<Box<dyn Future<Output = _> + Send>>
                            } else {
                                Box::pin(stream.completion())
                            }
                        })
                        .collect();
                    let (out, polls) = block_on(
                        JoinAll(futures.into_iter().map(Some).collect()),
                        Duration::from_secs(10),
                    );
                    (out.is_some(), polls)
                })
            })
            .collect();
        assert!(
            eventually(|| registered() == THREADS * EACH),
            "{} registered",
            registered()
        );
        stubs.pending(false);
        waiters
            .into_iter()
            .map(|w| w.join().expect("waiter"))
            .collect::<Vec<_>>()
    });
    for (done, polls) in &all_polls {
        assert!(done, "every future resolved");
        // One poll pending, then a few after wakes (each wake may find only some done).
        assert!(*polls < 50, "{polls} polls");
    }
    assert_eq!(registered(), 0);
}

/// The four kinds of future, 64 of each, spawned as tasks on a tokio runtime of two worker
/// threads while the work "runs" (300 ms): none resolves before it is done, all do after it
/// with the data, and a timer task ticking every millisecond meanwhile keeps its cadence, so no
/// future held a worker thread.
#[test]
fn on_tokio_two_workers_many_futures_resolve_and_a_timer_keeps_its_cadence() {
    let Some((_turn, stubs)) = serial() else {
        return;
    };
    let dev = Device::new(0).expect("device");
    let stream = Stream::new(&dev).expect("stream");
    let x = DeviceBuffer::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &stream).expect("buffer");
    let mut host = HostBuffer::<f32>::zeros(4, &dev).expect("host buffer");
    host.copy_from_device(&x, &stream).expect("copy");
    let host = Arc::new(host);
    let options = CommOptions::default().with_timeout(Duration::from_secs(30));
    let comm = Communicator::init_all_with(options, std::slice::from_ref(&dev))
        .expect("communicator")
        .pop()
        .expect("one");
    let event = Event::without_timing(&dev).expect("event");
    stream.record(&event).expect("record");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .expect("runtime");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = stop.clone();
    // Its ticks, and the longest time between two.
    let timer = rt.spawn(async move {
        let (mut ticks, mut worst, mut last) = (0, Duration::ZERO, Instant::now());
        while !stopped.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(1)).await;
            let now = Instant::now();
            worst = worst.max(now - last);
            (last, ticks) = (now, ticks + 1);
        }
        (ticks, worst)
    });
    /// Ends the work however the test ends, before the runtime drops: a runtime waits for its
    /// workers, and a worker a future held would otherwise never return.
    struct Done<'s>(&'s Stubs);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.pending(false);
        }
    }
    stubs.pending(true);
    let done = Done(stubs);
    let mut tasks = Vec::new();
    for i in 0..256 {
        tasks.push(match i % 4 {
            0 => {
                let f = event.completed();
                rt.spawn(async move { f.await.map(|()| Vec::new()) })
            }
            1 => {
                let f = stream.completion();
                rt.spawn(async move { f.await.map(|()| Vec::new()) })
            }
            2 => {
                // Made here (a communicator is not `Sync`), awaited in the task.
                let f = comm.wait_stream_async(&stream);
                rt.spawn(async move { f.await.map(|()| Vec::new()) })
            }
            _ => {
                let host = host.clone();
                rt.spawn(async move { Ok(host.read_async().await?.to_vec()) })
            }
        });
    }
    let all_registered = eventually(|| registered() == 256);
    std::thread::sleep(Duration::from_millis(300));
    let none_finished = tasks.iter().all(|t| !t.is_finished());
    drop(done);
    let outs = rt.block_on(async {
        let mut outs = Vec::new();
        for t in tasks {
            outs.push(t.await.expect("task"));
        }
        outs
    });
    stop.store(true, Ordering::Relaxed);
    let (ticks, worst) = rt.block_on(timer).expect("timer");
    for (i, o) in outs.into_iter().enumerate() {
        let data = o.expect("resolved Ok");
        if i % 4 == 3 {
            assert_eq!(data, [1.0, 2.0, 3.0, 4.0]);
        }
    }
    // A worker held by a future for the 300 ms would show as a gap of 300 ms.
    assert!(
        worst < Duration::from_millis(100),
        "the timer's longest gap was {worst:?} ({ticks} ticks): a future blocked a worker"
    );
    assert!(all_registered, "not every future was polled and registered");
    assert!(none_finished, "a future resolved while the work ran");
    assert_eq!(registered(), 0);
}

trait ReadyErr {
    /// Polled once: ready with an error (its timeout, passed).
    fn poll_ready_err(self) -> bool;
}

impl<F: Future<Output = handoff::Result<R>>, R> ReadyErr for F {
    fn poll_ready_err(self) -> bool {
        let f = pin!(self);
        let waker = Waker::from(counter());
        matches!(
            f.poll(&mut Context::from_waker(&waker)),
            Poll::Ready(Err(Error::Timeout { .. }))
        )
    }
}

/// Polls every future until all are ready; each output must be `Ok`.
struct JoinAll<F>(Vec<Option<std::pin::Pin<Box<F>>>>)
where
    F: Future<Output = handoff::Result<()>> + ?Sized;

impl<F> Future for JoinAll<F>
where
    F: Future<Output = handoff::Result<()>> + ?Sized,
{
    type Output = ();
    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let mut pending = false;
        for slot in &mut this.0 {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    Poll::Ready(r) => {
                        r.expect("resolved Ok");
                        *slot = None;
                    }
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending { Poll::Pending } else { Poll::Ready(()) }
    }
}

/// The host cost of one future on the stubs: made, polled pending (registered), woken by the
/// thread, polled ready. Printed, not asserted (timing); allocations are asserted.
#[test]
fn cost_per_future() {
    let Some((_turn, stubs)) = serial() else {
        return;
    };
    let dev = Device::new(0).expect("device");
    let stream = Stream::new(&dev).expect("stream");
    let event = Event::without_timing(&dev).expect("event");
    stream.record(&event).expect("record");
    let count = counter();
    const N: usize = 10_000;
    // Ready at the first poll: no registration.
    let measure_ready = |f: &dyn Fn() -> handoff::Result<()>| {
        let t = Instant::now();
        for _ in 0..N {
            f().expect("ready");
        }
        t.elapsed() / N as u32
    };
    let ready_event = measure_ready(&|| match poll_once(&mut event.completed(), &count) {
        Poll::Ready(r) => r,
        Poll::Pending => panic!("pending"),
    });
    let ready_stream = measure_ready(&|| match poll_once(&mut stream.completion(), &count) {
        Poll::Ready(r) => r,
        Poll::Pending => panic!("pending"),
    });
    // Pending, registered, woken, ready: N futures at once, of events and of streams.
    let mut lines = Vec::new();
    for stream_futures in [false, true] {
        stubs.pending(true);
        let queries_before = stubs.count("cudaEventQuery");
        let wakes_before = count.wakes.load(Ordering::SeqCst);
        let allocs_before = ALLOCS.with(Cell::get);
        let t = Instant::now();
        let mut futures: Vec<std::pin::Pin<Box<dyn Future<Output = handoff::Result<()>>>>> =
            Vec::with_capacity(N);
        for _ in 0..N {
            futures.push(if stream_futures {
                Box::pin(stream.completion())
            } else {
                Box::pin(event.completed())
            });
        }
        let made = t.elapsed() / N as u32;
        let t = Instant::now();
        let waker = Waker::from(count.clone());
        for f in &mut futures {
            assert!(f.as_mut().poll(&mut Context::from_waker(&waker)).is_pending());
        }
        let register = t.elapsed() / N as u32;
        // Less the boxes of this test and the list of them.
        let allocs = ALLOCS.with(Cell::get) - allocs_before - N as u64 - 1;
        stubs.pending(false);
        let t = Instant::now();
        assert!(
            eventually(|| count.wakes.load(Ordering::SeqCst) - wakes_before >= N),
            "all woken"
        );
        let wake = t.elapsed() / N as u32;
        let t = Instant::now();
        for f in &mut futures {
            assert!(matches!(
                f.as_mut().poll(&mut Context::from_waker(&waker)),
                Poll::Ready(Ok(()))
            ));
        }
        let finish = t.elapsed() / N as u32;
        drop(futures);
        let queries = stubs.count("cudaEventQuery") - queries_before;
        lines.push(format!(
            "{} futures, {N} at once: made {made:?}, first poll (pending: query, registration) \
             {register:?}, {:.2} allocations each; all woken in {wake:?} per future after the \
             work is done; last poll {finish:?}; {:.2} cudaEventQuery calls per future in all",
            if stream_futures { "stream" } else { "event" },
            allocs as f64 / N as f64,
            queries as f64 / N as f64
        ));
        if !stream_futures {
            assert!(
                allocs as usize <= N / 5,
                "an event future's registration allocates only as the map grows: {allocs} for {N}"
            );
        }
    }
    println!(
        "per future on the stubs: ready at the first poll {ready_event:?} (event) / \
         {ready_stream:?} (stream, with its record)"
    );
    for l in lines {
        println!("{l}");
    }
    assert_eq!(registered(), 0);
}
