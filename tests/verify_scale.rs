//! How verification's traffic grows with the world size, counted on the wire: ranks as threads
//! of this process, each verifying through the TCP channel (`HANDOFF_VERIFY_CHANNEL=tcp`, as
//! between hosts) with `handoff::nccl::rehearsal`, no GPU and no NCCL. The kernel's counters
//! of this process's TCP connections (`benches/harness/sockets.rs`) give what was sent.
//!
//! The law pinned here, per rank of a world of `n` (ARCHITECTURE.md, "Verifying collectives at
//! a thousand ranks"): `n - 1` connections; per collective, one record to every peer with its
//! entry and one with the checked counter that follows it, `2 (n - 1)`; per step of a ring of
//! sends and receives, two such records to each of its two neighbours, 4 whatever `n`. Each
//! operation runs alone and the channel is left to go quiet (its receiver threads send the
//! counters a verification held back), so the counts are exact: a record is then one frame.
//! `benches/verify_scale.rs` measures the same with ranks as processes, operations back to
//! back (where counters ride along with later entries), and the time they take.

#[path = "../benches/harness/sockets.rs"]
mod sockets;

use std::sync::{Arc, Barrier, Condvar, Mutex};
use std::time::{Duration, Instant};

use handoff::nccl::rehearsal::Rank;
use libtest_mimic::{Arguments, Failed, Trial};
use sockets::Tcp;

/// A record of one frame on the wire: its length (2 bytes), five words, the AEAD tag.
const ONE_FRAME_RECORD: u64 = 2 + 5 * 8 + 16;

fn main() {
    // SAFETY: no other thread exists yet, and nothing reads the environment meanwhile.
    unsafe {
        std::env::set_var("HANDOFF_VERIFY_CHANNEL", "tcp");
        std::env::set_var("HANDOFF_VERIFY_ADDR", "127.0.0.1");
    }
    let mut args = Arguments::from_args();
    // The counters are the whole process's: one world at a time.
    args.test_threads = Some(1);
    let mut trials = Vec::new();
    for n in [2, 4, 8] {
        trials.push(Trial::test(
            format!("a_collective_sends_two_records_to_each_of_the_other_ranks_{n}"),
            move || collective(n),
        ));
    }
    // Not at 2 ranks: there both neighbours are one peer, whose two counters (sends checked,
    // receives checked) go in one record or two as the receiver thread's timing falls.
    for n in [4, 8] {
        trials.push(Trial::test(
            format!("a_ring_step_sends_four_records_whatever_the_world_{n}"),
            move || ring(n),
        ));
    }
    libtest_mimic::run(&args, trials).exit()
}

/// Connections each rank has through the channel.
fn connections(n: u64) -> u64 {
    n - 1
}

/// Records a rank sends for one collective (its entry, then its checked counter, to each peer).
fn collective_records(n: u64) -> u64 {
    2 * (n - 1)
}

/// Records a rank sends for one step of a ring (an entry and a counter to each neighbour).
fn ring_records(_n: u64) -> u64 {
    4
}

/// An all-gather between ranks on threads, in rounds.
struct Exchange {
    world: usize,
    rounds: Mutex<Vec<Vec<Option<Vec<u64>>>>>,
    arrived: Condvar,
}

impl Exchange {
    fn gather(&self, rank: usize, round: usize, words: &[u64]) -> Result<Vec<u64>, String> {
        let mut rounds = self.rounds.lock().unwrap();
        while rounds.len() <= round {
            rounds.push(vec![None; self.world]);
        }
        rounds[round][rank] = Some(words.to_vec());
        self.arrived.notify_all();
        let until = Instant::now() + Duration::from_secs(10);
        while rounds[round].iter().any(Option::is_none) {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!("all-gather round {round} timed out"));
            }
            rounds = self.arrived.wait_timeout(rounds, left).unwrap().0;
        }
        Ok(rounds[round].iter().flat_map(|w| w.clone().unwrap()).collect())
    }
}

/// Waits until the process's TCP counters have not moved for 150 ms (the channel's receiver
/// threads send what was held back within 40 ms), then returns them.
fn quiet() -> Result<Tcp, Failed> {
    let until = Instant::now() + Duration::from_secs(5);
    let mut last = sockets::tcp();
    let mut still = 0;
    while still < 3 {
        if Instant::now() > until {
            return Err("the channel's connections did not go quiet within 5 s".into());
        }
        std::thread::sleep(Duration::from_millis(50));
        let now = sockets::tcp();
        still = if now == last { still + 1 } else { 0 };
        last = now;
    }
    Ok(last)
}

/// `n` ranks on threads, each running `step` `steps` times, one at a time; after each, the
/// counters' change over the whole world.
fn world(
    n: usize,
    steps: usize,
    step: impl Fn(&Rank, usize) -> Result<(), String> + Send + Sync + 'static,
) -> Result<Vec<Tcp>, Failed> {
    let x = Arc::new(Exchange {
        world: n,
        rounds: Mutex::new(Vec::new()),
        arrived: Condvar::new(),
    });
    let gate = Arc::new(Barrier::new(n + 1));
    let step = Arc::new(step);
    let ranks: Vec<_> = (0..n)
        .map(|r| {
            let (x, gate, step) = (x.clone(), gate.clone(), step.clone());
            std::thread::spawn(move || {
                let mut round = 0;
                let mut gather = |w: &[u64]| {
                    round += 1;
                    x.gather(r, round - 1, w)
                };
                let me = Rank::settle(r, n, Duration::from_secs(10), &mut gather);
                let mut failed = me.as_ref().err().cloned();
                // Every rank meets every barrier, failed or not, so that none waits forever.
                gate.wait();
                for _ in 0..steps {
                    gate.wait();
                    if let (Ok(me), None) = (&me, &failed) {
                        failed = step(me, r).err();
                    }
                    gate.wait();
                }
                // The channel closes once every rank is done with it.
                gate.wait();
                failed.map_or(Ok(()), |e| Err(format!("rank {r}: {e}")))
            })
        })
        .collect();
    gate.wait();
    let mut result = Ok(Vec::new());
    let mut before = quiet();
    if let Ok(b) = &before
        && b.established != n as u64 * connections(n as u64)
    {
        result = Err(format!(
            "{} connections established among {n} ranks, expected {} (both ends of each)",
            b.established,
            n as u64 * connections(n as u64)
        ));
    }
    for _ in 0..steps {
        gate.wait();
        gate.wait();
        let after = quiet();
        if let (Ok(v), Ok(b), Ok(a)) = (&mut result, &before, &after) {
            v.push(a.since(*b));
        }
        before = after;
    }
    gate.wait();
    for (r, t) in ranks.into_iter().enumerate() {
        t.join().map_err(|_| format!("rank {r} panicked"))??;
    }
    before?;
    Ok(result?)
}

/// Whether `seen` is `records` one-frame records sent and received over the world (the
/// kernel's retransmissions left out: over loopback, nothing is lost, so every segment sent
/// once is received once).
fn check(what: &str, seen: Tcp, records: u64) -> Result<(), Failed> {
    let bytes = records * ONE_FRAME_RECORD;
    let want = (records, records, bytes, bytes);
    let got = (
        seen.sent_once(),
        seen.data_segs_in - seen.retrans_segs,
        seen.bytes_once(),
        seen.bytes_received,
    );
    if got != want {
        return Err(format!(
            "{what}: (records sent, received, bytes sent, received) = {got:?} over the world, \
             expected {want:?} ({} retransmitted)",
            seen.retrans_segs
        )
        .into());
    }
    Ok(())
}

fn collective(n: usize) -> Result<(), Failed> {
    let seen = world(n, 2, |me, _| me.all_reduce(&[8]))?;
    for (i, s) in seen.into_iter().enumerate() {
        check(
            &format!("all-reduce {i} of {n} ranks"),
            s,
            n as u64 * collective_records(n as u64),
        )?;
    }
    Ok(())
}

fn ring(n: usize) -> Result<(), Failed> {
    // Even ranks send first and odd ones receive first, so that every send finds its receive.
    let seen = world(n, 2, move |me, r| {
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        if r.is_multiple_of(2) {
            me.exchange(next, &[8], &[])?;
            me.exchange(prev, &[], &[8])
        } else {
            me.exchange(prev, &[], &[8])?;
            me.exchange(next, &[8], &[])
        }
    })?;
    for (i, s) in seen.into_iter().enumerate() {
        check(
            &format!("ring step {i} of {n} ranks"),
            s,
            n as u64 * ring_records(n as u64),
        )?;
    }
    Ok(())
}
