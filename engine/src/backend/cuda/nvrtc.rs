//! Compiling the kernels with NVRTC (feature `cuda`): to PTX (what CI
//! assembles with `ptxas` to check registers and spills) or to a cubin for
//! the device at hand (what the backend loads: native code needs no PTX JIT
//! in the driver, so a newer NVRTC than the driver still works).
//!
//! NVRTC is loaded at run time ([`super::libraries`]); call
//! [`super::libraries::nvrtc_present`] first: cudarc panics on first use of
//! a missing library.

use std::ffi::{CStr, CString, c_char};

use cudarc::nvrtc::{result, sys};

use crate::error::EngineError;

/// What NVRTC produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// PTX text (`--gpu-architecture=compute_XY`).
    Ptx,
    /// A cubin (`--gpu-architecture=sm_XY`).
    Cubin,
}

/// Destroys the program when dropped.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `create_program`, destroyed only here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// The NVRTC version (major, minor).
pub fn version() -> Result<(i32, i32), EngineError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|source| EngineError::KernelCompile {
            options: String::new(),
            log: "nvrtcVersion failed".to_owned(),
            source,
        })?;
    Ok((major, minor))
}

/// Compiles `source` with `options`; returns the PTX (NUL-free text) or
/// cubin bytes, and the compiler's log (warnings).
pub fn compile(
    source: &str,
    name: &str,
    options: &[String],
    output: Output,
) -> Result<(Vec<u8>, String), EngineError> {
    let fail = |log: String, source| EngineError::KernelCompile {
        options: options.join(" "),
        log,
        source,
    };
    let bad_text = |what: &str| EngineError::InvalidConfig(format!("{what} contains a NUL byte"));
    let src = CString::new(source).map_err(|_| bad_text("the kernel source"))?;
    let cname = CString::new(name).map_err(|_| bad_text("the program name"))?;
    if options.iter().any(|o| o.contains('\0')) {
        return Err(bad_text("an NVRTC option"));
    }
    let prog =
        Program(result::create_program(&src, Some(&cname)).map_err(|e| fail(String::new(), e))?);
    // SAFETY: `prog` is a live program; options are NUL-free (checked).
    let compiled = unsafe { result::compile_program(prog.0, options) };
    // SAFETY: `prog` is live.
    let log = unsafe { result::get_program_log(prog.0) }
        .map(|raw| c_text(&raw))
        .unwrap_or_default();
    if let Err(e) = compiled {
        return Err(fail(log, e));
    }
    let bytes = match output {
        Output::Ptx => {
            // SAFETY: `prog` compiled successfully.
            let raw = unsafe { result::get_ptx(prog.0) }.map_err(|e| fail(log.clone(), e))?;
            c_text(&raw).into_bytes()
        }
        Output::Cubin => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled for a real architecture; valid out-pointer.
            unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
                .result()
                .map_err(|e| fail(log.clone(), e))?;
            let mut buf = vec![0u8; size];
            // SAFETY: `buf` holds the `size` bytes NVRTC reported.
            unsafe { sys::nvrtcGetCUBIN(prog.0, buf.as_mut_ptr().cast::<c_char>()) }
                .result()
                .map_err(|e| fail(log.clone(), e))?;
            buf
        }
    };
    Ok((bytes, log))
}

/// NVRTC's NUL-terminated text as a `String`.
fn c_text(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
    match CStr::from_bytes_until_nul(&bytes) {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(&bytes).into_owned(),
    }
}
