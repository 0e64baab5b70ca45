//! GPU tests of the foundation: the article's kernels, and the hazards that use tracking
//! exists to prevent. Each hazard test fails when tracking is bypassed (built with
//! `--cfg handoff_bypass_tracking`; `scripts/stage-device.sh` builds that twin).
//!
//! Reported as ignored where no GPU is usable; see `tests/common/mod.rs`.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Gpus, assert_all_eq};
use handoff::kernels::{self, produced_value};
use handoff::{Device, DeviceBuffer, Error, Event, Graph, HostBuffer, Stream};
use libtest_mimic::Failed;

/// Long enough that, without tracking, the conflicting operation queued after it on another
/// stream certainly runs while it is still waiting.
const LONG: Duration = Duration::from_millis(300);

fn main() {
    let g = Gpus::detect();
    common::run(vec![
        g.trial("a_then_b_on_one_stream_exact_values", 1, a_then_b_on_one_stream),
        g.trial(
            "the_articles_kernels_on_views_of_one_buffer",
            1,
            articles_kernels_on_views,
        ),
        g.trial(
            "hazard_a_write_after_long_read_on_another_stream",
            1,
            hazard_write_after_long_read,
        ),
        g.trial("hazard_b_drop_while_a_kernel_reads", 1, hazard_drop_while_read),
        g.trial(
            "hazard_c_host_copy_right_after_async_write",
            1,
            hazard_host_read_after_async_write,
        ),
        g.trial(
            "hazard_d_copy_from_a_pinned_slice_while_another_thread_captures",
            1,
            hazard_copy_from_pinned_slice_during_captures,
        ),
        g.trial(
            "write_waits_for_reads_on_two_streams",
            1,
            write_waits_for_reads_on_two_streams,
        ),
        g.trial(
            "read_after_write_on_another_stream",
            1,
            read_after_write_on_another_stream,
        ),
        g.trial(
            "stream_dropped_with_pending_work",
            1,
            stream_dropped_with_pending_work,
        ),
        g.trial("events_time_gpu_work", 1, events_time_gpu_work),
        g.trial(
            "blocking_host_copy_on_another_stream_inside_a_capture_is_bounded",
            1,
            blocking_copy_inside_a_capture,
        ),
        g.trial(
            "zero_length_and_mismatched_lengths",
            1,
            zero_length_and_mismatched_lengths,
        ),
        g.trial(
            "buffer_of_another_device_is_rejected",
            2,
            buffer_of_another_device_is_rejected,
        ),
        g.trial(
            "async_waits_many_futures_on_threads",
            1,
            async_waits_many_futures_on_threads,
        ),
    ]);
}

/// Event, stream and host-read futures, 8 threads of 96 each, behind 200 ms of GPU work: none
/// resolves before it, all resolve after it with the data, none blocks its thread between
/// polls (each thread parks until woken), and a timeout set shorter than the work ends its
/// future with `Error::Timeout`.
fn async_waits_many_futures_on_threads() -> Result<(), Failed> {
    let (dev, s, _) = common::gpu0_two_streams()?;
    kernels::busy(Duration::ZERO, &s)?;
    s.synchronize()?;
    let n = 1 << 20;
    let mut y = DeviceBuffer::<f32>::zeros(n, &s)?;
    let started = Instant::now();
    kernels::busy(Duration::from_millis(200), &s)?;
    kernels::produce(&mut y, 7, &s)?;
    let mut host = HostBuffer::<f32>::zeros(n, &dev)?;
    host.copy_from_device(&y, &s)?;
    let event = Event::without_timing(&dev)?;
    s.record(&event)?;
    let (host, s, event) = (&host, &s, &event);
    let results = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..8)
            .map(|_| {
                scope.spawn(move || -> Result<(usize, Duration), Failed> {
                    let mut futures: Vec<common::BoxFuture<'_, Result<usize, Error>>> = Vec::new();
                    for i in 0..96 {
                        futures.push(match i % 3 {
                            0 => Box::pin(async move { event.completed().await.map(|()| 0) }),
                            1 => Box::pin(async move { s.completion().await.map(|()| 0) }),
                            _ => Box::pin(async move {
                                let data = host.read_async().await?;
                                Ok((0..data.len())
                                    .step_by(4099)
                                    .filter(|&i| data[i] != produced_value(i, 7))
                                    .count())
                            }),
                        });
                    }
                    let outs = common::block_on(common::join_all(futures), Duration::from_secs(20))?;
                    let at = started.elapsed();
                    let mut wrong = 0;
                    for o in outs {
                        wrong += o?;
                    }
                    Ok((wrong, at))
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|_| Err("a waiter panicked".into())))
            .collect::<Vec<_>>()
    });
    for r in results {
        let (wrong, at) = r?;
        if wrong > 0 {
            return Err(format!("{wrong} wrong values read after the futures resolved").into());
        }
        if at < Duration::from_millis(190) {
            return Err(format!("futures resolved after {at:?}, before the 200 ms of work").into());
        }
    }
    println!("768 futures on 8 threads resolved after {:?}", started.elapsed());
    kernels::busy(Duration::from_millis(300), s)?;
    let out = common::block_on(
        s.completion().with_timeout(Duration::from_millis(20)),
        Duration::from_secs(5),
    )?;
    if !matches!(out, Err(Error::Timeout { .. })) {
        return Err(format!("a 20 ms timeout behind 300 ms of work gave {out:?}").into());
    }
    common::block_on(s.completion(), Duration::from_secs(5))??;
    Ok(())
}

fn produced(stream: &Stream, n: usize, round: u32) -> Result<DeviceBuffer<f32>, Failed> {
    let mut x = DeviceBuffer::zeros(n, stream)?;
    kernels::produce(&mut x, round, stream)?;
    Ok(x)
}

fn a_then_b_on_one_stream() -> Result<(), Failed> {
    let (dev, s, _) = common::gpu0_two_streams()?;
    println!("device 0: {}", dev.name()?);
    // The article's values first.
    let x = produced(&s, 4, 0)?;
    let mut y = DeviceBuffer::zeros(4, &s)?;
    kernels::twice(&x, &mut y, &s)?;
    let got = y.to_vec(&s)?;
    if got != [2.0, 4.0, 6.0, 8.0] {
        return Err(format!("y = {got:?}, want [2, 4, 6, 8]").into());
    }
    for (n, round) in [
        (1, 3),
        (1000, 1),
        (1 << 20, 7),
        ((1 << 24) + 3, 2),
        (50_000_000, 11),
    ] {
        let x = produced(&s, n, round)?;
        let mut y = DeviceBuffer::zeros(n, &s)?;
        kernels::twice(&x, &mut y, &s)?;
        assert_all_eq(&format!("y for n={n}"), &y.to_vec(&s)?, |i| {
            2.0 * produced_value(i, round)
        })?;
        assert_all_eq(&format!("x for n={n}"), &x.to_vec(&s)?, |i| {
            produced_value(i, round)
        })?;
    }
    Ok(())
}

/// The article's kernels on the two halves of one buffer (`split_at_mut`) and on a slice of
/// another: each writes its own elements, at its view's offset, and no others.
fn articles_kernels_on_views() -> Result<(), Failed> {
    let (_dev, s, _) = common::gpu0_two_streams()?;
    // Halves of an odd length, so that an offset taken in bytes or blocks instead of elements
    // shows.
    let n = 1003;
    let mut whole = DeviceBuffer::<f32>::zeros(2 * n, &s)?;
    {
        let (mut a, mut b) = whole.split_at_mut(n)?;
        kernels::produce(&mut b, 5, &s)?;
        kernels::produce(&mut a, 3, &s)?;
    }
    assert_all_eq("both halves produced", &whole.to_vec(&s)?, |i| {
        if i < n {
            produced_value(i, 3)
        } else {
            produced_value(i - n, 5)
        }
    })?;
    {
        let (a, mut b) = whole.split_at_mut(n)?;
        kernels::twice(&a, &mut b, &s)?;
    }
    assert_all_eq("b = 2a", &whole.to_vec(&s)?, |i| {
        if i < n {
            produced_value(i, 3)
        } else {
            2.0 * produced_value(i - n, 3)
        }
    })?;
    {
        let (mut a, b) = whole.split_at_mut(n)?;
        kernels::delayed_copy(&b, &mut a, Duration::from_millis(1), &s)?;
    }
    assert_all_eq("a = b", &whole.to_vec(&s)?, |i| 2.0 * produced_value(i % n, 3))?;
    // A slice that starts inside a buffer, read from another buffer's view.
    let x = produced(&s, n, 9)?;
    let mut y = DeviceBuffer::<f32>::zeros(n + 7, &s)?;
    kernels::twice(x.view(), y.slice_mut(7..)?, &s)?;
    assert_all_eq("y[7..] = 2x", &y.to_vec(&s)?, |i| {
        if i < 7 {
            0.0
        } else {
            2.0 * produced_value(i - 7, 9)
        }
    })
}

/// (a) A long read on stream 1, then a write on stream 2: the reader must see the old values.
fn hazard_write_after_long_read() -> Result<(), Failed> {
    let (_dev, s1, s2) = common::gpu0_two_streams()?;
    let n = 1 << 16;
    let mut x = produced(&s1, n, 0)?;
    let mut out = DeviceBuffer::zeros(n, &s1)?;
    kernels::delayed_copy(&x, &mut out, LONG, &s1)?;
    kernels::produce(&mut x, 1, &s2)?;
    assert_all_eq("reader's copy", &out.to_vec(&s1)?, |i| produced_value(i, 0))?;
    assert_all_eq("x after the write", &x.to_vec(&s2)?, |i| produced_value(i, 1))
}

/// (b) A buffer dropped while a long kernel reads it, then new allocations filled with other
/// values: the kernel's output must be unaffected.
fn hazard_drop_while_read() -> Result<(), Failed> {
    let (_dev, s1, s2) = common::gpu0_two_streams()?;
    let n = 1 << 16;
    let x = produced(&s1, n, 0)?;
    s1.synchronize()?;
    let old_addr = x.as_raw_ptr() as usize;
    let mut out = DeviceBuffer::zeros(n, &s1)?;
    kernels::delayed_copy(&x, &mut out, LONG, &s1)?;
    drop(x);
    // Let the (correctly or wrongly ordered) free be seen as done, so the pool may hand the
    // memory out again at once.
    std::thread::sleep(Duration::from_millis(5));
    let mut others = Vec::new();
    let mut reused = false;
    for k in 0..8 {
        let mut b = DeviceBuffer::<f32>::zeros(n, &s2)?;
        reused |= b.as_raw_ptr() as usize == old_addr;
        kernels::produce(&mut b, 1000 + k, &s2)?;
        others.push(b);
    }
    println!("freed memory handed out again while the reader waited: {reused}");
    assert_all_eq("reader's copy", &out.to_vec(&s1)?, |i| produced_value(i, 0))?;
    for (k, b) in others.iter().enumerate() {
        assert_all_eq("new buffer", &b.to_vec(&s2)?, |i| {
            produced_value(i, 1000 + k as u32)
        })?;
    }
    Ok(())
}

/// (c) A host copy right after an asynchronous write, on another stream, returns the new values.
fn hazard_host_read_after_async_write() -> Result<(), Failed> {
    let (_dev, s1, s2) = common::gpu0_two_streams()?;
    let n = 1 << 16;
    let mut x = produced(&s1, n, 0)?;
    s1.synchronize()?;
    kernels::busy(LONG, &s1)?;
    kernels::produce(&mut x, 5, &s1)?;
    assert_all_eq("host copy", &x.to_vec(&s2)?, |i| produced_value(i, 5))
}

/// (d) One thread queues a kernel and then a blocking copy from pinned host memory (a
/// `HostBuffer`'s contents, which the copy engine reads directly) on stream s, and overwrites
/// the host memory as soon as the copy returns, whatever it returned; another thread begins and
/// ends graph captures on s all the while. A copy that returns while the DMA may still read the
/// source (a wait that a capture begun in between cuts short) lets the overwrite reach the
/// device. The device must only ever hold a value the copy returned `Ok` for, or the one before
/// a copy refused outright.
fn hazard_copy_from_pinned_slice_during_captures() -> Result<(), Failed> {
    const ROUNDS: usize = 400;
    const OVERWRITE: f32 = -1.0;
    let (dev, s, s2) = common::gpu0_two_streams()?;
    let n = 1 << 16;
    let mut x = DeviceBuffer::<f32>::zeros(n, &s)?;
    let mut host = HostBuffer::<f32>::zeros(n, &dev)?;
    // Loaded before the threads start: a first launch must not wait for the other thread.
    kernels::busy(Duration::ZERO, &s)?;
    s.synchronize()?;
    let stop = AtomicBool::new(false);
    let captures = AtomicUsize::new(0);
    std::thread::scope(|t| {
        let capturer = t.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                if Graph::capture(&s, |_| Ok(())).is_ok() {
                    captures.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        let mut copier = || -> Result<[usize; 3], Failed> {
            let (mut copied, mut refused, mut failed) = (0, 0, 0);
            let mut want = 0.0f32;
            for round in 0..ROUNDS {
                let value = round as f32 + 1.0;
                host.write()?.fill(value);
                // The copy queues behind this kernel, so the DMA is still pending when the copy
                // would return early. Refused while a capture is under way: try again.
                while let Err(e) = kernels::busy(Duration::from_millis(5), &s) {
                    if !matches!(e, Error::Capture { .. }) {
                        return Err(e.into());
                    }
                }
                let r = {
                    let src = host.read()?;
                    x.copy_from_slice(&src, &s)
                };
                // At once, as a caller may once the copy has returned.
                host.write()?.fill(OVERWRITE);
                match &r {
                    Ok(()) => {
                        copied += 1;
                        want = value;
                    }
                    // Refused under the stream's order: nothing was queued.
                    Err(Error::Capture { .. }) => refused += 1,
                    Err(e) => {
                        failed += 1;
                        println!("round {round}: copy_from_slice failed: {e}");
                    }
                }
                let got = x.to_vec(&s2)?;
                if got.contains(&OVERWRITE) {
                    return Err(format!(
                        "round {round}: the device holds the host's overwrite, made after \
                         copy_from_slice returned ({r:?}): the copy read the source late"
                    )
                    .into());
                }
                if failed == 0 {
                    assert_all_eq(&format!("x after round {round}"), &got, |_| want)?;
                }
            }
            Ok([copied, refused, failed])
        };
        let counts = copier();
        stop.store(true, Ordering::Relaxed);
        capturer.join().map_err(|_| "the capturing thread panicked")?;
        let [copied, refused, failed] = counts?;
        let captures = captures.load(Ordering::Relaxed);
        println!(
            "{copied} copies, {refused} refused during a capture, {failed} failed; {captures} \
             captures meanwhile"
        );
        if captures == 0 || copied == 0 {
            return Err("the copies and the captures did not interleave: nothing was tested".into());
        }
        if failed > 0 {
            return Err(format!(
                "{failed} copies failed with an error other than a refusal (a wait cut short by \
                 a capture begun after the copy was queued)"
            )
            .into());
        }
        Ok(())
    })
}

/// Reads on two streams, then a write on a third: the write must wait for both reads (cudarc
/// keeps only the latest read and would wait for the shorter one here).
fn write_waits_for_reads_on_two_streams() -> Result<(), Failed> {
    let (dev, s1, s2) = common::gpu0_two_streams()?;
    let s3 = Stream::new(&dev)?;
    let n = 1 << 16;
    let mut x = produced(&s1, n, 0)?;
    let mut out1 = DeviceBuffer::zeros(n, &s1)?;
    let mut out2 = DeviceBuffer::zeros(n, &s2)?;
    kernels::delayed_copy(&x, &mut out1, LONG, &s1)?;
    kernels::delayed_copy(&x, &mut out2, LONG / 10, &s2)?;
    kernels::produce(&mut x, 9, &s3)?;
    assert_all_eq("first reader", &out1.to_vec(&s1)?, |i| produced_value(i, 0))?;
    assert_all_eq("second reader", &out2.to_vec(&s2)?, |i| produced_value(i, 0))?;
    assert_all_eq("x", &x.to_vec(&s3)?, |i| produced_value(i, 9))
}

/// A late write on stream 1, then B on stream 2: B must read the new x.
fn read_after_write_on_another_stream() -> Result<(), Failed> {
    let (_dev, s1, s2) = common::gpu0_two_streams()?;
    let n = 1 << 16;
    let mut x = produced(&s1, n, 0)?;
    s1.synchronize()?;
    let mut y = DeviceBuffer::zeros(n, &s2)?;
    kernels::busy(LONG, &s1)?;
    kernels::produce(&mut x, 3, &s1)?;
    kernels::twice(&x, &mut y, &s2)?;
    assert_all_eq("y", &y.to_vec(&s2)?, |i| 2.0 * produced_value(i, 3))
}

/// Dropping a stream with queued work neither blocks nor loses the ordering it owes.
fn stream_dropped_with_pending_work() -> Result<(), Failed> {
    let (dev, s1, _) = common::gpu0_two_streams()?;
    let n = 1 << 16;
    let mut x = produced(&s1, n, 0)?;
    {
        let tmp = Stream::new(&dev)?;
        kernels::busy(LONG, &tmp)?;
        kernels::produce(&mut x, 2, &tmp)?;
        let t = Instant::now();
        drop(tmp);
        if t.elapsed() > LONG / 2 {
            return Err(format!("dropping a busy stream blocked for {:?}", t.elapsed()).into());
        }
    }
    assert_all_eq("x", &x.to_vec(&s1)?, |i| produced_value(i, 2))
}

fn events_time_gpu_work() -> Result<(), Failed> {
    let (dev, s, _) = common::gpu0_two_streams()?;
    // The first launch in a process loads the kernels (JIT from PTX): keep it out of the timing.
    kernels::busy(Duration::ZERO, &s)?;
    s.synchronize()?;
    let (start, end) = (Event::new(&dev)?, Event::new(&dev)?);
    let host = Instant::now();
    s.record(&start)?;
    kernels::busy(Duration::from_millis(50), &s)?;
    s.record(&end)?;
    end.synchronize()?;
    let host_ms = host.elapsed().as_secs_f64() * 1e3;
    let ms = f64::from(start.elapsed_ms(&end)?);
    println!("50 ms of busy work timed at {ms:.2} ms (host saw {host_ms:.2} ms)");
    // At least the kernel's 50 ms; at most what the host saw between queueing the first event
    // and the second one completing. Not a fixed ceiling: the other tests of this binary run at
    // the same time, and their kernels can hold the GPU's multiprocessors and start busy late.
    if !(45.0..=host_ms + 1.0).contains(&ms) {
        return Err(format!("busy(50 ms) timed at {ms} ms; the host saw {host_ms} ms").into());
    }
    let untimed = Event::without_timing(&dev)?;
    s.record(&untimed)?;
    untimed.synchronize()?;
    assert!(untimed.is_complete()?);
    match start.elapsed_ms(&untimed) {
        Err(Error::InvalidArgument(_)) => Ok(()),
        other => Err(format!("timing with an untimed event gave {other:?}").into()),
    }
}

fn zero_length_and_mismatched_lengths() -> Result<(), Failed> {
    let (_dev, s, _) = common::gpu0_two_streams()?;
    let mut empty = DeviceBuffer::<f32>::zeros(0, &s)?;
    kernels::produce(&mut empty, 1, &s)?;
    if !empty.to_vec(&s)?.is_empty() || !empty.is_empty() {
        return Err("an empty buffer is not empty".into());
    }
    let x = produced(&s, 8, 0)?;
    let mut y = DeviceBuffer::zeros(7, &s)?;
    match kernels::twice(&x, &mut y, &s) {
        Err(Error::InvalidArgument(m)) => println!("rejected: {m}"),
        other => return Err(format!("twice with lengths 8 and 7 gave {other:?}").into()),
    }
    let mut z = DeviceBuffer::<u32>::from_slice(&[1, 2, 3], &s)?;
    match z.copy_from_slice(&[1, 2], &s) {
        Err(Error::InvalidArgument(_)) => {}
        other => return Err(format!("copy of 2 into 3 gave {other:?}").into()),
    }
    if z.to_vec(&s)? != [1, 2, 3] {
        return Err("a rejected copy changed the buffer".into());
    }
    // The explicit free reports errors that Drop would swallow.
    z.free()?;
    empty.free()?;
    Ok(())
}

fn buffer_of_another_device_is_rejected() -> Result<(), Failed> {
    let (d0, d1) = (Device::new(0)?, Device::new(1)?);
    let (s0, s1) = (Stream::new(&d0)?, Stream::new(&d1)?);
    let mut x = produced(&s0, 16, 0)?;
    match kernels::produce(&mut x, 1, &s1) {
        Err(Error::InvalidArgument(m)) => println!("rejected: {m}"),
        other => return Err(format!("a device-0 buffer on a device-1 stream gave {other:?}").into()),
    }
    assert_all_eq("x", &x.to_vec(&s0)?, |i| produced_value(i, 0))
}

/// A blocking host copy on another stream, made by the thread that is capturing a graph
/// (thread-local capture mode): either it runs and returns the right values, or it is a typed
/// error at once; never a wait of a minute that ends the process (the copy's wait gives up on
/// CUDA errors that persist). Run in a child thread, bounded at 10 s.
fn blocking_copy_inside_a_capture() -> Result<(), Failed> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = (|| -> Result<String, String> {
            let e = |e: Error| e.to_string();
            let dev = Device::new(0).map_err(e)?;
            let (s, other) = (Stream::new(&dev).map_err(e)?, Stream::new(&dev).map_err(e)?);
            let y = DeviceBuffer::from_slice(&[3.0f32; 1024], &other).map_err(e)?;
            other.synchronize().map_err(e)?;
            let mut seen = None;
            let captured = Graph::capture(&s, |_| {
                seen = Some(y.to_vec(&other));
                Ok(())
            });
            let seen = seen.ok_or("the capture's body did not run")?;
            let what = match &seen {
                Ok(v) => format!("{} values", v.len()),
                Err(err) => err.to_string(),
            };
            Ok(format!(
                "to_vec inside the capture: {what}; the capture: {}",
                match &captured {
                    Ok(_) => "made".to_string(),
                    Err(err) => err.to_string(),
                }
            ))
            .and_then(|m| match seen {
                Ok(v) if v.iter().all(|&x| x == 3.0) => Ok(m),
                Ok(_) => Err(format!("wrong values: {m}")),
                Err(_) => Ok(m),
            })
        })();
        let _ = tx.send(r);
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(Ok(m)) => {
            println!("{m}");
            Ok(())
        }
        Ok(Err(m)) => Err(m.into()),
        Err(_) => Err("a blocking host copy inside a capture did not return within 10 s".into()),
    }
}
