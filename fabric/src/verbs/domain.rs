//! Protection domains and memory registration.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use rdma_sys::{
    ibv_access_flags, ibv_alloc_pd, ibv_dealloc_pd, ibv_dereg_mr, ibv_mr, ibv_pd, ibv_reg_mr,
};

use super::connect;
use super::cq::VerbsCq;
use super::endpoint::VerbsEndpoint;
use super::sys::{errno_of, last_errno_or, verb_error, verb_error_detail};
use super::{FabricInner, VerbsFabric};
use crate::error::Result;
use crate::memory::{Access, Buffer, MemoryRegion, Registration};
use crate::provider;
use crate::registry::next_domain_id;
use crate::EndpointOptions;

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

/// A protection domain of the verbs provider.
#[derive(Debug)]
pub(crate) struct VerbsDomain {
    inner: Arc<DomainInner>,
}

/// A registered memory region of the NIC; deregistered on drop.
///
/// Holds the domain, so the MR is always deregistered before its PD is
/// deallocated. Work requests in flight hold the [`Buffer`] itself (see the
/// CQ's slot table), so deregistering while the NIC still has requests on the
/// region fails those requests (local protection error) instead of letting
/// the NIC touch unmapped memory.
pub(crate) struct MrHandle {
    mr: *mut ibv_mr,
    /// Keeps the pages mapped until after deregistration (the region's own
    /// reference may be dropped first).
    _buf: Arc<Buffer>,
    domain: Arc<DomainInner>,
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

/// The MR access flags for `access`: local write always (reads and atomics
/// land in local memory, and remote write requires it), remote rights as asked.
pub(crate) fn access_flags(access: Access) -> u32 {
    let mut flags = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    if access.contains(Access::REMOTE_WRITE) {
        flags |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
    }
    if access.contains(Access::REMOTE_READ) {
        flags |= ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
    }
    if access.contains(Access::REMOTE_ATOMIC) {
        flags |= ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
    }
    flags
}

impl VerbsDomain {
    pub(crate) fn new(fabric: Arc<FabricInner>) -> Result<VerbsDomain> {
        // SAFETY: the context is open while `fabric` lives.
        let pd = unsafe { ibv_alloc_pd(fabric.ctx) };
        if pd.is_null() {
            return Err(verb_error(
                "ibv_alloc_pd",
                &fabric.device,
                last_errno_or(libc::ENOMEM),
            ));
        }
        Ok(VerbsDomain {
            inner: Arc::new(DomainInner {
                id: next_domain_id(),
                pd,
                fabric,
            }),
        })
    }

    pub(crate) fn inner(&self) -> &Arc<DomainInner> {
        &self.inner
    }
}

impl provider::Domain<VerbsFabric> for VerbsDomain {
    fn id(&self) -> u64 {
        self.inner.id
    }

    /// Registers `buf` with `access`.
    fn register_buffer(&self, buf: Buffer, access: Access) -> Result<MemoryRegion> {
        let len = buf.len();
        let buf = Arc::new(buf);
        // ibv_reg_mr refuses zero lengths; an empty region registers one byte
        // of its (always present) page, and its descriptor still says 0.
        let reg_len = len.max(1);
        let flags = access_flags(access);
        // SAFETY: buf maps at least reg_len bytes and stays mapped while the
        // MR exists (MrHandle holds its own reference and deregisters before
        // releasing it); the PD is allocated while inner lives.
        let mr = unsafe {
            ibv_reg_mr(
                self.inner.pd,
                buf.as_ptr().cast(),
                reg_len,
                flags as libc::c_int,
            )
        };
        if mr.is_null() {
            let err = last_errno_or(libc::ENOMEM);
            let hint = if buf.is_file_backed() && err.raw_os_error() == Some(libc::EFAULT) {
                " (a writable mapping of a file on a file system that tracks dirty pages, such \
                 as ext4 or xfs, cannot be pinned on Linux 6.5 and later: put the file on tmpfs)"
            } else if err.raw_os_error() == Some(libc::ENOMEM)
                || err.raw_os_error() == Some(libc::EFAULT)
            {
                " (is the locked-memory limit, `ulimit -l`, large enough?)"
            } else {
                ""
            };
            return Err(verb_error_detail(
                "ibv_reg_mr",
                &self.inner.fabric.device,
                Some(format!("registering {len} bytes with {access:?}{hint}")),
                err,
            ));
        }
        // SAFETY: mr is a valid MR returned just above.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(MemoryRegion {
            buf: buf.clone(),
            rkey,
            lkey,
            access,
            domain_id: self.inner.id,
            _registration: Box::new(MrHandle {
                mr,
                _buf: buf,
                domain: self.inner.clone(),
            }),
        })
    }

    /// Connects to a listener at `addr`.
    fn connect(
        &self,
        addr: &str,
        cq: &mut VerbsCq,
        opts: &EndpointOptions,
    ) -> Result<VerbsEndpoint> {
        connect::connect(&self.inner, addr, cq, opts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    const LW: u32 = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    const RW: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
    const RR: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
    const RA: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;

    #[rstest]
    #[case(Access::LOCAL, LW)]
    #[case(Access::REMOTE_WRITE, LW | RW)]
    #[case(Access::REMOTE_READ, LW | RR)]
    #[case(Access::REMOTE_ATOMIC, LW | RA)]
    #[case(Access::ALL, LW | RW | RR | RA)]
    fn access_maps_to_mr_flags(#[case] access: Access, #[case] flags: u32) {
        assert_eq!(access_flags(access), flags);
    }
}
