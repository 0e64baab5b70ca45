//! The full communicator across the two "hosts": one process in each namespace, one GPU each
//! (`CUDA_VISIBLE_DEVICES`), the unique id through the bootstrap, verification over its
//! channel (the mount namespaces hide each other's mailbox files), and NCCL on its socket
//! transport over the veth pair, as between two machines: each rank has its own `NCCL_HOSTID`
//! (NCCL takes them for two hosts, so it does not even try its peer-to-peer or shared-memory
//! transports, which are off besides), `NCCL_NET=Socket`, `NCCL_IB_DISABLE=1`, and
//! `NCCL_SOCKET_IFNAME` its end of the pair. NCCL's log (`NCCL_DEBUG=INFO`) must show the
//! socket transport.
//!
//! With one GPU, both ranks take it (NCCL allows that here: their host ids differ). They need a
//! usable GPU and the namespaces; otherwise they report ignored, saying why, except that under
//! `HANDOFF_REQUIRE_GPUS` no usable GPU fails them.

use std::path::Path;
use std::process::Child;
use std::time::Duration;

use handoff::{CommOptions, DeviceBuffer, Error, Launch, Stream};
use libtest_mimic::{Failed, Trial};

use super::common::Gpus;
use super::{A_IP, Hosts, env, exe, expect, finish, scratch};

/// Rank 0's bootstrap port in namespace a (a fresh namespace: nothing else holds it).
const ID_PORT: u16 = 47_002;
/// How long a child may take: NCCL's creation over sockets takes seconds.
const CHILD_LIMIT: Duration = Duration::from_secs(120);
/// The sizes of the send/receive trial, in f32: one element, a few KiB, 4 MiB.
const SIZES: [usize; 3] = [1, 1_000, 1 << 20];
/// The mismatch: rank 0 sends this many f32, rank 1 receives `RECEIVED`.
const SENT: usize = 1_000;
const RECEIVED: usize = 750;
/// What rank 1's receive buffer holds before the mismatched receive, and must hold after.
const UNTOUCHED: f32 = -1.5;

/// The two trials, ignored (saying why) where they cannot run; `no_namespaces` is why the
/// namespaces cannot be made, if they cannot.
pub fn trials(no_namespaces: Option<&str>) -> Vec<Trial> {
    let gpus = Gpus::detect();
    if gpus.usable == 0 {
        eprintln!("hosts: the GPU trials need a GPU ({})", gpus.reason);
    } else if let Some(why) = no_namespaces {
        eprintln!("hosts: the GPU trials are ignored: {why}");
    }
    let trial = |name: &str, f: fn() -> Result<(), Failed>| {
        let t = gpus.trial(name, 1, f);
        // No GPU where one is required fails whatever the namespaces; otherwise no
        // namespaces, no trial.
        if gpus.usable >= 1 && no_namespaces.is_some() {
            t.with_ignored_flag(true)
        } else {
            t
        }
    };
    vec![
        trial(
            "gpus_across_namespaces_send_recv_over_nccl_sockets_verified",
            send_recv,
        ),
        trial(
            "gpus_across_namespaces_a_mismatch_is_refused_on_both_ranks_nothing_transferred",
            mismatch,
        ),
    ]
}

/// The GPU that rank `rank` takes: the `rank`-th of those this process sees, round-robin.
fn visible(rank: usize) -> String {
    let rank = rank % handoff::Device::count().unwrap_or(1).max(1);
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(list) if !list.trim().is_empty() => list
            .split(',')
            .nth(rank)
            .map(|d| d.trim().to_string())
            .unwrap_or_else(|| rank.to_string()),
        _ => rank.to_string(),
    }
}

/// A fresh secret for the trial's bootstrap and channel, as a launcher would give the ranks.
fn secret() -> Result<String, Failed> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Starts rank 0 in namespace a and rank 1 in b, playing `scenario`, as a launcher would
/// across two machines.
fn gpu_ranks(h: &Hosts, scenario: &str, dir: &Path) -> Result<[Child; 2], Failed> {
    let secret = secret()?;
    let mut kids = Vec::new();
    for (rank, (ns, veth)) in [(&h.a, &h.va), (&h.b, &h.vb)].into_iter().enumerate() {
        let mut v = env(&format!("rank{rank}"), scenario, dir);
        v.extend([
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", "2".into()),
            ("LOCAL_RANK", "0".into()),
            ("MASTER_ADDR", A_IP.into()),
            ("MASTER_PORT", ID_PORT.to_string()),
            ("HANDOFF_SECRET", secret.clone()),
            ("CUDA_VISIBLE_DEVICES", visible(rank)),
            ("NCCL_HOSTID", format!("handoff-rehearsal-host-{rank}")),
            ("NCCL_P2P_DISABLE", "1".into()),
            ("NCCL_SHM_DISABLE", "1".into()),
            ("NCCL_NET", "Socket".into()),
            ("NCCL_IB_DISABLE", "1".into()),
            ("NCCL_SOCKET_IFNAME", format!("={veth}")),
            ("NCCL_DEBUG", "INFO".into()),
            ("NCCL_DEBUG_SUBSYS", "INIT,NET".into()),
        ]);
        kids.push(h.run(ns, &v, &exe(), &[])?);
    }
    let [a, b]: [Child; 2] = kids.try_into().map_err(|_| "two children")?;
    Ok([a, b])
}

/// Both ranks' output, once both exited: whether each succeeded, and what it printed.
fn both(h: &Hosts, scenario: &str) -> Result<[(bool, String); 2], Failed> {
    let dir = scratch();
    let [c0, c1] = gpu_ranks(h, scenario, &dir)?;
    let r0 = finish(c0, CHILD_LIMIT);
    let r1 = finish(c1, CHILD_LIMIT);
    print!("rank 0:\n{}rank 1:\n{}", r0.1, r1.1);
    Ok([r0, r1])
}

fn send_recv() -> Result<(), Failed> {
    let h = Hosts::new()?;
    let [(ok0, out0), (ok1, out1)] = both(&h, "gpu_send_recv")?;
    let checked = format!("values checked in {} sizes", SIZES.len());
    for (ok, out, dir) in [
        (ok0, &out0, "[send] via NET/Socket"),
        (ok1, &out1, "[receive] via NET/Socket"),
    ] {
        expect(ok, out, &["Using network Socket", dir, &checked])?;
    }
    Ok(())
}

fn mismatch() -> Result<(), Failed> {
    let h = Hosts::new()?;
    let [(ok0, out0), (ok1, out1)] = both(&h, "gpu_mismatch")?;
    let refused = ["Using network Socket", "mismatch refused:"];
    expect(ok0, &out0, &refused)?;
    expect(ok1, &out1, &refused)?;
    expect(ok1, &out1, &["nothing transferred"])
}

// --- The children --------------------------------------------------------------------------

fn launch(timeout: Duration) -> Result<(handoff::Communicator, Stream), String> {
    let launch = Launch::from_env()
        .map_err(|e| e.to_string())?
        .ok_or("no launcher variables")?;
    let comm = launch
        .communicator(CommOptions::default().with_timeout(timeout))
        .map_err(|e| format!("rank {}: creating the communicator: {e}", launch.rank))?;
    let s = Stream::new(comm.device()).map_err(|e| e.to_string())?;
    Ok((comm, s))
}

/// The values of round `round`: distinct per element and round, exact in f32.
fn value(i: usize, round: usize) -> f32 {
    ((i * 7 + round * 13) % 65_521) as f32
}

/// Rank 0 sends each size to rank 1, which checks every value and sends them back; rank 0
/// checks what came back.
pub fn send_recv_child(rank: usize) -> Result<(), String> {
    let (comm, s) = launch(Duration::from_secs(60))?;
    let e = |e: Error| e.to_string();
    for (round, &n) in SIZES.iter().enumerate() {
        let want: Vec<f32> = (0..n).map(|i| value(i, round)).collect();
        let mut got = DeviceBuffer::<f32>::zeros(n, &s).map_err(e)?;
        if rank == 0 {
            let x = DeviceBuffer::from_slice(&want, &s).map_err(e)?;
            comm.send(&x, 1, &s).map_err(e)?;
            comm.recv(&mut got, 1, &s).map_err(e)?;
        } else {
            comm.recv(&mut got, 0, &s).map_err(e)?;
            comm.send(&got, 0, &s).map_err(e)?;
        }
        let back = got.to_vec(&s).map_err(e)?;
        if let Some(i) = (0..n).find(|&i| back[i] != want[i]) {
            return Err(format!(
                "rank {rank}, {n} elements: [{i}] = {}, want {}",
                back[i], want[i]
            ));
        }
    }
    println!("values checked in {} sizes", SIZES.len());
    s.synchronize().map_err(e)?;
    comm.finalize().map_err(e)
}

/// Rank 0 sends `SENT` f32, rank 1 receives `RECEIVED`: both get `Error::Mismatch` naming
/// both counts, and rank 1's buffer keeps what it held.
pub fn mismatch_child(rank: usize) -> Result<(), String> {
    let (comm, s) = launch(Duration::from_secs(20))?;
    let e = |e: Error| e.to_string();
    let (r, kept) = if rank == 0 {
        let x = DeviceBuffer::from_slice(&[1.0f32; SENT], &s).map_err(e)?;
        (comm.send(&x, 1, &s), None)
    } else {
        let mut y = DeviceBuffer::from_slice(&[UNTOUCHED; RECEIVED], &s).map_err(e)?;
        let r = comm.recv(&mut y, 0, &s);
        s.synchronize().map_err(e)?;
        (r, Some(y.to_vec(&s).map_err(e)?))
    };
    match r {
        Err(Error::Mismatch { detail })
            if detail.contains(&SENT.to_string()) && detail.contains(&RECEIVED.to_string()) =>
        {
            println!("mismatch refused: {detail}")
        }
        other => return Err(format!("rank {rank}: the mismatch gave {other:?}")),
    }
    if let Some(kept) = kept {
        match kept.iter().position(|&v| v != UNTOUCHED) {
            None => println!("nothing transferred: the receive buffer holds what it held"),
            Some(i) => return Err(format!("rank 1's receive buffer changed: [{i}] = {}", kept[i])),
        }
    }
    Ok(())
}
