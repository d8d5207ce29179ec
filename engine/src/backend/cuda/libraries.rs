//! Finding the CUDA libraries at run time (feature `cuda`): cudarc loads
//! the driver (`libcuda`), NVRTC and cuBLAS with `dlopen` on first use and
//! panics when one is missing, so the backend checks each one first and
//! says which is absent.
//!
//! `SLUICE_NVRTC_LIB` may name NVRTC's file (e.g. the `nvidia-cuda-nvrtc`
//! wheel's `nvidia/cu13/lib/libnvrtc.so.13`): it is loaded by path first,
//! and cudarc's later lookup by soname finds that copy.

use std::ffi::CString;

use crate::error::EngineError;

/// The variable naming NVRTC's shared library.
pub const NVRTC_LIB_VAR: &str = "SLUICE_NVRTC_LIB";

/// Loads the file `SLUICE_NVRTC_LIB` names, if set (once is enough; later
/// calls find it loaded).
pub fn preload_nvrtc() -> Result<(), EngineError> {
    let Some(path) = std::env::var_os(NVRTC_LIB_VAR) else {
        return Ok(());
    };
    let shown = path.to_string_lossy().into_owned();
    let c = CString::new(path.into_encoded_bytes()).map_err(|_| {
        EngineError::InvalidConfig(format!("{NVRTC_LIB_VAR}={shown} contains a NUL byte"))
    })?;
    // SAFETY: a NUL-terminated path; the handle is kept open for the life of
    // the process (never closed), so the library stays mapped for cudarc.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        return Err(EngineError::CudaLibraryMissing {
            library: "NVRTC (libnvrtc.so.13)",
            hint: "the file SLUICE_NVRTC_LIB names cannot be loaded",
        });
    }
    Ok(())
}

/// Whether NVRTC can be loaded (after [`preload_nvrtc`]).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Checks every library the backend uses, in the order it needs them: the
/// driver, NVRTC, cuBLAS.
pub fn check() -> Result<(), EngineError> {
    // SAFETY: only tries to dlopen candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(EngineError::CudaLibraryMissing {
            library: "the CUDA driver (libcuda.so)",
            hint: "is the NVIDIA driver installed, and is this a GPU host or a container run with GPU access?",
        });
    }
    preload_nvrtc()?;
    if !nvrtc_present() {
        return Err(EngineError::CudaLibraryMissing {
            library: "NVRTC (libnvrtc.so.13)",
            hint: "install the CUDA 13 toolkit or `pip install nvidia-cuda-nvrtc`, then put its lib directory on LD_LIBRARY_PATH or name the file in SLUICE_NVRTC_LIB",
        });
    }
    // SAFETY: only tries to dlopen candidate names.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(EngineError::CudaLibraryMissing {
            library: "cuBLAS (libcublas.so.13)",
            hint: "install the CUDA 13 toolkit or `pip install nvidia-cublas`, then put its lib directory on LD_LIBRARY_PATH",
        });
    }
    Ok(())
}
