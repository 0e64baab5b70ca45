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
    pub fn trial(&self, name: &str, needs: usize, f: fn() -> Result<(), Failed>) -> Trial {
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
    let args = Arguments::from_args();
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
