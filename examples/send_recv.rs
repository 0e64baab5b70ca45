//! The article end to end: a value produced on one GPU, received and used on another.
//!
//! Rank 0: kernel A writes x on stream S0, then sends x to rank 1 on S0.
//! Rank 1: receives x on stream S1, then kernel B computes y = 2x on S1, copies y to the host and
//! prints it: [2, 4, 6, 8] in round 0. Several rounds reuse the communicator and the buffers;
//! use tracking keeps each round's A from overwriting x before the send has read it, and each
//! receive from overwriting x before B has read it. Every y is checked.
//!
//! - Run plainly (`cargo run --example send_recv`), it starts two processes of itself as a
//!   launcher would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): one GPU each where
//!   there are two, both on GPU 0 where there is one. Two ranks on one GPU run in handoff's
//!   sharing mode (`spawn_local_with` and `GpuSharing::WhenFewerGpus`: each process its own NCCL
//!   host id, NCCL's socket transport over loopback between them), a development mode: correct,
//!   not fast. With no GPU it exits non-zero.
//! - Run under torchrun, Slurm or mpirun, it plays the one rank their variables name
//!   (with `HANDOFF_SHARE_GPUS=1`, ranks of one machine share its GPUs the same way).
//!
//! Each rank prints its rank, process id and GPU (`shared` when ranks share GPUs).

use std::process::Stdio;
use std::time::Duration;

use handoff::kernels::{self, produced_value};
use handoff::nccl::bootstrap::{GpuSharing, spawn_local_with};
use handoff::{CommOptions, Device, DeviceBuffer, Launch, Stream};

const ROUNDS: u32 = 4;
const N: usize = 4;
const TIMEOUT: Duration = Duration::from_secs(120);

fn main() {
    let result = match Launch::from_env() {
        Ok(Some(launch)) => run_rank(&launch),
        Ok(None) => start(),
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        eprintln!("send_recv [pid {}]: error: {e}", std::process::id());
        std::process::exit(1);
    }
}

/// No launcher: start the two ranks as processes of this executable, on one GPU each or, with
/// one GPU, both on it.
fn start() -> handoff::Result<()> {
    match Device::count()? {
        0 => {
            return Err(handoff::Error::NoDevice {
                reason: "the CUDA runtime reports 0 devices".into(),
            });
        }
        1 => println!(
            "send_recv: one GPU: starting 2 processes (ranks 0 and 1) that share GPU 0 \
             (development mode: NCCL's socket transport over loopback, correct, not fast)"
        ),
        _ => println!("send_recv: starting 2 processes (ranks 0 and 1, GPUs 0 and 1) on this machine"),
    }
    // Each rank's output comes back here line by line, prefixed "[rank r] ".
    let mut job = spawn_local_with(2, GpuSharing::WhenFewerGpus, |_, cmd| {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    })?;
    job.prefix_output()?;
    job.wait_timeout(Duration::from_secs(300))?.check()?;
    println!("send_recv: both ranks finished; every y was checked");
    Ok(())
}

fn fmt(v: &[f32]) -> String {
    let items: Vec<String> = v.iter().map(|x| format!("{x}")).collect();
    format!("[{}]", items.join(", "))
}

fn check(round: u32, y: &[f32]) -> handoff::Result<()> {
    let want: Vec<f32> = (0..y.len()).map(|i| 2.0 * produced_value(i, round)).collect();
    if y == want {
        Ok(())
    } else {
        Err(handoff::Error::InvalidArgument(format!(
            "round {round}: y = {y:?}, want {want:?}"
        )))
    }
}

/// One rank of the two-process run (started here or by a launcher).
fn run_rank(launch: &Launch) -> handoff::Result<()> {
    let comm = launch.communicator(CommOptions::default().with_timeout(TIMEOUT))?;
    let gpu = comm.device();
    let who = format!(
        "[rank {} of {} | pid {} | GPU {} {}{}]",
        comm.rank(),
        comm.world_size(),
        std::process::id(),
        gpu.ordinal(),
        gpu.name()?,
        if launch.share_gpus { ", shared" } else { "" }
    );
    println!("{who} joined through {} at {}", launch.launcher, launch.master);
    let stream = Stream::new(gpu)?;
    let mut x = DeviceBuffer::<f32>::zeros(N, &stream)?;
    let mut y = DeviceBuffer::<f32>::zeros(N, &stream)?;
    for round in 0..ROUNDS {
        match comm.rank() {
            0 => {
                kernels::produce(&mut x, round, &stream)?; // A
                comm.send(&x, 1, &stream)?; // waits for A on the GPU, not on the host
                println!(
                    "{who} round {round}: A wrote x = {}, sent to rank 1",
                    fmt(&x.to_vec(&stream)?)
                );
            }
            1 => {
                comm.recv(&mut x, 0, &stream)?;
                kernels::twice(&x, &mut y, &stream)?; // B
                let host = y.to_vec(&stream)?; // waits for B
                check(round, &host)?;
                println!(
                    "{who} round {round}: received x, B computed y = 2x = {}",
                    fmt(&host)
                );
            }
            _ => {}
        }
    }
    stream.synchronize()?; // cleanup needs completion
    comm.finalize()?;
    println!("{who} done: {ROUNDS} rounds");
    Ok(())
}
