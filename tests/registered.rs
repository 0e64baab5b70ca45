//! Registered memory and symmetric windows on GPUs (issue 19): memory from `ncclMemAlloc`
//! through sends, receives and collectives with values checked; registrations and windows
//! dropped while work on them is still queued (the drop waits for it, then deregisters);
//! the memory of a dropped `ncclMemAlloc` buffer freed only after a long queued read of it;
//! windows refused for pool memory and made only once; and, on two GPUs, window registrations
//! that differ between the ranks a typed error on both, before NCCL.
//!
//! `NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,REG,ALLOC` shows NCCL's side: `ncclMemAlloc`'s
//! allocations, `register comm ... buffer ... size ...` for each registration, and the
//! symmetric-window set-up. The tests print the addresses they register, to match those lines.

mod common;

use std::time::{Duration, Instant};

use common::{Gpus, assert_all_eq};
use handoff::{CommOptions, CtaPolicy, DeviceBuffer, Error, ReduceOp, Stream, group, kernels};
use libtest_mimic::Failed;

/// Elements per buffer: not a power of two.
const N: usize = 3001;

fn value(i: usize) -> f32 {
    ((i % 97) + 1) as f32
}

fn main() {
    let g = Gpus::detect();
    common::run(vec![
        g.trial(
            "an_nccl_buffer_round_trips_through_a_self_send_and_an_all_reduce",
            1,
            round_trip,
        ),
        g.trial(
            "registered_and_window_buffers_carry_sends_and_collectives",
            1,
            registered_paths,
        ),
        g.trial(
            "a_registration_dropped_behind_queued_work_waits_for_it",
            1,
            || dropped_behind_work(false),
        ),
        g.trial("a_window_dropped_behind_queued_work_waits_for_it", 1, || {
            dropped_behind_work(true)
        }),
        g.trial(
            "hazard_an_nccl_buffer_dropped_under_a_long_read_is_freed_after_it",
            1,
            freed_after_a_long_read,
        ),
        g.trial(
            "a_window_of_pool_memory_or_a_second_window_is_refused",
            1,
            window_refusals,
        ),
        g.ranks_trial(
            "window_sizes_that_differ_between_ranks_are_a_mismatch_on_both",
            || two_rank_mismatch(false),
        ),
        g.ranks_trial(
            "a_rank_whose_window_is_refused_makes_it_a_mismatch_on_the_other",
            || two_rank_mismatch(true),
        ),
        g.ranks_trial(
            "two_rank_windows_all_reduce_and_copy_engine_all_gather",
            two_rank_windows,
        ),
    ]);
}

fn values() -> Vec<f32> {
    (0..N).map(value).collect()
}

fn round_trip() -> Result<(), Failed> {
    let (dev, comm) = common::one_rank(CommOptions::default())?;
    let s = Stream::new(&dev)?;
    let a = DeviceBuffer::from_slice_nccl(&values(), &s)?;
    let mut b = DeviceBuffer::<f32>::zeros_nccl(N, &s)?;
    if !a.is_nccl_alloc() || !b.is_nccl_alloc() {
        return Err("zeros_nccl/from_slice_nccl gave pool memory".into());
    }
    group(|g| {
        g.send(&comm, &a, 0, &s)?;
        g.recv(&comm, &mut b, 0, &s)
    })?;
    assert_all_eq("self send/receive", &b.to_vec(&s)?, value)?;
    let mut c = DeviceBuffer::<f32>::zeros_nccl(N, &s)?;
    comm.all_reduce(&b, &mut c, ReduceOp::Sum, &s)?;
    assert_all_eq("all_reduce of one rank", &c.to_vec(&s)?, value)?;
    Ok(())
}

fn registered_paths() -> Result<(), Failed> {
    for policy in [None, Some(CtaPolicy::Zero)] {
        let options = match policy {
            Some(p) => CommOptions::default().with_cta_policy(p),
            None => CommOptions::default(),
        };
        let (dev, comm) = common::one_rank(options)?;
        let s = Stream::new(&dev)?;
        let mut a = DeviceBuffer::from_slice_nccl(&values(), &s)?;
        let mut b = DeviceBuffer::<f32>::zeros_nccl(N, &s)?;
        let mut w_in = DeviceBuffer::from_slice_nccl(&values(), &s)?;
        let mut w_out = DeviceBuffer::<f32>::zeros_nccl(N, &s)?;
        println!(
            "policy {policy:?}: registering {:p} and {:p}, windows {:p} and {:p}",
            a.as_raw_ptr(),
            b.as_raw_ptr(),
            w_in.as_raw_ptr(),
            w_out.as_raw_ptr()
        );
        let ra = comm.register(&mut a)?;
        let mut rb = comm.register(&mut b)?;
        if !ra.is_active() {
            println!("NCCL returned no registration handle (NCCL_LOCAL_REGISTER=0?)");
        }
        // SAFETY: one rank: no peer to pass another window.
        let wi = unsafe { comm.register_window(&mut w_in) }?;
        // SAFETY: as above.
        let mut wo = unsafe { comm.register_window(&mut w_out) }?;
        group(|g| {
            g.send(&comm, ra.view(), 0, &s)?;
            g.recv(&comm, rb.view_mut(), 0, &s)
        })?;
        assert_all_eq("registered send/receive", &rb.to_vec(&s)?, value)?;
        comm.all_reduce(wi.view(), wo.view_mut(), ReduceOp::Sum, &s)?;
        assert_all_eq("all_reduce over windows", &wo.to_vec(&s)?, value)?;
        comm.all_gather(wi.view(), wo.view_mut(), &s)?;
        assert_all_eq("all_gather over windows", &wo.to_vec(&s)?, value)?;
        // A kernel writes the window, a copy reads it.
        let mut produced = DeviceBuffer::<f32>::zeros(N, &s)?;
        kernels::produce(&mut produced, 7, &s)?;
        wo.view_mut().copy_from(&produced, &s)?;
        comm.all_reduce_in_place(wo.view_mut(), ReduceOp::Max, &s)?;
        assert_all_eq(
            "window written by a kernel's copy, then reduced",
            &wo.to_vec(&s)?,
            |i| kernels::produced_value(i, 7),
        )?;
        if (wi.index(), wo.index()) != (0, 1) {
            return Err(format!("window numbers {:?}, want (0, 1)", (wi.index(), wo.index())).into());
        }
        wo.deregister()?;
        drop((wi, ra));
        rb.deregister()?;
    }
    Ok(())
}

/// A long kernel, then a collective reading the registered buffer into another: dropping the
/// registration (or window) waits for both, then deregisters; the values arrive.
fn dropped_behind_work(window: bool) -> Result<(), Failed> {
    let (dev, comm) = common::one_rank(CommOptions::default())?;
    let s = Stream::new(&dev)?;
    let mut a = DeviceBuffer::from_slice_nccl(&values(), &s)?;
    let mut out = DeviceBuffer::<f32>::zeros(N, &s)?;
    let busy = Duration::from_millis(300);
    let took = if window {
        // SAFETY: one rank.
        let w = unsafe { comm.register_window(&mut a) }?;
        kernels::busy(busy, &s)?;
        comm.all_reduce(w.view(), &mut out, ReduceOp::Sum, &s)?;
        let start = Instant::now();
        drop(w);
        start.elapsed()
    } else {
        let r = comm.register(&mut a)?;
        kernels::busy(busy, &s)?;
        comm.all_reduce(r.view(), &mut out, ReduceOp::Sum, &s)?;
        let start = Instant::now();
        drop(r);
        start.elapsed()
    };
    // The drop returned only once the collective had completed.
    if !s.is_idle()? {
        return Err(format!("the drop returned after {took:?} with the collective still queued").into());
    }
    assert_all_eq(
        "all_reduce from the dropped registration",
        &out.to_vec(&s)?,
        value,
    )?;
    // The buffer is the caller's again.
    a.memset_zero(&s)?;
    assert_all_eq("the buffer after its registration", &a.to_vec(&s)?, |_| 0.0)?;
    Ok(())
}

/// A long read of an ncclMemAlloc buffer is queued, then the buffer dropped: ncclMemFree unmaps
/// at once, so freeing it then would make the read fault (an illegal address, sticky for the
/// process). It is freed after the read; the copy's values arrive.
fn freed_after_a_long_read() -> Result<(), Failed> {
    let dev = handoff::Device::new(0)?;
    let s = Stream::new(&dev)?;
    let a = DeviceBuffer::from_slice_nccl(&values(), &s)?;
    let mut out = DeviceBuffer::<f32>::zeros(N, &s)?;
    kernels::delayed_copy(&a, &mut out, Duration::from_millis(300), &s)?;
    let start = Instant::now();
    drop(a);
    let took = start.elapsed();
    if handoff::pending_nccl_frees() == 0 {
        return Err("the dropped buffer's memory was not left waiting for its read".into());
    }
    assert_all_eq(
        "a copy out of a dropped ncclMemAlloc buffer",
        &out.to_vec(&s)?,
        value,
    )?;
    let start_wait = Instant::now();
    while handoff::pending_nccl_frees() != 0 {
        if start_wait.elapsed() > Duration::from_secs(5) {
            return Err("the memory was never freed".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    println!("drop returned in {took:?}; freed after the read");
    Ok(())
}

fn window_refusals() -> Result<(), Failed> {
    let (dev, comm) = common::one_rank(CommOptions::default())?;
    let s = Stream::new(&dev)?;
    let mut pool = DeviceBuffer::<f32>::zeros(4096, &s)?;
    // SAFETY: one rank.
    match unsafe { comm.register_window(&mut pool) } {
        Err(Error::InvalidArgument(m)) if m.contains("ncclMemAlloc") => {}
        other => return Err(format!("a window of pool memory: {other:?}").into()),
    }
    let mut buf = DeviceBuffer::<f32>::zeros_nccl(4096, &s)?;
    // Forgotten: NCCL keeps it a window; a second registration is refused by the buffer's mark.
    // SAFETY: one rank.
    std::mem::forget(unsafe { comm.register_window(&mut buf) }?);
    // SAFETY: as above.
    match unsafe { comm.register_window(&mut buf) } {
        Err(Error::InvalidArgument(m)) if m.contains("already a window") => {}
        other => return Err(format!("a second window of one buffer: {other:?}").into()),
    }
    // Still usable as memory, and leaked rather than freed on drop.
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s)?;
    match buf.free() {
        Err(Error::InvalidArgument(m)) if m.contains("leaked") => Ok(()),
        other => Err(format!("a buffer still a window was freed: {other:?}").into()),
    }
}

/// Two ranks, one thread each: rank 1 registers a window of another size (or of pool memory);
/// both get an error before NCCL, and the communicator still works.
fn two_rank_mismatch(refuse: bool) -> Result<(), Failed> {
    let results = common::two_ranks([CommOptions::default(); 2], move |made| {
        let comm = made.map_err(|e| e.to_string())?;
        let rank = comm.rank();
        let s = Stream::new(comm.device()).map_err(|e| e.to_string())?;
        let len = if !refuse && rank == 1 { 2048 } else { 1024 };
        let mut buf = if refuse && rank == 1 {
            DeviceBuffer::<f32>::zeros(len, &s)
        } else {
            DeviceBuffer::<f32>::zeros_nccl(len, &s)
        }
        .map_err(|e| e.to_string())?;
        // SAFETY: refused before any collective uses it.
        let got = unsafe { comm.register_window(&mut buf) }.map(drop);
        let kind = match &got {
            Err(Error::Mismatch { detail }) => format!("mismatch: {detail}"),
            Err(Error::InvalidArgument(m)) => format!("refused: {m}"),
            other => return Err(format!("rank {rank}: {other:?}, want an error")),
        };
        // The communicator is still usable.
        let mut x = DeviceBuffer::from_slice(&[1.0f32; 8], &s).map_err(|e| e.to_string())?;
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &s)
            .map_err(|e| e.to_string())?;
        let v = x.to_vec(&s).map_err(|e| e.to_string())?;
        if v != [2.0; 8] {
            return Err(format!("rank {rank}: all_reduce after the refusal gave {v:?}"));
        }
        Ok(kind)
    })?;
    let [k0, k1] = common::both_ok(results)?;
    println!("rank 0: {k0}\nrank 1: {k1}");
    let want1 = if refuse { "refused:" } else { "mismatch:" };
    if !k0.starts_with("mismatch:") || !k1.starts_with(want1) {
        return Err(format!("rank 0 {k0:?}, rank 1 {k1:?}").into());
    }
    Ok(())
}

/// Two ranks with the copy-engine policy: an all-reduce and an all-gather over windows, values
/// checked (NCCL_DEBUG=INFO shows which path NCCL took).
fn two_rank_windows() -> Result<(), Failed> {
    let options = CommOptions::default().with_cta_policy(CtaPolicy::Zero);
    let results = common::two_ranks([options; 2], move |made| {
        let comm = made.map_err(|e| e.to_string())?;
        let rank = comm.rank();
        let e = |e: Error| format!("rank {rank}: {e}");
        let s = Stream::new(comm.device()).map_err(e)?;
        let mut input = DeviceBuffer::from_slice_nccl(&values(), &s).map_err(e)?;
        let mut out = DeviceBuffer::<f32>::zeros_nccl(2 * N, &s).map_err(e)?;
        // SAFETY: both ranks pass their windows #0 and #1, whole, in every collective below.
        let wi = unsafe { comm.register_window(&mut input) }.map_err(e)?;
        // SAFETY: as above.
        let mut wo = unsafe { comm.register_window(&mut out) }.map_err(e)?;
        comm.all_gather(wi.view(), wo.view_mut(), &s).map_err(e)?;
        let gathered = wo.to_vec(&s).map_err(e)?;
        comm.all_reduce(
            wi.view(),
            wo.view_mut().slice_mut(..N).map_err(e)?,
            ReduceOp::Sum,
            &s,
        )
        .map_err(e)?;
        let reduced = wo.to_vec(&s).map_err(e)?;
        Ok((gathered, reduced))
    })?;
    for (r, (gathered, reduced)) in common::both_ok(results)?.into_iter().enumerate() {
        assert_all_eq(&format!("rank {r}: all_gather over windows"), &gathered, |i| {
            value(i % N)
        })?;
        assert_all_eq(
            &format!("rank {r}: all_reduce over windows"),
            &reduced[..N],
            |i| 2.0 * value(i),
        )?;
    }
    Ok(())
}
