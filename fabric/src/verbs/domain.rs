//! Protection domains: memory registration and connecting (the `ibv_pd`
//! and the memory regions themselves are in [`super::pd`]).

use std::sync::Arc;

use rdma_sys::{ibv_access_flags, ibv_alloc_pd, ibv_reg_mr};

use super::connect;
use super::cq::VerbsCq;
use super::device::FabricInner;
use super::endpoint::VerbsEndpoint;
use super::pd::{DomainInner, MrHandle};
use super::sys::{last_errno_or, verb_error, verb_error_detail};
use crate::error::Result;
use crate::memory::{Access, Buffer, MemoryRegion};
use crate::registry::next_domain_id;
use crate::EndpointOptions;

/// A protection domain of the verbs provider.
#[derive(Debug)]
pub(crate) struct VerbsDomain {
    inner: Arc<DomainInner>,
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

impl VerbsDomain {
    /// Registers `buf` with `access`.
    pub(super) fn register_mr(&self, buf: Buffer, access: Access) -> Result<MemoryRegion> {
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
    pub(super) fn dial(
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
