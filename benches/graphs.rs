//! Graphs benchmark: the article's round (kernel A writes x, x goes over NCCL into r, kernel B
//! computes y = 2r) four ways, in the same process, interleaved:
//!
//! 1. handoff eager: per round, `kernels::produce`, a send/receive through handoff's
//!    communicator (a `group` in self mode), `kernels::twice`;
//! 2. handoff graph: the same round captured once with `Graph::capture_with` (on a
//!    communicator of its own, split from the first), then one `Graph::launch` per round;
//! 3. raw eager: the same kernels (the committed PTX, `src/sys/generated/article.ptx`, loaded
//!    and launched with raw runtime calls) and raw NCCL calls, on a raw stream, raw buffers and
//!    a raw communicator;
//! 4. raw graph: the raw round captured with raw `cudaStreamBeginCapture`/`EndCapture`,
//!    instantiated and replayed with `cudaGraphLaunch`, on another raw communicator.
//!
//! `cargo bench --bench graphs -- [--mode self|procs] [OPTIONS]`
//!
//! Modes: `self` (one GPU, rank 0 sends to itself, the send and the receive in one group);
//! `procs` (two processes through the bootstrap: rank 0 runs A and sends, rank 1 receives and
//! runs B; rank 0 reports, rank 1 checks the values). With one GPU (or `--devices 0,0`) the two
//! processes of `procs` share it (`HANDOFF_SHARE_GPUS=1`: NCCL's socket transport over loopback
//! between them): a correctness run of the sharing mode, whose times are not performance
//! figures (a line before the table says so).
//!
//! Sizes: the article's 4 floats (16 B), then the sweep (`--min-bytes`, default 1 KiB, to
//! `--max-bytes`, default 64 MiB, times `--factor`). For each size, after `--warmup` untimed
//! rounds of each way, `--repeats` runs of `--iters` rounds back to back of each way, rotating
//! the four; a run's time is the wall-clock time from the first enqueue to the end of a
//! synchronize of the stream (GPU-inclusive), and its host time the time to enqueue the rounds
//! (before the synchronize); both per round, the median run reported. Every way's result is
//! checked once per size, outside the timed runs.

mod harness;

use std::ffi::c_void;
use std::time::Instant;

use clap::{CommandFactory, FromArgMatches, Parser, ValueEnum};
use handoff::result::{cudart as raw, nccl as raw_nccl};
use handoff::sys::cudart::{cudaGraphExec_t, cudaKernel_t, cudaMemcpyKind, cudaStream_t};
use handoff::sys::nccl::{ncclComm_t, ncclUniqueId};
use handoff::{
    CommOptions, Communicator, Device, DeviceBuffer, Error, Graph, Launch, NcclType, Stream, UniqueId, group,
    kernels,
};
use harness::Role;

/// The four ways, in their column order.
const WAYS: [&str; 4] = ["handoff eager", "handoff graph", "raw eager", "raw graph"];
const HANDOFF_EAGER: usize = 0;
const HANDOFF_GRAPH: usize = 1;
const RAW_EAGER: usize = 2;
const RAW_GRAPH: usize = 3;

/// The article's x: four floats.
const ARTICLE_BYTES: usize = 16;
/// The round value the graphs were captured with (a graph replays its kernels' arguments).
const GRAPH_ROUND: u32 = 0;
/// The round value the eager ways' checks use.
const CHECK_ROUND: u32 = 7;

/// The kernels' PTX as committed (CI keeps it equal to what `build.rs` compiles from
/// `kernels/article.cu`): the crate's own copy is not public, and the raw ways load it raw.
const ARTICLE_PTX: &str = include_str!("../src/sys/generated/article.ptx");

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Mode {
    /// One rank sends to itself (one GPU).
    #[value(name = "self")]
    SelfRank,
    /// Two processes through the bootstrap (two GPUs; on one, they share it): rank 0 sends,
    /// rank 1 receives.
    #[value(name = "procs")]
    Procs,
}

#[derive(Parser, Clone, Debug)]
#[command(
    about = "The article's round (kernel A, send/receive, kernel B): handoff eager and graph \
                   against raw eager and raw graph"
)]
struct Opts {
    #[arg(long, value_enum, default_value = "self")]
    mode: Mode,
    #[command(flatten)]
    sweep: harness::Sweep,
    /// The GPUs, sender first.
    #[arg(long, value_delimiter = ',', default_value = "0,1")]
    devices: Vec<usize>,
    /// Write the rows as CSV to this file.
    #[arg(long)]
    csv: Option<String>,
    /// handoff's communicators unverified (the graph is verified once, at capture, either way).
    #[arg(long)]
    unverified: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

impl Opts {
    fn comm_options(&self) -> CommOptions {
        if self.unverified {
            // SAFETY: every rank runs this benchmark, which posts matching sends and receives.
            unsafe { CommOptions::default().unverified() }
        } else {
            CommOptions::default()
        }
    }
}

fn opts() -> Result<Opts, String> {
    // This benchmark's sweep defaults differ from the harness's: 1 KiB to 64 MiB.
    let cmd = Opts::command()
        .mut_arg("min_bytes", |a| a.default_value("1K"))
        .mut_arg("max_bytes", |a| a.default_value("64M"));
    let o = Opts::from_arg_matches(&cmd.get_matches()).unwrap_or_else(|e| e.exit());
    o.sweep.check()?;
    if o.mode == Mode::Procs && o.devices.len() < 2 {
        return Err("--devices needs two devices for --mode procs".into());
    }
    if o.devices.is_empty() {
        return Err("--devices needs a device".into());
    }
    Ok(o)
}

fn main() {
    let r = opts().and_then(|o| {
        let launched = Launch::from_env().map_err(|e| e.to_string())?;
        match (o.mode, launched) {
            (Mode::Procs, None) => {
                // Say so here, not in two children's errors, when the GPUs are not there. With
                // one GPU the two ranks share it (see `harness::spawn_procs`).
                let n = Device::count().map_err(|e| e.to_string())?;
                let need = o.devices[0].max(o.devices[1]) + 1;
                if n == 0 || (n > 1 && n < need) {
                    return Err(format!(
                        "--mode procs needs GPUs {:?}; {n} visible",
                        &o.devices[..2]
                    ));
                }
                harness::spawn_procs([o.devices[0], o.devices[1]])
            }
            (_, launch) => run(&o, launch).map_err(|e| e.to_string()),
        }
    });
    if let Err(e) = r {
        eprintln!("graphs: {e}");
        std::process::exit(1);
    }
}

/// The rank a [`Role`] sends to or receives from (itself, rank 0, in self mode).
fn peer(role: Role) -> usize {
    match role {
        Role::Both => 0,
        Role::Sender => 1,
        Role::Receiver => 0,
    }
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

// ---------------------------------------------------------------------------------------------
// The raw side: a stream, two communicators, the kernels, buffers and graphs, all raw handles.

/// The raw ways' stream, communicators and kernels. Dropped after everything that uses them.
struct RawCtx {
    stream: cudaStream_t,
    /// The raw eager way's communicator.
    eager: ncclComm_t,
    /// The raw graph way's communicator (its graphs' NCCL operations, nothing else).
    graph: ncclComm_t,
    produce: cudaKernel_t,
    twice: cudaKernel_t,
}

impl RawCtx {
    /// `ids`: the unique ids of the eager and the graph communicators, shared by every rank.
    fn new(dev: &Device, world: usize, rank: usize, ids: [ncclUniqueId; 2]) -> handoff::Result<RawCtx> {
        dev.set_current()?;
        let stream = raw::stream_create_non_blocking()?;
        let comm = |id: &ncclUniqueId| -> handoff::Result<ncclComm_t> {
            let mut config = raw_nccl::config_initializer();
            // SAFETY: a config from `config_initializer`, unchanged (blocking by default).
            let (c, in_progress) =
                unsafe { raw_nccl::comm_init_rank(world as i32, id, rank as i32, &mut config) }?;
            if in_progress {
                // SAFETY: `c` was just made.
                unsafe {
                    raw_nccl::wait_ready(
                        c,
                        "ncclCommInitRank",
                        Instant::now(),
                        CommOptions::default().timeout(),
                    )
                }?;
            }
            Ok(c)
        };
        let eager = comm(&ids[0])?;
        let graph = comm(&ids[1])?;
        // The PTX as a C string; the runtime copies it.
        let mut image = ARTICLE_PTX.as_bytes().to_vec();
        image.push(0);
        // SAFETY: NUL-terminated PTX.
        let library = unsafe { raw::library_load_image(&image) }?;
        // SAFETY: `library` is live (never unloaded: it lives as long as the process).
        let (produce, twice) = unsafe {
            (
                raw::library_get_kernel(library, c"handoff_produce")?,
                raw::library_get_kernel(library, c"handoff_twice")?,
            )
        };
        // Load both on this device now, not lazily inside a timed run or a capture.
        // SAFETY: live kernel handles.
        unsafe {
            raw::kernel_attributes(produce)?;
            raw::kernel_attributes(twice)?;
        }
        Ok(RawCtx {
            stream,
            eager,
            graph,
            produce,
            twice,
        })
    }

    fn synchronize(&self) -> handoff::Result<()> {
        // SAFETY: the stream is live until `self` is dropped.
        unsafe { raw::stream_synchronize(self.stream) }
    }

    /// One raw round of `n` elements on `comm`: A, send/receive, B, as `role` has it. Nothing
    /// checked beyond the return codes.
    ///
    /// # Safety
    /// `b` holds live buffers of `n` elements for the role; `comm` is one of `self`'s.
    unsafe fn round(&self, role: Role, comm: ncclComm_t, b: &RawBufs, round: u32) -> handoff::Result<()> {
        let n = b.n as u64;
        let dtype = <f32 as NcclType>::DATATYPE;
        let peer = peer(role) as i32;
        // SAFETY (the whole block): the buffers are live device memory of this device holding
        // `n` floats; the kernels' parameters are (float*, u64, u32) and (const float*, float*,
        // u64); everything is ordered on the one raw stream.
        unsafe {
            if role.sends() {
                let (mut x, mut n, mut r) = (b.x, n, round);
                let mut args: [*mut c_void; 3] =
                    [(&raw mut x).cast(), (&raw mut n).cast(), (&raw mut r).cast()];
                raw::launch_kernel(
                    self.produce,
                    (grid(b.n), 1, 1),
                    (BLOCK, 1, 1),
                    0,
                    &mut args,
                    self.stream,
                )?;
            }
            if role == Role::Both {
                raw_nccl::group_start()?;
            }
            if role.sends() {
                let rc = raw_nccl::send(b.x.cast(), b.n, dtype, peer, comm, self.stream)?;
                raw_nccl::check("ncclSend", rc)?;
            }
            if role.receives() {
                let rc = raw_nccl::recv(b.r.cast(), b.n, dtype, peer, comm, self.stream)?;
                raw_nccl::check("ncclRecv", rc)?;
            }
            if role == Role::Both {
                raw_nccl::group_end()?;
            }
            if role.receives() {
                let (mut r, mut y, mut n) = (b.r, b.y, n);
                let mut args: [*mut c_void; 3] =
                    [(&raw mut r).cast(), (&raw mut y).cast(), (&raw mut n).cast()];
                raw::launch_kernel(
                    self.twice,
                    (grid(b.n), 1, 1),
                    (BLOCK, 1, 1),
                    0,
                    &mut args,
                    self.stream,
                )?;
            }
        }
        Ok(())
    }
}

impl Drop for RawCtx {
    fn drop(&mut self) {
        // SAFETY: the handles are live and used by nothing after this (the graphs and buffers
        // that use them were dropped first); the stream is drained before the communicators go.
        unsafe {
            let _ = raw::stream_synchronize(self.stream);
            for c in [self.eager, self.graph] {
                if raw_nccl::comm_finalize(c).is_ok() && raw_nccl::comm_destroy(c).is_ok() {
                    continue;
                }
                let _ = raw_nccl::comm_abort(c);
            }
            let _ = raw::stream_destroy(self.stream);
        }
    }
}

/// `kernels.rs`'s launch shape, for the raw launches: 256 threads a block, a block per 256
/// elements up to 65,535 (the kernels loop over the rest).
const BLOCK: u32 = 256;
fn grid(n: usize) -> u32 {
    (n as u64).div_ceil(u64::from(BLOCK)).clamp(1, 65_535) as u32
}

/// The raw ways' buffers, `n` floats each (null where the role does not use one).
struct RawBufs {
    n: usize,
    x: *mut f32,
    r: *mut f32,
    y: *mut f32,
    stream: cudaStream_t,
}

impl RawBufs {
    fn new(ctx: &RawCtx, role: Role, n: usize) -> handoff::Result<RawBufs> {
        let mut b = RawBufs {
            n,
            x: std::ptr::null_mut(),
            r: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            stream: ctx.stream,
        };
        let bytes = n * size_of::<f32>();
        // SAFETY: allocations ordered on the live raw stream, freed in `drop` on it.
        unsafe {
            if role.sends() {
                b.x = raw::malloc_async(bytes, ctx.stream)?.cast();
            }
            if role.receives() {
                b.r = raw::malloc_async(bytes, ctx.stream)?.cast();
                b.y = raw::malloc_async(bytes, ctx.stream)?.cast();
            }
        }
        Ok(b)
    }

    /// Zeroes y (the receiver's result) on the raw stream.
    fn clear_y(&self) -> handoff::Result<()> {
        if self.y.is_null() {
            return Ok(());
        }
        // SAFETY: y is live, n floats, ordered on the raw stream.
        unsafe { raw::memset_async(self.y.cast(), 0, self.n * size_of::<f32>(), self.stream) }
    }

    /// y on the host (after everything queued on the raw stream).
    fn y(&self) -> handoff::Result<Vec<f32>> {
        let mut host = vec![0f32; self.n];
        // SAFETY: y is live, n floats; `host` outlives the copy (the stream is synchronized).
        unsafe {
            raw::memcpy_async(
                host.as_mut_ptr().cast(),
                self.y.cast_const().cast(),
                self.n * size_of::<f32>(),
                cudaMemcpyKind::cudaMemcpyDeviceToHost,
                self.stream,
            )?;
            raw::stream_synchronize(self.stream)?;
        }
        Ok(host)
    }
}

impl Drop for RawBufs {
    fn drop(&mut self) {
        // SAFETY: each pointer came from `malloc_async` on this stream (or is null); the stream
        // is drained first, so no graph or round still uses them.
        unsafe {
            let _ = raw::stream_synchronize(self.stream);
            for p in [self.x, self.r, self.y] {
                if !p.is_null() {
                    let _ = raw::free_async(p.cast(), self.stream);
                }
            }
            let _ = raw::stream_synchronize(self.stream);
        }
    }
}

/// A raw round captured and instantiated; destroyed (after its replays) when dropped.
struct RawGraph {
    exec: cudaGraphExec_t,
    stream: cudaStream_t,
}

impl RawGraph {
    fn capture(ctx: &RawCtx, role: Role, b: &RawBufs) -> handoff::Result<RawGraph> {
        // SAFETY: the raw stream is live, not the default stream, not being captured; the
        // capture is ended on every path before returning; the graph is destroyed after
        // instantiation (the executable graph is independent of it).
        unsafe {
            raw::stream_begin_capture(ctx.stream)?;
            let ran = ctx.round(role, ctx.graph, b, GRAPH_ROUND);
            let graph = raw::stream_end_capture(ctx.stream);
            let graph = match (ran, graph) {
                (Ok(()), Ok(g)) => g,
                (ran, graph) => {
                    if let Ok(g) = graph {
                        let _ = raw::graph_destroy(g);
                    }
                    return Err(ran.err().or(graph.err()).expect("one of them failed"));
                }
            };
            let exec = raw::graph_instantiate(graph);
            let _ = raw::graph_destroy(graph);
            Ok(RawGraph {
                exec: exec?,
                stream: ctx.stream,
            })
        }
    }

    fn launch(&self) -> handoff::Result<()> {
        // SAFETY: the executable graph is live, of the raw stream's device; its buffers live
        // until after it (RawBufs drains the stream before freeing, and is dropped after it).
        unsafe { raw::graph_launch(self.exec, self.stream) }
    }
}

impl Drop for RawGraph {
    fn drop(&mut self) {
        // SAFETY: instantiated in `capture`, destroyed once; CUDA defers the destruction of a
        // graph still running until it completes.
        let _ = unsafe { raw::graph_exec_destroy(self.exec) };
    }
}

/// A raw NCCL unique id from its bytes.
fn raw_id(bytes: &[u8]) -> ncclUniqueId {
    let mut id = ncclUniqueId { internal: [0; 128] };
    for (d, s) in id.internal.iter_mut().zip(bytes) {
        *d = *s as std::ffi::c_char;
    }
    id
}

fn id_bytes(id: &ncclUniqueId) -> Vec<u8> {
    id.internal.iter().map(|&c| c as u8).collect()
}

// ---------------------------------------------------------------------------------------------
// The handoff side.

struct Setup {
    role: Role,
    rank: usize,
    dev: Device,
    /// The handoff eager way's communicator; graphs' communicators are split from it.
    comm: Communicator,
    /// handoff's stream (both handoff ways).
    s: Stream,
    label: String,
    /// [`harness::shared_gpu_note`]: the ranks share a GPU.
    note: Option<String>,
}

fn setup(o: &Opts, launch: Option<Launch>) -> handoff::Result<(Setup, RawCtx)> {
    match launch {
        Some(l) => {
            let comm = l.communicator(o.comm_options())?;
            let dev = comm.device().clone();
            let s = Stream::new(&dev)?;
            let (rank, world) = (comm.rank(), comm.world_size());
            if world != 2 {
                return Err(invalid(format!("procs mode runs two ranks, not {world}")));
            }
            let role = Role::of_rank(rank);
            // The raw communicators' ids: made by rank 0, sent to rank 1 over handoff's.
            let mut ids = DeviceBuffer::<u8>::zeros(2 * UniqueId::BYTES, &s)?;
            if rank == 0 {
                let mut bytes = id_bytes(&raw_nccl::get_unique_id()?);
                bytes.extend(id_bytes(&raw_nccl::get_unique_id()?));
                ids.copy_from_slice(&bytes, &s)?;
                comm.send(&ids, 1, &s)?;
            } else {
                comm.recv(&mut ids, 0, &s)?;
            }
            let bytes = ids.to_vec(&s)?;
            let (a, b) = bytes.split_at(UniqueId::BYTES);
            let raw = RawCtx::new(&dev, 2, rank, [raw_id(a), raw_id(b)])?;
            let label = if l.share_gpus {
                format!(
                    "two processes through the bootstrap, sharing GPUs (rank {rank} on GPU {} of {}, {})",
                    dev.ordinal(),
                    Device::count()?,
                    dev.name()?
                )
            } else {
                format!(
                    "two processes through the bootstrap, GPU {} -> GPU {} ({})",
                    o.devices[0],
                    o.devices[1],
                    dev.name()?
                )
            };
            Ok((
                Setup {
                    role,
                    rank,
                    dev,
                    comm,
                    s,
                    label,
                    note: harness::shared_gpu_note(&l),
                },
                raw,
            ))
        }
        None => {
            let dev = Device::new(o.devices[0])?;
            let comm = Communicator::with_options(1, 0, &UniqueId::new()?, o.comm_options(), &dev)?;
            let s = Stream::new(&dev)?;
            let raw = RawCtx::new(
                &dev,
                1,
                0,
                [raw_nccl::get_unique_id()?, raw_nccl::get_unique_id()?],
            )?;
            let label = format!(
                "one rank sending to itself on GPU {} ({})",
                o.devices[0],
                dev.name()?
            );
            Ok((
                Setup {
                    role: Role::Both,
                    rank: 0,
                    dev,
                    comm,
                    s,
                    label,
                    note: None,
                },
                raw,
            ))
        }
    }
}

/// handoff's buffers for one size (None where the role does not use one).
struct Bufs {
    x: Option<DeviceBuffer<f32>>,
    r: Option<DeviceBuffer<f32>>,
    y: Option<DeviceBuffer<f32>>,
}

/// One round through handoff's API on `s` and `comm`: A, send/receive, B, as `role` has it.
fn handoff_round(
    role: Role,
    s: &Stream,
    comm: &Communicator,
    b: &mut Bufs,
    round: u32,
) -> handoff::Result<()> {
    let peer = peer(role);
    if let Some(x) = b.x.as_mut() {
        kernels::produce(x, round, s)?;
    }
    match role {
        Role::Both => {
            let (x, r) = (b.x.as_ref().expect("x"), b.r.as_mut().expect("r"));
            group(|g| {
                g.send(comm, x, peer, s)?;
                g.recv(comm, r, peer, s)
            })?;
        }
        Role::Sender => comm.send(b.x.as_ref().expect("x"), peer, s)?,
        Role::Receiver => comm.recv(b.r.as_mut().expect("r"), peer, s)?,
    }
    if let (Some(r), Some(y)) = (b.r.as_ref(), b.y.as_mut()) {
        kernels::twice(r, y, s)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Timing and reporting.

/// One size's medians, per round, in µs: GPU-inclusive and host (enqueue only), by way.
struct Row {
    bytes: usize,
    count: usize,
    us: [f64; 4],
    host_us: [f64; 4],
}

impl Row {
    /// handoff graph - raw graph, µs per round.
    fn graph_over_raw(&self) -> f64 {
        self.us[HANDOFF_GRAPH] - self.us[RAW_GRAPH]
    }
    /// handoff eager / handoff graph: the graph's speedup.
    fn speedup(&self) -> f64 {
        self.us[HANDOFF_EAGER] / self.us[HANDOFF_GRAPH]
    }
    /// raw eager / raw graph.
    fn raw_speedup(&self) -> f64 {
        self.us[RAW_EAGER] / self.us[RAW_GRAPH]
    }
}

fn header() -> String {
    format!(
        "#{:>11} {:>9} | {:>9} {:>9} {:>9} {:>9} | {:>9} {:>9} {:>9} {:>9} | {:>10} {:>8} {:>8}",
        "size(B)",
        "count",
        "h-eager",
        "h-graph",
        "r-eager",
        "r-graph",
        "host:h-e",
        "h-g",
        "r-e",
        "r-g",
        "hg-rg(us)",
        "he/hg",
        "re/rg"
    )
}

fn line(r: &Row) -> String {
    let [he, hg, re, rg] = r.us;
    let [hhe, hhg, hre, hrg] = r.host_us;
    format!(
        "{:>12} {:>9} | {he:>9.2} {hg:>9.2} {re:>9.2} {rg:>9.2} | {hhe:>9.2} {hhg:>9.2} {hre:>9.2} {hrg:>9.2} | {:>10.2} {:>8.3} {:>8.3}",
        r.bytes,
        r.count,
        r.graph_over_raw(),
        r.speedup(),
        r.raw_speedup()
    )
}

fn csv(mode: &str, rows: &[Row]) -> String {
    use std::fmt::Write as _;
    let mut out = String::from(
        "mode,bytes,count,handoff_eager_us,handoff_graph_us,raw_eager_us,raw_graph_us,\
         handoff_eager_host_us,handoff_graph_host_us,raw_eager_host_us,raw_graph_host_us,\
         handoff_graph_minus_raw_graph_us,handoff_eager_over_graph,raw_eager_over_graph\n",
    );
    for r in rows {
        let [he, hg, re, rg] = r.us;
        let [hhe, hhg, hre, hrg] = r.host_us;
        let _ = writeln!(
            out,
            "{mode},{},{},{he:.3},{hg:.3},{re:.3},{rg:.3},{hhe:.3},{hhg:.3},{hre:.3},{hrg:.3},{:.3},{:.4},{:.4}",
            r.bytes,
            r.count,
            r.graph_over_raw(),
            r.speedup(),
            r.raw_speedup()
        );
    }
    out
}

/// The expected y of a round, where the first `n` elements are compared.
fn check(got: &[f32], round: u32, what: &str, bytes: usize) -> Option<String> {
    got.iter()
        .enumerate()
        .find(|&(i, &v)| v != 2.0 * kernels::produced_value(i, round))
        .map(|(i, &v)| {
            format!(
                "{what} at {bytes} B: y[{i}] = {v}, expected {}",
                2.0 * kernels::produced_value(i, round)
            )
        })
}

fn run(o: &Opts, launch: Option<Launch>) -> handoff::Result<()> {
    let (st, raw_ctx) = setup(o, launch)?;
    let role = st.role;
    let reports = st.rank == 0;
    let mode = match o.mode {
        Mode::SelfRank => "self",
        Mode::Procs => "procs",
    };
    if reports {
        println!("# handoff graphs benchmark, the article's round: {}", st.label);
        println!("# (the date and machine are in the header that scripts/device-run.sh prints)");
        println!(
            "# round = kernel A (x), send/recv x -> r, kernel B (y = 2r); f32; iters {} rounds per run | warmup {} | repeats {} (median) | rotating {} | handoff communicators {}",
            o.sweep.iters,
            o.sweep.warmup,
            o.sweep.repeats,
            WAYS.join(", "),
            if o.unverified { "unverified" } else { "verified" }
        );
        println!(
            "# raw ways: raw NCCL calls and raw launches (cudaLaunchKernel) of the same kernels, from the committed PTX; raw graph: cudaStreamBeginCapture/EndCapture, cudaGraphLaunch"
        );
        if role == Role::Sender {
            println!("# procs mode: times are rank 0's (A and the send; rank 1 receives and runs B)");
        }
        println!(
            "# per round, µs: GPU-inclusive (N rounds back to back, then synchronize, / N), then host (enqueue only); hg-rg = handoff graph - raw graph; he/hg, re/rg = eager / graph"
        );
        if let Some(note) = &st.note {
            println!("{note}");
        }
        println!("{}", header());
    }
    let mut sizes = vec![ARTICLE_BYTES];
    sizes.extend(
        o.sweep
            .sizes(size_of::<f32>())
            .into_iter()
            .filter(|&b| b != ARTICLE_BYTES),
    );
    let mut rows = Vec::new();
    let mut wrong = Vec::new();
    let mut round = 0u32;
    for bytes in sizes {
        let n = bytes / size_of::<f32>();
        let mut b = Bufs {
            x: role.sends().then(|| DeviceBuffer::zeros(n, &st.s)).transpose()?,
            r: role
                .receives()
                .then(|| DeviceBuffer::zeros(n, &st.s))
                .transpose()?,
            y: role
                .receives()
                .then(|| DeviceBuffer::zeros(n, &st.s))
                .transpose()?,
        };
        let rb = RawBufs::new(&raw_ctx, role, n)?;
        // The graph's own communicator: every rank splits, in the same order.
        let gcomm = st
            .comm
            .split(Some(0), st.rank as i32)?
            .ok_or_else(|| invalid("the split left this rank out".into()))?;
        let graph = Graph::capture_with(gcomm, &st.s, |s, c| {
            handoff_round(role, s, c, &mut b, GRAPH_ROUND)
        })?;
        let rgraph = RawGraph::capture(&raw_ctx, role, &rb)?;
        st.s.synchronize()?;
        raw_ctx.synchronize()?;

        let mut host: [Vec<f64>; 4] = Default::default();
        let us = o.sweep.time_rotating::<4, Error>(|way, iters, timed| {
            let t = Instant::now();
            for _ in 0..iters {
                round = round.wrapping_add(1);
                match way {
                    HANDOFF_EAGER => handoff_round(role, &st.s, &st.comm, &mut b, round)?,
                    HANDOFF_GRAPH => graph.launch(&st.s)?,
                    // SAFETY: `rb` holds this size's raw buffers for the role.
                    RAW_EAGER => unsafe { raw_ctx.round(role, raw_ctx.eager, &rb, round)? },
                    _ => rgraph.launch()?,
                }
            }
            let enqueued = t.elapsed();
            if way < RAW_EAGER {
                st.s.synchronize()?;
            } else {
                raw_ctx.synchronize()?;
            }
            let total = t.elapsed();
            if timed {
                host[way].push(enqueued.as_secs_f64() * 1e6 / iters as f64);
            }
            Ok(total.as_secs_f64() * 1e6)
        })?;
        let host_us = host.map(harness::median);

        // Check each way once, outside the timing: clear y, one round, compare.
        for (way, name) in WAYS.iter().enumerate() {
            if let Some(y) = b.y.as_mut() {
                y.memset_zero(&st.s)?;
            }
            rb.clear_y()?;
            let expect = if way == HANDOFF_GRAPH || way == RAW_GRAPH {
                GRAPH_ROUND
            } else {
                CHECK_ROUND
            };
            let got = match way {
                HANDOFF_EAGER | HANDOFF_GRAPH => {
                    if way == HANDOFF_EAGER {
                        handoff_round(role, &st.s, &st.comm, &mut b, CHECK_ROUND)?;
                    } else {
                        graph.launch(&st.s)?;
                    }
                    st.s.synchronize()?;
                    b.y.as_ref().map(|y| y.to_vec(&st.s)).transpose()?
                }
                _ => {
                    if way == RAW_EAGER {
                        // SAFETY: as above.
                        unsafe { raw_ctx.round(role, raw_ctx.eager, &rb, CHECK_ROUND)? };
                    } else {
                        rgraph.launch()?;
                    }
                    raw_ctx.synchronize()?;
                    role.receives().then(|| rb.y()).transpose()?
                }
            };
            if let Some(got) = got {
                wrong.extend(check(&got, expect, name, bytes));
            }
        }
        st.s.synchronize()?;
        raw_ctx.synchronize()?;
        // The graphs before the buffers and communicators they use.
        drop(rgraph);
        drop(graph);
        drop(rb);
        drop(b);

        let row = Row {
            bytes,
            count: n,
            us,
            host_us,
        };
        if reports {
            println!("{}", line(&row));
        }
        rows.push(row);
    }
    if reports {
        if let Some(a) = rows.iter().find(|r| r.bytes == ARTICLE_BYTES) {
            println!(
                "# at {ARTICLE_BYTES} B (the article's x): handoff graph - raw graph {:.2} µs per round; eager/graph speedup: handoff {:.2}x, raw {:.2}x; host per round: handoff eager {:.2} µs, handoff graph {:.2} µs, raw eager {:.2} µs, raw graph {:.2} µs",
                a.graph_over_raw(),
                a.speedup(),
                a.raw_speedup(),
                a.host_us[HANDOFF_EAGER],
                a.host_us[HANDOFF_GRAPH],
                a.host_us[RAW_EAGER],
                a.host_us[RAW_GRAPH]
            );
        }
        if let Some(path) = &o.csv {
            std::fs::write(path, csv(mode, &rows)).map_err(|e| invalid(format!("writing {path}: {e}")))?;
            println!("# wrote {path}");
        }
    }
    st.s.synchronize()?;
    drop(raw_ctx);
    st.dev.synchronize()?;
    st.comm.finalize()?;
    if !wrong.is_empty() {
        return Err(invalid(format!("wrong results: {}", wrong.join("; "))));
    }
    Ok(())
}
