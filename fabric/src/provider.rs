//! The contract of a provider: what tcp, shm and verbs each implement, and
//! what the public types in `lib.rs` call.
//!
//! A provider is a [`Provider`] (the opened transport) with four object
//! kinds: a [`Domain`], a [`CompletionQueue`], a [`Listener`] and an
//! [`Endpoint`]. The public [`crate::Fabric`], [`crate::Domain`],
//! [`crate::CompletionQueue`], [`crate::Listener`] and [`crate::Endpoint`]
//! hold one provider's object in an enum and call it through these traits:
//! a `match` over concrete types, so the hot path has no virtual call.
//!
//! # Hot path
//!
//! [`CompletionQueue::poll`], [`Endpoint::write`] (with and without an
//! immediate), [`Endpoint::write_batch`] and [`Endpoint::post_recv`] are
//! the invocation path: they
//! never block, allocate, wait for a lock or log, except on an error path.
//! [`Endpoint::read`], the atomics and [`Endpoint::peer_view`] follow the
//! same rule once set up (shm maps a region on its first use). Everything
//! else is set-up or the warm path and may sleep.
//!
//! # Errors
//!
//! An `Err` is a local, synchronous failure: the call did nothing and no
//! completion will come for it. [`Error::QueueFull`](crate::Error::QueueFull)
//! when a send, receive or completion queue has no room (poll, then post
//! again); [`Error::Disconnected`](crate::Error::Disconnected) when the
//! connection can take no more work (verbs, after an error completion of
//! its own); [`Error::InvalidArgument`](crate::Error::InvalidArgument) for
//! a request the provider cannot express. Everything that happens at the
//! peer, or on the way there, is a [`Completion`] with a [`Status`],
//! including every operation posted after the peer was lost
//! ([`Status::PeerLost`]): an `Ok` post always ends in exactly one
//! completion.
//!
//! # What the caller checked
//!
//! Local memory reaches a provider only as a [`Local`] or [`LocalWord`],
//! which `lib.rs` builds after checking the range against the region and
//! the region's domain against the endpoint's. Providers rely on it for
//! memory safety: they copy to and from those bytes, and hand them to the
//! NIC.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::completion::{Completion, Status};
use crate::error::{Error, Result};
use crate::memory::WriteRequest;
use crate::memory::{Access, Buffer, MemoryRegion, PeerView, RemoteAddr};
use crate::EndpointOptions;

/// An opened provider: the factory of its domains, completion queues and
/// listeners.
pub(crate) trait Provider: fmt::Debug + Send + Sync + Sized {
    /// Its protection domains.
    type Domain: Domain<Self>;
    /// Its completion queues.
    type Cq: CompletionQueue;
    /// Its listeners.
    type Listener: Listener<Self>;
    /// Its connected endpoints.
    type Endpoint: Endpoint;

    /// A new protection domain.
    fn domain(&self) -> Result<Self::Domain>;

    /// A new completion queue holding up to `depth` (> 0) completions.
    fn completion_queue(&self, depth: usize) -> Result<Self::Cq>;

    /// Listens on `addr`, in the provider's address syntax (docs/fabric.md).
    fn listen(&self, addr: &str) -> Result<Self::Listener>;
}

/// A protection domain: regions and endpoints that may name each other. An
/// rkey of this domain is refused on endpoints of any other.
pub(crate) trait Domain<P: Provider>: fmt::Debug + Send + Sync {
    /// The domain's id, unique in the process; regions carry it, so
    /// `lib.rs` can refuse a region of another domain before posting.
    fn id(&self) -> u64;

    /// Registers `buf` with `access`; the region's `domain_id` is
    /// [`Domain::id`].
    fn register_buffer(&self, buf: Buffer, access: Access) -> Result<MemoryRegion>;

    /// Connects to a listener at `addr`; the endpoint's completions, and
    /// those of receives the peer consumes, go to `cq`. Fails with
    /// `Error::Timeout` past `opts.connect_timeout`, `Error::Connect` when
    /// the peer refuses or is not there, and `Error::InvalidArgument` when
    /// `cq` is too shallow for the endpoint's depths.
    fn connect(&self, addr: &str, cq: &mut P::Cq, opts: &EndpointOptions) -> Result<P::Endpoint>;
}

/// A passive endpoint: hands out connections.
pub(crate) trait Listener<P: Provider>: fmt::Debug + Send + Sync {
    /// Accepts one connection into `domain`, its completions going to `cq`,
    /// waiting at most `timeout` (forever with `None`: `Error::Timeout`
    /// past it). A peer whose opening message does not arrive within
    /// `opts.connect_timeout` is given up with `Error::Connect`.
    fn accept(
        &self,
        domain: &P::Domain,
        cq: &mut P::Cq,
        opts: &EndpointOptions,
        timeout: Option<Duration>,
    ) -> Result<P::Endpoint>;

    /// The address peers connect to, with the port chosen when 0 was asked.
    fn local_addr(&self) -> String;
}

/// A completion queue fed by one or more endpoints.
pub(crate) trait CompletionQueue: fmt::Debug + Send {
    /// Moves up to `out.len()` completions into `out` and returns how many.
    /// Hot path: never blocks, allocates, waits for a lock or logs. Where
    /// the provider has no NIC (tcp) it also drives its endpoints here.
    fn poll(&mut self, out: &mut [Completion]) -> usize;

    /// Like `poll`, but sleeps in the kernel until a completion is ready
    /// or `timeout` passes (then `Ok(0)`). Warm path. `Err` only when the
    /// kernel refuses the sleep.
    fn wait(&mut self, out: &mut [Completion], timeout: Duration) -> Result<usize>;
}

/// A connected endpoint. `Send`, not necessarily `Sync`: one thread at a
/// time posts on it (the public [`crate::Endpoint`] is never `Sync`).
///
/// Every post that returns `Ok` ends in exactly one completion on the
/// endpoint's completion queue (see the module doc for what `Err` means),
/// but an unsignaled write that succeeds, which ends in none; the peer
/// sees this endpoint's immediates in posting order.
pub(crate) trait Endpoint: fmt::Debug + Send {
    /// Writes `w.local` to `w.remote`; with `w.imm`, then consumes one
    /// receive posted at the peer, which completes with the immediate and
    /// the length. Hot path: this is an invocation's request and response.
    fn write(&self, w: Write<'_>) -> Result<()>;

    /// Posts the writes of a non-empty batch in order, each completing as
    /// if posted alone with `write`. Hot path.
    ///
    /// All or nothing: a provider claims room for the whole batch before
    /// it posts any, so `Err` means none was posted (`QueueFull` when
    /// there is no room now, `InvalidArgument` when the batch is longer
    /// than the send queue is deep). The default posts one by one: correct,
    /// but a full queue midway leaves the writes before it posted, so every
    /// provider here overrides it.
    fn write_batch(&self, writes: Writes<'_>) -> Result<()> {
        for w in writes.iter() {
            self.write(w)?;
        }
        Ok(())
    }

    /// Reads `local.len()` bytes at `remote` into `local`.
    fn read(&self, wr_id: u64, local: Local<'_>, remote: RemoteAddr) -> Result<()>;

    /// Adds `add` to the word at `remote`; the old value lands in `local`.
    /// An unaligned `remote` completes with `Status::RemoteOperation`.
    fn fetch_add(
        &self,
        wr_id: u64,
        local: LocalWord<'_>,
        remote: RemoteAddr,
        add: u64,
    ) -> Result<()>;

    /// Replaces the word at `remote` with `swap` if it equals `compare`;
    /// the old value lands in `local`.
    fn compare_swap(
        &self,
        wr_id: u64,
        local: LocalWord<'_>,
        remote: RemoteAddr,
        compare: u64,
        swap: u64,
    ) -> Result<()>;

    /// Posts a receive for the peer's next write-with-immediate. Hot path.
    fn post_recv(&self, wr_id: u64) -> Result<()>;

    /// In-place, read-only access to the peer's memory, checked as a read
    /// would be; `None` where the provider does not share memory with the
    /// peer. See [`crate::Endpoint::peer_view`].
    fn peer_view(&self, remote: RemoteAddr, len: usize) -> Option<Result<PeerView, Status>>;

    /// The peer, for logs and errors.
    fn peer_addr(&self) -> String;
}

/// Local bytes an operation reads from or writes to: `len` bytes at
/// `offset` in `region`, checked to lie inside it, in a region of the
/// endpoint's own domain. Only [`Local::check`] makes one.
#[derive(Clone, Copy)]
pub(crate) struct Local<'a> {
    region: &'a MemoryRegion,
    offset: usize,
    len: usize,
}

impl<'a> Local<'a> {
    /// Checks `offset..offset+len` against `region`, and `region` against
    /// the endpoint's domain `domain_id`.
    pub(crate) fn check(
        region: &'a MemoryRegion,
        offset: usize,
        len: usize,
        domain_id: u64,
    ) -> Result<Local<'a>> {
        if region.domain_id != domain_id {
            return Err(Error::DomainMismatch(
                "the local region belongs to another protection domain than the endpoint",
            ));
        }
        region.check_range(offset, len)?;
        Ok(Local {
            region,
            offset,
            len,
        })
    }

    /// The region.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn region(&self) -> &'a MemoryRegion {
        self.region
    }

    /// The region's buffer, for a provider that keeps it alive until the
    /// operation completes.
    pub(crate) fn buf(&self) -> &'a Arc<Buffer> {
        &self.region.buf
    }

    /// Where the bytes start in the region.
    pub(crate) fn offset(&self) -> usize {
        self.offset
    }

    /// How many bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The first byte. `len()` bytes from here lie inside the region's
    /// mapping, which lives as long as the region.
    pub(crate) fn ptr(&self) -> *mut u8 {
        // SAFETY: offset + len <= region.len() (checked in `check`), so the
        // pointer stays inside the buffer's mapping or one past its end.
        unsafe { self.region.as_ptr().add(self.offset) }
    }
}

/// The writes of a batch, every local range checked as [`Local::check`]
/// checks one. Only [`Writes::check`] makes one.
#[derive(Clone, Copy)]
pub(crate) struct Writes<'a> {
    writes: &'a [WriteRequest<'a>],
}

/// One write, its local range checked: a [`WriteRequest`] as
/// [`Write::check`] or a [`Writes`] made it.
#[derive(Clone, Copy)]
pub(crate) struct Write<'a> {
    pub(crate) wr_id: u64,
    pub(crate) local: Local<'a>,
    pub(crate) remote: RemoteAddr,
    pub(crate) imm: Option<u32>,
    /// No completion on success: see [`WriteRequest`].
    pub(crate) unsignaled: bool,
}

impl<'a> Write<'a> {
    /// Checks `w`'s local range as [`Local::check`] does.
    pub(crate) fn check(w: &WriteRequest<'a>, domain_id: u64) -> Result<Write<'a>> {
        Ok(Write {
            wr_id: w.wr_id,
            local: Local::check(w.local, w.offset, w.len, domain_id)?,
            remote: w.remote,
            imm: w.imm,
            unsignaled: w.unsignaled,
        })
    }
}

impl<'a> Writes<'a> {
    /// Checks every write's local range as [`Local::check`] does; the
    /// first refusal refuses the batch.
    pub(crate) fn check(writes: &'a [WriteRequest<'a>], domain_id: u64) -> Result<Writes<'a>> {
        for w in writes {
            Write::check(w, domain_id)?;
        }
        Ok(Writes { writes })
    }

    /// How many writes.
    pub(crate) fn len(&self) -> usize {
        self.writes.len()
    }

    /// The writes, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = Write<'a>> + 'a {
        self.writes.iter().map(|w| Write {
            wr_id: w.wr_id,
            // Checked in `check`.
            local: Local {
                region: w.local,
                offset: w.offset,
                len: w.len,
            },
            remote: w.remote,
            imm: w.imm,
            unsignaled: w.unsignaled,
        })
    }

    /// Refuses a batch longer than a send queue of `depth` could ever take.
    pub(crate) fn check_depth(&self, depth: usize) -> Result<()> {
        if self.len() > depth {
            return Err(Error::InvalidArgument(format!(
                "a batch of {} writes is more than the send queue holds ({depth}): post it in parts",
                self.len()
            )));
        }
        Ok(())
    }
}

/// The local word of an atomic: 8 bytes at an 8-byte aligned offset (so
/// an 8-byte aligned address: regions are page-aligned), checked like a
/// [`Local`]. Only [`LocalWord::check`] makes one.
#[derive(Clone, Copy)]
pub(crate) struct LocalWord<'a>(Local<'a>);

impl<'a> LocalWord<'a> {
    /// Checks the word at `offset` in `region` as [`Local::check`] checks a
    /// range, and its alignment.
    pub(crate) fn check(
        region: &'a MemoryRegion,
        offset: usize,
        domain_id: u64,
    ) -> Result<LocalWord<'a>> {
        let local = Local::check(region, offset, 8, domain_id)?;
        if offset % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "the local result word of an atomic must be 8-byte aligned, offset {offset} is not"
            )));
        }
        Ok(LocalWord(local))
    }

    /// The word as a range of 8 bytes.
    pub(crate) fn bytes(&self) -> Local<'a> {
        self.0
    }

    /// The word, 8-byte aligned, inside the region's mapping.
    pub(crate) fn ptr(&self) -> *mut u64 {
        self.0.ptr().cast()
    }
}
