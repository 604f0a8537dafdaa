//! The opened device: its context, limits and ports, and the peer-loss
//! monitor, shared by everything created from it.

use std::fmt;

use rdma_sys::{ibv_context, rdma_free_devices};

use super::monitor::Monitor;

/// `IBV_LINK_LAYER_INFINIBAND` (an anonymous enum in verbs.h that bindgen skips).
pub(crate) const LINK_LAYER_INFINIBAND: u8 = 1;
/// `IBV_LINK_LAYER_ETHERNET`.
pub(crate) const LINK_LAYER_ETHERNET: u8 = 2;

/// What the provider needs to know about the device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeviceLimits {
    pub(crate) max_qp_wr: u32,
    pub(crate) max_cqe: u32,
    /// Incoming reads/atomics a QP may serve at once (our responder resources).
    pub(crate) responder_resources: u8,
    /// Outgoing reads/atomics a QP may have in flight (our initiator depth).
    pub(crate) initiator_depth: u8,
}

/// One port of the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PortInfo {
    pub(crate) num: u8,
    pub(crate) state: u32,
    pub(crate) link_layer: u8,
    pub(crate) gid_tbl_len: u32,
    pub(crate) pkey_tbl_len: u16,
}

/// The opened device, shared by everything created from it.
pub(crate) struct FabricInner {
    pub(crate) device: String,
    pub(crate) ctx: *mut ibv_context,
    pub(super) devices: *mut *mut ibv_context,
    pub(crate) limits: DeviceLimits,
    pub(crate) ports: Vec<PortInfo>,
    pub(crate) monitor: Monitor,
}

// SAFETY: ibv_context is thread-safe (libibverbs serialises internally), and
// the device list is only freed in Drop, when no other reference exists.
unsafe impl Send for FabricInner {}
// SAFETY: as above; no field is mutated after open.
unsafe impl Sync for FabricInner {}

impl FabricInner {
    /// The link layer of `port` (Ethernet for RoCE, InfiniBand for IB).
    pub(crate) fn link_layer(&self, port: u8) -> u8 {
        self.ports
            .iter()
            .find(|p| p.num == port)
            .map_or(LINK_LAYER_ETHERNET, |p| p.link_layer)
    }

    /// The length of `port`'s P_Key table.
    pub(crate) fn pkey_table_len(&self, port: u8) -> usize {
        self.ports
            .iter()
            .find(|p| p.num == port)
            .map_or(0, |p| usize::from(p.pkey_tbl_len))
    }

    /// The length of `port`'s GID table.
    pub(crate) fn gid_table_len(&self, port: u8) -> usize {
        self.ports
            .iter()
            .find(|p| p.num == port)
            .map_or(0, |p| p.gid_tbl_len as usize)
    }
}

impl Drop for FabricInner {
    fn drop(&mut self) {
        self.monitor.stop();
        // SAFETY: `devices` came from rdma_get_devices and is freed once;
        // every PD, CQ and QP of `ctx` is gone (they hold Arcs to self).
        unsafe { rdma_free_devices(self.devices) };
    }
}

impl fmt::Debug for FabricInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FabricInner")
            .field("device", &self.device)
            .field("limits", &self.limits)
            .field("ports", &self.ports)
            .finish()
    }
}
