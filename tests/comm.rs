//! GPU tests of the communicator: one-rank self send/receive over many sizes and every type,
//! groups, the article's reuse rules under two streams, errors raised before NCCL is called,
//! and two-rank runs (in one process over two GPUs, and two processes through the bootstrap),
//! which report ignored where fewer than two GPUs are usable.

mod common;

use std::time::{Duration, Instant};

use common::{Gpus, assert_all_eq};
use handoff::kernels::{self, produced_value};
use handoff::{
    CommOptions, Communicator, Device, DeviceBuffer, Error, Launch, NcclType, ReduceOp, Stream, UniqueId,
    group,
};
use libtest_mimic::Failed;

const LONG: Duration = Duration::from_millis(300);

fn main() {
    common::run_child_role(&[("send_recv", child_send_recv)]);
    let g = Gpus::detect();
    common::run(vec![
        g.trial("unique_id_from_nccl_round_trips", 1, unique_id_from_nccl),
        g.trial("self_send_recv_many_sizes", 1, self_send_recv_many_sizes),
        g.trial("self_send_recv_every_type", 1, self_send_recv_every_type),
        g.trial("grouped_ranges_and_several_pairs", 1, grouped_ranges),
        g.trial(
            "send_buffer_rewritten_on_another_stream_right_after_send",
            1,
            send_buffer_rewritten,
        ),
        g.trial(
            "receive_buffer_rereceived_while_b_reads_it",
            1,
            receive_buffer_rereceived,
        ),
        g.trial("bad_arguments_fail_before_nccl", 1, bad_arguments),
        g.trial("abort_makes_later_calls_fail", 1, abort_makes_later_calls_fail),
        g.trial("nonblocking_communicator_sends_to_itself", 1, nonblocking_self),
        g.trial(
            "nonblocking_rendezvous_where_a_rank_never_comes_times_out",
            1,
            rank_never_comes,
        ),
        g.trial(
            "synchronize_and_finalize_wait_for_queued_work",
            1,
            synchronize_and_finalize,
        ),
        g.trial("two_ranks_in_one_process", 2, two_ranks_in_one_process),
        g.ranks_trial(
            "two_processes_through_the_bootstrap",
            two_processes_through_the_bootstrap,
        ),
        g.trial(
            "stream_of_another_device_is_rejected",
            2,
            stream_of_another_device,
        ),
        g.trial("wait_stream_async_resolves_and_times_out", 1, wait_stream_async),
    ]);
}

/// `Communicator::wait_stream_async`: 64 futures on 4 threads after an all-reduce resolve
/// with the data in place; behind work longer than the communicator's timeout, the future ends
/// with `Error::Timeout` within about that timeout and the communicator is aborted, as by
/// `wait_stream`.
fn wait_stream_async() -> Result<(), Failed> {
    let (dev, mut comm) = one_rank()?;
    let s = Stream::new(&dev)?;
    let n = 1 << 16;
    let mut x = DeviceBuffer::<f32>::zeros(n, &s)?;
    kernels::produce(&mut x, 3, &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(n, &s)?;
    kernels::busy(Duration::from_millis(100), &s)?;
    comm.all_reduce(&x, &mut y, ReduceOp::Sum, &s)?;
    let futures: Vec<_> = (0..64).map(|_| comm.wait_stream_async(&s)).collect();
    let mut left = futures.into_iter();
    std::thread::scope(|scope| {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let mine: Vec<_> = left.by_ref().take(16).collect();
                scope.spawn(move || -> Result<Vec<handoff::Result<()>>, Failed> {
                    let boxed = mine
                        .into_iter()
                        .map(|f| {
                            Box::pin(f) as std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>>
                        })
                        .collect();
                    common::block_on(common::join_all(boxed), Duration::from_secs(30))
                })
            })
            .collect();
        for t in threads {
            for r in t.join().map_err(|_| "a waiter panicked")?? {
                r?;
            }
        }
        Ok::<(), Failed>(())
    })?;
    let got = y.to_vec(&s)?;
    assert_all_eq("all-reduce of one rank", &got, |i| produced_value(i, 3))?;
    comm.set_timeout(Duration::from_millis(300));
    kernels::busy(Duration::from_secs(2), &s)?;
    let started = Instant::now();
    let out = common::block_on(comm.wait_stream_async(&s), Duration::from_secs(10))?;
    let waited = started.elapsed();
    if !matches!(out, Err(Error::Timeout { .. })) {
        return Err(format!("2 s of work behind a 300 ms timeout gave {out:?}").into());
    }
    if waited > Duration::from_millis(1500) {
        return Err(format!("the timeout of 300 ms ended the wait after {waited:?}").into());
    }
    if comm.broken_reason().is_none() {
        return Err("the communicator was not aborted by the async wait's timeout".into());
    }
    s.synchronize()?;
    Ok(())
}

fn one_rank() -> Result<(Device, Communicator), Failed> {
    common::one_rank(CommOptions::default())
}

fn self_transfer<T: NcclType>(
    comm: &Communicator,
    s: &Stream,
    x: &DeviceBuffer<T>,
    y: &mut DeviceBuffer<T>,
) -> handoff::Result<()> {
    group(|g| {
        g.send(comm, x, comm.rank(), s)?;
        g.recv(comm, y, comm.rank(), s)
    })
}

fn unique_id_from_nccl() -> Result<(), Failed> {
    let id = UniqueId::new()?;
    let back: UniqueId = id.to_string().parse()?;
    if back != id || UniqueId::from_bytes(id.as_bytes())? != id {
        return Err("unique id did not round-trip".into());
    }
    Ok(())
}

fn self_send_recv_many_sizes() -> Result<(), Failed> {
    let (dev, comm) = one_rank()?;
    let s = Stream::new(&dev)?;
    // 4 B to 400 MiB of f32.
    for (n, round) in [
        (1, 0),
        (2, 1),
        (7, 2),
        (1000, 3),
        (65_539, 4),
        (1 << 22, 5),
        (100 << 20, 6),
    ] {
        let mut x = DeviceBuffer::<f32>::zeros(n, &s)?;
        kernels::produce(&mut x, round, &s)?;
        let mut y = DeviceBuffer::<f32>::zeros(n, &s)?;
        let t = Instant::now();
        self_transfer(&comm, &s, &x, &mut y)?;
        let got = y.to_vec(&s)?;
        println!(
            "{n} f32 ({} B) sent to self and copied back in {:?}",
            n * 4,
            t.elapsed()
        );
        assert_all_eq(&format!("y for n={n}"), &got, |i| produced_value(i, round))?;
    }
    Ok(())
}

fn pattern<T: NcclType>(n: usize, salt: usize) -> Vec<T> {
    let bytes: Vec<u8> = (0..n * std::mem::size_of::<T>())
        .map(|i| ((i * 31 + salt * 7 + 5) % 251) as u8)
        .collect();
    bytemuck::pod_collect_to_vec(&bytes)
}

fn roundtrip_type<T: NcclType + PartialEq + std::fmt::Debug>(
    comm: &Communicator,
    s: &Stream,
) -> Result<(), Failed> {
    for n in [1usize, 33, 100_003] {
        let want = pattern::<T>(n, n);
        let x = DeviceBuffer::from_slice(&want, s)?;
        let mut y = DeviceBuffer::<T>::zeros(n, s)?;
        self_transfer(comm, s, &x, &mut y)?;
        let got = y.to_vec(s)?;
        if bytemuck::cast_slice::<T, u8>(&got) != bytemuck::cast_slice::<T, u8>(&want) {
            return Err(format!("{}: {n} elements came back different", T::NAME).into());
        }
    }
    println!("{}: ok", T::NAME);
    Ok(())
}

fn self_send_recv_every_type() -> Result<(), Failed> {
    let (dev, comm) = one_rank()?;
    let s = Stream::new(&dev)?;
    roundtrip_type::<i8>(&comm, &s)?;
    roundtrip_type::<u8>(&comm, &s)?;
    roundtrip_type::<i32>(&comm, &s)?;
    roundtrip_type::<u32>(&comm, &s)?;
    roundtrip_type::<i64>(&comm, &s)?;
    roundtrip_type::<u64>(&comm, &s)?;
    roundtrip_type::<half::f16>(&comm, &s)?;
    roundtrip_type::<f32>(&comm, &s)?;
    roundtrip_type::<f64>(&comm, &s)?;
    roundtrip_type::<half::bf16>(&comm, &s)
}

/// Several sends and receives, of sub-ranges and whole buffers, in one group on two streams.
fn grouped_ranges() -> Result<(), Failed> {
    let (dev, comm) = one_rank()?;
    let (s1, s2) = (Stream::new(&dev)?, Stream::new(&dev)?);
    let n = 4096;
    let x = DeviceBuffer::from_slice(&(0..n as u32).collect::<Vec<_>>(), &s1)?;
    let mut y = DeviceBuffer::<u32>::zeros(n, &s1)?;
    let mut z = DeviceBuffer::<u32>::zeros(n, &s2)?;
    let me = comm.rank();
    group(|g| {
        // x's lower half into y's upper half, on s1; all of x into z, on s2.
        g.send(&comm, x.slice(0..n / 2)?, me, &s1)?;
        g.recv(&comm, y.slice_mut(n / 2..n)?, me, &s1)?;
        g.send(&comm, &x, me, &s2)?;
        g.recv(&comm, &mut z, me, &s2)
    })?;
    assert_all_eq("z", &z.to_vec(&s1)?, |i| i as u32)?;
    let y = y.to_vec(&s2)?;
    assert_all_eq("upper half of y", &y[n / 2..], |i| i as u32)?;
    assert_all_eq("untouched lower half of y", &y[..n / 2], |_| 0)
}

/// The article: "A send buffer may be rewritten only after the send completes on the GPU".
/// The send is held back on the communication stream; kernel A rewrites x on the compute stream
/// right after the send is queued. The receiver must still get the old x.
fn send_buffer_rewritten() -> Result<(), Failed> {
    let (dev, comm) = one_rank()?;
    let (comm_s, compute) = (Stream::new(&dev)?, Stream::new(&dev)?);
    let n = 1 << 20;
    let mut x = DeviceBuffer::<f32>::zeros(n, &compute)?;
    kernels::produce(&mut x, 0, &compute)?;
    let mut y = DeviceBuffer::<f32>::zeros(n, &comm_s)?;
    kernels::busy(LONG, &comm_s)?;
    self_transfer(&comm, &comm_s, &x, &mut y)?;
    kernels::produce(&mut x, 1, &compute)?; // the next round's A
    assert_all_eq("received y", &y.to_vec(&comm_s)?, |i| produced_value(i, 0))?;
    assert_all_eq("rewritten x", &x.to_vec(&compute)?, |i| produced_value(i, 1))
}

/// The article: "a receive buffer [may be rewritten] only after B has read it". B (a long read
/// of x) runs on the compute stream; the next receive into x is queued on the communication
/// stream right after. B must see the first round's x.
fn receive_buffer_rereceived() -> Result<(), Failed> {
    let (dev, comm) = one_rank()?;
    let (comm_s, compute) = (Stream::new(&dev)?, Stream::new(&dev)?);
    let n = 1 << 16;
    let mut src = DeviceBuffer::<f32>::zeros(n, &comm_s)?;
    kernels::produce(&mut src, 0, &comm_s)?;
    let mut x = DeviceBuffer::<f32>::zeros(n, &comm_s)?;
    self_transfer(&comm, &comm_s, &src, &mut x)?; // round 0 arrives in x
    let mut seen_by_b = DeviceBuffer::<f32>::zeros(n, &compute)?;
    kernels::delayed_copy(&x, &mut seen_by_b, LONG, &compute)?; // B reads x, slowly
    kernels::produce(&mut src, 1, &comm_s)?;
    self_transfer(&comm, &comm_s, &src, &mut x)?; // round 1 into x
    assert_all_eq("x as B read it", &seen_by_b.to_vec(&compute)?, |i| {
        produced_value(i, 0)
    })?;
    assert_all_eq("x after the second receive", &x.to_vec(&comm_s)?, |i| {
        produced_value(i, 1)
    })
}

fn expect_invalid<T: std::fmt::Debug>(what: &str, r: handoff::Result<T>) -> Result<(), Failed> {
    match r {
        Err(Error::InvalidArgument(m)) => {
            println!("{what}: rejected: {m}");
            Ok(())
        }
        other => Err(format!("{what}: expected InvalidArgument, got {other:?}").into()),
    }
}

fn bad_arguments() -> Result<(), Failed> {
    let (dev, comm) = one_rank()?;
    let s = Stream::new(&dev)?;
    let x = DeviceBuffer::from_slice(&[1.0f32; 8], &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(8, &s)?;
    expect_invalid("peer out of range", comm.send(&x, 1, &s))?;
    expect_invalid("range beyond the buffer", x.slice(4..9))?;
    expect_invalid("send to oneself outside a group", comm.send(&x, 0, &s))?;
    expect_invalid("receive from oneself outside a group", comm.recv(&mut y, 0, &s))?;
    expect_invalid(
        "self send and receive of different counts",
        group(|g| {
            g.send(&comm, x.slice(0..8)?, 0, &s)?;
            g.recv(&comm, y.slice_mut(0..7)?, 0, &s)
        }),
    )?;
    let mut y2 = DeviceBuffer::<f32>::zeros(8, &s)?;
    expect_invalid(
        "self sends and receives of the same counts in another order",
        group(|g| {
            g.send(&comm, x.slice(0..8)?, 0, &s)?;
            g.send(&comm, x.slice(0..4)?, 0, &s)?;
            g.recv(&comm, y.slice_mut(0..4)?, 0, &s)?;
            g.recv(&comm, y2.slice_mut(0..8)?, 0, &s)
        }),
    )?;
    let id = UniqueId::new()?;
    expect_invalid("world size 0", Communicator::new(0, 0, &id, &dev))?;
    expect_invalid("rank beyond world", Communicator::new(2, 2, &id, &dev))?;
    expect_invalid(
        "one device twice",
        Communicator::init_all(&[dev.clone(), dev.clone()]),
    )?;
    // Zero-length transfers are no-ops, even to oneself outside a group.
    let empty = DeviceBuffer::<f32>::zeros(0, &s)?;
    comm.send(&empty, 0, &s)?;
    // None of the rejected calls touched the communicator: it still works.
    self_transfer(&comm, &s, &x, &mut y)?;
    assert_all_eq("y", &y.to_vec(&s)?, |_| 1.0)
}

fn abort_makes_later_calls_fail() -> Result<(), Failed> {
    let (dev, comm) = one_rank()?;
    let s = Stream::new(&dev)?;
    let x = DeviceBuffer::from_slice(&[1u8; 16], &s)?;
    let mut y = DeviceBuffer::<u8>::zeros(16, &s)?;
    comm.abort()?;
    match self_transfer(&comm, &s, &x, &mut y) {
        Err(Error::CommunicatorUnusable { reason }) => println!("after abort: {reason}"),
        other => return Err(format!("a transfer after abort gave {other:?}").into()),
    }
    // The buffers are still fine to use and to drop.
    assert_all_eq("y", &y.to_vec(&s)?, |_| 0)
}

fn nonblocking_self() -> Result<(), Failed> {
    let dev = Device::new(0)?;
    let opts = CommOptions::nonblocking(Duration::from_secs(30));
    let comm = Communicator::init_all_with(opts, std::slice::from_ref(&dev))?
        .pop()
        .ok_or("no communicator")?;
    let s = Stream::new(&dev)?;
    let mut x = DeviceBuffer::<f32>::zeros(1 << 20, &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(1 << 20, &s)?;
    for round in 0..3 {
        kernels::produce(&mut x, round, &s)?;
        self_transfer(&comm, &s, &x, &mut y)?;
        assert_all_eq("y", &y.to_vec(&s)?, |i| produced_value(i, round))?;
    }
    comm.finalize()?;
    Ok(())
}

/// Rank 0 of two, and rank 1 never comes: a non-blocking communicator gives up at its timeout
/// with a typed error instead of waiting forever.
fn rank_never_comes() -> Result<(), Failed> {
    let dev = Device::new(0)?;
    let id = UniqueId::new()?;
    let timeout = Duration::from_secs(3);
    let t = Instant::now();
    let r = Communicator::with_options(2, 0, &id, CommOptions::nonblocking(timeout), &dev);
    let took = t.elapsed();
    match r {
        Err(Error::Timeout { what, after }) if after == timeout => {
            println!("timed out after {took:?} waiting for {what}");
        }
        other => return Err(format!("expected a timeout, got {other:?} after {took:?}").into()),
    }
    if took > timeout + Duration::from_secs(10) {
        return Err(format!("a 3 s timeout took {took:?}").into());
    }
    Ok(())
}

/// `synchronize` returns only once the queued transfer has completed on the GPU, and
/// `finalize` after it; both on a blocking communicator.
fn synchronize_and_finalize() -> Result<(), Failed> {
    let (dev, comm) = one_rank()?;
    let s = Stream::new(&dev)?;
    let x = DeviceBuffer::from_slice(&[7u32; 1024], &s)?;
    let mut y = DeviceBuffer::<u32>::zeros(1024, &s)?;
    kernels::busy(LONG, &s)?;
    let t = Instant::now();
    self_transfer(&comm, &s, &x, &mut y)?;
    comm.synchronize()?;
    let waited = t.elapsed();
    if waited < LONG / 2 || !s.is_idle()? {
        return Err(format!("synchronize returned after {waited:?}, before the transfer ran").into());
    }
    comm.finalize()?;
    assert_all_eq("y", &y.to_vec(&s)?, |_| 7)
}

/// The article across two GPUs of one process: A on GPU 0, send; receive on GPU 1, B.
fn two_ranks_in_one_process() -> Result<(), Failed> {
    let devs = [Device::new(0)?, Device::new(1)?];
    let comms = Communicator::init_all(&devs)?;
    let (s0, s1) = (Stream::new(&devs[0])?, Stream::new(&devs[1])?);
    let n = 1 << 20;
    let mut x0 = DeviceBuffer::<f32>::zeros(n, &s0)?;
    let mut x1 = DeviceBuffer::<f32>::zeros(n, &s1)?;
    let mut y1 = DeviceBuffer::<f32>::zeros(n, &s1)?;
    for round in 0..5 {
        kernels::produce(&mut x0, round, &s0)?;
        group(|g| {
            g.send(&comms[0], &x0, 1, &s0)?;
            g.recv(&comms[1], &mut x1, 0, &s1)
        })?;
        kernels::twice(&x1, &mut y1, &s1)?;
        assert_all_eq(&format!("y in round {round}"), &y1.to_vec(&s1)?, |i| {
            2.0 * produced_value(i, round)
        })?;
    }
    Ok(())
}

/// Two processes, one GPU each, joined through the bootstrap as a launcher would start them.
fn two_processes_through_the_bootstrap() -> Result<(), Failed> {
    let job = common::spawn_ranks("send_recv", false)?;
    Ok(job.wait_timeout(Duration::from_secs(240))?.check()?)
}

fn child_send_recv() -> Result<(), Failed> {
    let launch = Launch::from_env()?.ok_or("no launcher variables")?;
    let comm = launch.communicator(CommOptions::default().with_timeout(Duration::from_secs(60)))?;
    let s = Stream::new(comm.device())?;
    let n = 4096;
    let mut x = DeviceBuffer::<f32>::zeros(n, &s)?;
    let mut y = DeviceBuffer::<f32>::zeros(n, &s)?;
    for round in 0..3 {
        if comm.rank() == 0 {
            kernels::produce(&mut x, round, &s)?;
            comm.send(&x, 1, &s)?;
        } else {
            comm.recv(&mut x, 0, &s)?;
            kernels::twice(&x, &mut y, &s)?;
            assert_all_eq(&format!("y in round {round}"), &y.to_vec(&s)?, |i| {
                2.0 * produced_value(i, round)
            })?;
        }
    }
    s.synchronize()?;
    comm.finalize()?;
    Ok(())
}

fn stream_of_another_device() -> Result<(), Failed> {
    let devs = [Device::new(0)?, Device::new(1)?];
    let comms = Communicator::init_all(&devs)?;
    let s1 = Stream::new(&devs[1])?;
    let s0 = Stream::new(&devs[0])?;
    let x0 = DeviceBuffer::<f32>::zeros(4, &s0)?;
    let x1 = DeviceBuffer::<f32>::zeros(4, &s1)?;
    expect_invalid(
        "stream of device 1 for device 0's communicator",
        comms[0].send(&x0, 1, &s1),
    )?;
    expect_invalid(
        "buffer of device 1 for device 0's communicator",
        comms[0].send(&x1, 1, &s0),
    )
}
