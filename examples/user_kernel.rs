//! A user's own kernel in the article's loop: kernel A (handoff's) writes x on GPU 0; NCCL sends
//! x to rank 1 (GPU 1, or GPU 0 itself when there is one GPU); there a kernel that is not
//! handoff's, loaded from PTX at run time, computes z = 3x; z goes back to rank 0, whose host
//! checks it. Every buffer is tracked through the user's launch as through handoff's own.
//!
//! `cargo run --example user_kernel`

use handoff::kernels::{self, produced_value};
use handoff::{Communicator, Device, DeviceBuffer, LaunchConfig, Module, Stream, group};

/// The user's kernels: `tests/data/user_kernels.cu`, compiled by nvcc to PTX.
const PTX: &str = include_str!("../tests/data/user_kernels.ptx");

fn main() -> handoff::Result<()> {
    let gpus = Device::count()?.min(2);
    if gpus == 0 {
        eprintln!("user_kernel: no GPU is usable");
        std::process::exit(1);
    }
    let devices: Vec<Device> = (0..gpus).map(Device::new).collect::<handoff::Result<_>>()?;
    let comms = Communicator::init_all(&devices)?;
    let (c0, c1) = (&comms[0], &comms[gpus - 1]);
    let (s0, s1) = (Stream::new(&devices[0])?, Stream::new(&devices[gpus - 1])?);

    let scale = Module::from_ptx(PTX)?.function("user_scale")?;
    let n = 4;
    let mut x = DeviceBuffer::<f32>::zeros(n, &s0)?;
    let mut x1 = DeviceBuffer::<f32>::zeros(n, &s1)?;
    let mut z1 = DeviceBuffer::<f32>::zeros(n, &s1)?;
    let mut z = DeviceBuffer::<f32>::zeros(n, &s0)?;
    for round in 0..4 {
        kernels::produce(&mut x, round, &s0)?; // A on rank 0
        group(|g| {
            g.send(c0, &x, c1.rank(), &s0)?;
            g.recv(c1, &mut x1, c0.rank(), &s1)
        })?;
        // SAFETY: user_scale(const float* x, float* y, float a, u64 n) reads x[0..n], writes
        // y[0..n], and ends.
        unsafe {
            s1.launch_builder(&scale)
                .arg(&x1) //     read: waits for the receive
                .arg(&mut z1) // written: the send below waits for it
                .arg(3.0f32)
                .arg(n as u64)
                .launch(LaunchConfig::for_elements(n))?;
        }
        group(|g| {
            g.send(c1, &z1, c0.rank(), &s1)?;
            g.recv(c0, &mut z, c1.rank(), &s0)
        })?;
        let got = z.to_vec(&s0)?;
        let want: Vec<f32> = (0..n).map(|i| 3.0 * produced_value(i, round)).collect();
        println!(
            "round {round}: x = {:?} on GPU 0, z = 3x = {got:?} computed by the user's kernel on GPU {}",
            (0..n).map(|i| produced_value(i, round)).collect::<Vec<_>>(),
            devices[gpus - 1].ordinal()
        );
        if got != want {
            eprintln!("user_kernel: z = {got:?}, want {want:?}");
            std::process::exit(1);
        }
    }
    println!("ok: 4 rounds checked");
    Ok(())
}
