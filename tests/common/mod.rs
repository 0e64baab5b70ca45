//! The GPU test harness, shared by the test binaries that need GPUs.
//!
//! Each test declares how many GPUs it needs. Where fewer are usable it reports as *ignored*,
//! never passed, unless `HANDOFF_REQUIRE_GPUS=N` says N must be there: then every test needing
//! at most N GPUs *fails* with the reason none are usable.
//!
//! A test whose ranks are processes ([`Gpus::ranks_trial`], [`ranks`], [`spawn_ranks`]) needs
//! one GPU whatever its number of ranks: where there are fewer GPUs than ranks, the ranks share
//! them (`GpuSharing::WhenFewerGpus`: NCCL's socket transport between processes that each have
//! an NCCL host id of their own). A test whose ranks are threads of one process needs a GPU per
//! rank: NCCL reads its host id once per process, so threads cannot share a GPU.
#![allow(dead_code)]

use std::cell::RefCell;
use std::time::Duration;

use handoff::nccl::bootstrap::{GpuSharing, LocalJob, spawn_local_with};
use libtest_mimic::{Arguments, Failed, Trial};

/// What this machine offers.
pub struct Gpus {
    /// GPUs the CUDA runtime reports usable.
    pub usable: usize,
    /// Why there are none (or fewer), if the runtime said.
    pub reason: String,
    /// `HANDOFF_REQUIRE_GPUS`, 0 when unset.
    pub required: usize,
}

impl Gpus {
    pub fn detect() -> Gpus {
        let required = match std::env::var("HANDOFF_REQUIRE_GPUS") {
            Ok(v) if !v.trim().is_empty() => v.trim().parse().unwrap_or_else(|_| {
                eprintln!("HANDOFF_REQUIRE_GPUS={v:?} is not a number; treating it as 1");
                1
            }),
            _ => 0,
        };
        let (usable, reason) = match handoff::Device::count() {
            Ok(n) => (n, format!("the CUDA runtime reports {n} device(s)")),
            Err(e) => (0, e.to_string()),
        };
        Gpus {
            usable,
            reason,
            required,
        }
    }

    /// A trial that needs `needs` GPUs.
    pub fn trial(
        &self,
        name: &str,
        needs: usize,
        f: impl FnOnce() -> Result<(), Failed> + Send + 'static,
    ) -> Trial {
        if self.usable >= needs {
            Trial::test(name, f)
        } else if self.required >= needs {
            let msg = format!(
                "HANDOFF_REQUIRE_GPUS={} but only {} GPU(s) usable ({}); this test needs {needs}",
                self.required, self.usable, self.reason
            );
            Trial::test(name, move || Err(msg.clone().into()))
        } else {
            Trial::test(name, f).with_ignored_flag(true)
        }
    }
}

impl Gpus {
    /// A trial whose ranks are processes (through [`ranks`] or [`spawn_ranks`]): it needs one
    /// GPU, whatever its number of ranks, which they share when there are fewer GPUs than ranks.
    pub fn ranks_trial(&self, name: &str, f: impl FnOnce() -> Result<(), Failed> + Send + 'static) -> Trial {
        let owned = name.to_string();
        self.trial(name, 1, move || {
            // The trial runs on one thread: the name set here is the trial that `ranks` re-runs
            // in each rank's process.
            TRIAL.with(|t| *t.borrow_mut() = Some((owned, false)));
            let r = f();
            TRIAL.with(|t| *t.borrow_mut() = None);
            r
        })
    }
}

thread_local! {
    /// The [`Gpus::ranks_trial`] this thread is running, and whether it has called [`ranks`].
    static TRIAL: RefCell<Option<(String, bool)>> = const { RefCell::new(None) };
}

/// Set in a rank process that [`ranks`] starts: the trial it re-runs, as one rank.
const RANKS_VAR: &str = "HANDOFF_TEST_RANKS_OF";
/// Starts the line on which a rank process reports its result to [`ranks`].
const RESULT_MARK: &str = "HANDOFF_RANK_RESULT ";
/// How long [`ranks`] waits for its rank processes before it kills them and fails.
const RANKS_DEADLINE: Duration = Duration::from_secs(300);

/// Runs `body` as every rank of a `world`-rank communicator, one process of this test binary
/// per rank (sharing GPUs where there are fewer than `world`), and returns each rank's result
/// in rank order: `body` gets its rank's communicator made with `options[rank]` (or the error
/// making it). The trial (a [`Gpus::ranks_trial`]) is re-run in each rank's process up to this
/// call, which there runs `body` once, reports and exits: so one call per trial (a second is
/// an error), and nothing before it that the rank processes must not repeat.
pub fn ranks<T: serde::Serialize + serde::de::DeserializeOwned>(
    options: &[handoff::CommOptions],
    body: impl Fn(Result<handoff::Communicator, handoff::Error>) -> Result<T, String>,
) -> Result<Vec<Result<T, String>>, Failed> {
    let (trial, called) = TRIAL
        .with(|t| {
            t.borrow_mut()
                .as_mut()
                .map(|(name, called)| (name.clone(), std::mem::replace(called, true)))
        })
        .ok_or("common::ranks called outside a Gpus::ranks_trial")?;
    if called {
        // A rank process re-runs the trial and plays the first call it meets.
        return Err("common::ranks called twice in one trial: give each call a trial of its own".into());
    }
    if std::env::var(RANKS_VAR).ok().as_deref() == Some(trial.as_str()) {
        // This process is one of the ranks.
        let made = handoff::Launch::from_env().and_then(|l| {
            let l = l.ok_or_else(|| handoff::Error::InvalidArgument("no RANK in a rank process".into()))?;
            l.communicator(options[l.rank])
        });
        let result = body(made);
        let line = serde_json::to_string(&result).map_err(|e| e.to_string())?;
        // On a line of its own: libtest has printed "test NAME ... " without a newline.
        println!("\n{RESULT_MARK}{line}");
        std::process::exit(0);
    }
    let world = options.len();
    let job = spawn_local_with(world, GpuSharing::WhenFewerGpus, |_, cmd| {
        cmd.args([trial.as_str(), "--exact", "--test-threads", "1"])
            .env(RANKS_VAR, &trial)
            .stdout(std::process::Stdio::piped());
    })?;
    let exit = job.wait_timeout(RANKS_DEADLINE)?;
    for r in &exit.ranks {
        println!("[{r}]");
        for l in r
            .stdout
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with(RESULT_MARK))
        {
            println!("[rank {}] {l}", r.rank);
        }
    }
    exit.ranks
        .into_iter()
        .map(|r| {
            let line = r
                .stdout
                .lines()
                .find_map(|l| l.strip_prefix(RESULT_MARK))
                .ok_or_else(|| format!("{r}, without a result"))?;
            serde_json::from_str(line).map_err(|e| format!("rank {}'s result {line:?}: {e}", r.rank).into())
        })
        .collect()
}

/// [`ranks`] for two ranks.
pub fn two_ranks<T: serde::Serialize + serde::de::DeserializeOwned>(
    options: [handoff::CommOptions; 2],
    body: impl Fn(Result<handoff::Communicator, handoff::Error>) -> Result<T, String>,
) -> Result<[Result<T, String>; 2], Failed> {
    let mut r = ranks(&options, body)?.into_iter();
    Ok([r.next().ok_or("no rank 0")?, r.next().ok_or("no rank 1")?])
}

/// Runs the trials and exits with libtest's status.
pub fn run(trials: Vec<Trial>) -> ! {
    run_with(Arguments::from_args(), trials)
}

/// As [`run`], one test at a time unless `--test-threads` says otherwise: for tests whose
/// timing another test's GPU work would disturb (deadlines, GPU-side waits).
pub fn run_serial(trials: Vec<Trial>) -> ! {
    let mut args = Arguments::from_args();
    args.test_threads.get_or_insert(1);
    run_with(args, trials)
}

fn run_with(args: Arguments, trials: Vec<Trial>) -> ! {
    let gpus = Gpus::detect();
    if gpus.usable == 0 && !args.list {
        let selected = trials.iter().filter(|t| !args.is_filtered_out(t));
        let (ignored, total) = selected.fold((0, 0), |(i, n), t| (i + t.has_ignored_flag() as usize, n + 1));
        // The first clause of the reason: its whole text is printed once per `cargo test` run.
        let short = gpus.reason.split([':', '.']).next().unwrap_or_default();
        eprintln!("handoff GPU tests: {ignored} of {total} ignored (no usable GPU: {short})");
        if first_to_speak() {
            eprintln!("handoff GPU tests: why: {}", gpus.reason);
        }
    }
    libtest_mimic::run(&args, trials).exit()
}

/// Whether this test binary is the first of its `cargo test` run to report the missing GPU.
///
/// Cargo runs each test binary as a process of its own, one after another, all children of the
/// one cargo process: the first to create a marker file named after that parent (its pid and
/// start time, so that a reused pid is another parent) is the first. Markers of parents that
/// have ended are removed. Where that cannot be told (no /proc), every binary is first.
fn first_to_speak() -> bool {
    const PREFIX: &str = "handoff-gpu-tests-said-";
    let start_of = |pid: u32| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Field 22, the start time, counted after the command name's closing parenthesis.
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(19)
            .map(str::to_string)
    };
    let parent = std::os::unix::process::parent_id();
    let Some(start) = start_of(parent) else {
        return true;
    };
    let dir = std::env::temp_dir();
    let marker = dir.join(format!("{PREFIX}{parent}-{start}"));
    let first = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&marker)
        .is_ok();
    if first && let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some((pid, start)) = name.strip_prefix(PREFIX).and_then(|r| r.split_once('-')) else {
                continue;
            };
            let alive = pid.parse().ok().and_then(start_of).is_some_and(|s| s == start);
            if !alive {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    first
}

/// Fails with a message showing the first mismatches.
pub fn assert_all_eq<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: &[T],
    want: impl Fn(usize) -> T,
) -> Result<(), Failed> {
    let bad: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want(i)).collect();
    if bad.is_empty() {
        return Ok(());
    }
    let shown: Vec<String> = bad
        .iter()
        .take(4)
        .map(|&i| format!("[{i}] = {:?}, want {:?}", got[i], want(i)))
        .collect();
    Err(format!(
        "{what}: {} of {} elements wrong: {}",
        bad.len(),
        got.len(),
        shown.join(", ")
    )
    .into())
}

/// A test body.
pub type TestFn = fn() -> Result<(), Failed>;

/// Set in the processes that the two-process tests start: the role each plays.
pub const CHILD_VAR: &str = "HANDOFF_TEST_CHILD";

/// In a process started by [`spawn_ranks`], runs its role and exits (0 on success); elsewhere
/// returns at once.
pub fn run_child_role(roles: &[(&str, TestFn)]) {
    let Ok(role) = std::env::var(CHILD_VAR) else {
        return;
    };
    let r = match roles.iter().find(|(name, _)| *name == role) {
        Some((_, f)) => f(),
        None => Err(format!("unknown child role {role}").into()),
    };
    if let Err(e) = r {
        eprintln!("child {role} failed: {}", e.message().unwrap_or("?"));
        std::process::exit(1);
    }
    std::process::exit(0);
}

/// Starts two ranks of this test binary on this machine, playing `role`: [`spawn_n`].
pub fn spawn_ranks(role: &str, piped_stdout: bool) -> Result<LocalJob, Failed> {
    spawn_n(role, 2, piped_stdout)
}

/// Starts `world` ranks of this test binary on this machine, playing `role`, sharing the GPUs
/// where there are fewer than `world`. Wait for them with the job's `wait_timeout` (which also
/// reads the piped stdout); dropping the job kills them.
pub fn spawn_n(role: &str, world: usize, piped_stdout: bool) -> Result<LocalJob, Failed> {
    Ok(spawn_local_with(world, GpuSharing::WhenFewerGpus, |_, cmd| {
        cmd.env(CHILD_VAR, role);
        if piped_stdout {
            cmd.stdout(std::process::Stdio::piped());
        }
    })?)
}

/// GPU 0 and two streams on it: the hazard tests' setting (an operation on one stream, the
/// conflicting one on the other).
pub fn gpu0_two_streams() -> Result<(handoff::Device, handoff::Stream, handoff::Stream), Failed> {
    let dev = handoff::Device::new(0)?;
    let (s1, s2) = (handoff::Stream::new(&dev)?, handoff::Stream::new(&dev)?);
    Ok((dev, s1, s2))
}

/// A one-rank communicator on GPU 0.
pub fn one_rank(options: handoff::CommOptions) -> Result<(handoff::Device, handoff::Communicator), Failed> {
    let dev = handoff::Device::new(0)?;
    let comm = handoff::Communicator::init_all_with(options, std::slice::from_ref(&dev))?
        .pop()
        .ok_or("no communicator")?;
    Ok((dev, comm))
}

/// Both ranks' values, or every rank's error, each named.
pub fn both_ok<T>(results: [Result<T, String>; 2]) -> Result<[T; 2], Failed> {
    match results {
        [Ok(a), Ok(b)] => Ok([a, b]),
        [a, b] => Err([a.err(), b.err()]
            .into_iter()
            .enumerate()
            .filter_map(|(r, e)| e.map(|e| format!("rank {r}: {e}")))
            .collect::<Vec<_>>()
            .join("; ")
            .into()),
    }
}

/// A waker that unparks the thread that made it.
struct Unpark(std::thread::Thread);

impl std::task::Wake for Unpark {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs `f` on this thread, parking between polls (the async GPU tests' executor: no runtime
/// dependency); an error if it is not done within `limit`.
pub fn block_on<F: std::future::Future>(f: F, limit: Duration) -> Result<F::Output, Failed> {
    let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    let end = std::time::Instant::now() + limit;
    loop {
        if let std::task::Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return Ok(out);
        }
        let now = std::time::Instant::now();
        if now >= end {
            return Err(format!("a future was not done within {limit:?}").into());
        }
        std::thread::park_timeout(end - now);
    }
}

/// A boxed future, for lists of futures of several kinds.
pub type BoxFuture<'f, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'f>>;

/// Every future of `futures` polled until all are done, their outputs in order.
pub fn join_all<'f, T: 'f>(futures: Vec<BoxFuture<'f, T>>) -> impl std::future::Future<Output = Vec<T>> + 'f {
    let mut slots: Vec<_> = futures.into_iter().map(Some).collect();
    let mut outs: Vec<Option<T>> = slots.iter().map(|_| None).collect();
    std::future::poll_fn(move |cx| {
        let mut pending = false;
        for (slot, out) in slots.iter_mut().zip(outs.iter_mut()) {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        *out = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(outs.iter_mut().map(|o| o.take().expect("done")).collect())
        }
    })
}
