//! The rank processes of `benches/verify_scale.rs`: what each measures and reports, and the
//! barriers (files) at which they meet their parent between phases.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use handoff::nccl::rehearsal::Rank;
use serde_json::{Value, json};

use crate::harness::files::{FileGather, wait_for};
use crate::harness::sockets::{self, Tcp};

// What the parent tells each rank: its rank, the folder of the all-gather and the barriers,
// the world's size, the timed and the warm-up operations per phase.
pub const ROLE: &str = "HANDOFF_SCALE_ROLE";
pub const DIR: &str = "HANDOFF_SCALE_DIR";
pub const WORLD: &str = "HANDOFF_SCALE_WORLD";
pub const OPS: &str = "HANDOFF_SCALE_OPS";
pub const WARMUP: &str = "HANDOFF_SCALE_WARMUP";
/// How long the channel is left between a phase's last operation and its counters.
const QUIET: Duration = Duration::from_millis(100);
/// How long the ranks sit idle, connected, while their CPU time is read.
const IDLE: Duration = Duration::from_secs(1);
/// How long anyone waits at a barrier.
const BARRIER_LIMIT: Duration = Duration::from_secs(300);
/// Every wait of verification.
const TIMEOUT: Duration = Duration::from_secs(60);

// --- What a rank reports ------------------------------------------------------------------

/// A rank's connections over a phase, from [`Tcp`]: established at its end; records sent
/// (data segments sent once) and data segments received (the peers' retransmissions
/// included); segments the kernel retransmitted; payload bytes sent once and received.
#[derive(Clone, Copy, Default)]
pub struct Counts {
    pub established: u64,
    pub records_out: u64,
    pub segs_in: u64,
    pub retrans: u64,
    pub bytes_out: u64,
    pub bytes_in: u64,
}

impl From<Tcp> for Counts {
    fn from(t: Tcp) -> Counts {
        Counts {
            established: t.established,
            records_out: t.sent_once(),
            segs_in: t.data_segs_in,
            retrans: t.retrans_segs,
            bytes_out: t.bytes_once(),
            bytes_in: t.bytes_received,
        }
    }
}

/// What a rank prints to its parent at the end: its setup, then each phase's counts and times.
pub struct Report {
    pub rank: usize,
    pub remote: usize,
    pub refused: usize,
    pub settle_us: f64,
    /// Of `settle_us`, the time spent in the file all-gather.
    pub gather_us: f64,
    pub rss_kib: u64,
    pub threads: u64,
    /// The process's CPU time per second of wall time while no rank verifies anything.
    pub idle_cpu_ms_per_s: f64,
    pub setup: Counts,
    pub p2p: Counts,
    pub p2p_us: f64,
    /// The process's CPU time per operation, all its threads.
    pub p2p_cpu_us: f64,
    pub coll: Counts,
    pub coll_us: f64,
    pub coll_cpu_us: f64,
}

impl Counts {
    fn json(&self) -> Value {
        json!([
            self.established,
            self.records_out,
            self.segs_in,
            self.retrans,
            self.bytes_out,
            self.bytes_in
        ])
    }

    fn from_json(v: &Value) -> Option<Counts> {
        let n = |i: usize| v.get(i)?.as_u64();
        Some(Counts {
            established: n(0)?,
            records_out: n(1)?,
            segs_in: n(2)?,
            retrans: n(3)?,
            bytes_out: n(4)?,
            bytes_in: n(5)?,
        })
    }
}

impl Report {
    /// The line a rank prints to its parent.
    fn json(&self) -> String {
        json!({
            "rank": self.rank, "remote": self.remote, "refused": self.refused,
            "settle_us": self.settle_us, "gather_us": self.gather_us,
            "rss_kib": self.rss_kib, "threads": self.threads,
            "idle_cpu_ms_per_s": self.idle_cpu_ms_per_s,
            "setup": self.setup.json(), "p2p": self.p2p.json(), "p2p_us": self.p2p_us,
            "p2p_cpu_us": self.p2p_cpu_us, "coll": self.coll.json(), "coll_us": self.coll_us,
            "coll_cpu_us": self.coll_cpu_us,
        })
        .to_string()
    }

    pub fn parse(line: &str) -> Option<Report> {
        let v: Value = serde_json::from_str(line).ok()?;
        let u = |k: &str| v.get(k)?.as_u64();
        let f = |k: &str| v.get(k)?.as_f64();
        let c = |k: &str| Counts::from_json(v.get(k)?);
        Some(Report {
            rank: u("rank")? as usize,
            remote: u("remote")? as usize,
            refused: u("refused")? as usize,
            settle_us: f("settle_us")?,
            gather_us: f("gather_us")?,
            rss_kib: u("rss_kib")?,
            threads: u("threads")?,
            idle_cpu_ms_per_s: f("idle_cpu_ms_per_s")?,
            setup: c("setup")?,
            p2p: c("p2p")?,
            p2p_us: f("p2p_us")?,
            p2p_cpu_us: f("p2p_cpu_us")?,
            coll: c("coll")?,
            coll_us: f("coll_us")?,
            coll_cpu_us: f("coll_cpu_us")?,
        })
    }
}

// --- Barriers between the ranks and the parent ----------------------------------------------

/// Rank `rank` has reached `phase`; returns once the parent says every rank has.
pub fn barrier(dir: &Path, rank: usize, phase: &str) -> Result<(), String> {
    std::fs::write(dir.join(format!("at-{phase}-{rank}")), b"").map_err(|e| e.to_string())?;
    wait_for(&dir.join(format!("go-{phase}")), BARRIER_LIMIT)
}

/// The parent's side of [`barrier`]: waits for every rank, reads `snapshot`, lets them go.
pub fn release<T>(
    dir: &Path,
    world: usize,
    phase: &str,
    children: &mut [Child],
    snapshot: impl FnOnce() -> T,
) -> Result<T, String> {
    let until = Instant::now() + BARRIER_LIMIT;
    for (r, child) in children.iter_mut().enumerate().take(world) {
        let f = dir.join(format!("at-{phase}-{r}"));
        while !f.exists() {
            if let Ok(Some(s)) = child.try_wait() {
                return Err(format!("rank {r} exited ({s}) before {phase}"));
            }
            if Instant::now() > until {
                return Err(format!("rank {r} did not reach {phase}"));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let t = snapshot();
    std::fs::write(dir.join(format!("go-{phase}")), b"").map_err(|e| e.to_string())?;
    Ok(t)
}

// --- A rank ---------------------------------------------------------------------------------

fn var(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("{name} is not set"))
}

/// A field of `/proc/self/status`, in its units.
fn status_field(name: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse().ok()))
        })
        .unwrap_or(0)
}

#[repr(C)]
struct Timespec {
    sec: i64,
    nsec: i64,
}

/// `CLOCK_PROCESS_CPUTIME_ID`.
const PROCESS_CPU: i32 = 2;

unsafe extern "C" {
    fn clock_gettime(clock: i32, t: *mut Timespec) -> i32;
}

/// The CPU time this process has used, all its threads.
pub fn process_cpu() -> Duration {
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: `t` is valid for writes for the call; the clock exists on every Linux.
    let r = unsafe { clock_gettime(PROCESS_CPU, &mut t) };
    assert_eq!(r, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID)");
    Duration::new(t.sec as u64, t.nsec as u32)
}

/// `n` operations of `op`, each as this rank sees it; the mean time per operation, in µs.
fn timed(n: usize, mut op: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
    let t = Instant::now();
    for _ in 0..n {
        op()?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e6 / n as f64)
}

/// What one phase measured: the counters' change, wall and CPU µs per operation.
type Measured = (Counts, f64, f64);

/// One phase of `ops` operations between barriers, after `warmup` untimed ones: the counters'
/// change over the timed ones, and the wall and CPU time per operation.
fn phase(
    dir: &Path,
    rank: usize,
    name: &str,
    warmup: usize,
    ops: usize,
    mut op: impl FnMut() -> Result<(), String>,
) -> Result<Measured, String> {
    timed(warmup.max(1), &mut op)?;
    barrier(dir, rank, &format!("{name}-warm"))?;
    std::thread::sleep(QUIET);
    let before = sockets::tcp();
    barrier(dir, rank, &format!("{name}-start"))?;
    let cpu = process_cpu();
    let us = timed(ops, &mut op)?;
    let cpu_us = (process_cpu() - cpu).as_secs_f64() * 1e6 / ops as f64;
    barrier(dir, rank, &format!("{name}-done"))?;
    std::thread::sleep(QUIET);
    let after = sockets::tcp();
    barrier(dir, rank, &format!("{name}-counted"))?;
    Ok((after.since(before).into(), us, cpu_us))
}

pub fn rank_main(rank: usize) -> Result<(), String> {
    let dir = PathBuf::from(var(DIR)?);
    let number = |n: &str| var(n)?.parse::<usize>().map_err(|e| format!("{n}: {e}"));
    let (world, ops, warmup) = (number(WORLD)?, number(OPS)?, number(WARMUP)?);
    let mut files = FileGather::new(dir.clone(), rank, world);
    let mut in_gather = Duration::ZERO;
    barrier(&dir, rank, "begin")?;
    let t = Instant::now();
    let me = Rank::settle(rank, world, TIMEOUT, &mut |w| {
        let g = Instant::now();
        let all = files.gather(w);
        in_gather += g.elapsed();
        all
    })?;
    let settle = t.elapsed();
    let setup = sockets::tcp();
    let (rss_kib, threads) = (status_field("VmRSS:"), status_field("Threads:"));
    barrier(&dir, rank, "settled")?;
    let (cpu, t) = (process_cpu(), Instant::now());
    std::thread::sleep(IDLE);
    let idle_cpu_ms_per_s = (process_cpu() - cpu).as_secs_f64() * 1e3 / t.elapsed().as_secs_f64();
    barrier(&dir, rank, "idle")?;
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let (p2p, p2p_us, p2p_cpu_us) = phase(&dir, rank, "p2p", warmup, ops, || {
        if rank.is_multiple_of(2) {
            me.exchange(next, &[8], &[])?;
            me.exchange(prev, &[], &[8])
        } else {
            me.exchange(prev, &[], &[8])?;
            me.exchange(next, &[8], &[])
        }
    })?;
    let (coll, coll_us, coll_cpu_us) = phase(&dir, rank, "coll", warmup, ops, || me.all_reduce(&[8]))?;
    let report = Report {
        rank,
        remote: me.remote().len(),
        refused: me.refused(),
        settle_us: settle.as_secs_f64() * 1e6,
        gather_us: in_gather.as_secs_f64() * 1e6,
        rss_kib,
        threads,
        idle_cpu_ms_per_s,
        setup: setup.into(),
        p2p,
        p2p_us,
        p2p_cpu_us,
        coll,
        coll_us,
        coll_cpu_us,
    };
    println!("{}", report.json());
    // No rank closes its channel while another may still read from it.
    barrier(&dir, rank, "end")?;
    Ok(())
}
