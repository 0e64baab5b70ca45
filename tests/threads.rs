//! Hole 5 of issue 9 on the GPU: many threads read one buffer on one shared stream while the
//! main thread then writes it on another. Each read is a slow copy of the buffer; the write must
//! wait for every one of them. Before the fix, two threads could store their tracking events in
//! the wrong order (T1 records, T2 records and stores, T1 stores its older event over T2's), and
//! the write then waited for an older read only: a later reader copied the new values.
//!
//! Uses only API that existed before the fix, so that it also builds against that crate.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Gpus, assert_all_eq};
use handoff::kernels::{self, produced_value};
use handoff::{Device, DeviceBuffer, Stream};
use libtest_mimic::Failed;

const THREADS: usize = 12;
const READS: usize = 6;
const ROUNDS: u32 = 150;

fn main() {
    let g = Gpus::detect();
    common::run(vec![g.trial(
        "hole5_threads_reading_on_a_shared_stream_then_a_write",
        1,
        readers_then_writer,
    )]);
}

fn readers_then_writer() -> Result<(), Failed> {
    let dev = Device::new(0)?;
    let shared = Arc::new(Stream::new(&dev)?);
    let writer = Stream::new(&dev)?;
    let n = 1 << 12;
    let mut x = DeviceBuffer::<f32>::zeros(n, &writer)?;
    let mut outs: Vec<Vec<DeviceBuffer<f32>>> = (0..THREADS)
        .map(|_| (0..READS).map(|_| DeviceBuffer::zeros(n, &shared)).collect())
        .collect::<Result<_, _>>()?;
    let mut bad = Vec::new();
    for round in 0..ROUNDS {
        kernels::produce(&mut x, round, &writer)?;
        let x_ref = &x;
        std::thread::scope(|s| {
            for outs in outs.iter_mut() {
                let shared = &shared;
                s.spawn(move || {
                    for out in outs.iter_mut() {
                        kernels::delayed_copy(x_ref, out, Duration::from_micros(300), shared).unwrap();
                    }
                });
            }
        });
        // The write must wait for every read above, whatever order the threads stored in.
        kernels::produce(&mut x, round + 1000, &writer)?;
        for (t, outs) in outs.iter().enumerate() {
            for (k, out) in outs.iter().enumerate() {
                let got = out.to_vec(&shared)?;
                if let Err(e) = assert_all_eq("", &got, |i| produced_value(i, round)) {
                    bad.push(format!(
                        "round {round}, thread {t}, read {k}: {}",
                        e.message().unwrap_or("?")
                    ));
                }
            }
        }
    }
    println!(
        "{} rounds of {THREADS} threads × {READS} reads: {} reads saw the later write",
        ROUNDS,
        bad.len()
    );
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!("{} reads overlapped the write, e.g. {}", bad.len(), bad[0]).into())
    }
}
