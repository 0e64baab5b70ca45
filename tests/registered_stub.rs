//! Registered memory and windows on a CPU, against the stub libraries of tests/stubs (built here
//! with the system's C compiler): `tests/stubs/register.c` is the stub NCCL with the
//! registration functions, `tests/stubs/nccl.c` one without them (an NCCL older than 2.27, or a
//! build without them). The stubs count their calls, so the tests assert which NCCL calls were
//! made, and when: `ncclMemFree` only after every tracked use completed (the stub runtime's
//! `cudaEventQuery` answers "not ready" until told otherwise), nothing freed while registered,
//! a window refused before NCCL is called.
//!
//! The crate opens each library once per process, so the test of the NCCL without the functions
//! runs in a child process of this binary.
//!
//! The binary's allocator is [`Trap`], the system's with one block held back on request, so that
//! a test can make a new communicator's state land where an old one's was.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use handoff::{Communicator, Device, DeviceBuffer, Error, ReduceOp, Stream, group};

mod stubs;
use libtest_mimic::{Arguments, Failed, Trial};

/// Set in the child that runs against the NCCL without the functions.
const CHILD: &str = "HANDOFF_REGISTERED_STUB_CHILD";
/// cudaErrorNotReady.
const NOT_READY: i32 = 600;

struct Stubs {
    cudart: libloading::Library,
    nccl: libloading::Library,
}

impl Stubs {
    fn count(&self, name: &str) -> i64 {
        let (lib, sym): (&libloading::Library, &[u8]) = if name.starts_with("nccl") {
            (&self.nccl, b"nccl_stub_count\0")
        } else {
            (&self.cudart, b"cudart_stub_count\0")
        };
        let name = std::ffi::CString::new(name).expect("name");
        // SAFETY: `long count(const char *name, int all)`.
        unsafe {
            let count: libloading::Symbol<unsafe extern "C" fn(*const std::ffi::c_char, i32) -> i64> =
                lib.get(sym).expect("count");
            count(name.as_ptr(), 1)
        }
    }

    /// Makes the stub's cudaEventQuery answer "not ready" (queued work still runs) or done.
    fn events_pending(&self, pending: bool) {
        // SAFETY: `void set(int)`.
        unsafe {
            let set: libloading::Symbol<unsafe extern "C" fn(i32)> =
                self.cudart.get(b"cudart_stub_set_event_query\0").expect("setter");
            set(if pending { NOT_READY } else { 0 });
        }
    }

    /// Makes the stub runtime report `n` devices.
    fn set_devices(&self, n: i32) {
        // SAFETY: `void set(int)`.
        unsafe {
            let set: libloading::Symbol<unsafe extern "C" fn(i32)> =
                self.cudart.get(b"cudart_stub_set_devices\0").expect("setter");
            set(n);
        }
    }

    /// Counts of `names` now.
    fn counts(&self, names: &[&str]) -> Vec<i64> {
        names.iter().map(|n| self.count(n)).collect()
    }
}

/// The system's allocator, which can also catch the block of the allocation a thread makes first
/// after the stub NCCL creates a communicator (`ncclCommInitRankConfig`: the communicator's
/// shared state, made right after), keep it from the system once freed, and hand it to the same
/// allocation of the next communicator made. Address reuse is then certain, where the system's
/// allocator gives it only by chance.
struct Trap;

#[global_allocator]
static ALLOC: Trap = Trap;

/// What [`Trap`] does: nothing.
const IDLE: u8 = 0;
/// Catches the next allocation after a communicator is created on the trapping thread.
const CATCH: u8 = 1;
/// Caught (`BLOCK`): kept from the system when freed.
const CAUGHT: u8 = 2;
/// Freed, and kept.
const KEPT: u8 = 3;
/// Hands the kept block to the next allocation after a communicator is created on the
/// trapping thread, if it has the same layout.
const HAND_BACK: u8 = 4;
/// Handed back.
const HANDED: u8 = 5;
/// That allocation had another layout: the kept block stays kept.
const MISSED: u8 = 6;

static PHASE: AtomicU8 = AtomicU8::new(IDLE);
static BLOCK: AtomicUsize = AtomicUsize::new(0);
static BLOCK_SIZE: AtomicUsize = AtomicUsize::new(0);
static BLOCK_ALIGN: AtomicUsize = AtomicUsize::new(0);
/// The trapping thread's `ncclCommInitRankConfig` calls when armed.
static INITS: AtomicI64 = AtomicI64::new(0);
/// The stub NCCL's `nccl_stub_count`, set once the library is loaded (and never unloaded).
static COUNT_FN: AtomicUsize = AtomicUsize::new(0);

type CountFn = unsafe extern "C" fn(*const std::ffi::c_char, i32) -> i64;

thread_local! {
    /// Whether this thread is the one [`Trap`] watches.
    static TRAPPING: Cell<bool> = const { Cell::new(false) };
}

impl Trap {
    /// The calling thread's `ncclCommInitRankConfig` calls so far.
    fn inits() -> i64 {
        let f = COUNT_FN.load(Ordering::Acquire);
        if f == 0 {
            return 0;
        }
        // SAFETY: `f` is `long nccl_stub_count(const char *, int)` of the stub NCCL, which is
        // never unloaded; it allocates nothing (reads the stub's counters and compares names).
        unsafe {
            let count: CountFn = std::mem::transmute::<usize, CountFn>(f);
            count(c"ncclCommInitRankConfig".as_ptr(), 0)
        }
    }

    /// Sets `phase` for the calling thread's next communicator.
    fn arm(phase: u8) {
        INITS.store(Trap::inits(), Ordering::Relaxed);
        TRAPPING.with(|t| t.set(true));
        PHASE.store(phase, Ordering::SeqCst);
    }

    /// Back to the system's allocator (a block still kept is leaked).
    fn disarm() {
        TRAPPING.with(|t| t.set(false));
        PHASE.store(IDLE, Ordering::SeqCst);
    }

    fn phase() -> u8 {
        PHASE.load(Ordering::SeqCst)
    }
}

// SAFETY: every block comes from `System` with the layout asked for: a caught block is one
// `System` allocated, and the one handed back has the layout it was allocated (and is now asked)
// with; a kept block is handed out at most once, and was freed by its owner before.
unsafe impl GlobalAlloc for Trap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let phase = PHASE.load(Ordering::SeqCst);
        if (phase == CATCH || phase == HAND_BACK)
            && TRAPPING.try_with(Cell::get).unwrap_or(false)
            && Trap::inits() > INITS.load(Ordering::Relaxed)
        {
            if phase == CATCH {
                // SAFETY: the caller's layout, passed on.
                let p = unsafe { System.alloc(layout) };
                BLOCK.store(p as usize, Ordering::SeqCst);
                BLOCK_SIZE.store(layout.size(), Ordering::SeqCst);
                BLOCK_ALIGN.store(layout.align(), Ordering::SeqCst);
                PHASE.store(if p.is_null() { IDLE } else { CAUGHT }, Ordering::SeqCst);
                return p;
            }
            let same = layout.size() == BLOCK_SIZE.load(Ordering::SeqCst)
                && layout.align() == BLOCK_ALIGN.load(Ordering::SeqCst);
            if same
                && PHASE
                    .compare_exchange(HAND_BACK, HANDED, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            {
                return BLOCK.load(Ordering::SeqCst) as *mut u8;
            }
            PHASE.store(MISSED, Ordering::SeqCst);
        }
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if ptr as usize == BLOCK.load(Ordering::SeqCst)
            && PHASE
                .compare_exchange(CAUGHT, KEPT, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            return;
        }
        // SAFETY: `ptr` came from `System` with `layout` (the caller's guarantee, and see above).
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Disarms [`Trap`] when a test ends, however it ends.
struct Disarm;

impl Drop for Disarm {
    fn drop(&mut self) {
        Trap::disarm();
    }
}

fn build(dir: &Path, c: &str, so: &str) -> Result<PathBuf, String> {
    stubs::build(dir, c, so).map_err(stubs::NoStubs::text)
}

fn one_rank() -> Result<(Device, Stream, Communicator), Failed> {
    let dev = Device::new(0)?;
    let stream = Stream::new(&dev)?;
    let comm = Communicator::init_all(std::slice::from_ref(&dev))?
        .pop()
        .ok_or("no communicator")?;
    Ok((dev, stream, comm))
}

/// `Communicator::barrier` queues one all-reduce and no other NCCL operation; `barrier_wait`
/// the same, then waits.
fn barrier_is_one_all_reduce(s: &Stubs) -> Result<(), Failed> {
    let (_dev, stream, comm) = one_rank()?;
    let calls = [
        "ncclAllReduce",
        "ncclSend",
        "ncclRecv",
        "ncclBroadcast",
        "ncclAllGather",
    ];
    let before: Vec<i64> = calls.iter().map(|c| s.count(c)).collect();
    comm.barrier(&stream)?;
    comm.barrier_wait(&stream)?;
    let made: Vec<i64> = calls.iter().zip(&before).map(|(c, b)| s.count(c) - b).collect();
    if made != [2, 0, 0, 0, 0] {
        return Err(format!("two barriers made these calls of {calls:?}: {made:?}").into());
    }
    Ok(())
}

/// Polls `cond` for up to two seconds.
fn eventually(what: &str, mut cond: impl FnMut() -> bool) -> Result<(), Failed> {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() > Duration::from_secs(2) {
            return Err(format!("{what}: not within 2 s").into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// A dropped ncclMemAlloc buffer is freed once, and only after its uses completed; the drop
/// does not wait for them.
fn freed_after_its_uses(s: &Stubs) -> Result<(), Failed> {
    let (_dev, stream, comm) = one_rank()?;
    let mut buf = DeviceBuffer::<f32>::from_slice_nccl(&[1.0, 2.0, 3.0], &stream)?;
    if !buf.is_nccl_alloc() || s.count("ncclMemAlloc") < 1 {
        return Err("the buffer did not come from ncclMemAlloc".into());
    }
    // Values through an all-reduce of one rank: the stub runtime copies, the stub NCCL does not
    // reduce, so only the round trip through the buffer is checked.
    if buf.to_vec(&stream)? != [1.0, 2.0, 3.0] {
        return Err("from_slice_nccl lost the values".into());
    }
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &stream)?;
    let frees = s.count("ncclMemFree");
    s.events_pending(true);
    let start = Instant::now();
    drop(buf);
    let took = start.elapsed();
    std::thread::sleep(Duration::from_millis(50));
    let early = s.count("ncclMemFree") - frees;
    let waiting = handoff::pending_nccl_frees();
    s.events_pending(false);
    if early != 0 {
        return Err(format!("ncclMemFree ran {early} time(s) while the buffer's uses were pending").into());
    }
    if waiting != 1 {
        return Err(format!("{waiting} allocations wait for their uses, want 1").into());
    }
    if took > Duration::from_millis(20) {
        return Err(format!("the drop blocked for {took:?}").into());
    }
    eventually("ncclMemFree once the uses completed", || {
        s.count("ncclMemFree") == frees + 1 && handoff::pending_nccl_frees() == 0
    })?;
    // `free` waits on the host and frees at once.
    let buf = DeviceBuffer::<u8>::zeros_nccl(4096, &stream)?;
    buf.free()?;
    if s.count("ncclMemFree") != frees + 2 {
        return Err("free() did not call ncclMemFree".into());
    }
    Ok(())
}

/// A registration is made once and deregistered once, after waiting for the buffer's uses;
/// one that is forgotten keeps the memory from being freed.
fn registration_lifecycle(s: &Stubs) -> Result<(), Failed> {
    let (_dev, stream, comm) = one_rank()?;
    let names = [
        "ncclCommRegister",
        "ncclCommDeregister",
        "ncclMemFree",
        "cudaEventSynchronize",
    ];
    let before = s.counts(&names);
    let mut buf = DeviceBuffer::<f32>::zeros_nccl(1024, &stream)?;
    {
        let mut reg = comm.register(&mut buf)?;
        if !reg.is_active() {
            return Err("the stub returned a handle".into());
        }
        comm.all_reduce_in_place(reg.view_mut(), ReduceOp::Sum, &stream)?;
    }
    let after = s.counts(&names);
    let d: Vec<i64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    if d[0] != 1 || d[1] != 1 {
        return Err(format!("register/deregister calls {:?}, want [1, 1]", &d[..2]).into());
    }
    if d[3] < 1 {
        return Err("the registration's drop did not wait for the buffer's uses".into());
    }
    // Explicit deregistration reports, and the buffer is the caller's again.
    let reg = comm.register(&mut buf)?;
    reg.deregister()?;
    buf.memset_zero(&stream)?;
    // Forgotten: the buffer leaks its memory instead of freeing it under NCCL.
    std::mem::forget(comm.register(&mut buf)?);
    let frees = s.count("ncclMemFree");
    match buf.free() {
        Err(Error::InvalidArgument(m)) if m.contains("forgotten") => {}
        other => return Err(format!("a buffer still registered was freed: {other:?}").into()),
    }
    if s.count("ncclMemFree") != frees {
        return Err("ncclMemFree ran on memory still registered".into());
    }
    Ok(())
}

/// NCCL's registered send/receive path needs both sides registered and does not check it: a
/// send from registered memory into an unregistered receive, between two ranks of one
/// `init_all` (two stub devices), is refused before NCCL is called; registered on both sides,
/// or on neither, it is posted.
fn registration_is_compared_across_a_transfer(s: &Stubs) -> Result<(), Failed> {
    s.set_devices(2);
    let (d0, d1) = (Device::new(0)?, Device::new(1)?);
    let comms = Communicator::init_all(&[d0.clone(), d1.clone()])?;
    let (s0, s1) = (Stream::new(&d0)?, Stream::new(&d1)?);
    let mut a = DeviceBuffer::<f32>::zeros_nccl(16, &s0)?;
    let mut b = DeviceBuffer::<f32>::zeros_nccl(16, &s1)?;
    let sends = s.count("ncclSend");
    {
        let ra = comms[0].register(&mut a)?;
        let refused = group(|g| {
            g.send(&comms[0], ra.view(), 1, &s0)?;
            g.recv(&comms[1], &mut b, 0, &s1)
        });
        match refused {
            Err(Error::InvalidArgument(m)) if m.contains("registered with the communicator") => {
                println!("refused: {m}")
            }
            other => {
                return Err(format!("a registered send into an unregistered receive gave {other:?}").into());
            }
        }
        if s.count("ncclSend") != sends {
            return Err("the refused transfer reached NCCL".into());
        }
        let mut rb = comms[1].register(&mut b)?;
        group(|g| {
            g.send(&comms[0], ra.view(), 1, &s0)?;
            g.recv(&comms[1], rb.view_mut(), 0, &s1)
        })?;
    }
    // Both deregistered: the same transfer over the bare buffers is posted.
    group(|g| {
        g.send(&comms[0], &a, 1, &s0)?;
        g.recv(&comms[1], &mut b, 0, &s1)
    })?;
    if s.count("ncclSend") != sends + 2 {
        return Err(format!("{} sends reached NCCL, want 2", s.count("ncclSend") - sends).into());
    }
    Ok(())
}

/// Two all_gathers of one group, one of registered memory: NCCL may merge them and, under the
/// efficiency CTA policy (or a tuner plugin) with NVLS on, pick the merge's algorithm by whether
/// one registration covers it, which verification cannot compare across ranks. Refused before
/// NCCL there (the efficiency policy, here); posted under the default policy, and under the
/// efficiency policy when each is in a group of its own.
fn layout_dependent_merges(s: &Stubs) -> Result<(), Failed> {
    // The process's environment decides too: this test needs none of these set.
    for k in [
        "NCCL_NVLS_ENABLE",
        "NCCL_CTA_POLICY",
        "NCCL_TUNER_PLUGIN",
        "NCCL_NET_PLUGIN",
    ] {
        if std::env::var_os(k).is_some() {
            println!("not run: {k} is set");
            return Ok(());
        }
    }
    s.set_devices(2);
    let (d0, d1) = (Device::new(0)?, Device::new(1)?);
    for policy in [handoff::CtaPolicy::Default, handoff::CtaPolicy::Efficiency] {
        let options = handoff::CommOptions::default().with_cta_policy(policy);
        let comms = Communicator::init_all_with(options, &[d0.clone(), d1.clone()])?;
        let ss = [Stream::new(&d0)?, Stream::new(&d1)?];
        let (mut a0, b0) = (
            DeviceBuffer::<f32>::zeros_nccl(16, &ss[0])?,
            DeviceBuffer::<f32>::zeros(16, &ss[0])?,
        );
        let (mut a1, b1) = (
            DeviceBuffer::<f32>::zeros_nccl(16, &ss[1])?,
            DeviceBuffer::<f32>::zeros(16, &ss[1])?,
        );
        let mut outs: Vec<DeviceBuffer<f32>> = Vec::new();
        for st in [&ss[0], &ss[0], &ss[1], &ss[1]] {
            outs.push(DeviceBuffer::zeros(32, st)?);
        }
        let [oa0, ob0, oa1, ob1] = &mut outs[..] else {
            return Err("four outputs".into());
        };
        let gathers = s.count("ncclAllGather");
        let r0 = comms[0].register(&mut a0)?;
        let r1 = comms[1].register(&mut a1)?;
        let grouped = group(|g| {
            g.all_gather(&comms[0], r0.view(), &mut *oa0, &ss[0])?;
            g.all_gather(&comms[0], &b0, &mut *ob0, &ss[0])?;
            g.all_gather(&comms[1], r1.view(), &mut *oa1, &ss[1])?;
            g.all_gather(&comms[1], &b1, &mut *ob1, &ss[1])
        });
        match (policy, grouped) {
            (handoff::CtaPolicy::Default, Ok(())) => {}
            (handoff::CtaPolicy::Efficiency, Err(Error::InvalidArgument(m)))
                if m.contains("beside another collective") =>
            {
                println!("efficiency: refused: {m}");
                if s.count("ncclAllGather") != gathers {
                    return Err("the refused group reached NCCL".into());
                }
                // Each in a group of its own (one per rank pair): posted.
                group(|g| {
                    g.all_gather(&comms[0], r0.view(), &mut *oa0, &ss[0])?;
                    g.all_gather(&comms[1], r1.view(), &mut *oa1, &ss[1])
                })?;
                group(|g| {
                    g.all_gather(&comms[0], &b0, &mut *ob0, &ss[0])?;
                    g.all_gather(&comms[1], &b1, &mut *ob1, &ss[1])
                })?;
            }
            (p, other) => return Err(format!("{p:?}: {other:?}").into()),
        }
        if s.count("ncclAllGather") != gathers + 4 {
            return Err(format!(
                "{p:?}: {} all_gathers reached NCCL, want 4",
                s.count("ncclAllGather") - gathers,
                p = policy
            )
            .into());
        }
    }
    Ok(())
}

/// A forgotten registration (`mem::forget`, safe) leaves its communicator's key on the buffer.
/// Once that communicator is gone, a new one whose state lands at the same address must not
/// count the buffer as registered with it: NCCL never registered it there. [`Trap`] makes the
/// new state land there. A key that is the state's address then lets an unregistered send into
/// a registered receive pass verification (NCCL's registered path on one side only) and refuses
/// the plain transfer.
fn a_forgotten_registration_is_not_inherited(s: &Stubs) -> Result<(), Failed> {
    s.set_devices(2);
    let (d0, d1) = (Device::new(0)?, Device::new(1)?);
    let (s0, s1) = (Stream::new(&d0)?, Stream::new(&d1)?);
    let mut x = DeviceBuffer::<f32>::zeros_nccl(1024, &s0)?;
    let mut y = DeviceBuffer::<f32>::zeros_nccl(1024, &s1)?;
    let _disarm = Disarm;
    Trap::arm(CATCH);
    {
        let old = Communicator::init_all(std::slice::from_ref(&d0))?;
        if Trap::phase() != CAUGHT {
            return Err(format!(
                "the old communicator's state was not caught (phase {})",
                Trap::phase()
            )
            .into());
        }
        std::mem::forget(old[0].register(&mut x)?);
        std::thread::sleep(Duration::from_millis(50));
        if Trap::phase() != CAUGHT {
            return Err("the caught block was freed while its communicator lived: not its state".into());
        }
    }
    // Freed once the watchdog lets go of its `Weak` (within two of its periods).
    eventually("the old communicator's state freed", || Trap::phase() == KEPT)?;
    Trap::arm(HAND_BACK);
    let made = Communicator::init_all(&[d0.clone(), d1.clone()]);
    let handed = Trap::phase();
    Trap::disarm();
    let new = made?;
    if handed != HANDED {
        return Err(format!(
            "the new communicator's state did not take the old one's block (phase {handed})"
        )
        .into());
    }
    let sends = s.count("ncclSend");
    {
        let mut ry = new[1].register(&mut y)?;
        let r = group(|g| {
            g.send(&new[0], &x, 1, &s0)?;
            g.recv(&new[1], ry.view_mut(), 0, &s1)
        });
        match r {
            Err(Error::InvalidArgument(m))
                if m.contains("rank 0's sends to rank 1 [1024 elements of f32] and")
                    && m.contains("registered with the communicator") =>
            {
                println!("refused: {m}")
            }
            other => {
                return Err(format!(
                    "a send NCCL sees unregistered into a registered receive, over a new \
                     communicator at the old one's address, gave {other:?}"
                )
                .into());
            }
        }
    }
    if s.count("ncclSend") != sends {
        return Err("the refused transfer reached NCCL".into());
    }
    group(|g| {
        g.send(&new[0], &x, 1, &s0)?;
        g.recv(&new[1], &mut y, 0, &s1)
    })
    .map_err(|e| format!("an unregistered send into an unregistered receive was refused: {e}"))?;
    Ok(())
}

/// Windows: only ncclMemAlloc memory, never twice, no exchange on one rank, deregistered with the
/// window call; refused before NCCL is called.
fn window_rules(s: &Stubs) -> Result<(), Failed> {
    let (_dev, stream, comm) = one_rank()?;
    let names = [
        "ncclCommWindowRegister",
        "ncclCommWindowDeregister",
        "ncclCommDeregister",
        "ncclAllGather",
    ];
    let before = s.counts(&names);
    let delta =
        |s: &Stubs| -> Vec<i64> { s.counts(&names).iter().zip(&before).map(|(a, b)| a - b).collect() };
    // Pool memory is refused, NCCL never called.
    let mut pool = DeviceBuffer::<f32>::zeros(1024, &stream)?;
    // SAFETY: one rank: no peer to disagree on windows.
    match unsafe { comm.register_window(&mut pool) } {
        Err(Error::InvalidArgument(m)) if m.contains("ncclMemAlloc") => {}
        other => return Err(format!("a window of pool memory: {other:?}").into()),
    }
    let mut buf = DeviceBuffer::<f32>::zeros_nccl(1024, &stream)?;
    {
        // SAFETY: as above.
        let mut win = unsafe { comm.register_window(&mut buf) }?;
        if win.index() != 1 {
            return Err(format!("the second attempt is window #{}, want #1", win.index()).into());
        }
        comm.all_reduce_in_place(win.view_mut(), ReduceOp::Sum, &stream)?;
    }
    if delta(s) != [1, 1, 0, 0] {
        return Err(format!(
            "window register/deregister/plain deregister/all-gather calls {:?}, want [1, 1, 0, 0]",
            delta(s)
        )
        .into());
    }
    // Forgotten, then registered again: refused by the buffer's mark, NCCL not called.
    // SAFETY: as above.
    std::mem::forget(unsafe { comm.register_window(&mut buf) }?);
    // SAFETY: as above.
    match unsafe { comm.register_window(&mut buf) } {
        Err(Error::InvalidArgument(m)) if m.contains("already a window") => {}
        other => return Err(format!("a second window of one buffer: {other:?}").into()),
    }
    if delta(s)[0] != 2 {
        return Err(format!("ncclCommWindowRegister called {} times, want 2", delta(s)[0]).into());
    }
    Ok(())
}

/// Ranks of one init_all share a thread: a collective window registration there is refused
/// rather than left waiting for the others.
fn window_on_a_clique_refused(_: &Stubs) -> Result<(), Failed> {
    // SAFETY: `void set(int)`; the stub's device count, read by Device::new.
    unsafe {
        let lib = libloading::Library::new(std::env::var("HANDOFF_CUDART_PATH")?)?;
        let set: libloading::Symbol<unsafe extern "C" fn(i32)> = lib.get(b"cudart_stub_set_devices\0")?;
        set(2);
    }
    let devs = [Device::new(0)?, Device::new(1)?];
    let comms = Communicator::init_all(&devs)?;
    let stream = Stream::new(&devs[0])?;
    let mut buf = DeviceBuffer::<f32>::zeros_nccl(1024, &stream)?;
    // SAFETY: refused before anything reaches NCCL.
    match unsafe { comms[0].register_window(&mut buf) } {
        Err(Error::InvalidArgument(m)) if m.contains("init_all") => Ok(()),
        other => Err(format!("a window on a two-rank init_all communicator: {other:?}").into()),
    }
}

/// Against the NCCL without the functions: every registered-memory entry point is
/// Error::Unsupported naming what is missing and the version needed; the rest works.
fn child_without_the_functions() -> Result<(), String> {
    let (_dev, stream, comm) = one_rank().map_err(|e| format!("{e:?}"))?;
    let check = |what: &str, e: Option<Error>| -> Result<(), String> {
        match e {
            Some(Error::Unsupported { needs, detail, .. })
                if needs.contains("2.27") && detail.contains("nccl") =>
            {
                Ok(())
            }
            other => Err(format!("{what}: {other:?}, want Error::Unsupported")),
        }
    };
    check("zeros_nccl", DeviceBuffer::<f32>::zeros_nccl(16, &stream).err())?;
    let mut buf = DeviceBuffer::<f32>::zeros(16, &stream).map_err(|e| e.to_string())?;
    check("register", comm.register(&mut buf).err())?;
    // SAFETY: refused before NCCL (one rank).
    check("register_window", unsafe { comm.register_window(&mut buf) }.err())?;
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &stream)
        .map_err(|e| format!("the rest of NCCL should work: {e}"))?;
    Ok(())
}

fn without_the_functions(cudart: &Path, plain: &Path) -> Result<(), Failed> {
    stubs::run_child(CHILD, cudart, plain).map_err(Failed::from)
}

fn main() {
    stubs::child_main(CHILD, child_without_the_functions);
    let mut args = Arguments::from_args();
    let dir = std::env::temp_dir().join(format!("handoff-registered-stubs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("stub folder");
    let plain_dir = dir.join("plain");
    std::fs::create_dir_all(&plain_dir).expect("stub folder");
    let built = (|| {
        Ok::<_, String>((
            build(&dir, "cudart.c", "libcudart.so.13")?,
            build(&dir, "register.c", "libnccl.so.2")?,
            build(&plain_dir, "nccl.c", "libnccl.so.2")?,
        ))
    })();
    let (cudart, nccl, plain) =
        built.unwrap_or_else(|e| panic!("the stub libraries could not be built: {e}"));
    // SAFETY: no other thread exists yet, and nothing has read the environment.
    unsafe {
        std::env::set_var("HANDOFF_CUDART_PATH", &cudart);
        std::env::set_var("HANDOFF_NCCL_PATH", &nccl);
    }
    // SAFETY: the stubs just built: plain C with no initialisers.
    let stubs: &'static Stubs = Box::leak(Box::new(unsafe {
        Stubs {
            cudart: libloading::Library::new(&cudart).expect("stub runtime"),
            nccl: libloading::Library::new(&nccl).expect("stub NCCL"),
        }
    }));
    // SAFETY: `long nccl_stub_count(const char *, int)`; the library is leaked (never unloaded).
    let count = unsafe { stubs.nccl.get::<CountFn>(b"nccl_stub_count\0") }.expect("count");
    COUNT_FN.store(*count as usize, Ordering::Release);
    let trial = |name: &str, f: fn(&Stubs) -> Result<(), Failed>| Trial::test(name, move || f(stubs));
    let (c, p) = (cudart.clone(), plain.clone());
    let trials = vec![
        trial(
            "an_nccl_buffer_is_freed_after_its_uses_without_blocking_the_drop",
            freed_after_its_uses,
        ),
        trial(
            "a_registration_deregisters_after_the_uses_and_a_forgotten_one_leaks",
            registration_lifecycle,
        ),
        trial("a_window_needs_nccl_memory_and_is_never_made_twice", window_rules),
        trial(
            "a_barrier_is_one_all_reduce_and_nothing_else",
            barrier_is_one_all_reduce,
        ),
        trial(
            "registration_is_compared_across_a_transfer",
            registration_is_compared_across_a_transfer,
        ),
        trial(
            "a_forgotten_registration_is_not_inherited_by_a_communicator_at_its_address",
            a_forgotten_registration_is_not_inherited,
        ),
        trial(
            "a_window_on_a_two_rank_init_all_communicator_is_refused",
            window_on_a_clique_refused,
        ),
        trial(
            "registered_all_gathers_grouped_are_refused_only_where_the_layout_can_pick_the_algorithm",
            layout_dependent_merges,
        ),
        Trial::test(
            "an_nccl_without_the_functions_is_unsupported_not_a_crash",
            move || without_the_functions(&c, &p),
        ),
    ];
    // One at a time: the stub's event state and its device count are the whole process's.
    args.test_threads = Some(1);
    let conclusion = libtest_mimic::run(&args, trials);
    let _ = std::fs::remove_dir_all(&dir);
    conclusion.exit()
}
