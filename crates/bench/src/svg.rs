//! A bar chart of median steady decode tok/s per arm, min–max whiskers, and
//! each arm's ceiling as a dashed line over its bar — written by hand as SVG,
//! so the report needs no plotting dependency and opens in any browser.

use std::fmt::Write as _;

use crate::report::{Report, Status, sig3};
use crate::sample::Metric;

const W: f64 = 720.0;
const H: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 70.0;

/// Renders the chart.
pub fn render(r: &Report) -> String {
    let arms = &r.arms;
    let bars: Vec<(f64, f64, f64)> = arms
        .iter()
        .map(|a| {
            a.summary
                .get(Metric::DecodeTokS.key())
                .map_or((0.0, 0.0, 0.0), |s| (s.min, s.median, s.max))
        })
        .collect();
    let top_bar = bars.iter().map(|b| b.2).fold(0.0, f64::max);
    // Fit ceilings on the scale unless one dwarfs the bars; those are drawn at
    // the top edge and labelled "off scale" so the bars stay readable.
    let near_ceiling = arms
        .iter()
        .filter_map(|a| a.ceiling_tok_s)
        .filter(|c| top_bar == 0.0 || *c <= 4.0 * top_bar)
        .fold(0.0, f64::max);
    let ymax = nice_max(top_bar.max(near_ceiling) * 1.1);
    let plot_h = H - TOP - BOTTOM;
    let plot_w = W - LEFT - RIGHT;
    let y = |v: f64| TOP + plot_h * (1.0 - (v / ymax).min(1.0));
    let slot = plot_w / arms.len().max(1) as f64;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let title = format!(
        "fathom bench: steady decode tok/s (median, min–max), {} new tokens, {} reps{}",
        r.config.max_new,
        r.config.reps,
        r.config.memory_cap_bytes.map_or(String::new(), |b| format!(
            ", cap {}",
            fathom_weights::units::format_bytes(b)
        ))
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="14">{}</text>"#,
        W / 2.0,
        esc(&title)
    );
    // Axis and gridlines.
    for i in 0..=5 {
        let v = ymax * i as f64 / 5.0;
        let yy = y(v);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{}" y2="{yy:.1}" stroke="#ddd"/>"##,
            W - RIGHT
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 6.0,
            yy + 4.0,
            sig3(v)
        );
    }
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{}" stroke="#333"/>"##,
        H - BOTTOM
    );
    let _ = writeln!(
        s,
        r#"<text x="16" y="{:.1}" transform="rotate(-90 16 {:.1})" text-anchor="middle">tok/s</text>"#,
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0
    );
    for (i, (a, &(lo, med, hi))) in arms.iter().zip(&bars).enumerate() {
        let x0 = LEFT + slot * i as f64;
        let cx = x0 + slot / 2.0;
        let bw = (slot * 0.5).min(90.0);
        let fill = match (a.status, a.kind) {
            (Status::Accepted, "peer") => "#e69f00",
            (Status::Accepted, _) => "#0072b2",
            _ => "#bbbbbb",
        };
        if a.samples > 0 {
            let _ = writeln!(
                s,
                r#"<rect x="{:.1}" y="{:.1}" width="{bw:.1}" height="{:.1}" fill="{fill}"><title>{} median {}</title></rect>"#,
                cx - bw / 2.0,
                y(med),
                (y(0.0) - y(med)).max(0.0),
                esc(&a.name),
                sig3(med)
            );
            let _ = writeln!(
                s,
                r##"<line x1="{cx:.1}" y1="{:.1}" x2="{cx:.1}" y2="{:.1}" stroke="#222"/><line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#222"/><line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#222"/>"##,
                y(lo),
                y(hi),
                cx - 8.0,
                y(lo),
                cx + 8.0,
                y(lo),
                cx - 8.0,
                y(hi),
                cx + 8.0,
                y(hi)
            );
            let _ = writeln!(
                s,
                r#"<text x="{cx:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                y(hi) - 6.0,
                sig3(med)
            );
        }
        if let Some(c) = a.ceiling_tok_s {
            let off = c > ymax;
            let yy = y(c);
            let label = if off {
                format!("ceiling {} (off scale)", sig3(c))
            } else {
                format!("ceiling {}", sig3(c))
            };
            let _ = writeln!(
                s,
                r##"<line x1="{:.1}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#d55e00" stroke-width="2" stroke-dasharray="6 3"/><text x="{cx:.1}" y="{:.1}" text-anchor="middle" fill="#d55e00" font-size="11">{}</text>"##,
                x0 + slot * 0.1,
                x0 + slot * 0.9,
                if off { yy + 14.0 } else { yy - 4.0 },
                esc(&label)
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{cx:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            H - BOTTOM + 18.0,
            esc(&a.name)
        );
        let note = match a.status {
            Status::Accepted => a
                .decode_vs_ceiling
                .map_or(String::new(), |v| format!("{} of ceiling", sig3(v))),
            Status::Rejected => "rejected: output differs".into(),
            Status::Failed => "failed".into(),
        };
        let _ = writeln!(
            s,
            r##"<text x="{cx:.1}" y="{:.1}" text-anchor="middle" fill="#555" font-size="11">{}</text>"##,
            H - BOTTOM + 34.0,
            esc(&note)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Rounds up to 1, 2 or 5 × a power of ten, so gridlines land on round values.
fn nice_max(v: f64) -> f64 {
    if v.is_nan() || v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|x| *x >= v)
        .unwrap_or(10.0 * p)
}

fn esc(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_maxima() {
        assert_eq!(nice_max(0.0), 1.0);
        assert_eq!(nice_max(7.3), 10.0);
        assert_eq!(nice_max(13.0), 20.0);
        assert_eq!(nice_max(0.42), 0.5);
        assert_eq!(nice_max(f64::NAN), 1.0);
    }

    #[test]
    fn escapes_markup() {
        assert_eq!(esc("a<b>&\"c\""), "a&lt;b&gt;&amp;&quot;c&quot;");
    }
}
