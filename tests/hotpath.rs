//! The hot path's cost in counts, on a CPU: CUDA and NCCL calls by name and heap allocations per
//! tracked operation, in steady state, against stub libraries (tests/stubs/*.c, built here with
//! the system's C compiler) that return success at once and count their calls per thread. The
//! counts are exact and asserted, so a change that adds a runtime call or an allocation to the
//! path fails CI; timing stays in the benchmarks.
//!
//! The stubs are chosen with `HANDOFF_CUDART_PATH` / `HANDOFF_NCCL_PATH`, set at the start of
//! this binary's `main`, before anything opens a library (the crate opens them once per
//! process). Run with `--nocapture` to see the counts.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use handoff::{CommOptions, Communicator, Device, DeviceBuffer, Graph, ReduceOp, Stream, group, kernels};
use libtest_mimic::{Arguments, Failed, Trial};

mod stubs;
use stubs::NoStubs;

/// Counts the calling thread's heap allocations (allocations and reallocations).
struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn note_alloc() {
    let _ = ALLOCS.try_with(|a| a.set(a.get() + 1));
}

// SAFETY: forwards every call to the system allocator unchanged; counting touches only a
// const-initialised thread-local without a destructor, which allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_alloc();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_alloc();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_alloc();
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

/// The stub libraries, built once into a folder of their own.
struct Stubs {
    cudart: libloading::Library,
    nccl: libloading::Library,
}

/// cudaErrorNotReady: what the stub's cudaEventQuery returns while work "runs".
const NOT_READY: i32 = 600;

fn build_stubs() -> Result<(PathBuf, PathBuf), NoStubs> {
    let out = std::env::temp_dir().join(format!("handoff-hotpath-stubs-{}", std::process::id()));
    Ok((
        stubs::build(&out, "cudart.c", "libcudart.so.13")?,
        stubs::build(&out, "nccl.c", "libnccl.so.2")?,
    ))
}

impl Stubs {
    fn open(cudart: &Path, nccl: &Path) -> Stubs {
        // SAFETY: the stubs just built: plain C with no initialisers.
        unsafe {
            Stubs {
                cudart: libloading::Library::new(cudart).expect("stub runtime"),
                nccl: libloading::Library::new(nccl).expect("stub NCCL"),
            }
        }
    }

    /// The calling thread's calls so far, by name.
    fn mine(lib: &libloading::Library, prefix: &str) -> BTreeMap<String, u64> {
        let name = format!("{prefix}_stub_dump\0");
        let mut buf = vec![0u8; 8192];
        // SAFETY: `void dump(char *buf, unsigned long len)`, writing at most `len` bytes.
        unsafe {
            let dump: libloading::Symbol<unsafe extern "C" fn(*mut u8, usize)> =
                lib.get(name.as_bytes()).expect("dump");
            dump(buf.as_mut_ptr(), buf.len());
        }
        let text = std::ffi::CStr::from_bytes_until_nul(&buf).expect("NUL");
        text.to_str()
            .expect("ASCII")
            .split_whitespace()
            .map(|kv| {
                let (k, v) = kv.split_once('=').expect("name=count");
                (k.to_string(), v.parse().expect("count"))
            })
            .collect()
    }

    /// Every thread's calls of `name` so far.
    fn all(&self, name: &str) -> u64 {
        let (lib, prefix) = if name.starts_with("nccl") {
            (&self.nccl, "nccl")
        } else {
            (&self.cudart, "cudart")
        };
        let sym = format!("{prefix}_stub_count\0");
        let name = std::ffi::CString::new(name).expect("name");
        // SAFETY: `long count(const char *name, int all)`.
        unsafe {
            let count: libloading::Symbol<unsafe extern "C" fn(*const std::ffi::c_char, i32) -> i64> =
                lib.get(sym.as_bytes()).expect("count");
            count(name.as_ptr(), 1) as u64
        }
    }

    fn set_event_query(&self, rc: i32) {
        // SAFETY: `void set(int)`.
        unsafe {
            let set: libloading::Symbol<unsafe extern "C" fn(i32)> =
                self.cudart.get(b"cudart_stub_set_event_query\0").expect("setter");
            set(rc);
        }
    }

    fn set_async_error(&self, rc: i32) {
        // SAFETY: `void set(int)`.
        unsafe {
            let set: libloading::Symbol<unsafe extern "C" fn(i32)> =
                self.nccl.get(b"nccl_stub_set_async_error\0").expect("setter");
            set(rc);
        }
    }

    fn call(&self, name: &str, arg: i32) {
        let sym = format!("{name}\0");
        // SAFETY: the stub's setters are `void set(int)`.
        unsafe {
            let set: libloading::Symbol<unsafe extern "C" fn(i32)> =
                self.cudart.get(sym.as_bytes()).expect("setter");
            set(arg);
        }
    }

    fn set_devices(&self, n: i32) {
        // SAFETY: `void set(int)`.
        unsafe {
            let set: libloading::Symbol<unsafe extern "C" fn(i32)> =
                self.cudart.get(b"cudart_stub_set_devices\0").expect("setter");
            set(n);
        }
    }

    fn snapshot(&self) -> Snapshot {
        let mut calls = Self::mine(&self.cudart, "cudart");
        calls.extend(Self::mine(&self.nccl, "nccl"));
        Snapshot {
            calls,
            allocs: ALLOCS.with(Cell::get),
        }
    }
}

/// The calling thread's counts at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Snapshot {
    calls: BTreeMap<String, u64>,
    allocs: u64,
}

impl Snapshot {
    fn since(&self, before: &Snapshot) -> Snapshot {
        let calls = self
            .calls
            .iter()
            .map(|(k, v)| (k.clone(), v - before.calls.get(k).copied().unwrap_or(0)))
            .filter(|(_, v)| *v > 0)
            .collect();
        Snapshot {
            calls,
            allocs: self.allocs - before.allocs,
        }
    }
}

/// Operations per measurement: a multiple of the graph's in-flight bound (8), so that a check
/// made once per so many launches counts whole.
const OPS: u64 = 64;

/// The watchdog's period is 20 ms: this covers a few of its looks.
const SETTLE: Duration = Duration::from_millis(100);

/// What the watchdog has to do with a measured operation.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Watched {
    /// Nothing: no communicator.
    No,
    /// Its communicator's queue: the warm-up waits for the watchdog to empty it.
    Yes,
    /// As `Yes`, and the warm-up runs while the stub's events report not complete, so that
    /// the watchdog keeps every operation queued, and the queue and the event pool reach the
    /// size the measured run needs (steady state, whatever the watchdog's timing); so does the
    /// measured run, after the warm-up's queue has been emptied, so that what the enqueueing
    /// thread's trim finds (and asks) does not depend on when the watchdog last looked.
    WhileRunning,
}

/// Runs `op` OPS times, after a warm-up of twice as many, and returns the calling thread's
/// counts for the measured ones.
fn measure(stubs: &Stubs, watched: Watched, mut op: impl FnMut(u32) -> handoff::Result<()>) -> Snapshot {
    if watched == Watched::WhileRunning {
        stubs.set_event_query(NOT_READY);
    }
    for i in 0..2 * OPS as u32 {
        op(i).expect("warm-up");
    }
    let others =
        || stubs.all("cudaEventQuery") - stubs.snapshot().calls.get("cudaEventQuery").copied().unwrap_or(0);
    // Counted after the switch, so that a look counted after it saw every event complete.
    stubs.set_event_query(0);
    let looked = others();
    if watched != Watched::No {
        // A look of the watchdog's since every event completed has emptied the queue (and
        // handed the events back to the pool); then one look more, to be sure it was applied.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while others() == looked && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    std::thread::sleep(SETTLE);
    if watched == Watched::WhileRunning {
        stubs.set_event_query(NOT_READY);
    }
    let before = stubs.snapshot();
    let allocs = ALLOCS.with(Cell::get);
    for i in 0..OPS as u32 {
        op(i).expect("measured operation");
    }
    // Before the snapshot, which allocates.
    let allocs = ALLOCS.with(Cell::get) - allocs;
    let after = stubs.snapshot();
    stubs.set_event_query(0);
    Snapshot {
        allocs,
        ..after.since(&before)
    }
}

/// What [`OPS`] operations cost, in calls by name and in heap allocations (totals, so that a
/// cost paid once per so many operations, or a buffer that grows now and then, counts exactly).
struct Expected {
    calls: &'static [(&'static str, u64)],
    allocs: u64,
}

fn check(what: &str, got: &Snapshot, want: &Expected) -> Result<(), Failed> {
    let per_op: Vec<String> = got
        .calls
        .iter()
        .map(|(k, v)| format!("{k} {}", *v as f64 / OPS as f64))
        .collect();
    println!(
        "{what}: per operation: {} heap allocations; calls: {}",
        got.allocs as f64 / OPS as f64,
        per_op.join(", ")
    );
    let want_calls: BTreeMap<String, u64> = want.calls.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    if got.calls != want_calls || got.allocs != want.allocs {
        return Err(format!(
            "{what}: over {OPS} operations, expected calls {want_calls:?} and {} allocations, got \
             {:?} and {}",
            want.allocs, got.calls, got.allocs
        )
        .into());
    }
    Ok(())
}

fn device() -> Device {
    Device::new(0).expect("the stub's device 0")
}

fn self_group(stubs: &Stubs, options: CommOptions, what: &str, want: &Expected) -> Result<(), Failed> {
    let dev = device();
    let comm = &Communicator::init_all_with(options, std::slice::from_ref(&dev))?[0];
    let s = Stream::new(&dev)?;
    let x = DeviceBuffer::from_slice(&[1.0f32], &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(1, &s)?;
    let got = measure(stubs, Watched::WhileRunning, |_| {
        group(|g| {
            g.send(comm, &x, 0, &s)?;
            g.recv(comm, &mut y, 0, &s)
        })
    });
    check(what, &got, want)
}

/// A verified send+receive to oneself, on one stream.
fn verified_self_group(stubs: &Stubs) -> Result<(), Failed> {
    self_group(
        stubs,
        CommOptions::default(),
        "verified self send+receive group",
        &SELF_GROUP,
    )
}

/// The same, unverified.
fn unverified_self_group(stubs: &Stubs) -> Result<(), Failed> {
    // SAFETY: one rank, whose send and receive are in one group: they match.
    let options = unsafe { CommOptions::default().unverified() };
    self_group(
        stubs,
        options,
        "unverified self send+receive group",
        &UNVERIFIED_SELF_GROUP,
    )
}

/// Per group: the NCCL group itself (start, send, receive, end), and one tracking event
/// recorded after it. Nothing else: the stream is handoff's own, so no capture but handoff's
/// can be under way on it (its capture state is in the stream's lock); NCCL sets the device
/// itself, and waits and records take theirs from the stream.
/// Every [`TRIM`]th operation on a communicator, the enqueueing thread drops what has completed
/// from its queue (NCCL's error state asked, then the newest entry's event and, that one still
/// running here, the oldest's, also running, then NCCL's error state again before anything
/// would go: here nothing does), so that tracking events go back to the pool at once instead
/// of at the watchdog's next look.
/// No allocation: the tracking event is taken from the pool, `Arc` and all, once nothing holds
/// it (the queue has let go of it), and the engine's, the group's and verification's lists
/// are inline, the local checks compare without collecting, and the watchdog's note shares the
/// last operation's origin.
const SELF_GROUP: Expected = Expected {
    calls: &[
        ("cudaEventQuery", 2 * OPS / TRIM),
        ("cudaEventRecord", OPS),
        ("ncclCommGetAsyncError", 2 * OPS / TRIM),
        ("ncclGroupEnd", OPS),
        ("ncclGroupStart", OPS),
        ("ncclRecv", OPS),
        ("ncclSend", OPS),
    ],
    allocs: 0,
};

/// How often the enqueueing thread trims its communicator's queue (the watchdog's
/// `TRIM_EVERY`); [`OPS`] is a multiple of it.
const TRIM: u64 = 64;

/// As verified: verification allocates nothing of its own.
const UNVERIFIED_SELF_GROUP: Expected = Expected {
    calls: SELF_GROUP.calls,
    allocs: 0,
};

/// A verified all_reduce over one rank.
fn all_reduce(stubs: &Stubs) -> Result<(), Failed> {
    let dev = device();
    let comm = &Communicator::init_all(std::slice::from_ref(&dev))?[0];
    let s = Stream::new(&dev)?;
    let x = DeviceBuffer::from_slice(&[1.0f32], &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(1, &s)?;
    let got = measure(stubs, Watched::WhileRunning, |_| {
        comm.all_reduce(&x, &mut y, ReduceOp::Sum, &s)
    });
    check("verified all_reduce", &got, &ALL_REDUCE)
}

/// As a self group, with ncclAllReduce in place of the send and receive; no allocation.
const ALL_REDUCE: Expected = Expected {
    calls: &[
        ("cudaEventQuery", 2 * OPS / TRIM),
        ("cudaEventRecord", OPS),
        ("ncclAllReduce", OPS),
        ("ncclCommGetAsyncError", 2 * OPS / TRIM),
        ("ncclGroupEnd", OPS),
        ("ncclGroupStart", OPS),
    ],
    allocs: 0,
};

/// `kernels::produce`: one kernel writing one buffer.
fn produce(stubs: &Stubs) -> Result<(), Failed> {
    let dev = device();
    let s = Stream::new(&dev)?;
    let mut x = DeviceBuffer::<f32>::zeros(4, &s)?;
    let got = measure(stubs, Watched::No, |round| kernels::produce(&mut x, round, &s));
    check("kernels::produce", &got, &PRODUCE)
}

/// The launch and one tracking event after it; the current device, asked (a kernel runs on
/// it), and set only when it differs. No allocation: the tracking event is the pool's (the
/// previous launch's, let go of as this one's replaces it in the tracker, after a few more),
/// the builder's arguments and the engine's lists are inline.
const PRODUCE: Expected = Expected {
    calls: &[
        ("cudaEventRecord", OPS),
        ("cudaGetDevice", OPS),
        ("cudaLaunchKernel", OPS),
    ],
    allocs: 0,
};

/// A replay of a graph of one kernel.
fn kernel_graph(stubs: &Stubs) -> Result<(), Failed> {
    let dev = device();
    let s = Stream::new(&dev)?;
    let mut x = DeviceBuffer::<f32>::zeros(4, &s)?;
    let graph = Graph::capture(&s, |s| kernels::produce(&mut x, 1, s))?;
    let got = measure(stubs, Watched::No, |_| graph.launch(&s));
    check("graph launch (one kernel)", &got, &KERNEL_GRAPH)
}

/// The launch alone, and the current device, asked: the replay records the graph's own
/// tracking event itself (an event record node), which the launch stores (an `Arc` clone):
/// no event record, no allocation.
const KERNEL_GRAPH: Expected = Expected {
    calls: &[("cudaGetDevice", OPS), ("cudaGraphLaunch", OPS)],
    allocs: 0,
};

/// A replay of a graph of one self send+receive group on the graph's own communicator.
fn nccl_graph(stubs: &Stubs) -> Result<(), Failed> {
    let dev = device();
    let comm = Communicator::init_all(std::slice::from_ref(&dev))?
        .pop()
        .expect("one rank");
    let s = Stream::new(&dev)?;
    let x = DeviceBuffer::from_slice(&[1.0f32], &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(1, &s)?;
    let graph = Graph::capture_with(comm, &s, |s, c| {
        group(|g| {
            g.send(c, &x, 0, s)?;
            g.recv(c, &mut y, 0, s)
        })
    })?;
    let got = measure(stubs, Watched::Yes, |_| graph.launch(&s));
    check("graph launch (self send+receive)", &got, &NCCL_GRAPH)
}

/// The launch, and the current device, asked; the graph's own event, recorded by the replay,
/// stored with no call; a host event (a fixed point for the watchdog and the in-flight bound)
/// after every 4th replay, from the pool (no allocation); the in-flight bound, which asks
/// the graph's event (the latest replay) only once 8 replays are not known complete (every 8th
/// launch here, where each is seen complete), and the queue's trim (see [`SELF_GROUP`]: here
/// its newest entry is complete, one query). The replay's origin is the graph's, made at
/// capture.
const NCCL_GRAPH: Expected = Expected {
    calls: &[
        ("cudaEventQuery", OPS / 8 + OPS / TRIM),
        ("cudaEventRecord", OPS / 4),
        ("cudaGetDevice", OPS),
        ("cudaGraphLaunch", OPS),
        ("ncclCommGetAsyncError", 2 * OPS / TRIM),
    ],
    allocs: 0,
};

/// An all_reduce on a stream whose previous work is a kernel graph's replay (the graph's event,
/// the latest replay, is the stream's last work).
fn all_reduce_after_a_replay(stubs: &Stubs) -> Result<(), Failed> {
    let dev = device();
    let comm = &Communicator::init_all(std::slice::from_ref(&dev))?[0];
    let s = Stream::new(&dev)?;
    let x = DeviceBuffer::from_slice(&[1.0f32], &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(1, &s)?;
    let mut z = DeviceBuffer::<f32>::zeros(4, &s)?;
    let graph = Graph::capture(&s, |s| kernels::produce(&mut z, 1, s))?;
    let got = measure(stubs, Watched::WhileRunning, |_| {
        graph.launch(&s)?;
        comm.all_reduce(&x, &mut y, ReduceOp::Sum, &s)
    });
    check("graph launch then all_reduce", &got, &REPLAY_THEN_ALL_REDUCE)
}

/// The replay as [`KERNEL_GRAPH`] and the all_reduce as [`ALL_REDUCE`], and one event more
/// (the pool's), recorded before the all_reduce: the watchdog's deadline for the all_reduce
/// counts from that fixed point, never from the graph's event, which a later replay (perhaps
/// waiting behind the all_reduce) would record again.
const REPLAY_THEN_ALL_REDUCE: Expected = Expected {
    calls: &[
        ("cudaEventQuery", 2 * OPS / TRIM),
        ("cudaEventRecord", 2 * OPS),
        ("cudaGetDevice", OPS),
        ("cudaGraphLaunch", OPS),
        ("ncclAllReduce", OPS),
        ("ncclCommGetAsyncError", 2 * OPS / TRIM),
        ("ncclGroupEnd", OPS),
        ("ncclGroupStart", OPS),
    ],
    allocs: 0,
};

/// The article's Figure 3 round captured across two streams: A on the captured stream `p`, a
/// fork (an event recorded there, waited for by `c`), the send and receive on `c`, C and then
/// B (which reads what was received) on `p`; replayed. Inside the capture handoff orders the
/// capture's conflicting uses across its streams through events recorded into it: the counts
/// of the capture thread's `cudaStreamWaitEvent` say which waits (graph edges) it made. And
/// what stays refused.
fn capture_across_streams(stubs: &Stubs) -> Result<(), Failed> {
    let dev = device();
    let comm = Communicator::init_all(std::slice::from_ref(&dev))?
        .pop()
        .expect("one rank");
    let (p, c, q) = (Stream::new(&dev)?, Stream::new(&dev)?, Stream::new(&dev)?);
    let mut a = DeviceBuffer::<f32>::zeros(4, &p)?;
    let mut x = DeviceBuffer::<f32>::zeros(4, &c)?;
    let mut y = DeviceBuffer::<f32>::zeros(4, &p)?;
    let outside = handoff::Event::without_timing(&dev)?;
    q.record(&outside)?;
    let fork = handoff::Event::without_timing(&dev)?;
    let waits = || {
        stubs
            .snapshot()
            .calls
            .get("cudaStreamWaitEvent")
            .copied()
            .unwrap_or(0)
    };
    let mut inside = Vec::new();
    let mut dropped_handle = None;
    let mut reused = false;
    let w0 = waits();
    let graph = Graph::capture_with(comm, &p, |p, comm| {
        kernels::produce(&mut a, 1, p)?;
        p.record(&fork)?;
        // Inside the capture, no wait for what is outside it.
        inside.push(("a wait for an event recorded outside", p.wait(&outside).err()));
        c.wait(&fork)?;
        // Joined: another thread's work there is refused, and so is its joining.
        std::thread::scope(|t| {
            let other = t
                .spawn(|| kernels::produce(&mut x, 9, &c).err())
                .join()
                .expect("thread");
            inside.push(("another thread's work on a joined stream", other));
            let join = t.spawn(|| q.wait(&fork).err()).join().expect("thread");
            inside.push(("another thread joining", join));
        });
        // A joined stream dropped inside the capture: its handle is not handed out again
        // before the capture ends (CUDA captures it until then).
        let t = Stream::new(p.device())?;
        t.wait(&fork)?;
        dropped_handle = Some(t.as_raw() as usize);
        drop(t);
        let u = Stream::new(p.device())?;
        reused = Some(u.as_raw() as usize) == dropped_handle;
        group(|g| {
            g.send(comm, &a, 0, &c)?;
            g.recv(comm, &mut x, 0, &c)
        })?;
        kernels::busy(Duration::ZERO, p)?;
        kernels::twice(&x, &mut y, p)
    })?;
    let captured_waits = waits() - w0;
    if reused {
        return Err("a dropped joined stream's handle was handed out during the capture".into());
    }
    // Parked once the capture has ended.
    if Some(Stream::new(&dev)?.as_raw() as usize) != dropped_handle {
        return Err("a dropped joined stream's handle must be parked once the capture ends".into());
    }
    for (what, refused) in inside {
        match refused {
            Some(handoff::Error::Capture { .. }) => {}
            other => {
                return Err(format!("{what}: must be refused with Error::Capture, got {other:?}").into());
            }
        }
    }
    // The forks (c, and the dropped one) and the edges: c's send waits for A (a's write on p),
    // B for the receive (x's write on c), and both forks are joined back into p at the end.
    println!("capture across streams: {captured_waits} waits inside the capture");
    if captured_waits != 6 {
        return Err(format!(
            "expected 6 waits inside the capture (2 forks, A before the send, the receive before \
             B, 2 joins), got {captured_waits}"
        )
        .into());
    }
    for _ in 0..3 {
        graph.launch(&p)?;
    }
    // After the capture: c runs eagerly again, and the fork event must be recorded anew.
    kernels::produce(&mut x, 2, &c)?;
    match q.wait(&fork) {
        Err(handoff::Error::Capture { detail }) if detail.contains("has ended") => {}
        other => return Err(format!("a wait for an event of an ended capture: {other:?}").into()),
    }
    // An operation spanning the capture's stream and one outside it.
    let comm2 = Communicator::init_all(std::slice::from_ref(&dev))?
        .pop()
        .expect("one rank");
    let spanning = Graph::capture_with(comm2, &p, |p, comm| {
        group(|g| {
            g.send(comm, &a, 0, p)?;
            g.recv(comm, &mut x, 0, &c)
        })
    });
    match spanning {
        Err(handoff::Error::Capture { .. }) => Ok(()),
        other => Err(format!("a group spanning a captured stream and another: {other:?}").into()),
    }
}

/// Pinned host buffers of a small size class, 16 alive at once: one `cudaMallocHost` (a slab
/// of the class), the other 15 cut from it.
fn pinned_slabs(stubs: &Stubs) -> Result<(), Failed> {
    let dev = device();
    let before = stubs.snapshot();
    let live: Vec<_> = (0..16)
        .map(|_| handoff::HostBuffer::<f32>::zeros(200, &dev))
        .collect::<handoff::Result<_>>()?;
    let calls = stubs.snapshot().since(&before);
    let mallocs = calls.calls.get("cudaMallocHost").copied().unwrap_or(0);
    println!("16 pinned buffers of 800 bytes: {mallocs} cudaMallocHost");
    drop(live);
    if mallocs != 1 {
        return Err(
            format!("16 small pinned buffers made {mallocs} cudaMallocHost calls, expected 1").into(),
        );
    }
    Ok(())
}

/// On two (stub) devices: a kernel launch makes its device current when another is (and asks
/// only, when it is already); an NCCL operation leaves the current device alone; a graph that
/// captured a peer copy (its source on the other device) replays, on a stream of its own device
/// only.
fn two_devices(stubs: &Stubs) -> Result<(), Failed> {
    stubs.set_devices(2);
    let (d0, d1) = (Device::new(0)?, Device::new(1)?);
    let (s0, s1) = (Stream::new(&d0)?, Stream::new(&d1)?);
    let mut x = DeviceBuffer::<f32>::zeros(4, &s0)?;
    let run = |label: &str, f: &mut dyn FnMut() -> handoff::Result<()>| -> Result<Snapshot, Failed> {
        let before = stubs.snapshot();
        f().map_err(|e| format!("{label}: {e}"))?;
        Ok(stubs.snapshot().since(&before))
    };
    let calls = |s: &Snapshot, name: &str| s.calls.get(name).copied().unwrap_or(0);
    kernels::produce(&mut x, 0, &s0)?;
    d1.set_current()?;
    let switched = run("a launch from device 1", &mut || kernels::produce(&mut x, 1, &s0))?;
    let stayed = run("a launch from device 0", &mut || kernels::produce(&mut x, 2, &s0))?;
    println!("two devices: a launch on device 0 from device 1: {switched:?}; again: {stayed:?}");
    if calls(&switched, "cudaSetDevice") != 1 || calls(&stayed, "cudaSetDevice") != 0 {
        return Err("a kernel launch must make its stream's device current, once".into());
    }
    // NCCL on device 0 while device 1 is current: no device calls of handoff's.
    let comm = &Communicator::init_all(std::slice::from_ref(&d0))?[0];
    let mut y = DeviceBuffer::<f32>::zeros(4, &s0)?;
    d1.set_current()?;
    let nccl = run("an all_reduce", &mut || {
        comm.all_reduce(&x, &mut y, ReduceOp::Sum, &s0)
    })?;
    if calls(&nccl, "cudaSetDevice") + calls(&nccl, "cudaGetDevice") != 0 {
        return Err(format!("an NCCL operation asked or set the device: {nccl:?}").into());
    }
    // A peer copy captured: b (device 0) from a (device 1).
    let a = DeviceBuffer::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &s1)?;
    let mut b = DeviceBuffer::<f32>::zeros(4, &s0)?;
    let graph = Graph::capture(&s0, |s| b.copy_from(&a, s))?;
    for _ in 0..3 {
        graph
            .launch(&s0)
            .map_err(|e| format!("a graph with a peer copy must launch: {e}"))?;
    }
    match graph.launch(&s1) {
        Err(handoff::Error::InvalidArgument(m)) if m.contains("the graph is on device 0") => {}
        other => {
            return Err(format!("a launch on another device's stream must be refused: {other:?}").into());
        }
    }
    Ok(())
}

/// Hostile-peers hole 7: when the event after an NCCL operation cannot be recorded, the
/// operation is neither tracked nor watched, and the host waits for its stream instead; that
/// wait, with the stream's locks held, must be bounded: the communicator is aborted first
/// (which ends its kernels: here, the stub's blocked synchronize).
fn failed_record_after_nccl_work(stubs: &Stubs) -> Result<(), Failed> {
    let dev = device();
    let comms = Communicator::init_all(std::slice::from_ref(&dev))?;
    let s = Stream::new(&dev)?;
    let x = DeviceBuffer::from_slice(&[1.0f32], &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(1, &s)?;
    stubs.call("cudart_stub_block_syncs", 1);
    stubs.call("cudart_stub_fail_event_records", 1);
    let (done, finished) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let r = comms[0].all_reduce(&x, &mut y, ReduceOp::Sum, &s);
        let _ = done.send((r, comms[0].broken_reason()));
        (comms, s, x, y)
    });
    let outcome = finished.recv_timeout(Duration::from_secs(10));
    stubs.call("cudart_stub_block_syncs", 0);
    stubs.call("cudart_stub_fail_event_records", 0);
    let _ = worker.join();
    let Ok((r, broken)) = outcome else {
        return Err("the wait after a failed event record on NCCL work did not end (10 s)".into());
    };
    println!("failed record: {r:?}; communicator: {broken:?}");
    if r.is_ok() || !broken.is_some_and(|b| b.contains("could not be recorded")) {
        return Err("the operation must fail and its communicator be aborted".into());
    }
    Ok(())
}

/// The watchdog's queries while [`OPS`] eager operations are queued and then seen complete.
fn watchdog_queries(stubs: &Stubs) -> Result<(), Failed> {
    let dev = device();
    let comm = &Communicator::init_all(std::slice::from_ref(&dev))?[0];
    let s = Stream::new(&dev)?;
    let x = DeviceBuffer::from_slice(&[1.0f32], &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(1, &s)?;
    let mut op = || comm.all_reduce(&x, &mut y, ReduceOp::Sum, &s);
    op()?;
    std::thread::sleep(SETTLE);
    // Queued while "running", then complete, then looked at: the watchdog's work for OPS
    // operations, not counting this thread's own queries.
    let all = |stubs: &Stubs| stubs.all("cudaEventQuery");
    let mine = |stubs: &Stubs| stubs.snapshot().calls.get("cudaEventQuery").copied().unwrap_or(0);
    let (all0, mine0) = (all(stubs), mine(stubs));
    let t0 = std::time::Instant::now();
    stubs.set_event_query(NOT_READY);
    for _ in 0..OPS {
        op()?;
    }
    std::thread::sleep(SETTLE);
    stubs.set_event_query(0);
    std::thread::sleep(SETTLE);
    let watchdog = (all(stubs) - all0) - (mine(stubs) - mine0);
    // The watchdog queries no event per operation: per look (one every 20 ms at most) at most
    // the newest's event, the oldest's, and what the oldest waits behind while they are
    // "running", then the newest alone once it has completed: 3 per look, and a look to spare
    // at each end: about 16 in two settles of 100 ms, where one query per operation would make
    // about 74.
    let looks = t0.elapsed().as_millis() as u64 / 20 + 2;
    let at_most = 3 * looks;
    println!(
        "watchdog: {watchdog} cudaEventQuery calls for {OPS} operations queued and completed (at \
         most {at_most} allowed)"
    );
    if watchdog > at_most {
        return Err(format!(
            "the watchdog made {watchdog} event queries for {OPS} queued operations (at most \
             {at_most}: it looks at the newest first)"
        )
        .into());
    }
    Ok(())
}

/// Set in the child process of `watchdog_survives_a_timeout_too_long_to_multiply`.
const CHILD: &str = "HANDOFF_HOTPATH_CHILD";

/// With the watchdog's log on, a timeout of `Duration::MAX` once overflowed the watchdog's
/// patience (`timeout * PATIENCE`) in the log line and killed its thread, after which nothing
/// was ever aborted. Run in a child process: the log setting is read once per process.
fn watchdog_survives_a_timeout_too_long_to_multiply(_: &Stubs) -> Result<(), Failed> {
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .env(CHILD, "1")
        .env("HANDOFF_WATCHDOG_LOG", "1")
        .args(["--exact", "child_watchdog_max_timeout", "--nocapture"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    // Without a watchdog the child's communicator, with its endless timeout, could wait
    // forever: bounded here.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while child.try_wait()?.is_none() {
        if std::time::Instant::now() > deadline {
            child.kill()?;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!(
        "child: {}",
        stdout
            .lines()
            .filter(|l| l.contains("child:"))
            .collect::<Vec<_>>()
            .join("; ")
    );
    if !out.status.success() {
        return Err(format!("the child failed ({}): {stdout}\n{stderr}", out.status).into());
    }
    Ok(())
}

fn child_watchdog_max_timeout(stubs: &Stubs) -> Result<(), Failed> {
    let dev = device();
    let mut comms = Communicator::init_all(std::slice::from_ref(&dev))?;
    comms[0].set_timeout(Duration::MAX);
    let comm = &comms[0];
    let s = Stream::new(&dev)?;
    let x = DeviceBuffer::from_slice(&[1.0f32], &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(1, &s)?;
    // Queued and "running": the watchdog logs each look at it.
    stubs.set_event_query(NOT_READY);
    comm.all_reduce(&x, &mut y, ReduceOp::Sum, &s)?;
    std::thread::sleep(SETTLE);
    // The watchdog, still alive, must see NCCL's error and abort the communicator.
    stubs.set_async_error(3);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while comm.broken_reason().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    stubs.set_event_query(0);
    let broken = comm.broken_reason();
    stubs.set_async_error(0);
    match broken {
        Some(reason) if reason.contains("the watchdog found an NCCL error") => {
            println!("child: aborted by the watchdog: {reason}");
            Ok(())
        }
        other => Err(format!("the watchdog did not abort the communicator: {other:?}").into()),
    }
}

fn main() {
    let args = Arguments::from_args();
    if std::env::var_os(CHILD).is_some() {
        let path = |v: &str| PathBuf::from(std::env::var_os(v).expect("set by the parent"));
        let stubs: &'static Stubs = Box::leak(Box::new(Stubs::open(
            &path("HANDOFF_CUDART_PATH"),
            &path("HANDOFF_NCCL_PATH"),
        )));
        let trials = vec![Trial::test("child_watchdog_max_timeout", move || {
            child_watchdog_max_timeout(stubs)
        })];
        libtest_mimic::run(&args, trials).exit()
    }
    let (cudart, nccl) = match build_stubs() {
        Ok(p) => p,
        // The GPU machine's runs (scripts/device-run.sh) need not have a C compiler; CI does.
        Err(NoStubs::NoCompiler(e)) if std::env::var_os("HANDOFF_REQUIRE_GPUS").is_some() => {
            println!("hotpath: not run here: {e}");
            return;
        }
        Err(e) => {
            panic!("the stub libraries could not be built: {}", e.text())
        }
    };
    // SAFETY: no other thread exists yet, and nothing has read the environment.
    unsafe {
        std::env::set_var("HANDOFF_CUDART_PATH", &cudart);
        std::env::set_var("HANDOFF_NCCL_PATH", &nccl);
    }
    let stubs: &'static Stubs = Box::leak(Box::new(Stubs::open(&cudart, &nccl)));
    let trial = |name: &str, f: fn(&Stubs) -> Result<(), Failed>| Trial::test(name, move || f(stubs));
    let trials = vec![
        trial("verified_self_group", verified_self_group),
        trial("unverified_self_group", unverified_self_group),
        trial("all_reduce", all_reduce),
        trial("kernels_produce", produce),
        trial("kernel_graph_launch", kernel_graph),
        trial("nccl_graph_launch", nccl_graph),
        trial("all_reduce_after_a_replay", all_reduce_after_a_replay),
        trial("capture_across_streams", capture_across_streams),
        trial("pinned_slabs", pinned_slabs),
        trial("watchdog_queries", watchdog_queries),
        trial("two_devices", two_devices),
        trial("failed_record_after_nccl_work", failed_record_after_nccl_work),
        trial(
            "watchdog_survives_a_timeout_too_long_to_multiply",
            watchdog_survives_a_timeout_too_long_to_multiply,
        ),
    ];
    // One at a time: the stub's event state and the watchdog are shared by the whole process.
    let mut args = args;
    args.test_threads = Some(1);
    let conclusion = libtest_mimic::run(&args, trials);
    let _ = std::fs::remove_dir_all(cudart.parent().expect("folder"));
    conclusion.exit()
}
