//! Send/receive benchmark: handoff's safe API, verified (the default) and unverified, against the
//! raw generated NCCL calls, in the same process, on the same buffers and streams, interleaved.
//!
//! `cargo bench --bench sendrecv -- [OPTIONS]`
//!
//! Modes (`--mode`):
//! - `self`: one rank sends to itself (one GPU), send and receive in one group;
//! - `inproc`: two ranks in this process (two GPUs), rank 0 sends to rank 1, in one group;
//! - `procs`: two processes through the bootstrap (two GPUs); rank 1 prints the results. With
//!   `--verify-channel tcp`, verification between them goes over its network channel
//!   (loopback TCP), as between hosts (`HANDOFF_VERIFY_CHANNEL=tcp` for both ranks). With one
//!   GPU (or `--devices 0,0`) the two processes share it (`HANDOFF_SHARE_GPUS=1`: NCCL's socket
//!   transport over loopback between them): a correctness run of the sharing mode, every value
//!   checked as usual, whose times are not performance figures (a line before the table says
//!   so).
//!
//! `--memory pool|nccl|registered|window` chooses the buffers' kind, for every way: the pool
//! (default), `ncclMemAlloc` memory, that memory registered with the communicator each way's
//! calls use, or symmetric windows of it (handoff through its API, raw NCCL registered raw: see
//! `benches/memory`). Each way (verified, unverified, raw) has its own send and receive buffers,
//! made and registered in the same order on every rank (windows are collective), and
//! deregistered at the end. In `--mode self` NCCL 2.28.3 takes no registered path for a send to
//! oneself (`addP2pToPlan` in `src/enqueue.cc` registers only `&& !selfSend`), so there the
//! columns measure `ncclMemAlloc` memory alone; `--mode procs` is where they mean something.
//! Windows need ranks of one thread each: `--mode self` or `procs`, not `inproc`.
//!
//! For each size, after `--warmup` untimed iterations, `--repeats` timed runs of `--iters`
//! iterations each of each way, rotating verified, unverified and raw; each run is timed with CUDA events on the
//! receiving stream, and the median run is reported. The received data is checked once per
//! size for every way (one transfer of that way, into its cleared receive buffer), outside the
//! timed loops. A host-overhead figure (CPU time to enqueue one send+receive,
//! for each way, at small sizes) follows the table.
//!
//! Output: a table shaped like nccl-tests' (size, count, type, time, algbw, busbw; for
//! point-to-point busbw = algbw) with raw figures and the ratio handoff/raw; the same rows as
//! CSV (`--csv`, default `sendrecv.csv`); a plot of bandwidth and latency against size
//! (`--svg`, default `sendrecv.svg`); for a `--memory` other than pool, both names get
//! `-MEMORY` before their extension (`sendrecv-window.csv`).

mod harness;
mod memory;

use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use handoff::result::nccl as raw_nccl;
use handoff::{CommOptions, Communicator, Device, DeviceBuffer, Event, Launch, NcclType, Stream, group};
use harness::{Role, Way};
use memory::{Held, Memory};

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Mode {
    /// One rank sends to itself (one GPU).
    #[value(name = "self")]
    SelfRank,
    /// Two ranks in this process (two GPUs).
    #[value(name = "inproc")]
    InProc,
    /// Two processes through the bootstrap (two GPUs; on one, they share it).
    #[value(name = "procs")]
    Procs,
}

#[derive(Parser, Clone, Debug)]
#[command(about = "handoff's send/receive against raw NCCL")]
struct Opts {
    #[arg(long, value_enum, default_value = "self")]
    mode: Mode,
    /// The buffers' kind, for every way.
    #[arg(long, value_enum, default_value = "pool")]
    memory: Memory,
    #[command(flatten)]
    sweep: harness::Sweep,
    #[arg(long, default_value = "f32", value_parser = ["f32", "f64", "f16", "bf16", "i32", "u8"])]
    dtype: String,
    /// The GPUs, sender first.
    #[arg(long, value_delimiter = ',', default_value = "0,1")]
    devices: Vec<usize>,
    #[arg(long, default_value = "sendrecv.csv")]
    csv: String,
    /// Plot of bandwidth, time and handoff's time over raw NCCL's, against size.
    #[arg(long, default_value = "sendrecv.svg")]
    svg: String,
    /// Calls timed for the host-overhead figure (0: skip it).
    #[arg(long, default_value_t = 2000)]
    overhead_calls: usize,
    /// Non-blocking communicators.
    #[arg(long)]
    nonblocking: bool,
    /// `tcp`: procs mode's verification over the network channel, as between hosts.
    #[arg(long, value_parser = ["tcp"])]
    verify_channel: Option<String>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

impl Opts {
    fn comm_options(&self) -> CommOptions {
        CommOptions::default().with_blocking(!self.nonblocking)
    }
}

fn opts() -> Result<Opts, String> {
    let o = Opts::parse();
    o.sweep.check()?;
    if o.sweep.min_bytes == 0 {
        return Err("need --min-bytes > 0".into());
    }
    if o.mode != Mode::SelfRank && o.devices.len() < 2 {
        return Err("--devices needs two devices for inproc and procs".into());
    }
    if o.memory == Memory::Window && o.mode == Mode::InProc {
        return Err(
            "--memory window needs --mode self or procs: handoff makes windows only on ranks \
             of one thread each, and refuses them on the two ranks of one init_all (--mode inproc)"
                .into(),
        );
    }
    if o.verify_channel.is_some() && o.mode != Mode::Procs {
        return Err("--verify-channel needs --mode procs (two processes)".into());
    }
    Ok(o)
}

fn main() {
    let r = opts().map_err(|e| e.to_string()).and_then(|o| {
        let launched = Launch::from_env().map_err(|e| e.to_string())?;
        match (o.mode, launched) {
            (Mode::Procs, None) => {
                if let Some(c) = &o.verify_channel {
                    // SAFETY: this process has one thread (it parsed its options and reads the
                    // environment, nothing more, before spawning the ranks, which inherit it).
                    unsafe { std::env::set_var("HANDOFF_VERIFY_CHANNEL", c) };
                }
                harness::spawn_procs([o.devices[0], o.devices[1]])
            }
            (_, launch) => match o.dtype.as_str() {
                "f32" => run::<f32>(&o, launch),
                "f64" => run::<f64>(&o, launch),
                "f16" => run::<half::f16>(&o, launch),
                "bf16" => run::<half::bf16>(&o, launch),
                "i32" => run::<i32>(&o, launch),
                "u8" => run::<u8>(&o, launch),
                d => unreachable!("clap accepts only the listed types, not {d}"),
            }
            .map_err(|e| e.to_string()),
        }
    });
    if let Err(e) = r {
        eprintln!("sendrecv: {e}");
        std::process::exit(1);
    }
}

struct Setup {
    /// Verified (the default).
    comms: Vec<Communicator>,
    /// The same ranks again, unverified: the cost of verification is the difference.
    unverified: Vec<Communicator>,
    /// Index in `comms` of the sender and receiver (both 0 in self mode; in procs mode the one
    /// communicator of this process).
    send: usize,
    recv: usize,
    send_s: Stream,
    recv_s: Stream,
    role: Role,
    label: String,
    /// [`harness::shared_gpu_note`]: the ranks share a GPU.
    note: Option<String>,
}

fn setup(o: &Opts, launch: Option<Launch>) -> handoff::Result<Setup> {
    match (o.mode, launch) {
        (Mode::Procs, Some(l)) => {
            // Ranks launched by another launcher must have the variable themselves.
            if o.verify_channel.is_some() && std::env::var("HANDOFF_VERIFY_CHANNEL").as_deref() != Ok("tcp") {
                return Err(handoff::Error::InvalidArgument(
                    "--verify-channel tcp: set HANDOFF_VERIFY_CHANNEL=tcp for every rank".into(),
                ));
            }
            let comm = l.communicator(o.comm_options())?;
            // SAFETY: both ranks run this benchmark, which posts matching sends and receives.
            let unverified = vec![l.communicator(unsafe { o.comm_options().unverified() })?];
            let role = Role::of_rank(comm.rank());
            let (send_s, recv_s) = (Stream::new(comm.device())?, Stream::new(comm.device())?);
            let mut label = if l.share_gpus {
                format!(
                    "two processes through the bootstrap, sharing GPUs (rank {} on GPU {} of {}, {})",
                    l.rank,
                    comm.device().ordinal(),
                    Device::count()?,
                    comm.device().name()?
                )
            } else {
                format!("two processes, GPUs {:?}, through the bootstrap", o.devices)
            };
            if o.verify_channel.is_some() {
                label += ", verified over the channel (loopback TCP, HANDOFF_VERIFY_CHANNEL=tcp)";
            }
            Ok(Setup {
                comms: vec![comm],
                unverified,
                send: 0,
                recv: 0,
                send_s,
                recv_s,
                role,
                label,
                note: harness::shared_gpu_note(&l),
            })
        }
        (Mode::SelfRank, _) => {
            let d = Device::new(o.devices[0])?;
            let comms = Communicator::init_all_with(o.comm_options(), std::slice::from_ref(&d))?;
            // SAFETY: the benchmark's sends and receives match.
            let unverified = Communicator::init_all_with(
                unsafe { o.comm_options().unverified() },
                std::slice::from_ref(&d),
            )?;
            let label = format!(
                "one rank sending to itself on GPU {} ({})",
                o.devices[0],
                d.name()?
            );
            Ok(Setup {
                comms,
                unverified,
                send: 0,
                recv: 0,
                send_s: Stream::new(&d)?,
                recv_s: Stream::new(&d)?,
                role: Role::Both,
                label,
                note: None,
            })
        }
        _ => {
            let devs = [Device::new(o.devices[0])?, Device::new(o.devices[1])?];
            let comms = Communicator::init_all_with(o.comm_options(), &devs)?;
            // SAFETY: the benchmark's sends and receives match.
            let unverified = Communicator::init_all_with(unsafe { o.comm_options().unverified() }, &devs)?;
            let label = format!(
                "two ranks in one process, GPU {} -> GPU {}",
                o.devices[0], o.devices[1]
            );
            Ok(Setup {
                comms,
                unverified,
                send: 0,
                recv: 1,
                send_s: Stream::new(&devs[0])?,
                recv_s: Stream::new(&devs[1])?,
                role: Role::Both,
                label,
                note: None,
            })
        }
    }
}

/// One way's buffers before it holds them: (x, y), as in [`Bufs`].
type Owned<T> = (Option<DeviceBuffer<T>>, Option<DeviceBuffer<T>>);

/// One way's buffers as it holds them: the sender's `x`, the receiver's `y` (each `None` on the
/// rank of procs mode that does not use it).
struct Bufs<'c, 'b, T: NcclType> {
    x: Option<Held<'c, 'b, T>>,
    y: Option<Held<'c, 'b, T>>,
}

impl Setup {
    fn comms(&self, verified: bool) -> &[Communicator] {
        if verified { &self.comms } else { &self.unverified }
    }
    fn sender(&self) -> &Communicator {
        &self.comms[self.send]
    }
    fn receiver(&self) -> &Communicator {
        &self.comms[self.recv]
    }
    /// The stream that times: the receiving one (the only one on rank 0 of procs).
    fn timing_stream(&self) -> &Stream {
        if self.role == Role::Sender {
            &self.send_s
        } else {
            &self.recv_s
        }
    }

    /// One send+receive of `count` elements through the safe API, verified or not.
    fn safe<T: NcclType>(&self, b: &mut Bufs<T>, count: usize, verified: bool) -> handoff::Result<()> {
        let (send_peer, recv_peer) = (self.receiver().rank(), self.sender().rank());
        let (sender, receiver) = (&self.comms(verified)[self.send], &self.comms(verified)[self.recv]);
        match self.role {
            Role::Sender => sender.send(b.x.as_ref().unwrap().view().slice(0..count)?, 1, &self.send_s),
            Role::Receiver => receiver.recv(
                b.y.as_mut().unwrap().view_mut().into_slice_mut(0..count)?,
                0,
                &self.recv_s,
            ),
            Role::Both => group(|g| {
                g.send(
                    sender,
                    b.x.as_ref().unwrap().view().slice(0..count)?,
                    send_peer,
                    &self.send_s,
                )?;
                g.recv(
                    receiver,
                    b.y.as_mut().unwrap().view_mut().into_slice_mut(0..count)?,
                    recv_peer,
                    &self.recv_s,
                )
            }),
        }
    }

    /// The same through the raw generated calls: no checks, no tracking.
    fn raw<T: NcclType>(&self, b: &mut Bufs<T>, count: usize) -> handoff::Result<()> {
        let (send_peer, recv_peer) = (self.receiver().rank() as i32, self.sender().rank() as i32);
        let nccl = raw_nccl::lib()?;
        // ncclInProgress (7) is not an error: the communicator is non-blocking; see below.
        let bad = |rc: handoff::sys::nccl::ncclResult_t| rc.0 != 0 && rc.0 != 7;
        let mut in_progress = false;
        // SAFETY: the buffers are live, on the communicators' devices and at least `count`
        // long; this benchmark orders raw and safe operations on the same streams, so stream
        // order alone keeps them apart.
        unsafe {
            if self.role.sends() {
                if self.role == Role::Both {
                    let rc = nccl.ncclGroupStart();
                    if bad(rc) {
                        return Err(raw_nccl::error("ncclGroupStart", rc));
                    }
                }
                let rc = nccl.ncclSend(
                    b.x.as_ref().unwrap().view().as_raw_ptr().cast(),
                    count,
                    T::DATATYPE,
                    if self.role == Role::Sender { 1 } else { send_peer },
                    self.sender().as_raw(),
                    self.send_s.as_raw(),
                );
                if bad(rc) {
                    return Err(raw_nccl::error("ncclSend", rc));
                }
                in_progress |= rc.0 == 7;
            }
            if self.role.receives() {
                let rc = nccl.ncclRecv(
                    b.y.as_mut().unwrap().view_mut().as_raw_mut_ptr().cast(),
                    count,
                    T::DATATYPE,
                    if self.role == Role::Receiver { 0 } else { recv_peer },
                    self.receiver().as_raw(),
                    self.recv_s.as_raw(),
                );
                if bad(rc) {
                    return Err(raw_nccl::error("ncclRecv", rc));
                }
                in_progress |= rc.0 == 7;
                if self.role == Role::Both {
                    let rc = nccl.ncclGroupEnd();
                    if bad(rc) {
                        return Err(raw_nccl::error("ncclGroupEnd", rc));
                    }
                    in_progress |= rc.0 == 7;
                }
            }
            // NCCL's rule for non-blocking communicators, which the safe path follows too: poll
            // until the communicator is ready before touching its streams again.
            if in_progress {
                let t = Instant::now();
                for c in &self.comms {
                    raw_nccl::wait_ready(c.as_raw(), "raw ncclGroupEnd", t, Duration::from_secs(60))?;
                }
            }
        }
        Ok(())
    }
}

impl Setup {
    fn call<T: NcclType>(&self, way: Way, b: &mut Bufs<T>, count: usize) -> handoff::Result<()> {
        match way {
            Way::Verified => self.safe(b, count, true),
            Way::Unverified => self.safe(b, count, false),
            Way::Raw => self.raw(b, count),
        }
    }
}

fn pattern<T: NcclType>(n: usize) -> Vec<T> {
    let bytes: Vec<u8> = (0..n * std::mem::size_of::<T>())
        .map(|i| (i % 251) as u8 + 1)
        .collect();
    bytemuck::pod_collect_to_vec(&bytes)
}

fn run<T: NcclType + PartialEq>(o: &Opts, launch: Option<Launch>) -> handoff::Result<()> {
    let s = setup(o, launch)?;
    let size = std::mem::size_of::<T>();
    let max_count = o.sweep.max_bytes / size;
    let host_x = pattern::<T>(max_count);
    // Each way's own buffers, made in `Way::ALL` order: in procs mode each rank makes one per
    // way (the sender x, the receiver y), of one size, so the k-th window is the k-th on both.
    let mut store: Vec<Owned<T>> = Way::ALL
        .iter()
        .map(|_| {
            Ok((
                s.role
                    .sends()
                    .then(|| o.memory.alloc(&s.send_s, &host_x))
                    .transpose()?,
                s.role
                    .receives()
                    .then(|| o.memory.zeros(max_count, &s.recv_s))
                    .transpose()?,
            ))
        })
        .collect::<handoff::Result<_>>()?;
    // Registered (or made windows) with the communicator each way's calls use, in the same
    // order on every rank: for each way, x then y.
    let mut ways: Vec<Bufs<T>> = Vec::new();
    for (way, (x, y)) in Way::ALL.iter().zip(store.iter_mut()) {
        let comms = s.comms(*way != Way::Unverified);
        let raw_way = *way == Way::Raw;
        ways.push(Bufs {
            x: x.as_mut()
                .map(|x| o.memory.hold(x, &comms[s.send], raw_way))
                .transpose()?,
            y: y.as_mut()
                .map(|y| o.memory.hold(y, &comms[s.recv], raw_way))
                .transpose()?,
        });
    }
    let reports = s.role.receives();
    let dev = s.timing_stream().device().clone();
    let (start, end) = (Event::new(&dev)?, Event::new(&dev)?);
    if reports {
        let memory = match (o.mode, o.memory) {
            (Mode::SelfRank, Memory::Registered | Memory::Window) => format!(
                "{} (but NCCL takes no registered path for a send to oneself: ncclMemAlloc memory \
                 alone is measured)",
                o.memory.describe()
            ),
            (_, m) => m.describe().to_string(),
        };
        println!("# handoff send/recv benchmark: {}, {memory}", s.label);
        println!(
            "# dtype {} | iters {} | warmup {} | repeats {} (median reported) | rotating verified, unverified and raw | {} communicator",
            o.dtype,
            o.sweep.iters,
            o.sweep.warmup,
            o.sweep.repeats,
            if o.nonblocking { "non-blocking" } else { "blocking" }
        );
        if let Some(note) = &s.note {
            println!("{note}");
        }
        println!("{}", harness::header());
    }
    let mut rows = Vec::new();
    for bytes in o.sweep.sizes(size) {
        let count = bytes / size;
        let ts = s.timing_stream();
        let us = o.sweep.time_ways(|way, n, timed| {
            if timed {
                ts.record(&start)?;
                if s.role == Role::Both && s.send != s.recv {
                    s.send_s.wait(&start)?;
                }
            }
            for _ in 0..n {
                s.call(way, &mut ways[way as usize], count)?;
            }
            if !timed {
                return Ok(0.0);
            }
            ts.record(&end)?;
            end.synchronize()?;
            Ok(f64::from(start.elapsed_ms(&end)?) * 1000.0)
        })?;
        // Check each way's data once per size, outside the timed loops: clear its y, one
        // transfer of that way, read y back (raw calls are ordered by the streams alone).
        for (way, b) in Way::ALL.iter().zip(ways.iter_mut()) {
            if let Some(y) = b.y.as_mut() {
                y.view_mut().memset_zero(&s.recv_s)?;
            }
            s.call(*way, b, count)?;
            if let Some(y) = b.y.as_ref() {
                let got = y.view().slice(..count)?.to_vec(&s.recv_s)?;
                if got != host_x[..count] {
                    return Err(handoff::Error::InvalidArgument(format!(
                        "received data wrong at {bytes} B, {way:?}"
                    )));
                }
            }
            s.send_s.synchronize()?;
        }
        let row = harness::Row { bytes, count, us };
        if reports {
            // Point to point: bus bandwidth is algorithm bandwidth (factor 1).
            println!("{}", harness::line(&row, 1.0));
        }
        rows.push(row);
    }
    let overhead = host_overhead(o, &s, &mut ways)?;
    if reports && s.role == Role::Both {
        call_costs(&s)?;
    }
    if reports {
        if let Some([v, u, r, re]) = overhead {
            println!(
                "# host overhead, {} calls of one send+receive of {} B each (enqueue only, GPU waited for outside the timing): verified {v:.0} ns, unverified {u:.0} ns, raw {r:.0} ns, raw and then one cudaEventRecord on the sending stream (what tracking adds to the GPU calls) {re:.0} ns; verified - raw {:.0} ns, verified - unverified {:.0} ns, unverified - (raw + record) {:.0} ns per call",
                o.overhead_calls,
                size,
                v - r,
                v - u,
                u - re
            );
        }
        let op = if o.verify_channel.is_some() {
            "send_recv_verify_tcp"
        } else {
            "send_recv"
        };
        let (csv, svg) = (o.memory.file(&o.csv), o.memory.file(&o.svg));
        std::fs::write(&csv, harness::csv(op, &o.dtype, &rows, 1.0))
            .map_err(|e| handoff::Error::InvalidArgument(format!("writing {csv}: {e}")))?;
        let title = format!(
            "handoff send/recv, {}, {}, {}",
            o.dtype,
            s.label,
            o.memory.describe()
        );
        harness::plot(&svg, &title, &rows, 1.0)
            .map_err(|e| handoff::Error::InvalidArgument(format!("writing {svg}: {e}")))?;
        println!("# wrote {csv} and {svg}");
    }
    s.send_s.synchronize()?;
    s.recv_s.synchronize()?;
    // Registrations and windows end before their buffers and communicators.
    drop(ways);
    drop(store);
    for c in s.comms.into_iter().chain(s.unverified) {
        c.finalize()?;
    }
    Ok(())
}

/// CPU time to enqueue one send+receive (one element), each way: batches of 100 calls,
/// the GPU waited for between batches, outside the timing. Median of the batches. Not in procs
/// mode, where each process enqueues only half of the pair.
fn host_overhead<T: NcclType>(
    o: &Opts,
    s: &Setup,
    ways: &mut [Bufs<T>],
) -> handoff::Result<Option<[f64; 4]>> {
    if s.role != Role::Both || o.overhead_calls == 0 {
        return Ok(None);
    }
    const BATCH: usize = 100;
    // The fourth way: raw, then one event recorded on the sending stream, as tracking records
    // one after a group.
    s.send_s.device().set_current()?;
    let ev = handoff::result::cudart::event_create(false)?;
    let mut ns = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    for r in 0..4 * o.overhead_calls.div_ceil(BATCH) {
        let i = r % 4;
        let t = Instant::now();
        for _ in 0..BATCH {
            match Way::ALL.get(i) {
                Some(&way) => s.call(way, &mut ways[way as usize], 1)?,
                None => {
                    s.call(Way::Raw, &mut ways[Way::Raw as usize], 1)?;
                    // SAFETY: `ev` is live, of the sending stream's device.
                    unsafe { handoff::result::cudart::event_record(ev, s.send_s.as_raw()) }?;
                }
            }
        }
        ns[i].push(t.elapsed().as_nanos() as f64 / BATCH as f64);
        s.send_s.synchronize()?;
        s.recv_s.synchronize()?;
    }
    // SAFETY: recorded work has completed (both streams synchronized); not used again.
    unsafe { handoff::result::cudart::event_destroy(ev) }?;
    Ok(Some(ns.map(harness::median)))
}

/// What the calls that tracking adds cost on the host, each timed over many calls: for finding
/// where the safe path's host overhead goes.
fn call_costs(s: &Setup) -> handoff::Result<()> {
    const N: u32 = 20_000;
    let time = |f: &mut dyn FnMut() -> handoff::Result<()>| -> handoff::Result<f64> {
        let t = Instant::now();
        for _ in 0..N {
            f()?;
        }
        Ok(t.elapsed().as_nanos() as f64 / f64::from(N))
    };
    // Events belong to the device current at creation: the receiving stream's.
    s.recv_s.device().set_current()?;
    let ev = handoff::result::cudart::event_create(false)?;
    let raw_s = s.recv_s.as_raw();
    // SAFETY: `ev` and the stream are live and of the same device.
    let record = time(&mut || unsafe { handoff::result::cudart::event_record(ev, raw_s) })?;
    s.recv_s.synchronize()?;
    // SAFETY: as above.
    let wait = time(&mut || unsafe { handoff::result::cudart::stream_wait_event(raw_s, ev) })?;
    s.recv_s.synchronize()?;
    let get_device = time(&mut || handoff::result::cudart::get_device().map(|_| ()))?;
    // SAFETY: the stream is live. (What every eager tracked operation asks of each stream.)
    let is_capturing =
        time(&mut || unsafe { handoff::result::cudart::stream_is_capturing(raw_s) }.map(drop))?;
    let pair = time(&mut || {
        let v: Vec<u64> = Vec::with_capacity(4);
        std::hint::black_box(v);
        Ok(())
    })?;
    // SAFETY: the event is not used afterwards.
    unsafe { handoff::result::cudart::event_destroy(ev) }?;
    // A tracked kernel launch (kernel A of the article) against a raw `cudaLaunchKernel` of the
    // same kernel on the same stream and buffer.
    let mut x = DeviceBuffer::<f32>::zeros(4, &s.recv_s)?;
    let produce = time(&mut || handoff::kernels::produce(&mut x, 0, &s.recv_s))?;
    s.recv_s.synchronize()?;
    let module = handoff::Module::from_ptx(include_str!("../src/sys/generated/article.ptx"))?;
    let kernel = module.function("handoff_produce")?;
    kernel.load_on(s.recv_s.device())?;
    let (mut ptr, mut n, mut round) = (x.as_raw_mut_ptr() as u64, x.len() as u64, 0u32);
    let mut args = [
        (&raw mut ptr).cast::<std::ffi::c_void>(),
        (&raw mut n).cast(),
        (&raw mut round).cast(),
    ];
    s.recv_s.device().set_current()?;
    // SAFETY: handoff_produce(float* x, u64 n, u32 round) writes x[0..n] only; `x` is live and
    // its tracked uses completed (synchronized above); the arguments outlive each call; the
    // stream is synchronized before `x` is used again.
    let raw_launch = time(&mut || unsafe {
        handoff::result::cudart::launch_kernel(kernel.as_raw(), (1, 1, 1), (256, 1, 1), 0, &mut args, raw_s)
    })?;
    s.recv_s.synchronize()?;
    println!(
        "# host cost per call: cudaEventRecord {record:.0} ns, cudaStreamWaitEvent {wait:.0} ns, \
         cudaGetDevice {get_device:.0} ns, cudaStreamIsCapturing {is_capturing:.0} ns, a small heap \
         allocation {pair:.0} ns; kernels::produce {produce:.0} ns, a raw cudaLaunchKernel of it \
         {raw_launch:.0} ns ({:+.0} ns)",
        produce - raw_launch
    );
    Ok(())
}
