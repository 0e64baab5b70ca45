//! Send/receive benchmark: handoff's safe API, verified (the default) and unverified, against the
//! raw generated NCCL calls, in the same process, on the same buffers and streams, interleaved.
//!
//! `cargo bench --bench sendrecv -- [OPTIONS]`
//!
//! Modes (`--mode`):
//! - `self`: one rank sends to itself (one GPU), send and receive in one group;
//! - `inproc`: two ranks in this process (two GPUs), rank 0 sends to rank 1, in one group;
//! - `procs`: two processes through the bootstrap (two GPUs); rank 1 prints the results.
//!
//! For each size, after `--warmup` untimed iterations, `--repeats` timed runs of `--iters`
//! iterations each of each way, rotating verified, unverified and raw; each run is timed with CUDA events on the
//! receiving stream, and the median run is reported. The received data is checked once per
//! size, outside the timed loops. A host-overhead figure (CPU time to enqueue one send+receive,
//! for each way, at small sizes) follows the table.
//!
//! Output: a table shaped like nccl-tests' (size, count, type, time, algbw, busbw; for
//! point-to-point busbw = algbw) with raw figures and the ratio handoff/raw; the same rows as
//! CSV (`--csv`, default `sendrecv.csv`); a plot of bandwidth and latency against size
//! (`--svg`, default `sendrecv.svg`).

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use handoff::result::nccl as raw_nccl;
use handoff::{CommOptions, Communicator, Device, DeviceBuffer, Event, Launch, NcclType, Stream, group};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    SelfRank,
    InProc,
    Procs,
}

#[derive(Clone, Debug)]
struct Opts {
    mode: Mode,
    min_bytes: usize,
    max_bytes: usize,
    factor: usize,
    iters: usize,
    warmup: usize,
    repeats: usize,
    dtype: String,
    devices: Vec<usize>,
    csv: String,
    svg: String,
    overhead_calls: usize,
    nonblocking: bool,
}

impl Opts {
    fn comm_options(&self) -> CommOptions {
        CommOptions::default().with_blocking(!self.nonblocking)
    }
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let m = match s[i..].to_ascii_uppercase().as_str() {
                "B" => 1,
                "K" | "KB" | "KIB" => 1 << 10,
                "M" | "MB" | "MIB" => 1 << 20,
                "G" | "GB" | "GIB" => 1 << 30,
                u => return Err(format!("unknown size unit {u} in {s}")),
            };
            (&s[..i], m)
        }
        None => (s, 1),
    };
    num.parse::<usize>()
        .map(|n| n * mult)
        .map_err(|e| format!("{s}: {e}"))
}

const USAGE: &str = "options: --mode self|inproc|procs  --min-bytes 8  --max-bytes 1G  --factor 4  \
--iters 50  --warmup 5  --repeats 7  --dtype f32|f64|f16|bf16|i32|u8  --devices 0,1  \
--csv sendrecv.csv  --svg sendrecv.svg  --overhead-calls 2000  --nonblocking";

fn opts() -> Result<Opts, String> {
    let mut o = Opts {
        mode: Mode::SelfRank,
        min_bytes: 8,
        max_bytes: 1 << 30,
        factor: 4,
        iters: 50,
        warmup: 5,
        repeats: 7,
        dtype: "f32".into(),
        devices: vec![0, 1],
        csv: "sendrecv.csv".into(),
        svg: "sendrecv.svg".into(),
        overhead_calls: 2000,
        nonblocking: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--bench" {
            continue; // cargo bench passes it
        }
        let mut v = || args.next().ok_or(format!("{a} needs a value; {USAGE}"));
        let num = |s: String| s.parse::<usize>().map_err(|e| format!("{s}: {e}"));
        match a.as_str() {
            "--mode" => {
                o.mode = match v()?.as_str() {
                    "self" => Mode::SelfRank,
                    "inproc" => Mode::InProc,
                    "procs" => Mode::Procs,
                    m => return Err(format!("unknown mode {m}; {USAGE}")),
                }
            }
            "--min-bytes" => o.min_bytes = parse_size(&v()?)?,
            "--max-bytes" => o.max_bytes = parse_size(&v()?)?,
            "--factor" => o.factor = num(v()?)?,
            "--iters" => o.iters = num(v()?)?,
            "--warmup" => o.warmup = num(v()?)?,
            "--repeats" => o.repeats = num(v()?)?,
            "--dtype" => o.dtype = v()?,
            "--devices" => {
                o.devices = v()?
                    .split(',')
                    .map(|d| num(d.to_string()))
                    .collect::<Result<_, _>>()?;
            }
            "--csv" => o.csv = v()?,
            "--svg" => o.svg = v()?,
            "--overhead-calls" => o.overhead_calls = num(v()?)?,
            "--nonblocking" => o.nonblocking = true,
            "--help" | "-h" => return Err(USAGE.into()),
            _ => return Err(format!("unknown option {a}; {USAGE}")),
        }
    }
    if o.factor < 2 || o.iters == 0 || o.repeats == 0 || o.min_bytes == 0 || o.min_bytes > o.max_bytes {
        return Err(format!(
            "need factor >= 2, iters and repeats > 0, 0 < min-bytes <= max-bytes; {USAGE}"
        ));
    }
    if o.mode != Mode::SelfRank && o.devices.len() < 2 {
        return Err("--devices needs two devices for inproc and procs".into());
    }
    Ok(o)
}

fn main() {
    let r = opts().map_err(|e| e.to_string()).and_then(|o| {
        let launched = Launch::from_env().map_err(|e| e.to_string())?;
        match (o.mode, launched) {
            (Mode::Procs, None) => spawn_procs(&o),
            (_, launch) => match o.dtype.as_str() {
                "f32" => run::<f32>(&o, launch),
                "f64" => run::<f64>(&o, launch),
                "f16" => run::<half::f16>(&o, launch),
                "bf16" => run::<half::bf16>(&o, launch),
                "i32" => run::<i32>(&o, launch),
                "u8" => run::<u8>(&o, launch),
                d => Err(handoff::Error::InvalidArgument(format!(
                    "unsupported --dtype {d}; {USAGE}"
                ))),
            }
            .map_err(|e| e.to_string()),
        }
    });
    if let Err(e) = r {
        eprintln!("sendrecv: {e}");
        std::process::exit(1);
    }
}

/// Starts the two processes of `--mode procs`, as a launcher would.
fn spawn_procs(o: &Opts) -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let kids = handoff::bootstrap::spawn_local(2, |rank, cmd| {
        cmd.args(&args).env("LOCAL_RANK", o.devices[rank].to_string());
    })
    .map_err(|e| e.to_string())?;
    let failed: Vec<usize> = kids
        .into_iter()
        .enumerate()
        .filter_map(|(r, mut k)| (!k.wait().map(|s| s.success()).unwrap_or(false)).then_some(r))
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("rank(s) {failed:?} failed"))
    }
}

/// What this process does per iteration.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Sends and receives (self and inproc modes): times and reports.
    Both,
    /// Rank 0 of procs: only sends.
    Sender,
    /// Rank 1 of procs: only receives, times and reports.
    Receiver,
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
}

fn setup(o: &Opts, launch: Option<Launch>) -> handoff::Result<Setup> {
    match (o.mode, launch) {
        (Mode::Procs, Some(l)) => {
            let comm = l.communicator(o.comm_options())?;
            // SAFETY: both ranks run this benchmark, which posts matching sends and receives.
            let unverified = vec![l.communicator(unsafe { o.comm_options().unverified() })?];
            let role = if comm.rank() == 0 {
                Role::Sender
            } else {
                Role::Receiver
            };
            let (send_s, recv_s) = (Stream::new(comm.device())?, Stream::new(comm.device())?);
            let label = format!("two processes, GPUs {:?}, through the bootstrap", o.devices);
            Ok(Setup {
                comms: vec![comm],
                unverified,
                send: 0,
                recv: 0,
                send_s,
                recv_s,
                role,
                label,
            })
        }
        (Mode::SelfRank, _) => {
            let d = Device::new(o.devices[0])?;
            let comms = Communicator::init_all_with(std::slice::from_ref(&d), o.comm_options())?;
            // SAFETY: the benchmark's sends and receives match.
            let unverified = Communicator::init_all_with(std::slice::from_ref(&d), unsafe {
                o.comm_options().unverified()
            })?;
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
            })
        }
        _ => {
            let devs = [Device::new(o.devices[0])?, Device::new(o.devices[1])?];
            let comms = Communicator::init_all_with(&devs, o.comm_options())?;
            // SAFETY: the benchmark's sends and receives match.
            let unverified = Communicator::init_all_with(&devs, unsafe { o.comm_options().unverified() })?;
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
            })
        }
    }
}

struct Bufs<T: NcclType> {
    x: Option<DeviceBuffer<T>>,
    y: Option<DeviceBuffer<T>>,
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
            Role::Sender => sender.send(b.x.as_ref().unwrap().slice(0..count)?, 1, &self.send_s),
            Role::Receiver => receiver.recv(b.y.as_mut().unwrap().slice_mut(0..count)?, 0, &self.recv_s),
            Role::Both => group(|g| {
                g.send(
                    sender,
                    b.x.as_ref().unwrap().slice(0..count)?,
                    send_peer,
                    &self.send_s,
                )?;
                g.recv(
                    receiver,
                    b.y.as_mut().unwrap().slice_mut(0..count)?,
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
            if self.role != Role::Receiver {
                if self.role == Role::Both {
                    let rc = nccl.ncclGroupStart();
                    if bad(rc) {
                        return Err(raw_nccl::error("ncclGroupStart", rc));
                    }
                }
                let rc = nccl.ncclSend(
                    b.x.as_ref().unwrap().as_raw_ptr().cast(),
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
            if self.role != Role::Sender {
                let rc = nccl.ncclRecv(
                    b.y.as_mut().unwrap().as_raw_mut_ptr().cast(),
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

#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    Verified = 0,
    Unverified = 1,
    Raw = 2,
}

const WAYS: [Way; 3] = [Way::Verified, Way::Unverified, Way::Raw];

impl Setup {
    fn call<T: NcclType>(&self, way: Way, b: &mut Bufs<T>, count: usize) -> handoff::Result<()> {
        match way {
            Way::Verified => self.safe(b, count, true),
            Way::Unverified => self.safe(b, count, false),
            Way::Raw => self.raw(b, count),
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

struct Row {
    bytes: usize,
    count: usize,
    /// Median time per transfer, indexed by `Way`.
    us: [f64; 3],
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
    let max_count = o.max_bytes / size;
    let host_x = pattern::<T>(max_count);
    let mut b = Bufs::<T> {
        x: (s.role != Role::Receiver)
            .then(|| DeviceBuffer::from_slice(&s.send_s, &host_x))
            .transpose()?,
        y: (s.role != Role::Sender)
            .then(|| DeviceBuffer::zeros(&s.recv_s, max_count))
            .transpose()?,
    };
    let reports = s.role != Role::Sender;
    let dev = s.timing_stream().device().clone();
    let (start, end) = (Event::new(&dev)?, Event::new(&dev)?);
    if reports {
        println!("# handoff send/recv benchmark: {}", s.label);
        println!(
            "# dtype {} | iters {} | warmup {} | repeats {} (median reported) | rotating verified, unverified and raw | {} communicator",
            o.dtype,
            o.iters,
            o.warmup,
            o.repeats,
            if o.nonblocking { "non-blocking" } else { "blocking" }
        );
        println!(
            "#{:>11} {:>12} {:>5} | {:>10} {:>8} | {:>10} {:>8} | {:>10} {:>8} | {:>8} {:>8} {:>9} {:>9}",
            "size(B)",
            "count",
            "type",
            "verif(us)",
            "busbw",
            "unver(us)",
            "busbw",
            "raw(us)",
            "busbw",
            "ver/raw",
            "unv/raw",
            "v-raw(us)",
            "v-unv(us)"
        );
    }
    let mut rows = Vec::new();
    let mut bytes = o.min_bytes.max(size);
    while bytes <= o.max_bytes {
        let count = bytes / size;
        let ts = s.timing_stream();
        let mut times = [Vec::new(), Vec::new(), Vec::new()];
        for way in WAYS {
            for _ in 0..o.warmup {
                s.call(way, &mut b, count)?;
            }
        }
        for r in 0..3 * o.repeats {
            let way = WAYS[r % 3];
            ts.record(&start)?;
            if s.role == Role::Both && s.send != s.recv {
                s.send_s.wait(&start)?;
            }
            for _ in 0..o.iters {
                s.call(way, &mut b, count)?;
            }
            ts.record(&end)?;
            end.synchronize()?;
            times[way as usize].push(f64::from(start.elapsed_ms(&end)?) * 1000.0 / o.iters as f64);
        }
        // Check the data once per size, outside the timed loops: clear y, one safe transfer.
        if let Some(y) = b.y.as_mut() {
            y.memset_zero(&s.recv_s)?;
        }
        s.safe(&mut b, count, true)?;
        if let Some(y) = b.y.as_ref() {
            let got = y.to_vec(&s.recv_s)?;
            if got[..count] != host_x[..count] {
                return Err(handoff::Error::InvalidArgument(format!(
                    "received data wrong at {bytes} B"
                )));
            }
        }
        s.send_s.synchronize()?;
        let row = Row {
            bytes,
            count,
            us: times.map(median),
        };
        if reports {
            let bw = |us: f64| bytes as f64 / us / 1000.0; // GB/s
            let [v, u, r] = row.us;
            println!(
                "{:>12} {:>12} {:>5} | {:>10.2} {:>8.2} | {:>10.2} {:>8.2} | {:>10.2} {:>8.2} | {:>8.4} {:>8.4} {:>9.2} {:>9.2}",
                bytes,
                count,
                o.dtype,
                v,
                bw(v),
                u,
                bw(u),
                r,
                bw(r),
                v / r,
                u / r,
                v - r,
                v - u
            );
        }
        rows.push(row);
        // Step by the factor, and end exactly at --max-bytes (8 B × 4^k never hits 1 GiB).
        bytes = match bytes.checked_mul(o.factor) {
            Some(b) if b > o.max_bytes && bytes < o.max_bytes => o.max_bytes,
            Some(b) => b,
            None if bytes < o.max_bytes => o.max_bytes,
            None => break,
        };
    }
    let overhead = host_overhead(o, &s, &mut b)?;
    if reports && s.role == Role::Both {
        call_costs(&s)?;
    }
    if reports {
        if let Some([v, u, r]) = overhead {
            println!(
                "# host overhead, {} calls of one send+receive of {} B each (enqueue only, GPU waited for outside the timing): verified {v:.0} ns, unverified {u:.0} ns, raw {r:.0} ns; verified - raw {:.0} ns, verified - unverified {:.0} ns per call",
                o.overhead_calls,
                size,
                v - r,
                v - u
            );
        }
        write_csv(o, &rows)
            .map_err(|e| handoff::Error::InvalidArgument(format!("writing {}: {e}", o.csv)))?;
        write_svg(o, &s.label, &rows)
            .map_err(|e| handoff::Error::InvalidArgument(format!("writing {}: {e}", o.svg)))?;
        println!("# wrote {} and {}", o.csv, o.svg);
    }
    s.send_s.synchronize()?;
    s.recv_s.synchronize()?;
    drop(b);
    for c in s.comms.into_iter().chain(s.unverified) {
        c.finalize()?;
    }
    Ok(())
}

/// CPU time to enqueue one send+receive (one element), each way: batches of 100 calls,
/// the GPU waited for between batches, outside the timing. Median of the batches. Not in procs
/// mode, where each process enqueues only half of the pair.
fn host_overhead<T: NcclType>(o: &Opts, s: &Setup, b: &mut Bufs<T>) -> handoff::Result<Option<[f64; 3]>> {
    if s.role != Role::Both || o.overhead_calls == 0 {
        return Ok(None);
    }
    const BATCH: usize = 100;
    let mut ns = [Vec::new(), Vec::new(), Vec::new()];
    for r in 0..3 * o.overhead_calls.div_ceil(BATCH) {
        let way = WAYS[r % 3];
        let t = Instant::now();
        for _ in 0..BATCH {
            s.call(way, b, 1)?;
        }
        ns[way as usize].push(t.elapsed().as_nanos() as f64 / BATCH as f64);
        s.send_s.synchronize()?;
        s.recv_s.synchronize()?;
    }
    Ok(Some(ns.map(median)))
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
    let ev = handoff::result::event_create(false)?;
    let raw_s = s.recv_s.as_raw();
    // SAFETY: `ev` and the stream are live and of the same device.
    let record = time(&mut || unsafe { handoff::result::event_record(ev, raw_s) })?;
    s.recv_s.synchronize()?;
    // SAFETY: as above.
    let wait = time(&mut || unsafe { handoff::result::stream_wait_event(raw_s, ev) })?;
    s.recv_s.synchronize()?;
    let get_device = time(&mut || handoff::result::get_device().map(|_| ()))?;
    let pair = time(&mut || {
        let v: Vec<u64> = Vec::with_capacity(4);
        std::hint::black_box(v);
        Ok(())
    })?;
    // SAFETY: the event is not used afterwards.
    unsafe { handoff::result::event_destroy(ev) }?;
    println!(
        "# host cost per call: cudaEventRecord {record:.0} ns, cudaStreamWaitEvent {wait:.0} ns, \
         cudaGetDevice {get_device:.0} ns, a small heap allocation {pair:.0} ns"
    );
    Ok(())
}

fn write_csv(o: &Opts, rows: &[Row]) -> std::io::Result<()> {
    let mut out = String::from(
        "bytes,count,dtype,verified_us,unverified_us,raw_us,verified_busbw_gbps,unverified_busbw_gbps,raw_busbw_gbps,verified_ratio,unverified_ratio\n",
    );
    for r in rows {
        let bw = |us: f64| r.bytes as f64 / us / 1000.0;
        let [v, u, raw] = r.us;
        let _ = writeln!(
            out,
            "{},{},{},{v:.3},{u:.3},{raw:.3},{:.3},{:.3},{:.3},{:.5},{:.5}",
            r.bytes,
            r.count,
            o.dtype,
            bw(v),
            bw(u),
            bw(raw),
            v / raw,
            u / raw
        );
    }
    std::fs::write(&o.csv, out)
}

/// A per-row figure to plot.
type Metric = Box<dyn Fn(&Row, Way) -> f64>;

/// Two log-scale panels, bus bandwidth and time against message size, handoff and raw.
fn write_svg(o: &Opts, label: &str, rows: &[Row]) -> std::io::Result<()> {
    let (w, h, pad) = (520.0, 360.0, 60.0);
    let xs: Vec<f64> = rows.iter().map(|r| (r.bytes as f64).log2()).collect();
    let (x0, x1) = (
        xs.first().copied().unwrap_or(0.0),
        xs.last().copied().unwrap_or(1.0).max(xs[0] + 1.0),
    );
    let mut svg = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{}' font-family='sans-serif' font-size='12'>\n\
         <rect width='100%' height='100%' fill='white'/>\n<text x='20' y='20' font-size='14'>handoff send/recv ({} {}): handoff verified and unverified vs raw NCCL</text>\n",
        2.0 * w,
        h + 40.0,
        label,
        o.dtype
    );
    let panels: [(&str, Metric); 2] = [
        (
            "bus bandwidth (GB/s, log)",
            Box::new(|r: &Row, way| r.bytes as f64 / r.us[way as usize] / 1000.0),
        ),
        (
            "time per transfer (us, log)",
            Box::new(|r: &Row, way| r.us[way as usize]),
        ),
    ];
    for (p, (title, f)) in panels.iter().enumerate() {
        let ox = p as f64 * w;
        let vals: Vec<f64> = rows
            .iter()
            .flat_map(|r| WAYS.map(|w| f(r, w)))
            .filter(|v| *v > 0.0)
            .collect();
        let lo = vals.iter().copied().fold(f64::INFINITY, f64::min).log10().floor();
        let hi = vals
            .iter()
            .copied()
            .fold(0.0, f64::max)
            .log10()
            .ceil()
            .max(lo + 1.0);
        let px = |x: f64| ox + pad + (x - x0) / (x1 - x0) * (w - 1.5 * pad);
        let py = |v: f64| 30.0 + (h - pad) - (v.log10() - lo) / (hi - lo) * (h - pad - 20.0);
        let _ = writeln!(
            svg,
            "<text x='{}' y='45'>{title}</text><line x1='{}' y1='{}' x2='{}' y2='{}' stroke='black'/><line x1='{}' y1='50' x2='{}' y2='{}' stroke='black'/>",
            ox + pad,
            px(x0),
            py(10f64.powf(lo)),
            px(x1),
            py(10f64.powf(lo)),
            px(x0),
            px(x0),
            py(10f64.powf(lo))
        );
        let mut e = lo;
        while e <= hi {
            let _ = writeln!(
                svg,
                "<text x='{}' y='{}' text-anchor='end'>1e{e}</text>",
                px(x0) - 4.0,
                py(10f64.powf(e)) + 4.0
            );
            e += 1.0;
        }
        for (i, r) in rows.iter().enumerate() {
            if i % 2 == 0 {
                let lbl = match r.bytes {
                    b if b >= 1 << 30 => format!("{}G", b >> 30),
                    b if b >= 1 << 20 => format!("{}M", b >> 20),
                    b if b >= 1 << 10 => format!("{}K", b >> 10),
                    b => format!("{b}"),
                };
                let _ = writeln!(
                    svg,
                    "<text x='{}' y='{}' text-anchor='middle'>{lbl}</text>",
                    px(xs[i]),
                    py(10f64.powf(lo)) + 16.0
                );
            }
        }
        for (way, color, name, ly) in [
            (Way::Raw, "#d62728", "raw NCCL", 95.0),
            (Way::Unverified, "#2ca02c", "handoff unverified", 80.0),
            (Way::Verified, "#1f77b4", "handoff verified", 65.0),
        ] {
            let pts: Vec<String> = rows
                .iter()
                .zip(&xs)
                .map(|(r, &x)| format!("{:.1},{:.1}", px(x), py(f(r, way))))
                .collect();
            let dash = match way {
                Way::Verified => " stroke-dasharray='6 3'",
                Way::Unverified => " stroke-dasharray='2 2'",
                Way::Raw => "",
            };
            let _ = writeln!(
                svg,
                "<polyline fill='none' stroke='{color}' stroke-width='2'{dash} points='{}'/>",
                pts.join(" ")
            );
            let _ = writeln!(
                svg,
                "<text x='{}' y='{ly}' fill='{color}'>{name}</text>",
                ox + w - 140.0
            );
        }
        let _ = writeln!(
            svg,
            "<text x='{}' y='{}' text-anchor='middle'>message size (bytes)</text>",
            ox + w / 2.0,
            h + 30.0
        );
    }
    svg.push_str("</svg>\n");
    std::fs::write(&o.svg, svg)
}
