//! Interop with cudarc 0.19 (feature `cudarc`): a handoff stream over a cudarc stream, slices
//! moved into handoff buffers and back after their pending uses, a kernel launched through
//! cudarc's own launch builder on handoff buffers inside `Stream::raw_use`, handoff buffers lent
//! to cudarc and cudarc slices borrowed by handoff (NCCL included) without moving them. The
//! hazard tests fail when tracking is bypassed (`--cfg handoff_bypass_tracking`), and so do the
//! refusals of uses that conflict with a lend.
//!
//! `cargo test --features cudarc-13000 --test cudarc`

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Gpus, assert_all_eq};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, PushKernelArg};
use cudarc::nvrtc::Ptx;
use handoff::kernels::{self, produced_value};
use handoff::{Device, DeviceBuffer, RawUse, Stream};
use libtest_mimic::Failed;

const PTX: &str = include_str!("data/user_kernels.ptx");
const N: usize = 1 << 12;

fn main() {
    let g = Gpus::detect();
    common::run(vec![
        g.trial("slices_move_into_handoff_and_back", 1, round_trip),
        g.trial(
            "hazard_a_buffer_handed_to_cudarc_waits_for_a_slow_handoff_write",
            1,
            handoff_write_then_cudarc_read,
        ),
        g.trial(
            "hazard_cudarc_launch_builder_in_raw_use_waits_for_a_slow_write",
            1,
            cudarc_launch_on_handoff_buffers,
        ),
        g.trial(
            "a_cudarc_stream_is_wrapped_by_one_live_stream_at_a_time",
            1,
            one_wrapper_at_a_time,
        ),
        g.trial(
            "a_slice_moves_in_only_on_a_wrapper_of_its_own_stream",
            1,
            slice_moves_on_its_own_stream,
        ),
        g.trial("zero_sized_elements_stay_in_handoff", 1, zero_sized_elements_stay),
        g.trial(
            "hazard_cudarc_reads_a_lent_buffer_after_a_slow_handoff_write",
            1,
            lent_read_after_handoff_write,
        ),
        g.trial(
            "hazard_handoff_reads_a_lent_buffer_after_a_slow_cudarc_write",
            1,
            handoff_read_after_lent_write,
        ),
        g.trial(
            "hazard_handoff_reads_a_borrowed_slice_after_a_slow_cudarc_write",
            1,
            borrowed_read_after_cudarc_write,
        ),
        g.trial(
            "hazard_cudarc_reads_a_borrowed_slice_after_a_slow_handoff_write",
            1,
            cudarc_read_after_borrowed_write,
        ),
        g.trial(
            "hazard_nccl_sends_and_receives_borrowed_cudarc_slices",
            1,
            nccl_on_borrowed_slices,
        ),
        g.trial(
            "a_lent_buffer_refuses_conflicting_uses_elsewhere_and_captures",
            1,
            lend_refusals,
        ),
        g.trial(
            "a_lent_view_panics_on_another_cudarc_stream_and_the_lend_still_ends",
            1,
            lent_view_on_another_stream,
        ),
        g.trial(
            "a_lent_view_panics_in_a_copy_to_another_context",
            2,
            lent_view_in_a_peer_copy,
        ),
        g.trial(
            "lends_and_borrows_need_a_wrapped_stream_and_tracked_memory",
            1,
            lend_and_borrow_requirements,
        ),
    ]);
}

/// How long the slow kernels take: long enough that untracked work would overtake them.
const SLOW: Duration = Duration::from_millis(300);

/// The user kernels' module in cudarc's context.
fn user_slow_copy(ctx: &Arc<CudaContext>) -> Result<CudaFunction, Failed> {
    Ok(ctx
        .load_module(Ptx::from_src(PTX))?
        .load_function("user_slow_copy")?)
}

/// `0, 1, 2, ...` as f32.
fn iota() -> Vec<f32> {
    (0..N).map(|i| i as f32).collect()
}

/// A slow handoff kernel writes x on a plain handoff stream; x is then lent to cudarc on the
/// stream a wrapper of another cudarc stream, which copies it to the host at once: cudarc must
/// see the written values.
fn lent_read_after_handoff_write() -> Result<(), Failed> {
    let (dev, _ctx, ca, _cb) = cudarc_streams()?;
    let s = wrap(&ca, &dev)?;
    let h = Stream::new(&dev)?;
    let mut src = DeviceBuffer::<f32>::zeros(N, &h)?;
    kernels::produce(&mut src, 5, &h)?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &h)?;
    h.synchronize()?;
    kernels::delayed_copy(&src, &mut x, SLOW, &h)?;
    let mut got = vec![0.0f32; N];
    s.lend_to_cudarc(&x, |v| ca.memcpy_dtoh(v, &mut got))??;
    assert_all_eq("cudarc's copy of the lent buffer", &got, |i| produced_value(i, 5))
}

/// cudarc writes a lent buffer with a slow kernel (launched through its builder with the
/// view's pointer); once the lend ends, a handoff copy on another stream must see the values.
fn handoff_read_after_lent_write() -> Result<(), Failed> {
    let (dev, ctx, ca, _cb) = cudarc_streams()?;
    let f = user_slow_copy(&ctx)?;
    let s = wrap(&ca, &dev)?;
    let h = Stream::new(&dev)?;
    let src = ca.clone_htod(&iota())?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &h)?;
    let (n, ns) = (N as u64, SLOW.as_nanos() as u64);
    s.lend_to_cudarc_mut(&mut x, |v| {
        // SAFETY: user_slow_copy(const float* src, float* dst, u64 n, u64 ns) reads src[0..n]
        // and writes dst[0..n]; launched on `ca`, the stream x is lent across.
        unsafe {
            ca.launch_builder(&f)
                .arg(&src)
                .arg(v.kernel_arg())
                .arg(&n)
                .arg(&ns)
                .launch(cudarc::driver::LaunchConfig::for_num_elems(N as u32))
        }
    })??;
    assert_all_eq("handoff's copy after the lend", &x.to_vec(&h)?, |i| i as f32)
}

/// cudarc writes a slice with a slow kernel on its stream; handoff borrows it on a wrapper of
/// that stream and copies it on a plain handoff stream, which must wait for cudarc's write.
fn borrowed_read_after_cudarc_write() -> Result<(), Failed> {
    let (dev, ctx, ca, _cb) = cudarc_streams()?;
    let f = user_slow_copy(&ctx)?;
    let s = wrap(&ca, &dev)?;
    let h = Stream::new(&dev)?;
    let src = ca.clone_htod(&iota())?;
    let mut y = ca.alloc_zeros::<f32>(N)?;
    let (n, ns) = (N as u64, SLOW.as_nanos() as u64);
    // SAFETY: as in handoff_read_after_lent_write.
    unsafe {
        ca.launch_builder(&f)
            .arg(&src)
            .arg(&mut y)
            .arg(&n)
            .arg(&ns)
            .launch(cudarc::driver::LaunchConfig::for_num_elems(N as u32))?;
    }
    let mut out = DeviceBuffer::<f32>::zeros(N, &h)?;
    s.borrow_from_cudarc(&y, |v| out.copy_from(v, &h))??;
    assert_all_eq("handoff's copy of the borrowed slice", &out.to_vec(&h)?, |i| {
        i as f32
    })
}

/// A slow handoff kernel on a plain handoff stream writes a borrowed cudarc slice; afterwards
/// cudarc copies the slice on another of its streams, which must wait for that write.
fn cudarc_read_after_borrowed_write() -> Result<(), Failed> {
    let (dev, _ctx, ca, cb) = cudarc_streams()?;
    let s = wrap(&ca, &dev)?;
    let h = Stream::new(&dev)?;
    let mut src = DeviceBuffer::<f32>::zeros(N, &h)?;
    kernels::produce(&mut src, 7, &h)?;
    let mut y = cb.alloc_zeros::<f32>(N)?;
    h.synchronize()?;
    s.borrow_from_cudarc_mut(&mut y, |v| kernels::delayed_copy(&src, v, SLOW, &h))??;
    let got = cb.clone_dtoh(&y)?;
    assert_all_eq("cudarc's copy after the borrow", &got, |i| produced_value(i, 7))
}

/// A one-rank communicator sends a cudarc slice, just written by a slow cudarc kernel, to
/// itself, into another cudarc slice, both borrowed, on a plain handoff stream; cudarc then
/// copies the received slice on its own stream.
fn nccl_on_borrowed_slices() -> Result<(), Failed> {
    let (dev, ctx, ca, cb) = cudarc_streams()?;
    let f = user_slow_copy(&ctx)?;
    let s = wrap(&cb, &dev)?;
    let comm = handoff::Communicator::init_all(std::slice::from_ref(&dev))?.remove(0);
    let h = Stream::new(&dev)?;
    let src = ca.clone_htod(&iota())?;
    let mut a = ca.alloc_zeros::<f32>(N)?;
    let mut b = ca.alloc_zeros::<f32>(N)?;
    let (n, ns) = (N as u64, SLOW.as_nanos() as u64);
    // SAFETY: as in handoff_read_after_lent_write.
    unsafe {
        ca.launch_builder(&f)
            .arg(&src)
            .arg(&mut a)
            .arg(&n)
            .arg(&ns)
            .launch(cudarc::driver::LaunchConfig::for_num_elems(N as u32))?;
    }
    s.borrow_from_cudarc(&a, |send| {
        s.borrow_from_cudarc_mut(&mut b, |mut recv| {
            handoff::group(|g| {
                g.send(&comm, send, 0, &h)?;
                g.recv(&comm, &mut recv, 0, &h)
            })
        })
    })???;
    let got = ca.clone_dtoh(&b)?;
    assert_all_eq("the received slice, in cudarc", &got, |i| i as f32)
}

/// While half of a buffer is lent to cudarc for writing: the other half (one tracker per buffer)
/// is refused on another stream and allowed on the lending one, no graph capture begins on the
/// lending stream, and a graph that writes the buffer is not launched elsewhere. Afterwards,
/// all of it is allowed again.
fn lend_refusals() -> Result<(), Failed> {
    let (dev, _ctx, ca, _cb) = cudarc_streams()?;
    let s = wrap(&ca, &dev)?;
    let h = Stream::new(&dev)?;
    let mut other = DeviceBuffer::<f32>::zeros(N, &h)?;
    let graph = handoff::Graph::capture(&h, |h| other.fill(2.0, h))?;
    let mut x = DeviceBuffer::<f32>::zeros(2 * N, &h)?;
    let (mut lo, mut hi) = x.split_at_mut(N)?;
    s.lend_to_cudarc_mut(&mut lo, |v| -> Result<(), Failed> {
        ca.memset_zeros(v)?;
        match hi.fill(1.0, &h) {
            Err(handoff::Error::InvalidArgument(m)) => println!("refused: {m}"),
            other => return Err(format!("the other half on another stream gave {other:?}").into()),
        }
        hi.fill(1.0, &s)?;
        match handoff::Graph::capture(&s, |_| Ok(())) {
            Err(handoff::Error::Capture { detail }) => println!("refused: {detail}"),
            other => return Err(format!("a capture on the lending stream gave {:?}", other.err()).into()),
        }
        Ok(())
    })??;
    // A read lend of `other`: the graph, which writes it, is refused on another stream.
    s.lend_to_cudarc(&other, |_| match graph.launch(&h) {
        Err(handoff::Error::InvalidArgument(m)) => {
            println!("refused: {m}");
            Ok(())
        }
        r => Err(Failed::from(format!("a graph writing a lent buffer gave {r:?}"))),
    })??;
    hi.fill(3.0, &h)?;
    graph.launch(&h)?;
    handoff::Graph::capture(&s, |_| Ok(()))?;
    assert_all_eq("hi", &hi.to_vec(&h)?, |_| 3.0)?;
    assert_all_eq("other", &other.to_vec(&h)?, |_| 2.0)
}

/// A lent view given to cudarc with another cudarc stream panics before cudarc queues
/// anything; the lend still ends (the buffer is written elsewhere, the stream captured, after).
fn lent_view_on_another_stream() -> Result<(), Failed> {
    let (dev, _ctx, ca, cb) = cudarc_streams()?;
    let s = wrap(&ca, &dev)?;
    let h = Stream::new(&dev)?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &h)?;
    let mut got = vec![0.0f32; N];
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        s.lend_to_cudarc(&x, |v| cb.memcpy_dtoh(v, &mut got))
    }));
    match caught {
        Err(p) => println!("panicked: {}", panic_text(&*p)),
        Ok(r) => return Err(format!("a lent view used on another stream gave {r:?}").into()),
    }
    x.fill(4.0, &h)?;
    handoff::Graph::capture(&s, |_| Ok(()))?;
    assert_all_eq("x", &x.to_vec(&h)?, |_| 4.0)
}

/// cudarc's copy between contexts takes the source's pointer for the source's stream but queues
/// the copy on the destination's (GPU 1's): a lent view as that source panics before cudarc
/// queues anything, and the lend still ends.
fn lent_view_in_a_peer_copy() -> Result<(), Failed> {
    let (dev, _ctx, ca, _cb) = cudarc_streams()?;
    let other = CudaContext::new(1)?.new_stream()?;
    let s = wrap(&ca, &dev)?;
    let h = Stream::new(&dev)?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &h)?;
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        s.lend_to_cudarc(&x, |v| other.clone_dtod(v).map(|c| c.len()))
    }));
    match caught {
        Err(p) => println!("panicked: {}", panic_text(&*p)),
        Ok(r) => return Err(format!("a lent view copied to GPU 1 gave {r:?}").into()),
    }
    x.fill(5.0, &h)?;
    assert_all_eq("x", &x.to_vec(&h)?, |_| 5.0)
}

/// A panic's message.
fn panic_text(p: &(dyn std::any::Any + Send)) -> &str {
    p.downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("?")
}

/// A lend or a borrow on a Stream that wraps no cudarc stream is refused; so is a borrow of a
/// slice whose context tracks no events, on a Stream that wraps another stream than its own.
fn lend_and_borrow_requirements() -> Result<(), Failed> {
    let (dev, ctx, ca, cb) = cudarc_streams()?;
    let plain = Stream::new(&dev)?;
    let x = DeviceBuffer::<f32>::zeros(N, &plain)?;
    let y = cb.clone_htod(&iota())?;
    match plain.lend_to_cudarc(&x, |_| ()) {
        Err(handoff::Error::InvalidArgument(m)) => println!("refused: {m}"),
        other => return Err(format!("a lend across a plain stream gave {other:?}").into()),
    }
    match plain.borrow_from_cudarc(&y, |_| ()) {
        Err(handoff::Error::InvalidArgument(m)) => println!("refused: {m}"),
        other => return Err(format!("a borrow across a plain stream gave {other:?}").into()),
    }
    // SAFETY: this test's work on y is all on cb, which orders it.
    unsafe { ctx.disable_event_tracking() };
    let on_a = wrap(&ca, &dev)?;
    match on_a.borrow_from_cudarc(&y, |_| ()) {
        Err(handoff::Error::InvalidArgument(m)) => println!("refused: {m}"),
        other => return Err(format!("a borrow of untracked memory elsewhere gave {other:?}").into()),
    }
    let on_b = wrap(&cb, &dev)?;
    let got = on_b.borrow_from_cudarc(&y, |v| v.to_vec(&on_b))??;
    assert_all_eq("y", &got, |i| i as f32)
}

/// GPU 0 for handoff, and cudarc's context and two of its streams there.
type Setup = (Device, Arc<CudaContext>, Arc<CudaStream>, Arc<CudaStream>);

/// cudarc's context and two of its streams on GPU 0, made before any other work (cudarc's first
/// stream synchronises the whole context).
fn cudarc_streams() -> Result<Setup, Failed> {
    let dev = Device::new(0)?;
    let ctx = CudaContext::new(0)?;
    let (a, b) = (ctx.new_stream()?, ctx.new_stream()?);
    Ok((dev, ctx, a, b))
}

/// A handoff stream over cudarc's `stream`.
fn wrap(stream: &Arc<CudaStream>, dev: &Device) -> handoff::Result<Stream> {
    // SAFETY: these tests begin no graph capture on a cudarc stream.
    unsafe { Stream::from_cudarc(stream, dev) }
}

/// Two handoff Streams over one cudarc stream would each keep their own order and capture
/// state: the second is refused while the first lives, and allowed once it is gone.
fn one_wrapper_at_a_time() -> Result<(), Failed> {
    let (dev, _ctx, ca, _cb) = cudarc_streams()?;
    let first = wrap(&ca, &dev)?;
    match wrap(&ca, &dev) {
        Err(handoff::Error::InvalidArgument(m)) => println!("refused: {m}"),
        other => return Err(format!("a second wrapper gave {other:?}").into()),
    }
    drop(first);
    let again = wrap(&ca, &dev)?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &again)?;
    kernels::produce(&mut x, 3, &again)?;
    assert_all_eq("x", &x.to_vec(&again)?, |i| kernels::produced_value(i, 3))
}

/// A slice moves into handoff only on a Stream wrapping the slice's own stream (the move queues
/// cudarc's waits there): on another, it is refused and cudarc keeps it, intact.
fn slice_moves_on_its_own_stream() -> Result<(), Failed> {
    let (dev, _ctx, ca, cb) = cudarc_streams()?;
    let on_a = wrap(&ca, &dev)?;
    let plain = Stream::new(&dev)?;
    let host: Vec<f32> = (0..N).map(|i| i as f32).collect();
    for other in [&plain, &on_a] {
        let slice = cb.clone_htod(&host)?;
        match DeviceBuffer::from_cudarc(slice, other) {
            Err(handoff::Error::InvalidArgument(m)) => println!("refused: {m}"),
            other => return Err(format!("a slice of another stream gave {other:?}").into()),
        }
    }
    let on_b = wrap(&cb, &dev)?;
    let x = DeviceBuffer::from_cudarc(cb.clone_htod(&host)?, &on_b)?;
    assert_all_eq("x", &x.to_vec(&plain)?, |i| i as f32)
}

/// A buffer of zero-sized elements owns no memory: handing it to cudarc, which would free its
/// dangling pointer, is refused; an empty one moves.
fn zero_sized_elements_stay() -> Result<(), Failed> {
    let (dev, _ctx, ca, _cb) = cudarc_streams()?;
    let s = Stream::new(&dev)?;
    let units = DeviceBuffer::<()>::zeros(5, &s)?;
    match units.into_cudarc(&ca) {
        Err(handoff::Error::InvalidArgument(m)) => println!("refused: {m}"),
        other => return Err(format!("5 zero-sized elements gave {:?}", other.map(|s| s.len())).into()),
    }
    let empty = DeviceBuffer::<()>::zeros(0, &s)?.into_cudarc(&ca)?;
    if !empty.is_empty() {
        return Err(format!("an empty buffer became a slice of {}", empty.len()).into());
    }
    ca.context().check_err()?;
    Ok(())
}

fn round_trip() -> Result<(), Failed> {
    let (dev, _ctx, ca, cb) = cudarc_streams()?;
    let s = wrap(&ca, &dev)?;
    let other = Stream::new(&dev)?;
    let host: Vec<f32> = (0..N).map(|i| i as f32 * 0.5).collect();
    let slice = ca.clone_htod(&host)?;
    let x = DeviceBuffer::from_cudarc(slice, &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(N, &other)?;
    kernels::twice(&x, &mut y, &other)?; // on another stream: waits for the slice's copy
    assert_all_eq("y in handoff", &y.to_vec(&other)?, |i| i as f32)?;
    let back = y.into_cudarc(&cb)?;
    let got = cb.clone_dtoh(&back)?;
    assert_all_eq("y back in cudarc", &got, |i| i as f32)
}

/// A slow handoff kernel writes x; x is then handed to cudarc on another stream, which copies it
/// to the host at once: cudarc must see the written values.
fn handoff_write_then_cudarc_read() -> Result<(), Failed> {
    let (dev, _ctx, _ca, cb) = cudarc_streams()?;
    let h = Stream::new(&dev)?;
    let mut src = DeviceBuffer::<f32>::zeros(N, &h)?;
    kernels::produce(&mut src, 3, &h)?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &h)?;
    h.synchronize()?;
    kernels::delayed_copy(&src, &mut x, Duration::from_millis(300), &h)?;
    let slice = x.into_cudarc(&cb)?;
    let got = cb.clone_dtoh(&slice)?;
    assert_all_eq("cudarc's copy", &got, |i| produced_value(i, 3))
}

/// cudarc's launch builder runs a user's kernel on handoff buffers inside `raw_use`, on the
/// cudarc stream the handoff stream wraps; its input was just written by a slow handoff kernel
/// on another stream, which the launch must wait for.
fn cudarc_launch_on_handoff_buffers() -> Result<(), Failed> {
    let (dev, ctx, ca, _cb) = cudarc_streams()?;
    let s = wrap(&ca, &dev)?;
    let f = ctx.load_module(Ptx::from_src(PTX))?.load_function("user_scale")?;
    let h = Stream::new(&dev)?;
    let mut src = DeviceBuffer::<f32>::zeros(N, &h)?;
    kernels::produce(&mut src, 9, &h)?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &h)?;
    let mut y = DeviceBuffer::<f32>::zeros(N, &s)?;
    h.synchronize()?;
    kernels::delayed_copy(&src, &mut x, Duration::from_millis(300), &h)?;
    let (px, py, a, n) = (x.as_raw_ptr() as u64, y.as_raw_mut_ptr() as u64, 4.0f32, N as u64);
    let cfg = cudarc::driver::LaunchConfig::for_num_elems(N as u32);
    // SAFETY: user_scale(const float* x, float* y, float a, u64 n) reads x and writes y within
    // their lengths; cudarc launches it on `ca`, the stream `s` wraps.
    unsafe {
        s.raw_use(&[RawUse::read(&x), RawUse::write(&mut y)], |_| {
            ca.launch_builder(&f)
                .arg(&px)
                .arg(&py)
                .arg(&a)
                .arg(&n)
                .launch(cfg)
        })??;
    }
    assert_all_eq("y", &y.to_vec(&h)?, |i| 4.0 * produced_value(i, 9))
}
