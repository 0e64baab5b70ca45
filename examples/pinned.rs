//! Pinned host memory on GPU 0: first the article's last step, y to the host, queued without
//! blocking (`HostBuffer::copy_from_device`, then `read()` where the host needs it); then
//! device-to-host copies of 4 B, 1 MiB and 256 MiB timed into pinned memory (`copy_from_device` +
//! `read()`) against pageable memory (`View::to_vec`, which allocates a `Vec` and blocks), host
//! wall time from the call to the data in hand, median of several repetitions; last, the
//! pinned memory the dropped buffers left in handoff's cache, given back to the system.
//!
//! Run: `cargo run --release --example pinned` (on a machine with a GPU; see README).

use std::time::{Duration, Instant};

use handoff::kernels::{self, produced_value};
use handoff::{Device, DeviceBuffer, HostBuffer, Stream};

fn main() {
    if let Err(e) = run() {
        eprintln!("pinned: {e}");
        std::process::exit(1);
    }
}

fn run() -> handoff::Result<()> {
    let count = Device::count()?;
    if count == 0 {
        return Err(handoff::Error::NoDevice {
            reason: "the CUDA runtime reports 0 devices".into(),
        });
    }
    let dev = Device::new(0)?;
    println!("GPU 0: {} ({count} visible)", dev.name()?);
    let stream = Stream::new(&dev)?;
    article_last_step(&dev, &stream)?;
    measure(&dev, &stream)?;
    release(&dev, &stream)
}

/// Dropped host buffers leave their pinned memory cached for the next ones (freeing it would
/// synchronise the device); once the GPU work is done, it is given back.
fn release(dev: &Device, stream: &Stream) -> handoff::Result<()> {
    let cached = handoff::cuda::host::cached_bytes(dev);
    stream.synchronize()?;
    let freed = handoff::cuda::host::release_cached(dev)?;
    println!();
    println!("pinned memory cached by dropped buffers: {cached} bytes; released: {freed} bytes");
    if freed < 256 << 20 || handoff::cuda::host::cached_bytes(dev) != 0 {
        return Err(handoff::Error::InvalidArgument(format!(
            "released {freed} bytes, {} still cached: the 256 MiB buffer should have been",
            handoff::cuda::host::cached_bytes(dev)
        )));
    }
    Ok(())
}

/// Kernel A writes x, kernel B computes y = 2x, and y goes to the host, all queued at once; the
/// host blocks only in `read()`, when it needs y.
fn article_last_step(dev: &Device, stream: &Stream) -> handoff::Result<()> {
    let n = 4;
    let mut x = DeviceBuffer::<f32>::zeros(n, stream)?;
    let mut y = DeviceBuffer::<f32>::zeros(n, stream)?;
    let mut y_host = HostBuffer::<f32>::zeros(n, dev)?; // allocated once, reused every round
    for round in 0..4 {
        let t = Instant::now();
        kernels::produce(&mut x, round, stream)?; // A
        kernels::twice(&x, &mut y, stream)?; // B
        y_host.copy_from_device(&y, stream)?; // returns at once
        let queued = t.elapsed();
        // ... the host is free here ...
        let got = y_host.read()?; // waits for the copy (which waited for B)
        let want: Vec<f32> = (0..n).map(|i| 2.0 * produced_value(i, round)).collect();
        println!(
            "round {round}: y = 2x = {:?} (A, B and the copy queued in {:.1} µs; y in hand after {:.1} µs)",
            &*got,
            micros(queued),
            micros(t.elapsed())
        );
        if *got != *want {
            return Err(handoff::Error::InvalidArgument(format!(
                "y = {:?}, want {want:?}",
                &*got
            )));
        }
    }
    Ok(())
}

fn measure(dev: &Device, stream: &Stream) -> handoff::Result<()> {
    println!();
    println!(
        "{:>8}  {:>10}  {:>12}  {:>11}  {:>13}",
        "size", "pinned µs", "pageable µs", "pinned GB/s", "pageable GB/s"
    );
    for (label, bytes, reps) in [
        ("4 B", 4, 201),
        ("1 MiB", 1 << 20, 101),
        ("256 MiB", 256 << 20, 11),
    ] {
        let n = bytes / std::mem::size_of::<f32>();
        let mut x = DeviceBuffer::<f32>::zeros(n, stream)?;
        kernels::produce(&mut x, 7, stream)?;
        stream.synchronize()?;
        let mut host = HostBuffer::<f32>::zeros(n, dev)?;
        // Warm-up, and a check of both paths' values.
        host.copy_from_device(&x, stream)?;
        let pageable = x.to_vec(stream)?;
        let want = |i: usize| produced_value(i, 7);
        if host.read()?.iter().enumerate().any(|(i, v)| *v != want(i))
            || pageable.iter().enumerate().any(|(i, v)| *v != want(i))
        {
            return Err(handoff::Error::InvalidArgument(format!(
                "{label}: wrong values copied"
            )));
        }
        let (mut pinned_t, mut pageable_t) = (Vec::new(), Vec::new());
        // Alternated, so that both see the same conditions.
        for _ in 0..reps {
            let t = Instant::now();
            host.copy_from_device(&x, stream)?;
            let last = host.read()?[n - 1];
            pinned_t.push(t.elapsed());
            let t = Instant::now();
            let v = x.to_vec(stream)?;
            pageable_t.push(t.elapsed());
            assert_eq!(last, v[n - 1]);
        }
        let (p, q) = (median(&mut pinned_t), median(&mut pageable_t));
        println!(
            "{label:>8}  {:>10.1}  {:>12.1}  {:>11.2}  {:>13.2}",
            micros(p),
            micros(q),
            gbps(bytes, p),
            gbps(bytes, q)
        );
    }
    Ok(())
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}
