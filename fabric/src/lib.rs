//! `rfaas-fabric`: the one-sided transport everything in rfaas stands on.
//!
//! A small API with RDMA verbs semantics: registered memory named by
//! `{addr, rkey, len}`, protection domains, connected endpoints, one-sided
//! write / write-with-immediate / read / fetch-and-add / compare-and-swap,
//! posted receives for immediates, and completion queues with a non-blocking
//! [`CompletionQueue::poll`] (the hot path) and a sleeping
//! [`CompletionQueue::wait`] (the warm path).
//!
//! Providers are chosen at run time by name ([`Fabric::open`]):
//!
//! | name | transport | who validates remote accesses |
//! |---|---|---|
//! | `tcp` | software RDMA over TCP | the target's fabric library, on every operation |
//! | `shm` | memfd-backed shared memory, same node | the target, when it grants a region's mapping |
//! | `verbs:<device>` | RDMA through libibverbs / librdmacm (feature `verbs`) | the NIC |
//!
//! # Layout
//!
//! - [`error`]: the [`Error`] type of local, synchronous failures.
//! - [`completion`]: [`Completion`], [`Opcode`], [`Status`]; remote failures
//!   arrive as error completions.
//! - [`memory`]: [`Buffer`], [`MemoryRegion`], [`Access`], [`RemoteDescriptor`].
//! - `provider`: the contract every provider implements (traits for the
//!   provider, its domains, completion queues, listeners and endpoints),
//!   which the public types below call through.
//! - `registry`: the lock-free region table of the software providers.
//! - `options`: [`EndpointOptions`].
//! - `os`: the epoll, eventfd and poll calls the software providers share.
//! - `tcp`: the tcp provider (frames in `rfaas_proto::tcp_frame`, the
//!   passive-target progress thread in `tcp::progress`).
//! - `shm`: the shared-memory provider.
//! - `verbs`: the verbs provider (feature `verbs`).
//! - `testing`: fixtures the fabric's unit and conformance tests share
//!   (tests, and feature `testing`).
//!
//! # Usage
//!
//! ```no_run
//! use rfaas_fabric::{Access, Completion, EndpointOptions, Fabric};
//! # fn main() -> rfaas_fabric::Result<()> {
//! let fabric = Fabric::open("tcp")?;
//! let domain = fabric.domain()?;
//! let mut cq = fabric.completion_queue(256)?;
//! let src = domain.register(4096, Access::LOCAL)?;
//! let ep = domain.connect("127.0.0.1:7000", &mut cq, &EndpointOptions::default())?;
//! # let remote = rfaas_fabric::RemoteAddr::default();
//! ep.write_with_imm(1, &src, 0, 64, remote, 42)?;
//! let mut done = [Completion::EMPTY; 16];
//! while cq.poll(&mut done) == 0 {}
//! # Ok(()) }
//! ```

pub mod completion;
pub mod error;
pub mod memory;
mod options;
mod os;
mod provider;
mod registry;
mod shm;
mod tcp;
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub mod testing;
#[cfg(feature = "verbs")]
mod verbs;

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::time::Duration;

pub use completion::{Completion, Opcode, Status};
pub use error::{Error, Result};
pub use memory::{
    page_size, Access, Buffer, MemoryRegion, PeerView, RemoteAddr, RemoteDescriptor, WriteRequest,
};
pub use options::EndpointOptions;

use provider::{
    CompletionQueue as _, Domain as _, Endpoint as _, Listener as _, Local, LocalWord,
    Provider as _, Write, Writes,
};

/// Which provider, parsed from its name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ProviderKind {
    /// Software RDMA over TCP.
    Tcp,
    /// Shared memory between processes of one node.
    Shm,
    /// RDMA verbs on the named device (for example `rxe0`, `mlx5_0`).
    Verbs(String),
}

impl std::str::FromStr for ProviderKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "tcp" => Ok(ProviderKind::Tcp),
            "shm" => Ok(ProviderKind::Shm),
            _ => match s.strip_prefix("verbs:") {
                Some(dev) if !dev.is_empty() => Ok(ProviderKind::Verbs(dev.to_owned())),
                _ => Err(Error::UnknownProvider(s.to_owned())),
            },
        }
    }
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProviderKind::Tcp => f.write_str("tcp"),
            ProviderKind::Shm => f.write_str("shm"),
            ProviderKind::Verbs(dev) => write!(f, "verbs:{dev}"),
        }
    }
}

/// Forwards a call to whichever provider an object belongs to: a `match`
/// whose arms call the same `provider` trait method on each concrete type.
macro_rules! dispatch {
    ($value:expr, $inner:ident => $body:expr) => {
        match $value {
            Imp::Tcp($inner) => $body,
            Imp::Shm($inner) => $body,
            #[cfg(feature = "verbs")]
            Imp::Verbs($inner) => $body,
            #[cfg(not(feature = "verbs"))]
            Imp::Verbs(never) => match *never {},
        }
    };
}

/// Like `dispatch!`, wrapping the result in the same provider's variant.
macro_rules! dispatch_map {
    ($value:expr, $inner:ident => $body:expr) => {
        match $value {
            Imp::Tcp($inner) => Imp::Tcp($body),
            Imp::Shm($inner) => Imp::Shm($body),
            #[cfg(feature = "verbs")]
            Imp::Verbs($inner) => Imp::Verbs($body),
            #[cfg(not(feature = "verbs"))]
            Imp::Verbs(never) => match *never {},
        }
    };
}

/// One provider-specific value of each kind.
#[derive(Debug)]
enum Imp<T, S, V> {
    Tcp(T),
    Shm(S),
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    Verbs(V),
}

/// Each provider's object of kind `$kind` (an associated type of
/// [`provider::Provider`]), one variant per provider.
macro_rules! per_provider {
    ($kind:ident) => {
        Imp<
            <tcp::TcpFabric as provider::Provider>::$kind,
            <shm::ShmFabric as provider::Provider>::$kind,
            verbs_objects::$kind,
        >
    };
}

#[cfg(feature = "verbs")]
mod verbs_objects {
    //! The verbs provider's objects.
    use crate::provider::Provider;
    pub(crate) type Fabric = crate::verbs::VerbsFabric;
    pub(crate) type Domain = <crate::verbs::VerbsFabric as Provider>::Domain;
    pub(crate) type Cq = <crate::verbs::VerbsFabric as Provider>::Cq;
    pub(crate) type Listener = <crate::verbs::VerbsFabric as Provider>::Listener;
    pub(crate) type Endpoint = <crate::verbs::VerbsFabric as Provider>::Endpoint;
}

#[cfg(not(feature = "verbs"))]
mod verbs_objects {
    //! Without the `verbs` feature the verbs variants hold a type with no values.
    #[derive(Debug)]
    pub(crate) enum Never {}
    pub(crate) type Fabric = Never;
    pub(crate) type Domain = Never;
    pub(crate) type Cq = Never;
    pub(crate) type Listener = Never;
    pub(crate) type Endpoint = Never;
}

/// An opened provider: the factory of domains, completion queues and listeners.
#[derive(Debug)]
pub struct Fabric {
    kind: ProviderKind,
    imp: Imp<tcp::TcpFabric, shm::ShmFabric, verbs_objects::Fabric>,
}

impl Fabric {
    /// Opens the provider named `spec`: `tcp`, `shm` or `verbs:<device>`.
    pub fn open(spec: &str) -> Result<Fabric> {
        let kind: ProviderKind = spec.parse()?;
        let imp = match &kind {
            ProviderKind::Tcp => Imp::Tcp(tcp::TcpFabric::open()?),
            ProviderKind::Shm => Imp::Shm(shm::ShmFabric::open()?),
            #[cfg(feature = "verbs")]
            ProviderKind::Verbs(dev) => Imp::Verbs(verbs::VerbsFabric::open(dev)?),
            #[cfg(not(feature = "verbs"))]
            ProviderKind::Verbs(_) => {
                return Err(Error::ProviderUnavailable {
                    provider: spec.to_owned(),
                    reason:
                        "this build has no verbs support: rebuild rfaas with `--features verbs`"
                            .into(),
                })
            }
        };
        Ok(Fabric { kind, imp })
    }

    /// Which provider this is.
    pub fn provider(&self) -> &ProviderKind {
        &self.kind
    }

    /// Creates a protection domain (rfaas uses one per lease).
    pub fn domain(&self) -> Result<Domain> {
        let imp = dispatch_map!(&self.imp, f => f.domain()?);
        Ok(Domain { imp })
    }

    /// Creates a completion queue holding up to `depth` completions.
    pub fn completion_queue(&self, depth: usize) -> Result<CompletionQueue> {
        if depth == 0 {
            return Err(Error::InvalidArgument(
                "a completion queue needs depth > 0".into(),
            ));
        }
        let imp = dispatch_map!(&self.imp, f => f.completion_queue(depth)?);
        Ok(CompletionQueue { imp })
    }

    /// Listens for connections on `addr` (`host:port` for tcp and verbs, a
    /// socket path for shm). Port 0 picks a free port; see [`Listener::local_addr`].
    pub fn listen(&self, addr: &str) -> Result<Listener> {
        let imp = dispatch_map!(&self.imp, f => f.listen(addr)?);
        Ok(Listener { imp })
    }
}

/// A protection domain: regions and endpoints that may name each other.
///
/// An rkey is valid only on endpoints of the domain that registered it.
#[derive(Debug)]
pub struct Domain {
    imp: per_provider!(Domain),
}

impl Domain {
    /// Allocates and registers `len` page-aligned, zeroed bytes with `access`.
    pub fn register(&self, len: usize, access: Access) -> Result<MemoryRegion> {
        let buf = Buffer::new(len)?;
        dispatch!(&self.imp, d => d.register_buffer(buf, access))
    }

    /// Like [`Domain::register`], but the region is `len` rounded up to
    /// whole pages, and the page after it is mapped with no access: a write
    /// running past the region's end faults at once (SIGSEGV) instead of
    /// corrupting whatever lies beyond. The worker's output buffers use it.
    pub fn register_guarded(&self, len: usize, access: Access) -> Result<MemoryRegion> {
        let buf = Buffer::guarded(len)?;
        dispatch!(&self.imp, d => d.register_buffer(buf, access))
    }

    /// Registers `buf` (for example a file's mapping, [`Buffer::map_file`])
    /// with `access`. The region keeps the buffer mapped until it and every
    /// operation posted with it are gone.
    pub fn register_buffer(&self, buf: Buffer, access: Access) -> Result<MemoryRegion> {
        dispatch!(&self.imp, d => d.register_buffer(buf, access))
    }

    /// Connects to a listener at `addr`; completions go to `cq`.
    pub fn connect(
        &self,
        addr: &str,
        cq: &mut CompletionQueue,
        opts: &EndpointOptions,
    ) -> Result<Endpoint> {
        let imp = match (&self.imp, &mut cq.imp) {
            (Imp::Tcp(d), Imp::Tcp(cq)) => Imp::Tcp(d.connect(addr, cq, opts)?),
            (Imp::Shm(d), Imp::Shm(cq)) => Imp::Shm(d.connect(addr, cq, opts)?),
            #[cfg(feature = "verbs")]
            (Imp::Verbs(d), Imp::Verbs(cq)) => Imp::Verbs(d.connect(addr, cq, opts)?),
            _ => return Err(Error::DomainMismatch(PROVIDER_MISMATCH)),
        };
        Ok(Endpoint::new(self.id(), imp))
    }

    /// The domain's id, unique in the process.
    pub fn id(&self) -> u64 {
        dispatch!(&self.imp, d => d.id())
    }
}

const PROVIDER_MISMATCH: &str =
    "the domain, completion queue and listener must come from the same provider";

/// A passive endpoint waiting for connections.
#[derive(Debug)]
pub struct Listener {
    imp: per_provider!(Listener),
}

impl Listener {
    /// Accepts one connection into `domain`; its completions go to `cq`.
    /// Waits at most `timeout` (forever with `None`).
    pub fn accept(
        &self,
        domain: &Domain,
        cq: &mut CompletionQueue,
        opts: &EndpointOptions,
        timeout: Option<Duration>,
    ) -> Result<Endpoint> {
        let imp = match (&self.imp, &domain.imp, &mut cq.imp) {
            (Imp::Tcp(l), Imp::Tcp(d), Imp::Tcp(cq)) => Imp::Tcp(l.accept(d, cq, opts, timeout)?),
            (Imp::Shm(l), Imp::Shm(d), Imp::Shm(cq)) => Imp::Shm(l.accept(d, cq, opts, timeout)?),
            #[cfg(feature = "verbs")]
            (Imp::Verbs(l), Imp::Verbs(d), Imp::Verbs(cq)) => {
                Imp::Verbs(l.accept(d, cq, opts, timeout)?)
            }
            _ => return Err(Error::DomainMismatch(PROVIDER_MISMATCH)),
        };
        Ok(Endpoint::new(domain.id(), imp))
    }

    /// The address peers connect to (with the actual port when 0 was asked).
    pub fn local_addr(&self) -> String {
        dispatch!(&self.imp, l => l.local_addr())
    }
}

/// A connected endpoint (a queue pair). Completions of its operations, and
/// of receives consumed by the peer's writes-with-immediate, go to the
/// completion queue it was created with.
///
/// Every operation's local range must lie in a region of the endpoint's
/// domain; such mistakes are returned as errors at once. Everything that
/// happens at or on the way to the peer comes back as a completion.
///
/// An endpoint is `Send` but not `Sync`: it may move between threads, and
/// one thread at a time posts on it (rfaas gives each worker thread its
/// own). The completion queue may be polled on another thread.
///
/// ```compile_fail,E0277
/// fn shared_between_threads<T: Sync>() {}
/// shared_between_threads::<rfaas_fabric::Endpoint>();
/// ```
#[derive(Debug)]
pub struct Endpoint {
    domain_id: u64,
    imp: per_provider!(Endpoint),
    /// Not `Sync`, whatever the provider: providers may rely on one poster.
    _one_poster: PhantomData<Cell<()>>,
}

impl Endpoint {
    fn new(domain_id: u64, imp: per_provider!(Endpoint)) -> Endpoint {
        Endpoint {
            domain_id,
            imp,
            _one_poster: PhantomData,
        }
    }

    /// Writes `local[offset..offset+len]` to `remote`. Hot path.
    pub fn write(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: RemoteAddr,
    ) -> Result<()> {
        self.post_one(&WriteRequest {
            wr_id,
            local,
            offset,
            len,
            remote,
            imm: None,
            unsignaled: false,
        })
    }

    /// Writes like [`Endpoint::write`], then consumes one receive posted at
    /// the peer, which completes with `imm` and the byte length. Hot path.
    pub fn write_with_imm(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: RemoteAddr,
        imm: u32,
    ) -> Result<()> {
        self.post_one(&WriteRequest {
            wr_id,
            local,
            offset,
            len,
            remote,
            imm: Some(imm),
            unsignaled: false,
        })
    }

    /// Checks and posts one write. Hot path.
    #[inline]
    fn post_one(&self, w: &WriteRequest<'_>) -> Result<()> {
        let w = Write::check(w, self.domain_id)?;
        dispatch!(&self.imp, e => e.write(w))
    }

    /// Posts `writes` in one call, each as [`Endpoint::write`] (no `imm`)
    /// or [`Endpoint::write_with_imm`] would, in order: each completes, and
    /// each immediate reaches the peer, exactly as if posted alone. What
    /// is ready leaves together: on tcp one `writev` for the frames, on shm
    /// one doorbell for the immediates, on verbs one `ibv_post_send` for
    /// the chained work requests. Hot path.
    ///
    /// All or nothing: every local range is checked, and room for the whole
    /// batch is claimed, before anything is posted. `Err` means no write of
    /// the batch was posted: [`Error::QueueFull`] when the send queue (or
    /// the completion queue, or on shm the peer's immediate ring) has no
    /// room for all of them now, [`Error::InvalidArgument`] when the batch
    /// is longer than the send queue is deep. An empty batch does nothing;
    /// a batch of one is a plain post.
    ///
    /// A write marked [`unsignaled`](WriteRequest::unsignaled) completes
    /// only if it fails; the others complete as above.
    pub fn write_batch(&self, writes: &[WriteRequest<'_>]) -> Result<()> {
        match writes {
            [] => Ok(()),
            [w] => self.post_one(w),
            _ => {
                let writes = Writes::check(writes, self.domain_id)?;
                dispatch!(&self.imp, e => e.write_batch(writes))
            }
        }
    }

    /// In-place, read-only access to `len` bytes of the peer's memory at
    /// `remote`, checked as a [`read`](Self::read) of them would be (an rkey
    /// of this connection's peer, bounds, [`Access::REMOTE_READ`]). Only a
    /// provider that shares memory with the peer offers it (shm): `None` on
    /// tcp and verbs, where the caller copies with `read`. `Some(Err)` with
    /// the status a read would complete with when the access is refused or
    /// the peer is gone.
    ///
    /// The view stays mapped until the next operation on this endpoint
    /// (which may unmap regions the peer revoked) or until the endpoint is
    /// dropped. The bytes are the peer's: it may change them meanwhile, as
    /// it may under a NIC's read. The mapping is read-only.
    pub fn peer_view(
        &self,
        remote: RemoteAddr,
        len: usize,
    ) -> Option<std::result::Result<PeerView, Status>> {
        dispatch!(&self.imp, e => e.peer_view(remote, len))
    }

    /// Reads `len` bytes at `remote` into `local[offset..]`.
    pub fn read(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: RemoteAddr,
    ) -> Result<()> {
        let local = Local::check(local, offset, len, self.domain_id)?;
        dispatch!(&self.imp, e => e.read(wr_id, local, remote))
    }

    /// Atomically adds `add` to the 8-byte word at `remote` (which must be
    /// 8-byte aligned); the old value lands in `local[offset..offset+8]`.
    pub fn fetch_add(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        remote: RemoteAddr,
        add: u64,
    ) -> Result<()> {
        let local = LocalWord::check(local, offset, self.domain_id)?;
        dispatch!(&self.imp, e => e.fetch_add(wr_id, local, remote, add))
    }

    /// Atomically replaces the word at `remote` with `swap` if it equals
    /// `compare`; the old value lands in `local[offset..offset+8]`.
    pub fn compare_swap(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        remote: RemoteAddr,
        compare: u64,
        swap: u64,
    ) -> Result<()> {
        let local = LocalWord::check(local, offset, self.domain_id)?;
        dispatch!(&self.imp, e => e.compare_swap(wr_id, local, remote, compare, swap))
    }

    /// Posts a receive; the peer's next write-with-immediate consumes it and
    /// completes it with [`Opcode::RecvWithImm`]. Hot path.
    pub fn post_recv(&self, wr_id: u64) -> Result<()> {
        dispatch!(&self.imp, e => e.post_recv(wr_id))
    }

    /// The peer's address, for logs and errors.
    pub fn peer_addr(&self) -> String {
        dispatch!(&self.imp, e => e.peer_addr())
    }
}

/// A completion queue shared by one or more endpoints.
#[derive(Debug)]
pub struct CompletionQueue {
    imp: per_provider!(Cq),
}

impl CompletionQueue {
    /// Moves up to `out.len()` completions into `out`; returns how many.
    ///
    /// Hot path: never blocks, allocates or takes a lock. On the tcp provider
    /// it also drives the connection, so a busy poller reads its own socket.
    #[inline]
    pub fn poll(&mut self, out: &mut [Completion]) -> usize {
        dispatch!(&mut self.imp, cq => cq.poll(out))
    }

    /// Like [`CompletionQueue::poll`], but sleeps in the kernel until at least
    /// one completion is ready or `timeout` passes (then returns `Ok(0)`).
    pub fn wait(&mut self, out: &mut [Completion], timeout: Duration) -> Result<usize> {
        dispatch!(&mut self.imp, cq => cq.wait(out, timeout))
    }
}
