//! The `rdma` transport (cargo feature `rdma`): ibverbs through hand-written
//! `extern "C"` declarations (`rdma/ffi.rs`), linked against `libibverbs` (Debian:
//! `libibverbs-dev`). No bindgen, no extra crates.
//!
//! The verbs layer, bottom up:
//!
//! - [`Device`]: an opened RDMA device (by name, or the first one) with one
//!   protection domain. [`Device::register`] pins memory for local and remote
//!   writes and yields a [`MemoryRegion`] (`lkey`, `rkey`, `addr`, `len`).
//! - [`Connection`]: one completion queue and one reliable-connection queue
//!   pair. [`Connection::new`] leaves the QP in INIT and returns the
//!   [`QpInfo`] the peer needs; [`Connection::connect`] takes the peer's
//!   [`QpInfo`] and moves the QP through RTR to RTS. [`Connection::write`]
//!   then posts one-sided `IBV_WR_RDMA_WRITE`s and waits for them.
//! - [`exchange_as_client`] / [`exchange_as_server`]: swap [`QpInfo`]s over
//!   any tokio byte stream (the transport's side channel), framed with a
//!   magic/version word.
//!
//! The typical sequence, on both sides: `Device::open`, `register` the KV
//! pool (receiver) or staging memory (sender), `Connection::new`, exchange
//! infos, `connect`. The receiver then tells the sender its region's
//! `addr`/`rkey` (in the transfer registration) and, once its own `connect`
//! has returned, that it is ready; only then does the sender `write` (see
//! [`Connection::connect`]). `write` busy-polls: run it on a blocking thread.
//!
//! [`probe`] says whether this host can do any of that: a device must open
//! and its port 1 must be ACTIVE.
//!
//! Ownership: `Device` is a cheap handle onto a shared context + PD; every
//! `MemoryRegion` and `Connection` keeps that shared state alive, so the
//! verbs objects are always released children first (QP, CQ, MR, then PD,
//! then the context) whatever order the Rust values are dropped in.

use std::ffi::{CStr, c_char, c_int, c_uint};
use std::sync::Arc;

use crate::{KvTransferError, TransportKind};
use ffi::Zeroed as _;

mod ffi;
mod handshake;
mod qp;
mod transport;

pub use handshake::{HANDSHAKE_MAGIC, exchange_as_client, exchange_as_server};
pub use qp::{Connection, ConnectionOptions, QP_INFO_LEN, QpInfo, WriteOp};
pub use transport::{RdmaInbound, RdmaSender};

/// The port every connection uses unless told otherwise (verbs ports count
/// from 1).
pub const DEFAULT_PORT: u8 = 1;

/// A check of `rdma` failed (no underlying error).
fn rdma_err(msg: impl Into<String>) -> KvTransferError {
    KvTransferError::transport(TransportKind::Rdma, msg)
}

/// `rdma` failed while doing `what` on an underlying error (for `map_err`).
fn rdma_failed<E: Into<crate::BoxError>>(
    what: impl Into<String>,
) -> impl FnOnce(E) -> KvTransferError {
    KvTransferError::failed(TransportKind::Rdma, what)
}

/// The error of an errno-style return code (verbs calls return the errno
/// value itself, or -1 with `errno` set, depending on the call and provider).
fn os_error(rc: c_int) -> std::io::Error {
    if rc > 0 {
        std::io::Error::from_raw_os_error(rc)
    } else {
        std::io::Error::last_os_error()
    }
}

/// A verbs call (`what`) returned `rc`: the errno it stands for is the source.
fn verbs_failed(what: String, rc: c_int) -> KvTransferError {
    KvTransferError::Failed {
        transport: TransportKind::Rdma,
        what,
        source: os_error(rc).into(),
    }
}

/// The context and protection domain behind a [`Device`], shared with every
/// region and connection made from it and released after the last of them.
#[derive(Debug)]
struct DeviceInner {
    name: String,
    context: *mut ffi::IbvContext,
    pd: *mut ffi::IbvPd,
}

// SAFETY: ibverbs contexts and protection domains are thread-safe handles
// (libibverbs and the providers serialise what needs it internally); the
// pointers are only freed in `Drop`, once.
unsafe impl Send for DeviceInner {}
// SAFETY: as above; `DeviceInner` exposes no interior mutation of its own.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // SAFETY: both handles are live and released exactly once, the PD
        // before its context. Every MR/QP/CQ made from them holds an `Arc` to
        // this value, so they are all gone by now.
        unsafe {
            ffi::ibv_dealloc_pd(self.pd);
            ffi::ibv_close_device(self.context);
        }
    }
}

/// What `ibv_query_port` says about one port, in the terms this transport
/// uses.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PortInfo {
    state: c_uint,
    active_mtu: c_uint,
    max_msg_sz: u32,
    lid: u16,
    link_layer: u8,
}

impl PortInfo {
    fn is_active(&self) -> bool {
        self.state == ffi::IBV_PORT_ACTIVE
    }

    fn is_ethernet(&self) -> bool {
        self.link_layer == ffi::IBV_LINK_LAYER_ETHERNET
    }
}

fn port_state_name(state: c_uint) -> &'static str {
    match state {
        ffi::IBV_PORT_NOP => "NOP",
        ffi::IBV_PORT_DOWN => "DOWN",
        ffi::IBV_PORT_INIT => "INIT",
        ffi::IBV_PORT_ARMED => "ARMED",
        ffi::IBV_PORT_ACTIVE => "ACTIVE",
        ffi::IBV_PORT_ACTIVE_DEFER => "ACTIVE_DEFER",
        _ => "unknown",
    }
}

/// An opened RDMA device with one protection domain. Cloning is cheap and
/// shares the device; it is closed once the last clone, region and
/// connection made from it are dropped.
#[derive(Debug, Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

impl Device {
    /// Opens the RDMA device called `name` (e.g. `mlx5_0`), or the first one
    /// when `None`. Fails with "no RDMA device" on a host without any, and
    /// names the devices there are when `name` is not among them.
    pub fn open(name: Option<&str>) -> Result<Self, KvTransferError> {
        let mut n: c_int = 0;
        // SAFETY: plain FFI call; a null return means an error (errno).
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(rdma_err(format!(
                "no RDMA device (ibv_get_device_list: {})",
                std::io::Error::last_os_error()
            )));
        }
        let result = (|| {
            let count = usize::try_from(n).unwrap_or(0);
            if count == 0 {
                return Err(rdma_err("no RDMA device"));
            }
            let mut names = Vec::with_capacity(count);
            for i in 0..count {
                // SAFETY: the list holds `count` valid device pointers.
                let dev = unsafe { *list.add(i) };
                // SAFETY: `dev` is a valid device; its name is a
                // NUL-terminated string owned by the device list.
                let dev_name = unsafe { cstr_lossy(ffi::ibv_get_device_name(dev)) };
                if name.is_none_or(|wanted| wanted == dev_name) {
                    // SAFETY: `dev` stays valid until the list is freed, and
                    // an opened context outlives the list.
                    return unsafe { Self::open_listed(dev, dev_name) };
                }
                names.push(dev_name);
            }
            Err(rdma_err(format!(
                "no RDMA device named {} (there are: {})",
                name.unwrap_or_default(),
                names.join(", ")
            )))
        })();
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { ffi::ibv_free_device_list(list) };
        result
    }

    /// Opens the first RDMA device; the same as `Device::open(None)`.
    pub fn open_first() -> Result<Self, KvTransferError> {
        Self::open(None)
    }

    /// # Safety
    /// `dev` must be a live entry of a device list that is not freed during
    /// the call.
    unsafe fn open_listed(dev: *mut ffi::IbvDevice, name: String) -> Result<Self, KvTransferError> {
        // SAFETY: per the function's contract `dev` is valid.
        let context = unsafe { ffi::ibv_open_device(dev) };
        if context.is_null() {
            return Err(rdma_err(format!(
                "cannot open RDMA device {name}: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `context` was just opened.
        let pd = unsafe { ffi::ibv_alloc_pd(context) };
        if pd.is_null() {
            let why = std::io::Error::last_os_error();
            // SAFETY: closing the context opened above, once.
            unsafe { ffi::ibv_close_device(context) };
            return Err(rdma_err(format!(
                "cannot allocate a protection domain on {name}: {why}"
            )));
        }
        Ok(Device {
            inner: Arc::new(DeviceInner { name, context, pd }),
        })
    }

    /// The device's name (e.g. `mlx5_0`).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Queries `port` (verbs ports count from 1).
    pub(crate) fn query_port(&self, port: u8) -> Result<PortInfo, KvTransferError> {
        let mut attr = ffi::IbvPortAttr::zeroed();
        // SAFETY: the context is live; `attr` is a zeroed, full-size
        // `ibv_port_attr`, larger than the compat struct the exported symbol
        // fills — the same call verbs.h's `___ibv_query_port` makes on its
        // fallback path.
        let rc = unsafe {
            ffi::ibv_query_port(
                self.inner.context,
                port,
                (&raw mut attr).cast::<ffi::CompatIbvPortAttr>(),
            )
        };
        if rc != 0 {
            return Err(verbs_failed(
                format!("ibv_query_port({}, port {port})", self.name()),
                rc,
            ));
        }
        Ok(PortInfo {
            state: attr.state,
            active_mtu: attr.active_mtu,
            max_msg_sz: attr.max_msg_sz,
            lid: attr.lid,
            link_layer: attr.link_layer,
        })
    }

    /// Reads entry `index` of `port`'s GID table.
    pub(crate) fn query_gid(&self, port: u8, index: u8) -> Result<[u8; 16], KvTransferError> {
        let mut gid = ffi::IbvGid::zeroed();
        // SAFETY: the context is live and `gid` is a writable `union ibv_gid`.
        let rc =
            unsafe { ffi::ibv_query_gid(self.inner.context, port, c_int::from(index), &mut gid) };
        if rc != 0 {
            return Err(verbs_failed(
                format!("ibv_query_gid({}, port {port}, index {index})", self.name()),
                rc,
            ));
        }
        // SAFETY: every bit pattern is a valid `[u8; 16]`.
        Ok(unsafe { gid.raw })
    }

    /// Registers `len` bytes at `addr` for local and remote writes.
    ///
    /// # Safety
    /// `addr..addr + len` must stay valid (and not move) until the returned
    /// region is dropped.
    pub unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
    ) -> Result<MemoryRegion, KvTransferError> {
        // SAFETY: the caller keeps the memory valid; the PD is live.
        let mr = unsafe {
            ffi::ibv_reg_mr(
                self.inner.pd,
                addr.cast(),
                len,
                ffi::IBV_ACCESS_LOCAL_WRITE | ffi::IBV_ACCESS_REMOTE_WRITE,
            )
        };
        if mr.is_null() {
            return Err(rdma_err(format!(
                "ibv_reg_mr of {len} bytes on {}: {}",
                self.name(),
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `mr` is a live `struct ibv_mr` just returned by ibv_reg_mr.
        let (lkey, rkey, addr, len) =
            unsafe { ((*mr).lkey, (*mr).rkey, (*mr).addr as u64, (*mr).length) };
        Ok(MemoryRegion {
            mr,
            lkey,
            rkey,
            addr,
            len,
            _device: Arc::clone(&self.inner),
        })
    }
}

/// # Safety
/// `p` must be null or a NUL-terminated string that lives through the call.
unsafe fn cstr_lossy(p: *const c_char) -> String {
    if p.is_null() {
        return String::from("?");
    }
    // SAFETY: per the contract, `p` is a valid C string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Memory registered for local and remote writes; deregistered when dropped
/// (before its device's PD, which it keeps alive).
#[derive(Debug)]
pub struct MemoryRegion {
    mr: *mut ffi::IbvMr,
    lkey: u32,
    rkey: u32,
    addr: u64,
    len: usize,
    _device: Arc<DeviceInner>,
}

// SAFETY: a registered MR is an immutable handle once created; the copied
// keys are plain data.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// The local key: what [`WriteOp::lkey`] names when this region is the
    /// source of a write.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// The remote key a peer writes with.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The registered base address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// The registered base address (the same as [`MemoryRegion::addr`]).
    pub fn base_addr(&self) -> u64 {
        self.addr
    }

    /// The registered length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is zero bytes long.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: `mr` came from ibv_reg_mr and is deregistered once; its PD
        // is still allocated (`_device` keeps it).
        unsafe { ffi::ibv_dereg_mr(self.mr) };
    }
}

/// Whether this host can run the transport: an RDMA device must open and its
/// port 1 must be ACTIVE. The error says which of the two failed.
pub fn probe() -> Result<(), KvTransferError> {
    let dev = Device::open(None)?;
    let port = dev.query_port(DEFAULT_PORT)?;
    if !port.is_active() {
        return Err(rdma_err(format!(
            "port {DEFAULT_PORT} of {} is not active (state {})",
            dev.name(),
            port_state_name(port.state)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_fails_cleanly_without_a_usable_device() {
        // This host (and CI) has no RDMA hardware: the probe must say so
        // rather than panic or claim success. On a host with a device whose
        // port is down, the reason names the port instead.
        let Err(err) = probe() else {
            eprintln!("an RDMA device with an active port is present; nothing to check");
            return;
        };
        let msg = err.to_string();
        assert!(msg.contains("rdma: "), "{msg}");
        if no_rdma_devices_in_sysfs() {
            assert!(msg.contains("no RDMA device"), "{msg}");
        } else {
            assert!(
                msg.contains("no RDMA device") || msg.contains("is not active"),
                "{msg}"
            );
        }
    }

    /// Whether the kernel lists no RDMA devices at all (no
    /// `/sys/class/infiniband/*`), as on this project's build hosts and CI.
    fn no_rdma_devices_in_sysfs() -> bool {
        std::fs::read_dir("/sys/class/infiniband").map_or(true, |mut d| d.next().is_none())
    }

    #[test]
    fn opening_a_named_device_fails_cleanly_without_one() {
        match Device::open(Some("mlx5_does_not_exist")) {
            Ok(dev) => panic!("opened {}", dev.name()),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("no RDMA device"), "{msg}");
            }
        }
    }

    #[test]
    fn port_states_have_names() {
        assert_eq!(port_state_name(ffi::IBV_PORT_ACTIVE), "ACTIVE");
        assert_eq!(port_state_name(ffi::IBV_PORT_DOWN), "DOWN");
        assert_eq!(port_state_name(99), "unknown");
    }

    #[test]
    fn os_error_prefers_the_returned_code() {
        // 22 is EINVAL on Linux; verbs calls return it rather than -1.
        let text = os_error(22).to_string();
        assert!(text.contains("nvalid argument"), "{text}");
    }
}
