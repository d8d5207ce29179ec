//! Hand-written ibverbs declarations: the `#[repr(C)]` mirrors of the
//! `verbs.h` structs this transport touches, its constants, and the exported
//! `libibverbs.so.1` symbols it links.
//!
//! Ground truth is `/usr/include/infiniband/verbs.h` (rdma-core 44). Field
//! order, types and unions below are copied from it one for one; the sizes and
//! offsets asserted in the tests at the bottom were printed by a C program
//! compiled against that header (`sizeof`/`offsetof`, x86_64 glibc).
//!
//! Two things verbs.h hides behind `static inline` and that have no exported
//! symbol: `ibv_post_send` and `ibv_poll_cq`. Both are one indirect call
//! through `struct ibv_context_ops` (`qp->context->ops.post_send`,
//! `cq->context->ops.poll_cq`), which is why `IbvContext`, `IbvContextOps`,
//! `IbvQp` and `IbvCq` are declared in full rather than as opaque handles.
//!
//! `ibv_query_port` is a macro (`___ibv_query_port`) in verbs.h. The symbol
//! this links is the exported `ibv_query_port@@IBVERBS_1.1`, which takes a
//! `struct _compat_ibv_port_attr *`: the leading part of `struct
//! ibv_port_attr` up to `link_layer`/`flags`. The header's own fallback path
//! does exactly what `Device::query_port` does: zero a full
//! `ibv_port_attr` and hand it to that symbol. libibverbs (`__lib_query_port`)
//! queries into a full temporary and copies back the compat size, 48 bytes,
//! leaving `port_cap_flags2` zero; everything this transport reads
//! (`state`, `active_mtu`, `max_msg_sz`, `lid`, `link_layer`) lies in those.

// These structs mirror C layouts field for field; most fields are never read
// from Rust but must be there for the offsets of the ones that are.
#![allow(dead_code)]

use std::ffi::{c_char, c_int, c_uint, c_void};

// ---------------------------------------------------------------- opaque ---

/// Declares `#[repr(C)]` types only ever handled through pointers.
macro_rules! opaque {
    ($($name:ident),* $(,)?) => {$(
        #[repr(C)]
        pub(super) struct $name {
            _opaque: [u8; 0],
        }
    )*};
}

opaque!(
    IbvDevice,
    IbvDeviceAttr,
    CompatIbvPortAttr,
    IbvCompChannel,
    IbvSrq,
    IbvMw,
    IbvMwBind,
    IbvRecvWr,
    IbvAh,
);

// ------------------------------------------------------------- pthreads ---

/// `pthread_mutex_t` / `pthread_cond_t` as glibc (and musl) lay them out on
/// the 64-bit targets RDMA hosts run. Only their size and alignment matter:
/// they sit inside `ibv_context`, `ibv_qp` and `ibv_cq` before fields this
/// code never reads, but the mirrors should be whole.
#[cfg(target_arch = "x86_64")]
const PTHREAD_MUTEX_WORDS: usize = 5; // 40 bytes
#[cfg(target_arch = "aarch64")]
const PTHREAD_MUTEX_WORDS: usize = 6; // 48 bytes
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
compile_error!(
    "rdma: pthread_mutex_t size unknown for this target; add it to services/kv-transfer/src/rdma/ffi.rs"
);

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct PthreadMutex {
    _opaque: [u64; PTHREAD_MUTEX_WORDS],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct PthreadCond {
    _opaque: [u64; 6], // 48 bytes on every 64-bit glibc target
}

// --------------------------------------------------------------- context ---

/// Slots of `struct ibv_context_ops` that are `void *(*_compat_xxx)(void)`.
type CompatFn = Option<unsafe extern "C" fn() -> *mut c_void>;

/// `struct ibv_context_ops`: every member, in order, as in verbs.h.
#[repr(C)]
pub(super) struct IbvContextOps {
    pub(super) _compat_query_device:
        Option<unsafe extern "C" fn(*mut IbvContext, *mut IbvDeviceAttr) -> c_int>,
    pub(super) _compat_query_port:
        Option<unsafe extern "C" fn(*mut IbvContext, u8, *mut CompatIbvPortAttr) -> c_int>,
    pub(super) _compat_alloc_pd: CompatFn,
    pub(super) _compat_dealloc_pd: CompatFn,
    pub(super) _compat_reg_mr: CompatFn,
    pub(super) _compat_rereg_mr: CompatFn,
    pub(super) _compat_dereg_mr: CompatFn,
    pub(super) alloc_mw: Option<unsafe extern "C" fn(*mut IbvPd, c_int) -> *mut IbvMw>,
    pub(super) bind_mw:
        Option<unsafe extern "C" fn(*mut IbvQp, *mut IbvMw, *mut IbvMwBind) -> c_int>,
    pub(super) dealloc_mw: Option<unsafe extern "C" fn(*mut IbvMw) -> c_int>,
    pub(super) _compat_create_cq: CompatFn,
    pub(super) poll_cq: Option<unsafe extern "C" fn(*mut IbvCq, c_int, *mut IbvWc) -> c_int>,
    pub(super) req_notify_cq: Option<unsafe extern "C" fn(*mut IbvCq, c_int) -> c_int>,
    pub(super) _compat_cq_event: CompatFn,
    pub(super) _compat_resize_cq: CompatFn,
    pub(super) _compat_destroy_cq: CompatFn,
    pub(super) _compat_create_srq: CompatFn,
    pub(super) _compat_modify_srq: CompatFn,
    pub(super) _compat_query_srq: CompatFn,
    pub(super) _compat_destroy_srq: CompatFn,
    pub(super) post_srq_recv:
        Option<unsafe extern "C" fn(*mut IbvSrq, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int>,
    pub(super) _compat_create_qp: CompatFn,
    pub(super) _compat_query_qp: CompatFn,
    pub(super) _compat_modify_qp: CompatFn,
    pub(super) _compat_destroy_qp: CompatFn,
    pub(super) post_send:
        Option<unsafe extern "C" fn(*mut IbvQp, *mut IbvSendWr, *mut *mut IbvSendWr) -> c_int>,
    pub(super) post_recv:
        Option<unsafe extern "C" fn(*mut IbvQp, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int>,
    pub(super) _compat_create_ah: CompatFn,
    pub(super) _compat_destroy_ah: CompatFn,
    pub(super) _compat_attach_mcast: CompatFn,
    pub(super) _compat_detach_mcast: CompatFn,
    pub(super) _compat_async_event: CompatFn,
}

/// `struct ibv_context`.
#[repr(C)]
pub(super) struct IbvContext {
    pub(super) device: *mut IbvDevice,
    pub(super) ops: IbvContextOps,
    pub(super) cmd_fd: c_int,
    pub(super) async_fd: c_int,
    pub(super) num_comp_vectors: c_int,
    pub(super) mutex: PthreadMutex,
    pub(super) abi_compat: *mut c_void,
}

/// `struct ibv_pd`.
#[repr(C)]
pub(super) struct IbvPd {
    pub(super) context: *mut IbvContext,
    pub(super) handle: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
pub(super) struct IbvMr {
    pub(super) context: *mut IbvContext,
    pub(super) pd: *mut IbvPd,
    pub(super) addr: *mut c_void,
    pub(super) length: usize,
    pub(super) handle: u32,
    pub(super) lkey: u32,
    pub(super) rkey: u32,
}

// ------------------------------------------------------------- port, gid ---

/// `union ibv_gid` (`raw[16]` or two big-endian u64; hence 8-byte aligned).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) union IbvGid {
    pub(super) raw: [u8; 16],
    pub(super) global: IbvGidGlobal,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct IbvGidGlobal {
    pub(super) subnet_prefix: u64, // __be64
    pub(super) interface_id: u64,  // __be64
}

/// `struct ibv_port_attr` (the current, non-compat one).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct IbvPortAttr {
    pub(super) state: c_uint,      // enum ibv_port_state
    pub(super) max_mtu: c_uint,    // enum ibv_mtu
    pub(super) active_mtu: c_uint, // enum ibv_mtu
    pub(super) gid_tbl_len: c_int,
    pub(super) port_cap_flags: u32,
    pub(super) max_msg_sz: u32,
    pub(super) bad_pkey_cntr: u32,
    pub(super) qkey_viol_cntr: u32,
    pub(super) pkey_tbl_len: u16,
    pub(super) lid: u16,
    pub(super) sm_lid: u16,
    pub(super) lmc: u8,
    pub(super) max_vl_num: u8,
    pub(super) sm_sl: u8,
    pub(super) subnet_timeout: u8,
    pub(super) init_type_reply: u8,
    pub(super) active_width: u8,
    pub(super) active_speed: u8,
    pub(super) phys_state: u8,
    pub(super) link_layer: u8,
    pub(super) flags: u8,
    pub(super) port_cap_flags2: u16,
}

// ------------------------------------------------------------------ CQ/QP ---

/// `struct ibv_cq`.
#[repr(C)]
pub(super) struct IbvCq {
    pub(super) context: *mut IbvContext,
    pub(super) channel: *mut IbvCompChannel,
    pub(super) cq_context: *mut c_void,
    pub(super) handle: u32,
    pub(super) cqe: c_int,
    pub(super) mutex: PthreadMutex,
    pub(super) cond: PthreadCond,
    pub(super) comp_events_completed: u32,
    pub(super) async_events_completed: u32,
}

/// `struct ibv_qp`.
#[repr(C)]
pub(super) struct IbvQp {
    pub(super) context: *mut IbvContext,
    pub(super) qp_context: *mut c_void,
    pub(super) pd: *mut IbvPd,
    pub(super) send_cq: *mut IbvCq,
    pub(super) recv_cq: *mut IbvCq,
    pub(super) srq: *mut IbvSrq,
    pub(super) handle: u32,
    pub(super) qp_num: u32,
    pub(super) state: c_uint,   // enum ibv_qp_state
    pub(super) qp_type: c_uint, // enum ibv_qp_type
    pub(super) mutex: PthreadMutex,
    pub(super) cond: PthreadCond,
    pub(super) events_completed: u32,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct IbvQpCap {
    pub(super) max_send_wr: u32,
    pub(super) max_recv_wr: u32,
    pub(super) max_send_sge: u32,
    pub(super) max_recv_sge: u32,
    pub(super) max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub(super) struct IbvQpInitAttr {
    pub(super) qp_context: *mut c_void,
    pub(super) send_cq: *mut IbvCq,
    pub(super) recv_cq: *mut IbvCq,
    pub(super) srq: *mut IbvSrq,
    pub(super) cap: IbvQpCap,
    pub(super) qp_type: c_uint, // enum ibv_qp_type
    pub(super) sq_sig_all: c_int,
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct IbvGlobalRoute {
    pub(super) dgid: IbvGid,
    pub(super) flow_label: u32,
    pub(super) sgid_index: u8,
    pub(super) hop_limit: u8,
    pub(super) traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct IbvAhAttr {
    pub(super) grh: IbvGlobalRoute,
    pub(super) dlid: u16,
    pub(super) sl: u8,
    pub(super) src_path_bits: u8,
    pub(super) static_rate: u8,
    pub(super) is_global: u8,
    pub(super) port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct IbvQpAttr {
    pub(super) qp_state: c_uint,       // enum ibv_qp_state
    pub(super) cur_qp_state: c_uint,   // enum ibv_qp_state
    pub(super) path_mtu: c_uint,       // enum ibv_mtu
    pub(super) path_mig_state: c_uint, // enum ibv_mig_state
    pub(super) qkey: u32,
    pub(super) rq_psn: u32,
    pub(super) sq_psn: u32,
    pub(super) dest_qp_num: u32,
    pub(super) qp_access_flags: c_uint,
    pub(super) cap: IbvQpCap,
    pub(super) ah_attr: IbvAhAttr,
    pub(super) alt_ah_attr: IbvAhAttr,
    pub(super) pkey_index: u16,
    pub(super) alt_pkey_index: u16,
    pub(super) en_sqd_async_notify: u8,
    pub(super) sq_draining: u8,
    pub(super) max_rd_atomic: u8,
    pub(super) max_dest_rd_atomic: u8,
    pub(super) min_rnr_timer: u8,
    pub(super) port_num: u8,
    pub(super) timeout: u8,
    pub(super) retry_cnt: u8,
    pub(super) rnr_retry: u8,
    pub(super) alt_port_num: u8,
    pub(super) alt_timeout: u8,
    pub(super) rate_limit: u32,
}

// ---------------------------------------------------------- work requests ---

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct IbvSge {
    pub(super) addr: u64,
    pub(super) length: u32,
    pub(super) lkey: u32,
}

/// `struct ibv_mw_bind_info`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct IbvMwBindInfo {
    pub(super) mr: *mut IbvMr,
    pub(super) addr: u64,
    pub(super) length: u64,
    pub(super) mw_access_flags: c_uint,
}

/// The first anonymous union of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) union SendWrImm {
    pub(super) imm_data: u32, // __be32
    pub(super) invalidate_rkey: u32,
}

/// `ibv_send_wr.wr.rdma`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct SendWrRdma {
    pub(super) remote_addr: u64,
    pub(super) rkey: u32,
}

/// `ibv_send_wr.wr.atomic`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct SendWrAtomic {
    pub(super) remote_addr: u64,
    pub(super) compare_add: u64,
    pub(super) swap: u64,
    pub(super) rkey: u32,
}

/// `ibv_send_wr.wr.ud`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct SendWrUd {
    pub(super) ah: *mut IbvAh,
    pub(super) remote_qpn: u32,
    pub(super) remote_qkey: u32,
}

/// `ibv_send_wr.wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) union SendWrWr {
    pub(super) rdma: SendWrRdma,
    pub(super) atomic: SendWrAtomic,
    pub(super) ud: SendWrUd,
}

/// `ibv_send_wr.qp_type.xrc`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct SendWrXrc {
    pub(super) remote_srqn: u32,
}

/// `ibv_send_wr.qp_type`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) union SendWrQpType {
    pub(super) xrc: SendWrXrc,
}

/// `ibv_send_wr.bind_mw`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct SendWrBindMw {
    pub(super) mw: *mut IbvMw,
    pub(super) rkey: u32,
    pub(super) bind_info: IbvMwBindInfo,
}

/// `ibv_send_wr.tso`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct SendWrTso {
    pub(super) hdr: *mut c_void,
    pub(super) hdr_sz: u16,
    pub(super) mss: u16,
}

/// The last anonymous union of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) union SendWrExt {
    pub(super) bind_mw: SendWrBindMw,
    pub(super) tso: SendWrTso,
}

/// `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct IbvSendWr {
    pub(super) wr_id: u64,
    pub(super) next: *mut IbvSendWr,
    pub(super) sg_list: *mut IbvSge,
    pub(super) num_sge: c_int,
    pub(super) opcode: c_uint, // enum ibv_wr_opcode
    pub(super) send_flags: c_uint,
    pub(super) imm: SendWrImm,
    pub(super) wr: SendWrWr,
    pub(super) qp_type: SendWrQpType,
    pub(super) ext: SendWrExt,
}

/// The anonymous union of `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) union WcImm {
    pub(super) imm_data: u32, // __be32
    pub(super) invalidated_rkey: u32,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct IbvWc {
    pub(super) wr_id: u64,
    pub(super) status: c_uint, // enum ibv_wc_status
    pub(super) opcode: c_uint, // enum ibv_wc_opcode
    pub(super) vendor_err: u32,
    pub(super) byte_len: u32,
    pub(super) imm: WcImm,
    pub(super) qp_num: u32,
    pub(super) src_qp: u32,
    pub(super) wc_flags: c_uint,
    pub(super) pkey_index: u16,
    pub(super) slid: u16,
    pub(super) sl: u8,
    pub(super) dlid_path_bits: u8,
}

/// All-zero values of the plain-data verbs structs, as C code gets them from
/// `memset(&x, 0, sizeof x)` before filling them in.
pub(super) trait Zeroed: Sized {
    fn zeroed() -> Self;
}

macro_rules! zeroed {
    ($($t:ty),*) => {$(
        impl Zeroed for $t {
            fn zeroed() -> Self {
                // SAFETY: the type holds integers, raw pointers, nullable
                // (`Option`) function pointers and unions of those only; the
                // all-zero bit pattern is valid for each.
                unsafe { std::mem::zeroed() }
            }
        }
    )*};
}
zeroed!(
    IbvPortAttr,
    IbvQpInitAttr,
    IbvQpAttr,
    IbvGid,
    IbvSendWr,
    IbvWc,
    IbvContext,
    IbvQp,
    IbvCq
);

// -------------------------------------------------------------- constants ---

pub(super) const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub(super) const IBV_ACCESS_REMOTE_WRITE: c_int = 1 << 1;

// enum ibv_port_state
pub(super) const IBV_PORT_NOP: c_uint = 0;
pub(super) const IBV_PORT_DOWN: c_uint = 1;
pub(super) const IBV_PORT_INIT: c_uint = 2;
pub(super) const IBV_PORT_ARMED: c_uint = 3;
pub(super) const IBV_PORT_ACTIVE: c_uint = 4;
pub(super) const IBV_PORT_ACTIVE_DEFER: c_uint = 5;

// IBV_LINK_LAYER_* (anonymous enum; stored in a uint8_t)
pub(super) const IBV_LINK_LAYER_UNSPECIFIED: u8 = 0;
pub(super) const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub(super) const IBV_LINK_LAYER_ETHERNET: u8 = 2;

// enum ibv_qp_type
pub(super) const IBV_QPT_RC: c_uint = 2;

// enum ibv_qp_state
pub(super) const IBV_QPS_INIT: c_uint = 1;
pub(super) const IBV_QPS_RTR: c_uint = 2;
pub(super) const IBV_QPS_RTS: c_uint = 3;

// enum ibv_qp_attr_mask
pub(super) const IBV_QP_STATE: c_int = 1 << 0;
pub(super) const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub(super) const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub(super) const IBV_QP_PORT: c_int = 1 << 5;
pub(super) const IBV_QP_AV: c_int = 1 << 7;
pub(super) const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub(super) const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub(super) const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub(super) const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub(super) const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub(super) const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub(super) const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub(super) const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub(super) const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub(super) const IBV_QP_DEST_QPN: c_int = 1 << 20;

// enum ibv_wr_opcode
pub(super) const IBV_WR_RDMA_WRITE: c_uint = 0;

// enum ibv_send_flags
pub(super) const IBV_SEND_SIGNALED: c_uint = 1 << 1;

// enum ibv_wc_status
pub(super) const IBV_WC_SUCCESS: c_uint = 0;

// ---------------------------------------------------------------- symbols ---

#[link(name = "ibverbs")]
unsafe extern "C" {
    pub(super) fn ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut IbvDevice;
    pub(super) fn ibv_free_device_list(list: *mut *mut IbvDevice);
    pub(super) fn ibv_get_device_name(device: *mut IbvDevice) -> *const c_char;
    pub(super) fn ibv_open_device(device: *mut IbvDevice) -> *mut IbvContext;
    pub(super) fn ibv_close_device(context: *mut IbvContext) -> c_int;
    pub(super) fn ibv_alloc_pd(context: *mut IbvContext) -> *mut IbvPd;
    pub(super) fn ibv_dealloc_pd(pd: *mut IbvPd) -> c_int;
    pub(super) fn ibv_reg_mr(
        pd: *mut IbvPd,
        addr: *mut c_void,
        length: usize,
        access: c_int,
    ) -> *mut IbvMr;
    pub(super) fn ibv_dereg_mr(mr: *mut IbvMr) -> c_int;

    /// The exported compat entry point behind verbs.h's `ibv_query_port`
    /// macro (see the module docs): pass a zeroed full `IbvPortAttr`.
    pub(super) fn ibv_query_port(
        context: *mut IbvContext,
        port_num: u8,
        port_attr: *mut CompatIbvPortAttr,
    ) -> c_int;
    pub(super) fn ibv_query_gid(
        context: *mut IbvContext,
        port_num: u8,
        index: c_int,
        gid: *mut IbvGid,
    ) -> c_int;

    pub(super) fn ibv_create_cq(
        context: *mut IbvContext,
        cqe: c_int,
        cq_context: *mut c_void,
        channel: *mut IbvCompChannel,
        comp_vector: c_int,
    ) -> *mut IbvCq;
    pub(super) fn ibv_destroy_cq(cq: *mut IbvCq) -> c_int;
    pub(super) fn ibv_create_qp(pd: *mut IbvPd, qp_init_attr: *mut IbvQpInitAttr) -> *mut IbvQp;
    pub(super) fn ibv_modify_qp(qp: *mut IbvQp, attr: *mut IbvQpAttr, attr_mask: c_int) -> c_int;
    pub(super) fn ibv_destroy_qp(qp: *mut IbvQp) -> c_int;

    /// `const char *ibv_wc_status_str(enum ibv_wc_status)`: a static string.
    pub(super) fn ibv_wc_status_str(status: c_uint) -> *const c_char;
}

#[cfg(all(test, target_arch = "x86_64", target_os = "linux"))]
mod layout_tests {
    //! Sizes and offsets printed by a C program compiled against rdma-core
    //! 44's verbs.h on x86_64 glibc (`cc l.c && ./l`, `sizeof`, `_Alignof`,
    //! `offsetof`). A mismatch means a mirror above drifted from the header.
    use std::mem::{align_of, offset_of, size_of};

    use super::*;

    #[test]
    fn context_ops_matches_verbs_h() {
        assert_eq!(size_of::<IbvContextOps>(), 256);
        assert_eq!(offset_of!(IbvContextOps, poll_cq), 88);
        assert_eq!(offset_of!(IbvContextOps, req_notify_cq), 96);
        assert_eq!(offset_of!(IbvContextOps, post_send), 200);
        assert_eq!(offset_of!(IbvContextOps, post_recv), 208);
        assert_eq!(offset_of!(IbvContextOps, _compat_async_event), 248);
    }

    #[test]
    fn context_matches_verbs_h() {
        assert_eq!(size_of::<IbvContext>(), 328);
        assert_eq!(align_of::<IbvContext>(), 8);
        assert_eq!(offset_of!(IbvContext, ops), 8);
        assert_eq!(offset_of!(IbvContext, cmd_fd), 264);
        assert_eq!(offset_of!(IbvContext, async_fd), 268);
        assert_eq!(offset_of!(IbvContext, num_comp_vectors), 272);
        assert_eq!(offset_of!(IbvContext, mutex), 280);
        assert_eq!(offset_of!(IbvContext, abi_compat), 320);
        assert_eq!(size_of::<PthreadMutex>(), 40);
        assert_eq!(size_of::<PthreadCond>(), 48);
    }

    #[test]
    fn qp_and_cq_match_verbs_h() {
        assert_eq!(size_of::<IbvQp>(), 160);
        assert_eq!(offset_of!(IbvQp, context), 0);
        assert_eq!(offset_of!(IbvQp, handle), 48);
        assert_eq!(offset_of!(IbvQp, qp_num), 52);
        assert_eq!(offset_of!(IbvQp, state), 56);
        assert_eq!(offset_of!(IbvQp, qp_type), 60);
        assert_eq!(offset_of!(IbvQp, mutex), 64);
        assert_eq!(offset_of!(IbvQp, cond), 104);
        assert_eq!(offset_of!(IbvQp, events_completed), 152);

        assert_eq!(size_of::<IbvCq>(), 128);
        assert_eq!(offset_of!(IbvCq, context), 0);
        assert_eq!(offset_of!(IbvCq, handle), 24);
        assert_eq!(offset_of!(IbvCq, cqe), 28);
        assert_eq!(offset_of!(IbvCq, mutex), 32);
        assert_eq!(offset_of!(IbvCq, cond), 72);
        assert_eq!(offset_of!(IbvCq, comp_events_completed), 120);
        assert_eq!(offset_of!(IbvCq, async_events_completed), 124);
    }

    #[test]
    fn send_wr_matches_verbs_h() {
        assert_eq!(size_of::<IbvSendWr>(), 128);
        assert_eq!(align_of::<IbvSendWr>(), 8);
        assert_eq!(offset_of!(IbvSendWr, wr_id), 0);
        assert_eq!(offset_of!(IbvSendWr, next), 8);
        assert_eq!(offset_of!(IbvSendWr, sg_list), 16);
        assert_eq!(offset_of!(IbvSendWr, num_sge), 24);
        assert_eq!(offset_of!(IbvSendWr, opcode), 28);
        assert_eq!(offset_of!(IbvSendWr, send_flags), 32);
        assert_eq!(offset_of!(IbvSendWr, imm), 36);
        assert_eq!(offset_of!(IbvSendWr, wr), 40);
        assert_eq!(offset_of!(IbvSendWr, wr.rdma.remote_addr), 40);
        assert_eq!(offset_of!(IbvSendWr, wr.rdma.rkey), 48);
        assert_eq!(size_of::<SendWrWr>(), 32);
        assert_eq!(offset_of!(IbvSendWr, qp_type), 72);
        assert_eq!(offset_of!(IbvSendWr, ext), 80);
        assert_eq!(size_of::<IbvMwBindInfo>(), 32);
    }

    #[test]
    fn sge_and_wc_match_verbs_h() {
        assert_eq!(size_of::<IbvSge>(), 16);
        assert_eq!(offset_of!(IbvSge, addr), 0);
        assert_eq!(offset_of!(IbvSge, length), 8);
        assert_eq!(offset_of!(IbvSge, lkey), 12);

        assert_eq!(size_of::<IbvWc>(), 48);
        assert_eq!(offset_of!(IbvWc, wr_id), 0);
        assert_eq!(offset_of!(IbvWc, status), 8);
        assert_eq!(offset_of!(IbvWc, opcode), 12);
        assert_eq!(offset_of!(IbvWc, vendor_err), 16);
        assert_eq!(offset_of!(IbvWc, byte_len), 20);
        assert_eq!(offset_of!(IbvWc, imm), 24);
        assert_eq!(offset_of!(IbvWc, qp_num), 28);
        assert_eq!(offset_of!(IbvWc, src_qp), 32);
        assert_eq!(offset_of!(IbvWc, wc_flags), 36);
        assert_eq!(offset_of!(IbvWc, pkey_index), 40);
        assert_eq!(offset_of!(IbvWc, slid), 42);
        assert_eq!(offset_of!(IbvWc, sl), 44);
        assert_eq!(offset_of!(IbvWc, dlid_path_bits), 45);
    }

    #[test]
    fn qp_attrs_match_verbs_h() {
        assert_eq!(size_of::<IbvQpCap>(), 20);
        assert_eq!(size_of::<IbvQpInitAttr>(), 64);
        assert_eq!(offset_of!(IbvQpInitAttr, send_cq), 8);
        assert_eq!(offset_of!(IbvQpInitAttr, cap), 32);
        assert_eq!(offset_of!(IbvQpInitAttr, qp_type), 52);
        assert_eq!(offset_of!(IbvQpInitAttr, sq_sig_all), 56);

        assert_eq!(size_of::<IbvGid>(), 16);
        assert_eq!(align_of::<IbvGid>(), 8);
        assert_eq!(size_of::<IbvGlobalRoute>(), 24);
        assert_eq!(offset_of!(IbvGlobalRoute, flow_label), 16);
        assert_eq!(offset_of!(IbvGlobalRoute, sgid_index), 20);
        assert_eq!(offset_of!(IbvGlobalRoute, hop_limit), 21);
        assert_eq!(offset_of!(IbvGlobalRoute, traffic_class), 22);
        assert_eq!(size_of::<IbvAhAttr>(), 32);
        assert_eq!(offset_of!(IbvAhAttr, dlid), 24);
        assert_eq!(offset_of!(IbvAhAttr, sl), 26);
        assert_eq!(offset_of!(IbvAhAttr, is_global), 29);
        assert_eq!(offset_of!(IbvAhAttr, port_num), 30);

        assert_eq!(size_of::<IbvQpAttr>(), 144);
        assert_eq!(offset_of!(IbvQpAttr, qkey), 16);
        assert_eq!(offset_of!(IbvQpAttr, rq_psn), 20);
        assert_eq!(offset_of!(IbvQpAttr, sq_psn), 24);
        assert_eq!(offset_of!(IbvQpAttr, dest_qp_num), 28);
        assert_eq!(offset_of!(IbvQpAttr, qp_access_flags), 32);
        assert_eq!(offset_of!(IbvQpAttr, cap), 36);
        assert_eq!(offset_of!(IbvQpAttr, ah_attr), 56);
        assert_eq!(offset_of!(IbvQpAttr, alt_ah_attr), 88);
        assert_eq!(offset_of!(IbvQpAttr, pkey_index), 120);
        assert_eq!(offset_of!(IbvQpAttr, alt_pkey_index), 122);
        assert_eq!(offset_of!(IbvQpAttr, en_sqd_async_notify), 124);
        assert_eq!(offset_of!(IbvQpAttr, max_rd_atomic), 126);
        assert_eq!(offset_of!(IbvQpAttr, max_dest_rd_atomic), 127);
        assert_eq!(offset_of!(IbvQpAttr, min_rnr_timer), 128);
        assert_eq!(offset_of!(IbvQpAttr, port_num), 129);
        assert_eq!(offset_of!(IbvQpAttr, timeout), 130);
        assert_eq!(offset_of!(IbvQpAttr, retry_cnt), 131);
        assert_eq!(offset_of!(IbvQpAttr, rnr_retry), 132);
        assert_eq!(offset_of!(IbvQpAttr, alt_port_num), 133);
        assert_eq!(offset_of!(IbvQpAttr, alt_timeout), 134);
        assert_eq!(offset_of!(IbvQpAttr, rate_limit), 136);
    }

    #[test]
    fn port_attr_and_mr_match_verbs_h() {
        assert_eq!(size_of::<IbvPortAttr>(), 52);
        assert_eq!(align_of::<IbvPortAttr>(), 4);
        assert_eq!(offset_of!(IbvPortAttr, state), 0);
        assert_eq!(offset_of!(IbvPortAttr, active_mtu), 8);
        assert_eq!(offset_of!(IbvPortAttr, gid_tbl_len), 12);
        assert_eq!(offset_of!(IbvPortAttr, pkey_tbl_len), 32);
        assert_eq!(offset_of!(IbvPortAttr, lid), 34);
        assert_eq!(offset_of!(IbvPortAttr, sm_lid), 36);
        assert_eq!(offset_of!(IbvPortAttr, lmc), 38);
        assert_eq!(offset_of!(IbvPortAttr, phys_state), 45);
        assert_eq!(offset_of!(IbvPortAttr, link_layer), 46);
        assert_eq!(offset_of!(IbvPortAttr, flags), 47);
        assert_eq!(offset_of!(IbvPortAttr, port_cap_flags2), 48);

        assert_eq!(size_of::<IbvMr>(), 48);
        assert_eq!(offset_of!(IbvMr, length), 24);
        assert_eq!(offset_of!(IbvMr, lkey), 36);
        assert_eq!(offset_of!(IbvMr, rkey), 40);
    }
}
