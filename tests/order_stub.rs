//! The order in which verification compares a group's collectives, against the stub libraries
//! of tests/stubs: NCCL's own order (`src/nccl/verify/order.rs`) only for an NCCL whose order
//! was read (2.28.3 to 2.28.9), call order for any other, which is stricter. Two ranks of one
//! `init_all` (two stub devices) put an all_reduce of 1 Mi elements and one of 16 in one group,
//! in opposite call orders: NCCL 2.28 runs both ranks' the same way (smaller first), so under a
//! stub NCCL reporting 2.28.3 the group reaches NCCL; reporting 2.29.0, it is refused before
//! NCCL. Each runs in a child process: the crate reads NCCL's version once per process.

use std::path::Path;

use handoff::{Communicator, Device, DeviceBuffer, Error, ReduceOp, Stream, group};
use libtest_mimic::{Arguments, Failed, Trial};

mod stubs;

/// Set in a child: the NCCL version its stub reports.
const CHILD: &str = "HANDOFF_ORDER_STUB_VERSION";

/// A child's run: the group on both ranks, and what came of it.
fn child(version: i32) -> Result<(), String> {
    let var = |k: &str| std::env::var_os(k).ok_or(format!("{k} is not set"));
    stubs::set(
        Path::new(&var("HANDOFF_CUDART_PATH")?),
        b"cudart_stub_set_devices\0",
        2,
    )?;
    stubs::set(
        Path::new(&var("HANDOFF_NCCL_PATH")?),
        b"nccl_stub_set_version\0",
        version,
    )?;
    let e = |e: Error| e.to_string();
    let devs = [Device::new(0).map_err(e)?, Device::new(1).map_err(e)?];
    let comms = Communicator::init_all(&devs).map_err(e)?;
    let ss = [
        Stream::new(&devs[0]).map_err(e)?,
        Stream::new(&devs[1]).map_err(e)?,
    ];
    let bufs = |r: usize, n: usize| -> Result<(DeviceBuffer<f32>, DeviceBuffer<f32>), String> {
        Ok((
            DeviceBuffer::from_slice(&vec![1.0f32; n], &ss[r]).map_err(e)?,
            DeviceBuffer::zeros(n, &ss[r]).map_err(e)?,
        ))
    };
    let (big0, mut big0_out) = bufs(0, 1 << 20)?;
    let (small0, mut small0_out) = bufs(0, 16)?;
    let (big1, mut big1_out) = bufs(1, 1 << 20)?;
    let (small1, mut small1_out) = bufs(1, 16)?;
    let got = group(|g| {
        g.all_reduce(&comms[0], &big0, &mut big0_out, ReduceOp::Sum, &ss[0])?;
        g.all_reduce(&comms[0], &small0, &mut small0_out, ReduceOp::Sum, &ss[0])?;
        g.all_reduce(&comms[1], &small1, &mut small1_out, ReduceOp::Sum, &ss[1])?;
        g.all_reduce(&comms[1], &big1, &mut big1_out, ReduceOp::Sum, &ss[1])
    });
    match (version, got) {
        (22803, Ok(())) => Ok(()),
        (22900, Err(Error::InvalidArgument(m))) if m.contains("all_reduce") => {
            println!("refused: {m}");
            Ok(())
        }
        (v, other) => Err(format!("NCCL {v}: {other:?}")),
    }
}

/// Runs [`child`] for `version` in a child process of this binary.
fn in_child(cudart: &Path, nccl: &Path, version: i32) -> Result<(), Failed> {
    let exe = std::env::current_exe()?;
    let out = std::process::Command::new(exe)
        .env(CHILD, version.to_string())
        .env("HANDOFF_CUDART_PATH", cudart)
        .env("HANDOFF_NCCL_PATH", nccl)
        .output()?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "the child failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into())
    }
}

fn main() {
    if let Some(v) = std::env::var(CHILD).ok().and_then(|v| v.parse().ok()) {
        stubs::child_main(CHILD, || child(v));
    }
    let args = Arguments::from_args();
    let Some((dir, cudart, nccl)) = stubs::build_pair("order_stub", "nccl.c") else {
        return;
    };
    let (c, n) = (cudart.clone(), nccl.clone());
    let trials = vec![
        Trial::test(
            "one_group_in_two_call_orders_reaches_nccl_2_28_3_which_runs_both_alike",
            move || in_child(&c, &n, 22803),
        ),
        Trial::test(
            "one_group_in_two_call_orders_is_refused_under_an_nccl_whose_order_was_not_read",
            move || in_child(&cudart, &nccl, 22900),
        ),
    ];
    let conclusion = libtest_mimic::run(&args, trials);
    let _ = std::fs::remove_dir_all(&dir);
    conclusion.exit()
}
