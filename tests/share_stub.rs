//! Ranks that share a GPU (`HANDOFF_SHARE_GPUS=1`), the parts that run on a CPU, against the
//! stub libraries of tests/stubs (built here with the system's C compiler):
//! - `Launch::from_env` gives a sharing rank process NCCL's variables (a host id of its own,
//!   the socket transport over loopback, a user's interface kept), and refuses, changing
//!   nothing, when it cannot set them safely: another thread runs, or NCCL is already open; with
//!   the variables already as they must be (as `spawn_local_with` sets them), nothing is set and
//!   nothing refused;
//! - `Launch::device` puts a sharing rank on `LOCAL_RANK % count`, a rank that does not share
//!   on `LOCAL_RANK` or nowhere;
//! - `Communicator::init_all` refuses a device listed twice, naming `HANDOFF_SHARE_GPUS`.
//!
//! Why children: `from_env` writes the process's environment only while the process has one
//! thread and NCCL is not open, and the crate opens each library once per process; the test
//! harness runs threads and opens the stubs. So each case of `from_env` is a child process of
//! this binary, started with the environment of the case and a role (what to do before
//! `from_env`) that `main` handles before anything else; the child reports on its standard
//! output and the parent checks the report. The device and `init_all` cases touch no
//! environment and run in this process.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use handoff::{Communicator, Device, Error, Launch};
use libtest_mimic::{Arguments, Failed, Trial};

mod stubs;

/// Set in a child: which role it plays (see [`child_main`]).
const ROLE: &str = "HANDOFF_SHARE_STUB_ROLE";
/// The variables a sharing rank needs before NCCL starts.
const NCCL_VARS: [&str; 3] = ["NCCL_HOSTID", "NCCL_NET", "NCCL_SOCKET_IFNAME"];
/// What every child starts with: rank 1 of 2 (a torchrun launch) sharing GPUs. Nobody listens on
/// the port: `from_env` only reads it.
const BASE_ENV: [(&str, &str); 6] = [
    ("RANK", "1"),
    ("WORLD_SIZE", "2"),
    ("LOCAL_RANK", "1"),
    ("MASTER_ADDR", "127.0.0.1"),
    ("MASTER_PORT", "29500"),
    ("HANDOFF_SHARE_GPUS", "1"),
];
/// Taken from a child's environment, whatever this process has: they would change the case.
const CLEARED: [&str; 7] = [
    "NCCL_HOSTID",
    "NCCL_NET",
    "NCCL_SOCKET_IFNAME",
    "HANDOFF_PORT",
    "HANDOFF_SECRET",
    "HANDOFF_SECRET_FILE",
    "CUDA_VISIBLE_DEVICES",
];

/// As a value in [`run_child`]'s `env`: the variable is removed (no variable holds a NUL).
const UNSET: &str = "\0unset";

/// This process's threads, from `/proc/self/status` (0 where it cannot be read).
fn threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// A child's side: when [`ROLE`] is set, does what the role says before `Launch::from_env`,
/// calls it, reports on standard output (`key=value` lines: `threads_before`, `from_env`, and
/// each of [`NCCL_VARS`] that is set afterwards) and exits; otherwise returns. Roles:
/// - `plain`: `from_env` first thing;
/// - `thread_first`: starts a thread (parked, alive until the process exits) first;
/// - `nccl_first`: opens NCCL first, making a unique id, on this one thread.
fn child_main() {
    let Some(role) = std::env::var_os(ROLE) else {
        return;
    };
    let mut report = Vec::new();
    match role.to_str() {
        Some("plain") => {}
        Some("thread_first") => {
            std::thread::spawn(|| {
                loop {
                    std::thread::park();
                }
            });
        }
        Some("nccl_first") => {
            let id = handoff::UniqueId::new();
            report.push(format!("unique_id={}", if id.is_ok() { "ok" } else { "failed" }));
        }
        other => {
            eprintln!("unknown role {other:?}");
            std::process::exit(2);
        }
    }
    report.push(format!("threads_before={}", threads()));
    let outcome = match Launch::from_env() {
        Ok(Some(l)) => format!("ok share_gpus={}", l.share_gpus),
        Ok(None) => "no launch".into(),
        Err(Error::InvalidArgument(m)) => format!("invalid argument: {m}"),
        Err(e) => format!("other error: {e:?}"),
    };
    report.push(format!("from_env={outcome}"));
    for k in NCCL_VARS {
        if let Ok(v) = std::env::var(k) {
            report.push(format!("{k}={v}"));
        }
    }
    println!("{}", report.join("\n"));
    std::process::exit(0);
}

/// What a child reported.
struct Report {
    lines: HashMap<String, String>,
    stderr: String,
}

impl Report {
    fn get(&self, key: &str) -> Option<&str> {
        self.lines.get(key).map(String::as_str)
    }

    /// `from_env`'s outcome, as the child described it.
    fn outcome(&self) -> &str {
        self.get("from_env").unwrap_or("(not reported)")
    }

    /// The NCCL variables the child had after `from_env`, in the order of [`NCCL_VARS`].
    fn nccl_vars(&self) -> [Option<&str>; 3] {
        NCCL_VARS.map(|k| self.get(k))
    }
}

/// Runs this binary as a child in role `role` (see [`child_main`]) against the stubs, with
/// [`BASE_ENV`] overridden by `env` (a variable valued [`UNSET`] removed), and none of
/// [`CLEARED`] unless `env` sets it; fails unless it exits successfully.
fn run_child(stubs: &Stubs, role: &str, env: &[(&str, &str)]) -> Result<Report, Failed> {
    let mut cmd = Command::new(std::env::current_exe()?);
    for k in CLEARED {
        cmd.env_remove(k);
    }
    cmd.env(ROLE, role)
        .env("HANDOFF_CUDART_PATH", &stubs.cudart_path)
        .env("HANDOFF_NCCL_PATH", &stubs.nccl_path)
        .envs(BASE_ENV);
    for &(k, v) in env {
        if v == UNSET {
            cmd.env_remove(k);
        } else {
            cmd.env(k, v);
        }
    }
    let out = cmd.output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        return Err(format!("child {role} {env:?}: {}; stderr: {stderr}", out.status).into());
    }
    let lines = stdout
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Ok(Report { lines, stderr })
}

/// The stub libraries: their files, for children, and this process's handles, for their knobs.
struct Stubs {
    cudart_path: PathBuf,
    nccl_path: PathBuf,
    cudart: libloading::Library,
    nccl: libloading::Library,
}

impl Stubs {
    /// Makes the stub runtime report `n` devices.
    fn set_devices(&self, n: i32) {
        // SAFETY: the stub's `void cudart_stub_set_devices(int)`.
        unsafe {
            let set: libloading::Symbol<unsafe extern "C" fn(i32)> =
                self.cudart.get(b"cudart_stub_set_devices\0").expect("setter");
            set(n);
        }
    }

    /// How many times the stub NCCL's function `name` was called, by all threads.
    fn nccl_calls(&self, name: &str) -> i64 {
        let name = std::ffi::CString::new(name).expect("name");
        // SAFETY: the stub's `long nccl_stub_count(const char *name, int all)`, given a
        // NUL-terminated string that outlives the call.
        unsafe {
            let count: libloading::Symbol<unsafe extern "C" fn(*const std::ffi::c_char, i32) -> i64> =
                self.nccl.get(b"nccl_stub_count\0").expect("count");
            count(name.as_ptr(), 1)
        }
    }
}

/// The trailing number of a host id, the rank it names.
fn named_rank(host_id: &str) -> Option<&str> {
    let digits = host_id.len() - host_id.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    (digits > 0).then(|| &host_id[host_id.len() - digits..])
}

/// A sharing rank (1 of 2), with no NCCL variables, gets them all from `from_env`: a host id
/// naming rank 1, NCCL's socket transport, loopback. Its environment is written while it has
/// one thread, and it prints nothing about the mode (rank 0 does).
fn a_sharing_rank_gets_its_variables(stubs: &Stubs) -> Result<(), Failed> {
    let r = run_child(stubs, "plain", &[])?;
    if r.outcome() != "ok share_gpus=true" {
        return Err(format!("from_env: {}", r.outcome()).into());
    }
    if r.get("threads_before") != Some("1") {
        return Err(format!("the child had {:?} threads, want 1", r.get("threads_before")).into());
    }
    let [host, net, ifname] = r.nccl_vars();
    if net != Some("Socket") || ifname != Some("lo") {
        return Err(format!("NCCL_NET={net:?} NCCL_SOCKET_IFNAME={ifname:?}, want Socket and lo").into());
    }
    match host {
        Some(h) if named_rank(h) == Some("1") => {}
        other => return Err(format!("NCCL_HOSTID={other:?}, want one naming rank 1").into()),
    }
    if r.stderr.contains("development mode") {
        return Err(format!("rank 1 spoke of the mode: {}", r.stderr).into());
    }
    Ok(())
}

/// Rank 0 of the same launch gets a host id of its own (NCCL then takes it for another host)
/// and says once that this is a development mode.
fn rank_0_gets_another_host_id(stubs: &Stubs) -> Result<(), Failed> {
    let one = run_child(stubs, "plain", &[])?;
    let zero = run_child(stubs, "plain", &[("RANK", "0"), ("LOCAL_RANK", "0")])?;
    if zero.outcome() != "ok share_gpus=true" {
        return Err(format!("rank 0's from_env: {}", zero.outcome()).into());
    }
    let (h0, h1) = (zero.get("NCCL_HOSTID"), one.get("NCCL_HOSTID"));
    if h0.is_none() || h0 == h1 || named_rank(h0.unwrap_or_default()) != Some("0") {
        return Err(format!("NCCL_HOSTID {h0:?} on rank 0 and {h1:?} on rank 1").into());
    }
    if zero.stderr.matches("development mode").count() != 1 {
        return Err(format!(
            "rank 0 should say once what the mode is; it said: {}",
            zero.stderr
        )
        .into());
    }
    Ok(())
}

/// An interface the user chose is kept; the rest is set as without it.
fn a_users_interface_is_kept(stubs: &Stubs) -> Result<(), Failed> {
    let r = run_child(stubs, "plain", &[("NCCL_SOCKET_IFNAME", "eth7")])?;
    match (r.outcome(), r.nccl_vars()) {
        ("ok share_gpus=true", [Some(h), Some("Socket"), Some("eth7")]) if named_rank(h) == Some("1") => {
            Ok(())
        }
        (outcome, vars) => Err(format!("from_env: {outcome}; NCCL variables {vars:?}").into()),
    }
}

/// Without `HANDOFF_SHARE_GPUS=1`, `from_env` sets nothing, whether the switch is off or absent.
fn without_sharing_nothing_is_set(stubs: &Stubs) -> Result<(), Failed> {
    for switch in ["0", UNSET] {
        let r = run_child(stubs, "plain", &[("HANDOFF_SHARE_GPUS", switch)])?;
        if r.outcome() != "ok share_gpus=false" || r.nccl_vars() != [None; 3] {
            return Err(format!(
                "HANDOFF_SHARE_GPUS={switch:?}: from_env {}; NCCL variables {:?}",
                r.outcome(),
                r.nccl_vars()
            )
            .into());
        }
    }
    Ok(())
}

/// Checks that `r` is `from_env`'s refusal naming `NCCL_HOSTID` and `why`, and that the
/// refused child's environment was left alone.
fn refused(r: &Report, why: &str) -> Result<(), Failed> {
    let outcome = r.outcome();
    let Some(message) = outcome.strip_prefix("invalid argument: ") else {
        return Err(format!("from_env: {outcome}, want Error::InvalidArgument").into());
    };
    if !message.contains("NCCL_HOSTID") || !message.contains(why) {
        return Err(format!("the refusal should name NCCL_HOSTID and {why:?}: {message}").into());
    }
    if r.nccl_vars() != [None; 3] {
        return Err(format!("refused, yet the environment changed: {:?}", r.nccl_vars()).into());
    }
    println!("refused: {message}");
    Ok(())
}

/// Another thread (alive, parked) before `from_env`: refused, nothing set.
fn refused_with_another_thread(stubs: &Stubs) -> Result<(), Failed> {
    let r = run_child(stubs, "thread_first", &[])?;
    if r.get("threads_before") != Some("2") {
        return Err(format!("the child had {:?} threads, want 2", r.get("threads_before")).into());
    }
    refused(&r, "threads")
}

/// NCCL opened before `from_env`, on the only thread: refused for that, nothing set.
fn refused_once_nccl_is_open(stubs: &Stubs) -> Result<(), Failed> {
    let r = run_child(stubs, "nccl_first", &[])?;
    if r.get("unique_id") != Some("ok") || r.get("threads_before") != Some("1") {
        return Err(format!(
            "the stub NCCL's unique id {:?}, threads {:?}: want ok and 1",
            r.get("unique_id"),
            r.get("threads_before")
        )
        .into());
    }
    refused(&r, "NCCL is already open")
}

/// With the variables already as a sharing rank needs them (as `spawn_local_with` sets them:
/// here, what a first child was given), there is nothing to set: no refusal with another
/// thread running, nor with NCCL open, and the variables stay as they were.
fn nothing_to_set_is_not_refused(stubs: &Stubs) -> Result<(), Failed> {
    let first = run_child(stubs, "plain", &[])?;
    let given: Vec<(&str, &str)> = NCCL_VARS
        .iter()
        .zip(first.nccl_vars())
        .map(|(k, v)| {
            v.map(|v| (*k, v))
                .ok_or_else(|| format!("the first child was not given {k}"))
        })
        .collect::<Result<_, _>>()?;
    for role in ["thread_first", "nccl_first"] {
        let r = run_child(stubs, role, &given)?;
        if r.outcome() != "ok share_gpus=true" {
            return Err(format!("{role} with the variables set: {}", r.outcome()).into());
        }
        let after: Vec<(&str, &str)> = NCCL_VARS
            .iter()
            .zip(r.nccl_vars())
            .filter_map(|(k, v)| v.map(|v| (*k, v)))
            .collect();
        if after != given {
            return Err(format!("{role}: the variables were {given:?}, are {after:?}").into());
        }
    }
    Ok(())
}

/// The launch of local rank `local` of 8 (torchrun), sharing GPUs or not.
fn launch(local: &str, share: bool) -> Result<Launch, Failed> {
    let vars: HashMap<&str, &str> = HashMap::from([
        ("RANK", local),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", local),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("HANDOFF_SHARE_GPUS", if share { "1" } else { "0" }),
    ]);
    Ok(Launch::from_vars(|k| vars.get(k).map(|v| v.to_string()))?.ok_or("no launch read")?)
}

/// Which device `launch.device()` gives with the stub reporting `devices`: its ordinal, or the
/// error.
fn device_of(stubs: &Stubs, launch: &Launch, devices: i32) -> Result<usize, Error> {
    stubs.set_devices(devices);
    launch.device().map(|d| d.ordinal())
}

/// A sharing rank takes `LOCAL_RANK % count`; one that does not share takes `LOCAL_RANK` or
/// none.
fn devices_are_assigned(stubs: &Stubs) -> Result<(), Failed> {
    let result = (|| {
        let (shared, own) = (launch("3", true)?, launch("3", false)?);
        let got = |l: &Launch, n: i32| format!("{:?}", device_of(stubs, l, n));
        let checks = [
            ("sharing, local rank 3, 1 device", got(&shared, 1), "Ok(0)"),
            ("sharing, local rank 3, 2 devices", got(&shared, 2), "Ok(1)"),
            (
                "sharing, local rank 5, 4 devices",
                got(&launch("5", true)?, 4),
                "Ok(1)",
            ),
            (
                "own GPU, local rank 1, 2 devices",
                got(&launch("1", false)?, 2),
                "Ok(1)",
            ),
        ];
        for (case, got, want) in checks {
            if got != want {
                return Err(format!("{case}: {got}, want {want}").into());
            }
        }
        match device_of(stubs, &own, 2) {
            Err(Error::NoDevice { reason }) if reason.contains("device 3") && reason.contains("sees 2") => {}
            other => {
                return Err(format!("own GPU, local rank 3, 2 devices: {other:?}, want NoDevice").into());
            }
        }
        match device_of(stubs, &shared, 0) {
            Err(Error::NoDevice { reason }) if reason.contains("0 devices") => Ok(()),
            other => Err(format!("sharing, no device: {other:?}, want NoDevice").into()),
        }
    })();
    stubs.set_devices(1);
    result
}

/// One device twice in `init_all` is refused before NCCL is called, naming the way that works;
/// two devices are not.
fn init_all_names_the_sharing_mode(stubs: &Stubs) -> Result<(), Failed> {
    let result = (|| {
        stubs.set_devices(2);
        let d0 = Device::new(0)?;
        let inits = stubs.nccl_calls("ncclCommInitRankConfig") + stubs.nccl_calls("ncclGetUniqueId");
        match Communicator::init_all(&[d0.clone(), d0.clone()]) {
            Err(Error::InvalidArgument(m)) if m.contains("HANDOFF_SHARE_GPUS") => println!("refused: {m}"),
            Err(e) => {
                return Err(format!(
                    "one device twice: {e:?}, want InvalidArgument naming HANDOFF_SHARE_GPUS"
                )
                .into());
            }
            Ok(_) => return Err("one device twice was accepted".into()),
        }
        if stubs.nccl_calls("ncclCommInitRankConfig") + stubs.nccl_calls("ncclGetUniqueId") != inits {
            return Err("the refused init_all reached NCCL".into());
        }
        let comms = Communicator::init_all(&[d0, Device::new(1)?])?;
        if comms.len() != 2 {
            return Err(format!("{} communicators over two devices", comms.len()).into());
        }
        Ok(())
    })();
    stubs.set_devices(1);
    result
}

fn build(dir: &Path, c: &str, so: &str) -> Result<PathBuf, String> {
    stubs::build(dir, c, so).map_err(stubs::NoStubs::text)
}

fn main() {
    child_main();
    let mut args = Arguments::from_args();
    let dir = std::env::temp_dir().join(format!("handoff-share-stubs-{}", std::process::id()));
    let built = (|| {
        Ok::<_, String>((
            build(&dir, "cudart.c", "libcudart.so.13")?,
            build(&dir, "nccl.c", "libnccl.so.2")?,
        ))
    })();
    let (cudart, nccl) = built.unwrap_or_else(|e| panic!("the stub libraries could not be built: {e}"));
    // SAFETY: no other thread exists yet, and nothing has read the environment.
    unsafe {
        std::env::set_var("HANDOFF_CUDART_PATH", &cudart);
        std::env::set_var("HANDOFF_NCCL_PATH", &nccl);
    }
    // SAFETY: the stubs just built: plain C with no initialisers.
    let stubs: &'static Stubs = Box::leak(Box::new(unsafe {
        Stubs {
            cudart: libloading::Library::new(&cudart).expect("stub runtime"),
            nccl: libloading::Library::new(&nccl).expect("stub NCCL"),
            cudart_path: cudart,
            nccl_path: nccl,
        }
    }));
    let trial = |name: &str, f: fn(&Stubs) -> Result<(), Failed>| Trial::test(name, move || f(stubs));
    let trials = vec![
        trial(
            "a_sharing_rank_gets_a_host_id_of_its_own_and_loopback_sockets",
            a_sharing_rank_gets_its_variables,
        ),
        trial(
            "rank_0_gets_another_host_id_and_says_what_the_mode_is",
            rank_0_gets_another_host_id,
        ),
        trial("a_users_socket_interface_is_kept", a_users_interface_is_kept),
        trial(
            "without_sharing_from_env_sets_nothing",
            without_sharing_nothing_is_set,
        ),
        trial(
            "another_thread_before_from_env_is_refused_and_nothing_set",
            refused_with_another_thread,
        ),
        trial(
            "nccl_opened_before_from_env_is_refused_and_nothing_set",
            refused_once_nccl_is_open,
        ),
        trial(
            "variables_already_set_are_not_refused_with_threads_or_nccl",
            nothing_to_set_is_not_refused,
        ),
        trial(
            "a_sharing_rank_takes_its_local_rank_modulo_the_devices",
            devices_are_assigned,
        ),
        trial(
            "init_all_refuses_a_device_twice_naming_handoff_share_gpus",
            init_all_names_the_sharing_mode,
        ),
    ];
    // One at a time: the stub's device count is the whole process's.
    args.test_threads = Some(1);
    let conclusion = libtest_mimic::run(&args, trials);
    let _ = std::fs::remove_dir_all(&dir);
    conclusion.exit()
}
