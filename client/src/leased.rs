//! [`LeasedAllocation`]: an allocation that holds its own lease, made by
//! [`Managers::allocate`].
//!
//! It asks the managers for a lease, allocates on the granted node, and
//! keeps both alive from a background thread: two thirds of the time the
//! lease is sure to last after it was asked for (its duration less one
//! second, as the manager counts its end in whole seconds), on the
//! [`Managers`]' clock, the thread renews it and hands the new token to
//! the executor, so the worker is not stopped at the old end. Deallocating, or dropping it, stops the thread and releases
//! the lease.
//!
//! With [`LeaseOptions::retry_elsewhere`],
//! [`invoke_retrying`](LeasedAllocation::invoke_retrying) moves to another
//! node when the executor refuses for want of room, stops, or dies: it
//! releases the lease, asks for a new one preferring every other node, and
//! allocates there in the same protection domain, so buffers stay valid.
//! [`node`](LeasedAllocation::node) says where it runs now, and
//! [`moves`](LeasedAllocation::moves) how often it moved.
//!
//! The renewal thread and an invocation share no lock: the thread holds
//! the lease and a [`Renewer`] behind a mutex that only it and a move to
//! another node take.

use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::allocation::{Allocation, FunctionId, Renewer};
use crate::buffer::{Buffer, Pod};
use crate::client::Client;
use crate::control::lock;
use crate::error::{Error, Next, Result};
use crate::lease::{Lease, LeaseRequest, Managers, NodeLease, NodeState};
use crate::spec::AllocationSpec;

/// How [`Managers::allocate`] leases, renews and moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseOptions {
    /// How long to wait for a lease while none is free (the managers'
    /// backoff deadline), at first and at each move.
    pub deadline: Duration,
    /// Whether [`invoke_retrying`](LeasedAllocation::invoke_retrying)
    /// takes a new lease on another node when the executor refuses for
    /// want of room, is draining, stops or dies (and when the lease has
    /// ended). Without it, it re-allocates on the same node only.
    pub retry_elsewhere: bool,
}

impl Default for LeaseOptions {
    fn default() -> LeaseOptions {
        LeaseOptions {
            deadline: Duration::from_secs(60),
            retry_elsewhere: false,
        }
    }
}

impl LeaseOptions {
    /// Sets [`retry_elsewhere`](Self::retry_elsewhere).
    pub fn retry_elsewhere(mut self, yes: bool) -> LeaseOptions {
        self.retry_elsewhere = yes;
        self
    }

    /// Sets [`deadline`](Self::deadline).
    pub fn deadline(mut self, deadline: Duration) -> LeaseOptions {
        self.deadline = deadline;
        self
    }
}

/// The longest the renewal thread sleeps at once: how soon it notices it
/// should stop.
const SLICE: Duration = Duration::from_millis(50);

/// What a lease may fall short of its duration: the manager sets its end
/// in whole Unix seconds from the second it grants or renews it in.
const WHOLE_SECOND: Duration = Duration::from_secs(1);

/// Nodes a [`LeaseRequest`] may prefer.
const MAX_PREFERRED: usize = 1024;

/// An [`Allocation`] with its own lease, renewed in the background and
/// released on [`deallocate`](Self::deallocate) and on drop. It derefs to
/// the allocation, so `submit`, `invoke`, `buffer` and the rest are the
/// allocation's own, with no lock on their path.
#[derive(Debug)]
pub struct LeasedAllocation {
    // Dropped first: the worker ends before its lease is released.
    alloc: Allocation,
    keeper: Keeper,
    client: Client,
    spec: AllocationSpec,
    request: LeaseRequest,
    options: LeaseOptions,
    /// Nodes this allocation left because they refused or died.
    left: Vec<String>,
}

/// The lease and the renewal thread.
#[derive(Debug)]
struct Keeper {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    managers: Managers,
    duration: Duration,
    stop: AtomicBool,
    renewals: AtomicU64,
    /// Moves to another node.
    moves: AtomicU64,
    current: Mutex<Current>,
}

/// What the renewal thread renews.
#[derive(Debug)]
struct Current {
    /// `None` once released.
    lease: Option<Lease>,
    /// The node the allocation is on.
    node: String,
    renewer: Renewer,
}

impl Managers {
    /// Asks for a lease as `request` says, allocates `spec` on the granted
    /// node (the first, when the grant spans several), and keeps the lease
    /// renewed until the allocation is deallocated or dropped. See
    /// [`LeasedAllocation`].
    pub fn allocate(
        &self,
        client: &Client,
        request: &LeaseRequest,
        spec: &AllocationSpec,
        options: &LeaseOptions,
    ) -> Result<LeasedAllocation> {
        if request.duration_s < 3 {
            return Err(Error::InvalidArgument(format!(
                "a lease renewed in the background needs duration_s of 3 or more (it is {}); \
                 the renewal comes at two thirds of it less a second",
                request.duration_s
            )));
        }
        let asked = self.clock().now();
        let mut left = Vec::new();
        let attempts = if options.retry_elsewhere { 3 } else { 1 };
        let mut n = 0;
        let (lease, node, alloc) = loop {
            n += 1;
            match place(self, client, request, spec, options, &left, None) {
                Ok(placed) => break placed,
                Err((e, node)) if n < attempts && moves(&e) => {
                    tracing::info!(error = %e, node, "cannot allocate on the leased node; leasing elsewhere");
                    left.extend(node);
                }
                Err((e, _)) => return Err(e),
            }
        };
        let shared = Arc::new(Shared {
            managers: self.clone(),
            duration: Duration::from_secs(request.duration_s),
            stop: AtomicBool::new(false),
            renewals: AtomicU64::new(0),
            moves: AtomicU64::new(0),
            current: Mutex::new(Current {
                lease: Some(lease),
                node: node.node,
                renewer: alloc.renewer(),
            }),
        });
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("rfaas-renew".into())
                .spawn(move || shared.renew_forever(asked))
                .map_err(|e| {
                    Error::InvalidArgument(format!(
                        "cannot start the lease renewal thread: {e}; raise the process's thread limit"
                    ))
                })?
        };
        Ok(LeasedAllocation {
            alloc,
            keeper: Keeper {
                shared,
                thread: Some(thread),
            },
            client: client.clone(),
            spec: spec.clone(),
            request: request.clone(),
            options: options.clone(),
            left,
        })
    }
}

/// Whether `e` is a reason to lease on another node.
fn moves(e: &Error) -> bool {
    matches!(e.next(), Next::Elsewhere | Next::NewLease)
}

/// Leases (preferring nodes not in `avoid`) and allocates on the granted
/// node. On failure, the lease is released and the node it named, if any,
/// comes back with the error.
fn place(
    managers: &Managers,
    client: &Client,
    request: &LeaseRequest,
    spec: &AllocationSpec,
    options: &LeaseOptions,
    avoid: &[String],
    domain: Option<Arc<rfaas_fabric::Domain>>,
) -> std::result::Result<(Lease, NodeLease, Allocation), (Error, Option<String>)> {
    let mut request = request.clone();
    if !avoid.is_empty() {
        request.nodes = preferred(managers, &request, avoid, options.deadline);
    }
    let lease = managers
        .request(&request, options.deadline)
        .map_err(|e| (e, None))?;
    let Some(node) = lease.nodes().into_iter().next() else {
        return Err((
            Error::Protocol("the manager granted a lease with no node in it".into()),
            None,
        ));
    };
    let mut spec = spec.clone();
    spec.fallback_executors.clear();
    let executors: Arc<[(String, String)]> = vec![(node.executor(), node.token.clone())].into();
    match client.allocate_in(executors, 0, &spec, domain) {
        Ok(alloc) => Ok((lease, node, alloc)),
        Err(e) => {
            if let Err(r) = lease.release() {
                tracing::warn!(error = %r, "cannot release the lease; it ends at its expiry");
            }
            Err((e, Some(node.node)))
        }
    }
}

/// The request's own preferences, then every other node that is up, all
/// without those in `avoid`; the request's own list when that leaves none.
fn preferred(
    managers: &Managers,
    request: &LeaseRequest,
    avoid: &[String],
    deadline: Duration,
) -> Vec<String> {
    let mut list: Vec<String> = request
        .nodes
        .iter()
        .filter(|n| !avoid.contains(n))
        .cloned()
        .collect();
    match managers.nodes(deadline) {
        Ok(nodes) => {
            for n in nodes {
                if n.state == NodeState::Up && !avoid.contains(&n.name) && !list.contains(&n.name) {
                    list.push(n.name);
                }
            }
        }
        Err(e) => tracing::info!(error = %e, "cannot list the nodes; leasing without preferences"),
    }
    list.truncate(MAX_PREFERRED);
    if list.is_empty() {
        request.nodes.clone()
    } else {
        list
    }
}

impl Shared {
    /// The renewal thread: renews at two thirds of what the lease asked
    /// for at `asked` is sure to last, counted from when it was asked for
    /// (so neither the allocation's start nor a renewal's own round trip
    /// delays the next), until told to stop.
    fn renew_forever(&self, mut asked: Instant) {
        let clock = self.managers.clock();
        let lasts = self.duration.saturating_sub(WHOLE_SECOND);
        let period = lasts * 2 / 3;
        loop {
            let due = asked + period;
            loop {
                if self.stop.load(Ordering::Acquire) {
                    return;
                }
                let left = due.saturating_duration_since(clock.now());
                if left.is_zero() {
                    break;
                }
                clock.sleep(left.min(SLICE));
            }
            let current = lock(&self.current);
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            asked = clock.now();
            let Some(lease) = current.lease.as_ref() else {
                continue;
            };
            // What is left of the lease is the time to get it renewed in.
            let deadline = (lasts - period).max(Duration::from_secs(1));
            let token = match lease.renew(self.duration, deadline) {
                Ok(nodes) => nodes.into_iter().find(|n| n.node == current.node),
                Err(e) => {
                    tracing::warn!(lease = lease.id(), error = %e, "cannot renew the lease; trying again at the next period");
                    continue;
                }
            };
            let Some(token) = token else {
                tracing::warn!(
                    lease = lease.id(),
                    node = current.node,
                    "the renewed lease no longer names the allocation's node"
                );
                continue;
            };
            match current.renewer.renew(&token.token) {
                Ok(expires_at) => {
                    self.renewals.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(lease = lease.id(), expires_at, "lease renewed");
                }
                Err(e) => tracing::warn!(
                    lease = lease.id(),
                    allocation = current.renewer.allocation_id(),
                    error = %e,
                    "the executor refused the renewed token; the allocation ends at the old expiry"
                ),
            }
        }
    }
}

impl Keeper {
    /// Stops the renewal thread and takes the lease out.
    fn stop(&mut self) -> Option<Lease> {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::warn!("the lease renewal thread panicked");
            }
        }
        lock(&self.shared.current).lease.take()
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        // Dropping the lease releases it.
        drop(self.stop());
    }
}

impl Deref for LeasedAllocation {
    type Target = Allocation;
    fn deref(&self) -> &Allocation {
        &self.alloc
    }
}

impl LeasedAllocation {
    /// The allocation, as [`Deref`] gives it.
    pub fn allocation(&self) -> &Allocation {
        &self.alloc
    }

    /// The current lease's grant id (it changes when the allocation moves);
    /// `None` once released.
    pub fn lease_grant_id(&self) -> Option<u64> {
        lock(&self.keeper.shared.current)
            .lease
            .as_ref()
            .map(Lease::id)
    }

    /// The id of the node lease the allocation runs under (the token's
    /// `lease_id`, which bills key on); `None` once released.
    pub fn node_lease_id(&self) -> Option<u64> {
        let current = lock(&self.keeper.shared.current);
        let node = current.node.clone();
        current
            .lease
            .as_ref()
            .and_then(|l| l.nodes().into_iter().find(|n| n.node == node))
            .map(|n| n.lease_id)
    }

    /// The node the allocation is on.
    pub fn node(&self) -> String {
        lock(&self.keeper.shared.current).node.clone()
    }

    /// How many renewals the executor has accepted so far.
    pub fn renewals(&self) -> u64 {
        self.keeper.shared.renewals.load(Ordering::Relaxed)
    }

    /// How many times [`invoke_retrying`](Self::invoke_retrying) moved the
    /// allocation to another node (with
    /// [`LeaseOptions::retry_elsewhere`]). A new lease on the node it left,
    /// when only that one had room, is no move.
    pub fn moves(&self) -> u64 {
        self.keeper.shared.moves.load(Ordering::Relaxed)
    }

    /// Like [`Allocation::invoke`], but after a retryable failure calls
    /// again, at most `retries` times in all (re-allocations count too):
    /// on the same worker when the failure was passing, on a new worker on
    /// the same node when the worker ended, and, with
    /// [`LeaseOptions::retry_elsewhere`], under a new lease on another node
    /// when the executor refused, stopped or died or the lease ended.
    /// Buffers stay valid across all of it.
    ///
    /// After a crash, the new worker on the same node comes under the same
    /// lease once the crashed one is gone (the old allocation is let go
    /// first; the executor's `allocation_ending` meanwhile is waited out,
    /// not counted as a retry). What it retried past stays readable:
    /// [`Allocation::retry_causes`].
    pub fn invoke_retrying<I: Pod, O: Pod>(
        &mut self,
        function: FunctionId,
        input: &Buffer<I>,
        in_len: usize,
        output: &mut Buffer<O>,
        retries: u32,
    ) -> Result<usize> {
        let mut attempts = 0u32;
        self.alloc.clear_retry_causes();
        loop {
            let mut err = match self.alloc.invoke(function, input, in_len, output) {
                Ok(n) => return Ok(n),
                Err(e) => e,
            };
            loop {
                if !err.is_retryable() || attempts >= retries {
                    return Err(err);
                }
                attempts += 1;
                tracing::info!(error = %err, attempt = attempts, retries, "invocation failed; trying again");
                let (next, elsewhere) = (err.next(), moves(&err));
                self.alloc.note_retry_cause(err);
                let moved = match next {
                    Next::Retry => Ok(()),
                    _ if self.options.retry_elsewhere && elsewhere => self.move_elsewhere(),
                    _ => self.alloc.reallocate(false),
                };
                match moved {
                    Ok(()) => break,
                    Err(e) => err = e,
                }
            }
        }
    }

    /// Releases the lease and the allocation, leases again preferring
    /// other nodes, and allocates there in the same domain.
    ///
    /// The old allocation goes first, before the new one is sought: it
    /// serves nothing more (its node refused, stopped or lost it, or a
    /// Slurm job is taking its cores back and waits until it ends).
    fn move_elsewhere(&mut self) -> Result<()> {
        let node = {
            let mut current = lock(&self.keeper.shared.current);
            if let Some(lease) = current.lease.take() {
                if let Err(e) = lease.release() {
                    tracing::warn!(error = %e, "cannot release the lease; it ends at its expiry");
                }
            }
            current.node.clone()
        };
        self.alloc.let_go();
        if !self.left.contains(&node) {
            self.left.push(node);
        }
        let placed = place(
            &self.keeper.shared.managers,
            &self.client,
            &self.request,
            &self.spec,
            &self.options,
            &self.left,
            Some(Arc::clone(self.alloc.domain())),
        );
        let (lease, node, alloc) = placed.map_err(|(e, node)| {
            if let Some(node) = node {
                if !self.left.contains(&node) {
                    self.left.push(node);
                }
            }
            e
        })?;
        tracing::info!(
            node = node.node,
            lease = lease.id(),
            "moved to another node"
        );
        let mut current = lock(&self.keeper.shared.current);
        if current.node != node.node {
            self.keeper.shared.moves.fetch_add(1, Ordering::Relaxed);
        }
        *current = Current {
            lease: Some(lease),
            node: node.node,
            renewer: alloc.renewer(),
        };
        drop(current);
        self.alloc.replace(alloc);
        Ok(())
    }

    /// Ends the allocation (waiting for the executor, as
    /// [`Allocation::deallocate`]) and releases its lease.
    pub fn deallocate(self) -> Result<()> {
        let LeasedAllocation {
            alloc, mut keeper, ..
        } = self;
        let ended = alloc.deallocate();
        let released = match keeper.stop() {
            Some(lease) => lease.release(),
            None => Ok(()),
        };
        ended.and(released)
    }
}
