//! The cost of verification between two processes of one host, CPU only, through shared
//! mailbox files and through the channel over loopback TCP (`HANDOFF_VERIFY_CHANNEL=tcp`):
//! - a round trip: a published and checked operation each way (rank 0 verifies a send to rank
//!   1, then a receive from it; rank 1 the counterparts), the latency of verification when
//!   each rank waits for the other;
//! - a stream: rank 0 verifies sends one at a time, rank 1 the receives, each going on as
//!   soon as its own is checked, as two hosts that run ahead of their GPUs do: the rate of
//!   verifications when neither rank waits for the other to finish one;
//! - the receiver ahead: rank 1 verifies receives back to back while rank 0, between its
//!   verified sends, works for [`WORK`] (as a host does that launches the transfer): each of
//!   rank 0's verifications finds rank 1's counterpart there, the common case; what it costs
//!   rank 0's host is what verification adds to a send on that path. Also as this thread's
//!   CPU time (which a loaded machine's other work does not inflate, as it does wall time).
//!
//! Beside them, the floor any TCP channel has here: two threads exchanging records of one
//! frame's size ([`RECORD`]) over loopback with the same non-blocking calls, nothing verified.
//!
//! `cargo bench --bench verify_channel [-- ITERATIONS] [auto|tcp]` (both modes unless one is
//! named).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use handoff::nccl::rehearsal::Rank;

mod harness;

use harness::files::{FileGather, wait_for};

const ROLE: &str = "HANDOFF_BENCH_ROLE";
/// Rank 0's work between two sends in the receiver-ahead measurement.
const WORK: Duration = Duration::from_micros(20);
/// A record of one frame on the channel: its count, a frame of five words, its tag.
const RECORD: usize = 8 + 40 + 16;
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
    let named: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a == "auto" || a == "tcp")
        .collect();
    for mode in ["auto", "tcp"] {
        if !named.is_empty() && !named.iter().any(|n| n == mode) {
            continue;
        }
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
    if named.is_empty() || named.iter().any(|n| n == "tcp") {
        tcp_floor(iterations);
    }
}

fn rank_main(rank: usize, iterations: usize) {
    let dir = PathBuf::from(std::env::var(DIR).unwrap());
    let mut files = FileGather::new(dir.clone(), rank, 2);
    let me = Rank::settle(rank, 2, Duration::from_secs(10), &mut |w| files.gather(w)).unwrap();
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
    let mut ahead = Vec::with_capacity(iterations);
    let mut ahead_cpu = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        if rank == 0 {
            let until = Instant::now() + WORK;
            while Instant::now() < until {
                std::hint::spin_loop();
            }
            let (t, c) = (Instant::now(), thread_cpu());
            me.exchange(peer, &[8], &[]).unwrap();
            ahead_cpu.push(thread_cpu() - c);
            ahead.push(t.elapsed());
        } else {
            me.exchange(peer, &[], &[8]).unwrap();
        }
    }
    for _ in 0..10 {
        step();
    }
    std::fs::write(dir.join(format!("done{rank}")), b"").unwrap();
    wait_for(&dir.join(format!("done{peer}")), Duration::from_secs(20)).unwrap();
    times.sort();
    streamed.sort();
    ahead.sort();
    ahead_cpu.sort();
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
        println!(
            "{:>26}receiver ahead: median {:.2} µs, mean {:.2} µs, p99 {:.2} µs per verified send \
             (CPU median {:.2} µs)",
            "",
            us(ahead[ahead.len() / 2]),
            mean(&ahead),
            us(ahead[ahead.len() * 99 / 100]),
            us(ahead_cpu[ahead_cpu.len() / 2])
        );
    }
}

// Linux's flags (libc is not a dependency).
const MSG_DONTWAIT: i32 = 0x40;
const MSG_NOSIGNAL: i32 = 0x4000;

#[repr(C)]
struct Timespec {
    sec: i64,
    nsec: i64,
}

/// `CLOCK_THREAD_CPUTIME_ID`.
const THREAD_CPU: i32 = 3;

unsafe extern "C" {
    fn clock_gettime(clock: i32, t: *mut Timespec) -> i32;
    fn send(fd: i32, buf: *const u8, len: usize, flags: i32) -> isize;
    fn recv(fd: i32, buf: *mut u8, len: usize, flags: i32) -> isize;
}

/// The CPU time this thread has used.
fn thread_cpu() -> Duration {
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: `t` is valid for writes for the call; the clock exists on every Linux.
    let r = unsafe { clock_gettime(THREAD_CPU, &mut t) };
    assert_eq!(r, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(t.sec as u64, t.nsec as u32)
}

/// One record to the peer, as the channel sends it; panics if the socket does not take it
/// whole (it has room for thousands).
fn send_record(s: &std::net::TcpStream, r: &[u8; RECORD]) {
    use std::os::fd::AsRawFd;
    // SAFETY: `r` is valid for `RECORD` bytes for the call; `s` owns the descriptor.
    let n = unsafe { send(s.as_raw_fd(), r.as_ptr(), RECORD, MSG_DONTWAIT | MSG_NOSIGNAL) };
    assert_eq!(n, RECORD as isize, "loopback took less than a record");
}

/// Reads one record (not a byte past it), one non-blocking call at a time, as the channel does.
fn recv_record(s: &std::net::TcpStream, buf: &mut [u8; RECORD]) {
    use std::os::fd::AsRawFd;
    let mut have = 0;
    while have < RECORD {
        // SAFETY: `buf[have..]` is valid for writes of `RECORD - have` bytes for the call; `s`
        // owns the descriptor.
        let n = unsafe {
            recv(
                s.as_raw_fd(),
                buf[have..].as_mut_ptr(),
                RECORD - have,
                MSG_DONTWAIT,
            )
        };
        match n {
            0 => panic!("the peer closed"),
            n if n > 0 => have += n as usize,
            _ => std::hint::spin_loop(),
        }
    }
}

/// The floor of a channel over loopback TCP: records sent and read as the channel does,
/// nothing sealed, checked or applied: lock-step as the stream (each thread sends one, then
/// waits for the other's), and as the receiver-ahead path (one send, one read of a record
/// already there, while the peer waits for the next on another core).
/// A loopback TCP connection without Nagle's delay: this end, and a thread running `peer` on
/// the other.
fn loopback(
    peer: impl FnOnce(&std::net::TcpStream) + Send + 'static,
) -> (std::net::TcpStream, std::thread::JoinHandle<()>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let thread = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        s.set_nodelay(true).unwrap();
        peer(&s);
    });
    let s = std::net::TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    (s, thread)
}

fn tcp_floor(iterations: usize) {
    let (s, peer) = loopback(move |s| {
        let (r, mut buf) = ([1u8; RECORD], [0u8; RECORD]);
        for _ in 0..iterations + 1_000 {
            send_record(s, &r);
            recv_record(s, &mut buf);
        }
    });
    let (r, mut buf) = ([2u8; RECORD], [0u8; RECORD]);
    let mut stream = Vec::with_capacity(iterations);
    for i in 0..iterations + 1_000 {
        let t = Instant::now();
        send_record(&s, &r);
        recv_record(&s, &mut buf);
        if i >= 1_000 {
            stream.push(t.elapsed());
        }
    }
    peer.join().unwrap();
    drop(s);
    // The receiver-ahead path: the peer thread reads each record and answers it at once (as
    // rank 1 publishes its next receive when one returns); this thread works between sends,
    // so that the answer is there when it reads.
    let (s, peer) = loopback(move |s| {
        let (r, mut buf) = ([1u8; RECORD], [0u8; RECORD]);
        send_record(s, &r);
        for _ in 0..iterations + 1_000 {
            recv_record(s, &mut buf);
            send_record(s, &r);
        }
    });
    let mut ahead = Vec::with_capacity(iterations);
    let mut ahead_cpu = Vec::with_capacity(iterations);
    for i in 0..iterations + 1_000 {
        let until = Instant::now() + WORK;
        while Instant::now() < until {
            std::hint::spin_loop();
        }
        let (t, c) = (Instant::now(), thread_cpu());
        send_record(&s, &r);
        recv_record(&s, &mut buf);
        if i >= 1_000 {
            ahead_cpu.push(thread_cpu() - c);
            ahead.push(t.elapsed());
        }
    }
    peer.join().unwrap();
    stream.sort();
    ahead.sort();
    ahead_cpu.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "{:>24}: lock-step median {:.2} µs per record each way; receiver ahead median {:.2} µs \
         per send and read (CPU median {:.2} µs)",
        "TCP floor, unverified",
        us(stream[stream.len() / 2]),
        us(ahead[ahead.len() / 2]),
        us(ahead_cpu[ahead_cpu.len() / 2])
    );
}
