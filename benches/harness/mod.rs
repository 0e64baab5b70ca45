//! What the benchmarks share: the sizes and repetitions (options), the rotation of the three ways
//! (verified, unverified and raw handoff against raw NCCL) and their medians, starting two
//! processes, nccl-tests' table, the CSV and the plot. Each benchmark says `mod harness;`
//! (a folder, so that cargo does not take it for a benchmark of its own); `tests/bench_harness.rs`
//! includes it by path and tests it without a GPU.

#![allow(dead_code)]

pub mod files;
pub mod sockets;

use std::fmt::Write as _;

use handoff::Launch;
use handoff::nccl::bootstrap::{GpuSharing, spawn_local_with};
use plotters::prelude::*;

/// One value of a row for a way: its time, or its bus bandwidth.
type Measure<'a> = &'a dyn Fn(&Row, usize) -> f64;

/// The three ways each size is timed, in their column order.
pub const WAYS: [&str; 3] = ["handoff verified", "handoff unverified", "raw NCCL"];

/// A way, indexing [`WAYS`] and a [`Row`]'s times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    Verified = 0,
    Unverified = 1,
    Raw = 2,
}

impl Way {
    pub const ALL: [Way; 3] = [Way::Verified, Way::Unverified, Way::Raw];
}

/// The sizes and repetitions every benchmark takes (flattened into its options).
#[derive(clap::Args, Clone, Debug)]
pub struct Sweep {
    /// Smallest size, like 8, 64K, 1M (for collectives nccl-tests' size: the larger of a rank's
    /// input and output).
    #[arg(long, default_value = "8", value_parser = parse_size)]
    pub min_bytes: usize,
    /// Largest size.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub max_bytes: usize,
    /// Step between sizes (at least 2).
    #[arg(long, default_value_t = 4)]
    pub factor: usize,
    /// Iterations per timed run (at least 1).
    #[arg(long, default_value_t = 50)]
    pub iters: usize,
    /// Untimed iterations per way and size.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Timed runs per way and size, the median reported (at least 1).
    #[arg(long, default_value_t = 7)]
    pub repeats: usize,
}

impl Sweep {
    /// The options' own rules.
    pub fn check(&self) -> Result<(), String> {
        if self.factor < 2 || self.iters == 0 || self.repeats == 0 || self.min_bytes > self.max_bytes {
            return Err("need --factor >= 2, --iters and --repeats > 0, --min-bytes <= --max-bytes".into());
        }
        Ok(())
    }

    /// The sizes to time, from at least `smallest` bytes.
    pub fn sizes(&self, smallest: usize) -> Vec<usize> {
        sizes(self.min_bytes.max(smallest), self.max_bytes, self.factor)
    }

    /// Times the three ways at one size: `warmup` untimed iterations of each, then `repeats`
    /// runs of `iters` iterations of each, rotating verified, unverified and raw. `run(way, n,
    /// timed)` does `n` iterations of `way` and, when `timed`, returns their time in µs. Returns
    /// each way's median run, per iteration.
    pub fn time_ways<E>(
        &self,
        mut run: impl FnMut(Way, usize, bool) -> Result<f64, E>,
    ) -> Result<[f64; 3], E> {
        self.time_rotating(|w, n, timed| run(Way::ALL[w], n, timed))
    }

    /// [`Sweep::time_ways`] for any number `N` of ways, named by their index: `run(w, n,
    /// timed)` does `n` iterations of way `w`; the ways rotate 0, 1, .., N-1 per repeat.
    pub fn time_rotating<const N: usize, E>(
        &self,
        mut run: impl FnMut(usize, usize, bool) -> Result<f64, E>,
    ) -> Result<[f64; N], E> {
        for w in 0..N {
            run(w, self.warmup, false)?;
        }
        let mut times: [Vec<f64>; N] = std::array::from_fn(|_| Vec::new());
        for rep in 0..N * self.repeats {
            let w = rep % N;
            times[w].push(run(w, self.iters, true)? / self.iters as f64);
        }
        Ok(times.map(median))
    }
}

/// What a process does in a point-to-point benchmark: both sides (one rank sending to itself, or
/// one process driving both ranks), or one side of two processes (rank 0 sends to rank 1).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Role {
    /// Sends and receives.
    Both,
    /// Rank 0 of two processes: only sends, to rank 1.
    Sender,
    /// Rank 1 of two processes: only receives, from rank 0.
    Receiver,
}

impl Role {
    /// The side `rank` plays in two processes.
    pub fn of_rank(rank: usize) -> Role {
        if rank == 0 { Role::Sender } else { Role::Receiver }
    }

    pub fn sends(self) -> bool {
        self != Role::Receiver
    }

    pub fn receives(self) -> bool {
        self != Role::Sender
    }
}

/// Starts the running benchmark again as two ranks in two processes, with its arguments, as a
/// launcher would: rank `r` on GPU `local_ranks[r]`. Waits for both.
///
/// With fewer than two GPUs, or both ranks given one GPU, the two ranks share it
/// (`GpuSharing::WhenFewerGpus`, `GpuSharing::Always`): each process its own NCCL host id,
/// NCCL's socket transport over loopback between them, each rank on the GPU that
/// `Launch::device` gives its `LOCAL_RANK` (GPU 0 for both with one GPU).
/// Such a run checks the values as any other, but its times are the sharing mode's socket path:
/// each benchmark prints [`shared_gpu_note`] before its table.
pub fn spawn_procs(local_ranks: [usize; 2]) -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sharing = if local_ranks[0] == local_ranks[1] {
        GpuSharing::Always
    } else {
        GpuSharing::WhenFewerGpus
    };
    spawn_local_with(2, sharing, |rank, cmd| {
        cmd.args(&args).env("LOCAL_RANK", local_ranks[rank].to_string());
    })
    .and_then(|job| job.wait())
    .and_then(|exit| exit.check())
    .map_err(|e| e.to_string())
}

/// The `main` of a benchmark of two ranks in processes: parses its options, then in the
/// process started by hand starts the two ranks ([`spawn_procs`]), and in each rank runs `run`;
/// an error is printed after `name` and ends the process with status 1.
pub fn two_rank_main<O>(
    name: &str,
    opts: impl FnOnce() -> Result<O, String>,
    run: impl FnOnce(&O, &Launch) -> handoff::Result<()>,
) {
    let r = opts().and_then(|o| match Launch::from_env().map_err(|e| e.to_string())? {
        None => spawn_procs([0, 1]),
        Some(l) => run(&o, &l).map_err(|e| e.to_string()),
    });
    if let Err(e) = r {
        eprintln!("{name}: {e}");
        std::process::exit(1);
    }
}

/// For a rank whose launch shares GPUs (`HANDOFF_SHARE_GPUS=1`, as [`spawn_procs`] sets it on
/// one GPU): the line to print before the table, saying that the run checks correctness and
/// that its times are not performance figures. `None` otherwise.
pub fn shared_gpu_note(launch: &Launch) -> Option<String> {
    launch.share_gpus.then(|| {
        let var = |k: &str| std::env::var(k).unwrap_or_else(|_| "unset".into());
        format!(
            "# CORRECTNESS RUN OF THE SHARING MODE, NOT PERFORMANCE FIGURES: the ranks share GPUs \
             (HANDOFF_SHARE_GPUS=1, each process its own NCCL host id), so NCCL moves every byte \
             through its network transport (NCCL_NET={}, NCCL_SOCKET_IFNAME={}), not NVLink or \
             shared memory; the values are checked, the times below are that path's",
            var("NCCL_NET"),
            var("NCCL_SOCKET_IFNAME")
        )
    })
}

/// One size's medians, in µs per operation, indexed like [`WAYS`].
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub bytes: usize,
    pub count: usize,
    pub us: [f64; 3],
}

impl Row {
    /// Bus bandwidth in GB/s of way `w`, with nccl-tests' factor for the operation.
    pub fn busbw(&self, w: usize, factor: f64) -> f64 {
        self.bytes as f64 / self.us[w] / 1000.0 * factor
    }
}

/// A size like `8`, `64K`, `1M`, `1GiB`.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let m: usize = match s[i..].to_ascii_uppercase().as_str() {
                "B" => 1,
                "K" | "KB" | "KIB" => 1 << 10,
                "M" | "MB" | "MIB" => 1 << 20,
                "G" | "GB" | "GIB" => 1 << 30,
                u => return Err(format!("unknown size unit {u} in {s}")),
            };
            (&s[..i], m)
        }
        None => (s, 1),
    };
    let n = num.trim().parse::<usize>().map_err(|e| format!("{s}: {e}"))?;
    n.checked_mul(mult).ok_or_else(|| format!("{s} is too large"))
}

/// The sizes from `min` to `max`, each `factor` times the last, ending exactly at `max`.
pub fn sizes(min: usize, max: usize, factor: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut b = min.max(1);
    while b <= max {
        out.push(b);
        b = match b.checked_mul(factor.max(2)) {
            Some(n) if n > max && b < max => max,
            Some(n) => n,
            None if b < max => max,
            None => break,
        };
    }
    out
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// nccl-tests' table header, with handoff's three ways and the ratios.
pub fn header() -> String {
    format!(
        "#{:>11} {:>11} | {:>10} {:>8} | {:>10} {:>8} | {:>10} {:>8} | {:>8} {:>8} {:>9} {:>9}",
        "size(B)",
        "count",
        "verif(us)",
        "busbw",
        "unver(us)",
        "busbw",
        "raw(us)",
        "busbw",
        "ver/raw",
        "unv/raw",
        "v-raw(us)",
        "v-unv(us)"
    )
}

/// One table line.
pub fn line(r: &Row, factor: f64) -> String {
    let [v, u, raw] = r.us;
    format!(
        "{:>12} {:>11} | {:>10.2} {:>8.2} | {:>10.2} {:>8.2} | {:>10.2} {:>8.2} | {:>8.4} {:>8.4} {:>9.2} {:>9.2}",
        r.bytes,
        r.count,
        v,
        r.busbw(0, factor),
        u,
        r.busbw(1, factor),
        raw,
        r.busbw(2, factor),
        v / raw,
        u / raw,
        v - raw,
        v - u
    )
}

/// The rows as CSV: `what` (the operation) and `dtype` in every row.
pub fn csv(what: &str, dtype: &str, rows: &[Row], factor: f64) -> String {
    let mut out = String::from(
        "op,bytes,count,dtype,verified_us,unverified_us,raw_us,verified_busbw_gbps,unverified_busbw_gbps,raw_busbw_gbps,verified_ratio,unverified_ratio\n",
    );
    for r in rows {
        let [v, u, raw] = r.us;
        let _ = writeln!(
            out,
            "{what},{},{},{dtype},{v:.3},{u:.3},{raw:.3},{:.3},{:.3},{:.3},{:.5},{:.5}",
            r.bytes,
            r.count,
            r.busbw(0, factor),
            r.busbw(1, factor),
            r.busbw(2, factor),
            v / raw,
            u / raw
        );
    }
    out
}

/// Three panels against message size: bus bandwidth, time per operation (both log scales) and
/// handoff / raw NCCL time per size (the figure readers look for first).
pub fn plot(path: &str, title: &str, rows: &[Row], factor: f64) -> Result<(), String> {
    if rows.is_empty() {
        return Err("no rows to plot".into());
    }
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let root = SVGBackend::new(path, (1500, 460)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let root = root.titled(title, ("sans-serif", 18)).map_err(|x| e(&x))?;
    let panels = root.split_evenly((1, 3));
    let xs: Vec<f64> = rows.iter().map(|r| r.bytes as f64).collect();
    let (x0, x1) = (xs[0], xs[xs.len() - 1].max(xs[0] * 2.0));
    let colors = [BLUE, GREEN, RED];
    let series = |f: Measure, w: usize| -> Vec<(f64, f64)> {
        rows.iter().map(|r| (r.bytes as f64, f(r, w))).collect()
    };
    let range = |vals: Vec<f64>| {
        let lo = vals.iter().copied().fold(f64::INFINITY, f64::min).max(1e-6);
        let hi = vals.iter().copied().fold(0.0, f64::max).max(lo * 10.0);
        (lo * 0.8, hi * 1.25)
    };
    // Panels 1 and 2: log-log, one line per way.
    let logged: [(&str, Measure); 2] = [
        ("bus bandwidth (GB/s)", &|r: &Row, w| r.busbw(w, factor)),
        ("time per operation (µs)", &|r: &Row, w| r.us[w]),
    ];
    for (panel, (name, f)) in panels.iter().zip(logged) {
        let (lo, hi) = range(rows.iter().flat_map(|r| (0..3).map(|w| f(r, w))).collect());
        let mut chart = ChartBuilder::on(panel)
            .caption(name, ("sans-serif", 15))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(55)
            .build_cartesian_2d((x0..x1).log_scale().base(4.0), (lo..hi).log_scale())
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .x_desc("message size (bytes)")
            .x_label_formatter(&|b| human(*b))
            .draw()
            .map_err(|x| e(&x))?;
        for (w, color) in colors.iter().enumerate() {
            chart
                .draw_series(LineSeries::new(series(f, w), color.stroke_width(2)))
                .map_err(|x| e(&x))?
                .label(WAYS[w])
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|x| e(&x))?;
    }
    // Panel 3: handoff's time over raw NCCL's, per size.
    let ratio = |r: &Row, w: usize| r.us[w] / r.us[2];
    // A linear axis from just below the smallest ratio to just above the largest (the log
    // panels' decade of headroom would flatten ratios near 1).
    let ratios: Vec<f64> = rows.iter().flat_map(|r| [ratio(r, 0), ratio(r, 1)]).collect();
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let pad = 0.05 * (hi - lo).max(0.1);
    let mut chart = ChartBuilder::on(&panels[2])
        .caption("handoff / raw NCCL (time)", ("sans-serif", 15))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(
            (x0..x1).log_scale().base(4.0),
            (lo.min(1.0) - pad)..(hi.max(1.0) + pad),
        )
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("message size (bytes)")
        .x_label_formatter(&|b| human(*b))
        .draw()
        .map_err(|x| e(&x))?;
    chart
        .draw_series(LineSeries::new(vec![(x0, 1.0), (x1, 1.0)], BLACK.mix(0.4)))
        .map_err(|x| e(&x))?;
    for (w, color) in colors.iter().take(2).enumerate() {
        chart
            .draw_series(LineSeries::new(series(&ratio, w), color.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(WAYS[w])
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))
}

/// 1024 as "1K", and so on.
pub fn human(b: f64) -> String {
    let b = b.round() as u64;
    match b {
        b if b >= 1 << 30 => format!("{}G", b >> 30),
        b if b >= 1 << 20 => format!("{}M", b >> 20),
        b if b >= 1 << 10 => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}
