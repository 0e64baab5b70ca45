//! The plot of `benches/verify_scale.rs`.

use std::path::Path;

use plotters::prelude::*;

use crate::rank::Report;
use crate::{Row, spread};

/// Two panels against the world size (log-log): what each rank sends per operation, with
/// its connections, the law `n - 1` beside them; and the time per operation.
pub fn plot(path: &Path, rows: &[Row]) -> Result<(), String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let root = SVGBackend::new(path, (1200, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let root = root
        .titled(
            "verification over the TCP channel, every pair remote, CPU only (ranks as processes)",
            ("sans-serif", 18),
        )
        .map_err(|x| e(&x))?;
    let panels = root.split_evenly((1, 2));
    let x1 = rows.iter().map(|r| r.world).max().unwrap_or(2).max(4) as f64;
    let med = |r: &Row, f: &dyn Fn(&Report) -> f64| spread(&r.reports, f)[1];
    type Series<'a> = (&'a str, RGBColor, Box<dyn Fn(&Row) -> f64 + 'a>);
    let counts: Vec<Series> = vec![
        (
            "connections per rank",
            BLACK,
            Box::new(|r: &Row| med(r, &|x| x.setup.established as f64)),
        ),
        (
            "records sent per rank per collective",
            RED,
            Box::new(|r: &Row| med(r, &|x| x.coll.records_out as f64 / r.ops as f64)),
        ),
        (
            "records sent per rank per ring step",
            BLUE,
            Box::new(|r: &Row| med(r, &|x| x.p2p.records_out as f64 / r.ops as f64)),
        ),
        (
            "n - 1",
            RGBColor(150, 150, 150),
            Box::new(|r: &Row| r.world as f64 - 1.0),
        ),
    ];
    let times: Vec<Series> = vec![
        (
            "µs per collective (median rank)",
            RED,
            Box::new(|r: &Row| med(r, &|x| x.coll_us)),
        ),
        (
            "µs per ring step (median rank)",
            BLUE,
            Box::new(|r: &Row| med(r, &|x| x.p2p_us)),
        ),
        (
            "CPU µs per collective, the rank's process",
            RGBColor(230, 140, 0),
            Box::new(|r: &Row| med(r, &|x| x.coll_cpu_us)),
        ),
        (
            "CPU µs per ring step, the rank's process",
            RGBColor(0, 160, 160),
            Box::new(|r: &Row| med(r, &|x| x.p2p_cpu_us)),
        ),
    ];
    let panel_specs = [
        ("per rank (log-log)", "count", counts),
        ("time per verified operation (log-log; contended)", "µs", times),
    ];
    for (panel, (caption, unit, series)) in panels.iter().zip(panel_specs) {
        let vals: Vec<f64> = series.iter().flat_map(|(_, _, f)| rows.iter().map(f)).collect();
        let lo = vals
            .iter()
            .copied()
            .filter(|v| *v > 0.0)
            .fold(f64::INFINITY, f64::min);
        let hi = vals.iter().copied().fold(0.0, f64::max);
        let mut chart = ChartBuilder::on(panel)
            .caption(caption, ("sans-serif", 15))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(55)
            .build_cartesian_2d((2f64..x1).log_scale().base(2.0), (lo * 0.7..hi * 1.4).log_scale())
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .x_desc("world size (ranks)")
            .y_desc(unit)
            .x_label_formatter(&|v| format!("{}", v.round()))
            .draw()
            .map_err(|x| e(&x))?;
        for (name, color, f) in &series {
            let points: Vec<(f64, f64)> = rows.iter().map(|r| (r.world as f64, f(r))).collect();
            let color = *color;
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(|x| e(&x))?
                .label(*name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
            chart
                .draw_series(points.into_iter().map(|p| Circle::new(p, 3, color.filled())))
                .map_err(|x| e(&x))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|x| e(&x))?;
    }
    root.present().map_err(|x| e(&x))
}
