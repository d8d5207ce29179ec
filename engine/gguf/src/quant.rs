//! ggml's tensor types: block geometry and reference de-quantization.
//!
//! Every quantized type stores a row as independent blocks: 32 weights per
//! block for the legacy types (`Q4_0`, `Q4_1`, `Q8_0`), 256 per super-block
//! for the K-quants (`Q4_K`, `Q5_K`, `Q6_K`). The layouts and formulas are
//! ggml's (`ggml-common.h`, `ggml-quants.c`); [`dequantize`] is the plain
//! reference the engine's fast kernels are tested against, and is itself
//! checked against gguf-py's de-quantization in this crate's tests.

use half::f16;

/// Weights per block of the legacy types.
pub const QK: usize = 32;
/// Weights per K-quant super-block.
pub const QK_K: usize = 256;

/// The tensor types Sluice reads (ggml's names, hence the underscores).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    /// 32 weights: f16 scale `d`, 16 bytes of 4-bit values `q`; `w = (q - 8) d`.
    Q4_0,
    /// 32 weights: f16 `d`, f16 `m`, 16 bytes of 4-bit `q`; `w = q d + m`.
    Q4_1,
    /// 32 weights: f16 `d`, 32 signed bytes `q`; `w = q d`.
    Q8_0,
    /// 256 weights in 8 sub-blocks of 32, each with a 6-bit scale and min.
    Q4_K,
    /// Q4_K with a fifth bit per weight.
    Q5_K,
    /// 256 weights in 16 sub-blocks of 16 with 8-bit scales; 6-bit values.
    Q6_K,
}

impl GgmlType {
    /// Every type, in ggml id order.
    pub const ALL: [GgmlType; 9] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::BF16,
    ];

    /// The type with ggml id `id`, if Sluice reads it.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// ggml's name for the type.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
        }
    }

    /// Elements per block (1 for the float types).
    pub fn block_elements(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => QK,
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 2 + QK / 2,
            GgmlType::Q4_1 => 4 + QK / 2,
            GgmlType::Q8_0 => 2 + QK,
            GgmlType::Q4_K => 4 + 12 + QK_K / 2,
            GgmlType::Q5_K => 4 + 12 + QK_K / 8 + QK_K / 2,
            GgmlType::Q6_K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
        }
    }

    /// Bytes of a row of `elements` (a multiple of [`Self::block_elements`]).
    pub fn row_bytes(self, elements: usize) -> usize {
        elements / self.block_elements() * self.block_bytes()
    }

    /// Whether the type is block-quantized (not a plain float type).
    pub fn is_quantized(self) -> bool {
        self.block_elements() > 1
    }
}

/// ggml's name for any type id, for error messages about types Sluice does
/// not read.
pub fn type_name(id: u32) -> &'static str {
    match id {
        6 => "Q5_0",
        7 => "Q5_1",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => GgmlType::from_id(id).map_or("unknown", GgmlType::name),
    }
}

#[inline(always)]
pub fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K block's
/// 12 packed scale bytes.
#[inline(always)]
pub fn k_scale_min(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

/// De-quantizes `bytes` (whole blocks of `ty`) into `out`, one value per
/// element.
///
/// # Panics
/// When `bytes` is not `out.len()` elements of `ty`.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    assert_eq!(
        bytes.len(),
        ty.row_bytes(out.len()),
        "{} bytes hold {} elements of {}",
        bytes.len(),
        out.len(),
        ty.name()
    );
    let blocks = bytes
        .chunks_exact(ty.block_bytes())
        .zip(out.chunks_exact_mut(ty.block_elements()));
    match ty {
        GgmlType::F32 => {
            for (b, y) in blocks {
                y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (b, y) in blocks {
                y[0] = f16_at(b, 0);
            }
        }
        GgmlType::BF16 => {
            for (b, y) in blocks {
                y[0] = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        GgmlType::Q4_0 => {
            for (b, y) in blocks {
                let d = f16_at(b, 0);
                for (j, &q) in b[2..].iter().enumerate() {
                    y[j] = ((q & 0xF) as i32 - 8) as f32 * d;
                    y[j + QK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (b, y) in blocks {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for (j, &q) in b[4..].iter().enumerate() {
                    y[j] = (q & 0xF) as f32 * d + m;
                    y[j + QK / 2] = (q >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (b, y) in blocks {
                let d = f16_at(b, 0);
                for (j, &q) in b[2..].iter().enumerate() {
                    y[j] = q as i8 as f32 * d;
                }
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            // Q5_K is Q4_K with a fifth bit per weight in 32 bytes of `qh`
            // between the scales and the nibbles.
            let high = ty == GgmlType::Q5_K;
            for (b, y) in blocks {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let scales = &b[4..16];
                let (qh, qs) = if high {
                    (&b[16..48], &b[48..])
                } else {
                    (&[][..], &b[16..])
                };
                for chunk in 0..4 {
                    let q = &qs[chunk * 32..chunk * 32 + 32];
                    let (s1, m1) = k_scale_min(scales, 2 * chunk);
                    let (s2, m2) = k_scale_min(scales, 2 * chunk + 1);
                    let (d1, m1) = (d * s1 as f32, dmin * m1 as f32);
                    let (d2, m2) = (d * s2 as f32, dmin * m2 as f32);
                    let (u1, u2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
                    let bit = |l: usize, u: u8| if high && qh[l] & u != 0 { 16 } else { 0 };
                    let y = &mut y[chunk * 64..chunk * 64 + 64];
                    for l in 0..32 {
                        y[l] = d1 * ((q[l] & 0xF) + bit(l, u1)) as f32 - m1;
                        y[l + 32] = d2 * ((q[l] >> 4) + bit(l, u2)) as f32 - m2;
                    }
                }
            }
        }
        GgmlType::Q6_K => {
            for (b, y) in blocks {
                let ql = &b[..128];
                let qh = &b[128..192];
                let sc = &b[192..208];
                let d = f16_at(b, 208);
                for half in 0..2 {
                    let (ql, qh) = (&ql[half * 64..], &qh[half * 32..]);
                    let sc = &sc[half * 8..];
                    let y = &mut y[half * 128..half * 128 + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
            }
        }
    }
}

/// `bytes` of `ty` de-quantized into a new vector of `elements` values.
pub fn dequantize_to_vec(ty: GgmlType, bytes: &[u8], elements: usize) -> Vec<f32> {
    let mut out = vec![0.0; elements];
    dequantize(ty, bytes, &mut out);
    out
}
