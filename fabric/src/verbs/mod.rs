//! The verbs provider: real RDMA through libibverbs and librdmacm (`rdma-sys`).
//!
//! # Design
//!
//! - **Device.** [`VerbsFabric::open`] finds the device by name among
//!   librdmacm's contexts (`rdma_get_devices`), so protection domains, CQs and
//!   QPs live on the same `ibv_context` that rdma_cm binds connection ids to
//!   (a QP must share its PD's context with the id). The list is held until
//!   the fabric is dropped, which keeps librdmacm from closing the context.
//!   `ibv_fork_init` runs once per process first: executors spawn workers,
//!   and registered pages must not become copy-on-write in the parent.
//! - **Domains and regions.** One `ibv_pd` per [`VerbsDomain`]; a region is a
//!   memfd-backed [`crate::Buffer`] registered with `ibv_reg_mr` (local write
//!   always, remote rights per [`crate::Access`]). [`MrHandle`] deregisters on
//!   drop and holds the domain, so an MR never outlives its PD. rkeys are
//!   checked by the NIC, per PD: an rkey of another domain fails the access.
//! - **Completion queues.** [`VerbsCq`] owns an `ibv_cq` with a completion
//!   channel. `poll` reads into a preallocated `ibv_wc` array (hot path: no
//!   allocation, no lock, no log). `wait` polls, arms, polls again (so a
//!   completion that slipped in before arming is not missed), then sleeps in
//!   poll(2) on the channel. Every outstanding work request holds a slot of
//!   the CQ's [`slots::SlotTable`], which remembers the opcode (undefined in
//!   error completions), keeps the local buffer alive until the completion is
//!   polled, and bounds outstanding requests by the CQ depth (no overrun).
//! - **Connections.** rdma_cm with an event channel per connection. The
//!   provider creates the RC QP itself (`ibv_create_qp`) and drives it through
//!   INIT, RTR and RTS with `rdma_init_qp_attr` plus overrides, so it can set
//!   what rdma_cm does not: service level (`ah_attr.sl`), P_Key index
//!   (checked against the port's table), local ACK timeout 14 (≈ 67 ms) with
//!   retry count 6 (a silent peer is noticed in about half a second; not 7,
//!   which Soft-RoCE takes as "forever"), RNR retry 7 (infinite: a
//!   write-with-immediate waits for the peer to post a receive), a short RNR
//!   timer, and read/atomic depths.
//!   Active side: resolve address and route, create QP, INIT, `rdma_connect`,
//!   CONNECT_RESPONSE, RTR, RTS, `rdma_establish`. Passive side: CONNECT_REQUEST,
//!   migrate the id to its own channel, create QP, INIT, RTR, RTS,
//!   `rdma_accept`, ESTABLISHED. Private data carries a small hello
//!   ([`hello`]) checked by both sides.
//! - **GIDs.** With RoCE the source GID comes from rdma_cm: address
//!   resolution binds the id to the netdev that owns the local IP, and
//!   `rdma_init_qp_attr(RTR)` fills `ah_attr.grh.sgid_index` with the GID of
//!   that IP in the kernel's default rdma_cm GID type (RoCE v2 on current
//!   kernels: the IPv4-mapped GID `::ffff:a.b.c.d`). The provider never picks
//!   a GID index itself; `qp_attributes` reports the chosen one and whether
//!   it is the IPv4-mapped GID of the local address ([`gid`]).
//! - **Peer loss.** A monitor thread per fabric watches every connection's
//!   event channel (epoll). On RDMA_CM_EVENT_DISCONNECTED or DEVICE_REMOVAL
//!   it records the connection's fate and moves the QP to ERR, so every
//!   outstanding request and posted receive completes at once with
//!   [`crate::Status::PeerLost`]; later posts complete with PeerLost too,
//!   through the CQ without reaching the NIC, as on every provider. A peer
//!   that vanishes without a word is caught by the transport retries
//!   (RETRY_EXC_ERR → PeerLost).
//! - **RC semantics.** As on any RC queue pair, the first error completion
//!   from the NIC (a bad rkey, an rkey of another domain, an out-of-bounds
//!   access, a missing right) moves the QP to the error state: the access is
//!   refused with the target's memory untouched, and every later post on that
//!   endpoint fails with [`crate::Error::Disconnected`]. Reconnect to go on.
//!   An atomic on an unaligned remote word never reaches the NIC (providers
//!   disagree on it: rxe refuses the post, NICs fail it at the target): the
//!   provider completes it itself with [`crate::Status::RemoteOperation`]
//!   through the CQ, and the endpoint stays usable.
//! - **Teardown.** Dropping an endpoint moves its QP to ERR, sends a
//!   disconnect, destroys the QP, then the cm id and its event channel; its
//!   still-outstanding requests are discarded (their slots reclaimed, stale
//!   completions skipped). QPs hold their CQ and domain, MRs their domain,
//!   domains and CQs the fabric, so destruction always runs QP → CQ → PD →
//!   context. CQ events are acknowledged before the CQ is destroyed.
//!
//! - **Service level.** Applied in the address vector at RTR. Soft-RoCE does
//!   not keep it (ibv_query_qp reports 0 there); RoCE NICs map it to an
//!   Ethernet priority, InfiniBand to a virtual lane.
//!
//! # What runs where
//!
//! The build machines have no RDMA device. Unit tests here cover the pure
//! logic (status and opcode mapping, slot table, hello, addresses, device,
//! GID and P_Key checks, error texts) and run everywhere. Everything that
//! touches a device — opening, registration, connection set-up, QP
//! attributes, data operations, error completions, peer loss (closed, killed
//! and silent peers), fork safety — is exercised only under Soft-RoCE
//! (`rdma_rxe`) inside a VM: those tests (`tests.rs`) are `#[ignore]`d with
//! the reason, so a plain `cargo test` shows them as skipped. The VM stage
//! (`scripts/test-verbs.sh`) builds the test binary on the host and runs it
//! in the guest with `verbs::tests:: --include-ignored`, where `RDMA_DEVICE`
//! and `RDMA_VM_IP` are set (one VM boot for it and the conformance suite's
//! verbs cases); `scripts/test-verbs-two-node.sh` checks connections between
//! two guest kernels. Not covered there: device removal,
//! InfiniBand link layers, real NICs (which may purge a destroyed QP's
//! completions and do keep the SL), and IPv6 rdma_cm addresses.
//!
//! # Files
//!
//! - [`connect`]: connection set-up over rdma_cm, both sides.
//! - [`conn`]: an established connection; [`fate`]: what became of it.
//! - [`endpoint`]: the data path: posting work requests.
//! - [`cq`]: completion queues, `poll` and `wait`; [`slots`]: what each
//!   outstanding work request needs at its completion.
//! - [`device`]: the opened device, its limits and ports.
//! - [`domain`]: protection domains and memory registration; [`pd`]: the
//!   `ibv_pd` and its memory regions.
//! - [`qp`]: queue pair creation and state transitions; [`cm`]: rdma_cm
//!   ids and event channels; [`monitor`]: the peer-loss monitor thread.
//! - [`hello`], [`gid`], [`sys`]: the connection hello, GID checks, and
//!   system-call helpers.

mod cm;
mod conn;
mod connect;
mod cq;
mod device;
mod domain;
mod endpoint;
mod fate;
pub(crate) mod gid;
mod hello;
mod monitor;
mod pd;
mod qp;
mod slots;
mod sys;
#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::{Arc, Once};
use std::time::Duration;

use rdma_sys::{
    ___ibv_query_port, ibv_device_attr, ibv_fork_init, ibv_get_device_name, ibv_port_attr,
    ibv_port_state, ibv_query_device, rdma_free_devices, rdma_get_devices,
};

pub(crate) use connect::VerbsListener;
pub(crate) use cq::VerbsCq;
pub(crate) use domain::VerbsDomain;
pub(crate) use endpoint::VerbsEndpoint;

use crate::error::{Error, Result};
use crate::memory::{Access, Buffer, MemoryRegion};
use crate::provider;
use crate::EndpointOptions;
use device::{DeviceLimits, FabricInner, PortInfo};
use monitor::Monitor;
use sys::{c_str, errno_of, verb_error};

/// Reads and atomics one side may have in flight towards the other (capped
/// by the device's limits).
const RD_ATOMIC_DEPTH: u8 = 16;

/// The verbs provider opened on one device.
pub(crate) struct VerbsFabric {
    inner: Arc<FabricInner>,
}

impl fmt::Debug for VerbsFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsFabric")
            .field("device", &self.inner.device)
            .finish()
    }
}

static FORK_INIT: Once = Once::new();

/// Makes registered memory survive fork (workers are spawned by executors):
/// `ibv_fork_init` marks registered pages MADV_DONTFORK. A no-op on kernels
/// that handle fork themselves (5.13+).
fn fork_init_once() {
    FORK_INIT.call_once(|| {
        // SAFETY: no preconditions; it must run before memory is registered,
        // which Once plus "first thing in open" ensure for this crate.
        let rc = unsafe { ibv_fork_init() };
        if rc != 0 {
            tracing::warn!(
                error = %errno_of(rc),
                "ibv_fork_init failed: memory registered before it may break in processes that fork; \
                 open the verbs fabric before anything else registers memory"
            );
        }
    });
}

/// Picks `wanted` among the device names, or says why not (the
/// `ProviderUnavailable` reason).
pub(crate) fn pick_device(names: &[String], wanted: &str) -> std::result::Result<usize, String> {
    if let Some(i) = names.iter().position(|n| n == wanted) {
        return Ok(i);
    }
    if names.is_empty() {
        return Err(format!(
            "RDMA device {wanted} not found: librdmacm sees no RDMA device on this machine. \
             Load a driver, or for Soft-RoCE run `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <ifname>`; \
             without RDMA hardware use the `tcp` provider"
        ));
    }
    let list = names.join(", ");
    let first = &names[0];
    Err(format!(
        "RDMA device {wanted} not found; devices present: {list}. \
         Use one of them (e.g. `verbs:{first}`); `rdma link` and `ibv_devices` list them"
    ))
}

/// Says why no port of `device` can carry traffic, if none is ACTIVE.
pub(crate) fn port_problem(device: &str, ports: &[PortInfo]) -> Option<String> {
    if ports
        .iter()
        .any(|p| p.state == ibv_port_state::IBV_PORT_ACTIVE)
    {
        return None;
    }
    let states: Vec<String> = ports
        .iter()
        .map(|p| format!("port {} is {}", p.num, port_state_name(p.state)))
        .collect();
    Some(format!(
        "RDMA device {device} has no ACTIVE port ({}). Bring its network interface up \
         (`ip link set <ifname> up`; `rdma link` shows which one), check the cable, or on \
         InfiniBand make sure a subnet manager runs",
        if states.is_empty() {
            "it reports no ports".to_owned()
        } else {
            states.join(", ")
        }
    ))
}

fn port_state_name(state: u32) -> &'static str {
    match state {
        ibv_port_state::IBV_PORT_NOP => "NOP",
        ibv_port_state::IBV_PORT_DOWN => "DOWN",
        ibv_port_state::IBV_PORT_INIT => "INIT",
        ibv_port_state::IBV_PORT_ARMED => "ARMED",
        ibv_port_state::IBV_PORT_ACTIVE => "ACTIVE",
        ibv_port_state::IBV_PORT_ACTIVE_DEFER => "ACTIVE_DEFER",
        _ => "in an unknown state",
    }
}

fn unavailable(device: &str, reason: String) -> Error {
    Error::ProviderUnavailable {
        provider: format!("verbs:{device}"),
        reason,
    }
}

impl VerbsFabric {
    /// Opens the RDMA device named `device` (e.g. `rxe0`, `mlx5_0`).
    pub(crate) fn open(device: &str) -> Result<VerbsFabric> {
        fork_init_once();

        let mut count: libc::c_int = 0;
        // SAFETY: count is a valid out-pointer; the list is freed in Drop or below.
        let devices = unsafe { rdma_get_devices(&mut count) };
        if devices.is_null() {
            let why = std::io::Error::last_os_error();
            return Err(unavailable(
                device,
                format!(
                    "librdmacm cannot list RDMA devices ({why}). Is the rdma_ucm module loaded and \
                     /dev/infiniband/rdma_cm accessible? Without RDMA hardware use the `tcp` provider"
                ),
            ));
        }
        // From here the list must be freed on every error path.
        let free_list = |devices| {
            // SAFETY: freed once, on an error path, before anything uses it.
            unsafe { rdma_free_devices(devices) }
        };

        let mut contexts = Vec::new();
        let mut names = Vec::new();
        for i in 0..usize::try_from(count).unwrap_or(0) {
            // SAFETY: the list holds `count` valid contexts followed by NULL.
            let ctx = unsafe { *devices.add(i) };
            if ctx.is_null() {
                break;
            }
            // SAFETY: ctx is an open context; its device name is a static C string.
            let name = unsafe { c_str(ibv_get_device_name((*ctx).device)) };
            contexts.push(ctx);
            names.push(name);
        }
        let ctx = match pick_device(&names, device) {
            Ok(i) => contexts[i],
            Err(reason) => {
                free_list(devices);
                return Err(unavailable(device, reason));
            }
        };

        // SAFETY: ibv_device_attr is plain old data.
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is open (the list holds it); attr is a valid out-pointer.
        let rc = unsafe { ibv_query_device(ctx, &mut attr) };
        if rc != 0 {
            free_list(devices);
            return Err(verb_error("ibv_query_device", device, errno_of(rc)));
        }

        let mut ports = Vec::new();
        for num in 1..=attr.phys_port_cnt {
            // SAFETY: ibv_port_attr is plain old data.
            let mut port: ibv_port_attr = unsafe { std::mem::zeroed() };
            // SAFETY: ctx is open; port is a valid out-pointer of the full
            // (current) size, which ___ibv_query_port passes on.
            let rc = unsafe { ___ibv_query_port(ctx, num, &mut port) };
            if rc != 0 {
                free_list(devices);
                return Err(verb_error("ibv_query_port", device, errno_of(rc)));
            }
            ports.push(PortInfo {
                num,
                state: port.state,
                link_layer: port.link_layer,
                gid_tbl_len: u32::try_from(port.gid_tbl_len.max(0)).unwrap_or(0),
                pkey_tbl_len: port.pkey_tbl_len,
            });
        }
        if let Some(reason) = port_problem(device, &ports) {
            free_list(devices);
            return Err(unavailable(device, reason));
        }

        let clamp = |v: libc::c_int| {
            u8::try_from(v.max(0))
                .unwrap_or(u8::MAX)
                .min(RD_ATOMIC_DEPTH)
        };
        let limits = DeviceLimits {
            max_qp_wr: u32::try_from(attr.max_qp_wr.max(0)).unwrap_or(0),
            max_cqe: u32::try_from(attr.max_cqe.max(0)).unwrap_or(0),
            responder_resources: clamp(attr.max_qp_rd_atom),
            initiator_depth: clamp(attr.max_qp_init_rd_atom),
        };

        let monitor = match Monitor::start(device) {
            Ok(m) => m,
            Err(e) => {
                free_list(devices);
                return Err(e);
            }
        };
        tracing::debug!(device, ?limits, ?ports, "verbs fabric opened");
        Ok(VerbsFabric {
            inner: Arc::new(FabricInner {
                device: device.to_owned(),
                ctx,
                devices,
                limits,
                ports,
                monitor,
            }),
        })
    }
}

impl provider::Provider for VerbsFabric {
    type Domain = VerbsDomain;
    type Cq = VerbsCq;
    type Listener = VerbsListener;
    type Endpoint = VerbsEndpoint;

    fn domain(&self) -> Result<VerbsDomain> {
        VerbsDomain::new(self.inner.clone())
    }

    fn completion_queue(&self, depth: usize) -> Result<VerbsCq> {
        VerbsCq::new(self.inner.clone(), depth)
    }

    /// Listens on `addr` (`ip:port`, port 0 picks one).
    fn listen(&self, addr: &str) -> Result<VerbsListener> {
        VerbsListener::new(self.inner.clone(), addr)
    }
}

impl provider::Domain<VerbsFabric> for VerbsDomain {
    fn id(&self) -> u64 {
        self.inner().id
    }

    fn register_buffer(&self, buf: Buffer, access: Access) -> Result<MemoryRegion> {
        self.register_mr(buf, access)
    }

    fn connect(
        &self,
        addr: &str,
        cq: &mut VerbsCq,
        opts: &EndpointOptions,
    ) -> Result<VerbsEndpoint> {
        self.dial(addr, cq, opts)
    }
}

impl provider::Listener<VerbsFabric> for VerbsListener {
    fn local_addr(&self) -> String {
        self.local()
    }

    fn accept(
        &self,
        domain: &VerbsDomain,
        cq: &mut VerbsCq,
        opts: &EndpointOptions,
        timeout: Option<Duration>,
    ) -> Result<VerbsEndpoint> {
        self.accept_into(domain.inner(), cq, opts, timeout)
    }
}

#[cfg(test)]
mod unit_tests {
    use super::device::LINK_LAYER_ETHERNET;
    use super::*;

    #[test]
    fn a_missing_device_lists_the_present_ones() {
        let names = vec!["rxe0".to_owned(), "mlx5_0".to_owned()];
        assert_eq!(pick_device(&names, "mlx5_0"), Ok(1));
        let reason = pick_device(&names, "rxe9").unwrap_err();
        assert!(reason.contains("rxe9"), "{reason}");
        assert!(reason.contains("rxe0, mlx5_0"), "{reason}");
        assert!(reason.contains("verbs:rxe0"), "{reason}");
    }

    #[test]
    fn no_device_at_all_says_how_to_get_one() {
        let reason = pick_device(&[], "rxe0").unwrap_err();
        assert!(reason.contains("rdma link add"), "{reason}");
        assert!(reason.contains("tcp"), "{reason}");
    }

    #[test]
    fn a_down_port_is_named() {
        let down = [PortInfo {
            num: 1,
            state: ibv_port_state::IBV_PORT_DOWN,
            link_layer: LINK_LAYER_ETHERNET,
            gid_tbl_len: 16,
            pkey_tbl_len: 1,
        }];
        let reason = port_problem("rxe0", &down).unwrap();
        assert!(
            reason.contains("rxe0") && reason.contains("port 1 is DOWN"),
            "{reason}"
        );
        let up = [PortInfo {
            state: ibv_port_state::IBV_PORT_ACTIVE,
            ..down[0]
        }];
        assert_eq!(port_problem("rxe0", &up), None);
    }
}
