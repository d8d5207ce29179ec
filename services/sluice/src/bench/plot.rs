//! The PNG plot of TTFT by priority tier: one bar per tier (mean), a line
//! from p50 to p99 with ticks at p50, p90 and p99, highest priority on the
//! left.
//!
//! plotters' bitmap backend draws into a buffer that `png` encodes. It has
//! no font without the `ttf` feature (which needs fontconfig), so text is
//! drawn pixel by pixel from `font8x8`'s built-in 8×8 glyphs: the plot
//! needs no system font.

use std::path::Path;

use plotters::prelude::*;

use super::BenchError;
use super::report::fmt;
use super::stats::Summary;

const W: u32 = 900;
const H: u32 = 540;
const LEFT: i32 = 90;
const RIGHT: i32 = 30;
const TOP: i32 = 60;
const BOTTOM: i32 = 80;

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

fn draw_err<E: std::fmt::Debug>(e: E) -> BenchError {
    BenchError::Encode {
        what: "the TTFT plot",
        detail: format!("{e:?}"),
    }
}

/// Draws `text` with its top-left corner at (x, y), each font pixel `scale` wide.
fn text(area: &Area<'_>, s: &str, x: i32, y: i32, scale: i32) -> Result<(), BenchError> {
    for (i, ch) in s.chars().enumerate() {
        let glyph = font8x8::legacy::BASIC_LEGACY
            .get(ch as usize)
            .copied()
            .unwrap_or(font8x8::legacy::NOTHING_TO_DISPLAY);
        let x0 = x + i as i32 * 8 * scale;
        for (row, bits) in glyph.iter().enumerate() {
            for col in 0..8 {
                if bits & (1 << col) != 0 {
                    let (px, py) = (x0 + col * scale, y + row as i32 * scale);
                    for dx in 0..scale {
                        for dy in 0..scale {
                            area.draw_pixel((px + dx, py + dy), &BLACK)
                                .map_err(draw_err)?;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

fn text_width(s: &str, scale: i32) -> i32 {
    s.chars().count() as i32 * 8 * scale
}

/// A round axis maximum at or above `x`.
fn nice_max(x: f64) -> f64 {
    if x <= 0.0 || !x.is_finite() {
        return 1.0;
    }
    let mag = 10f64.powf(x.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|&m| m >= x)
        .unwrap_or(10.0 * mag)
}

const COLORS: [RGBColor; 6] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
];

/// Renders the plot as RGB pixels (`W × H × 3` bytes).
fn render(title: &str, tiers: &[(String, Summary)]) -> Result<Vec<u8>, BenchError> {
    let mut buf = vec![0u8; (W * H * 3) as usize];
    {
        let area = BitMapBackend::with_buffer(&mut buf, (W, H)).into_drawing_area();
        area.fill(&WHITE).map_err(draw_err)?;
        text(&area, title, LEFT, 16, 2)?;
        let (x0, x1, y0, y1) = (LEFT, W as i32 - RIGHT, TOP, H as i32 - BOTTOM);
        let ymax = nice_max(tiers.iter().map(|(_, s)| s.p99).fold(0.0, f64::max) * 1.05);
        let y_of = |v: f64| y1 - ((v / ymax).clamp(0.0, 1.0) * f64::from(y1 - y0)) as i32;
        // Axes, grid and y labels.
        for k in 0..=5 {
            let v = ymax * f64::from(k) / 5.0;
            let y = y_of(v);
            let grid = if k == 0 {
                BLACK
            } else {
                RGBColor(220, 220, 220)
            };
            area.draw(&PathElement::new(vec![(x0, y), (x1, y)], grid))
                .map_err(draw_err)?;
            let label = if ymax >= 10.0 {
                format!("{v:.0}")
            } else {
                fmt(v)
            };
            text(&area, &label, x0 - 8 - text_width(&label, 1), y - 4, 1)?;
        }
        area.draw(&PathElement::new(vec![(x0, y0), (x0, y1)], BLACK))
            .map_err(draw_err)?;
        text(&area, "TTFT ms", 8, TOP - 24, 1)?;
        let n = tiers.len().max(1) as i32;
        let slot = (x1 - x0) / n;
        for (i, (name, s)) in tiers.iter().enumerate() {
            let i = i as i32;
            let cx = x0 + slot * i + slot / 2;
            let half = (slot / 4).clamp(4, 60);
            let color = COLORS[i as usize % COLORS.len()];
            area.draw(&Rectangle::new(
                [(cx - half, y_of(s.mean)), (cx + half, y1)],
                color.filled(),
            ))
            .map_err(draw_err)?;
            let whisker = ShapeStyle::from(&BLACK).stroke_width(2);
            area.draw(&PathElement::new(
                vec![(cx, y_of(s.p50)), (cx, y_of(s.p99))],
                whisker,
            ))
            .map_err(draw_err)?;
            for (v, w) in [(s.p50, half / 2), (s.p90, half / 3), (s.p99, half / 2)] {
                area.draw(&PathElement::new(
                    vec![(cx - w, y_of(v)), (cx + w, y_of(v))],
                    whisker,
                ))
                .map_err(draw_err)?;
            }
            let mean = fmt(s.mean);
            text(&area, name, cx - text_width(name, 2) / 2, y1 + 12, 2)?;
            text(
                &area,
                &format!("mean {mean}"),
                cx - text_width(&format!("mean {mean}"), 1) / 2,
                y1 + 36,
                1,
            )?;
            let p99 = format!("p99 {}", fmt(s.p99));
            text(&area, &p99, cx - text_width(&p99, 1) / 2, y1 + 50, 1)?;
        }
        text(
            &area,
            "bar: mean; line: p50 to p99, ticks at p50, p90, p99",
            LEFT,
            H as i32 - 16,
            1,
        )?;
        area.present().map_err(draw_err)?;
    }
    Ok(buf)
}

/// Writes the TTFT-by-tier plot to `path` as PNG.
pub(crate) fn write_ttft_plot(
    path: &Path,
    title: &str,
    tiers: &[(String, Summary)],
) -> Result<(), BenchError> {
    let pixels = render(title, tiers)?;
    let file = std::fs::File::create(path).map_err(|source| BenchError::Write {
        path: path.to_path_buf(),
        source,
    })?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), W, H);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let encode = |e: png::EncodingError| BenchError::Encode {
        what: "the TTFT plot",
        detail: e.to_string(),
    };
    let mut w = enc.write_header().map_err(encode)?;
    w.write_image_data(&pixels).map_err(encode)?;
    w.finish().map_err(encode)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(mean: f64) -> Summary {
        Summary {
            count: 3,
            mean,
            p50: mean * 0.9,
            p90: mean * 1.2,
            p99: mean * 1.5,
            min: 1.0,
            max: mean * 2.0,
        }
    }

    #[test]
    fn nice_max_rounds_up_to_one_two_five() {
        assert_eq!(nice_max(0.0), 1.0);
        assert_eq!(nice_max(7.3), 10.0);
        assert_eq!(nice_max(130.0), 200.0);
        assert_eq!(nice_max(2400.0), 2500.0);
    }

    #[test]
    fn writes_a_png_with_bars_and_text() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ttft.png");
        let tiers = vec![("p3".to_string(), s(100.0)), ("p0".to_string(), s(900.0))];
        write_ttft_plot(&path, "TTFT by priority", &tiers).expect("writes");
        let bytes = std::fs::read(&path).expect("png");
        assert_eq!(&bytes[1..4], b"PNG");
        // The tallest bar's colour and black text are both drawn.
        let px = render("t", &tiers).expect("renders");
        let has = |c: RGBColor| px.chunks(3).any(|p| p == [c.0, c.1, c.2]);
        assert!(has(COLORS[0]) && has(COLORS[1]) && has(BLACK));
    }
}
