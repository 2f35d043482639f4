//! SVG plots of a run: TTFT p90 and hit rate against the offered rate,
//! one line per policy.

use std::path::Path;

use anyhow::Result;

use super::{Row, medians};

const COLORS: [(u8, u8, u8); 16] = [
    (214, 39, 40),
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (30, 30, 30),
    (188, 189, 34),
    (23, 190, 207),
    (255, 152, 150),
    (174, 199, 232),
    (152, 223, 138),
    (197, 176, 213),
    (127, 127, 127),
    (219, 219, 141),
];

/// Draws `series` (one line per policy, ours thicker) with a legend.
macro_rules! draw_lines {
    ($chart:expr, $series:expr, $x_desc:expr, $y_desc:expr, $legend:expr) => {{
        $chart
            .configure_mesh()
            .x_desc($x_desc)
            .y_desc($y_desc)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .light_line_style(RGBColor(245, 245, 245))
            .draw()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        for (i, (policy, points)) in $series.iter().enumerate() {
            let (r, g, b) = COLORS[i % COLORS.len()];
            let color = RGBColor(r, g, b);
            let width = if policy == "kinference" { 3 } else { 1 };
            $chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(width)))
                .map_err(|e| anyhow::anyhow!("{e}"))?
                .label(policy.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(width))
                });
            $chart
                .draw_series(points.iter().map(|pt| Circle::new(*pt, 3, color.filled())))
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        $chart
            .configure_series_labels()
            .position($legend)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }};
}

/// Plots one workload: TTFT p90 (log scale) vs rate, and hit rate vs rate,
/// one line per policy.
pub(crate) fn plots(rows: &[Row], workload: &str, dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    use plotters::prelude::*;
    let rows: Vec<Row> = medians(rows)
        .into_iter()
        .filter(|r| r.workload == workload)
        .collect();
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let mut policies: Vec<String> = Vec::new();
    for r in &rows {
        if !policies.contains(&r.policy) {
            policies.push(r.policy.clone());
        }
    }
    let series = |f: fn(&Row) -> f64| -> Vec<(String, Vec<(f64, f64)>)> {
        policies
            .iter()
            .map(|p| {
                let pts = rows
                    .iter()
                    .filter(|r| &r.policy == p)
                    .map(|r| (r.rate, f(r)))
                    .filter(|(_, y)| y.is_finite())
                    .collect();
                (p.clone(), pts)
            })
            .collect()
    };
    let max_rate = rows.iter().map(|r| r.rate).fold(0.0, f64::max) * 1.05;
    let x_desc = "requests per second";
    let mut out = Vec::new();

    let ttft = series(|r| r.ttft_p90_ms.max(1.0));
    let ys = ttft.iter().flat_map(|(_, p)| p.iter().map(|(_, y)| *y));
    let (lo, hi) = ys.fold((f64::INFINITY, 1.0f64), |(lo, hi), y| {
        (lo.min(y), hi.max(y))
    });
    let path = dir.join(format!("{workload}-ttft-p90.svg"));
    {
        let root = SVGBackend::new(&path, (760, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("{workload}: TTFT p90 vs request rate"),
                ("sans-serif", 20),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(
                0.0..max_rate,
                ((lo.min(hi) / 1.5).max(1.0)..hi * 1.5).log_scale(),
            )
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        draw_lines!(
            chart,
            ttft,
            x_desc,
            "TTFT p90, ms (log)",
            SeriesLabelPosition::UpperLeft
        );
        root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    out.push(path);

    let hits = series(|r| r.hit_rate * 100.0);
    let path = dir.join(format!("{workload}-hit-rate.svg"));
    {
        let root = SVGBackend::new(&path, (760, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("{workload}: prefix-cache hit rate vs request rate"),
                ("sans-serif", 20),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..max_rate, 0.0..100.0)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        draw_lines!(
            chart,
            hits,
            x_desc,
            "prefix-cache hit rate, %",
            SeriesLabelPosition::LowerLeft
        );
        root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    out.push(path);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::tests::row;
    use super::*;

    #[test]
    fn plots_are_svg_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut rows = vec![row("kinference", 0, 200.0), row("greedy-truth", 0, 100.0)];
        let mut more = rows.clone();
        for r in &mut more {
            r.rate = 8.0;
            r.ttft_p90_ms *= 3.0;
        }
        rows.extend(more);
        let files = plots(&rows, "shared-prefix", dir.path()).expect("plots");
        assert_eq!(files.len(), 2);
        for f in files {
            let s = std::fs::read_to_string(&f).expect("written");
            assert!(s.starts_with("<svg"), "{}", &s[..s.len().min(80)]);
            assert!(s.contains("kinference"));
        }
    }
}
