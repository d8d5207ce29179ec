//! One reliable-connection queue pair and its completion queue: setup
//! (RESET → INIT → RTR → RTS), the [`QpInfo`] two sides exchange, and
//! posting `IBV_WR_RDMA_WRITE`s.

use std::ffi::{c_int, c_uint};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::ffi::{self, Zeroed as _};
use super::{DEFAULT_PORT, Device, PortInfo, cstr_lossy, os_error, rdma_err, verbs_failed};
use crate::KvTransferError;

/// Length of [`QpInfo::to_bytes`]: lid (2) + qpn (4) + psn (4) + gid (16).
pub const QP_INFO_LEN: usize = 26;

/// Queue-pair numbers and packet sequence numbers are 24-bit.
const MAX_24_BIT: u32 = 0x00ff_ffff;

/// What one side of a connection tells the other: where its queue pair is
/// (LID for InfiniBand, GID for RoCE or routed InfiniBand), its number, and
/// the first packet sequence number it will send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInfo {
    /// The port's local identifier (0 on RoCE).
    pub lid: u16,
    /// The queue-pair number (24-bit).
    pub qpn: u32,
    /// The initial packet sequence number (24-bit).
    pub psn: u32,
    /// The port's GID at the chosen `sgid_index`; all zero when the sender
    /// uses no global route (InfiniBand within one subnet).
    pub gid: [u8; 16],
}

impl QpInfo {
    /// The fixed little-endian wire form: `lid u16 | qpn u32 | psn u32 |
    /// gid [u8; 16]`, 26 bytes.
    pub fn to_bytes(&self) -> [u8; QP_INFO_LEN] {
        let mut out = [0u8; QP_INFO_LEN];
        out[0..2].copy_from_slice(&self.lid.to_le_bytes());
        out[2..6].copy_from_slice(&self.qpn.to_le_bytes());
        out[6..10].copy_from_slice(&self.psn.to_le_bytes());
        out[10..26].copy_from_slice(&self.gid);
        out
    }

    /// Parses [`QpInfo::to_bytes`]'s form. Refuses any other length, and a
    /// QP number or PSN that does not fit 24 bits.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KvTransferError> {
        let bytes: &[u8; QP_INFO_LEN] = bytes.try_into().map_err(|_| {
            rdma_err(format!(
                "a queue-pair info is {QP_INFO_LEN} bytes, got {}",
                bytes.len()
            ))
        })?;
        let [l0, l1, q0, q1, q2, q3, p0, p1, p2, p3, gid @ ..] = *bytes;
        let info = QpInfo {
            lid: u16::from_le_bytes([l0, l1]),
            qpn: u32::from_le_bytes([q0, q1, q2, q3]),
            psn: u32::from_le_bytes([p0, p1, p2, p3]),
            gid,
        };
        if info.qpn > MAX_24_BIT {
            return Err(rdma_err(format!(
                "queue-pair number {:#x} does not fit 24 bits",
                info.qpn
            )));
        }
        if info.psn > MAX_24_BIT {
            return Err(rdma_err(format!(
                "packet sequence number {:#x} does not fit 24 bits",
                info.psn
            )));
        }
        Ok(info)
    }

    /// Whether a GID was given (any byte non-zero).
    pub fn has_gid(&self) -> bool {
        self.gid != [0; 16]
    }
}

impl fmt::Display for QpInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "lid {:#06x} qpn {:#08x} psn {:#08x} gid {}",
            self.lid,
            self.qpn,
            self.psn,
            std::net::Ipv6Addr::from(self.gid)
        )
    }
}

/// One RDMA WRITE: `len` bytes from local registered memory (`local_addr`,
/// `lkey`) to the peer's registered memory (`remote_addr`, `rkey`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOp {
    pub local_addr: u64,
    pub lkey: u32,
    pub len: u32,
    pub remote_addr: u64,
    pub rkey: u32,
}

/// How a [`Connection`] is set up; `Default` is what the transport uses.
#[derive(Debug, Clone)]
pub struct ConnectionOptions {
    /// The HCA port (verbs ports count from 1). Default 1.
    pub port: u8,
    /// Which entry of the port's GID table to send from (`sgid_index`) and
    /// advertise. Default 0. On RoCE v2 hosts the right index is the one whose
    /// GID type is RoCE v2 for the interface's IP (see `show_gids`).
    pub sgid_index: u8,
    /// Advertise a GID, and so make the peer use a global route, even on an
    /// InfiniBand port (routed fabrics). RoCE ports always do. Default false.
    pub use_gid: bool,
    /// Send-queue depth, and the longest chain of work requests posted at
    /// once. Default 256.
    pub max_send_wr: u32,
    /// How long [`Connection::write`] waits for a chain's completion before
    /// giving up. Default 10 s.
    pub completion_timeout: Duration,
}

impl Default for ConnectionOptions {
    fn default() -> Self {
        Self {
            port: DEFAULT_PORT,
            sgid_index: 0,
            use_gid: false,
            max_send_wr: 256,
            completion_timeout: Duration::from_secs(10),
        }
    }
}

/// `ibv_qp_init_attr.cap` besides the send depth: one SGE per write, and a
/// token receive queue (RDMA WRITE without immediate consumes no receive).
const MAX_SEND_SGE: u32 = 1;
const MAX_RECV_WR: u32 = 1;
const MAX_RECV_SGE: u32 = 1;

/// Completions taken from the CQ per `ibv_poll_cq` call.
const POLL_BATCH: usize = 16;

/// Mutable write-side state, behind the connection's lock (which also keeps
/// two writers from sharing the send queue and stealing each other's
/// completions).
#[derive(Debug)]
struct WriteState {
    next_wr_id: u64,
    /// Set once the queue pair is unusable (error completion, timeout, or a
    /// partly posted chain): every later write fails with it.
    broken: Option<String>,
}

/// A completion queue and a reliable-connection queue pair on one device.
///
/// Made in INIT by [`Connection::new`]; usable for [`Connection::write`]
/// after [`Connection::connect`]. `write` busy-polls the CQ, so call it from
/// a blocking context (`tokio::task::spawn_blocking`), not from an async task.
#[derive(Debug)]
pub struct Connection {
    qp: *mut ffi::IbvQp,
    cq: *mut ffi::IbvCq,
    device: Device,
    options: ConnectionOptions,
    port: PortInfo,
    local: QpInfo,
    remote: Option<QpInfo>,
    state: Mutex<WriteState>,
}

/// The options' port of `device`, checked active, and the GID to use on it
/// (zero where the link is InfiniBand and no GID was asked for).
fn active_port(
    device: &Device,
    options: &ConnectionOptions,
) -> Result<(PortInfo, [u8; 16]), KvTransferError> {
    let port = device.query_port(options.port)?;
    if !port.is_active() {
        return Err(rdma_err(format!(
            "port {} of {} is not active (state {})",
            options.port,
            device.name(),
            super::port_state_name(port.state)
        )));
    }
    let gid = if port.is_ethernet() || options.use_gid {
        device.query_gid(options.port, options.sgid_index)?
    } else {
        [0; 16]
    };
    Ok((port, gid))
}

/// A completion queue on `device` deep enough for the options' send WRs
/// and the receive queue. The caller owns it (`ibv_destroy_cq`).
fn create_cq(
    device: &Device,
    options: &ConnectionOptions,
) -> Result<*mut ffi::IbvCq, KvTransferError> {
    let cqe = c_int::try_from(options.max_send_wr.saturating_add(MAX_RECV_WR))
        .map_err(|_| rdma_err(format!("max_send_wr {} is too large", options.max_send_wr)))?;
    // SAFETY: the context is live; no completion channel, vector 0.
    let cq = unsafe {
        ffi::ibv_create_cq(
            device.inner.context,
            cqe,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        )
    };
    if cq.is_null() {
        return Err(rdma_err(format!(
            "ibv_create_cq({cqe}) on {}: {}",
            device.name(),
            std::io::Error::last_os_error()
        )));
    }
    Ok(cq)
}

/// An RC queue pair on `device`'s PD whose send and receive completions
/// go to `cq`. On failure `cq` is destroyed; on success the caller owns
/// both (`ibv_destroy_qp`, then `ibv_destroy_cq`).
fn create_qp(
    device: &Device,
    cq: *mut ffi::IbvCq,
    options: &ConnectionOptions,
) -> Result<*mut ffi::IbvQp, KvTransferError> {
    let mut init = ffi::IbvQpInitAttr::zeroed();
    init.send_cq = cq;
    init.recv_cq = cq;
    init.cap = ffi::IbvQpCap {
        max_send_wr: options.max_send_wr,
        max_recv_wr: MAX_RECV_WR,
        max_send_sge: MAX_SEND_SGE,
        max_recv_sge: MAX_RECV_SGE,
        max_inline_data: 0,
    };
    init.qp_type = ffi::IBV_QPT_RC;
    init.sq_sig_all = 0;
    // SAFETY: the PD and `cq` are live; `init` is a filled-in
    // `ibv_qp_init_attr` the call may write the granted caps back into.
    let qp = unsafe { ffi::ibv_create_qp(device.inner.pd, &mut init) };
    if qp.is_null() {
        let why = std::io::Error::last_os_error();
        // SAFETY: `cq` was created by `create_cq` and nothing else uses it.
        unsafe { ffi::ibv_destroy_cq(cq) };
        return Err(rdma_err(format!(
            "ibv_create_qp(RC, {} send WRs) on {}: {why}",
            options.max_send_wr,
            device.name()
        )));
    }
    Ok(qp)
}

// SAFETY: verbs QP and CQ handles may be used from any thread (providers
// lock their queues). `connect` takes `&mut self`; `write`, the only other
// user of the handles, holds `state`'s lock throughout, so the send queue and
// the CQ have one user at a time.
unsafe impl Send for Connection {}
// SAFETY: as above.
unsafe impl Sync for Connection {}

impl Connection {
    /// Creates a CQ and an RC queue pair on `device` with the default
    /// [`ConnectionOptions`], moves the QP to INIT, and returns it with the
    /// [`QpInfo`] to send the peer.
    pub fn new(device: &Device) -> Result<(Connection, QpInfo), KvTransferError> {
        Self::with_options(device, ConnectionOptions::default())
    }

    /// [`Connection::new`] with explicit options.
    pub fn with_options(
        device: &Device,
        options: ConnectionOptions,
    ) -> Result<(Connection, QpInfo), KvTransferError> {
        if options.max_send_wr == 0 {
            return Err(rdma_err("max_send_wr must be at least 1"));
        }
        let (port, gid) = active_port(device, &options)?;
        let cq = create_cq(device, &options)?;
        let qp = create_qp(device, cq, &options)?;
        // SAFETY: `qp` is a live `struct ibv_qp` just returned.
        let qpn = unsafe { (*qp).qp_num };

        // From here on `Drop` releases the QP and CQ.
        let conn = Connection {
            qp,
            cq,
            device: device.clone(),
            local: QpInfo {
                lid: port.lid,
                qpn,
                psn: random_psn(),
                gid,
            },
            options,
            port,
            remote: None,
            state: Mutex::new(WriteState {
                next_wr_id: 1,
                broken: None,
            }),
        };
        conn.to_init()?;
        let local = conn.local;
        Ok((conn, local))
    }

    /// Moves the fresh QP to INIT on its port, open to remote writes.
    fn to_init(&self) -> Result<(), KvTransferError> {
        let mut attr = ffi::IbvQpAttr::zeroed();
        attr.qp_state = ffi::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = self.options.port;
        attr.qp_access_flags =
            (ffi::IBV_ACCESS_LOCAL_WRITE | ffi::IBV_ACCESS_REMOTE_WRITE) as c_uint;
        self.modify(
            "INIT",
            &mut attr,
            ffi::IBV_QP_STATE
                | ffi::IBV_QP_PKEY_INDEX
                | ffi::IBV_QP_PORT
                | ffi::IBV_QP_ACCESS_FLAGS,
        )
    }

    /// What this side sends the peer (also returned by `new`).
    pub fn local_info(&self) -> QpInfo {
        self.local
    }

    /// The peer this connection was connected to, if it has been.
    pub fn remote_info(&self) -> Option<QpInfo> {
        self.remote
    }

    /// Connects to the peer described by `remote`: INIT → RTR → RTS.
    ///
    /// The peer must have connected too (reached RTR) before this side
    /// writes: a QP still in INIT drops what arrives, and the writer gives up
    /// after its transport retries (`timeout` 14 ≈ 67 ms, `retry_cnt` 7)
    /// with "transport retry counter exceeded". Have the receiving side send
    /// a ready message on the side channel after its own `connect`.
    pub fn connect(&mut self, remote: &QpInfo) -> Result<(), KvTransferError> {
        if let Some(prev) = self.remote {
            return Err(rdma_err(format!("queue pair already connected to {prev}")));
        }
        if remote.qpn > MAX_24_BIT || remote.psn > MAX_24_BIT {
            return Err(rdma_err(format!(
                "peer queue-pair info out of range: {remote}"
            )));
        }
        if remote.qpn < 2 {
            // QP0/QP1 are the management QPs; no RC QP has those numbers.
            return Err(rdma_err(format!(
                "peer sent queue-pair number {}",
                remote.qpn
            )));
        }
        let global = self.port.is_ethernet() || remote.has_gid();
        if self.port.is_ethernet() && !remote.has_gid() {
            return Err(rdma_err(format!(
                "port {} of {} is RoCE (Ethernet) and the peer sent no GID",
                self.options.port,
                self.device.name()
            )));
        }

        let mut attr = ffi::IbvQpAttr::zeroed();
        attr.qp_state = ffi::IBV_QPS_RTR;
        attr.path_mtu = self.port.active_mtu;
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = 1;
        attr.min_rnr_timer = 12;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = self.options.port;
        if global {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = ffi::IbvGid { raw: remote.gid };
            attr.ah_attr.grh.sgid_index = self.options.sgid_index;
            attr.ah_attr.grh.hop_limit = 64;
            attr.ah_attr.grh.flow_label = 0;
            attr.ah_attr.grh.traffic_class = 0;
        }
        self.modify(
            "RTR",
            &mut attr,
            ffi::IBV_QP_STATE
                | ffi::IBV_QP_AV
                | ffi::IBV_QP_PATH_MTU
                | ffi::IBV_QP_DEST_QPN
                | ffi::IBV_QP_RQ_PSN
                | ffi::IBV_QP_MAX_DEST_RD_ATOMIC
                | ffi::IBV_QP_MIN_RNR_TIMER,
        )?;

        let mut attr = ffi::IbvQpAttr::zeroed();
        attr.qp_state = ffi::IBV_QPS_RTS;
        attr.timeout = 14;
        attr.retry_cnt = 7;
        attr.rnr_retry = 7;
        attr.sq_psn = self.local.psn;
        attr.max_rd_atomic = 1;
        self.modify(
            "RTS",
            &mut attr,
            ffi::IBV_QP_STATE
                | ffi::IBV_QP_TIMEOUT
                | ffi::IBV_QP_RETRY_CNT
                | ffi::IBV_QP_RNR_RETRY
                | ffi::IBV_QP_SQ_PSN
                | ffi::IBV_QP_MAX_QP_RD_ATOMIC,
        )?;
        self.remote = Some(*remote);
        Ok(())
    }

    fn modify(
        &self,
        to: &str,
        attr: &mut ffi::IbvQpAttr,
        mask: c_int,
    ) -> Result<(), KvTransferError> {
        // SAFETY: `qp` is live; `attr` is a zero-initialised `ibv_qp_attr`
        // with the fields `mask` names filled in.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask) };
        if rc != 0 {
            return Err(verbs_failed(
                format!(
                    "ibv_modify_qp(qpn {:#x} on {}) to {to}",
                    self.local.qpn,
                    self.device.name()
                ),
                rc,
            ));
        }
        Ok(())
    }

    /// Posts `ops` as `IBV_WR_RDMA_WRITE`s, in chains of at most the send
    /// queue depth with only each chain's last request signalled, and waits
    /// for each chain's completion (busy-polling, at most
    /// `completion_timeout` per chain). Zero-length ops are skipped.
    ///
    /// A failed completion, a timeout or a partly posted chain leaves the
    /// queue pair unusable: the error says why, and so does every later call.
    pub fn write(&self, ops: &[WriteOp]) -> Result<(), KvTransferError> {
        let mut state = self.state.lock();
        if let Some(why) = &state.broken {
            return Err(rdma_err(format!(
                "connection unusable after an earlier failure ({why}); reconnect"
            )));
        }
        if self.remote.is_none() {
            return Err(rdma_err("write on a queue pair that is not connected"));
        }
        let ops: Vec<WriteOp> = ops.iter().copied().filter(|op| op.len > 0).collect();
        let limit = self.port.max_msg_sz;
        if let Some(op) = ops.iter().find(|op| limit != 0 && op.len > limit) {
            return Err(rdma_err(format!(
                "a write of {} bytes exceeds the port's {}-byte message limit",
                op.len, self.port.max_msg_sz
            )));
        }
        let depth = usize::try_from(self.options.max_send_wr).unwrap_or(usize::MAX);
        for chain in ops.chunks(depth) {
            if let Err(e) = self.write_chain(&mut state, chain) {
                if let ChainError::Fatal(why) = &e {
                    state.broken = Some(why.clone());
                }
                return Err(rdma_err(e.message()));
            }
        }
        Ok(())
    }

    /// Posts one chain (at most the send depth, non-empty) and waits for
    /// its signalled last request.
    fn write_chain(&self, state: &mut WriteState, ops: &[WriteOp]) -> Result<(), ChainError> {
        let first = state.next_wr_id;
        state.next_wr_id = first.wrapping_add(ops.len() as u64);
        let mut chain = Chain::new(ops, first);
        let n = ops.len();

        let head = chain.head();
        let mut bad: *mut ffi::IbvSendWr = std::ptr::null_mut();
        // SAFETY: `qp` is live and connected; `head` starts a well-formed,
        // null-terminated chain of `n` requests whose SGEs live in `chain`,
        // alive across the call (providers copy requests into the send queue
        // before returning, so nothing needs them afterwards).
        let rc = unsafe { post_send(self.qp, head, &mut bad) };
        if rc != 0 {
            let why = format!("ibv_post_send of {n} writes: {}", os_error(rc));
            // Nothing was queued if the first request was refused; otherwise
            // unsignalled requests sit in the send queue with no completion
            // to wait for, and the queue pair cannot be trusted again.
            return Err(if bad.is_null() || bad == head {
                ChainError::Refused(why)
            } else {
                ChainError::Fatal(why)
            });
        }
        let signalled = chain.last_wr_id();
        drop(chain);
        self.wait_for(signalled)
    }

    /// Polls the CQ until the request `wr_id` completes, any request fails,
    /// or the timeout passes.
    fn wait_for(&self, wr_id: u64) -> Result<(), ChainError> {
        let deadline = Instant::now() + self.options.completion_timeout;
        let mut wcs = [ffi::IbvWc::zeroed(); POLL_BATCH];
        let mut idle: u32 = 0;
        loop {
            // SAFETY: `cq` is live; `wcs` has room for POLL_BATCH entries.
            let n = unsafe { poll_cq(self.cq, POLL_BATCH as c_int, wcs.as_mut_ptr()) };
            let n = usize::try_from(n)
                .map_err(|_| ChainError::Fatal(format!("ibv_poll_cq failed ({n})")))?;
            let mut done = false;
            for wc in &wcs[..n.min(POLL_BATCH)] {
                if wc.status != ffi::IBV_WC_SUCCESS {
                    return Err(ChainError::Fatal(format!(
                        "RDMA write completion failed: {} (status {}, vendor error {:#x}, wr {})",
                        wc_status_str(wc.status),
                        wc.status,
                        wc.vendor_err,
                        wc.wr_id
                    )));
                }
                done |= wc.wr_id == wr_id;
            }
            if done {
                return Ok(());
            }
            if n == 0 {
                idle = idle.wrapping_add(1);
                if idle.is_multiple_of(1024) {
                    if Instant::now() >= deadline {
                        return Err(ChainError::Fatal(format!(
                            "no completion for RDMA write chain within {:?}",
                            self.options.completion_timeout
                        )));
                    }
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // SAFETY: both handles are live and released once, the QP before the
        // CQ it completes into; the device (PD, context) outlives both via
        // `self.device`, dropped after this body.
        unsafe {
            ffi::ibv_destroy_qp(self.qp);
            ffi::ibv_destroy_cq(self.cq);
        }
    }
}

/// One chain of RDMA WRITE requests ready for `ibv_post_send`: each request
/// points at its SGE and at the next request, and only the last is
/// signalled. Both vectors are filled within their initial capacity and never
/// touched again, so the pointers stay valid wherever the `Chain` moves.
struct Chain {
    /// Only referenced through the requests' `sg_list` pointers.
    _sges: Vec<ffi::IbvSge>,
    wrs: Vec<ffi::IbvSendWr>,
}

impl Chain {
    /// Requests for `ops` (non-empty), numbered from `first_wr_id`.
    fn new(ops: &[WriteOp], first_wr_id: u64) -> Chain {
        let n = ops.len();
        let mut sges: Vec<ffi::IbvSge> = Vec::with_capacity(n);
        let mut wrs: Vec<ffi::IbvSendWr> = Vec::with_capacity(n);
        let sge_base = sges.as_mut_ptr();
        let wr_base = wrs.as_mut_ptr();
        for (i, op) in ops.iter().enumerate() {
            sges.push(ffi::IbvSge {
                addr: op.local_addr,
                length: op.len,
                lkey: op.lkey,
            });
            let last = i + 1 == n;
            let mut wr = ffi::IbvSendWr::zeroed();
            wr.wr_id = first_wr_id.wrapping_add(i as u64);
            wr.next = if last {
                std::ptr::null_mut()
            } else {
                wr_base.wrapping_add(i + 1)
            };
            wr.sg_list = sge_base.wrapping_add(i);
            wr.num_sge = 1;
            wr.opcode = ffi::IBV_WR_RDMA_WRITE;
            wr.send_flags = if last { ffi::IBV_SEND_SIGNALED } else { 0 };
            wr.wr.rdma = ffi::SendWrRdma {
                remote_addr: op.remote_addr,
                rkey: op.rkey,
            };
            wrs.push(wr);
        }
        Chain { _sges: sges, wrs }
    }

    fn head(&mut self) -> *mut ffi::IbvSendWr {
        self.wrs.as_mut_ptr()
    }

    fn last_wr_id(&self) -> u64 {
        self.wrs.last().map_or(0, |wr| wr.wr_id)
    }
}

/// Why a chain failed: `Refused` leaves the queue pair usable (nothing was
/// posted); `Fatal` does not.
#[derive(Debug)]
enum ChainError {
    Refused(String),
    Fatal(String),
}

impl ChainError {
    fn message(self) -> String {
        match self {
            ChainError::Refused(m) | ChainError::Fatal(m) => m,
        }
    }
}

/// verbs.h's `static inline ibv_post_send`: `qp->context->ops.post_send`.
///
/// # Safety
/// `qp` must be a live queue pair and `wr` a valid chain of send requests.
unsafe fn post_send(
    qp: *mut ffi::IbvQp,
    wr: *mut ffi::IbvSendWr,
    bad: *mut *mut ffi::IbvSendWr,
) -> c_int {
    // SAFETY: per the contract `qp` is live, so is its context; the ops table
    // is filled in by the provider when the context is opened.
    let f = unsafe { (*(*qp).context).ops.post_send };
    match f {
        // SAFETY: the provider's own post_send, called as verbs.h does.
        Some(f) => unsafe { f(qp, wr, bad) },
        None => EOPNOTSUPP,
    }
}

/// verbs.h's `static inline ibv_poll_cq`: `cq->context->ops.poll_cq`.
///
/// # Safety
/// `cq` must be a live completion queue and `wc` point at `n` writable
/// entries.
unsafe fn poll_cq(cq: *mut ffi::IbvCq, n: c_int, wc: *mut ffi::IbvWc) -> c_int {
    // SAFETY: per the contract `cq` is live, so is its context.
    let f = unsafe { (*(*cq).context).ops.poll_cq };
    match f {
        // SAFETY: the provider's own poll_cq, called as verbs.h does.
        Some(f) => unsafe { f(cq, n, wc) },
        None => -1,
    }
}

/// `EOPNOTSUPP` on Linux, for a provider without a `post_send`.
const EOPNOTSUPP: c_int = 95;

/// `ibv_wc_status_str`: the library's name for a completion status.
fn wc_status_str(status: c_uint) -> String {
    // SAFETY: ibv_wc_status_str accepts any value (unknown ones map to
    // "unknown") and returns a static NUL-terminated string.
    unsafe { cstr_lossy(ffi::ibv_wc_status_str(status)) }
}

/// A random 24-bit initial packet sequence number, from std's per-process
/// random hasher keys mixed with the clock (no RNG crate needed; PSNs only
/// need to differ between successive connections).
fn random_psn() -> u32 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(d.as_nanos());
    }
    (h.finish() as u32) & MAX_24_BIT
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> QpInfo {
        QpInfo {
            lid: 0x1234,
            qpn: 0x00ab_cdef,
            psn: 0x0012_3456,
            gid: [
                0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x11, 0x22, 0xff, 0xfe, 0x33, 0x44, 0x55,
            ],
        }
    }

    #[test]
    fn qp_info_round_trips_in_a_fixed_little_endian_form() {
        let info = sample();
        let bytes = info.to_bytes();
        assert_eq!(bytes.len(), QP_INFO_LEN);
        assert_eq!(&bytes[0..2], &[0x34, 0x12]);
        assert_eq!(&bytes[2..6], &[0xef, 0xcd, 0xab, 0x00]);
        assert_eq!(&bytes[6..10], &[0x56, 0x34, 0x12, 0x00]);
        assert_eq!(&bytes[10..26], &info.gid);
        assert_eq!(QpInfo::from_bytes(&bytes).expect("valid"), info);

        let no_gid = QpInfo {
            gid: [0; 16],
            ..info
        };
        assert!(!no_gid.has_gid());
        assert!(info.has_gid());
        assert_eq!(
            QpInfo::from_bytes(&no_gid.to_bytes()).expect("valid"),
            no_gid
        );
    }

    #[test]
    fn qp_info_refuses_wrong_lengths() {
        let bytes = sample().to_bytes();
        for len in [0, 1, 25, 27, 30] {
            let mut v = bytes.to_vec();
            v.resize(len, 0);
            let msg = QpInfo::from_bytes(&v)
                .expect_err("wrong length")
                .to_string();
            assert!(msg.contains("26 bytes"), "{msg}");
            assert!(msg.contains(&format!("got {len}")), "{msg}");
        }
    }

    #[test]
    fn qp_info_refuses_numbers_wider_than_24_bits() {
        let mut bytes = sample().to_bytes();
        bytes[5] = 1; // qpn's top byte
        let msg = QpInfo::from_bytes(&bytes).expect_err("qpn").to_string();
        assert!(msg.contains("queue-pair number"), "{msg}");

        let mut bytes = sample().to_bytes();
        bytes[9] = 0x80; // psn's top byte
        let msg = QpInfo::from_bytes(&bytes).expect_err("psn").to_string();
        assert!(msg.contains("packet sequence number"), "{msg}");
    }

    #[test]
    fn qp_info_displays_the_gid_as_an_address() {
        let text = sample().to_string();
        assert!(text.contains("qpn 0xabcdef"), "{text}");
        assert!(text.contains("fe80::211:22ff:fe33:4455"), "{text}");
    }

    #[test]
    fn psns_are_24_bit() {
        for _ in 0..64 {
            assert!(random_psn() <= MAX_24_BIT);
        }
    }

    #[test]
    fn completion_statuses_are_named_by_libibverbs() {
        assert_eq!(wc_status_str(ffi::IBV_WC_SUCCESS), "success");
        // IBV_WC_REM_ACCESS_ERR = 10: what a wrong rkey produces.
        assert_eq!(wc_status_str(10), "remote access error");
        assert_eq!(wc_status_str(12), "transport retry counter exceeded");
    }

    #[test]
    fn default_options_are_the_documented_ones() {
        let o = ConnectionOptions::default();
        assert_eq!(o.port, 1);
        assert_eq!(o.sgid_index, 0);
        assert!(!o.use_gid);
        assert_eq!(o.max_send_wr, 256);
        assert_eq!(o.completion_timeout, Duration::from_secs(10));
    }
}

/// `Connection::write` against a fake provider: an `ibv_context` whose
/// `ops.post_send`/`ops.poll_cq` are Rust functions, so the dispatch, the
/// chaining, the signalling and the error paths run without hardware.
#[cfg(test)]
mod fake_provider_tests {
    use std::cell::RefCell;
    use std::collections::VecDeque;
    use std::mem::ManuallyDrop;
    use std::sync::Arc;

    use super::*;
    use crate::rdma::DeviceInner;

    /// What the fake saw of one posted request.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Posted {
        wr_id: u64,
        signalled: bool,
        opcode: c_uint,
        num_sge: c_int,
        sge: (u64, u32, u32),
        rdma: (u64, u32),
    }

    #[derive(Default)]
    struct FakeState {
        /// One entry per `post_send` call: the chain it was given.
        chains: Vec<Vec<Posted>>,
        cq: VecDeque<ffi::IbvWc>,
        /// Complete this wr_id (and everything after it) with this status.
        fail: Option<(u64, c_uint)>,
        /// Make `post_send` refuse the whole chain with this errno.
        refuse: Option<c_int>,
        /// Post, but never complete anything.
        silent: bool,
    }

    thread_local! {
        static FAKE: RefCell<FakeState> = RefCell::new(FakeState::default());
    }

    unsafe extern "C" fn fake_post_send(
        _qp: *mut ffi::IbvQp,
        mut wr: *mut ffi::IbvSendWr,
        bad: *mut *mut ffi::IbvSendWr,
    ) -> c_int {
        FAKE.with_borrow_mut(|f| {
            if let Some(errno) = f.refuse {
                // SAFETY: `bad` is the caller's out-pointer.
                unsafe { *bad = wr };
                return errno;
            }
            let mut chain = Vec::new();
            while !wr.is_null() {
                // SAFETY: `wr` walks the caller's null-terminated chain.
                let w = unsafe { &*wr };
                // SAFETY: every request in the chain has one valid SGE.
                let sge = unsafe { *w.sg_list };
                // SAFETY: RDMA WRITE requests use the `rdma` member.
                let rdma = unsafe { w.wr.rdma };
                let posted = Posted {
                    wr_id: w.wr_id,
                    signalled: w.send_flags & ffi::IBV_SEND_SIGNALED != 0,
                    opcode: w.opcode,
                    num_sge: w.num_sge,
                    sge: (sge.addr, sge.length, sge.lkey),
                    rdma: (rdma.remote_addr, rdma.rkey),
                };
                let failing = f.fail.filter(|(id, _)| posted.wr_id >= *id);
                if !f.silent && (posted.signalled || failing.is_some()) {
                    let mut wc = ffi::IbvWc::zeroed();
                    wc.wr_id = posted.wr_id;
                    wc.status = failing.map_or(ffi::IBV_WC_SUCCESS, |(_, st)| st);
                    wc.byte_len = sge.length;
                    f.cq.push_back(wc);
                }
                chain.push(posted);
                wr = w.next;
            }
            f.chains.push(chain);
            0
        })
    }

    unsafe extern "C" fn fake_poll_cq(
        _cq: *mut ffi::IbvCq,
        n: c_int,
        wc: *mut ffi::IbvWc,
    ) -> c_int {
        FAKE.with_borrow_mut(|f| {
            let mut got = 0;
            while got < n {
                let Some(next) = f.cq.pop_front() else { break };
                // SAFETY: the caller's array has room for `n` entries.
                unsafe { *wc.add(got as usize) = next };
                got += 1;
            }
            got
        })
    }

    /// A connected `Connection` over the fake ops. Its boxes must outlive
    /// it; it is never dropped (its `Drop` would call into libibverbs).
    struct Fake {
        conn: ManuallyDrop<Connection>,
        _ctx: Box<ffi::IbvContext>,
        _qp: Box<ffi::IbvQp>,
        _cq: Box<ffi::IbvCq>,
    }

    fn fake(max_send_wr: u32, timeout: Duration, connected: bool) -> Fake {
        FAKE.with_borrow_mut(|f| *f = FakeState::default());
        let mut ctx = Box::new(ffi::IbvContext::zeroed());
        ctx.ops.post_send = Some(fake_post_send);
        ctx.ops.poll_cq = Some(fake_poll_cq);
        let mut qp = Box::new(ffi::IbvQp::zeroed());
        qp.context = &mut *ctx;
        let mut cq = Box::new(ffi::IbvCq::zeroed());
        cq.context = &mut *ctx;
        let local = QpInfo {
            lid: 1,
            qpn: 0x100,
            psn: 7,
            gid: [0; 16],
        };
        let conn = Connection {
            qp: &mut *qp,
            cq: &mut *cq,
            device: Device {
                inner: Arc::new(DeviceInner {
                    name: "fake0".into(),
                    context: std::ptr::null_mut(),
                    pd: std::ptr::null_mut(),
                }),
            },
            options: ConnectionOptions {
                max_send_wr,
                completion_timeout: timeout,
                ..ConnectionOptions::default()
            },
            port: PortInfo {
                state: ffi::IBV_PORT_ACTIVE,
                active_mtu: 5,
                max_msg_sz: 1 << 30,
                lid: 1,
                link_layer: ffi::IBV_LINK_LAYER_INFINIBAND,
            },
            local,
            remote: connected.then_some(QpInfo {
                qpn: 0x200,
                ..local
            }),
            state: Mutex::new(WriteState {
                next_wr_id: 1,
                broken: None,
            }),
        };
        Fake {
            conn: ManuallyDrop::new(conn),
            _ctx: ctx,
            _qp: qp,
            _cq: cq,
        }
    }

    fn op(i: u32, len: u32) -> WriteOp {
        WriteOp {
            local_addr: 0x1000 + u64::from(i) * 0x100,
            lkey: 0x11,
            len,
            remote_addr: 0x9000_0000 + u64::from(i) * 0x100,
            rkey: 0x22,
        }
    }

    fn posted_chains() -> Vec<Vec<Posted>> {
        FAKE.with_borrow(|f| f.chains.clone())
    }

    #[test]
    fn writes_go_out_in_chains_of_the_queue_depth_with_only_the_last_signalled() {
        let f = fake(4, Duration::from_secs(1), true);
        let mut ops: Vec<WriteOp> = (0..10).map(|i| op(i, 64 + i)).collect();
        ops.insert(3, op(99, 0)); // zero-length: skipped, writes nothing
        f.conn.write(&ops).expect("write");

        let chains = posted_chains();
        assert_eq!(
            chains.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![4, 4, 2]
        );
        let all: Vec<Posted> = chains.iter().flatten().copied().collect();
        for (i, p) in all.iter().enumerate() {
            let i = i as u32;
            assert_eq!(p.opcode, ffi::IBV_WR_RDMA_WRITE);
            assert_eq!(p.num_sge, 1);
            assert_eq!(p.sge, (0x1000 + u64::from(i) * 0x100, 64 + i, 0x11));
            assert_eq!(p.rdma, (0x9000_0000 + u64::from(i) * 0x100, 0x22));
            assert_eq!(p.wr_id, u64::from(i) + 1, "unique, consecutive ids");
        }
        for chain in &chains {
            let (last, rest) = chain.split_last().expect("non-empty");
            assert!(last.signalled);
            assert!(rest.iter().all(|p| !p.signalled));
        }
        // Every chain's completion was consumed.
        assert!(FAKE.with_borrow(|f| f.cq.is_empty()));

        // The connection stays usable and keeps numbering.
        f.conn.write(&[op(0, 8)]).expect("second write");
        assert_eq!(posted_chains().last().expect("posted")[0].wr_id, 11);
        f.conn.write(&[]).expect("nothing to write");
        assert_eq!(posted_chains().len(), 4);
    }

    #[test]
    fn a_failed_completion_is_named_and_poisons_the_connection() {
        let f = fake(4, Duration::from_secs(1), true);
        FAKE.with_borrow_mut(|s| s.fail = Some((6, 10))); // IBV_WC_REM_ACCESS_ERR
        let ops: Vec<WriteOp> = (0..8).map(|i| op(i, 16)).collect();
        let msg = f.conn.write(&ops).expect_err("bad rkey").to_string();
        assert!(msg.contains("remote access error"), "{msg}");
        assert!(msg.contains("status 10"), "{msg}");

        let msg = f.conn.write(&ops[..1]).expect_err("unusable").to_string();
        assert!(msg.contains("unusable"), "{msg}");
        assert!(msg.contains("remote access error"), "{msg}");
    }

    #[test]
    fn a_missing_completion_times_out_instead_of_hanging() {
        let f = fake(4, Duration::from_millis(50), true);
        FAKE.with_borrow_mut(|s| s.silent = true);
        let started = Instant::now();
        let msg = f.conn.write(&[op(0, 16)]).expect_err("timeout").to_string();
        assert!(msg.contains("no completion"), "{msg}");
        assert!(started.elapsed() < Duration::from_secs(5));
        let msg = f
            .conn
            .write(&[op(0, 16)])
            .expect_err("unusable")
            .to_string();
        assert!(msg.contains("unusable"), "{msg}");
    }

    #[test]
    fn a_refused_post_is_reported_and_leaves_the_connection_usable() {
        let f = fake(4, Duration::from_secs(1), true);
        FAKE.with_borrow_mut(|s| s.refuse = Some(12)); // ENOMEM
        let msg = f.conn.write(&[op(0, 16)]).expect_err("refused").to_string();
        assert!(msg.contains("ibv_post_send"), "{msg}");
        assert!(msg.contains("memory"), "{msg}");
        FAKE.with_borrow_mut(|s| s.refuse = None);
        f.conn
            .write(&[op(0, 16)])
            .expect("nothing was queued, so it still works");
    }

    #[test]
    fn connect_refuses_bad_peers_before_touching_the_queue_pair() {
        // Each of these returns before any ibv_modify_qp call.
        let mut f = fake(4, Duration::from_secs(1), true);
        let peer = QpInfo {
            lid: 2,
            qpn: 0x300,
            psn: 1,
            gid: [0; 16],
        };
        let msg = f.conn.connect(&peer).expect_err("twice").to_string();
        assert!(msg.contains("already connected"), "{msg}");

        let mut f = fake(4, Duration::from_secs(1), false);
        for qpn in [0, 1, 0x0100_0000] {
            let msg = f
                .conn
                .connect(&QpInfo { qpn, ..peer })
                .expect_err("bad qpn")
                .to_string();
            assert!(msg.contains("queue-pair"), "{qpn}: {msg}");
        }

        f.conn.port.link_layer = ffi::IBV_LINK_LAYER_ETHERNET;
        let msg = f.conn.connect(&peer).expect_err("no gid").to_string();
        assert!(msg.contains("RoCE"), "{msg}");
        assert!(msg.contains("no GID"), "{msg}");
        assert!(f.conn.remote_info().is_none());
    }

    #[test]
    fn writes_need_a_connected_queue_pair_and_fitting_sizes() {
        let f = fake(4, Duration::from_secs(1), false);
        let msg = f
            .conn
            .write(&[op(0, 16)])
            .expect_err("not connected")
            .to_string();
        assert!(msg.contains("not connected"), "{msg}");

        let f = fake(4, Duration::from_secs(1), true);
        let msg = f
            .conn
            .write(&[op(0, (1 << 30) + 1)])
            .expect_err("too long")
            .to_string();
        assert!(msg.contains("message limit"), "{msg}");
        assert!(posted_chains().is_empty());
    }
}
