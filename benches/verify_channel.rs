//! The cost of verification between two processes of one host, CPU only, through shared
//! mailbox files and through the channel over loopback TCP (`HANDOFF_VERIFY_CHANNEL=tcp`):
//! - a round trip: a published and checked operation each way (rank 0 verifies a send to rank
//!   1, then a receive from it; rank 1 the counterparts), the latency of verification when
//!   each rank waits for the other;
//! - a stream: rank 0 verifies sends one at a time, rank 1 the receives, each going on as
//!   soon as its own is checked, as two hosts that run ahead of their GPUs do: the rate of
//!   verifications when neither rank waits for the other to finish one.
//!
//! `cargo bench --bench verify_channel [-- ITERATIONS]`

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use handoff::nccl::rehearsal::Rank;

const ROLE: &str = "HANDOFF_BENCH_ROLE";
const DIR: &str = "HANDOFF_BENCH_DIR";

fn main() {
    let iterations: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(20_000);
    if let Ok(role) = std::env::var(ROLE) {
        let rank: usize = role.parse().expect("a rank");
        rank_main(rank, iterations);
        return;
    }
    println!("verification round trip between two processes, {iterations} iterations (after 1,000 warm-up)");
    for mode in ["auto", "tcp"] {
        let dir = std::env::temp_dir().join(format!("handoff-bench-verify-{}-{mode}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let spawn = |r: usize| {
            Command::new(std::env::current_exe().unwrap())
                .arg(iterations.to_string())
                .env(ROLE, r.to_string())
                .env(DIR, &dir)
                .env("HANDOFF_VERIFY_CHANNEL", mode)
                .env("HANDOFF_VERIFY_ADDR", "127.0.0.1")
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        };
        let (a, b) = (spawn(0), spawn(1));
        let out = a.wait_with_output().unwrap();
        b.wait_with_output().unwrap();
        let what = if mode == "tcp" {
            "channel (loopback TCP)"
        } else {
            "shared mailbox files"
        };
        print!("{what:>24}: {}", String::from_utf8_lossy(&out.stdout));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn rank_main(rank: usize, iterations: usize) {
    let dir = PathBuf::from(std::env::var(DIR).unwrap());
    let mut round = 0;
    let mut gather = |w: &[u64]| -> Result<Vec<u64>, String> {
        let name = |r: usize| dir.join(format!("round{round}-rank{r}"));
        let tmp = dir.join(format!("tmp{round}-{rank}"));
        std::fs::write(&tmp, w.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
            .map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, name(rank)).map_err(|e| e.to_string())?;
        let mut all = Vec::new();
        for r in 0..2 {
            wait_for(&name(r));
            let b = std::fs::read(name(r)).map_err(|e| e.to_string())?;
            all.extend(b.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())));
        }
        round += 1;
        Ok(all)
    };
    let me = Rank::settle(rank, 2, Duration::from_secs(10), &mut gather).unwrap();
    let peer = 1 - rank;
    let step = || {
        if rank == 0 {
            me.exchange(peer, &[8], &[]).unwrap();
            me.exchange(peer, &[], &[8]).unwrap();
        } else {
            me.exchange(peer, &[], &[8]).unwrap();
            me.exchange(peer, &[8], &[]).unwrap();
        }
    };
    for _ in 0..1_000 {
        step();
    }
    let mut times = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let t = Instant::now();
        step();
        times.push(t.elapsed());
    }
    // Neither side closes its channel while the other may still read from it.
    for _ in 0..10 {
        step();
    }
    let mut streamed = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let t = Instant::now();
        if rank == 0 {
            me.exchange(peer, &[8], &[]).unwrap();
        } else {
            me.exchange(peer, &[], &[8]).unwrap();
        }
        streamed.push(t.elapsed());
    }
    for _ in 0..10 {
        step();
    }
    std::fs::write(dir.join(format!("done{rank}")), b"").unwrap();
    wait_for(&dir.join(format!("done{peer}")));
    times.sort();
    streamed.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mean = |t: &[Duration]| t.iter().map(|&d| us(d)).sum::<f64>() / t.len() as f64;
    if rank == 0 {
        println!(
            "remote {:?}: median {:.2} µs, mean {:.2} µs, p99 {:.2} µs per round trip",
            me.remote(),
            us(times[times.len() / 2]),
            mean(&times),
            us(times[times.len() * 99 / 100])
        );
        println!(
            "{:>26}stream: median {:.2} µs, mean {:.2} µs per verified send",
            "",
            us(streamed[streamed.len() / 2]),
            mean(&streamed)
        );
    }
}

fn wait_for(f: &Path) {
    let until = Instant::now() + Duration::from_secs(20);
    while !f.exists() {
        assert!(Instant::now() < until, "{} did not appear", f.display());
        std::thread::sleep(Duration::from_millis(2));
    }
}
