//! One backend's hold on a GPU (feature `cuda`): the context, its own
//! stream and cuBLAS handle, the kernels compiled for this device, and the
//! two ways work is enqueued — a kernel launch and a bf16 GEMM.
//!
//! Kernel arguments are raw device addresses ([`Arg`]): the backend owns
//! every buffer they point into and synchronises its stream before a step
//! returns, so nothing is freed or reused while a launch may still read it.
//! Event tracking (cudarc's per-buffer cross-stream events) is switched off
//! for this reason: each backend uses exactly one stream.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::result as blas;
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::libraries;
use super::nvrtc::{self, Output};
use super::plan::Launch;
use super::source::{KernelConfig, PROGRAM_NAME, SOURCE};
use crate::error::EngineError;

/// A driver error with what was being done.
pub(crate) fn driver(what: &'static str) -> impl FnOnce(DriverError) -> EngineError {
    move |source| EngineError::CudaDriver {
        what: what.to_owned(),
        source,
    }
}

/// One kernel argument.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg {
    /// A device address (0 for an absent optional buffer).
    Ptr(u64),
    I32(i32),
    U32(u32),
    U64(u64),
    F32(f32),
}

/// The kernels of [`SOURCE`], loaded.
#[derive(Debug)]
pub(crate) struct Kernels {
    pub(crate) embed_gather: CudaFunction,
    pub(crate) rms_norm: CudaFunction,
    pub(crate) qkv_rope_store: CudaFunction,
    pub(crate) paged_attention: CudaFunction,
    pub(crate) attention_combine: CudaFunction,
    pub(crate) swiglu: CudaFunction,
    pub(crate) add_bias: CudaFunction,
    pub(crate) kv_pack: CudaFunction,
    pub(crate) kv_unpack: CudaFunction,
}

/// A context, a stream, a cuBLAS handle and the kernels.
#[derive(Debug)]
pub(crate) struct Device {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    blas: CudaBlas,
    pub(crate) kernels: Kernels,
    /// Blocks of a grid-stride launch: a few waves of the device's SMs.
    pub(crate) max_blocks: u32,
    /// Streaming multiprocessors.
    pub(crate) sms: u32,
    /// `name (sm_XY)`, for logs.
    pub(crate) description: String,
    /// cuBLAS's workspace, set on the handle: a GEMM captured in a CUDA
    /// graph must not allocate.
    _workspace: CudaSlice<u8>,
}

/// The oldest driver API the backend runs on (`cuDriverGetVersion`'s form):
/// CUDA 13.0, what cudarc is built for and what its NVRTC targets.
const MIN_DRIVER_CUDA: i32 = 13000;

/// Bytes of the cuBLAS workspace (what cuBLAS's own default is on Hopper).
const CUBLAS_WORKSPACE: usize = 32 << 20;

impl Device {
    /// Opens device `ordinal` (modulo the visible devices) and compiles the
    /// kernels for it. Every missing library or device is a clear error,
    /// never a panic.
    pub(crate) fn open(ordinal: usize, kernels: KernelConfig) -> Result<Self, EngineError> {
        libraries::check()?;
        let count = match CudaContext::device_count() {
            Ok(n) => n,
            Err(e) if e.0 == cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NO_DEVICE => 0,
            Err(e) => return Err(driver("initialising the CUDA driver")(e)),
        };
        if count <= 0 {
            return Err(EngineError::NoCudaDevice {
                visible: std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into()),
            });
        }
        let mut version = 0;
        // SAFETY: a valid out-pointer; the driver library is loaded (checked).
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(driver("reading the driver version"))?;
        if version < MIN_DRIVER_CUDA {
            // Kernels compiled by CUDA 13's NVRTC do not load on older drivers.
            return Err(EngineError::InvalidConfig(format!(
                "the NVIDIA driver supports CUDA {}.{}; the cuda engine needs CUDA 13 (driver 580 or newer)",
                version / 1000,
                version % 1000 / 10
            )));
        }
        let ctx =
            CudaContext::new(ordinal % count as usize).map_err(driver("opening the device"))?;
        // SAFETY: before any buffer exists; every buffer of this backend is
        // used on its one stream only (see the module docs).
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("reading the compute capability"))?;
        let name = ctx.name().map_err(driver("reading the device name"))?;
        let description = format!("{name} (sm_{major}{minor})");
        if major < 8 {
            return Err(EngineError::InvalidConfig(format!(
                "the cuda backend computes in bf16, which needs compute capability 8.0 (Ampere) or newer; {description} has {major}.{minor}"
            )));
        }
        let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
        let blas = CudaBlas::new(Arc::clone(&stream)).map_err(|source| EngineError::Cublas {
            what: "creating a handle".into(),
            source,
        })?;
        let workspace = stream
            .alloc_zeros::<u8>(CUBLAS_WORKSPACE)
            .map_err(driver("allocating the cuBLAS workspace"))?;
        {
            let (ptr, _sync) = workspace.device_ptr(&stream);
            // SAFETY: a live handle and a device buffer of this size that
            // outlives it (both are fields of this device; the handle is
            // dropped first).
            unsafe {
                blas_sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut c_void,
                    CUBLAS_WORKSPACE,
                )
            }
            .result()
            .map_err(|source| EngineError::Cublas {
                what: "setting the workspace".into(),
                source,
            })?;
        }
        let options = kernels.nvrtc_options(&format!("sm_{major}{minor}"));
        let (cubin, log) = nvrtc::compile(SOURCE, PROGRAM_NAME, &options, Output::Cubin)?;
        if !log.trim().is_empty() {
            tracing::debug!(%log, "NVRTC compiled the kernels with messages");
        }
        let module = ctx
            .load_module(Ptx::from_binary(cubin))
            .map_err(driver("loading the kernels"))?;
        let f = |name: &'static str| module.load_function(name).map_err(driver(name));
        let kernels = Kernels {
            embed_gather: f("embed_gather")?,
            rms_norm: f("rms_norm")?,
            qkv_rope_store: f("qkv_rope_store")?,
            paged_attention: f("paged_attention")?,
            attention_combine: f("attention_combine")?,
            swiglu: f("swiglu")?,
            add_bias: f("add_bias")?,
            kv_pack: f("kv_pack")?,
            kv_unpack: f("kv_unpack")?,
        };
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver("reading the SM count"))?;
        Ok(Self {
            ctx,
            stream,
            blas,
            kernels,
            max_blocks: (sms.max(1) as u32).saturating_mul(4),
            sms: sms.max(1) as u32,
            description,
            _workspace: workspace,
        })
    }

    /// Makes this device's context current on the calling thread (the
    /// engine thread is not the one that opened it).
    pub(crate) fn bind(&self) -> Result<(), EngineError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))
    }

    /// The device address of `buf` plus `offset` elements.
    pub(crate) fn addr<T>(&self, buf: &CudaSlice<T>, offset: usize) -> u64 {
        let (ptr, _sync) = buf.device_ptr(&self.stream);
        ptr + (offset * std::mem::size_of::<T>()) as u64
    }

    /// Enqueues `f` with `args`.
    pub(crate) fn launch(
        &self,
        f: &CudaFunction,
        launch: Launch,
        args: &[Arg],
    ) -> Result<(), EngineError> {
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Ptr(v) | Arg::U64(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::U32(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: launch.grid,
            block_dim: (launch.block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every argument matches the kernel's signature in
        // kernels.cu (the callers pass them in order), and every address
        // points into a live buffer of the calling backend large enough for
        // the launch (sized from the same step plan).
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(driver("launching a kernel"))
    }

    /// `y[tokens, outputs] (+)= x[tokens, inputs] · w[outputs, inputs]ᵀ`:
    /// bf16 `x` and `w` (HF layout), f32 `y`, f32 accumulation; adds to `y`
    /// when `accumulate` (the residual stream).
    ///
    /// # Safety
    /// The addresses must hold matrices of these shapes on this device.
    #[expect(
        clippy::too_many_arguments,
        reason = "three operands, three dimensions and the accumulate flag of one GEMM"
    )]
    pub(crate) unsafe fn linear(
        &self,
        y: u64,
        x: u64,
        w: u64,
        tokens: usize,
        inputs: usize,
        outputs: usize,
        accumulate: bool,
    ) -> Result<(), EngineError> {
        let alpha = 1.0f32;
        let beta = if accumulate { 1.0f32 } else { 0.0 };
        // Column-major view: y is [outputs, tokens] = op(w)[outputs, inputs]
        // · x[inputs, tokens], w stored as [inputs, outputs] (lda = inputs).
        // SAFETY: shapes and addresses are the caller's; alpha and beta
        // live across the call (host pointer mode).
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                outputs as i32,
                tokens as i32,
                inputs as i32,
                (&alpha as *const f32).cast::<c_void>(),
                w as *const c_void,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                inputs as i32,
                x as *const c_void,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                inputs as i32,
                (&beta as *const f32).cast::<c_void>(),
                y as *mut c_void,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                outputs as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|source| EngineError::Cublas {
            what: format!("GEMM {tokens}x{inputs} by {outputs}x{inputs}"),
            source,
        })
    }

    /// Waits for everything enqueued.
    pub(crate) fn sync(&self, what: &'static str) -> Result<(), EngineError> {
        self.stream.synchronize().map_err(driver(what))
    }
}
