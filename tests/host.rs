//! GPU tests of pinned host memory ([`HostBuffer`]): asynchronous copies to and from the device,
//! and the host's access, which waits for them. The hazard tests fail when tracking is bypassed
//! (`--cfg handoff_bypass_tracking`; `scripts/stage-device.sh` builds that twin): the host's
//! waits go through the tracker too.
//!
//! Reported as ignored where no GPU is usable; see `tests/common/mod.rs`.

mod common;

use std::time::{Duration, Instant};

use common::{Gpus, assert_all_eq};
use handoff::kernels::{self, produced_value};
use handoff::{DeviceBuffer, Error, HostBuffer, Stream};
use libtest_mimic::Failed;

/// Long enough that, without tracking, the host or another stream certainly acts while the
/// copy is still waiting.
const LONG: Duration = Duration::from_millis(300);
const N: usize = 1 << 20;

fn main() {
    let g = Gpus::detect();
    common::run(vec![
        g.trial(
            "hazard_host_read_right_after_a_copy_in_is_queued",
            1,
            host_read_right_after_copy_in,
        ),
        g.trial(
            "hazard_copy_to_host_after_a_late_write_on_another_stream",
            1,
            copy_to_host_after_late_write,
        ),
        g.trial(
            "hazard_host_write_right_after_a_copy_out_is_queued",
            1,
            host_write_right_after_copy_out,
        ),
        g.trial(
            "hazard_copy_into_a_host_buffer_still_copied_out_on_another_stream",
            1,
            copy_in_while_copied_out_on_another_stream,
        ),
        g.trial(
            "hazard_drop_right_after_queued_copies",
            1,
            drop_right_after_queued_copies,
        ),
        g.trial("round_trips_through_views_exact_values", 1, round_trips),
        g.trial(
            "the_cache_reuses_memory_once_its_copies_are_done",
            1,
            cache_reuses_memory_once_its_copies_are_done,
        ),
        g.trial(
            "zero_length_and_mismatched_lengths",
            1,
            zero_length_and_mismatched_lengths,
        ),
    ]);
}

/// `x = produced_value(i, round)`, finished on the GPU before the timed part of a test.
fn produced(s: &Stream, n: usize, round: u32) -> Result<DeviceBuffer<f32>, Failed> {
    let mut x = DeviceBuffer::<f32>::zeros(n, s)?;
    kernels::produce(&mut x, round, s)?;
    s.synchronize()?;
    Ok(x)
}

/// A slow kernel writes y; the copy of y to pinned memory is queued behind it on the same
/// stream (so the stream alone orders the copy after the write), and the host reads at once.
/// `read()` must wait for the copy: otherwise it sees the zeros the buffer started with.
fn host_read_right_after_copy_in() -> Result<(), Failed> {
    let (dev, s, _) = common::gpu0_two_streams()?;
    let x = produced(&s, N, 3)?;
    let mut y = DeviceBuffer::<f32>::zeros(N, &s)?;
    let mut host = HostBuffer::<f32>::zeros(N, &dev)?;
    s.synchronize()?;
    kernels::delayed_copy(&x, &mut y, LONG, &s)?;
    let queued = Instant::now();
    host.copy_from_device(&y, &s)?;
    let returned = queued.elapsed();
    let got = host.read()?;
    println!(
        "copy_from_device returned in {returned:?}; read() after {:?}",
        queued.elapsed()
    );
    assert_all_eq("host after read()", &got, |i| produced_value(i, 3))?;
    if returned >= LONG {
        return Err(format!("copy_from_device blocked for {returned:?}: it must return at once").into());
    }
    Ok(())
}

/// A slow kernel writes y on stream 1; y is copied to pinned memory on stream 2 right after,
/// and the host reads. The copy must wait for the write, and the read for the copy.
fn copy_to_host_after_late_write() -> Result<(), Failed> {
    let (dev, s1, s2) = common::gpu0_two_streams()?;
    let x = produced(&s1, N, 5)?;
    let mut y = DeviceBuffer::<f32>::zeros(N, &s1)?;
    let mut host = HostBuffer::<f32>::zeros(N, &dev)?;
    s1.synchronize()?;
    kernels::delayed_copy(&x, &mut y, LONG, &s1)?;
    host.copy_from_device(&y, &s2)?;
    assert_all_eq("host after read()", &host.read()?, |i| produced_value(i, 5))
}

/// A copy of pinned memory to the device is queued behind a long kernel; the host then
/// overwrites the pinned memory at once. `write()` must wait for the copy: the device gets the
/// old values.
fn host_write_right_after_copy_out() -> Result<(), Failed> {
    let (dev, s, _) = common::gpu0_two_streams()?;
    let old: Vec<f32> = (0..N).map(|i| i as f32).collect();
    let mut host = HostBuffer::from_slice(&old, &dev)?;
    let mut d = DeviceBuffer::<f32>::zeros(N, &s)?;
    s.synchronize()?;
    kernels::busy(LONG, &s)?;
    d.copy_from_host(&host, &s)?;
    let t = Instant::now();
    host.write()?.fill(-1.0);
    println!("write() returned after {:?}", t.elapsed());
    assert_all_eq("device copy", &d.to_vec(&s)?, |i| i as f32)?;
    assert_all_eq("host after the write", &host.read()?, |_| -1.0)
}

/// Pinned memory is copied out to d1 on stream 1 behind a long kernel; then a copy from d2 into
/// the same pinned memory is queued on stream 2. The copy in must wait for the copy out (write
/// after read, across streams): d1 gets the old values, the host the new ones.
fn copy_in_while_copied_out_on_another_stream() -> Result<(), Failed> {
    let (dev, s1, s2) = common::gpu0_two_streams()?;
    let d2 = produced(&s2, N, 9)?;
    let mut host = HostBuffer::from_slice(&(0..N).map(|i| -(i as f32)).collect::<Vec<_>>(), &dev)?;
    let mut d1 = DeviceBuffer::<f32>::zeros(N, &s1)?;
    s1.synchronize()?;
    kernels::busy(LONG, &s1)?;
    d1.copy_from_host(&host, &s1)?;
    host.copy_from_device(&d2, &s2)?;
    assert_all_eq("d1, copied out first", &d1.to_vec(&s1)?, |i| -(i as f32))?;
    assert_all_eq("host, copied in second", &host.read()?, |i| produced_value(i, 9))
}

/// Host buffers dropped right after a copy out of one and into another was queued behind a long
/// kernel. The drop must not block (the memory goes to the device's cache with the copy's
/// event), and no new host buffer may take that memory while the copy still uses it: new
/// buffers of the same size, filled on the host at once, must leave the copy's values intact.
/// `free()` waits for the copies and reports their errors: the stream is idle after it. With
/// tracking bypassed the cache hands the memory out at once and the copy reads the new values.
fn drop_right_after_queued_copies() -> Result<(), Failed> {
    let (dev, s, _) = common::gpu0_two_streams()?;
    // Out of a host buffer, then drop it.
    let host = HostBuffer::from_slice(&(0..N).map(|i| 2.0 * i as f32).collect::<Vec<_>>(), &dev)?;
    let old_addr = host.as_raw_ptr() as usize;
    let mut d = DeviceBuffer::<f32>::zeros(N, &s)?;
    s.synchronize()?;
    kernels::busy(LONG, &s)?;
    d.copy_from_host(&host, &s)?;
    let t = Instant::now();
    drop(host);
    let dropped = t.elapsed();
    // A new buffer may get the memory only once the copy is done, i.e. with the stream idle
    // (nothing else is queued on it). A pool miss allocates with cudaMallocHost, which may wait
    // for the device: a later buffer then rightly reuses the block, the copy being done.
    let mut reused = false;
    let mut others = Vec::new();
    for _ in 0..4 {
        let other = HostBuffer::from_slice(&vec![-1.0f32; N], &dev)?;
        reused |= other.as_raw_ptr() as usize == old_addr && !s.is_idle()?;
        others.push(other);
    }
    println!(
        "drop after a copy out: {dropped:?}; its memory handed out again while the copy was \
         queued: {reused}"
    );
    assert_all_eq("device copy", &d.to_vec(&s)?, |i| 2.0 * i as f32)?;
    if reused {
        return Err("a host buffer's memory was handed out again while a copy out of it was queued".into());
    }
    if dropped >= LONG / 2 {
        return Err(format!("dropping a host buffer blocked for {dropped:?}: it must return at once").into());
    }
    // Into a host buffer, then free() it: it waits, and reports.
    let x = produced(&s, N, 2)?;
    let mut host = HostBuffer::<f32>::zeros(N, &dev)?;
    kernels::busy(LONG, &s)?;
    host.copy_from_device(&x, &s)?;
    let t = Instant::now();
    host.free()?;
    let idle = s.is_idle()?;
    println!(
        "free after a copy in: {:?}, stream idle after: {idle}",
        t.elapsed()
    );
    if !idle {
        return Err("free() returned while a copy into the host buffer was still queued".into());
    }
    s.synchronize()?;
    Ok(())
}

/// A dropped host buffer's memory, once its copies have completed, is what the next buffer of
/// its size class on the device gets: no new pinned allocation. A size class no other test of
/// this binary uses (16 MiB), so that the parallel tests cannot take the block first.
/// `release_cached` is left to `examples/pinned.rs`: here its device-wide wait would stall the
/// other tests' copies, as dropped buffers did before the cache.
fn cache_reuses_memory_once_its_copies_are_done() -> Result<(), Failed> {
    let (dev, s, _) = common::gpu0_two_streams()?;
    let n = (3 << 22) / std::mem::size_of::<f32>(); // 12 MiB: the 16 MiB class
    let x = produced(&s, n, 4)?;
    let mut host = HostBuffer::<f32>::zeros(n, &dev)?;
    host.copy_from_device(&x, &s)?;
    assert_all_eq("host", &host.read()?, |i| produced_value(i, 4))?;
    let addr = host.as_raw_ptr() as usize;
    drop(host);
    // Other tests only add blocks of other classes meanwhile, or take them.
    let cached = handoff::cuda::host::cached_bytes(&dev);
    if cached < 16 << 20 {
        return Err(format!("after dropping a 12 MiB buffer, {cached} bytes are cached").into());
    }
    // Smaller, of the same class: the same block, with the new contents.
    let again = HostBuffer::from_slice(&vec![7u32; n - 5], &dev)?;
    if again.as_raw_ptr() as usize != addr {
        return Err("a buffer of the same size class did not reuse the cached block".into());
    }
    assert_all_eq("reused buffer", &again.read()?, |_| 7)
}

/// Exact values through views in both directions, and through a second pinned buffer.
fn round_trips() -> Result<(), Failed> {
    let (dev, s1, s2) = common::gpu0_two_streams()?;
    let n = 1000;
    let src = HostBuffer::from_slice(&(0..n).map(|i| i as u32 * 7).collect::<Vec<_>>(), &dev)?;
    let mut d = DeviceBuffer::<u32>::zeros(3 * n, &s1)?;
    d.slice_mut(n..2 * n)?.copy_from_host(&src, &s1)?;
    let mut back = HostBuffer::<u32>::zeros(n, &dev)?;
    back.copy_from_device(d.slice(n..2 * n)?, &s2)?;
    assert_all_eq("middle third, back", &back.read()?, |i| i as u32 * 7)?;
    let mut whole = HostBuffer::<u32>::zeros(3 * n, &dev)?;
    whole.copy_from_device(&d, &s2)?;
    {
        let got = whole.read()?;
        assert_all_eq("first third", &got[..n], |_| 0)?;
        assert_all_eq("middle third", &got[n..2 * n], |i| i as u32 * 7)?;
        assert_all_eq("last third", &got[2 * n..], |_| 0)?;
    }
    // The same pinned buffer, rewritten on the host and copied again.
    whole
        .write()?
        .iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = i as u32);
    d.copy_from_host(&whole, &s1)?;
    assert_all_eq("device after the second copy", &d.to_vec(&s2)?, |i| i as u32)
}

fn zero_length_and_mismatched_lengths() -> Result<(), Failed> {
    let (dev, s, _) = common::gpu0_two_streams()?;
    let mut h0 = HostBuffer::<f32>::zeros(0, &dev)?;
    let mut d0 = DeviceBuffer::<f32>::zeros(0, &s)?;
    h0.copy_from_device(&d0, &s)?;
    d0.copy_from_host(&h0, &s)?;
    if !h0.read()?.is_empty() || !h0.write()?.is_empty() {
        return Err("a zero-length host buffer has elements".into());
    }
    h0.free()?;
    let mut h = HostBuffer::<f32>::zeros(10, &dev)?;
    let mut d = DeviceBuffer::<f32>::zeros(11, &s)?;
    match h.copy_from_device(&d, &s) {
        Err(Error::InvalidArgument(m)) => println!("refused: {m}"),
        other => return Err(format!("a copy to the host of another length gave {other:?}").into()),
    }
    match d.copy_from_host(&h, &s) {
        Err(Error::InvalidArgument(m)) => println!("refused: {m}"),
        other => return Err(format!("a copy from the host of another length gave {other:?}").into()),
    }
    // The refused copies touched nothing.
    assert_all_eq("host", &h.read()?, |_| 0.0)?;
    assert_all_eq("device", &d.to_vec(&s)?, |_| 0.0)
}
