//! One connection to an accounting instance: the hello, then fetch-and-adds
//! into slots and reads of them.
//!
//! Every call waits for its own completions, with a deadline: the poster
//! thread is the only user, and nothing here is on an invocation's path.
//! An error leaves the link unusable (drop it and open another); whether
//! the adds of a failed [`Link::add`] landed is unknown until the slot is
//! read back.

use std::time::{Duration, Instant};

use rfaas_fabric::{
    Access, Completion, CompletionQueue, Domain, Endpoint, EndpointOptions, Fabric, MemoryRegion,
    Opcode, RemoteAddr, RemoteDescriptor, Status,
};
use rfaas_proto::accounting::{
    slot_offset, word_offset, AccountingHello, AccountingReply, Counter, ReplyStatus, SlotTotals,
    REPLY_IMM, SLOT_LEN, SLOT_WORDS,
};
use rfaas_proto::ticket::AccountingTicket;

/// Where the service's reply lands in the local region.
const REPLY_OFF: usize = 0;
/// Where a slot read lands.
const READ_OFF: usize = 64;
/// Where the old values of fetch-and-adds land, one word per counter.
const FAA_OFF: usize = 128;
/// The local region's size.
const LOCAL_LEN: usize = 4096;

/// The receive posted for the reply.
const REPLY_WR: u64 = 1 << 40;

/// Why a link failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LinkError {
    /// The service refused the hello (a refused ticket, another release):
    /// retrying soon with the same ticket will not help.
    #[error("the accounting service refused this node: {0}")]
    Refused(&'static str),
    /// Anything that may pass: the service is down, slow, restarting, or
    /// its database is.
    #[error("{0}")]
    Transient(String),
}

fn transient(what: &str, e: impl std::fmt::Display) -> LinkError {
    LinkError::Transient(format!("{what}: {e}"))
}

/// A connected, accepted link.
pub(crate) struct Link {
    // Field order is drop order: the endpoint before its queue and memory.
    ep: Endpoint,
    cq: CompletionQueue,
    local: MemoryRegion,
    _domain: Domain,
    region: RemoteDescriptor,
    slots: u32,
    region_id: u64,
    next_wr: u64,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("peer", &self.ep.peer_addr())
            .field("slots", &self.slots)
            .field("region_id", &self.region_id)
            .finish_non_exhaustive()
    }
}

impl Link {
    /// Connects to `addr` on `fabric`, says the hello with `ticket`, and
    /// waits for the answer, all within `timeout`.
    pub(crate) fn open(
        fabric: &Fabric,
        addr: &str,
        ticket: &AccountingTicket,
        timeout: Duration,
    ) -> Result<Link, LinkError> {
        let deadline = Instant::now() + timeout;
        let domain = fabric
            .domain()
            .map_err(|e| transient("no protection domain", e))?;
        let mut cq = fabric
            .completion_queue(256)
            .map_err(|e| transient("no completion queue", e))?;
        let local = domain
            .register(LOCAL_LEN, Access::REMOTE_WRITE)
            .map_err(|e| transient("cannot register the link's buffer", e))?;
        let opts = EndpointOptions {
            send_depth: 128,
            recv_depth: 4,
            connect_timeout: timeout,
            // The region is the service's file; the token that named it
            // was signed by the manager.
            map_file_regions: true,
            ..EndpointOptions::default()
        };
        let ep = domain
            .connect(addr, &mut cq, &opts)
            .map_err(|e| transient(&format!("cannot connect to {addr}"), e))?;
        let mut link = Link {
            ep,
            cq,
            local,
            _domain: domain,
            region: RemoteDescriptor::default(),
            slots: 0,
            region_id: 0,
            next_wr: 1,
        };
        link.hello(ticket, deadline)?;
        Ok(link)
    }

    fn hello(&mut self, ticket: &AccountingTicket, deadline: Instant) -> Result<(), LinkError> {
        let reply_to = self.local.descriptor().at(REPLY_OFF as u64);
        let hello = AccountingHello {
            reply_addr: reply_to.addr,
            reply_rkey: reply_to.rkey,
            ticket: ticket.clone(),
        };
        let imms = hello
            .to_imms()
            .map_err(|e| LinkError::Transient(format!("the hello cannot be encoded: {e}")))?;
        self.ep
            .post_recv(REPLY_WR)
            .map_err(|e| transient("cannot post the reply's receive", e))?;
        let nowhere = RemoteAddr { addr: 0, rkey: 0 };
        for imm in imms {
            let wr = self.wr();
            self.ep
                .write_with_imm(wr, &self.local, 0, 0, nowhere, imm)
                .map_err(|e| transient("cannot send the hello", e))?;
        }
        let mut sent = 0;
        let mut reply = None;
        while sent < imms.len() || reply.is_none() {
            let c = self.next_completion(deadline, "the hello's answer")?;
            match (c.opcode, c.status) {
                (Opcode::WriteWithImm, Status::Success) => sent += 1,
                (Opcode::RecvWithImm, Status::Success) if c.imm == REPLY_IMM => {
                    let mut b = [0u8; AccountingReply::LEN];
                    self.local.read_into(REPLY_OFF, &mut b);
                    reply = Some(AccountingReply::decode(&b).map_err(|e| {
                        LinkError::Transient(format!("the service's answer is garbled: {e}"))
                    })?);
                }
                (_, status) => {
                    return Err(LinkError::Transient(format!(
                        "the hello failed: {status} (the service dropped the connection, or is not an rfaas accounting service)"
                    )))
                }
            }
        }
        let reply = reply.expect("loop ends with a reply");
        match reply.status {
            ReplyStatus::Accepted => {}
            ReplyStatus::Unavailable => {
                return Err(LinkError::Transient(
                    ReplyStatus::Unavailable.describe().into(),
                ))
            }
            other => return Err(LinkError::Refused(other.describe())),
        }
        self.region = RemoteDescriptor {
            addr: reply.region_addr,
            rkey: reply.region_rkey,
            len: 0,
        };
        self.slots = reply.slots;
        self.region_id = reply.region_id;
        Ok(())
    }

    /// The region's id, as the service's answer gave it.
    pub(crate) fn region_id(&self) -> u64 {
        self.region_id
    }

    /// The slots the region holds.
    pub(crate) fn slots(&self) -> u32 {
        self.slots
    }

    /// Adds each nonzero delta to its word of `slot`, and waits until every
    /// add completed. `Err` when any did not: which landed is unknown (read
    /// the slot).
    pub(crate) fn add(
        &mut self,
        slot: u32,
        deltas: &[u64; SLOT_WORDS],
        timeout: Duration,
    ) -> Result<(), LinkError> {
        self.check_slot(slot)?;
        let deadline = Instant::now() + timeout;
        let mut posted = 0;
        for c in Counter::ALL {
            let add = deltas[c.index()];
            if add == 0 {
                continue;
            }
            let wr = self.wr();
            let remote = self.region.at(word_offset(slot, c));
            self.ep
                .fetch_add(wr, &self.local, FAA_OFF + 8 * c.index(), remote, add)
                .map_err(|e| transient("cannot post an add", e))?;
            posted += 1;
        }
        for _ in 0..posted {
            let c = self.next_completion(deadline, "an add")?;
            if c.status != Status::Success {
                return Err(LinkError::Transient(format!(
                    "an add into slot {slot} failed: {}",
                    c.status
                )));
            }
        }
        Ok(())
    }

    /// Reads `slot`'s words.
    pub(crate) fn read_slot(
        &mut self,
        slot: u32,
        timeout: Duration,
    ) -> Result<SlotTotals, LinkError> {
        self.check_slot(slot)?;
        let deadline = Instant::now() + timeout;
        let wr = self.wr();
        let remote = self.region.at(slot_offset(slot));
        self.ep
            .read(wr, &self.local, READ_OFF, SLOT_LEN, remote)
            .map_err(|e| transient("cannot post a read", e))?;
        let c = self.next_completion(deadline, "a slot read")?;
        if c.status != Status::Success {
            return Err(LinkError::Transient(format!(
                "reading slot {slot} failed: {}",
                c.status
            )));
        }
        let mut b = [0u8; SLOT_LEN];
        self.local.read_into(READ_OFF, &mut b);
        SlotTotals::decode(&b).map_err(|e| LinkError::Transient(e.to_string()))
    }

    fn check_slot(&self, slot: u32) -> Result<(), LinkError> {
        if slot >= self.slots {
            // A manager that hands out slots a region lacks is misconfigured
            // (or the region was made smaller): nothing to add into.
            return Err(LinkError::Refused(
                "the lease names a slot beyond the accounting region; the instance's region was made smaller than when the slot was given",
            ));
        }
        Ok(())
    }

    fn wr(&mut self) -> u64 {
        self.next_wr += 1;
        self.next_wr
    }

    fn next_completion(&mut self, deadline: Instant, what: &str) -> Result<Completion, LinkError> {
        let mut out = [Completion::EMPTY; 1];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(LinkError::Transient(format!(
                    "the accounting service did not complete {what} in time"
                )));
            }
            let n = self
                .cq
                .wait(&mut out, left.min(Duration::from_millis(100)))
                .map_err(|e| transient("waiting for completions failed", e))?;
            if n == 1 {
                return Ok(out[0]);
            }
        }
    }
}
