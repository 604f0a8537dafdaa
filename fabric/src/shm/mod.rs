//! The `shm` provider: one-sided operations between processes of one node,
//! through shared memory mapped from memfds.
//!
//! # Design
//!
//! - **Connections.** A listener is a unix stream socket at a path (never
//!   an abstract name), accepting peers of its own user or root only.
//!   Each side of a new connection creates its *inbound immediate ring*
//!   (a memfd) and a *wake-up socket pair*, and passes the ring, one end
//!   of the pair and its domain's read-only *validity table* in a hello
//!   (magic, version, depths) with SCM_RIGHTS. The socket stays open as the control channel
//!   ([`rfaas_proto::shm_control`]).
//! - **Grants.** Operations are one-sided: the initiator copies straight
//!   into or out of its mapping of the target's memory. Before the first
//!   access to an rkey it asks the target for it; the target looks the rkey
//!   up in the registry of the endpoint's own domain (an rkey of another
//!   domain never matches) and answers with base, length, rights, a serial
//!   and the region's memfd. A region without remote write or atomic rights
//!   goes out as a read-only file description, so the kernel refuses a
//!   writable mapping. The initiator caches the mapping per endpoint; a
//!   cached access takes no lock, no syscall and no allocation. A readable
//!   region with write rights is mapped a second time read-only, for
//!   [`crate::Endpoint::peer_view`] (in-place reads).
//! - **Checks.** The initiator's library checks bounds and rights on every
//!   access against the grant, and the rkey's current serial in the target
//!   domain's validity table (one atomic load). A refused access completes
//!   with [`Status::RemoteAccess`](crate::Status::RemoteAccess) before any
//!   byte moves; an unaligned atomic with `RemoteOperation`. Atomics are
//!   `AtomicU64` operations on the shared page, so adds from any number of
//!   processes sum exactly. Zero-length writes and reads check no rkey, like a NIC.
//! - **Revocation.** Dropping a region clears its serial in the validity
//!   table before the registry slot is freed; later accesses fail with
//!   `RemoteAccess` and drop the cached mapping (mappings of revoked
//!   regions are also swept whenever a new grant is fetched). Race window:
//!   an access that read the serial just before the clear completes after
//!   it. It can only reach the pages of the region being dropped (every
//!   region has its own memfd, and serials never repeat), which no new
//!   region reuses.
//! - **Immediates.** A write-with-immediate copies the bytes, then appends
//!   `{imm, byte_len}` to the target's inbound ring ([`ring`]: single
//!   producer, single consumer, head and tail doorbells on their own cache
//!   lines). The target's `poll` pairs notifications with posted receives in
//!   order. Without a posted receive a notification waits in the ring (like
//!   RNR retry); the ring holds `recv_depth` entries (rounded up to a power
//!   of two, at least 16), and when it is full the write returns
//!   [`crate::Error::QueueFull`] before copying anything: a sender that
//!   never has more immediates in flight than receives posted never sees it.
//! - **Completions.** Local completions are pushed at post time into the
//!   CQ's lock-free queue; room is reserved first, so a full queue (or more
//!   than `send_depth` unpolled completions of one endpoint) makes the post
//!   return `QueueFull` and do nothing. `poll` drains that queue and every
//!   attached ring: atomics only.
//! - **Wake-up.** `wait` announces "sleeping on a futex" in its own flag and
//!   in every attached ring, reads the futex words (its private one and each
//!   ring's, next to the ring's flag), fences, polls once more, then sleeps
//!   in `futex_waitv` on those words with the values read. A producer
//!   publishes, fences, and only if it sees the announcement clears it,
//!   bumps the word and calls `FUTEX_WAKE` (shared for a ring word, which
//!   lives in a memfd both processes map; private for the CQ's own word,
//!   bumped by local completions, `wake` and the progress thread's peer-loss
//!   notice): no missed wake-up (the kernel compares the word before
//!   sleeping), and no syscall on the hot path while the target polls. The
//!   timeout is an absolute `CLOCK_MONOTONIC` time, not rounded to
//!   milliseconds.
//!
//!   Fallback: when `futex_waitv` is missing (Linux < 5.16: `ENOSYS` on
//!   first use, or refused by a seccomp filter) or more than 127 endpoints
//!   are attached (`FUTEX_WAITV_MAX` is 128 words), `wait` announces
//!   "sleeping on the socket" instead and sleeps in `epoll_wait` on a
//!   private eventfd and the *wake-up sockets* (one pair per connection, one
//!   end passed in the hello); the producer then sends one byte with
//!   `MSG_DONTWAIT`. The flag's value tells the producer which to do.
//!
//!   Isolation: a peer can touch only the ring it was given, so corrupting
//!   that ring's flag or futex word can cause spurious wake-ups of our CQ
//!   (at worst a busy `wait`) or lose its *own* wake-ups, never another
//!   peer's: every other word we sleep on lives in pages that peer does not
//!   map, and `futex_waitv` returns as soon as any one word changes or is
//!   woken. The same holds for the wake-up sockets: each peer holds only its
//!   own.
//! - **Progress and peer loss.** One progress thread per process ([`progress`],
//!   started lazily) serves grant requests with epoll over all control
//!   sockets, so a target that never polls stays accessible. When a socket
//!   hangs up (the peer died or dropped its endpoint) the connection is
//!   marked lost: notifications published before the loss still pair with
//!   receives; the other posted receives, later receives and every later
//!   operation complete with `PeerLost`, and the CQ is woken (its private
//!   futex word and its eventfd, whichever it sleeps on). Dropping an
//!   endpoint flushes its own posted receives (`Flushed`). Memory we mapped
//!   stays mapped until our endpoint drops, so a peer dying mid-operation
//!   cannot crash us; all shared memory is sealed against shrinking (no
//!   SIGBUS), except a region its owner keeps in a file
//!   ([`crate::Buffer::map_file`]), which a peer maps only when connected
//!   with `EndpointOptions::map_file_regions`. A grant request the peer's progress thread leaves unanswered
//!   for 5 s (a stopped process) also counts as loss.
//!
//! # Trust model
//!
//! Same-node peers see only the regions granted to them, on connections to
//! endpoints of the region's domain. rkeys are not secrets: who may connect
//! is the access control: a socket path's permissions, and the peer's user
//! as the kernel reports it (`SO_PEERCRED`), which must be the listener's
//! own or root. Abstract names, reachable by every process in the network
//! namespace, are refused. The rfaas layers above authenticate connections
//! with lease tokens.
//!
//! The kernel enforces "no write" for regions without remote write or atomic
//! rights; finer distinctions (read vs. atomic, bounds inside a writable
//! region) are enforced by this library in the initiator, so a hostile
//! process granted a writable region can write all of it, and nothing else.
//! Revocation binds honest peers only: a hostile one may keep the memfd of a
//! dropped region, whose pages no new region reuses. A file-backed region
//! is granted as the file's own descriptor: a peer granted it may also
//! truncate the file, which faults its owner, so its owner lets only
//! peers it trusts connect (the accounting service's socket). Everything a peer
//! writes (ring counters, hellos, grant replies, descriptors) is validated
//! before use: memfds must be sealed and long enough (files, where
//! accepted, long enough), the wake-up
//! descriptor must be a socket, counters must be possible. What it writes
//! to wake us (its ring's flag and futex word, its socket's bytes) can only
//! end or skip one of our sleeps (see "Wake-up").
//!
//! # Files
//!
//! - the hello and grant messages are `rfaas_proto::shm_control`.
//! - [`ring`]: the immediate ring and its doorbells.
//! - [`cq`]: the completion queue, `poll` and the wake-up protocol of `wait`;
//!   [`queue`]: the part of it endpoints hold.
//! - [`domain`]: a protection domain's region and validity tables.
//! - [`connect`]: connection set-up (dialling, the hello exchange).
//! - [`endpoint`]: the data path: the one-sided operations.
//! - [`grant`]: the peer's regions mapped here, fetched and cached.
//! - [`link`]: per-connection state shared with the CQ and the progress thread.
//! - [`progress`]: the progress thread.
//! - [`listener`]: listening sockets and `accept`.
//! - [`sys`]: system-call wrappers.

mod connect;
mod cq;
mod domain;
mod endpoint;
mod grant;
mod link;
mod listener;
mod progress;
mod queue;
mod ring;
mod sys;

#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub(crate) use cq::ShmCq;
pub(crate) use endpoint::ShmEndpoint;
pub(crate) use listener::ShmListener;

use domain::DomainState;

use crate::error::Result;
use crate::memory::{Access, Buffer, MemoryRegion};
use crate::provider;
use crate::EndpointOptions;

/// The shm provider.
#[derive(Debug)]
pub(crate) struct ShmFabric;

impl ShmFabric {
    pub(crate) fn open() -> Result<Self> {
        Ok(ShmFabric)
    }
}

impl provider::Provider for ShmFabric {
    type Domain = ShmDomain;
    type Cq = ShmCq;
    type Listener = ShmListener;
    type Endpoint = ShmEndpoint;

    fn domain(&self) -> Result<ShmDomain> {
        Ok(ShmDomain {
            state: DomainState::new()?,
        })
    }

    fn completion_queue(&self, depth: usize) -> Result<ShmCq> {
        ShmCq::new(depth)
    }

    fn listen(&self, addr: &str) -> Result<ShmListener> {
        ShmListener::bind(addr)
    }
}

/// Source of registration serials; 0 means "no region".
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

impl provider::Listener<ShmFabric> for ShmListener {
    fn accept(
        &self,
        domain: &ShmDomain,
        cq: &mut ShmCq,
        opts: &EndpointOptions,
        timeout: Option<Duration>,
    ) -> Result<ShmEndpoint> {
        self.accept_into(&domain.state, cq, opts, timeout)
    }

    fn local_addr(&self) -> String {
        self.local()
    }
}

/// A protection domain of the shm provider.
#[derive(Debug)]
pub(crate) struct ShmDomain {
    state: Arc<DomainState>,
}

impl provider::Domain<ShmFabric> for ShmDomain {
    fn id(&self) -> u64 {
        self.state.registry.id()
    }

    fn register_buffer(&self, buf: Buffer, access: Access) -> Result<MemoryRegion> {
        let buf = Arc::new(buf);
        let (rkey, guard) = self.state.registry.insert(buf.clone(), access)?;
        let serial = NEXT_SERIAL.fetch_add(1, Ordering::Relaxed);
        self.state.word(rkey).store(serial, Ordering::Release);
        let state = self.state.clone();
        let guard = guard.on_release(Box::new(move || {
            // Revoke first: peers check this word before every access.
            let _ =
                state
                    .word(rkey)
                    .compare_exchange(serial, 0, Ordering::AcqRel, Ordering::Relaxed);
        }));
        Ok(MemoryRegion {
            buf,
            rkey,
            lkey: rkey,
            access,
            domain_id: self.state.registry.id(),
            _registration: Box::new(guard),
        })
    }

    fn connect(&self, addr: &str, cq: &mut ShmCq, opts: &EndpointOptions) -> Result<ShmEndpoint> {
        connect::connect(addr, &self.state, cq, opts)
    }
}
