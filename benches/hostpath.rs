//! Host time per tracked operation, beside the raw calls that do the same work, on one GPU:
//! where the safe path's host overhead goes.
//!
//! `cargo bench --bench hostpath -- [--calls N]`
//!
//! Each line is the median over batches of 100 calls of one kind (the stream synchronized
//! between batches, outside the timing), in ns per call: a verified and an unverified
//! send+receive group to oneself, an in-place broadcast over one rank (NCCL does nothing for it,
//! so it isolates handoff's own cost per collective), `kernels::produce`, a graph of one kernel
//! launched, each beside the raw calls of the same work with and without the one
//! `cudaEventRecord` tracking adds (for the graph: also a raw graph ending in an event record
//! node, the way handoff's replays record theirs). Then the unverified group and the raw one,
//! with and without its record, GPU-inclusive: batches timed by events on the stream.
//!
//! Run against the stub libraries of `tests/stubs` (`HANDOFF_CUDART_PATH`, `HANDOFF_NCCL_PATH`:
//! calls that return at once), the handoff lines are handoff's own CPU work and the raw lines
//! nearly nothing; against the real libraries, the whole host cost.

use std::time::Instant;

use clap::Parser;
use handoff::result::cudart as rt;
use handoff::result::nccl as raw;
use handoff::sys::nccl::ncclDataType_t;
use handoff::{CommOptions, Communicator, Device, DeviceBuffer, NcclType, Stream, group, kernels};

#[derive(Parser)]
struct Opts {
    /// Calls of each kind (in batches of 100).
    #[arg(long, default_value_t = 20_000)]
    calls: u32,
    /// Ignored (cargo bench passes it).
    #[arg(long, hide = true)]
    bench: bool,
}

const BATCH: u32 = 100;

fn time(calls: u32, s: &Stream, mut f: impl FnMut(u32) -> handoff::Result<()>) -> handoff::Result<f64> {
    let mut per_call = Vec::new();
    let mut i = 0;
    for _ in 0..calls.div_ceil(BATCH) {
        let t = Instant::now();
        for _ in 0..BATCH {
            f(i)?;
            i += 1;
        }
        per_call.push(t.elapsed().as_nanos() as f64 / f64::from(BATCH));
        s.synchronize()?;
    }
    per_call.sort_by(f64::total_cmp);
    Ok(per_call[per_call.len() / 2])
}

fn main() -> handoff::Result<()> {
    let o = Opts::parse();
    let dev = Device::new(0)?;
    let comm = &Communicator::init_all(std::slice::from_ref(&dev))?[0];
    // SAFETY: one rank, whose send and receive are in one group: they match.
    let options = unsafe { CommOptions::default().unverified() };
    let ucomm = &Communicator::init_all_with(options, std::slice::from_ref(&dev))?[0];
    let s = Stream::new(&dev)?;
    let x = DeviceBuffer::from_slice(&[1.0f32], &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(1, &s)?;
    let mut k = DeviceBuffer::<f32>::zeros(4, &s)?;
    let dt: ncclDataType_t = f32::DATATYPE;
    dev.set_current()?;
    let ev = rt::event_create(false)?;
    let module = handoff::Module::from_ptx(include_str!("../src/sys/generated/article.ptx"))?;
    let kernel = module.function("handoff_produce")?;
    kernel.load_on(&dev)?;
    let (mut ptr, mut n, mut round) = (k.as_raw_mut_ptr() as u64, k.len() as u64, 0u32);
    let mut args = [
        (&raw mut ptr).cast::<std::ffi::c_void>(),
        (&raw mut n).cast(),
        (&raw mut round).cast(),
    ];
    let rs = s.as_raw();
    let (xp, yp) = (x.as_raw_ptr().cast(), y.as_raw_mut_ptr().cast());
    let rc = comm.as_raw();
    // SAFETY (every raw call below): the buffers are live and of the stream's device, one
    // element each (four for the kernel); the raw and tracked calls share one stream, whose
    // order keeps them apart; each raw group is closed in the same call; `ev` is of the
    // stream's device; handoff_produce(float* x, u64 n, u32 round) writes x[0..n] only.
    let raw_group = || unsafe {
        raw::group_start()?;
        raw::check("ncclSend", raw::send(xp, 1, dt, 0, rc, rs)?)?;
        raw::check("ncclRecv", raw::recv(yp, 1, dt, 0, rc, rs)?)?;
        raw::group_end().map(drop)
    };
    // Graphs of one kernel (`produce` on `k`, launched on `s`): handoff's, and raw ones captured
    // on a raw stream of their own: the kernel alone, and the kernel followed by an event record
    // node (what handoff's replays record their tracking event with).
    let mut k2 = DeviceBuffer::<f32>::zeros(4, &s)?;
    let graph = handoff::Graph::capture(&s, |s| kernels::produce(&mut k2, 1, s))?;
    let gev = rt::event_create(false)?;
    let gs = rt::stream_create_non_blocking()?;
    // SAFETY: `gs` is a raw stream of this device, captured here only, by this thread; the
    // captured launch is as the raw launches' below (`args` stays alive and is copied at
    // capture), the node records `gev`, of this device.
    let mut capture_raw = |with_record: bool| unsafe {
        rt::stream_begin_capture(gs)?;
        let launched = rt::launch_kernel(kernel.as_raw(), (1, 1, 1), (256, 1, 1), 0, &mut args, gs);
        let recorded = if with_record {
            rt::event_record_external(gev, gs)
        } else {
            Ok(())
        };
        let g = rt::stream_end_capture(gs)?;
        launched?;
        recorded?;
        let exec = rt::graph_instantiate(g);
        rt::graph_destroy(g)?;
        exec
    };
    let raw_graph = capture_raw(false)?;
    let raw_graph_node = capture_raw(true)?;
    let calls = o.calls;
    let mut rows: Vec<(&str, f64)> = Vec::new();
    // Twice: the first pass warms the pools, the second is reported.
    for _ in 0..2 {
        rows.clear();
        let mut row = |name, ns| rows.push((name, ns));
        row(
            "verified send+receive group",
            time(calls, &s, |_| {
                group(|g| {
                    g.send(comm, &x, 0, &s)?;
                    g.recv(comm, &mut y, 0, &s)
                })
            })?,
        );
        row(
            "unverified send+receive group",
            time(calls, &s, |_| {
                group(|g| {
                    g.send(ucomm, &x, 0, &s)?;
                    g.recv(ucomm, &mut y, 0, &s)
                })
            })?,
        );
        row("raw send+receive group", time(calls, &s, |_| raw_group())?);
        row(
            "raw group + cudaEventRecord",
            time(calls, &s, |_| {
                raw_group()?;
                // SAFETY: as above.
                unsafe { rt::event_record(ev, rs) }
            })?,
        );
        row(
            "verified broadcast in place",
            time(calls, &s, |_| comm.broadcast(&mut y, 0, &s))?,
        );
        row(
            "unverified broadcast in place",
            time(calls, &s, |_| ucomm.broadcast(&mut y, 0, &s))?,
        );
        // SAFETY: as above.
        row(
            "raw broadcast in place",
            time(calls, &s, |_| unsafe {
                raw::check("ncclBroadcast", raw::broadcast(yp, yp, 1, dt, 0, rc, rs)?)
            })?,
        );
        // SAFETY: as above.
        row(
            "raw broadcast + cudaEventRecord",
            time(calls, &s, |_| unsafe {
                raw::check("ncclBroadcast", raw::broadcast(yp, yp, 1, dt, 0, rc, rs)?)?;
                rt::event_record(ev, rs)
            })?,
        );
        row(
            "kernels::produce",
            time(calls, &s, |i| kernels::produce(&mut k, i, &s))?,
        );
        // SAFETY: as above.
        row(
            "raw cudaLaunchKernel",
            time(calls, &s, |_| unsafe {
                rt::launch_kernel(kernel.as_raw(), (1, 1, 1), (256, 1, 1), 0, &mut args, rs)
            })?,
        );
        // SAFETY: as above.
        row(
            "raw launch + cudaEventRecord",
            time(calls, &s, |_| unsafe {
                rt::launch_kernel(kernel.as_raw(), (1, 1, 1), (256, 1, 1), 0, &mut args, rs)?;
                rt::event_record(ev, rs)
            })?,
        );
        row(
            "handoff graph launch (one kernel)",
            time(calls, &s, |_| graph.launch(&s))?,
        );
        // SAFETY: the raw graphs are live executables of this device, writing `k` (as the raw
        // launches above, ordered with them on `s`); `gev` is of this device.
        row(
            "raw cudaGraphLaunch (one kernel)",
            time(calls, &s, |_| unsafe { rt::graph_launch(raw_graph, rs) })?,
        );
        // SAFETY: as above.
        row(
            "raw graph launch + cudaEventRecord",
            time(calls, &s, |_| unsafe {
                rt::graph_launch(raw_graph, rs)?;
                rt::event_record(gev, rs)
            })?,
        );
        // SAFETY: as above.
        row(
            "raw graph with an event record node",
            time(calls, &s, |_| unsafe { rt::graph_launch(raw_graph_node, rs) })?,
        );
        // SAFETY: as above.
        row(
            "cudaEventRecord",
            time(calls, &s, |_| unsafe { rt::event_record(ev, rs) })?,
        );
    }
    s.synchronize()?;
    println!("# host time per call, ns (median of batches of {BATCH}, {calls} calls of each):");
    for (name, ns) in &rows {
        println!("{name:>34} {ns:>8.0}");
    }
    // GPU-inclusive: batches timed by events on the stream, so that a gap the GPU sees between
    // two groups (a tracking event recorded between them) counts, beside the raw groups with
    // and without that record.
    let (start, end) = (handoff::Event::new(&dev)?, handoff::Event::new(&dev)?);
    let gpu_time = |f: &mut dyn FnMut() -> handoff::Result<()>| -> handoff::Result<f64> {
        let mut per_call = Vec::new();
        for _ in 0..calls.div_ceil(BATCH) {
            s.record(&start)?;
            for _ in 0..BATCH {
                f()?;
            }
            s.record(&end)?;
            end.synchronize()?;
            per_call.push(f64::from(start.elapsed_ms(&end)?) * 1e6 / f64::from(BATCH));
        }
        per_call.sort_by(f64::total_cmp);
        Ok(per_call[per_call.len() / 2])
    };
    let mut gpu_rows: Vec<(&str, f64)> = Vec::new();
    for _ in 0..2 {
        gpu_rows.clear();
        gpu_rows.push((
            "unverified send+receive group",
            gpu_time(&mut || {
                group(|g| {
                    g.send(ucomm, &x, 0, &s)?;
                    g.recv(ucomm, &mut y, 0, &s)
                })
            })?,
        ));
        gpu_rows.push(("raw send+receive group", gpu_time(&mut || raw_group())?));
        gpu_rows.push((
            "raw group + cudaEventRecord",
            gpu_time(&mut || {
                raw_group()?;
                // SAFETY: as above.
                unsafe { rt::event_record(ev, rs) }
            })?,
        ));
    }
    println!("# GPU-inclusive time per call, ns (batches of {BATCH} timed by events on the stream, median):");
    for (name, ns) in &gpu_rows {
        println!("{name:>34} {ns:>8.0}");
    }
    // SAFETY: the stream is synchronized (above): nothing recorded `ev` is pending.
    // The raw graphs and their stream are idle too: each graph ran on `s`, and `gs` only
    // captured.
    unsafe {
        rt::event_destroy(ev)?;
        rt::graph_exec_destroy(raw_graph)?;
        rt::graph_exec_destroy(raw_graph_node)?;
        rt::event_destroy(gev)?;
        rt::stream_destroy(gs)
    }?;
    Ok(())
}
