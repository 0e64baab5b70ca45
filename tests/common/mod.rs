//! The GPU test harness, shared by the test binaries that need GPUs.
//!
//! Each test declares how many GPUs it needs. Where fewer are usable it reports as *ignored*,
//! never passed, unless `HANDOFF_REQUIRE_GPUS=N` says N must be there: then every test needing
//! at most N GPUs *fails* with the reason none are usable.
#![allow(dead_code)]

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
    pub fn trial(&self, name: &str, needs: usize, f: TestFn) -> Trial {
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
        eprintln!(
            "handoff GPU tests: no usable GPU ({}): tests needing one are ignored",
            gpus.reason
        );
    }
    libtest_mimic::run(&args, trials).exit()
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

/// Starts two ranks of this test binary on this machine, playing `role`.
pub fn spawn_ranks(role: &str, piped_stdout: bool) -> Result<Vec<std::process::Child>, Failed> {
    Ok(handoff::nccl::bootstrap::spawn_local(2, |_, cmd| {
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

/// Two ranks of one process, one thread each (the same path as two processes: shared-memory
/// mailboxes), made with `options[rank]`; `body` gets each rank's communicator, or the error
/// making it. A thread that panics reports "panicked".
pub fn two_threads<T: Send + 'static>(
    options: [handoff::CommOptions; 2],
    body: impl Fn(Result<handoff::Communicator, handoff::Error>) -> Result<T, String>
    + Send
    + Sync
    + Clone
    + 'static,
) -> Result<[Result<T, String>; 2], Failed> {
    let id = handoff::UniqueId::new()?;
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let (id, body) = (id.clone(), body.clone());
            let opts = options[rank];
            std::thread::spawn(move || {
                let made = handoff::Device::new(rank)
                    .and_then(|d| handoff::Communicator::with_options(2, rank, &id, opts, &d));
                body(made)
            })
        })
        .collect();
    let mut out = handles
        .into_iter()
        .map(|h| h.join().unwrap_or_else(|_| Err("panicked".into())));
    Ok([out.next().unwrap(), out.next().unwrap()])
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
