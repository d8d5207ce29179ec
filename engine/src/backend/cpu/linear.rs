//! A linear layer (or several side by side: q/k/v, gate/up) as the CPU
//! backend computes it: one f32 input-major matrix ([`super::matmul`]), or
//! the model file's quantized rows ([`super::quant`]).

use super::matmul::{matmul, transpose};
use super::quant::{self, Q8Block};
use crate::model::{Linear, QuantTensor, Tensor, Weight};

#[derive(Debug)]
enum Matrix {
    /// `[inputs, outputs]` (input-major: HF's layout transposed).
    Dense(Vec<f32>),
    /// Quantized rows of each part, the parts' outputs side by side.
    Quant(Vec<QuantTensor>),
}

/// `y = x · Wᵀ + b` for one or more HF linears stacked along the output.
#[derive(Debug)]
pub(crate) struct CpuLinear {
    inputs: usize,
    outputs: usize,
    matrix: Matrix,
    bias: Option<Vec<f32>>,
}

/// Quantized activations reused across the products of one step.
#[derive(Debug, Default)]
pub(crate) struct LinearScratch {
    xq: Vec<Q8Block>,
}

impl CpuLinear {
    /// HF `[out, in]` linears side by side. Quantized parts stay quantized
    /// when every part is; a mix is computed in f32.
    pub(crate) fn stack(parts: &[&Linear]) -> Self {
        let weights: Vec<&Weight> = parts.iter().map(|l| &l.weight).collect();
        let mut this = Self::from_weights(&weights);
        this.bias = Linear::stacked_bias(parts);
        this
    }

    /// An lm_head: `[vocab, hidden]`, no bias.
    pub(crate) fn head(weight: &Weight) -> Self {
        Self::from_weights(&[weight])
    }

    fn from_weights(parts: &[&Weight]) -> Self {
        let inputs = parts[0].shape()[1];
        let outputs: usize = parts.iter().map(|w| w.shape()[0]).sum();
        let quantized: Option<Vec<QuantTensor>> = parts
            .iter()
            .map(|w| match w {
                Weight::Quant(q) => Some(q.clone()),
                Weight::Dense(_) => None,
            })
            .collect();
        let matrix = match quantized {
            Some(q) if inputs.is_multiple_of(sluice_gguf::quant::QK) => Matrix::Quant(q),
            _ => {
                let mut dense = vec![0.0; inputs * outputs];
                let mut offset = 0;
                for w in parts {
                    let t: std::borrow::Cow<'_, Tensor> = w.dense();
                    debug_assert_eq!(t.shape[1], inputs);
                    transpose(&mut dense, outputs, offset, &t.data, t.shape[0], inputs);
                    offset += t.shape[0];
                }
                Matrix::Dense(dense)
            }
        };
        CpuLinear {
            inputs,
            outputs,
            matrix,
            bias: None,
        }
    }

    /// `out = x · Wᵀ + b` (`+=` when `accumulate`) for `x` of `n` rows.
    pub(crate) fn forward(
        &self,
        out: &mut [f32],
        x: &[f32],
        n: usize,
        accumulate: bool,
        scratch: &mut LinearScratch,
    ) {
        match &self.matrix {
            Matrix::Dense(w) => matmul(out, x, w, n, self.inputs, self.outputs, accumulate),
            Matrix::Quant(parts) => {
                if parts.iter().any(|p| quant::uses_q8(p.ty)) {
                    quant::quantize_rows(x, self.inputs, &mut scratch.xq);
                }
                quant::matmul(out, self.outputs, x, &scratch.xq, parts, accumulate);
            }
        }
        if let Some(b) = &self.bias {
            super::kernels::add_bias(out, b);
        }
    }
}

/// An embedding table: f32 rows, or quantized rows de-quantized on lookup.
#[derive(Debug)]
pub(crate) enum Embedding {
    Dense(Vec<f32>),
    Quant(QuantTensor),
}

impl Embedding {
    pub(crate) fn new(weight: Weight) -> Self {
        match weight {
            Weight::Dense(t) => Embedding::Dense(t.data),
            Weight::Quant(q) => Embedding::Quant(q),
        }
    }

    /// Writes token `id`'s row into `out` (`hidden` values).
    pub(crate) fn row(&self, id: usize, out: &mut [f32]) {
        match self {
            Embedding::Dense(data) => {
                out.copy_from_slice(&data[id * out.len()..(id + 1) * out.len()]);
            }
            Embedding::Quant(q) => sluice_gguf::quant::dequantize(q.ty, q.row(id), out),
        }
    }
}
