//! The `rdma` transport (cargo feature `rdma`): ibverbs through a few
//! hand-written `extern "C"` declarations, linked against `libibverbs`
//! (Debian: `libibverbs-dev`).
//!
//! What exists: opening the first RDMA device, a protection domain, and
//! registering memory for remote writes (`ibv_reg_mr` with
//! `REMOTE_WRITE`), which is what a region's `rkey`/`base_addr`/`length`
//! describe. What does not yet: the reliable-connection queue-pair exchange
//! and the `IBV_WR_RDMA_WRITE` post (both go through `ibv_context_ops`, which
//! needs the C struct layouts and a device to test on). Until then both
//! sides report the transport unavailable — "no RDMA device" on a host
//! without one, "queue-pair setup not implemented" on a host with one — so
//! negotiation skips it and nothing is offered that cannot be written.

use std::ffi::{CStr, c_char, c_int, c_void};

use crate::error::WorkerError;

#[repr(C)]
struct IbvDevice {
    _opaque: [u8; 0],
}

#[repr(C)]
struct IbvContext {
    _opaque: [u8; 0],
}

#[repr(C)]
struct IbvPd {
    _opaque: [u8; 0],
}

/// `struct ibv_mr` (verbs.h): stable since libibverbs 1.1.
#[repr(C)]
struct IbvMr {
    context: *mut IbvContext,
    pd: *mut IbvPd,
    addr: *mut c_void,
    length: usize,
    handle: u32,
    lkey: u32,
    rkey: u32,
}

const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
const IBV_ACCESS_REMOTE_WRITE: c_int = 1 << 1;

#[link(name = "ibverbs")]
unsafe extern "C" {
    fn ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut IbvDevice;
    fn ibv_free_device_list(list: *mut *mut IbvDevice);
    fn ibv_get_device_name(device: *mut IbvDevice) -> *const c_char;
    fn ibv_open_device(device: *mut IbvDevice) -> *mut IbvContext;
    fn ibv_close_device(context: *mut IbvContext) -> c_int;
    fn ibv_alloc_pd(context: *mut IbvContext) -> *mut IbvPd;
    fn ibv_dealloc_pd(pd: *mut IbvPd) -> c_int;
    fn ibv_reg_mr(pd: *mut IbvPd, addr: *mut c_void, length: usize, access: c_int) -> *mut IbvMr;
    fn ibv_dereg_mr(mr: *mut IbvMr) -> c_int;
}

fn rdma_err(msg: impl Into<String>) -> WorkerError {
    WorkerError::Transfer(format!("rdma: {}", msg.into()))
}

/// An opened RDMA device with one protection domain; closed when dropped.
#[derive(Debug)]
pub struct Device {
    name: String,
    context: *mut IbvContext,
    pd: *mut IbvPd,
}

// SAFETY: ibverbs contexts and protection domains are thread-safe handles
// (libibverbs serialises what needs it internally).
unsafe impl Send for Device {}
// SAFETY: as above; `Device` exposes no interior mutation of its own.
unsafe impl Sync for Device {}

impl Device {
    /// Opens the first RDMA device; "no RDMA device" when there is none.
    pub fn open_first() -> Result<Self, WorkerError> {
        let mut n: c_int = 0;
        // SAFETY: plain FFI call; a null return means an error (errno).
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(rdma_err(format!(
                "no RDMA device (ibv_get_device_list: {})",
                std::io::Error::last_os_error()
            )));
        }
        let result = (|| {
            if n <= 0 {
                return Err(rdma_err("no RDMA device"));
            }
            // SAFETY: the list holds `n` valid device pointers.
            let dev = unsafe { *list };
            // SAFETY: `dev` is a valid device; the name is a NUL-terminated
            // string owned by the device list.
            let name = unsafe { CStr::from_ptr(ibv_get_device_name(dev)) }
                .to_string_lossy()
                .into_owned();
            // SAFETY: `dev` is valid until the list is freed; an opened
            // context stays valid after that.
            let context = unsafe { ibv_open_device(dev) };
            if context.is_null() {
                return Err(rdma_err(format!("cannot open RDMA device {name}")));
            }
            // SAFETY: `context` was just opened.
            let pd = unsafe { ibv_alloc_pd(context) };
            if pd.is_null() {
                // SAFETY: closing the context opened above.
                unsafe { ibv_close_device(context) };
                return Err(rdma_err(format!(
                    "cannot allocate a protection domain on {name}"
                )));
            }
            Ok(Device { name, context, pd })
        })();
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { ibv_free_device_list(list) };
        result
    }

    /// The device's name (e.g. `mlx5_0`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Registers `len` bytes at `addr` for local and remote writes.
    ///
    /// # Safety
    /// `addr..addr + len` must stay valid (and not move) until the returned
    /// region is dropped.
    pub unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<MemoryRegion, WorkerError> {
        // SAFETY: the caller keeps the memory valid; `self.pd` is live.
        let mr = unsafe {
            ibv_reg_mr(
                self.pd,
                addr.cast(),
                len,
                IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
            )
        };
        if mr.is_null() {
            return Err(rdma_err(format!(
                "ibv_reg_mr of {len} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(MemoryRegion { mr })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: both handles are live and released exactly once, PD first.
        unsafe {
            ibv_dealloc_pd(self.pd);
            ibv_close_device(self.context);
        }
    }
}

/// Memory registered for remote writes; deregistered when dropped.
#[derive(Debug)]
pub struct MemoryRegion {
    mr: *mut IbvMr,
}

// SAFETY: a registered MR is an immutable handle once created.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// The remote key a peer writes with.
    pub fn rkey(&self) -> u32 {
        // SAFETY: `mr` is live while `self` is.
        unsafe { (*self.mr).rkey }
    }

    /// The registered base address.
    pub fn base_addr(&self) -> u64 {
        // SAFETY: `mr` is live while `self` is.
        unsafe { (*self.mr).addr as u64 }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: `mr` came from ibv_reg_mr and is deregistered once.
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

/// Whether this host can run the transport: a device must open, and the
/// queue-pair data path must exist (it does not yet, see the module docs).
pub fn probe() -> Result<(), WorkerError> {
    let dev = Device::open_first()?;
    Err(rdma_err(format!(
        "device {} found, but the queue-pair setup is not implemented",
        dev.name()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_fails_cleanly_without_a_usable_device() {
        let err = probe().expect_err("no usable RDMA data path in this build");
        let msg = err.to_string();
        assert!(
            msg.contains("no RDMA device") || msg.contains("not implemented"),
            "{msg}"
        );
    }
}
