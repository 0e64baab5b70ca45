//! The article's flow on one GPU, before NCCL enters: kernel A writes x on a producer stream,
//! kernel B reads it on a consumer stream (y = 2x), over several rounds that reuse x and y.
//! Use tracking orders A before B, and the next round's A after B has read x, without any
//! explicit synchronisation in this code.
//!
//! Run: `cargo run --example one_gpu` (on a machine with a GPU; see README).

use handoff::kernels::{self, produced_value};
use handoff::{Device, DeviceBuffer, Stream};

fn main() {
    if let Err(e) = run() {
        eprintln!("one_gpu: {e}");
        std::process::exit(1);
    }
}

fn run() -> handoff::Result<()> {
    let count = Device::count()?;
    if count == 0 {
        return Err(handoff::Error::NoDevice {
            reason: "the CUDA runtime reports 0 devices".into(),
        });
    }
    let dev = Device::new(0)?;
    println!("GPU 0: {} ({count} visible)", dev.name()?);
    let producer = Stream::new(&dev)?;
    let consumer = Stream::new(&dev)?;
    let mut x = DeviceBuffer::<f32>::zeros(4, &producer)?;
    let mut y = DeviceBuffer::<f32>::zeros(4, &consumer)?;
    for round in 0..4 {
        kernels::produce(&mut x, round, &producer)?; // A, on the producer stream
        kernels::twice(&x, &mut y, &consumer)?; // B, on the consumer stream: waits for A
        let y_host = y.to_vec(&consumer)?; // waits for B
        let want: Vec<f32> = (0..4).map(|i| 2.0 * produced_value(i, round)).collect();
        println!(
            "round {round}: x = {:?}, y = 2x = {y_host:?}",
            x.to_vec(&producer)?
        );
        if y_host != want {
            return Err(handoff::Error::InvalidArgument(format!(
                "round {round}: y = {y_host:?}, want {want:?}"
            )));
        }
    }
    println!("ok: 4 rounds, every y checked");
    Ok(())
}
