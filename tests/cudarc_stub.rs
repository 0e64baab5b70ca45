//! The cudarc interop's lends and borrows on a CPU, against the stub libraries of tests/stubs.
//! The stub driver (`cuda.c`) hands cudarc's streams, events, memory and copies to the stub
//! runtime, so cudarc's work and handoff's share its model of a GPU: a gate (the stub's
//! `cuStreamWaitValue32`) holds its stream, every event recorded behind it and every stream
//! made to wait for such an event, until its word is written. A shut gate stands for slow work:
//! whoever must come after it is held too, and whoever is not shows idle. The stub runtime's
//! counts (cudarc's calls reach it through the driver, which counts them again) say what each
//! side queued: the stream waits, the event records, and no host wait.
//!
//! Built with `--cfg handoff_bypass_tracking`, the ordering tests and the refusals fail.
//!
//! `cargo test --features cudarc-13000 --test cudarc_stub`

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaStream};
use handoff::{Device, DeviceBuffer, Error, Graph, Stream};
use libtest_mimic::{Arguments, Failed, Trial};

mod stubs;

const N: usize = 64;

static CUDART: OnceLock<PathBuf> = OnceLock::new();
static DRIVER: OnceLock<PathBuf> = OnceLock::new();

/// A shut gate on a stream: its later work (and what waits for it) is held until `open`.
struct Gate(&'static AtomicU32);

impl Gate {
    /// Shuts a gate on the raw stream `raw` (a stub stream, handoff's or cudarc's).
    fn shut_on(raw: *mut c_void) -> Gate {
        type Entry =
            unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_uint, c_ulonglong, *mut c_int) -> c_int;
        type WaitValue = unsafe extern "C" fn(*mut c_void, c_ulonglong, c_uint, c_uint) -> c_int;
        // Never freed: the stub's events keep the word's address after it opens.
        let word: &'static AtomicU32 = Box::leak(Box::new(AtomicU32::new(0)));
        // SAFETY: the stub runtime, loaded for the whole process (leaked); its entry point gives
        // its own `cuStreamWaitValue32` (GEQ), which holds `raw` until `*word >= 1`; the word
        // lives forever.
        unsafe {
            let lib = Box::leak(Box::new(
                libloading::Library::new(CUDART.get().expect("built")).expect("the stub loads"),
            ));
            let entry: libloading::Symbol<Entry> = lib
                .get(b"cudaGetDriverEntryPointByVersion\0")
                .expect("the stub has it");
            let mut f: *mut c_void = std::ptr::null_mut();
            let mut status = 0;
            entry(c"cuStreamWaitValue32".as_ptr(), &mut f, 12000, 0, &mut status);
            assert!(!f.is_null(), "the stub gives cuStreamWaitValue32");
            let wait: WaitValue = std::mem::transmute(f);
            assert_eq!(wait(raw, word as *const AtomicU32 as u64, 1, 0), 0);
        }
        Gate(word)
    }

    fn open(&self) {
        self.0.store(1, Ordering::SeqCst);
    }
}

/// This thread's calls so far: handoff's stream waits, event records and host waits (the stub
/// runtime's counts less what cudarc's calls through the stub driver added), and cudarc's
/// stream waits and event records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Calls {
    waits: i64,
    records: i64,
    host_waits: i64,
    cudarc_waits: i64,
    cudarc_records: i64,
}

fn calls() -> Calls {
    let rt = |n| stubs::count(CUDART.get().expect("built"), "cudart", n, false);
    let drv = |n| stubs::count(DRIVER.get().expect("built"), "cuda", n, false);
    let host = |rt_name, drv_name| rt(rt_name) - drv(drv_name);
    Calls {
        waits: rt("cudaStreamWaitEvent") - drv("cuStreamWaitEvent"),
        records: rt("cudaEventRecord") - drv("cuEventRecord"),
        host_waits: host("cudaStreamSynchronize", "cuStreamSynchronize")
            + host("cudaEventSynchronize", "cuEventSynchronize")
            + host("cudaDeviceSynchronize", "cuCtxSynchronize"),
        cudarc_waits: drv("cuStreamWaitEvent"),
        cudarc_records: drv("cuEventRecord"),
    }
}

impl std::ops::Sub for Calls {
    type Output = Calls;
    fn sub(self, o: Calls) -> Calls {
        Calls {
            waits: self.waits - o.waits,
            records: self.records - o.records,
            host_waits: self.host_waits - o.host_waits,
            cudarc_waits: self.cudarc_waits - o.cudarc_waits,
            cudarc_records: self.cudarc_records - o.cudarc_records,
        }
    }
}

/// Fails unless `calls` is `want`.
fn expect_calls(what: &str, calls: Calls, want: Calls) -> Result<(), Failed> {
    if calls == want {
        return Ok(());
    }
    Err(format!("{what}: {calls:?}, want {want:?}").into())
}

/// Device 0, cudarc's context and two of its streams, each wrapped by a handoff Stream, and a
/// plain handoff stream.
struct Setup {
    _dev: Device,
    _ctx: Arc<CudaContext>,
    ca: Arc<CudaStream>,
    cb: Arc<CudaStream>,
    sa: Stream,
    sb: Stream,
    plain: Stream,
}

fn setup() -> Result<Setup, Failed> {
    let dev = Device::new(0)?;
    let ctx = CudaContext::new(0)?;
    let (ca, cb) = (ctx.new_stream()?, ctx.new_stream()?);
    // SAFETY: these tests begin no capture on a cudarc stream outside handoff::Graph.
    let (sa, sb) = unsafe { (Stream::from_cudarc(&ca, &dev)?, Stream::from_cudarc(&cb, &dev)?) };
    let plain = Stream::new(&dev)?;
    Ok(Setup {
        _dev: dev,
        _ctx: ctx,
        ca,
        cb,
        sa,
        sb,
        plain,
    })
}

/// A buffer written on the plain stream behind a shut gate is lent to cudarc on `sa`: before
/// cudarc's copy, `sa` waits (on the GPU) for that write, and so is held by the gate; the host
/// waits for nothing. One wait and one record at the lend's start, the same at its end (the
/// end's use waits for the last write on another stream too).
fn lend_waits_for_handoffs_write() -> Result<(), Failed> {
    let t = setup()?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &t.plain)?;
    let mut y = t.ca.alloc_zeros::<f32>(N)?;
    t.plain.synchronize()?;
    let gate = Gate::shut_on(t.plain.as_raw().cast());
    x.memset_zero(&t.plain)?;
    let before = calls();
    let held = t.sa.lend_to_cudarc(&x, |v| -> Result<bool, Failed> {
        t.ca.memcpy_dtod(v, &mut y)?;
        Ok(!t.sa.is_idle()?)
    })??;
    let issued = calls() - before;
    if !held {
        return Err("cudarc's copy of the lent buffer did not wait for handoff's write".into());
    }
    gate.open();
    if !t.sa.is_idle()? {
        return Err("the cudarc stream is still held once the write's gate opened".into());
    }
    // handoff: the lend's start and end each wait for x's write on the plain stream and record
    // an event; cudarc's copy waits for y's read and write events and records its write.
    expect_calls(
        "the lend",
        issued,
        Calls {
            waits: 2,
            records: 2,
            host_waits: 0,
            cudarc_waits: 2,
            cudarc_records: 1,
        },
    )
}

/// cudarc writes a lent buffer on `sa` behind a shut gate; once the lend ends, a handoff write
/// of the buffer on the plain stream waits for the event recorded after cudarc's work there.
fn handoff_waits_for_the_lends_end() -> Result<(), Failed> {
    let t = setup()?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &t.plain)?;
    t.plain.synchronize()?;
    let mut gate = None;
    t.sa.lend_to_cudarc_mut(&mut x, |v| {
        gate = Some(Gate::shut_on(t.ca.cu_stream().cast()));
        t.ca.memset_zeros(v)
    })??;
    x.memset_zero(&t.plain)?;
    let held = !t.plain.is_idle()?;
    gate.expect("shut").open();
    if !held {
        return Err("a handoff write after the lend did not wait for cudarc's work".into());
    }
    if !t.plain.is_idle()? {
        return Err("the handoff stream is still held once cudarc's gate opened".into());
    }
    Ok(())
}

/// cudarc writes a slice on its stream behind a shut gate; borrowed on the other cudarc
/// stream's wrapper, it is read by a handoff copy on the plain stream, which must be held.
/// cudarc waits once (for the slice's write event) and records once (its read event).
fn borrow_waits_for_cudarcs_write() -> Result<(), Failed> {
    let t = setup()?;
    let mut y = t.ca.alloc_zeros::<f32>(N)?;
    let mut out = DeviceBuffer::<f32>::zeros(N, &t.plain)?;
    t.plain.synchronize()?;
    let gate = Gate::shut_on(t.ca.cu_stream().cast());
    t.ca.memset_zeros(&mut y)?;
    let before = calls();
    t.sb.borrow_from_cudarc(&y, |v| out.copy_from(v, &t.plain))??;
    let issued = calls() - before;
    let held = !t.plain.is_idle()?;
    gate.open();
    if !held {
        return Err("a handoff copy of the borrowed slice did not wait for cudarc's write".into());
    }
    // handoff: the borrow's own write (after cudarc's wait) and the copy each record an event;
    // the copy waits for the former, the give-back for the latter. cudarc waits for its write
    // event and records its read event.
    expect_calls(
        "the borrow",
        issued,
        Calls {
            waits: 2,
            records: 2,
            host_waits: 0,
            cudarc_waits: 1,
            cudarc_records: 1,
        },
    )
}

/// A handoff write on the plain stream behind a shut gate writes a borrowed slice; afterwards
/// cudarc writes the slice on its other stream, which must be held: the borrow's stream waited
/// for handoff's write before cudarc's write event was recorded there.
fn cudarc_waits_for_the_borrows_end() -> Result<(), Failed> {
    let t = setup()?;
    let mut y = t.cb.alloc_zeros::<f32>(N)?;
    t.plain.synchronize()?;
    let gate = Gate::shut_on(t.plain.as_raw().cast());
    t.sa.borrow_from_cudarc_mut(&mut y, |mut v| v.memset_zero(&t.plain))??;
    t.cb.memset_zeros(&mut y)?;
    let held = !t.sb.is_idle()?;
    gate.open();
    if !held {
        return Err("cudarc's write after the borrow did not wait for handoff's".into());
    }
    if !t.sb.is_idle()? {
        return Err("the cudarc stream is still held once handoff's gate opened".into());
    }
    Ok(())
}

/// While half of a buffer is lent for writing: the other half is refused on another stream and
/// allowed on the lending one; no capture begins on the lending stream; a graph that writes a
/// buffer lent for reading is not launched on another stream. Afterwards all of it is allowed.
fn lends_refuse_what_they_cannot_order() -> Result<(), Failed> {
    let t = setup()?;
    let mut other = DeviceBuffer::<f32>::zeros(N, &t.plain)?;
    let graph = Graph::capture(&t.plain, |s| other.memset_zero(s))?;
    let mut x = DeviceBuffer::<f32>::zeros(2 * N, &t.plain)?;
    let (mut lo, mut hi) = x.split_at_mut(N)?;
    t.sa.lend_to_cudarc_mut(&mut lo, |v| -> Result<(), Failed> {
        t.ca.memset_zeros(v)?;
        match hi.memset_zero(&t.plain) {
            Err(Error::InvalidArgument(m)) => println!("refused: {m}"),
            r => return Err(format!("the other half on another stream gave {r:?}").into()),
        }
        hi.memset_zero(&t.sa)?;
        match Graph::capture(&t.sa, |_| Ok(())) {
            Err(Error::Capture { detail }) => println!("refused: {detail}"),
            r => return Err(format!("a capture of the lending stream gave {:?}", r.err()).into()),
        }
        Ok(())
    })??;
    t.sa.lend_to_cudarc(&other, |_| match graph.launch(&t.plain) {
        Err(Error::InvalidArgument(m)) => {
            println!("refused: {m}");
            Ok(())
        }
        r => Err(Failed::from(format!("a graph writing a lent buffer gave {r:?}"))),
    })??;
    hi.memset_zero(&t.plain)?;
    graph.launch(&t.plain)?;
    Graph::capture(&t.sa, |_| Ok(()))?;
    Ok(())
}

/// A lent view given to cudarc with another cudarc stream panics before cudarc queues anything,
/// and the lend still ends: the buffer is written on another stream, and the lending stream
/// captured, afterwards.
fn a_lent_view_elsewhere_panics() -> Result<(), Failed> {
    let t = setup()?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &t.plain)?;
    let mut y = t.cb.alloc_zeros::<f32>(N)?;
    let copies = || {
        stubs::count(
            DRIVER.get().expect("built"),
            "cuda",
            "cuMemcpyDtoDAsync_v2",
            false,
        )
    };
    let (before, copied) = (calls(), copies());
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        t.sa.lend_to_cudarc(&x, |v| t.cb.memcpy_dtod(v, &mut y))
    }));
    match caught {
        Err(p) => println!("panicked: {}", panic_text(&*p)),
        Ok(r) => return Err(format!("a lent view used on another stream gave {r:?}").into()),
    }
    if copies() != copied {
        return Err("cudarc queued its copy before the view's panic".into());
    }
    x.memset_zero(&t.plain)?;
    Graph::capture(&t.sa, |_| Ok(()))?;
    let issued = calls() - before;
    if issued.host_waits != 0 {
        return Err(format!("{issued:?}: the host waited").into());
    }
    Ok(())
}

/// cudarc's copy between contexts (here a second device's) takes the source's pointer for the
/// source's stream, then queues the copy on the destination's: a lent view as that source
/// panics, before any copy, and the lend still ends.
fn a_lent_view_in_a_copy_between_contexts_panics() -> Result<(), Failed> {
    let t = setup()?;
    let other = CudaContext::new(1)?.new_stream()?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &t.plain)?;
    let peer_copies = || stubs::count(DRIVER.get().expect("built"), "cuda", "cuMemcpyPeerAsync", false);
    let copied = peer_copies();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        t.sa.lend_to_cudarc(&x, |v| other.clone_dtod(v).map(|c| c.len()))
    }));
    match caught {
        Err(p) => println!("panicked: {}", panic_text(&*p)),
        Ok(r) => return Err(format!("a lent view copied to another context gave {r:?}").into()),
    }
    if peer_copies() != copied {
        return Err("cudarc queued its copy before the view's panic".into());
    }
    x.memset_zero(&t.plain)?;
    Ok(())
}

/// A panic's message.
fn panic_text(p: &(dyn std::any::Any + Send)) -> &str {
    p.downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("?")
}

fn main() {
    let args = Arguments::from_args();
    // SAFETY: no other thread exists yet, and nothing has read the environment.
    let Some((dir, cudart, _nccl)) = (unsafe { stubs::install_pair("cudarc_stub", "nccl.c") }) else {
        return;
    };
    let driver = match stubs::preload_driver(&dir) {
        Ok(d) => d,
        Err(e) => panic!("the stub driver could not be built: {}", e.text()),
    };
    CUDART.set(cudart).expect("once");
    DRIVER.set(driver).expect("once");
    let trials = vec![
        Trial::test(
            "hazard_a_lend_waits_on_the_gpu_for_a_slow_handoff_write",
            lend_waits_for_handoffs_write,
        ),
        Trial::test(
            "hazard_handoff_waits_on_the_gpu_for_a_lends_slow_cudarc_work",
            handoff_waits_for_the_lends_end,
        ),
        Trial::test(
            "hazard_a_borrow_waits_on_the_gpu_for_a_slow_cudarc_write",
            borrow_waits_for_cudarcs_write,
        ),
        Trial::test(
            "hazard_cudarc_waits_on_the_gpu_for_a_borrows_slow_handoff_write",
            cudarc_waits_for_the_borrows_end,
        ),
        Trial::test(
            "a_lend_refuses_conflicting_uses_elsewhere_and_captures",
            lends_refuse_what_they_cannot_order,
        ),
        Trial::test(
            "a_lent_view_on_another_cudarc_stream_panics_before_anything_is_queued",
            a_lent_view_elsewhere_panics,
        ),
        Trial::test(
            "a_lent_view_in_a_copy_to_another_context_panics_before_anything_is_queued",
            a_lent_view_in_a_copy_between_contexts_panics,
        ),
    ];
    let conclusion = libtest_mimic::run(&args, trials);
    let _ = std::fs::remove_dir_all(&dir);
    conclusion.exit()
}
