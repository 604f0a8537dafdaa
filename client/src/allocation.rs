//! [`Allocation`]: a worker on an executor, its lanes, and the calls made
//! on them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rfaas_fabric::Domain;
use rfaas_proto::control::client::{Deallocate, RenewLease};
use rfaas_proto::control::{ErrorCode, Frame};
use rfaas_proto::lease::read_claims_unverified;

use crate::buffer::{Buffer, Pod};
use crate::client::Client;
use crate::control::{lock, ControlConn, Fate, FateState, Reply};
use crate::error::{elements, Error, Result};
use crate::invocation::Invocation;
use crate::lane::{Lane, Take, LOST_GRACE};
use crate::pipeline::Pipeline;
use crate::spec::AllocationSpec;

/// A function of an allocation's table, by index. Valid only for the
/// allocation (or its re-allocations) that returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FunctionId(pub(crate) u16);

impl FunctionId {
    /// The index in the function table (the order of
    /// [`AllocationSpec::new`]'s names).
    pub fn index(self) -> u16 {
        self.0
    }
}

/// Where a cold start spent its time: the executor's phases from its
/// `AllocateOk` and what the client measured around them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ColdStart {
    /// Connecting the control connection (zero when a cached one was used).
    pub connect_control: Duration,
    /// From sending the request to receiving `AllocateOk`: the executor's
    /// phases below plus the network and the library's transfer.
    pub round_trip: Duration,
    /// The executor parsing the request and checking token and capacity.
    pub validate: Duration,
    /// The executor taking a pooled worker or spawning one.
    pub worker: Duration,
    /// The worker loading the library and resolving the functions.
    pub load: Duration,
    /// The worker registering its buffers and listening.
    pub listen: Duration,
    /// The client connecting every lane's endpoint.
    pub connect_lanes: Duration,
    /// The whole `allocate` call.
    pub total: Duration,
    /// Whether a pre-spawned worker was used.
    pub pooled: bool,
}

/// A worker process on an executor serving one library's functions, and the
/// client's side of it: a protection domain and one lane (endpoint) per
/// worker thread. Made by [`Client::allocate`].
///
/// `submit` takes `&self`, so several threads may invoke at once (one
/// invocation per lane). Dropping it deallocates without waiting;
/// [`deallocate`](Self::deallocate) waits for the executor.
#[derive(Debug)]
pub struct Allocation {
    client: Client,
    /// Executors to use, the first is the one asked for; each with its token.
    executors: Arc<[(String, String)]>,
    /// Which of `executors` this allocation is on.
    target: usize,
    spec: AllocationSpec,
    conn: Arc<ControlConn>,
    id: u64,
    lease_id: u64,
    functions: Vec<String>,
    output_capacity: u32,
    /// The largest input one call may carry (the executor's word; 0 when
    /// it did not say).
    max_input: u64,
    deadline: Duration,
    /// Its end, and a renewed token, shared with its [`Renewer`]s.
    renewal: Arc<Renewal>,
    fate: Arc<Fate>,
    lanes: Box<[Arc<Lane>]>,
    domain: Arc<Domain>,
    domain_id: u64,
    cold_start: ColdStart,
    /// The node its lease token names (the executor checked it is its own).
    node: String,
    /// How many times [`invoke_retrying`](Self::invoke_retrying) moved it
    /// to another executor.
    moves: u64,
    /// Deallocated explicitly.
    done: bool,
    /// The failures the last `invoke_retrying` retried past, oldest first;
    /// they follow the allocation into the ones that replace it.
    retried: Vec<Error>,
}

/// What [`Client`] hands over to build an [`Allocation`].
pub(crate) struct Parts {
    pub(crate) client: Client,
    pub(crate) executors: Arc<[(String, String)]>,
    pub(crate) target: usize,
    pub(crate) spec: AllocationSpec,
    pub(crate) conn: Arc<ControlConn>,
    pub(crate) ok: rfaas_proto::control::client::AllocateOk,
    pub(crate) fate: Arc<Fate>,
    pub(crate) lanes: Box<[Arc<Lane>]>,
    pub(crate) domain: Arc<Domain>,
    pub(crate) cold_start: ColdStart,
}

impl Allocation {
    pub(crate) fn from_parts(p: Parts) -> Allocation {
        let token = &p.executors[p.target].1;
        // The executor accepted the token, so its claims are readable.
        let node = match read_claims_unverified(token) {
            Ok(claims) => claims.node,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the node from the lease token");
                String::new()
            }
        };
        Allocation {
            client: p.client,
            executors: p.executors,
            target: p.target,
            spec: p.spec,
            conn: p.conn,
            id: p.ok.allocation_id,
            lease_id: p.ok.lease_id,
            functions: p.ok.functions,
            output_capacity: p.ok.output_capacity,
            max_input: p.ok.max_input_bytes,
            deadline: Duration::from_millis(p.ok.deadline_ms),
            renewal: Arc::new(Renewal {
                expires_at: AtomicU64::new(p.ok.expires_at),
                token: Mutex::new(None),
            }),
            fate: p.fate,
            lanes: p.lanes,
            domain_id: p.domain.id(),
            domain: p.domain,
            cold_start: p.cold_start,
            node,
            moves: 0,
            done: false,
            retried: Vec::new(),
        }
    }

    /// The function called `name`.
    pub fn function(&self, name: &str) -> Result<FunctionId> {
        self.functions
            .iter()
            .position(|f| f == name)
            .map(|i| FunctionId(i as u16))
            .ok_or_else(|| Error::UnknownFunction(name.to_owned()))
    }

    /// The function at `index` of the table.
    pub fn function_at(&self, index: u16) -> Result<FunctionId> {
        if usize::from(index) < self.functions.len() {
            Ok(FunctionId(index))
        } else {
            Err(Error::UnknownFunction(format!("#{index}")))
        }
    }

    /// The function table, in index order.
    pub fn functions(&self) -> &[String] {
        &self.functions
    }

    /// The allocation's id on its executor.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The lease it runs under.
    pub fn lease_id(&self) -> u64 {
        self.lease_id
    }

    /// The executor's control address.
    pub fn executor(&self) -> &str {
        self.conn.executor()
    }

    /// The node the allocation runs on: the one its lease token names,
    /// which the executor checked is its own.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// How many times [`invoke_retrying`](Self::invoke_retrying) moved the
    /// allocation to another executor (a fallback); 0 while it stays on
    /// the one it was made on, re-allocations there included.
    pub fn moves(&self) -> u64 {
        self.moves
    }

    /// The protection domain its buffers are registered in.
    pub(crate) fn domain(&self) -> &Arc<Domain> {
        &self.domain
    }

    /// Lanes: invocations that may be in flight at once.
    pub fn lanes(&self) -> usize {
        self.lanes.len()
    }

    /// Bytes a function may write per invocation.
    pub fn output_capacity(&self) -> u32 {
        self.output_capacity
    }

    /// The function deadline in force.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// When the lease ends, Unix seconds.
    pub fn expires_at(&self) -> u64 {
        self.renewal.expires_at.load(Ordering::Relaxed)
    }

    /// A handle that renews this allocation from another thread (a
    /// background renewal), while this one keeps invoking: renewing takes
    /// no lock an invocation takes. It renews this allocation only, not
    /// the one [`invoke_retrying`](Self::invoke_retrying) may replace it
    /// by; take a new handle then.
    pub fn renewer(&self) -> Renewer {
        Renewer {
            conn: Arc::clone(&self.conn),
            id: self.id,
            fate: Arc::clone(&self.fate),
            timeout: self.client.options().allocation_timeout,
            renewal: Arc::clone(&self.renewal),
        }
    }

    /// Where the allocation's cold start spent its time.
    pub fn cold_start(&self) -> ColdStart {
        self.cold_start
    }

    /// What made the last [`invoke_retrying`](Self::invoke_retrying) (or
    /// [`LeasedAllocation::invoke_retrying`](crate::LeasedAllocation::invoke_retrying))
    /// try again: each failure it retried past, oldest first: the call's
    /// failure (a crash, with its signal: [`Error::signal`]), and
    /// re-allocations that failed and were tried again. Empty when its
    /// first attempt stood; the final failure, if any, is what it returned.
    pub fn retry_causes(&self) -> &[Error] {
        &self.retried
    }

    /// Whether the worker is still there as far as the client knows (no
    /// `WorkerExited`, the control connection open).
    pub fn is_alive(&self) -> bool {
        !self.fate.ended()
    }

    /// Whether `buffer` was made for this allocation (or for the one it
    /// replaced in [`invoke_retrying`](Self::invoke_retrying)): only those
    /// can be an invocation's input or output.
    pub fn owns<T: Pod>(&self, buffer: &Buffer<T>) -> bool {
        buffer.domain_id() == self.domain_id
    }

    /// Adds another executor (control address) and a lease token for its
    /// node, after those of [`AllocationSpec::fallback_executor`], for
    /// [`invoke_retrying`](Self::invoke_retrying) to move to when the
    /// current one is lost, stopped or full.
    pub fn add_fallback_executor(&mut self, executor: &str, token: &str) {
        let added = (executor.to_owned(), token.to_owned());
        self.spec.fallback_executors.push(added.clone());
        let mut executors = self.executors.to_vec();
        executors.push(added);
        self.executors = executors.into();
    }

    /// A buffer of `len` zeroed elements registered for this allocation
    /// (and its re-allocations): page-aligned data with room for the
    /// request header in front.
    pub fn buffer<T: Pod>(&self, len: usize) -> Result<Buffer<T>> {
        Buffer::new(&self.domain, len)
    }

    /// Starts `function` on the first `in_len` elements of `input`; its
    /// output goes to `output`. Takes the first idle lane, or fails with
    /// [`Error::AllLanesBusy`]. Hot path: no lock, no allocation.
    pub fn submit<'a, I: Pod, O: Pod>(
        &'a self,
        function: FunctionId,
        input: &'a Buffer<I>,
        in_len: usize,
        output: &'a mut Buffer<O>,
    ) -> Result<Invocation<'a>> {
        let (in_bytes, out_bytes) = self.check(function, input, in_len, output)?;
        self.claim_output(output)?;
        let lane = match self.take_lane() {
            Ok(Some(lane)) => lane,
            Ok(None) => {
                self.unclaim_output(output);
                return Err(Error::AllLanesBusy);
            }
            Err(e) => {
                self.unclaim_output(output);
                return Err(e);
            }
        };
        self.launch(lane, function, input, in_bytes, output, out_bytes)
    }

    /// Like [`submit`](Self::submit), but waits for an idle lane (and for
    /// an output buffer a dropped invocation still targets) instead of
    /// failing.
    pub fn submit_wait<'a, I: Pod, O: Pod>(
        &'a self,
        function: FunctionId,
        input: &'a Buffer<I>,
        in_len: usize,
        output: &'a mut Buffer<O>,
    ) -> Result<Invocation<'a>> {
        let (in_bytes, out_bytes) = self.check(function, input, in_len, output)?;
        let mut tries = 0u32;
        loop {
            match self.claim_output(output) {
                Ok(()) => break,
                Err(Error::BufferBusy) => backoff(&mut tries),
                Err(e) => return Err(e),
            }
        }
        loop {
            match self.take_lane() {
                Ok(Some(lane)) => {
                    return self.launch(lane, function, input, in_bytes, output, out_bytes)
                }
                Ok(None) => backoff(&mut tries),
                Err(e) => {
                    self.unclaim_output(output);
                    return Err(e);
                }
            }
        }
    }

    /// Takes an idle lane for a [`Pipeline`]: many calls in flight on it at
    /// once, as many as the allocation has slots per lane
    /// ([`AllocationSpec::slots`](crate::spec::AllocationSpec::slots)),
    /// submitted and collected by one thread. Fails with
    /// [`Error::AllLanesBusy`] when no lane is idle.
    pub fn pipeline<I: Pod, O: Pod>(&self) -> Result<Pipeline<'_, I, O>> {
        if self.fate.ended() {
            return Err(self.fate.error(Duration::ZERO));
        }
        match self.take_lane()? {
            Some(lane) => Ok(Pipeline::new(
                self,
                lane,
                self.client.options().invocation_timeout,
            )),
            None => Err(Error::AllLanesBusy),
        }
    }

    /// The invocations one lane holds in flight at once: 1 unless the
    /// allocation asked for more slots (and the executor gave them).
    pub fn slots(&self) -> usize {
        self.lanes.first().map_or(1, |l| l.slots())
    }

    /// Waits until `buffer` is no longer the output of a dropped,
    /// unfinished invocation ([`Buffer::is_busy`]): until its late answer
    /// has arrived (or the allocation has ended, after which nothing lands
    /// in it), at most `timeout`. Then the buffer can be read, written and
    /// used again. Returns at once for a buffer at rest.
    pub fn reclaim<T: Pod>(&self, buffer: &Buffer<T>, timeout: Duration) -> Result<()> {
        let until = Instant::now() + timeout;
        loop {
            if !buffer.is_busy() {
                return Ok(());
            }
            for lane in self.lanes.iter() {
                lane.drain_if_idle();
            }
            if !buffer.is_busy() {
                return Ok(());
            }
            if Instant::now() >= until {
                return Err(Error::Timeout {
                    what: "the answer of a dropped invocation",
                    after: timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Calls `function` and waits for it (sleeping): `submit_wait` then
    /// [`Invocation::get`]. Returns the output length in bytes.
    pub fn invoke<I: Pod, O: Pod>(
        &self,
        function: FunctionId,
        input: &Buffer<I>,
        in_len: usize,
        output: &mut Buffer<O>,
    ) -> Result<usize> {
        self.submit_wait(function, input, in_len, output)?.get()
    }

    /// Like [`invoke`](Self::invoke), but after a retryable failure (the
    /// worker crashed or was lost, the executor was lost or is draining,
    /// ...) allocates again with the same spec and token, on the same
    /// executor or, when that one is lost or full, on the next of
    /// [`AllocationSpec::fallback_executor`], and calls again; at most
    /// `retries` times in all (re-allocations that fail count too).
    ///
    /// The old allocation is let go before the new one is asked for, so on
    /// the same executor a crashed worker's cores (which the lease may
    /// need again) are free first; a refusal while they are not
    /// (`allocation_ending`) is waited out without counting as a retry
    /// ([`Client::allocate`]). What it retried past stays readable:
    /// [`retry_causes`](Self::retry_causes).
    ///
    /// The new allocation keeps this one's protection domain, so every
    /// [`Buffer`] made by [`buffer`](Self::buffer) stays valid. It replaces
    /// `self`: ids, lanes and [`cold_start`](Self::cold_start) are the new
    /// worker's.
    pub fn invoke_retrying<I: Pod, O: Pod>(
        &mut self,
        function: FunctionId,
        input: &Buffer<I>,
        in_len: usize,
        output: &mut Buffer<O>,
        retries: u32,
    ) -> Result<usize> {
        let mut attempts = 0u32;
        self.retried.clear();
        loop {
            let err = match self.invoke(function, input, in_len, output) {
                Ok(n) => return Ok(n),
                Err(e) => e,
            };
            if !err.is_retryable() || attempts >= retries {
                return Err(err);
            }
            let mut elsewhere = err.wants_other_executor();
            tracing::info!(error = %err, attempt = attempts + 1, retries, "invocation failed; allocating again");
            self.retried.push(err);
            loop {
                attempts += 1;
                match self.reallocate(elsewhere) {
                    Ok(()) => break,
                    Err(e) if e.is_retryable() && attempts < retries => {
                        tracing::info!(error = %e, attempt = attempts + 1, retries, "re-allocation failed; trying again");
                        elsewhere |= e.wants_other_executor();
                        self.retried.push(e);
                        std::thread::sleep(Duration::from_millis(50 * u64::from(attempts.min(20))));
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    }

    /// Starts a new list of [`retry_causes`](Self::retry_causes).
    pub(crate) fn clear_retry_causes(&mut self) {
        self.retried.clear();
    }

    /// Adds `cause` to [`retry_causes`](Self::retry_causes).
    pub(crate) fn note_retry_cause(&mut self, cause: Error) {
        self.retried.push(cause);
    }

    /// Replaces this allocation by a new one with the same spec, in the
    /// same domain. This one is let go first: it serves nothing more, and
    /// on the same executor its worker's cores (the lease's) are freed
    /// before the new request is read.
    pub(crate) fn reallocate(&mut self, elsewhere: bool) -> Result<()> {
        self.take_renewed_token();
        self.let_go();
        let target = if elsewhere {
            (self.target + 1) % self.executors.len()
        } else {
            self.target
        };
        let mut new = self.client.allocate_in(
            Arc::clone(&self.executors),
            target,
            &self.spec,
            Some(Arc::clone(&self.domain)),
        )?;
        new.moves = self.moves + u64::from(new.executor() != self.executor());
        self.replace(new);
        Ok(())
    }

    /// Becomes `new`, a replacement in the same domain, keeping
    /// [`retry_causes`](Self::retry_causes).
    pub(crate) fn replace(&mut self, new: Allocation) {
        let retried = std::mem::take(&mut self.retried);
        // The old one is dropped here: best-effort deallocation.
        *self = new;
        self.retried = retried;
    }

    /// Ends the allocation: the executor stops the worker and frees its
    /// cores. Waits for the executor's confirmation. An allocation whose
    /// worker already ended, or whose executor is lost, is ended already:
    /// that is not an error.
    pub fn deallocate(mut self) -> Result<()> {
        self.done = true;
        if self.fate.gone() {
            self.conn.forget(self.id);
            return Ok(());
        }
        let request_id = self.conn.next_request_id();
        let frame = Frame::new(
            &Deallocate {
                request_id,
                allocation_id: self.id,
            },
            Vec::new(),
        );
        let reply = self
            .conn
            .request(&frame, request_id, self.client.options().allocation_timeout);
        self.fate.set(FateState::Deallocated);
        self.conn.forget(self.id);
        match reply? {
            Reply::Deallocated => Ok(()),
            Reply::Refused(e) if e.code == ErrorCode::UnknownAllocation => Ok(()),
            Reply::Refused(e) => Err(Error::Refused {
                code: e.code,
                message: e.message,
            }),
            Reply::Allocated(..) | Reply::Renewed(_) => Err(Error::Protocol(
                "the executor answered a Deallocate with another request's reply".into(),
            )),
        }
    }

    /// Moves the allocation's end to that of `token`, a new token for the
    /// same lease (the manager renewed it), and returns the new end (Unix
    /// seconds, as [`expires_at`](Self::expires_at) then says). The
    /// executor checks the token as at allocation, and that it names this
    /// allocation's lease and ends no earlier; it refuses otherwise
    /// ([`Error::Refused`], `lease_mismatch`, `token_forged`, ...) and the
    /// allocation goes on until its old end. A later re-allocation by
    /// [`invoke_retrying`](Self::invoke_retrying) on this executor uses
    /// `token`.
    ///
    /// Renew before the old end: an allocation whose lease has ended is
    /// gone, and renewing it is refused (`unknown_allocation`).
    pub fn renew(&mut self, token: &str) -> Result<u64> {
        let expires_at = self.renewer().renew(token)?;
        self.take_renewed_token();
        Ok(expires_at)
    }

    /// Moves a token a [`Renewer`] got accepted into the executors list,
    /// for re-allocations on this executor.
    fn take_renewed_token(&mut self) {
        let Some(token) = lock(&self.renewal.token).take() else {
            return;
        };
        let mut executors = self.executors.to_vec();
        executors[self.target].1 = token;
        self.executors = executors.into();
    }

    /// Checks a submission's arguments; returns the input and output sizes
    /// in bytes.
    pub(crate) fn check<I: Pod, O: Pod>(
        &self,
        function: FunctionId,
        input: &Buffer<I>,
        in_len: usize,
        output: &Buffer<O>,
    ) -> Result<(u32, u32)> {
        if usize::from(function.0) >= self.functions.len() {
            return Err(Error::UnknownFunction(format!("#{}", function.0)));
        }
        if in_len > input.len() {
            return Err(Error::InvalidArgument(format!(
                "in_len {in_len} is more than the input buffer holds ({})",
                elements(input.len(), std::mem::size_of::<I>())
            )));
        }
        if !self.owns(input) || !self.owns(output) {
            return Err(Error::InvalidArgument(
                "a buffer belongs to another allocation; make buffers with this allocation's buffer()".into(),
            ));
        }
        let in_bytes = u32::try_from(in_len * std::mem::size_of::<I>()).map_err(|_| {
            Error::InvalidArgument(format!(
                "the input is {} bytes; an invocation carries at most 4 GiB - 1",
                in_len * std::mem::size_of::<I>()
            ))
        })?;
        if self.max_input > 0 && u64::from(in_bytes) > self.max_input {
            return Err(self.input_too_large(in_bytes));
        }
        let out_bytes = u32::try_from(output.capacity_bytes()).unwrap_or(u32::MAX);
        if self.fate.ended() {
            return Err(self.fate.error(Duration::ZERO));
        }
        Ok((in_bytes, out_bytes))
    }

    /// An input bigger than the allocation's memory lets its worker pull.
    #[cold]
    fn input_too_large(&self, in_bytes: u32) -> Error {
        // As the executor counts a pulled payload (docs/executor.md): its
        // size, and on shm the client's buffer mapped twice besides.
        let copies = match self.client.options().provider.as_str() {
            "shm" if self.spec.read_only_input => 2,
            "shm" => 3,
            _ => 1,
        };
        let more = ((u64::from(in_bytes) - self.max_input) * copies).div_ceil(1 << 20);
        Error::InvalidArgument(format!(
            "the input is {in_bytes} bytes, but this allocation takes at most {} bytes per call \
             (what its memory_mib {} leaves after the worker's own needs, for pulling a payload \
             bigger than the input buffer); allocate with memory_mib {} or more, or send less",
            self.max_input,
            self.spec.memory_mib,
            u64::from(self.spec.memory_mib) + more,
        ))
    }

    fn claim_output<O: Pod>(&self, output: &Buffer<O>) -> Result<()> {
        let flag = &output.shared.output_busy;
        let claim = || {
            flag.compare_exchange(
                false,
                true,
                std::sync::atomic::Ordering::Acquire,
                std::sync::atomic::Ordering::Relaxed,
            )
            .is_ok()
        };
        if claim() {
            return Ok(());
        }
        // A dropped invocation still targets it: reap what has arrived.
        for lane in self.lanes.iter() {
            lane.drain_if_idle();
        }
        if claim() {
            Ok(())
        } else {
            Err(Error::BufferBusy)
        }
    }

    fn unclaim_output<O: Pod>(&self, output: &Buffer<O>) {
        output
            .shared
            .output_busy
            .store(false, std::sync::atomic::Ordering::Release);
    }

    /// The first idle lane, taken; `None` when all are busy.
    fn take_lane(&self) -> Result<Option<&Arc<Lane>>> {
        for lane in self.lanes.iter() {
            match lane.try_take() {
                Take::Taken => return Ok(Some(lane)),
                Take::Busy => {}
                Take::Broken => return Err(self.fate.error(LOST_GRACE)),
            }
        }
        Ok(None)
    }

    fn launch<'a, I: Pod, O: Pod>(
        &'a self,
        lane: &'a Arc<Lane>,
        function: FunctionId,
        input: &'a Buffer<I>,
        in_bytes: u32,
        output: &'a mut Buffer<O>,
        out_bytes: u32,
    ) -> Result<Invocation<'a>> {
        if let Err(e) = lane.start(
            function.0,
            &input.shared,
            in_bytes,
            &output.shared,
            out_bytes,
        ) {
            lane.release();
            self.unclaim_output(output);
            return Err(e);
        }
        Ok(Invocation::new(
            lane,
            self.client.options().invocation_timeout,
        ))
    }
}

/// What an allocation shares with its [`Renewer`]s.
#[derive(Debug)]
struct Renewal {
    /// When the lease ends, Unix seconds, as the executor last said.
    expires_at: AtomicU64,
    /// A token the executor accepted by a renewal, not yet in the
    /// allocation's executors list. Only renewal and re-allocation touch
    /// it, never an invocation.
    token: Mutex<Option<String>>,
}

/// Renews one [`Allocation`] from any thread: made by
/// [`Allocation::renewer`]. The allocation's
/// [`expires_at`](Allocation::expires_at) follows.
#[derive(Debug, Clone)]
pub struct Renewer {
    conn: Arc<ControlConn>,
    id: u64,
    fate: Arc<Fate>,
    timeout: Duration,
    renewal: Arc<Renewal>,
}

impl Renewer {
    /// The allocation it renews.
    pub fn allocation_id(&self) -> u64 {
        self.id
    }

    /// As [`Allocation::renew`].
    pub fn renew(&self, token: &str) -> Result<u64> {
        if self.fate.ended() {
            return Err(self.fate.error(LOST_GRACE));
        }
        let request_id = self.conn.next_request_id();
        let frame = Frame::new(
            &RenewLease {
                request_id,
                allocation_id: self.id,
                token: token.to_owned(),
            },
            Vec::new(),
        );
        match self.conn.request(&frame, request_id, self.timeout)? {
            Reply::Renewed(expires_at) => {
                self.renewal.expires_at.store(expires_at, Ordering::Relaxed);
                *lock(&self.renewal.token) = Some(token.to_owned());
                Ok(expires_at)
            }
            Reply::Refused(e) => Err(Error::Refused {
                code: e.code,
                message: e.message,
            }),
            Reply::Allocated(..) | Reply::Deallocated => Err(Error::Protocol(
                "the executor answered a RenewLease with another request's reply".into(),
            )),
        }
    }
}

/// Spins a little, then yields, while waiting for a lane.
fn backoff(tries: &mut u32) {
    *tries = tries.saturating_add(1);
    if *tries < 64 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

impl Allocation {
    /// Asks the executor to end the allocation now without waiting for
    /// its word, as a drop does; nothing is served on it afterwards.
    pub(crate) fn let_go(&mut self) {
        // A worker that refuses calls (its node is being taken back), or
        // answered a crash and is dying, is still the executor's, holding
        // its cores until told or reaped: the executor hears of it.
        if !self.done && !self.fate.settled() {
            self.conn.deallocate_nowait(self.id);
        }
        self.done = true;
        self.fate.set(FateState::Deallocated);
        self.conn.forget(self.id);
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        self.let_go();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn allocations_and_buffers_cross_threads() {
        assert_send_sync::<Allocation>();
        assert_send_sync::<Buffer<f64>>();
        assert_send_sync::<Client>();
        assert_send_sync::<Renewer>();
        fn assert_send<T: Send>() {}
        assert_send::<Invocation<'static>>();
    }
}
