//! Users' own GPU code on tracked buffers (issue 10): a kernel that is not handoff's, loaded from
//! PTX at run time and launched with tracking; raw CUDA work declared with `Stream::raw_use`;
//! views; device, peer and host copies; fills. The hazard tests fail when tracking is bypassed
//! (`--cfg handoff_bypass_tracking`).
//!
//! Reported as ignored where too few GPUs are usable; see `tests/common/mod.rs`.

mod common;

use std::time::Duration;

use common::{Gpus, assert_all_eq};
use handoff::kernels::{self, produced_value};
use handoff::sys::cudart::cudaMemcpyKind;
use handoff::{
    Communicator, Device, DeviceBuffer, Error, Function, LaunchConfig, Module, RawUse, Stream, View, ViewMut,
    group,
};
use libtest_mimic::Failed;

const PTX: &str = include_str!("data/user_kernels.ptx");
/// Long enough that, without tracking, the conflicting operation on another stream certainly
/// runs while this one is still waiting.
const LONG: Duration = Duration::from_millis(300);
const N: usize = 1 << 12;

fn main() {
    let g = Gpus::detect();
    common::run(vec![
        g.trial("a_user_kernel_computes_exact_values", 1, user_kernel_values),
        g.trial(
            "hazard_user_kernel_long_read_then_a_write_on_another_stream",
            1,
            long_read_then_write,
        ),
        g.trial(
            "hazard_user_kernel_late_write_then_a_host_read",
            1,
            late_write_then_host_read,
        ),
        g.trial("hazard_raw_use_waits_for_a_tracked_read", 1, raw_use_after_read),
        g.trial(
            "bad_ptx_missing_kernels_and_bad_launches_are_typed_errors",
            1,
            typed_errors,
        ),
        g.trial("fills_of_every_element_size", 1, fills),
        g.trial(
            "split_halves_written_from_two_threads",
            1,
            split_halves_from_threads,
        ),
        g.trial(
            "receive_into_one_view_while_a_kernel_reads_another",
            1,
            receive_into_a_view_while_another_is_read,
        ),
        g.trial("peer_copy_between_two_gpus", 2, peer_copy),
    ]);
}

struct User {
    scale: Function,
    iota: Function,
    slow_copy: Function,
}

fn user() -> Result<User, Failed> {
    let m = Module::from_ptx(PTX)?;
    Ok(User {
        scale: m.function("user_scale")?,
        iota: m.function("user_iota")?,
        slow_copy: m.function("user_slow_copy")?,
    })
}

fn iota(u: &User, s: &Stream, x: &mut DeviceBuffer<f32>, base: f32) -> handoff::Result<()> {
    let n = x.len() as u64;
    // SAFETY: user_iota(float* x, u64 n, float base) writes x[0..n] only.
    unsafe {
        s.launch_builder(&u.iota)
            .arg(x)
            .arg(n)
            .arg(base)
            .launch(LaunchConfig::for_elements(n as usize))
    }
}

fn slow_copy<'a>(
    u: &User,
    s: &Stream,
    src: impl Into<View<'a, f32>>,
    dst: impl Into<ViewMut<'a, f32>>,
) -> handoff::Result<()> {
    let (src, dst) = (src.into(), dst.into());
    let n = src.len() as u64;
    assert_eq!(src.len(), dst.len());
    // SAFETY: user_slow_copy(const float* src, float* dst, u64 n, u64 ns) reads src[0..n],
    // writes dst[0..n], and ends after `ns`.
    unsafe {
        s.launch_builder(&u.slow_copy)
            .arg(src)
            .arg(dst)
            .arg(n)
            .arg(LONG.as_nanos() as u64)
            .launch(LaunchConfig::for_elements(n as usize))
    }
}

fn user_kernel_values() -> Result<(), Failed> {
    let (_dev, s, _) = common::gpu0_two_streams()?;
    let u = user()?;
    let mut x = DeviceBuffer::<f32>::zeros(1000, &s)?;
    iota(&u, &s, &mut x, 1.0)?;
    let mut y = DeviceBuffer::<f32>::zeros(1000, &s)?;
    // SAFETY: user_scale(const float* x, float* y, float a, u64 n) reads x[0..n], writes y[0..n].
    unsafe {
        s.launch_builder(&u.scale)
            .arg(&x)
            .arg(&mut y)
            .arg(2.5f32)
            .arg(1000u64)
            .launch(LaunchConfig::for_elements(1000))?;
    }
    assert_all_eq("y", &y.to_vec(&s)?, |i| 2.5 * (1.0 + i as f32))
}

/// A user kernel reads x for a long time on stream 1; a user kernel then rewrites x on stream 2.
/// The reader must see the old values.
fn long_read_then_write() -> Result<(), Failed> {
    let (_dev, s1, s2) = common::gpu0_two_streams()?;
    let u = user()?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &s1)?;
    iota(&u, &s1, &mut x, 0.0)?;
    let mut out = DeviceBuffer::<f32>::zeros(N, &s1)?;
    slow_copy(&u, &s1, &x, &mut out)?;
    iota(&u, &s2, &mut x, 1000.0)?;
    assert_all_eq("reader's copy", &out.to_vec(&s1)?, |i| i as f32)?;
    assert_all_eq("x after the write", &x.to_vec(&s2)?, |i| 1000.0 + i as f32)
}

/// A user kernel writes y late (after a long wait) on stream 1; the host reads y through stream
/// 2 right after. The read must see the written values.
fn late_write_then_host_read() -> Result<(), Failed> {
    let (_dev, s1, s2) = common::gpu0_two_streams()?;
    let u = user()?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &s1)?;
    iota(&u, &s1, &mut x, 7.0)?;
    let mut y = DeviceBuffer::<f32>::zeros(N, &s1)?;
    s1.synchronize()?;
    slow_copy(&u, &s1, &x, &mut y)?;
    assert_all_eq("host copy", &y.to_vec(&s2)?, |i| 7.0 + i as f32)
}

/// A tracked long read of x on stream 1, then raw work (a runtime memset) declared as a write of
/// x on stream 2: the raw write must wait for the read.
fn raw_use_after_read() -> Result<(), Failed> {
    let (_dev, s1, s2) = common::gpu0_two_streams()?;
    let u = user()?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &s1)?;
    iota(&u, &s1, &mut x, 3.0)?;
    let mut out = DeviceBuffer::<f32>::zeros(N, &s1)?;
    slow_copy(&u, &s1, &x, &mut out)?;
    let (p, bytes) = (x.as_raw_mut_ptr(), x.byte_len());
    // SAFETY: the memset writes x's bytes only, on the stream it is given.
    unsafe {
        s2.raw_use(&[RawUse::write(&mut x)], |s| {
            handoff::result::cudart::memset_async(p.cast(), 0xff, bytes, s)
        })??;
    }
    assert_all_eq("reader's copy", &out.to_vec(&s1)?, |i| 3.0 + i as f32)?;
    let raw: Vec<u32> = x.to_vec(&s2)?.iter().map(|v| v.to_bits()).collect();
    assert_all_eq("x after the raw write", &raw, |_| u32::MAX)?;
    // A raw read of x declared on stream 1, copying it into out: ordered after the raw write.
    let (src, dst) = (x.as_raw_ptr(), out.as_raw_mut_ptr());
    // SAFETY: the copy reads x and writes out, within their lengths, on the stream it is given.
    unsafe {
        s1.raw_use(&[RawUse::read(&x), RawUse::write(&mut out)], |s| {
            handoff::result::cudart::memcpy_async(
                dst.cast(),
                src.cast(),
                bytes,
                cudaMemcpyKind::cudaMemcpyDeviceToDevice,
                s,
            )
        })??;
    }
    let copied: Vec<u32> = out.to_vec(&s2)?.iter().map(|v| v.to_bits()).collect();
    assert_all_eq("out after the raw copy", &copied, |_| u32::MAX)
}

fn typed_errors() -> Result<(), Failed> {
    let (_dev, s, _) = common::gpu0_two_streams()?;
    // The driver compiles PTX lazily: a bad module is reported when it loads, when its kernel
    // is looked up, or at its first launch on a device, as Error::Module at whichever comes.
    let bad = (|| {
        let m = Module::from_ptx(".version 9.0\n.target sm_75\n.address_size 64\n.visible .entry broken( {")?;
        let f = m.function("broken")?;
        let mut x = DeviceBuffer::<f32>::zeros(16, &s)?;
        // SAFETY: refused before any kernel runs (the PTX does not compile).
        unsafe {
            s.launch_builder(&f)
                .arg(&mut x)
                .launch(LaunchConfig::for_elements(16))
        }
    })();
    match bad {
        Err(Error::Module { module, source }) => println!("bad PTX: {module}: {source}"),
        other => return Err(format!("bad PTX gave {other:?}").into()),
    }
    let m = Module::from_ptx(PTX)?;
    match m.function("no_such_kernel") {
        Err(e @ Error::FunctionNotFound { .. }) => println!("missing: {e}"),
        other => return Err(format!("a missing kernel gave {other:?}").into()),
    }
    let f = m.function("user_iota")?;
    let mut x = DeviceBuffer::<f32>::zeros(16, &s)?;
    let too_big = LaunchConfig {
        block: (2048, 1, 1),
        ..LaunchConfig::for_elements(16)
    };
    // SAFETY: the launch is refused before the kernel is queued.
    let r = unsafe {
        s.launch_builder(&f)
            .arg(&mut x)
            .arg(16u64)
            .arg(0f32)
            .launch(too_big)
    };
    match r {
        Err(e @ Error::LaunchConfig { .. }) => println!("refused: {e}"),
        other => return Err(format!("a block of 2048 threads gave {other:?}").into()),
    }
    Ok(())
}

fn fills() -> Result<(), Failed> {
    let (_dev, s, _) = common::gpu0_two_streams()?;
    let mut a = DeviceBuffer::<u8>::zeros(1001, &s)?;
    a.fill(0xab, &s)?;
    assert_all_eq("u8", &a.to_vec(&s)?, |_| 0xab)?;
    let mut b = DeviceBuffer::<u16>::zeros(1001, &s)?;
    b.fill(0xbeef, &s)?;
    assert_all_eq("u16", &b.to_vec(&s)?, |_| 0xbeef)?;
    let mut c = DeviceBuffer::<f64>::zeros(1001, &s)?;
    c.fill(-2.5, &s)?;
    assert_all_eq("f64", &c.to_vec(&s)?, |_| -2.5)?;
    let mut d = DeviceBuffer::<[u8; 3]>::zeros(1001, &s)?;
    d.fill([1, 2, 3], &s)?;
    assert_all_eq("[u8; 3]", &d.to_vec(&s)?, |_| [1, 2, 3])?;
    let mut e = DeviceBuffer::<[f32; 4]>::zeros(1001, &s)?;
    e.fill([1.0, -2.0, 3.5, 4.25], &s)?;
    assert_all_eq("[f32; 4]", &e.to_vec(&s)?, |_| [1.0, -2.0, 3.5, 4.25])?;
    // Part of a buffer: the rest stays.
    let mut f = DeviceBuffer::<f32>::zeros(100, &s)?;
    f.slice_mut(10..20)?.fill(9.0, &s)?;
    assert_all_eq("a filled view", &f.to_vec(&s)?, |i| {
        if (10..20).contains(&i) { 9.0 } else { 0.0 }
    })?;
    let mut g = DeviceBuffer::<[u64; 3]>::zeros(4, &s)?;
    match g.fill([1, 2, 3], &s) {
        Err(Error::InvalidArgument(m)) => println!("refused: {m}"),
        other => return Err(format!("a 24-byte fill gave {other:?}").into()),
    }
    Ok(())
}

/// The two halves of one buffer, written by two threads on two streams at once, each half by a
/// long copy: both halves end right, and a host read of the whole buffer waits for both.
fn split_halves_from_threads() -> Result<(), Failed> {
    let (_dev, s1, s2) = common::gpu0_two_streams()?;
    let u = user()?;
    let mut src = DeviceBuffer::<f32>::zeros(2 * N, &s1)?;
    iota(&u, &s1, &mut src, 5.0)?;
    let mut dst = DeviceBuffer::<f32>::zeros(2 * N, &s1)?;
    {
        let (lo, hi) = dst.split_at_mut(N)?;
        let (src_lo, src_hi) = (src.slice(..N)?, src.slice(N..)?);
        let (u, s1, s2) = (&u, &s1, &s2);
        std::thread::scope(|sc| {
            let a = sc.spawn(move || slow_copy(u, s1, src_lo, lo));
            let b = sc.spawn(move || slow_copy(u, s2, src_hi, hi));
            a.join().expect("thread").and(b.join().expect("thread"))
        })?;
    }
    assert_all_eq("dst", &dst.to_vec(&Stream::new(s1.device())?)?, |i| {
        5.0 + i as f32
    })
}

/// One GPU, a one-rank communicator: a receive into the first half of a buffer on stream 1 while
/// a kernel reads its second half on stream 2 (tracking is per buffer, so they are ordered);
/// both results exact.
fn receive_into_a_view_while_another_is_read() -> Result<(), Failed> {
    let (dev, s1, s2) = common::gpu0_two_streams()?;
    let u = user()?;
    let comm = Communicator::init_all(std::slice::from_ref(&dev))?
        .pop()
        .ok_or("no communicator")?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &s1)?;
    kernels::produce(&mut x, 4, &s1)?;
    let mut buf = DeviceBuffer::<f32>::zeros(2 * N, &s1)?;
    iota(&u, &s1, &mut buf, 100.0)?;
    let mut out = DeviceBuffer::<f32>::zeros(N, &s2)?;
    {
        let (front, back) = buf.split_at_mut(N)?;
        slow_copy(&u, &s2, back.as_view(), &mut out)?;
        group(|g| {
            g.send(&comm, &x, 0, &s1)?;
            g.recv(&comm, front, 0, &s1)
        })?;
    }
    assert_all_eq("kernel's copy of the back half", &out.to_vec(&s2)?, |i| {
        100.0 + (N + i) as f32
    })?;
    let got = buf.to_vec(&s2)?;
    assert_all_eq("front half", &got[..N], |i| produced_value(i, 4))?;
    assert_all_eq("back half", &got[N..], |i| 100.0 + (N + i) as f32)?;
    comm.finalize()?;
    Ok(())
}

/// A peer copy from GPU 0 to GPU 1, then a rewrite of the source on GPU 0: the copy keeps the
/// old values, and the source waits for it.
fn peer_copy() -> Result<(), Failed> {
    let (d0, d1) = (Device::new(0)?, Device::new(1)?);
    let (s0, s1) = (Stream::new(&d0)?, Stream::new(&d1)?);
    let n = 1 << 22;
    let mut x = DeviceBuffer::<f32>::zeros(n, &s0)?;
    kernels::produce(&mut x, 1, &s0)?;
    let mut y = DeviceBuffer::<f32>::zeros(n, &s1)?;
    y.copy_from(&x, &s1)?;
    kernels::produce(&mut x, 2, &s0)?;
    assert_all_eq("y on GPU 1", &y.to_vec(&s1)?, |i| produced_value(i, 1))?;
    assert_all_eq("x on GPU 0", &x.to_vec(&s0)?, |i| produced_value(i, 2))?;
    // Part of it back, into a view on GPU 0.
    x.slice_mut(..1000)?.copy_from(y.slice(n - 1000..)?, &s0)?;
    let back = x.to_vec(&s0)?;
    assert_all_eq("x's front", &back[..1000], |i| produced_value(n - 1000 + i, 1))?;
    match y.copy_from(x.slice(..10)?, &s1) {
        Err(Error::InvalidArgument(m)) => println!("refused: {m}"),
        other => return Err(format!("a copy of another length gave {other:?}").into()),
    }
    Ok(())
}
