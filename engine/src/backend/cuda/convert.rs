//! Host-side weight preparation for the cuda backend: f32 tensors (as the
//! loader gives them, from f32, f16 or bf16 safetensors) rounded to bf16,
//! and Hugging Face `[out, in]` linears fused by stacking their rows, so a
//! fused projection is one `[Σ out, in]` matrix cuBLAS multiplies as is
//! (transposed operand, no repacking).
//!
//! Pure host code, tested without the `cuda` feature. bf16 keeps f32's
//! range, so no weight overflows; a bf16 source round-trips exactly.

use half::bf16;
use half::slice::HalfFloatSliceExt;

use crate::model::Linear;

/// `src` rounded to bf16 (nearest, ties to even; NaN stays NaN), as raw bits.
pub fn to_bf16_bits(src: &[f32]) -> Vec<u16> {
    let mut out = vec![bf16::ZERO; src.len()];
    out.convert_from_f32_slice(src);
    out.into_iter().map(bf16::to_bits).collect()
}

/// bf16 bits back to f32 (exact).
pub fn bf16_bits_to_f32(src: &[u16]) -> Vec<f32> {
    src.iter().map(|&b| bf16::from_bits(b).to_f32()).collect()
}

/// Linears fused into one matrix: rows of every part in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Fused {
    /// `[rows, cols]` row-major bf16 bits (HF layout: one row per output).
    pub weight: Vec<u16>,
    /// Concatenated biases, zeros for a part without one; `None` when no
    /// part has a bias.
    pub bias: Option<Vec<f32>>,
    /// Outputs (sum of the parts' out features).
    pub rows: usize,
    /// Inputs (shared by every part).
    pub cols: usize,
}

/// Stacks `parts` (same input width) into one bf16 matrix.
pub fn fuse(parts: &[&Linear]) -> Fused {
    let cols = parts.first().map_or(0, |l| l.weight.shape()[1]);
    let rows: usize = parts.iter().map(|l| l.out_features()).sum();
    let mut weight = Vec::with_capacity(rows * cols);
    for l in parts {
        debug_assert_eq!(l.weight.shape()[1], cols);
        // A GGUF's quantized blocks are widened here: the cuda engine
        // computes in bf16.
        weight.extend(to_bf16_bits(&l.weight.dense().data));
    }
    let bias = Linear::stacked_bias(parts);
    Fused {
        weight,
        bias,
        rows,
        cols,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Tensor;

    #[test]
    fn rounding_is_nearest_even_and_keeps_specials() {
        let one = 1.0f32.to_bits();
        let halfway = f32::from_bits(one + 0x8000); // exactly between 1 and the next bf16
        let above = f32::from_bits(one + 0x8001);
        let odd_halfway = f32::from_bits(one + 0x1_8000); // between two bf16s, lower one odd
        let bits = to_bf16_bits(&[halfway, above, odd_halfway, -2.5, f32::INFINITY, f32::NAN]);
        assert_eq!(bits[0], 0x3f80, "ties go to the even neighbour (1.0)");
        assert_eq!(bits[1], 0x3f81, "above the tie rounds up");
        assert_eq!(
            bits[2], 0x3f82,
            "ties from an odd neighbour round up to even"
        );
        assert_eq!(bf16_bits_to_f32(&bits[3..5]), vec![-2.5, f32::INFINITY]);
        assert!(bf16_bits_to_f32(&bits[5..])[0].is_nan());
    }

    #[test]
    fn bf16_values_round_trip_exactly() {
        let values: Vec<f32> = (0..1000)
            .map(|i| bf16::from_f32((i as f32 - 500.0) * 0.013).to_f32())
            .collect();
        assert_eq!(bf16_bits_to_f32(&to_bf16_bits(&values)), values);
    }

    #[test]
    fn large_weights_stay_finite_and_close() {
        let w = [3.0e38f32, -1.0e-30, 65504.0 * 4.0, 0.1];
        for (got, want) in bf16_bits_to_f32(&to_bf16_bits(&w)).iter().zip(w) {
            assert!(got.is_finite());
            assert!((got - want).abs() <= want.abs() / 256.0, "{got} vs {want}");
        }
    }

    fn linear(out: usize, inp: usize, base: f32, bias: bool) -> Linear {
        Linear {
            weight: Tensor::new(
                vec![out, inp],
                (0..out * inp).map(|i| base + i as f32).collect(),
            )
            .into(),
            bias: bias.then(|| (0..out).map(|i| base + 0.5 + i as f32).collect()),
        }
    }

    #[test]
    fn fusing_stacks_rows_and_fills_missing_biases() {
        let q = linear(2, 3, 0.0, true);
        let k = linear(1, 3, 100.0, false);
        let v = linear(1, 3, 200.0, true);
        let f = fuse(&[&q, &k, &v]);
        assert_eq!((f.rows, f.cols), (4, 3));
        let w = bf16_bits_to_f32(&f.weight);
        assert_eq!(&w[..6], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(&w[6..9], &[100.0, 101.0, 102.0]);
        assert_eq!(&w[9..], &[200.0, 201.0, 202.0]);
        assert_eq!(f.bias, Some(vec![0.5, 1.5, 0.0, 200.5]));
        assert_eq!(fuse(&[&k]).bias, None);
    }
}
