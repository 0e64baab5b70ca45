//! The article's Figure 3: independent work C overlapping a receive.
//!
//! On the receiving GPU, two ways:
//! - serial: receive, C, B, all on one stream;
//! - overlapped: receive then event E on a communication stream; C, wait(E), B on a compute
//!   stream. handoff records E and makes B wait for it itself: B reads the received buffer, so
//!   use tracking orders it after the receive.
//!
//! Each variant is timed with CUDA events (median of several iterations) and the intervals and
//! totals are printed, so a reader sees whether the overlap paid.
//!
//! With two GPUs, GPU 0 sends to GPU 1 (one process, two ranks); with one, a one-rank
//! communicator sends to itself. Options: `--mib N` (message size, default 256), `--c-ms M`
//! (duration of C; default: the measured receive time), `--iters K` (default 10).

use std::time::Duration;

use handoff::kernels;
use handoff::{Communicator, Device, DeviceBuffer, Event, Stream, group};

struct Options {
    mib: usize,
    c_ms: Option<f64>,
    iters: usize,
}

fn options() -> Result<Options, String> {
    let mut o = Options {
        mib: 256,
        c_ms: None,
        iters: 10,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--mib" => o.mib = value("--mib")?.parse().map_err(|e| format!("--mib: {e}"))?,
            "--c-ms" => o.c_ms = Some(value("--c-ms")?.parse().map_err(|e| format!("--c-ms: {e}"))?),
            "--iters" => o.iters = value("--iters")?.parse().map_err(|e| format!("--iters: {e}"))?,
            other => {
                return Err(format!(
                    "unknown option {other}; options: --mib N --c-ms M --iters K"
                ));
            }
        }
    }
    if o.iters == 0 || o.mib == 0 {
        return Err("--mib and --iters must be positive".into());
    }
    Ok(o)
}

fn main() {
    let r = options()
        .map_err(handoff::Error::InvalidArgument)
        .and_then(|o| run(&o));
    if let Err(e) = r {
        eprintln!("overlap: error: {e}");
        std::process::exit(1);
    }
}

/// The sending and receiving side: two ranks over two GPUs, or one rank sending to itself.
struct Pair {
    comms: Vec<Communicator>,
    send_dev: Device,
    recv_dev: Device,
}

impl Pair {
    fn sender(&self) -> &Communicator {
        &self.comms[0]
    }
    fn receiver(&self) -> &Communicator {
        self.comms.last().expect("one or two communicators")
    }
}

/// One iteration's event timings, in milliseconds from the start.
struct Timing {
    recv_end: f32,
    c_start: f32,
    c_end: f32,
    end: f32,
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn run(o: &Options) -> handoff::Result<()> {
    let gpus = Device::count()?;
    let pair = match gpus {
        0 => {
            return Err(handoff::Error::NoDevice {
                reason: "the CUDA runtime reports 0 devices".into(),
            });
        }
        1 => {
            let d = Device::new(0)?;
            println!(
                "overlap: one GPU ({}): a one-rank communicator sends to itself",
                d.name()?
            );
            Pair {
                comms: Communicator::init_all(std::slice::from_ref(&d))?,
                send_dev: d.clone(),
                recv_dev: d,
            }
        }
        _ => {
            let (d0, d1) = (Device::new(0)?, Device::new(1)?);
            println!(
                "overlap: GPU 0 ({}) sends to GPU 1 ({}), one process",
                d0.name()?,
                d1.name()?
            );
            Pair {
                comms: Communicator::init_all(&[d0.clone(), d1.clone()])?,
                send_dev: d0,
                recv_dev: d1,
            }
        }
    };
    let n = o.mib * (1 << 20) / 4;
    let send_s = Stream::new(&pair.send_dev)?;
    let comm_s = Stream::new(&pair.recv_dev)?;
    let compute_s = Stream::new(&pair.recv_dev)?;
    let mut x_send = DeviceBuffer::<f32>::zeros(n, &send_s)?;
    kernels::produce(&mut x_send, 0, &send_s)?;
    let mut x = DeviceBuffer::<f32>::zeros(n, &comm_s)?;
    let mut y = DeviceBuffer::<f32>::zeros(n, &compute_s)?;
    let ev = |_: ()| Event::new(&pair.recv_dev);
    let (start, recv_end, c_start, c_end, end) = (ev(())?, ev(())?, ev(())?, ev(())?, ev(())?);
    let peer_of_receiver = pair.sender().rank();
    let peer_of_sender = pair.receiver().rank();

    let receive = |x: &mut DeviceBuffer<f32>| {
        group(|g| {
            g.send(pair.sender(), &x_send, peer_of_sender, &send_s)?;
            g.recv(pair.receiver(), x, peer_of_receiver, &comm_s)
        })
    };

    // Warm up (connections, kernel loading), and measure the receive alone to size C.
    let mut recv_ms = Vec::new();
    for _ in 0..3 + o.iters {
        comm_s.record(&start)?;
        receive(&mut x)?;
        comm_s.record(&recv_end)?;
        recv_end.synchronize()?;
        recv_ms.push(start.elapsed_ms(&recv_end)?);
    }
    let recv_alone = median(recv_ms.split_off(3));
    let c_ms = o.c_ms.unwrap_or(f64::from(recv_alone));
    let c = Duration::from_secs_f64(c_ms / 1000.0);
    println!(
        "message {} MiB ({n} f32); receive alone: {recv_alone:.3} ms; C: {c_ms:.3} ms",
        o.mib
    );

    let mut serial = Vec::new();
    let mut overlapped = Vec::new();
    for _ in 0..o.iters {
        // Serial: receive, C, B on one stream.
        comm_s.record(&start)?;
        receive(&mut x)?;
        comm_s.record(&recv_end)?;
        comm_s.record(&c_start)?;
        kernels::busy(c, &comm_s)?;
        comm_s.record(&c_end)?;
        kernels::twice(&x, &mut y, &comm_s)?;
        comm_s.record(&end)?;
        end.synchronize()?;
        serial.push(timing(&start, &recv_end, &c_start, &c_end, &end)?);

        // Overlapped: receive (then E, recorded by handoff) on comm_s; C, wait(E), B on
        // compute_s. Both streams start at `start`.
        comm_s.record(&start)?;
        compute_s.wait(&start)?;
        receive(&mut x)?;
        comm_s.record(&recv_end)?;
        compute_s.record(&c_start)?;
        kernels::busy(c, &compute_s)?;
        compute_s.record(&c_end)?;
        kernels::twice(&x, &mut y, &compute_s)?; // waits for the receive: tracking
        compute_s.record(&end)?;
        end.synchronize()?;
        overlapped.push(timing(&start, &recv_end, &c_start, &c_end, &end)?);
    }
    let check = y.to_vec(&compute_s)?;
    let bad = (0..n)
        .filter(|&i| check[i] != 2.0 * kernels::produced_value(i, 0))
        .count();
    if bad > 0 {
        return Err(handoff::Error::InvalidArgument(format!(
            "{bad} of {n} elements of y are wrong"
        )));
    }

    let report = |name: &str, t: &[Timing]| {
        let m = |f: &dyn Fn(&Timing) -> f32| median(t.iter().map(f).collect());
        let total = m(&|t| t.end);
        println!(
            "{name:>10}: receive 0.000-{:.3} ms | C {:.3}-{:.3} ms | B ends {total:.3} ms | total {total:.3} ms",
            m(&|t| t.recv_end),
            m(&|t| t.c_start),
            m(&|t| t.c_end),
        );
        total
    };
    println!(
        "median of {} iterations, milliseconds from the start event:",
        o.iters
    );
    let ts = report("serial", &serial);
    let to = report("overlapped", &overlapped);
    println!(
        "overlap {}: {:.3} ms saved ({:.1}% of the serial total); y checked ({n} elements)",
        if to < ts { "paid" } else { "did not pay" },
        ts - to,
        100.0 * (ts - to) / ts
    );
    Ok(())
}

fn timing(
    start: &Event,
    recv_end: &Event,
    c_start: &Event,
    c_end: &Event,
    end: &Event,
) -> handoff::Result<Timing> {
    Ok(Timing {
        recv_end: start.elapsed_ms(recv_end)?,
        c_start: start.elapsed_ms(c_start)?,
        c_end: start.elapsed_ms(c_end)?,
        end: start.elapsed_ms(end)?,
    })
}
