//! Interop with cudarc 0.19 (feature `cudarc`): a handoff stream over a cudarc stream, slices
//! moved into handoff buffers and back after their pending uses, and a kernel launched through
//! cudarc's own launch builder on handoff buffers inside `Stream::raw_use`. The hazard tests
//! fail when tracking is bypassed.
//!
//! `CUDARC_CUDA_VERSION=13000 cargo test --features cudarc --test cudarc`

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Gpus, assert_all_eq};
use cudarc::driver::{CudaContext, CudaStream, PushKernelArg};
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
    ]);
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
