//! Held groups and their gates (`verify::held`), on a CPU, against the stub libraries of
//! tests/stubs: the stub runtime's `cuStreamWaitValue32` holds a stream (its queries, its
//! synchronizations and events recorded behind it) until the word is written, as the GPU does.
//! Two ranks, each a thread of this process with a verified communicator of its own, first
//! exchange one send and receive (NCCL connects a peer at the first; a group is held only
//! after). Then:
//! - a receiver whose host posts late: the sender's `send` returns at once, having queued one
//!   gate; its stream completes only after the receiver posted;
//! - a receiver that posts a different count late: the receiver gets `Error::Mismatch` at
//!   once, the sender (whose send was held) from its next call, and its stream is released;
//! - a receiver that never posts: the sender's next call is `Error::Timeout` within the bound,
//!   and its stream is released;
//! - a receiver that posted first: the sender's send is checked at once and queues no gate.

use std::path::PathBuf;
use std::sync::{Barrier, OnceLock};
use std::time::{Duration, Instant};

use handoff::{Communicator, DeviceBuffer, Error, Stream};
use libtest_mimic::{Arguments, Failed, Trial};

mod stubs;

static CUDART: OnceLock<PathBuf> = OnceLock::new();

/// This thread's calls of the stub's `cuStreamWaitValue32`.
fn gates_queued() -> i64 {
    stubs::count(
        CUDART.get().expect("built"),
        "cudart",
        "stub_cuStreamWaitValue32",
        false,
    )
}

/// Two ranks on two threads, each with its communicator (timeout `timeout`) and a stream,
/// connected by one send and receive of 4, then running `body(rank, comm, stream, barrier)`.
fn two_ranks(
    timeout: Duration,
    body: impl Fn(usize, &Communicator, &Stream, &Barrier) -> Result<(), String> + Send + Sync + 'static,
) -> Result<(), Failed> {
    let connected =
        |rank: usize, comm: Communicator, stream: Stream| -> handoff::Result<(Communicator, Stream)> {
            let mut x = DeviceBuffer::<f32>::zeros(4, &stream)?;
            if rank == 0 {
                comm.send(&x, 1, &stream)?;
            } else {
                comm.recv(&mut x, 0, &stream)?;
            }
            stream.synchronize()?;
            Ok((comm, stream))
        };
    let body = move |rank: usize, (comm, stream): &(Communicator, Stream), barrier: &Barrier| {
        body(rank, comm, stream, barrier)
    };
    Ok(stubs::rank_threads(2, timeout, connected, body)?)
}

const LATE: Duration = Duration::from_millis(300);

fn a_late_receiver_does_not_hold_the_senders_host() -> Result<(), Failed> {
    two_ranks(Duration::from_secs(10), |rank, comm, stream, barrier| {
        let mut x = DeviceBuffer::<f32>::zeros(8, stream).map_err(|e| e.to_string())?;
        if rank == 1 {
            barrier.wait();
            std::thread::sleep(LATE);
            comm.recv(&mut x, 0, stream).map_err(|e| e.to_string())?;
            return stream.synchronize().map_err(|e| e.to_string());
        }
        let before = gates_queued();
        barrier.wait();
        let t = Instant::now();
        comm.send(&x, 1, stream).map_err(|e| e.to_string())?;
        let took = t.elapsed();
        let gates = gates_queued() - before;
        let idle = stream.is_idle().map_err(|e| e.to_string())?;
        stream.synchronize().map_err(|e| e.to_string())?;
        let done = t.elapsed();
        println!(
            "send returned after {took:?} with {gates} gate(s); stream idle then: {idle}; done after {done:?}"
        );
        if took >= LATE / 3 || gates != 1 || idle || done < LATE * 2 / 3 {
            return Err(format!(
                "send took {took:?} (want well under {LATE:?}), queued {gates} gates (want 1), \
                 stream idle at once: {idle} (want false), done after {done:?} (want about {LATE:?})"
            ));
        }
        Ok(())
    })
}

fn a_late_mismatch_fails_both_ranks_and_releases_the_senders_stream() -> Result<(), Failed> {
    two_ranks(Duration::from_secs(10), |rank, comm, stream, barrier| {
        let mut x = DeviceBuffer::<f32>::zeros(8, stream).map_err(|e| e.to_string())?;
        if rank == 1 {
            barrier.wait();
            std::thread::sleep(LATE);
            let mut y = DeviceBuffer::<f32>::zeros(7, stream).map_err(|e| e.to_string())?;
            return match comm.recv(&mut y, 0, stream) {
                Err(Error::Mismatch { detail }) => {
                    println!("receiver: {detail}");
                    Ok(())
                }
                other => Err(format!("the receive gave {other:?}, want Error::Mismatch")),
            };
        }
        barrier.wait();
        comm.send(&x, 1, stream)
            .map_err(|e| format!("the held send: {e}"))?;
        let t = Instant::now();
        // The stream is released once the gatekeeper has found the difference.
        let synced = stream.synchronize();
        let released = t.elapsed();
        let next = comm.recv(&mut x, 1, stream);
        println!("sender: stream released after {released:?} ({synced:?}); next call: {next:?}");
        match next {
            Err(Error::Mismatch { detail }) if detail.contains('8') && detail.contains('7') => Ok(()),
            other => Err(format!(
                "the next call gave {other:?}, want Error::Mismatch naming 8 and 7"
            )),
        }
    })
}

fn a_receiver_that_never_posts_is_a_timeout_and_releases_the_stream() -> Result<(), Failed> {
    let timeout = Duration::from_millis(500);
    two_ranks(timeout, move |rank, comm, stream, barrier| {
        let x = DeviceBuffer::<f32>::zeros(8, stream).map_err(|e| e.to_string())?;
        if rank == 1 {
            barrier.wait();
            // Posts nothing; stays alive (its mailbox live) until the sender is done.
            barrier.wait();
            return Ok(());
        }
        barrier.wait();
        let t = Instant::now();
        comm.send(&x, 1, stream)
            .map_err(|e| format!("the held send: {e}"))?;
        let took = t.elapsed();
        let synced = stream.synchronize();
        let released = t.elapsed();
        let next = comm.send(&x, 1, stream);
        barrier.wait();
        println!("send took {took:?}; stream released after {released:?} ({synced:?}); next: {next:?}");
        if took >= timeout / 2 || released > timeout * 4 {
            return Err(format!("send took {took:?}, stream released after {released:?}"));
        }
        match next {
            Err(Error::Timeout { .. }) => Ok(()),
            other => Err(format!("the next call gave {other:?}, want Error::Timeout")),
        }
    })
}

fn a_peer_that_posted_first_means_no_gate() -> Result<(), Failed> {
    two_ranks(Duration::from_secs(10), |rank, comm, stream, barrier| {
        let mut x = DeviceBuffer::<f32>::zeros(8, stream).map_err(|e| e.to_string())?;
        if rank == 1 {
            comm.recv(&mut x, 0, stream).map_err(|e| e.to_string())?;
            barrier.wait();
            return stream.synchronize().map_err(|e| e.to_string());
        }
        barrier.wait();
        let before = gates_queued();
        comm.send(&x, 1, stream).map_err(|e| e.to_string())?;
        let gates = gates_queued() - before;
        stream.synchronize().map_err(|e| e.to_string())?;
        if gates != 0 {
            return Err(format!(
                "{gates} gates queued for a send whose receive was posted first"
            ));
        }
        Ok(())
    })
}

fn one_group_each_way_longer_than_the_ring() -> Result<(), Failed> {
    two_ranks(Duration::from_secs(2), |rank, comm, stream, barrier| {
        let n = 300;
        let mut bufs: Vec<DeviceBuffer<f32>> = (0..n)
            .map(|_| DeviceBuffer::<f32>::zeros(4, stream))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        barrier.wait();
        let t = Instant::now();
        let r = if rank == 0 {
            handoff::group(|g| {
                for b in &bufs {
                    g.send(comm, b, 1, stream)?;
                }
                Ok(())
            })
        } else {
            handoff::group(|g| {
                for b in bufs.iter_mut() {
                    g.recv(comm, b, 0, stream)?;
                }
                Ok(())
            })
        };
        println!("rank {rank}: one group of {n}: {r:?} after {:?}", t.elapsed());
        r.map_err(|e| e.to_string())?;
        stream.synchronize().map_err(|e| e.to_string())
    })
}

fn main() {
    let mut args = Arguments::from_args();
    // The stub NCCL gathers between the threads of one communicator at a time.
    args.test_threads = Some(1);
    // SAFETY: no other thread exists yet, and nothing has read the environment.
    let Some((dir, cudart, _)) = (unsafe { stubs::install_gathering_pair("gate_stub") }) else {
        return;
    };
    CUDART.set(cudart).expect("once");
    let trials = vec![
        Trial::test(
            "one_group_each_way_longer_than_the_ring_is_checked_on_the_host",
            one_group_each_way_longer_than_the_ring,
        ),
        Trial::test(
            "a_late_receiver_does_not_hold_the_senders_host",
            a_late_receiver_does_not_hold_the_senders_host,
        ),
        Trial::test(
            "a_late_mismatch_fails_both_ranks_and_releases_the_senders_stream",
            a_late_mismatch_fails_both_ranks_and_releases_the_senders_stream,
        ),
        Trial::test(
            "a_receiver_that_never_posts_is_a_timeout_and_releases_the_stream",
            a_receiver_that_never_posts_is_a_timeout_and_releases_the_stream,
        ),
        Trial::test(
            "a_peer_that_posted_first_means_no_gate",
            a_peer_that_posted_first_means_no_gate,
        ),
    ];
    let conclusion = libtest_mimic::run(&args, trials);
    let _ = std::fs::remove_dir_all(&dir);
    conclusion.exit()
}
