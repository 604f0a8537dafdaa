//! RC queue pairs: creation and the INIT → RTR → RTS transitions.
//!
//! The provider creates the QP itself and moves it through its states with
//! the attributes rdma_cm computes (`rdma_init_qp_attr`: port, P_Key index,
//! path MTU, address vector with the source GID, remote QP number, PSNs)
//! plus its own overrides: the P_Key index and service level of the
//! endpoint options (the P_Key index is checked against the port's table
//! first: some devices, Soft-RoCE among them, accept any index), all remote
//! access rights on the QP (the MR rights are what grant access), the
//! read/atomic depths agreed at connect, a local ACK timeout of 14
//! (4.096 µs × 2^14 ≈ 67 ms) with 6 retries, infinite RNR retries and an
//! RNR timer of 0.64 ms.

use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rdma_sys::{
    ibv_access_flags, ibv_create_qp, ibv_destroy_qp, ibv_modify_qp, ibv_qp, ibv_qp_attr,
    ibv_qp_attr_mask, ibv_qp_cap, ibv_qp_init_attr, ibv_qp_state, ibv_qp_type, ibv_query_pkey,
    ibv_query_qp, rdma_init_qp_attr,
};

use super::cm::CmId;
use super::cq::CqShared;
use super::device::LINK_LAYER_INFINIBAND;
use super::gid::{self, GidKind};
use super::pd::DomainInner;
use super::sys::{errno_of, last_errno_or, verb_error, verb_error_detail};
use crate::error::{Error, Result};
use crate::EndpointOptions;

/// Local ACK timeout exponent: 4.096 µs × 2^14 ≈ 67 ms per try.
pub(crate) const ACK_TIMEOUT: u8 = 14;
/// Transport retries before RETRY_EXC_ERR: 6, so 7 tries ≈ 0.5 s. Not 7:
/// Soft-RoCE treats a retry count of 7 like an RNR retry count of 7 (retry
/// forever), so a silent peer would never be noticed there.
pub(crate) const RETRY_COUNT: u8 = 6;
/// RNR retries: 7 means retry forever, so a write-with-immediate waits for
/// the peer to post a receive.
pub(crate) const RNR_RETRY: u8 = 7;
/// RNR NAK timer the responder asks for: 12 = 0.64 ms (0 would mean 655 ms).
pub(crate) const MIN_RNR_TIMER: u8 = 12;
/// Inline data sizes to ask for, largest first, until the device accepts.
const INLINE_TRIES: [u32; 4] = [256, 128, 64, 0];

/// Process-wide ids of queue pairs, naming their slots in a CQ's table.
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// An RC queue pair; destroyed on drop, before its CQ and PD (it holds both).
pub(crate) struct Qp {
    pub(crate) raw: *mut ibv_qp,
    /// Largest inline send the QP accepts (from the created QP's caps).
    pub(crate) max_inline: u32,
    /// Names this QP's slots in the CQ's table.
    pub(crate) owner: u64,
    pub(crate) cq: Arc<CqShared>,
    pub(crate) domain: Arc<DomainInner>,
}

// SAFETY: libibverbs allows posting, modifying and querying a QP from any
// thread; it is destroyed once, in Drop.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: raw is a QP of domain.pd completing into cq.cq, both alive
        // (held by self); destroyed once.
        let rc = unsafe { ibv_destroy_qp(self.raw) };
        if rc != 0 {
            tracing::warn!(device = %self.device(), error = %errno_of(rc), "ibv_destroy_qp failed");
        }
        // The QP can produce no more completions; requests it never completed
        // (providers may also purge its queued completions) free their slots.
        let reclaimed = self.cq.slots.reclaim(self.owner);
        if reclaimed > 0 {
            tracing::debug!(device = %self.device(), reclaimed, "discarded outstanding work requests of a closed endpoint");
        }
    }
}

impl fmt::Debug for Qp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Qp")
            .field("qp_num", &self.qp_num())
            .field("max_inline", &self.max_inline)
            .finish()
    }
}

/// The attributes of a queue pair that tests and operators care about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct QpInfo {
    pub(crate) state: &'static str,
    pub(crate) qp_num: u32,
    pub(crate) dest_qp_num: u32,
    /// Service level in the address vector. Soft-RoCE does not keep it (it
    /// reports 0 whatever was set); RoCE NICs map it to a priority.
    pub(crate) sl: u8,
    pub(crate) pkey_index: u16,
    pub(crate) port_num: u8,
    pub(crate) sgid_index: u8,
    /// The source GID at `sgid_index`, formatted as an IPv6 address.
    pub(crate) sgid: String,
    pub(crate) sgid_kind: GidKind,
    /// Whether `sgid` is the GID of the endpoint's local IP address.
    pub(crate) sgid_matches_local_ip: bool,
    /// The index [`gid::select_gid`] finds for the local IP in the port's
    /// table (what a provider without rdma_cm would have to use).
    pub(crate) expected_sgid_index: Option<u8>,
    pub(crate) timeout: u8,
    pub(crate) retry_cnt: u8,
    pub(crate) rnr_retry: u8,
    pub(crate) min_rnr_timer: u8,
    pub(crate) max_rd_atomic: u8,
    pub(crate) max_dest_rd_atomic: u8,
    pub(crate) max_send_wr: u32,
    pub(crate) max_recv_wr: u32,
    pub(crate) max_inline_data: u32,
}

/// The name of a QP state.
pub(crate) fn state_name(state: u32) -> &'static str {
    match state {
        ibv_qp_state::IBV_QPS_RESET => "RESET",
        ibv_qp_state::IBV_QPS_INIT => "INIT",
        ibv_qp_state::IBV_QPS_RTR => "RTR",
        ibv_qp_state::IBV_QPS_RTS => "RTS",
        ibv_qp_state::IBV_QPS_SQD => "SQD",
        ibv_qp_state::IBV_QPS_SQE => "SQE",
        ibv_qp_state::IBV_QPS_ERR => "ERR",
        _ => "UNKNOWN",
    }
}

/// The attribute names in a modify mask, for error messages.
pub(crate) fn mask_names(mask: u32) -> String {
    const NAMES: [&str; 26] = [
        "STATE",
        "CUR_STATE",
        "EN_SQD_ASYNC_NOTIFY",
        "ACCESS_FLAGS",
        "PKEY_INDEX",
        "PORT",
        "QKEY",
        "AV",
        "PATH_MTU",
        "TIMEOUT",
        "RETRY_CNT",
        "RNR_RETRY",
        "RQ_PSN",
        "MAX_QP_RD_ATOMIC",
        "ALT_PATH",
        "MIN_RNR_TIMER",
        "SQ_PSN",
        "MAX_DEST_RD_ATOMIC",
        "PATH_MIG_STATE",
        "CAP",
        "DEST_QPN",
        "bit21",
        "bit22",
        "bit23",
        "bit24",
        "RATE_LIMIT",
    ];
    let names: Vec<&str> = NAMES
        .iter()
        .enumerate()
        .filter(|(bit, _)| mask & (1 << bit) != 0)
        .map(|(_, name)| *name)
        .collect();
    names.join("|")
}

/// Bits 21-23 (SMAC, ALT_SMAC, VID) that old kernels report for InfiniBand
/// ports and that ibv_modify_qp refuses there (librdmacm masks them too).
const KERNEL_ONLY_BITS: u32 = 0x00e0_0000;

/// What a state transition failed on, for the error message.
fn transition_error(
    qp: &Qp,
    from: u32,
    to: u32,
    mask: u32,
    step: &'static str,
    err: std::io::Error,
) -> Error {
    verb_error_detail(
        step,
        qp.device(),
        Some(format!(
            "moving queue pair {} from {} to {} (attributes {})",
            qp.qp_num(),
            state_name(from),
            state_name(to),
            mask_names(mask)
        )),
        err,
    )
}

impl Qp {
    /// Creates an RC QP on the domain's PD completing into `cq`.
    pub(crate) fn create(
        domain: &Arc<DomainInner>,
        cq: &Arc<CqShared>,
        opts: &EndpointOptions,
    ) -> Result<Qp> {
        let fabric = &domain.fabric;
        let max_wr = fabric.limits.max_qp_wr as usize;
        for (name, depth) in [
            ("send_depth", opts.send_depth),
            ("recv_depth", opts.recv_depth),
        ] {
            if depth > max_wr {
                return Err(Error::InvalidArgument(format!(
                    "{name} {depth} is more than RDMA device {} allows per queue pair ({max_wr})",
                    fabric.device
                )));
            }
        }
        if opts.send_depth == 0 {
            return Err(Error::InvalidArgument(
                "send_depth must be at least 1".into(),
            ));
        }
        let mut last_err = None;
        for inline in INLINE_TRIES {
            let mut attr = ibv_qp_init_attr {
                qp_context: std::ptr::null_mut(),
                send_cq: cq.cq,
                recv_cq: cq.cq,
                srq: std::ptr::null_mut(),
                cap: ibv_qp_cap {
                    max_send_wr: opts.send_depth as u32,
                    max_recv_wr: opts.recv_depth.max(1) as u32,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: inline,
                },
                qp_type: ibv_qp_type::IBV_QPT_RC,
                sq_sig_all: 0,
            };
            // SAFETY: the PD and CQ are alive (held by the Arcs, which the
            // returned Qp keeps); attr is a valid in/out pointer.
            let raw = unsafe { ibv_create_qp(domain.pd, &mut attr) };
            if !raw.is_null() {
                let qp = Qp {
                    raw,
                    max_inline: attr.cap.max_inline_data,
                    owner: NEXT_OWNER.fetch_add(1, Ordering::Relaxed),
                    cq: cq.clone(),
                    domain: domain.clone(),
                };
                tracing::debug!(
                    device = %fabric.device,
                    qp_num = qp.qp_num(),
                    max_inline = qp.max_inline,
                    "created queue pair"
                );
                return Ok(qp);
            }
            let err = last_errno_or(libc::EINVAL);
            // Devices refuse inline sizes they cannot do with EINVAL (or ENOMEM).
            let retry = matches!(err.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOMEM));
            last_err = Some(err);
            if !retry {
                break;
            }
        }
        Err(verb_error_detail(
            "ibv_create_qp",
            &fabric.device,
            Some(format!(
                "creating an RC queue pair with send_depth {} and recv_depth {}",
                opts.send_depth, opts.recv_depth
            )),
            last_err.unwrap_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL)),
        ))
    }

    pub(crate) fn device(&self) -> &str {
        &self.domain.fabric.device
    }

    pub(crate) fn qp_num(&self) -> u32 {
        // SAFETY: raw is valid while self lives; qp_num never changes.
        unsafe { (*self.raw).qp_num }
    }

    /// rdma_cm's attributes for moving to `state`.
    fn cm_attributes(&self, id: &CmId, state: u32) -> Result<(ibv_qp_attr, u32)> {
        // SAFETY: ibv_qp_attr is plain old data.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = state;
        let mut mask: libc::c_int = 0;
        // SAFETY: id is a valid id bound to the QP's device; attr and mask
        // are valid out-pointers.
        let rc = unsafe { rdma_init_qp_attr(id.raw(), &mut attr, &mut mask) };
        if rc != 0 {
            return Err(verb_error_detail(
                "rdma_init_qp_attr",
                self.device(),
                Some(format!(
                    "asking rdma_cm for the {} attributes of queue pair {}",
                    state_name(state),
                    self.qp_num()
                )),
                last_errno_or(libc::EINVAL),
            ));
        }
        Ok((attr, mask as u32))
    }

    /// Refuses a P_Key index that names no partition on `port` (tenants are
    /// isolated by partition; a wrong index must not pass silently).
    fn check_pkey_index(&self, port: u8, index: u16) -> Result<()> {
        let fabric = &self.domain.fabric;
        let table_len = fabric.pkey_table_len(port);
        let mut pkey_be: u16 = 0;
        let rc = if usize::from(index) < table_len {
            // SAFETY: the context is open while the fabric lives; pkey_be is
            // a valid out-pointer.
            unsafe { ibv_query_pkey(fabric.ctx, port, libc::c_int::from(index), &mut pkey_be) }
        } else {
            libc::EINVAL
        };
        let pkey = u16::from_be(pkey_be);
        match pkey_problem(index, table_len, rc, pkey) {
            None => Ok(()),
            Some(problem) => Err(Error::InvalidArgument(format!(
                "P_Key index {index} cannot be used on port {port} of RDMA device {}: {problem} \
                 (the table is in /sys/class/infiniband/{}/ports/{port}/pkeys/)",
                fabric.device, fabric.device
            ))),
        }
    }

    fn modify(&self, attr: &mut ibv_qp_attr, mask: u32, from: u32) -> Result<()> {
        // SAFETY: raw is valid; attr is a valid pointer for the call.
        let rc = unsafe { ibv_modify_qp(self.raw, attr, mask as libc::c_int) };
        if rc != 0 {
            return Err(transition_error(
                self,
                from,
                attr.qp_state,
                mask,
                "ibv_modify_qp",
                errno_of(rc),
            ));
        }
        Ok(())
    }

    /// RESET → INIT: port and P_Key from rdma_cm, the endpoint's P_Key index,
    /// all remote rights (the MR decides).
    pub(crate) fn to_init(&self, id: &CmId, pkey_index: u16) -> Result<()> {
        self.check_pkey_index(id.port_num(), pkey_index)?;
        let (mut attr, mut mask) = self.cm_attributes(id, ibv_qp_state::IBV_QPS_INIT)?;
        attr.qp_access_flags = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
            | ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
        attr.pkey_index = pkey_index;
        mask |= ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0 | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0;
        self.modify(&mut attr, mask, ibv_qp_state::IBV_QPS_RESET)
    }

    /// INIT → RTR: the path from rdma_cm (address vector with the source GID
    /// of the local IP, MTU, remote QPN, receive PSN), plus the service level,
    /// incoming read/atomic depth and RNR timer.
    pub(crate) fn to_rtr(&self, id: &CmId, sl: u8, max_dest_rd_atomic: u8) -> Result<()> {
        let (mut attr, mut mask) = self.cm_attributes(id, ibv_qp_state::IBV_QPS_RTR)?;
        if self.domain.fabric.link_layer(id.port_num()) == LINK_LAYER_INFINIBAND {
            mask &= !KERNEL_ONLY_BITS;
        }
        attr.ah_attr.sl = sl;
        attr.max_dest_rd_atomic = max_dest_rd_atomic;
        attr.min_rnr_timer = MIN_RNR_TIMER;
        mask |= ibv_qp_attr_mask::IBV_QP_AV.0
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC.0
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0;
        self.modify(&mut attr, mask, ibv_qp_state::IBV_QPS_INIT)
    }

    /// RTR → RTS: send PSN from rdma_cm, plus our timeouts, retries and
    /// outgoing read/atomic depth.
    pub(crate) fn to_rts(&self, id: &CmId, max_rd_atomic: u8) -> Result<()> {
        let (mut attr, mut mask) = self.cm_attributes(id, ibv_qp_state::IBV_QPS_RTS)?;
        attr.timeout = ACK_TIMEOUT;
        attr.retry_cnt = RETRY_COUNT;
        attr.rnr_retry = RNR_RETRY;
        attr.max_rd_atomic = max_rd_atomic;
        mask |= ibv_qp_attr_mask::IBV_QP_TIMEOUT.0
            | ibv_qp_attr_mask::IBV_QP_RETRY_CNT.0
            | ibv_qp_attr_mask::IBV_QP_RNR_RETRY.0
            | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC.0;
        self.modify(&mut attr, mask, ibv_qp_state::IBV_QPS_RTR)
    }

    /// Any state → ERR: every outstanding request and posted receive
    /// completes with a flush error.
    pub(crate) fn to_error(&self) -> std::io::Result<()> {
        // SAFETY: ibv_qp_attr is plain old data.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
        // SAFETY: raw is valid; attr valid for the call.
        let rc = unsafe {
            ibv_modify_qp(
                self.raw,
                &mut attr,
                ibv_qp_attr_mask::IBV_QP_STATE.0 as libc::c_int,
            )
        };
        if rc != 0 {
            return Err(errno_of(rc));
        }
        Ok(())
    }

    /// Queries the QP (ibv_query_qp) and checks its source GID against
    /// `local_ip`.
    pub(crate) fn info(&self, local_ip: Option<IpAddr>) -> Result<QpInfo> {
        // SAFETY: plain old data.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: plain old data.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        let mask = ibv_qp_attr_mask::IBV_QP_STATE.0
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0
            | ibv_qp_attr_mask::IBV_QP_PORT.0
            | ibv_qp_attr_mask::IBV_QP_AV.0
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT.0
            | ibv_qp_attr_mask::IBV_QP_RETRY_CNT.0
            | ibv_qp_attr_mask::IBV_QP_RNR_RETRY.0
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0
            | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC.0
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC.0
            | ibv_qp_attr_mask::IBV_QP_CAP.0
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN.0;
        // SAFETY: raw valid; attr and init are valid out-pointers.
        let rc = unsafe { ibv_query_qp(self.raw, &mut attr, mask as libc::c_int, &mut init) };
        if rc != 0 {
            return Err(verb_error("ibv_query_qp", self.device(), errno_of(rc)));
        }
        let port = if attr.port_num != 0 {
            attr.port_num
        } else {
            attr.ah_attr.port_num.max(1)
        };
        let sgid_index = attr.ah_attr.grh.sgid_index;
        // SAFETY: the context is open while the domain's fabric lives.
        let entry =
            unsafe { gid::query_gid(self.domain.fabric.ctx, self.device(), port, sgid_index) };
        let (sgid, sgid_kind) = entry.map_or(([0; 16], GidKind::Unknown), |e| (e.gid, e.kind));
        let expected_sgid_index = local_ip.and_then(|ip| {
            let fabric = &self.domain.fabric;
            // SAFETY: the context is open while the domain's fabric lives.
            let table = unsafe {
                gid::gid_table(fabric.ctx, &fabric.device, port, fabric.gid_table_len(port))
            };
            gid::select_gid(&table, ip)
        });
        Ok(QpInfo {
            state: state_name(attr.qp_state),
            qp_num: self.qp_num(),
            dest_qp_num: attr.dest_qp_num,
            sl: attr.ah_attr.sl,
            pkey_index: attr.pkey_index,
            port_num: port,
            sgid_index,
            sgid: gid::format_gid(&sgid),
            sgid_kind,
            sgid_matches_local_ip: local_ip.is_some_and(|ip| gid::gid_of_ip(ip) == sgid),
            expected_sgid_index,
            timeout: attr.timeout,
            retry_cnt: attr.retry_cnt,
            rnr_retry: attr.rnr_retry,
            min_rnr_timer: attr.min_rnr_timer,
            max_rd_atomic: attr.max_rd_atomic,
            max_dest_rd_atomic: attr.max_dest_rd_atomic,
            max_send_wr: attr.cap.max_send_wr,
            max_recv_wr: attr.cap.max_recv_wr,
            max_inline_data: attr.cap.max_inline_data,
        })
    }
}

/// Why a P_Key table entry cannot be used, given the query's result.
pub(crate) fn pkey_problem(
    index: u16,
    table_len: usize,
    query_rc: i32,
    pkey: u16,
) -> Option<String> {
    if usize::from(index) >= table_len {
        let entries = if table_len == 1 { "entry" } else { "entries" };
        return Some(format!("the port's P_Key table has {table_len} {entries}"));
    }
    if query_rc != 0 {
        return Some(format!("ibv_query_pkey failed ({})", errno_of(query_rc)));
    }
    // The low 15 bits name the partition; 0 is an empty slot.
    if pkey & 0x7fff == 0 {
        return Some(format!("the entry is empty (P_Key {pkey:#06x})"));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pkey_indices_must_name_a_partition() {
        assert_eq!(pkey_problem(0, 64, 0, 0xffff), None);
        assert_eq!(
            pkey_problem(3, 64, 0, 0x8001),
            None,
            "full member of partition 1"
        );
        assert!(pkey_problem(1, 64, 0, 0).unwrap().contains("empty"));
        assert!(pkey_problem(1, 64, 0, 0x8000).unwrap().contains("empty"));
        assert!(pkey_problem(1000, 64, 0, 0).unwrap().contains("64 entries"));
        assert!(pkey_problem(1, 1, 0, 0).unwrap().contains("has 1 entry"));
        assert!(pkey_problem(2, 64, libc::EINVAL, 0)
            .unwrap()
            .contains("ibv_query_pkey"));
    }

    #[test]
    fn masks_read_as_attribute_names() {
        let mask = ibv_qp_attr_mask::IBV_QP_STATE.0
            | ibv_qp_attr_mask::IBV_QP_AV.0
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU.0
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN.0
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN.0
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC.0
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0;
        assert_eq!(
            mask_names(mask),
            "STATE|AV|PATH_MTU|RQ_PSN|MIN_RNR_TIMER|MAX_DEST_RD_ATOMIC|DEST_QPN"
        );
        assert_eq!(
            mask_names(ibv_qp_attr_mask::IBV_QP_RATE_LIMIT.0),
            "RATE_LIMIT"
        );
    }

    #[test]
    fn states_have_names() {
        assert_eq!(state_name(ibv_qp_state::IBV_QPS_RTS), "RTS");
        assert_eq!(state_name(ibv_qp_state::IBV_QPS_ERR), "ERR");
    }

    #[test]
    fn timeouts_detect_a_silent_peer_in_about_a_second() {
        let per_try = 4.096e-6 * f64::from(1u32 << ACK_TIMEOUT);
        let total = per_try * f64::from(u32::from(RETRY_COUNT) + 1);
        assert!((0.3..2.0).contains(&total), "{total} s");
        const { assert!(RETRY_COUNT < 7, "rxe retries forever at 7") };
    }

    #[test]
    fn kernel_only_bits_are_21_to_23() {
        assert_eq!(mask_names(KERNEL_ONLY_BITS), "bit21|bit22|bit23");
    }
}
