//! The demo's picture: per-tenant CPU per second across the three phases
//! with the noisy tenant's cap drawn as a line, and beneath it the light
//! tenants' p99 latency per second. One SVG, one line series per tenant.

use crate::load::{Light, Noisy};
use crate::phase::PhaseResult;
use anyhow::{Context, Result};
use plotters::prelude::*;
use serde_json::json;
use std::path::Path;

const LIGHT_COLORS: [RGBColor; 3] =
    [RGBColor(0x1f, 0x77, 0xb4), RGBColor(0x2c, 0xa0, 0x2c), RGBColor(0x94, 0x67, 0xbd)];
const NOISY_COLOR: RGBColor = RGBColor(0xd6, 0x27, 0x28);
const CAP_COLOR: RGBColor = RGBColor(0x33, 0x33, 0x33);

fn light_color(i: usize) -> RGBColor {
    LIGHT_COLORS[i % LIGHT_COLORS.len()]
}

fn hex(c: RGBColor) -> String {
    format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
}

/// Which stroke colour draws which tenant (for readers of the SVG).
pub fn series(lights: &[Light], noisy: &Noisy) -> serde_json::Value {
    let mut v: Vec<_> =
        lights.iter().enumerate().map(|(i, l)| json!({"tenant": l.name, "color": hex(light_color(i))})).collect();
    v.push(json!({"tenant": noisy.name, "color": hex(NOISY_COLOR)}));
    json!(v)
}

/// `(x, value)` of one tenant's per-second values over all phases, each
/// phase `len` seconds wide on the x axis; a phase the tenant sat out
/// counts as zero CPU.
fn timeline(phases: &[PhaseResult], len: f64, f: impl Fn(&PhaseResult) -> Option<Vec<f64>>) -> Vec<(f64, f64)> {
    let mut pts = Vec::new();
    for (i, p) in phases.iter().enumerate() {
        let values = f(p).unwrap_or_else(|| vec![0.0; len as usize]);
        pts.extend(values.iter().enumerate().map(|(s, v)| (i as f64 * len + s as f64 + 0.5, *v)));
    }
    pts
}

pub fn write(path: &Path, phases: &[PhaseResult], lights: &[Light], noisy: &Noisy, cap: f64, cores: f64) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    draw(path, phases, lights, noisy, cap, cores).map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))
}

fn draw(
    path: &Path,
    phases: &[PhaseResult],
    lights: &[Light],
    noisy: &Noisy,
    cap: f64,
    cores: f64,
) -> Result<(), Box<dyn std::error::Error>> {
    let len = phases.iter().map(|p| p.seconds.round()).fold(1.0, f64::max);
    let x_end = len * phases.len() as f64;
    let root = SVGBackend::new(path, (1000, 720)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(420);

    // CPU per tenant.
    let mut cpu = ChartBuilder::on(&top)
        .caption("CPU per tenant, charged by the governor agent (cores, 1 s windows)", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(32)
        .y_label_area_size(52)
        .build_cartesian_2d(0.0..x_end, 0.0..cores)?;
    cpu.configure_mesh().x_desc("demo time (s)").y_desc("cores").light_line_style(WHITE.mix(0.0)).draw()?;
    for (i, p) in phases.iter().enumerate() {
        let x0 = i as f64 * len;
        if i > 0 {
            cpu.draw_series(std::iter::once(PathElement::new(vec![(x0, 0.0), (x0, cores)], BLACK.mix(0.4))))?;
        }
        let label = format!("{} {}", i + 1, p.name);
        cpu.draw_series(std::iter::once(Text::new(label, (x0 + 0.3, cores * 0.97), ("sans-serif", 14))))?;
    }
    for (i, l) in lights.iter().enumerate() {
        let c = light_color(i);
        let pts = timeline(phases, len, |p| p.tenants.get(&l.name).map(|t| t.windows_cores.clone()));
        cpu.draw_series(LineSeries::new(pts, c.stroke_width(2)))?
            .label(l.name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    let pts = timeline(phases, len, |p| p.tenants.get(&noisy.name).map(|t| t.windows_cores.clone()));
    cpu.draw_series(LineSeries::new(pts, NOISY_COLOR.stroke_width(2)))?
        .label(noisy.name.as_str())
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], NOISY_COLOR.stroke_width(2)));
    cpu.draw_series(DashedLineSeries::new(vec![(0.0, cap), (x_end, cap)], 8, 5, CAP_COLOR.stroke_width(1)))?
        .label(format!("noisy tenant's cap, {cap} core (enforced in phase 3)"))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], CAP_COLOR));
    // Beside the alone phase, between the light tenants (near 0) and the
    // noisy tenant's unthrottled CPU (near the top).
    cpu.configure_series_labels()
        .position(SeriesLabelPosition::MiddleLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;

    // The light tenants' p99 per second.
    let ms = |us: u64| us as f64 / 1e3;
    let all: Vec<f64> = phases
        .iter()
        .flat_map(|p| {
            lights.iter().filter_map(|l| p.tenants.get(&l.name)).flat_map(|t| t.p99_per_second_us.iter().copied())
        })
        .filter(|&v| v > 0)
        .map(ms)
        .chain(
            phases
                .iter()
                .flat_map(|p| lights.iter().filter_map(|l| p.tenants.get(&l.name)))
                .flat_map(|t| t.windows_runq_wait_per_request_us.iter().map(|us| us / 1e3))
                .filter(|&v| v > 0.0),
        )
        .collect();
    let lo = all.iter().copied().fold(f64::INFINITY, f64::min).min(0.1) / 1.5;
    let hi = all.iter().copied().fold(1.0, f64::max) * 1.5;
    let mut lat = ChartBuilder::on(&bottom)
        .caption(
            "light tenants' p99 latency per second, dashed: their run-queue wait per request (ms, log scale)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(32)
        .y_label_area_size(52)
        .build_cartesian_2d(0.0..x_end, (lo..hi).log_scale())?;
    lat.configure_mesh()
        .x_desc("demo time (s)")
        .y_desc("p99 (ms)")
        .y_label_formatter(&|v| {
            let s = format!("{v:.2}");
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        })
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    for i in 1..phases.len() {
        let x0 = i as f64 * len;
        lat.draw_series(std::iter::once(PathElement::new(vec![(x0, lo), (x0, hi)], BLACK.mix(0.4))))?;
    }
    for (i, l) in lights.iter().enumerate() {
        let c = light_color(i);
        let pts: Vec<(f64, f64)> = timeline(phases, len, |p| {
            p.tenants.get(&l.name).map(|t| t.p99_per_second_us.iter().map(|&v| ms(v)).collect())
        })
        .into_iter()
        .filter(|(_, v)| *v > 0.0)
        .collect();
        lat.draw_series(LineSeries::new(pts, c.stroke_width(2)))?
            .label(l.name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        // Beside it, dashed: how long its threads waited in the kernel's run
        // queue per request, each second.
        let runq: Vec<(f64, f64)> = timeline(phases, len, |p| {
            p.tenants.get(&l.name).map(|t| t.windows_runq_wait_per_request_us.iter().map(|us| us / 1e3).collect())
        })
        .into_iter()
        .filter(|(_, v)| *v > 0.0)
        .collect();
        let label = format!("{}: run-queue wait per request", l.name);
        lat.draw_series(DashedLineSeries::new(runq, 4, 3, c.stroke_width(1)))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(1)));
    }
    if let Some(alone) = phases.first() {
        let bound = ms(alone.light.p99_us) * 1.5;
        lat.draw_series(DashedLineSeries::new(vec![(0.0, bound), (x_end, bound)], 8, 5, CAP_COLOR.stroke_width(1)))?
            .label("1.5 × the light tenants' p99 alone")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], CAP_COLOR));
    }
    // Above the alone phase, the lowest.
    lat.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
