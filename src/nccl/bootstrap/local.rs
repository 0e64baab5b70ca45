//! Ranks started on this machine ([`spawn_local`]), and ranks that share a GPU.
//!
//! NCCL refuses two ranks of one communicator on one GPU of one host ("Duplicate GPU
//! detected"): it compares the ranks' bus ids and host hashes. A process computes its host hash
//! once, at its first NCCL call, from `NCCL_HOSTID` where set (else the hostname and boot id).
//! A rank process with a host id of its own is therefore, to NCCL, a host of its own: NCCL
//! connects it to the others through its network transport (here the socket transport over
//! loopback), never peer-to-peer or shared memory, and lets it share a GPU. That is correct but
//! not fast (no NVLink, every byte through the kernel's sockets): a development mode, for
//! running multi-rank code and its tests on fewer GPUs than ranks, not for measuring.
//!
//! Threads of one process share its host id, so ranks that share a GPU must be processes.
//! handoff's own verification is unchanged: it finds ranks of one machine by the boot id, not
//! by NCCL's host id, and checks them through shared memory as before.

use std::sync::Once;

use super::secret::{SECRET_FILE_VAR, SECRET_VAR, Secret};
use crate::engine::device::Device;
use crate::error::{Error, Result};

/// The variable that turns GPU sharing on for a rank process: `1` (or `true`, `yes`, `on`) on,
/// `0` (or `false`, `no`, `off`, empty) off.
pub const SHARE_GPUS_VAR: &str = "HANDOFF_SHARE_GPUS";

/// Where [`spawn_local_with`] puts its ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum GpuSharing {
    /// One GPU per rank: rank `r` on GPU `r`, NCCL's fast paths between them. The ranks still
    /// share GPUs if this process has `HANDOFF_SHARE_GPUS=1` set.
    #[default]
    Never,
    /// Ranks round-robin over the visible GPUs (rank `r` on GPU `r % count`), each process with
    /// its own NCCL host id over NCCL's socket transport: correct, not fast.
    Always,
    /// [`GpuSharing::Always`] when there are more ranks than visible GPUs, else
    /// [`GpuSharing::Never`]: what a test or an example that must run anywhere wants.
    WhenFewerGpus,
}

/// Whether `value` of [`SHARE_GPUS_VAR`] turns sharing on.
///
/// # Errors
/// [`Error::InvalidArgument`] for a value that is neither on nor off.
pub(crate) fn parse_share(value: Option<&str>) -> Result<bool> {
    let Some(v) = value else { return Ok(false) };
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "" | "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::InvalidArgument(format!(
            "{SHARE_GPUS_VAR}={v:?} is neither 1 nor 0"
        ))),
    }
}

/// NCCL's variables for rank `rank`'s process when ranks share GPUs, given the environment
/// `var`: a host id of its own, and NCCL's socket transport over loopback unless the
/// environment picks a network and an interface already. The one rule for both ways a rank
/// gets them: [`spawn_local_with`] sets them on the process it starts, [`apply`] in a process a
/// launcher started.
pub(crate) fn rank_env(rank: usize, var: impl Fn(&str) -> Option<String>) -> [(&'static str, String); 3] {
    // Unique among the ranks of any communicator this process joins; the same NCCL_HOSTID on
    // every rank (a launcher passes one environment to all) is exactly what must not stay.
    let host = ("NCCL_HOSTID", format!("handoff-shared-gpu-rank-{rank}"));
    let keep = |name: &'static str, default: &str| (name, var(name).unwrap_or_else(|| default.to_string()));
    [host, keep("NCCL_NET", "Socket"), keep("NCCL_SOCKET_IFNAME", "lo")]
}

/// The threads of this process, from `/proc/self/status`; `None` where it cannot be read.
fn threads() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
}

/// Gives this process, rank `rank` of a launcher's job that shares GPUs, the variables of
/// [`rank_env`] before NCCL starts, and says once (on rank 0) what the mode is.
///
/// # Errors
/// [`Error::InvalidArgument`] when a variable is missing or different and cannot be set
/// safely: NCCL has already been opened in this process (it read them), or the process runs
/// other threads (one of them could be reading the environment). It names what to export.
pub(crate) fn apply(rank: usize) -> Result<()> {
    let wanted = rank_env(rank, |k| std::env::var(k).ok());
    let differ: Vec<&(&str, String)> = wanted
        .iter()
        .filter(|(k, v)| std::env::var(k).ok().as_deref() != Some(v.as_str()))
        .collect();
    if !differ.is_empty() {
        let exports = differ
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ");
        let refuse = |why: String| {
            Error::InvalidArgument(format!(
                "{SHARE_GPUS_VAR}=1 needs {exports} in rank {rank}'s environment before NCCL \
                 starts, and handoff cannot set them now: {why}. Call Launch::from_env() first \
                 thing in main, or export them for this rank"
            ))
        };
        if crate::sys::loader::nccl_opened() {
            return Err(refuse(
                "NCCL is already open in this process and has read them".into(),
            ));
        }
        match threads() {
            Some(1) => {}
            Some(n) => return Err(refuse(format!("this process runs {n} threads"))),
            None => return Err(refuse("/proc/self/status gives no thread count".into())),
        }
        for (k, v) in differ {
            // SAFETY: the environment is written while this process has one thread, the one
            // running here, so no other thread can be reading or writing it (the data race
            // that makes `set_var` unsafe); only this thread could start another, and it does
            // not until the loop ends.
            unsafe { std::env::set_var(k, v) };
        }
    }
    if rank == 0 {
        static SAID: Once = Once::new();
        SAID.call_once(|| {
            eprintln!(
                "handoff: {SHARE_GPUS_VAR}=1: ranks share GPUs, each process its own NCCL host \
                 id, through NCCL's socket transport ({}): a development mode, correct but not \
                 fast (no NVLink or shared memory); its figures are not performance figures",
                std::env::var("NCCL_SOCKET_IFNAME").unwrap_or_default()
            )
        });
    }
    Ok(())
}

/// The GPU a rank of local index `local_rank` takes: the one of that index, or when ranks share
/// GPUs, `local_rank` modulo the visible GPUs.
///
/// # Errors
/// [`Error::NoDevice`] when that GPU is not visible, or none is; CUDA errors.
pub(crate) fn rank_device(local_rank: usize, share: bool) -> Result<Device> {
    if !share {
        return Device::new(local_rank);
    }
    match Device::count()? {
        0 => Err(Error::NoDevice {
            reason: "the CUDA runtime reports 0 devices".into(),
        }),
        n => Device::new(local_rank % n),
    }
}

/// Where rank 0 of a local launch serves the unique id: a loopback address drawn at random
/// (all of 127.0.0.0/8 is this host's; not 127.0.0.x, where the rest of the host's loopback
/// traffic is) and a port of 20000-29999: nothing else binds that address. Never
/// a port found free by binding it for a moment: a process that another thread spawns at that
/// moment inherits the listener until it execs, and rank 0's bind then fails (seen on the
/// 16-core H200 machine with many launches at once).
fn local_master() -> std::io::Result<std::net::SocketAddrV4> {
    let mut b = [0u8; 5];
    loop {
        super::secret::random(&mut b)?;
        if (b[0], b[1]) != (0, 0) && !matches!(b[2], 0 | 255) {
            let ip = std::net::Ipv4Addr::new(127, b[0], b[1], b[2]);
            let port = 20_000 + u16::from_le_bytes([b[3], b[4]]) % 10_000;
            return Ok(std::net::SocketAddrV4::new(ip, port));
        }
    }
}

/// Starts `world` copies of the running executable on this machine, one rank each, one GPU
/// each: [`spawn_local_with`] and [`GpuSharing::Never`].
///
/// # Errors
/// As [`spawn_local_with`].
pub fn spawn_local(
    world: usize,
    configure: impl FnMut(usize, &mut std::process::Command),
) -> Result<LocalJob> {
    spawn_local_with(world, GpuSharing::Never, configure)
}

/// Starts `world` copies of the running executable on this machine, one rank each, as a
/// launcher would: rank `r` gets `RANK=r`, `WORLD_SIZE`, `LOCAL_RANK=r`, and a `MASTER_ADDR`
/// and `MASTER_PORT` of this launch's own (a loopback address drawn for it, 127.a.b.c, and a
/// port of 20000-29999), and inherits the rest of the environment
/// (`NCCL_*` included). Unless this process has `HANDOFF_SECRET` or `HANDOFF_SECRET_FILE` set,
/// the ranks get a fresh random `HANDOFF_SECRET`, so that no other local process can fetch
/// their id. `configure` may change each rank's command (arguments, variables, redirections)
/// before it starts. Returns the [`LocalJob`] of the ranks: wait for it
/// ([`LocalJob::wait_timeout`]); dropping it kills the ranks still running.
///
/// Where `sharing` says so (or this process has `HANDOFF_SHARE_GPUS=1`), the ranks share the
/// visible GPUs round-robin: each gets `HANDOFF_SHARE_GPUS=1`, an `NCCL_HOSTID` of its own,
/// and NCCL's socket transport over loopback unless `NCCL_NET` and `NCCL_SOCKET_IFNAME` are set;
/// [`Launch::communicator`](super::Launch::communicator) then puts rank `r` on GPU
/// `r % count`. See the [module](super) docs for what that costs.
///
/// # Errors
/// [`Error::Bootstrap`] when no address or secret can be drawn from /dev/urandom, or a process
/// cannot be started (the ranks already started are then killed); [`Error::InvalidArgument`]
/// for a malformed `HANDOFF_SHARE_GPUS`; with [`GpuSharing::WhenFewerGpus`], the errors of
/// [`Device::count`].
pub fn spawn_local_with(
    world: usize,
    sharing: GpuSharing,
    mut configure: impl FnMut(usize, &mut std::process::Command),
) -> Result<LocalJob> {
    let fail = job_error;
    let inherited = std::env::var_os(SHARE_GPUS_VAR).map(|v| v.to_string_lossy().into_owned());
    let share = parse_share(inherited.as_deref())?
        || match sharing {
            GpuSharing::Never => false,
            GpuSharing::Always => true,
            GpuSharing::WhenFewerGpus => world > Device::count()?,
        };
    let master = local_master().map_err(|e| fail(format!("cannot draw an address: {e}")))?;
    let exe = std::env::current_exe().map_err(|e| fail(format!("cannot find this executable: {e}")))?;
    let secret = match (std::env::var_os(SECRET_VAR), std::env::var_os(SECRET_FILE_VAR)) {
        (None, None) => Some(Secret::random_hex().map_err(|e| fail(format!("cannot draw a secret: {e}")))?),
        _ => None,
    };
    // Built as the ranks start: on an error (or a panic in `configure`) the job holding the
    // ranks started so far drops, which kills and reaps them.
    let mut job = LocalJob {
        children: Vec::with_capacity(world),
        forwarders: Vec::new(),
    };
    for rank in 0..world {
        let mut cmd = std::process::Command::new(&exe);
        cmd.env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("MASTER_ADDR", master.ip().to_string())
            .env("MASTER_PORT", master.port().to_string());
        if let Some(s) = &secret {
            cmd.env(SECRET_VAR, s);
        }
        if share {
            cmd.env(SHARE_GPUS_VAR, "1");
            // Set here, before the child runs, so that it never has to write its own
            // environment.
            for (k, v) in rank_env(rank, |k| std::env::var(k).ok()) {
                cmd.env(k, v);
            }
        }
        configure(rank, &mut cmd);
        let child = cmd
            .spawn()
            .map_err(|e| fail(format!("cannot start rank {rank}: {e}")))?;
        job.children.push(child);
    }
    Ok(job)
}

/// The error of starting or watching a local job's processes (as before the job handle: no
/// address is involved yet, so the loopback network's).
fn job_error(detail: String) -> Error {
    Error::Bootstrap {
        addr: "127.0.0.1".into(),
        detail,
    }
}

/// The ranks that [`spawn_local`] or [`spawn_local_with`] started, in rank order.
///
/// Wait for them with [`LocalJob::wait_timeout`] (or [`LocalJob::wait`]): one [`JobExit`] with
/// every rank's exit status and the output it piped, and [`JobExit::check`] for an error
/// naming the ranks that failed or were killed. [`LocalJob::prefix_output`] forwards the
/// ranks' piped output to this process, each line prefixed `[rank r] `. The children stay
/// reachable ([`LocalJob::child_mut`], [`LocalJob::kill`]) for callers that read a rank's
/// output as it runs or end one on purpose.
///
/// Dropping the job kills the ranks still running (SIGKILL) and reaps them, so that no rank
/// outlives its handle, as a zombie or running; [`LocalJob::into_children`] gives them up
/// instead. A killed process ends only once the kernel lets it: one in uninterruptible sleep
/// (in the GPU driver, say) ends when that call returns, which may be never. So the drop waits
/// at most 5 s for the killed ranks, and hands those that have not ended by then to a thread
/// (`handoff-job-reaper`) that reaps each when it ends; the drop never blocks longer.
#[derive(Debug)]
#[must_use = "dropping a LocalJob kills its ranks"]
pub struct LocalJob {
    children: Vec<std::process::Child>,
    /// The threads of [`LocalJob::prefix_output`], joined once the ranks have exited.
    forwarders: Vec<std::thread::JoinHandle<()>>,
}

/// How long a killed rank is waited for before it is left to a reaper thread: long enough for
/// a GPU process's teardown (the driver frees its memory as it exits), short enough that a
/// rank stuck in the kernel does not hold the caller.
const REAP_BOUND: std::time::Duration = std::time::Duration::from_secs(5);

/// How one rank of a [`LocalJob`] ended.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RankExit {
    /// The rank.
    pub rank: usize,
    /// Its exit status; `None` only for a rank killed at the deadline of
    /// [`LocalJob::wait_timeout`] that had not ended 5 s after the kill (stuck in the kernel,
    /// e.g. in the GPU driver): a thread of the job reaps it when it ends.
    pub status: Option<std::process::ExitStatus>,
    /// Whether the rank still ran at the deadline of [`LocalJob::wait_timeout`] and was killed
    /// then.
    pub timed_out: bool,
    /// Its standard output, where it was piped and neither taken by the caller nor forwarded
    /// ([`LocalJob::prefix_output`]); empty otherwise. For a rank killed at the deadline, what
    /// it wrote until then. Invalid UTF-8 is replaced.
    pub stdout: String,
    /// Its standard error, as `stdout`.
    pub stderr: String,
}

impl RankExit {
    /// Whether the rank exited successfully (status 0).
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    /// Whether the rank was ended by a signal (killed) rather than exiting, or was killed at
    /// the deadline and had not ended yet.
    pub fn killed(&self) -> bool {
        use std::os::unix::process::ExitStatusExt;
        self.status.map_or(self.timed_out, |s| s.signal().is_some())
    }
}

/// How the rank ended, in a sentence: `rank 1 failed (exit status: 3)`.
impl std::fmt::Display for RankExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rank = self.rank;
        match (self.status, self.timed_out) {
            (None, _) => write!(
                f,
                "rank {rank} still ran at the deadline, was killed, and had not ended \
                 {REAP_BOUND:?} later (stuck in the kernel, e.g. in the GPU driver)"
            ),
            (Some(s), true) => write!(f, "rank {rank} still ran at the deadline and was killed ({s})"),
            (Some(s), false) if s.success() => write!(f, "rank {rank} succeeded ({s})"),
            (Some(s), false) if self.killed() => write!(f, "rank {rank} was killed ({s})"),
            (Some(s), false) => write!(f, "rank {rank} failed ({s})"),
        }
    }
}

/// Every rank's end, from [`LocalJob::wait_timeout`] or [`LocalJob::wait`], in rank order.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct JobExit {
    /// One per rank, in rank order.
    pub ranks: Vec<RankExit>,
    /// The deadline of [`LocalJob::wait_timeout`], when it passed with ranks still running
    /// (those have [`RankExit::timed_out`] set).
    pub timed_out: Option<std::time::Duration>,
}

impl JobExit {
    /// Whether every rank exited successfully (status 0).
    pub fn success(&self) -> bool {
        self.ranks.iter().all(RankExit::success)
    }

    /// The ranks that did not exit successfully (failed, killed, or still running at the
    /// deadline), in rank order.
    pub fn failed(&self) -> Vec<usize> {
        self.ranks
            .iter()
            .filter(|r| !r.success())
            .map(|r| r.rank)
            .collect()
    }

    /// `Ok` when every rank exited successfully.
    ///
    /// # Errors
    /// [`Error::RanksFailed`] naming each rank that failed (with its exit status), was killed
    /// (with the signal), or still ran at the deadline; with `after` set (its
    /// [`kind`](Error::kind) is [`ErrorKind::Timeout`](crate::ErrorKind::Timeout)) when the
    /// deadline passed with ranks still running.
    pub fn check(&self) -> Result<()> {
        let failed: Vec<&RankExit> = self.ranks.iter().filter(|r| !r.success()).collect();
        if failed.is_empty() {
            return Ok(());
        }
        let each: Vec<String> = failed.iter().map(|r| r.to_string()).collect();
        let (n, world) = (failed.len(), self.ranks.len());
        let detail = match self.timed_out {
            None => format!(
                "{n} of the {world} ranks of the local job did not succeed: {}",
                each.join(", ")
            ),
            Some(t) => format!(
                "{n} of the {world} ranks of the local job did not succeed within {t:?}: {}. \
                 Give them longer, or see what each wrote (JobExit::ranks) for where it stopped",
                each.join(", ")
            ),
        };
        Err(Error::RanksFailed {
            ranks: failed.iter().map(|r| r.rank).collect(),
            detail,
            after: self.timed_out,
        })
    }
}

/// A process that a [`LocalJob`] ends: a rank's [`std::process::Child`], or in tests one whose
/// end is injected (a process that does not end when killed cannot be made on demand).
trait Process: Send + 'static {
    /// Its exit status, reaping it, if it has ended.
    fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>>;
    /// Sends it SIGKILL.
    fn kill(&mut self) -> std::io::Result<()>;
    /// Blocks until it ends, and reaps it.
    fn wait(&mut self) -> std::io::Result<std::process::ExitStatus>;
}

impl Process for std::process::Child {
    fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        std::process::Child::try_wait(self)
    }
    fn kill(&mut self) -> std::io::Result<()> {
        std::process::Child::kill(self)
    }
    fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        std::process::Child::wait(self)
    }
}

/// Polls each process of `procs` whose entry of `statuses` is `None` until every one has ended
/// or `until` passes, filling in the status of each that ended. One that cannot be waited for
/// (reaped by someone else) stays `None` and is not polled again.
fn reap_until<P: Process>(
    procs: &mut [P],
    statuses: &mut [Option<std::process::ExitStatus>],
    until: std::time::Instant,
) {
    let mut pending: Vec<bool> = statuses.iter().map(Option::is_none).collect();
    let mut pause = std::time::Duration::from_micros(100);
    loop {
        for ((p, s), wait) in procs.iter_mut().zip(statuses.iter_mut()).zip(&mut pending) {
            if *wait {
                match p.try_wait() {
                    Ok(None) => {}
                    Ok(Some(status)) => (*s, *wait) = (Some(status), false),
                    Err(_) => *wait = false,
                }
            }
        }
        let now = std::time::Instant::now();
        if !pending.contains(&true) || now >= until {
            return;
        }
        std::thread::sleep(pause.min(until - now));
        pause = (pause * 2).min(std::time::Duration::from_millis(10));
    }
}

/// Kills each process of `procs` that still runs (SIGKILL) and waits at most `bound` for them
/// all to end. Returns, in order, each one's exit status (`None` where it had not ended by
/// then) and whether it was killed here. Those not ended go to one thread,
/// `handoff-job-reaper`, that waits for each and so reaps it when it ends; where no thread can
/// be started they are left unreaped until this process exits. Never blocks much past `bound`.
fn end_within<P: Process>(
    mut procs: Vec<P>,
    bound: std::time::Duration,
) -> Vec<(Option<std::process::ExitStatus>, bool)> {
    let until = std::time::Instant::now() + bound;
    let mut statuses = Vec::with_capacity(procs.len());
    let mut killed = Vec::with_capacity(procs.len());
    for p in &mut procs {
        let status = p.try_wait().ok().flatten();
        // A process that ended between the two calls ignores the signal; its status says so.
        killed.push(status.is_none() && p.kill().is_ok());
        statuses.push(status);
    }
    reap_until(&mut procs, &mut statuses, until);
    let left: Vec<P> = procs
        .into_iter()
        .zip(&statuses)
        .filter(|(_, s)| s.is_none())
        .map(|(p, _)| p)
        .collect();
    if !left.is_empty() {
        let _ = std::thread::Builder::new()
            .name("handoff-job-reaper".into())
            .spawn(move || {
                for mut p in left {
                    let _ = p.wait();
                }
            });
    }
    statuses.into_iter().zip(killed).collect()
}

/// Reads `pipe` to its end on a thread of its own, so that a rank that fills the pipe never
/// blocks on it.
fn read_all(mut pipe: impl std::io::Read + Send + 'static) -> Result<std::thread::JoinHandle<Vec<u8>>> {
    std::thread::Builder::new()
        .name("handoff-job-output".into())
        .spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
        .map_err(|e| job_error(format!("cannot start a thread to read a rank's output: {e}")))
}

/// `handle`'s result once its thread ends, or `None` when it has not by `until` (it is then left
/// running, detached) or panicked.
fn joined_by<T>(handle: std::thread::JoinHandle<T>, until: Option<std::time::Instant>) -> Option<T> {
    if let Some(until) = until {
        while !handle.is_finished() {
            if std::time::Instant::now() >= until {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    handle.join().ok()
}

/// Copies `pipe` line by line to `sink`, each line prefixed `[rank r] ` and ended by a
/// newline, on a thread of its own; the thread ends at the pipe's end.
fn forward(
    rank: usize,
    pipe: impl std::io::Read + Send + 'static,
    sink: impl Fn(&[u8]) + Send + 'static,
) -> Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("handoff-rank-{rank}-output"))
        .spawn(move || {
            use std::io::BufRead;
            let mut lines = std::io::BufReader::new(pipe);
            let mut line = Vec::new();
            loop {
                line.clear();
                match lines.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                // One write per line: the lines of different ranks interleave, never their
                // characters.
                let mut text = format!("[rank {rank}] ").into_bytes();
                text.extend_from_slice(&line);
                sink(&text);
            }
        })
        .map_err(|e| {
            job_error(format!(
                "cannot start a thread to forward rank {rank}'s output: {e}"
            ))
        })
}

impl LocalJob {
    /// The number of ranks.
    pub fn len(&self) -> usize {
        self.children.len()
    }

    /// Whether the job has no ranks (`world` 0).
    pub fn is_empty(&self) -> bool {
        self.children.is_empty()
    }

    /// Rank `rank`'s process, e.g. to take its piped stdout and read it as it runs (what is
    /// left in the child is read by [`LocalJob::wait_timeout`]).
    ///
    /// # Panics
    /// If `rank` is not below [`LocalJob::len`].
    pub fn child_mut(&mut self, rank: usize) -> &mut std::process::Child {
        &mut self.children[rank]
    }

    /// Every rank's process, in rank order.
    pub fn children(&self) -> &[std::process::Child] {
        &self.children
    }

    /// Kills rank `rank` (SIGKILL) and waits at most 5 s for it to end, reaping it; nothing if
    /// it has exited already. Its status is then in [`LocalJob::wait_timeout`]'s result,
    /// killed. A rank that has not ended 5 s after the kill (stuck in the kernel, e.g. in the
    /// GPU driver) is left killed but unreaped: the job's wait or drop reaps it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a rank not below [`LocalJob::len`]; [`Error::Bootstrap`]
    /// when the process cannot be killed.
    pub fn kill(&mut self, rank: usize) -> Result<()> {
        let world = self.children.len();
        let child = self
            .children
            .get_mut(rank)
            .ok_or_else(|| Error::InvalidArgument(format!("rank {rank} is not in a job of {world} ranks")))?;
        child
            .kill()
            .map_err(|e| job_error(format!("cannot kill rank {rank}: {e}")))?;
        reap_until(
            std::slice::from_mut(child),
            &mut [None],
            std::time::Instant::now() + REAP_BOUND,
        );
        Ok(())
    }

    /// Forwards the ranks' piped stdout and stderr to this process's stdout and stderr, line by
    /// line, each line prefixed `[rank r] ` (one thread per pipe). Only pipes that `configure`
    /// asked for (`cmd.stdout(Stdio::piped())`) and that are still in the children are
    /// forwarded; their output is then not in [`RankExit::stdout`] and `stderr`.
    ///
    /// # Errors
    /// [`Error::Bootstrap`] when a thread cannot be started (the pipes already handed to a
    /// thread stay forwarded).
    pub fn prefix_output(&mut self) -> Result<&mut Self> {
        for (rank, child) in self.children.iter_mut().enumerate() {
            // A closed stdout or stderr only loses the rank's output.
            if let Some(out) = child.stdout.take() {
                let sink = |b: &[u8]| drop(std::io::Write::write_all(&mut std::io::stdout(), b));
                self.forwarders.push(forward(rank, out, sink)?);
            }
            if let Some(err) = child.stderr.take() {
                let sink = |b: &[u8]| drop(std::io::Write::write_all(&mut std::io::stderr(), b));
                self.forwarders.push(forward(rank, err, sink)?);
            }
        }
        Ok(self)
    }

    /// Waits for every rank to exit, however long it takes; see [`LocalJob::wait_timeout`].
    ///
    /// # Errors
    /// As [`LocalJob::wait_timeout`], less the deadline.
    pub fn wait(self) -> Result<JobExit> {
        self.finish(None)
    }

    /// Waits for every rank to exit, reading what each piped to stdout and stderr meanwhile
    /// (the pipes still in the children), for at most `timeout`; returns every rank's status
    /// and output, successful or not ([`JobExit::check`] turns failures into an error). Output
    /// a process started by a rank still writes into its pipe after the rank exited is read
    /// until the deadline (at least half a second after the last rank exited), then cut.
    ///
    /// Ranks still running at the deadline are killed (SIGKILL) and waited for at most 5 s
    /// more (as the job's drop does); the result still holds every rank: those that ended
    /// before with their status and output, those killed with [`RankExit::timed_out`] set and
    /// what they wrote until then, and [`JobExit::timed_out`] the deadline, which
    /// [`JobExit::check`] reports as a timeout. So the call returns within about `timeout`
    /// plus 5.5 s.
    ///
    /// # Errors
    /// [`Error::Bootstrap`] when a rank cannot be waited for or a reading thread cannot be
    /// started (the ranks are then killed as the job drops).
    pub fn wait_timeout(self, timeout: std::time::Duration) -> Result<JobExit> {
        self.finish(Some(timeout))
    }

    fn finish(mut self, timeout: Option<std::time::Duration>) -> Result<JobExit> {
        let start = std::time::Instant::now();
        let mut readers = Vec::with_capacity(self.children.len());
        for child in &mut self.children {
            let out = child.stdout.take().map(read_all).transpose()?;
            let err = child.stderr.take().map(read_all).transpose()?;
            readers.push((out, err));
        }
        let world = self.children.len();
        let mut statuses = vec![None; world];
        let mut timed_out = vec![false; world];
        let mut passed = None;
        loop {
            for (rank, child) in self.children.iter_mut().enumerate() {
                if statuses[rank].is_none() {
                    statuses[rank] = child
                        .try_wait()
                        .map_err(|e| job_error(format!("cannot wait for rank {rank}: {e}")))?;
                }
            }
            if statuses.iter().all(Option::is_some) {
                break;
            }
            if let Some(t) = timeout
                && start.elapsed() >= t
            {
                // The ranks that ended keep their statuses; the rest are killed now.
                let ended = end_within(std::mem::take(&mut self.children), REAP_BOUND);
                for (rank, (status, killed)) in ended.into_iter().enumerate() {
                    // Killed, unless it ended successfully just before the signal.
                    timed_out[rank] = killed && !status.is_some_and(|s| s.success());
                    statuses[rank] = status;
                }
                passed = Some(t);
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        // Every rank has ended or been killed: the pipes reach their ends, unless a process a
        // rank started holds them still. Under a deadline the threads reading them get what is
        // left of it (at least half a second), then are left to finish alone, their output cut
        // there.
        let until = timeout.map(|t| {
            let now = std::time::Instant::now();
            now + t
                .saturating_sub(start.elapsed())
                .max(std::time::Duration::from_millis(500))
        });
        for f in self.forwarders.drain(..) {
            let _ = joined_by(f, until);
        }
        let text = |r: Option<std::thread::JoinHandle<Vec<u8>>>| {
            r.and_then(|h| joined_by(h, until))
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default()
        };
        let ranks = readers
            .into_iter()
            .zip(statuses.into_iter().zip(timed_out))
            .enumerate()
            .map(|(rank, ((out, err), (status, timed_out)))| RankExit {
                rank,
                status,
                timed_out,
                stdout: text(out),
                stderr: text(err),
            })
            .collect();
        Ok(JobExit {
            ranks,
            timed_out: passed,
        })
    }

    /// Gives up the children, in rank order: the job no longer kills them on drop; the caller
    /// waits for them. Output already being forwarded ([`LocalJob::prefix_output`]) still is.
    pub fn into_children(mut self) -> Vec<std::process::Child> {
        std::mem::take(&mut self.children)
    }
}

impl Drop for LocalJob {
    fn drop(&mut self) {
        // Ranks that exited answer at once; the rest are killed, then reaped (or left to the
        // reaper thread past the bound).
        end_within(std::mem::take(&mut self.children), REAP_BOUND);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::ffi::OsString;
    use std::time::{Duration, Instant};

    /// The variables [`spawn_local_with`] gives rank `rank`'s process, for tests: what
    /// `configure` sees already set on the command.
    fn command_env(cmd: &std::process::Command) -> Vec<(OsString, Option<OsString>)> {
        cmd.get_envs()
            .map(|(k, v)| (k.to_owned(), v.map(|v| v.to_owned())))
            .collect()
    }

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn each_rank_gets_a_host_id_of_its_own_and_loopback_sockets_unless_chosen() {
        let env = vars(&[("NCCL_HOSTID", "the-launchers-one")]);
        let ids: Vec<String> = (0..8).map(|r| rank_env(r, &env)[0].1.clone()).collect();
        let distinct: std::collections::BTreeSet<&String> = ids.iter().collect();
        assert_eq!(distinct.len(), 8, "{ids:?}");
        assert!(ids.iter().all(|i| i != "the-launchers-one"), "{ids:?}");
        assert_eq!(
            rank_env(3, vars(&[]))[1..],
            [("NCCL_NET", "Socket".into()), ("NCCL_SOCKET_IFNAME", "lo".into())]
        );
        // A network and an interface the user chose are kept.
        let chosen = vars(&[("NCCL_NET", "IB"), ("NCCL_SOCKET_IFNAME", "eth0")]);
        assert_eq!(
            rank_env(0, chosen)[1..],
            [("NCCL_NET", "IB".into()), ("NCCL_SOCKET_IFNAME", "eth0".into())]
        );
        // The same rank, the same id: a process that already has its variables keeps them.
        assert_eq!(rank_env(5, vars(&[])), rank_env(5, vars(&[])));
    }

    #[test]
    fn the_switch_is_on_off_or_named_as_malformed() {
        for on in ["1", "true", "YES", " on "] {
            assert!(parse_share(Some(on)).unwrap(), "{on}");
        }
        for off in ["0", "", "false", "No", "off"] {
            assert!(!parse_share(Some(off)).unwrap(), "{off}");
        }
        assert!(!parse_share(None).unwrap());
        let e = parse_share(Some("2")).unwrap_err().to_string();
        assert!(e.contains("HANDOFF_SHARE_GPUS=\"2\""), "{e}");
    }

    #[test]
    fn shared_ranks_are_started_with_their_variables_set() {
        // Each rank is this test binary listing its tests (and exiting); `configure` sees each
        // command as it starts.
        let mut seen = Vec::new();
        let job = spawn_local_with(3, GpuSharing::Always, |rank, cmd| {
            cmd.arg("--list").stdout(std::process::Stdio::null());
            seen.push((rank, command_env(cmd)));
        })
        .unwrap();
        job.wait_timeout(Duration::from_secs(60))
            .unwrap()
            .check()
            .unwrap();
        let get = |env: &[(OsString, Option<OsString>)], k: &str| {
            env.iter()
                .find(|(n, _)| n == k)
                .and_then(|(_, v)| v.clone())
                .map(|v| v.to_string_lossy().into_owned())
        };
        assert_eq!(seen.len(), 3);
        let mut ids = std::collections::BTreeSet::new();
        for (rank, env) in &seen {
            assert_eq!(get(env, SHARE_GPUS_VAR).as_deref(), Some("1"));
            for (k, v) in rank_env(*rank, |k| std::env::var(k).ok()) {
                assert_eq!(get(env, k), Some(v), "rank {rank}: {k}");
            }
            assert_eq!(get(env, "LOCAL_RANK"), Some(rank.to_string()));
            ids.insert(get(env, "NCCL_HOSTID"));
        }
        assert_eq!(ids.len(), 3, "{ids:?}");
    }

    /// Set on the ranks the job tests start: what [`job_child_role`] makes each do.
    const ROLE_VAR: &str = "HANDOFF_LOCAL_JOB_TEST_ROLE";

    /// A job of `roles.len()` ranks of this test binary, rank `r` playing `roles[r]` in
    /// [`job_child_role`], its stdout and stderr piped.
    fn job(roles: &'static [&'static str]) -> LocalJob {
        spawn_local(roles.len(), |rank, cmd| {
            cmd.args([
                "--exact",
                "nccl::bootstrap::local::tests::job_child_role",
                "--nocapture",
            ])
            .env(ROLE_VAR, roles[rank])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        })
        .unwrap()
    }

    /// In a rank of [`job`], its role; elsewhere (the ordinary test run) nothing.
    #[test]
    fn job_child_role() {
        let Ok(role) = std::env::var(ROLE_VAR) else { return };
        match role.as_str() {
            "ok" => {
                println!("rank {} says hello", std::env::var("RANK").unwrap());
                eprintln!("and to stderr");
                std::process::exit(0);
            }
            "fail" => std::process::exit(3),
            "grandchild" => {
                // A process of its own that keeps the rank's stdout and stderr open after the
                // rank exits.
                std::process::Command::new("sleep").arg("30").spawn().unwrap();
                println!("started a grandchild");
                std::process::exit(0);
            }
            _ => {
                println!("rank {} sleeps", std::env::var("RANK").unwrap());
                std::thread::sleep(Duration::from_secs(120));
                std::process::exit(0);
            }
        }
    }

    /// Whether process `pid` still exists (running, or exited and not reaped).
    fn exists(pid: u32) -> bool {
        std::path::Path::new(&format!("/proc/{pid}")).exists()
    }

    #[test]
    fn a_job_gives_every_ranks_status_and_output_and_names_the_failed() {
        let exit = job(&["ok", "fail", "ok"])
            .wait_timeout(Duration::from_secs(60))
            .unwrap();
        assert_eq!(exit.ranks.len(), 3);
        assert!(!exit.success());
        assert_eq!(exit.failed(), [1]);
        assert_eq!(exit.ranks[1].status.and_then(|s| s.code()), Some(3));
        assert!(
            exit.ranks[0].stdout.contains("rank 0 says hello"),
            "{:?}",
            exit.ranks[0]
        );
        assert!(
            exit.ranks[2].stdout.contains("rank 2 says hello"),
            "{:?}",
            exit.ranks[2]
        );
        assert!(
            exit.ranks[2].stderr.contains("and to stderr"),
            "{:?}",
            exit.ranks[2]
        );
        let e = exit.check().unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::RanksFailed);
        assert!(matches!(&e, Error::RanksFailed { ranks, after: None, .. } if ranks == &[1]));
        assert_eq!(
            e.to_string(),
            "1 of the 3 ranks of the local job did not succeed: rank 1 failed (exit status: 3)"
        );
        job(&["ok", "ok"]).wait().unwrap().check().unwrap();
    }

    #[test]
    fn output_a_rank_left_to_a_process_of_its_own_is_cut_at_the_deadline() {
        let started = Instant::now();
        let exit = job(&["grandchild"]).wait_timeout(Duration::from_secs(2)).unwrap();
        let took = started.elapsed();
        // The grandchild holds the pipes for 30 s: the wait ends near the deadline anyway.
        assert!(took < Duration::from_secs(10), "{took:?}");
        assert!(exit.success(), "{exit:?}");
    }

    /// The processes whose environment has `HANDOFF_JOB_TEST_TAG=tag`.
    fn tagged(tag: &str) -> Vec<u32> {
        let want = format!("HANDOFF_JOB_TEST_TAG={tag}");
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == want.as_bytes()))
            })
            .collect()
    }

    #[test]
    fn a_rank_that_cannot_start_ends_the_ranks_started_before_it() {
        let tag = format!("{}-{:?}", std::process::id(), Instant::now());
        let r = spawn_local(3, |rank, cmd| {
            cmd.args(["--exact", "nccl::bootstrap::local::tests::job_child_role"])
                .env(ROLE_VAR, "sleep")
                .env("HANDOFF_JOB_TEST_TAG", &tag)
                .stdout(std::process::Stdio::null());
            if rank == 2 {
                cmd.current_dir("/nonexistent/handoff-job-test");
            }
        });
        assert!(r.is_err());
        // Killed and reaped before the error returned.
        assert_eq!(tagged(&tag), Vec::<u32>::new());
    }

    #[test]
    fn past_the_deadline_every_ranks_end_and_output_is_kept_and_check_says_timeout() {
        let j = job(&["ok", "sleep", "fail", "sleep"]);
        let pids: Vec<u32> = j.children().iter().map(|c| c.id()).collect();
        let started = Instant::now();
        let exit = j.wait_timeout(Duration::from_secs(3)).unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(exit.timed_out, Some(Duration::from_secs(3)));
        // The ranks that ended keep their statuses and output.
        let r = &exit.ranks;
        assert!(r[0].success() && !r[0].timed_out, "{:?}", r[0]);
        assert!(r[0].stdout.contains("rank 0 says hello"), "{:?}", r[0]);
        assert_eq!(r[2].status.and_then(|s| s.code()), Some(3));
        assert!(!r[2].timed_out);
        // The ranks still running are killed at the deadline, with what they wrote until then.
        for k in [1, 3] {
            assert!(r[k].timed_out && r[k].killed() && !r[k].success(), "{:?}", r[k]);
            assert!(r[k].stdout.contains(&format!("rank {k} sleeps")), "{:?}", r[k]);
        }
        assert_eq!(exit.failed(), [1, 2, 3]);
        let e = exit.check().unwrap_err();
        assert!(e.is_timeout(), "{e}");
        assert!(
            matches!(&e, Error::RanksFailed { ranks, after: Some(_), .. } if ranks == &[1, 2, 3]),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "3 of the 4 ranks of the local job did not succeed within 3s: rank 1 still ran at \
             the deadline and was killed (signal: 9 (SIGKILL)), rank 2 failed (exit status: 3), \
             rank 3 still ran at the deadline and was killed (signal: 9 (SIGKILL)). Give them \
             longer, or see what each wrote (JobExit::ranks) for where it stopped"
        );
        // Killed and reaped: no process, not even a zombie, is left.
        for pid in pids {
            assert!(!exists(pid), "process {pid} is left");
        }
    }

    /// A process that does not end when killed until the test lets it, as one in
    /// uninterruptible sleep in the GPU driver: what [`end_within`] must not wait for past its
    /// bound.
    struct Stuck {
        /// Set by the test when the process may end; `wait` blocks until then.
        free: std::sync::Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
        /// Set once `wait` has returned: the process was reaped.
        reaped: std::sync::Arc<std::sync::atomic::AtomicBool>,
        killed: bool,
    }

    impl Process for Stuck {
        fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
            Ok(None)
        }
        fn kill(&mut self) -> std::io::Result<()> {
            self.killed = true;
            Ok(())
        }
        fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
            assert!(self.killed, "waited for before it was killed");
            let (lock, freed) = &*self.free;
            let mut free = lock.lock().unwrap();
            while !*free {
                free = freed.wait(free).unwrap();
            }
            self.reaped.store(true, std::sync::atomic::Ordering::SeqCst);
            use std::os::unix::process::ExitStatusExt;
            Ok(std::process::ExitStatus::from_raw(9))
        }
    }

    #[test]
    fn a_rank_that_does_not_end_when_killed_is_left_to_a_reaper_at_the_bound() {
        let free = std::sync::Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let reaped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stuck = Stuck {
            free: free.clone(),
            reaped: reaped.clone(),
            killed: false,
        };
        let bound = Duration::from_millis(300);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let started = Instant::now();
            let ended = end_within(vec![stuck], bound);
            let _ = tx.send((ended, started.elapsed()));
        });
        // Past the bound with room to spare; an unbounded wait never answers until freed.
        let answer = rx.recv_timeout(bound + Duration::from_secs(5));
        let release = || {
            *free.0.lock().unwrap() = true;
            free.1.notify_all();
        };
        let Ok((ended, took)) = answer else {
            release();
            panic!("end_within still waited for the stuck process 5 s past its bound");
        };
        assert!(took >= bound, "{took:?}");
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0], (None, true), "not ended, and killed");
        assert!(!reaped.load(std::sync::atomic::Ordering::SeqCst));
        // Once it ends, the reaper thread reaps it.
        release();
        let until = Instant::now() + Duration::from_secs(10);
        while !reaped.load(std::sync::atomic::Ordering::SeqCst) {
            assert!(Instant::now() < until, "the stuck process was never reaped");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn dropping_the_job_kills_and_reaps_its_ranks_and_one_rank_can_be_killed() {
        let mut j = job(&["sleep", "sleep"]);
        let pids: Vec<u32> = j.children().iter().map(|c| c.id()).collect();
        j.kill(0).unwrap();
        assert!(!exists(pids[0]));
        assert!(exists(pids[1]));
        assert!(matches!(j.kill(2), Err(Error::InvalidArgument(_))));
        drop(j);
        assert!(!exists(pids[1]), "rank 1 outlived its job");
    }

    #[test]
    fn a_killed_rank_is_reported_as_killed() {
        let mut j = job(&["ok", "sleep"]);
        j.kill(1).unwrap();
        let exit = j.wait_timeout(Duration::from_secs(60)).unwrap();
        assert!(exit.ranks[1].killed() && !exit.ranks[0].killed());
        let e = exit.check().unwrap_err().to_string();
        assert!(e.contains("rank 1 was killed (signal: 9 (SIGKILL))"), "{e}");
    }

    #[test]
    fn forwarded_lines_are_prefixed_with_the_rank() {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let into = seen.clone();
        let pipe = std::io::Cursor::new(b"first\nsecond\n\nlast, unended".to_vec());
        forward(2, pipe, move |b| into.lock().unwrap().extend_from_slice(b))
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(
            String::from_utf8(seen.lock().unwrap().clone()).unwrap(),
            "[rank 2] first\n[rank 2] second\n[rank 2] \n[rank 2] last, unended\n"
        );
    }
}
