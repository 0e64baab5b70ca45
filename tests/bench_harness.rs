//! The benchmarks' shared harness (benches/harness/mod.rs), tested without a GPU: sizes, medians,
//! the table, the CSV and the plot.

#[path = "../benches/harness/mod.rs"]
mod harness;

use harness::{Row, Sweep, Way, csv, header, line, median, parse_size, plot, sizes};

#[test]
fn sizes_parse_and_step_to_the_maximum() {
    assert_eq!(parse_size("8").unwrap(), 8);
    assert_eq!(parse_size("64K").unwrap(), 65536);
    assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
    assert!(parse_size("3X").is_err() && parse_size("M").is_err());
    assert_eq!(sizes(8, 1000, 4), [8, 32, 128, 512, 1000]);
    assert_eq!(sizes(8, 8, 4), [8]);
    assert_eq!(sizes(8, 1 << 30, 4).last(), Some(&(1 << 30)));
    assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
}

fn rows() -> Vec<Row> {
    sizes(8, 1 << 30, 4)
        .into_iter()
        .map(|b| {
            let raw = 10.0 + b as f64 / 370_000.0;
            Row {
                bytes: b,
                count: b / 4,
                us: [raw + 1.0, raw + 0.5, raw],
            }
        })
        .collect()
}

#[test]
fn table_and_csv_carry_every_way_and_the_ratios() {
    let r = &rows()[0];
    assert!(header().contains("ver/raw"));
    let l = line(r, 1.0);
    assert!(
        l.contains("11.00") && l.contains("10.50") && l.contains("1.1000"),
        "{l}"
    );
    let c = csv("all_reduce", "f32", &rows(), 2.0);
    let lines: Vec<&str> = c.lines().collect();
    assert_eq!(lines.len(), rows().len() + 1);
    assert!(
        lines[1].starts_with("all_reduce,8,2,f32,11.000,10.500,10.000,"),
        "{}",
        lines[1]
    );
}

#[test]
fn the_plot_has_three_panels_with_every_series() {
    let path = std::env::temp_dir().join(format!("handoff-harness-{}.svg", std::process::id()));
    plot(path.to_str().unwrap(), "test: all_reduce", &rows(), 1.0).unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    for text in [
        "bus bandwidth",
        "time per operation",
        "handoff / raw NCCL",
        "raw NCCL",
        "handoff verified",
    ] {
        assert!(svg.contains(text), "the plot lacks {text}");
    }
    assert!(svg.matches("<polyline").count() >= 3 * 2 + 2, "too few lines");
    // The ratio panel's linear axis hugs the ratios (1.0 to 1.1 here) instead of running to 10×,
    // and sizes are marked in powers of 4 (4K, not 1000).
    assert!(
        !svg.contains("\n4.0\n"),
        "the ratio axis runs far past the ratios"
    );
    assert!(
        svg.contains("\n4K\n") && !svg.contains("\n1000\n"),
        "sizes not in powers of 4"
    );
    assert!(plot("/nonexistent/dir/x.svg", "t", &[], 1.0).is_err());
}

fn sweep(repeats: usize) -> Sweep {
    Sweep {
        min_bytes: 8,
        max_bytes: 1000,
        factor: 4,
        iters: 10,
        warmup: 3,
        repeats,
    }
}

#[test]
fn ways_are_warmed_then_timed_in_rotation_and_their_medians_taken() {
    let mut calls = Vec::new();
    // Run k of a way takes 10·(k+1) µs for 10 iterations: medians are per iteration.
    let mut seen = [0usize; 3];
    let us = sweep(3)
        .time_ways(|way, n, timed| -> Result<f64, ()> {
            calls.push((way, n, timed));
            if !timed {
                return Ok(0.0);
            }
            seen[way as usize] += 1;
            Ok(10.0 * seen[way as usize] as f64 * (way as usize + 1) as f64)
        })
        .unwrap();
    let warm: Vec<_> = Way::ALL.iter().map(|&w| (w, 3, false)).collect();
    assert_eq!(calls[..3], warm[..]);
    let order: Vec<Way> = calls[3..].iter().map(|c| c.0).collect();
    assert_eq!(order, [Way::ALL, Way::ALL, Way::ALL].concat());
    assert!(calls[3..].iter().all(|c| c.1 == 10 && c.2));
    assert_eq!(us, [2.0, 4.0, 6.0]);
}

#[test]
fn sweep_checks_its_options_and_gives_its_sizes() {
    assert!(sweep(1).check().is_ok());
    assert!(sweep(0).check().is_err());
    assert!(
        Sweep {
            factor: 1,
            ..sweep(1)
        }
        .check()
        .is_err()
    );
    assert!(
        Sweep {
            min_bytes: 2000,
            ..sweep(1)
        }
        .check()
        .is_err()
    );
    assert_eq!(sweep(1).sizes(16), [16, 64, 256, 1000]);
}
