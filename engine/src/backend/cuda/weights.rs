//! A model's weights on the device (feature `cuda`): projections as bf16
//! `[out, in]` matrices (q/k/v fused into one, gate/up into another),
//! embeddings and lm_head bf16, norm weights and biases f32 (tiny, and
//! they scale every activation).

use cudarc::driver::CudaSlice;

use super::convert::{Fused, fuse, to_bf16_bits};
use super::device::{Device, driver};
use crate::backend::cpu::kernels::Rope;
use crate::error::EngineError;
use crate::model::{LayerWeights, Model, ModelConfig, ModelWeights};

/// One fused projection on the device.
#[derive(Debug)]
pub(crate) struct DeviceLinear {
    /// `[rows, cols]` bf16.
    pub(crate) weight: CudaSlice<u16>,
    pub(crate) bias: Option<CudaSlice<f32>>,
}

/// One decoder layer on the device.
#[derive(Debug)]
pub(crate) struct DeviceLayer {
    pub(crate) input_norm: CudaSlice<f32>,
    /// `[q + k + v, hidden]`.
    pub(crate) qkv: DeviceLinear,
    /// `[hidden, heads · head_dim]`.
    pub(crate) o: DeviceLinear,
    pub(crate) post_norm: CudaSlice<f32>,
    /// `[2 · intermediate, hidden]`: gate rows, then up rows.
    pub(crate) gate_up: DeviceLinear,
    /// `[hidden, intermediate]`.
    pub(crate) down: DeviceLinear,
}

/// The model on the device, and the host-side RoPE tables' source.
#[derive(Debug)]
pub(crate) struct DeviceWeights {
    pub(crate) config: ModelConfig,
    pub(crate) rope: Rope,
    /// `[vocab, hidden]` bf16.
    pub(crate) embed: CudaSlice<u16>,
    pub(crate) layers: Vec<DeviceLayer>,
    pub(crate) final_norm: CudaSlice<f32>,
    /// `[vocab, hidden]` bf16; `None` when tied to `embed`.
    pub(crate) lm_head: Option<CudaSlice<u16>>,
    /// Bytes of every weight on the device.
    pub(crate) bytes: usize,
    /// Bytes of `embed` (a step gathers only its tokens' rows unless the
    /// lm_head is tied to it).
    pub(crate) embed_bytes: usize,
}

struct Uploader<'a> {
    device: &'a Device,
    bytes: usize,
}

impl Uploader<'_> {
    fn f32s(&mut self, data: &[f32]) -> Result<CudaSlice<f32>, EngineError> {
        self.bytes += 4 * data.len();
        self.device
            .stream
            .clone_htod(data)
            .map_err(driver("uploading weights"))
    }

    fn bf16s(&mut self, data: &[u16]) -> Result<CudaSlice<u16>, EngineError> {
        self.bytes += 2 * data.len();
        self.device
            .stream
            .clone_htod(data)
            .map_err(driver("uploading weights"))
    }

    fn linear(&mut self, fused: Fused) -> Result<DeviceLinear, EngineError> {
        Ok(DeviceLinear {
            weight: self.bf16s(&fused.weight)?,
            bias: fused.bias.as_deref().map(|b| self.f32s(b)).transpose()?,
        })
    }

    fn layer(&mut self, w: LayerWeights) -> Result<DeviceLayer, EngineError> {
        Ok(DeviceLayer {
            input_norm: self.f32s(&w.input_layernorm)?,
            qkv: self.linear(fuse(&[&w.q_proj, &w.k_proj, &w.v_proj]))?,
            o: self.linear(fuse(&[&w.o_proj]))?,
            post_norm: self.f32s(&w.post_attention_layernorm)?,
            gate_up: self.linear(fuse(&[&w.gate_proj, &w.up_proj]))?,
            down: self.linear(fuse(&[&w.down_proj]))?,
        })
    }
}

impl DeviceWeights {
    /// Converts and uploads `model` (each host tensor is dropped once it is
    /// on the device), then waits for the copies.
    pub(crate) fn upload(model: Model, device: &Device) -> Result<Self, EngineError> {
        let Model { config, weights } = model;
        let ModelWeights {
            embed_tokens,
            layers,
            norm,
            lm_head,
        } = weights;
        let mut up = Uploader { device, bytes: 0 };
        let embed = up.bf16s(&to_bf16_bits(&embed_tokens.dense().data))?;
        let embed_bytes = up.bytes;
        drop(embed_tokens);
        let lm_head = lm_head
            .map(|t| up.bf16s(&to_bf16_bits(&t.dense().data)))
            .transpose()?;
        let mut device_layers = Vec::with_capacity(layers.len());
        for w in layers {
            device_layers.push(up.layer(w)?);
        }
        let final_norm = up.f32s(&norm)?;
        device.sync("uploading weights")?;
        Ok(Self {
            rope: Rope::new(&config),
            config,
            embed,
            layers: device_layers,
            final_norm,
            lm_head,
            bytes: up.bytes,
            embed_bytes,
        })
    }

    /// Bytes a decode step reads from the weights: every layer, the final
    /// norm and the lm_head (the embedding when tied).
    pub(crate) fn decode_read_bytes(&self) -> usize {
        match self.lm_head {
            Some(_) => self.bytes - self.embed_bytes,
            None => self.bytes,
        }
    }

    /// The lm_head matrix (the embeddings when tied).
    pub(crate) fn lm_head(&self) -> &CudaSlice<u16> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}
