//! A protection domain's `ibv_pd` and the memory regions registered in it.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use rdma_sys::{ibv_dealloc_pd, ibv_dereg_mr, ibv_mr, ibv_pd};

use super::device::FabricInner;
use super::sys::errno_of;
use crate::memory::{Buffer, Registration};

/// The `ibv_pd` of a domain, shared by its regions and queue pairs.
pub(crate) struct DomainInner {
    pub(crate) id: u64,
    pub(crate) pd: *mut ibv_pd,
    pub(crate) fabric: Arc<FabricInner>,
}

// SAFETY: a PD is a handle the verbs library uses thread-safely; it is only
// deallocated in Drop, when no region or QP refers to it any more.
unsafe impl Send for DomainInner {}
// SAFETY: as above; nothing is mutated through &DomainInner.
unsafe impl Sync for DomainInner {}

impl Drop for DomainInner {
    fn drop(&mut self) {
        // SAFETY: every MR and QP of this PD holds an Arc to self, so all are
        // gone; the context (in `fabric`) outlives this call.
        let rc = unsafe { ibv_dealloc_pd(self.pd) };
        if rc != 0 {
            tracing::warn!(device = %self.fabric.device, error = %errno_of(rc), "ibv_dealloc_pd failed");
        }
    }
}

impl fmt::Debug for DomainInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DomainInner")
            .field("id", &self.id)
            .field("device", &self.fabric.device)
            .finish()
    }
}

/// A registered memory region of the NIC; deregistered on drop.
///
/// Holds the domain, so the MR is always deregistered before its PD is
/// deallocated. Work requests in flight hold the [`Buffer`] itself (see the
/// CQ's slot table), so deregistering while the NIC still has requests on the
/// region fails those requests (local protection error) instead of letting
/// the NIC touch unmapped memory.
pub(crate) struct MrHandle {
    pub(super) mr: *mut ibv_mr,
    /// Keeps the pages mapped until after deregistration (the region's own
    /// reference may be dropped first).
    pub(super) _buf: Arc<Buffer>,
    pub(super) domain: Arc<DomainInner>,
}

// SAFETY: the MR handle is only passed to ibv_dereg_mr, once, in Drop.
unsafe impl Send for MrHandle {}
// SAFETY: no method mutates through &MrHandle.
unsafe impl Sync for MrHandle {}

impl MrHandle {
    /// Whether the MR belongs to `domain`'s PD.
    pub(crate) fn is_in(&self, domain: &Arc<DomainInner>) -> bool {
        Arc::ptr_eq(&self.domain, domain)
    }
}

impl Registration for MrHandle {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for MrHandle {
    fn drop(&mut self) {
        // SAFETY: mr came from ibv_reg_mr on domain.pd, which is still
        // allocated (we hold the domain); deregistered exactly once.
        let rc = unsafe { ibv_dereg_mr(self.mr) };
        if rc != 0 {
            tracing::warn!(device = %self.domain.fabric.device, error = %errno_of(rc), "ibv_dereg_mr failed");
        }
    }
}

impl fmt::Debug for MrHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MrHandle")
            .field("domain", &self.domain.id)
            .finish()
    }
}
