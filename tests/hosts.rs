//! Verification across hosts, rehearsed on one machine: two processes in two network
//! namespaces joined by a veth pair, each with a private tmpfs on /dev/shm in its own mount
//! namespace (so neither can see the other's mailbox file), as two hosts would be. Each runs
//! the verification layer alone (no GPU, no NCCL): `handoff::nccl::rehearsal` sets it up with
//! the communicator's own setup code, over an all-gather made of files in a folder both see,
//! in place of NCCL's.
//!
//! Needs root and `ip` (iproute2; `HANDOFF_IP` may name it where it is not on the path); where
//! namespaces cannot be made the namespace trials print why and report ignored. The same-host
//! trial runs everywhere.
//!
//! With two GPUs, the full communicator too (`hosts/gpu.rs`): one process and GPU in each
//! namespace, NCCL on its socket transport over the veth pair.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use handoff::nccl::rehearsal::Rank;
use libtest_mimic::{Arguments, Failed, Trial};

mod common;
#[path = "hosts/gpu.rs"]
mod gpu;

/// Set in the child processes: their role.
const ROLE: &str = "HANDOFF_REHEARSAL_ROLE";
/// The folder of the file all-gather, and of the parent's notes to its children.
const DIR: &str = "HANDOFF_REHEARSAL_DIR";
const SCENARIO: &str = "HANDOFF_REHEARSAL_SCENARIO";

const A_IP: &str = "10.77.0.1";
const B_IP: &str = "10.77.0.2";
/// Rank 0's listener in the rogue trial, so that the rogue knows where to connect.
const ROGUE_PORT: u16 = 47_001;

fn main() {
    let args = Arguments::from_args();
    if let Ok(role) = std::env::var(ROLE) {
        let code = match child(&role) {
            Ok(()) => 0,
            Err(e) => {
                println!("child failed: {e}");
                1
            }
        };
        std::process::exit(code);
    }
    let why_not = namespaces_unavailable();
    if let Some(why) = &why_not {
        eprintln!("hosts: the namespace trials are ignored: {why}");
    }
    let ns =
        |name: &str, f: fn() -> Result<(), Failed>| Trial::test(name, f).with_ignored_flag(why_not.is_some());
    let mut trials = vec![
        Trial::test(
            "same_host_pairs_share_files_unless_the_channel_is_forced",
            same_host,
        ),
        ns("across_namespaces_operations_are_checked_over_the_channel", ops),
        ns("across_namespaces_with_a_shared_secret", ops_with_secret),
        ns("a_killed_peer_is_peer_broken_at_once", killed),
        ns("a_stopped_peer_is_a_timeout_within_the_bound", stopped),
        ns("rogue_connections_are_refused_and_do_not_delay_the_peer", rogue),
        ns(
            "ranks_with_different_secrets_or_one_without_are_refused",
            secrets_differ,
        ),
    ];
    trials.extend(gpu::trials(why_not.as_deref()));
    libtest_mimic::run(&args, trials).exit()
}

/// Why two network namespaces joined by a veth pair, each with a private /dev/shm, cannot be
/// made here; `None` if they can.
fn namespaces_unavailable() -> Option<String> {
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { geteuid() } != 0 {
        return Some("not root (network and mount namespaces need CAP_SYS_ADMIN)".into());
    }
    for tool in [ip().as_str(), "unshare", "mount"] {
        let found = Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Some(format!(
                "`{tool}` is not installed (scripts/setup.sh installs iproute2; HANDOFF_IP may name \
                 an `ip` elsewhere)"
            ));
        }
    }
    match Hosts::new() {
        Ok(h) => {
            let probe = h.run(
                &h.a,
                &[],
                Path::new("sh"),
                &["-c", "test -z \"$(ls -A /dev/shm)\""],
            );
            match probe.and_then(|mut c| c.wait().map_err(|e| e.to_string())) {
                Ok(s) if s.success() => None,
                Ok(s) => Some(format!("a private tmpfs on /dev/shm could not be made ({s})")),
                Err(e) => Some(e),
            }
        }
        Err(e) => Some(e),
    }
}

unsafe extern "C" {
    fn geteuid() -> u32;
}

/// The `ip` to run: `HANDOFF_IP`, else the one on the path.
fn ip() -> String {
    std::env::var("HANDOFF_IP")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "ip".into())
}

fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two network namespaces `a` (10.77.0.1) and `b` (10.77.0.2) joined by a veth pair; removed
/// when dropped.
struct Hosts {
    a: String,
    b: String,
    /// The veth pair's ends, in `a` and in `b`.
    va: String,
    vb: String,
}

impl Hosts {
    fn new() -> Result<Hosts, String> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let tag = format!("{}x{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let h = Hosts {
            a: format!("hoa{tag}"),
            b: format!("hob{tag}"),
            va: format!("va{tag}"),
            vb: format!("vb{tag}"),
        };
        let ip = ip();
        sh(&[&ip, "netns", "add", &h.a])?;
        sh(&[&ip, "netns", "add", &h.b])?;
        sh(&[&ip, "link", "add", &h.va, "type", "veth", "peer", "name", &h.vb])?;
        for (ns, v, addr) in [(&h.a, &h.va, A_IP), (&h.b, &h.vb, B_IP)] {
            sh(&[&ip, "link", "set", v, "netns", ns])?;
            sh(&[&ip, "-n", ns, "addr", "add", &format!("{addr}/24"), "dev", v])?;
            sh(&[&ip, "-n", ns, "link", "set", v, "up"])?;
            sh(&[&ip, "-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(h)
    }

    /// Runs `program` in namespace `ns` with its own mount namespace and an empty private
    /// tmpfs on /dev/shm, with `env`.
    fn run(&self, ns: &str, env: &[(&str, String)], program: &Path, args: &[&str]) -> Result<Child, String> {
        let mut c = Command::new(ip());
        c.args([
            "netns",
            "exec",
            ns,
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
        ])
        .arg("mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec \"$0\" \"$@\"")
        .arg(program)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        for (k, v) in env {
            c.env(k, v);
        }
        c.spawn().map_err(|e| format!("ip netns exec: {e}"))
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let ip = ip();
        let _ = sh(&[&ip, "netns", "del", &self.a]);
        let _ = sh(&[&ip, "netns", "del", &self.b]);
    }
}

/// A fresh folder for one trial's all-gather and notes.
fn scratch() -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "handoff-hosts-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// What a child printed, once it exited (killed after `limit`). Its output is read while it
/// runs: a child that prints more than a pipe holds (NCCL's log) must not stall on it.
fn finish(mut c: Child, limit: Duration) -> (bool, String) {
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut text);
            }
            text
        })
    };
    let out = drain(c.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let err = drain(c.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let started = Instant::now();
    let status = loop {
        if let Some(s) = c.try_wait().unwrap() {
            break Some(s);
        }
        if started.elapsed() > limit {
            let _ = c.kill();
            let _ = c.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let (out, err) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
    (
        status.is_some_and(|s| s.success()),
        format!(
            "{out}{err}{}",
            if status.is_none() {
                "[killed: ran too long]"
            } else {
                ""
            }
        ),
    )
}

fn env(role: &str, scenario: &str, dir: &Path) -> Vec<(&'static str, String)> {
    vec![
        (ROLE, role.into()),
        (SCENARIO, scenario.into()),
        (DIR, dir.display().to_string()),
    ]
}

fn exe() -> PathBuf {
    std::env::current_exe().unwrap()
}

/// Runs rank 0 in namespace a and rank 1 in b, with `extra[r]` added to rank r's variables.
fn two_ranks(h: &Hosts, scenario: &str, dir: &Path, extra: [Vec<(&'static str, String)>; 2]) -> [Child; 2] {
    let [e0, e1] = extra;
    let mut v0 = env("rank0", scenario, dir);
    v0.extend(e0);
    let mut v1 = env("rank1", scenario, dir);
    v1.extend(e1);
    [
        h.run(&h.a, &v0, &exe(), &[]).unwrap(),
        h.run(&h.b, &v1, &exe(), &[]).unwrap(),
    ]
}

fn expect(ok: bool, out: &str, wanted: &[&str]) -> Result<(), Failed> {
    if !ok {
        return Err(format!("the child failed:\n{out}").into());
    }
    for w in wanted {
        if !out.contains(w) {
            return Err(format!("the child did not print {w:?}:\n{out}").into());
        }
    }
    Ok(())
}

fn run_ops(secret: Option<&str>) -> Result<(), Failed> {
    let h = Hosts::new()?;
    let dir = scratch();
    // Each rank finds its address as the interface towards MASTER_ADDR.
    let mut extra: Vec<(&'static str, String)> = vec![("MASTER_ADDR", A_IP.into())];
    if let Some(s) = secret {
        extra.push(("HANDOFF_SECRET", s.into()));
    }
    let [c0, c1] = two_ranks(&h, "ops", &dir, [extra.clone(), extra]);
    let (ok0, out0) = finish(c0, Duration::from_secs(20));
    let (ok1, out1) = finish(c1, Duration::from_secs(20));
    print!("rank 0:\n{out0}rank 1:\n{out1}");
    let common = [
        "remote [",
        "300 operations checked",
        "100 collectives checked",
        "mismatch refused",
    ];
    expect(ok0, &out0, &common)?;
    expect(ok1, &out1, &common)?;
    expect(ok0, &out0, &[&format!("listens on {A_IP}:"), "remote [1]"])?;
    expect(ok1, &out1, &[&format!("listens on {B_IP}:"), "remote [0]"])
}

fn ops() -> Result<(), Failed> {
    run_ops(None)
}

fn ops_with_secret() -> Result<(), Failed> {
    run_ops(Some("the job's secret"))
}

fn same_host() -> Result<(), Failed> {
    for (mode, remote) in [("auto", "remote []"), ("tcp", "remote [1]")] {
        let dir = scratch();
        let spawn = |role: &str| {
            Command::new(std::env::current_exe().unwrap())
                .envs(env(role, "ops", &dir))
                .env("HANDOFF_VERIFY_CHANNEL", mode)
                .env("HANDOFF_VERIFY_ADDR", "127.0.0.1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        };
        let (c0, c1) = (spawn("rank0"), spawn("rank1"));
        let (ok0, out0) = finish(c0, Duration::from_secs(20));
        let (ok1, out1) = finish(c1, Duration::from_secs(20));
        print!("{mode}: rank 0:\n{out0}rank 1:\n{out1}");
        let wanted = ["300 operations checked", "mismatch refused"];
        expect(ok0, &out0, &wanted)?;
        expect(ok1, &out1, &wanted)?;
        let other = if remote == "remote []" {
            remote
        } else {
            "remote [0]"
        };
        expect(ok0, &out0, &[remote])?;
        expect(ok1, &out1, &[other])?;
    }
    Ok(())
}

/// Rank 1 is set up, then `what` is done to it; rank 0 then verifies a send to it.
fn peer_lost(scenario: &str, signal: &str) -> Result<Vec<String>, Failed> {
    let h = Hosts::new()?;
    let dir = scratch();
    let addr = |ip: &str| vec![("HANDOFF_VERIFY_ADDR", ip.to_string())];
    let [c0, c1] = two_ranks(&h, scenario, &dir, [addr(A_IP), addr(B_IP)]);
    let ready = dir.join("rank1-ready");
    let until = Instant::now() + Duration::from_secs(10);
    while !ready.exists() {
        if Instant::now() > until {
            return Err("rank 1 never got ready".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    sh(&["kill", signal, &c1.id().to_string()])?;
    std::fs::write(dir.join("done-to-rank1"), b"")?;
    let (ok0, out0) = finish(c0, Duration::from_secs(20));
    let _ = sh(&["kill", "-KILL", &c1.id().to_string()]);
    let (_, out1) = finish(c1, Duration::from_secs(5));
    print!("rank 0:\n{out0}rank 1:\n{out1}");
    expect(ok0, &out0, &["lost peer:"])?;
    Ok(out0.lines().map(str::to_string).collect())
}

fn killed() -> Result<(), Failed> {
    let lines = peer_lost("lost", "-KILL")?;
    let l = lines.iter().find(|l| l.starts_with("lost peer:")).unwrap();
    if !l.contains("PeerBroken(1)") {
        return Err(format!("a killed peer gave {l}").into());
    }
    Ok(())
}

fn stopped() -> Result<(), Failed> {
    let lines = peer_lost("lost", "-STOP")?;
    let l = lines.iter().find(|l| l.starts_with("lost peer:")).unwrap();
    if !l.contains("Timeout") {
        return Err(format!("a stopped peer gave {l}").into());
    }
    Ok(())
}

fn rogue() -> Result<(), Failed> {
    let h = Hosts::new()?;
    let dir = scratch();
    let [c0, c1] = two_ranks(
        &h,
        "rogue",
        &dir,
        [
            vec![("HANDOFF_VERIFY_ADDR", format!("{A_IP}:{ROGUE_PORT}"))],
            vec![("HANDOFF_VERIFY_ADDR", B_IP.into())],
        ],
    );
    let r = h.run(&h.b, &env("rogue", "rogue", &dir), &exe(), &[]).unwrap();
    let (okr, outr) = finish(r, Duration::from_secs(20));
    let (ok0, out0) = finish(c0, Duration::from_secs(20));
    let (ok1, out1) = finish(c1, Duration::from_secs(20));
    print!("rank 0:\n{out0}rank 1:\n{out1}rogue:\n{outr}");
    expect(
        okr,
        &outr,
        &[
            "garbage: closed",
            "guessed proof: closed without an acknowledgement",
        ],
    )?;
    expect(ok0, &out0, &["refused ", "checked after the rogues"])?;
    expect(ok1, &out1, &["checked after the rogues"])
}

fn secrets_differ() -> Result<(), Failed> {
    let h = Hosts::new()?;
    for (s0, s1, said) in [
        (
            Some("alpha-secret-of-the-job"),
            Some("beta-secret-of-the-job"),
            "HANDOFF_SECRET",
        ),
        (Some("alpha-secret-of-the-job"), None, "has a shared secret"),
    ] {
        let dir = scratch();
        let extra = |ip: &str, s: Option<&str>| {
            let mut v = vec![("HANDOFF_VERIFY_ADDR", ip.to_string())];
            v.extend(s.map(|s| ("HANDOFF_SECRET", s.to_string())));
            v
        };
        let [c0, c1] = two_ranks(&h, "refused", &dir, [extra(A_IP, s0), extra(B_IP, s1)]);
        let (ok0, out0) = finish(c0, Duration::from_secs(20));
        let (ok1, out1) = finish(c1, Duration::from_secs(20));
        print!("{s0:?} / {s1:?}: rank 0:\n{out0}rank 1:\n{out1}");
        expect(ok0, &out0, &["setup refused:"])?;
        expect(ok1, &out1, &["setup refused:", said])?;
    }
    Ok(())
}

// --- The children --------------------------------------------------------------------------

fn dir() -> PathBuf {
    PathBuf::from(std::env::var(DIR).expect("the parent sets the folder"))
}

/// An all-gather of `world` ranks through files in `dir`: each round, each rank writes its
/// words to a file of its own (renamed into place whole), then reads everyone's.
struct FileGather {
    rank: usize,
    world: usize,
    round: usize,
    /// Before writing round `.0`, wait for this file (the rogue trial's ordering).
    wait: Option<(usize, PathBuf)>,
}

impl FileGather {
    fn gather(&mut self, words: &[u64]) -> Result<Vec<u64>, String> {
        let d = dir();
        if let Some((round, f)) = &self.wait
            && *round == self.round
        {
            wait_for(f, Duration::from_secs(10))?;
        }
        let name = |r: usize| d.join(format!("round{}-rank{r}", self.round));
        let tmp = d.join(format!("tmp-round{}-rank{}", self.round, self.rank));
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        std::fs::write(&tmp, bytes).map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, name(self.rank)).map_err(|e| e.to_string())?;
        let mut all = Vec::new();
        for r in 0..self.world {
            wait_for(&name(r), Duration::from_secs(10))?;
            let b = std::fs::read(name(r)).map_err(|e| e.to_string())?;
            all.extend(b.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())));
        }
        self.round += 1;
        Ok(all)
    }
}

fn wait_for(f: &Path, limit: Duration) -> Result<(), String> {
    let until = Instant::now() + limit;
    while !f.exists() {
        if Instant::now() > until {
            return Err(format!("{} did not appear", f.display()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

fn settle(rank: usize, timeout: Duration, wait: Option<(usize, PathBuf)>) -> Result<Rank, String> {
    let mut g = FileGather {
        rank,
        world: 2,
        round: 0,
        wait,
    };
    Rank::settle(rank, 2, timeout, &mut |w| g.gather(w))
}

fn child(role: &str) -> Result<(), String> {
    let scenario = std::env::var(SCENARIO).unwrap_or_default();
    if role == "rogue" {
        return rogue_child();
    }
    let rank = match role {
        "rank0" => 0,
        "rank1" => 1,
        _ => return Err(format!("unknown role {role}")),
    };
    let peer = 1 - rank;
    match scenario.as_str() {
        "ops" => {
            let me = settle(rank, Duration::from_secs(5), None)?;
            println!("remote {:?}", me.remote());
            if let Some(a) = listen_note() {
                println!("listens on {a}");
            }
            let counts: Vec<u64> = (1..=300).collect();
            if rank == 0 {
                me.exchange(peer, &counts, &[7])?;
            } else {
                me.exchange(peer, &[7], &[])?;
                for c in &counts {
                    me.exchange(peer, &[], &[*c])?;
                }
            }
            println!("300 operations checked");
            let colls: Vec<u64> = (1..=100).collect();
            me.all_reduce(&colls)?;
            println!("100 collectives checked");
            let r = if rank == 0 {
                me.exchange(peer, &[4_194_304], &[])
            } else {
                me.exchange(peer, &[], &[3_145_728])
            };
            match r {
                Err(e) if e.starts_with("Mismatch(") && e.contains("4194304") && e.contains("3145728") => {
                    println!("mismatch refused: {e}")
                }
                other => return Err(format!("the mismatch gave {other:?}")),
            }
            barrier(rank)
        }
        "lost" => {
            let me = settle(rank, Duration::from_secs(2), None)?;
            if rank == 1 {
                std::fs::write(dir().join("rank1-ready"), b"").map_err(|e| e.to_string())?;
                std::thread::sleep(Duration::from_secs(30));
                return Ok(());
            }
            wait_for(&dir().join("done-to-rank1"), Duration::from_secs(10))?;
            // Give a killed peer's kernel the moment it takes to close its sockets.
            std::thread::sleep(Duration::from_millis(50));
            let t = Instant::now();
            let r = me.exchange(peer, &[4], &[]);
            let took = t.elapsed();
            println!("lost peer: {r:?} after {took:?}");
            if took > Duration::from_secs(4) {
                return Err(format!("waited {took:?} with a 2 s timeout"));
            }
            Ok(())
        }
        "rogue" => {
            let wait = (rank == 1).then(|| (1, dir().join("rogue-done")));
            let me = settle(rank, Duration::from_secs(5), wait)?;
            if rank == 0 {
                println!("refused {}", me.refused());
            }
            if rank == 0 {
                me.exchange(peer, &[5], &[6])?;
            } else {
                me.exchange(peer, &[6], &[5])?;
            }
            println!("checked after the rogues");
            barrier(rank)
        }
        "gpu_send_recv" => gpu::send_recv_child(rank),
        "gpu_mismatch" => gpu::mismatch_child(rank),
        "refused" => match settle(rank, Duration::from_secs(2), None) {
            Ok(_) => Err("set up with a peer that holds another secret".into()),
            Err(e) => {
                println!("setup refused: {e}");
                Ok(())
            }
        },
        _ => Err(format!("unknown scenario {scenario}")),
    }
}

/// Waits until the other rank has verified too before this one drops its side, as a
/// communicator waits for its operations to complete before it closes its channel (a peer
/// that closed reads as broken, and its partner would not post).
fn barrier(rank: usize) -> Result<(), String> {
    std::fs::write(dir().join(format!("exit-rank{rank}")), b"").map_err(|e| e.to_string())?;
    wait_for(
        &dir().join(format!("exit-rank{}", 1 - rank)),
        Duration::from_secs(10),
    )
}

/// Where this rank's channel listens, as the setup chose it (for the trials' checks).
fn listen_note() -> Option<String> {
    handoff::nccl::rehearsal::listen_addr()
        .ok()
        .map(|a| a.ip().to_string() + ":")
}

/// Connects to rank 0's listener as three rogues would, before rank 1 does: one that stays
/// silent (held open until the end), one that sends garbage, one with a well-formed hello
/// claiming rank 1 and a guessed proof.
fn rogue_child() -> Result<(), String> {
    let addr = format!("{A_IP}:{ROGUE_PORT}");
    let until = Instant::now() + Duration::from_secs(10);
    let connect = || loop {
        match TcpStream::connect(&addr) {
            Ok(s) => return Ok(s),
            Err(_) if Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(format!("connecting to {addr}: {e}")),
        }
    };
    let silent = connect()?;
    let mut garbage = connect()?;
    garbage.write_all(&[0xab; 200]).map_err(|e| e.to_string())?;
    let mut guess = connect()?;
    let mut hello = 0x4844_4f46_4656_4331u64.to_le_bytes().to_vec();
    for w in [1u32, 0, 2, 0] {
        hello.extend_from_slice(&w.to_le_bytes());
    }
    hello.extend_from_slice(&[7; 32]);
    guess.write_all(&hello).map_err(|e| e.to_string())?;
    std::fs::write(dir().join("rogue-done"), b"").map_err(|e| e.to_string())?;
    for s in [&garbage, &guess] {
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
    }
    let mut rest = Vec::new();
    // Closed with the garbage unread, the connection is reset: refused either way.
    match garbage.read_to_end(&mut rest) {
        Ok(_) => println!("garbage: closed after {} bytes", rest.len()),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => println!("garbage: closed ({e})"),
        Err(e) => return Err(format!("garbage: {e}")),
    }
    let mut reply = [0u8; 80];
    guess
        .read_exact(&mut reply)
        .map_err(|e| format!("guessed proof: no reply: {e}"))?;
    guess.write_all(&[0; 32]).map_err(|e| e.to_string())?;
    let mut rest = Vec::new();
    match guess.read_to_end(&mut rest) {
        Ok(_) if rest.is_empty() => println!("guessed proof: closed without an acknowledgement"),
        Ok(_) => return Err(format!("guessed proof: got {rest:?}")),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
            println!("guessed proof: closed without an acknowledgement ({e})")
        }
        Err(e) => return Err(format!("guessed proof: {e}")),
    }
    drop(silent);
    Ok(())
}
