//! One lane: an endpoint connected to one worker thread, its completion
//! queue, and the bookkeeping of the invocation in flight on it.
//!
//! # Ownership
//!
//! A lane is taken by flipping its `busy` flag (no lock). Whoever holds the
//! flag, an [`Invocation`](crate::Invocation) or the submission that is
//! starting one, has the lane's [`LaneInner`] (the completion queue above
//! all) to itself. An invocation awaited as a future hands the lane to the
//! lane's helper thread while it sleeps, and takes it back when the helper
//! is done; `AsyncSlot::in_helper` says who has it. So the completion queue
//! is never touched by two threads at once, and the synchronous paths take
//! no lock.
//!
//! # Abandoned invocations
//!
//! A lane is clean when no response is owed and no send is unreaped. An
//! invocation dropped before its response leaves the lane unclean; the next
//! submission that tries the lane drains its completion queue without
//! waiting and skips the lane while the response is still owed. The buffers
//! of the abandoned invocation stay referenced (and flagged busy) until
//! their completions are reaped.

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::Waker;
use std::time::{Duration, Instant};

use rfaas_fabric::{
    Completion, CompletionQueue, Domain, Endpoint, MemoryRegion, Opcode, RemoteAddr, Status,
    WriteRequest,
};
use rfaas_proto::control::client::Descriptor;
use rfaas_proto::{
    next_invocation_id, InvocationHeader, InvocationStatus, RequestImm, ResponseImm,
};

use crate::buffer::{header_offset, RegionShared};
use crate::control::{lock, Fate, FateState};
use crate::error::{Error, Result, INVOCATION};
use crate::spin::{slept_once, spin_sleeps, Probe};

/// wr_id of the request write.
const SEND_WR: u64 = 1;
/// wr_id of the response receive.
const RECV_WR: u64 = 2;
/// wr_id of a pipelined request's write (unsignaled: it completes only
/// when it failed, which ends every call of the lane alike).
const PIPE_SEND_WR: u64 = 3;
/// Completions per poll.
const BATCH: usize = 8;
/// Send and receive depth of a lane's endpoint with one slot: one
/// invocation is in flight, the rest is slack. With more slots, see
/// [`endpoint_depth`].
pub(crate) const ENDPOINT_DEPTH: usize = 8;
/// Receives a lane keeps posted: one for the response in flight, one
/// ahead for the next, posted while a request is on its way rather than
/// before it leaves.
const RECVS_POSTED: u32 = 2;
/// Send and receive depth of a lane's endpoint with `slots` slots: a
/// request and a receive per slot, and the slack.
pub(crate) fn endpoint_depth(slots: u16) -> usize {
    ENDPOINT_DEPTH.max(usize::from(slots) + 4)
}

/// Depth of a lane's completion queue (at least both endpoint depths).
pub(crate) fn cq_depth(slots: u16) -> usize {
    2 * endpoint_depth(slots)
}
/// How long a lane that lost its worker waits for the executor to say why.
pub(crate) const LOST_GRACE: Duration = Duration::from_secs(2);
/// How long one blocking wait sleeps before it looks at the allocation's
/// fate and the timeout again.
const WAIT_SLICE: Duration = Duration::from_millis(50);
/// Empty polls between two looks at the fate and the clock while spinning.
const SPINS_PER_CHECK: u32 = 1024;

/// How long `spin` busy-polls before it also yields the CPU at each check:
/// a spinning thread must not starve a thread of its own process (the
/// fabric's progress thread serving the worker's reads and grants) or a
/// worker that shares its core.
const SPIN_BEFORE_YIELD: Duration = Duration::from_micros(50);

/// How a request leaves the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Header and payload from the input buffer's header slot, one write.
    Inline,
    /// The header alone from the input buffer's header slot; the worker
    /// reads the payload.
    BulkFromSlot,
    /// The header alone from the lane's own header region: the input
    /// buffer's slot is in use by another lane.
    BulkFromLane,
}

/// The request header and how to send it. `input` is the data's
/// `(address, rkey)`; `slot_free` says whether the input buffer's header
/// slot could be taken.
pub(crate) fn plan_request(
    output: (u64, u32, u32),
    input: (u64, u32),
    in_bytes: u32,
    lane_capacity: u32,
    slot_free: bool,
) -> (InvocationHeader, Plan) {
    let fits = InvocationHeader::LEN as u64 + u64::from(in_bytes) <= u64::from(lane_capacity);
    let plan = match (slot_free, fits) {
        (true, true) => Plan::Inline,
        (true, false) => Plan::BulkFromSlot,
        (false, _) => Plan::BulkFromLane,
    };
    let (input_addr, input_rkey) = match plan {
        Plan::Inline => (0, 0),
        Plan::BulkFromSlot | Plan::BulkFromLane => input,
    };
    let header = InvocationHeader {
        output_addr: output.0,
        output_rkey: output.1,
        output_capacity: output.2,
        input_addr,
        input_rkey,
        input_len: in_bytes,
    };
    (header, plan)
}

/// How a waiter waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum How {
    /// Look once.
    Poll,
    /// Busy-poll.
    Spin,
    /// Sleep in the kernel.
    Block,
}

/// The async hand-over between an invocation and the lane's helper thread.
#[derive(Debug, Default)]
pub(crate) struct AsyncSlot {
    /// The helper has the lane.
    pub(crate) in_helper: bool,
    /// The invocation was dropped while the helper had the lane: the
    /// helper releases it when done.
    pub(crate) abandoned: bool,
    /// Woken when the helper is done.
    pub(crate) waker: Option<Waker>,
    /// The helper's result.
    pub(crate) result: Option<Result<usize>>,
    /// The invocation's timeout.
    pub(crate) deadline: Option<Deadline>,
}

/// When a waiter gives up.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline {
    /// The moment.
    pub(crate) at: Instant,
    /// The configured timeout, for the error.
    pub(crate) after: Duration,
}

impl Deadline {
    /// `timeout` from now, if any.
    pub(crate) fn after(timeout: Option<Duration>) -> Option<Deadline> {
        timeout.map(|after| Deadline {
            at: Instant::now() + after,
            after,
        })
    }
}

/// The part of a lane only its holder touches.
struct LaneInner {
    cq: CompletionQueue,
    /// A 32-byte region for headers of requests whose input buffer's slot
    /// is taken.
    header: MemoryRegion,
    next_id: u32,
    /// The invocation id the holder waits for.
    expected: Option<u32>,
    response: Option<Result<usize>>,
    unreaped_sends: u32,
    posted_recvs: u32,
    /// Requests sent and not answered.
    owed: u32,
    input_hold: Option<Arc<RegionShared>>,
    output_hold: Option<Arc<RegionShared>>,
    /// The first error completion: the endpoint is finished.
    broken: Option<Status>,
    /// When the lane broke, or the fate was first seen ended.
    trouble_since: Option<Instant>,
    /// The calls of a [`Pipeline`](crate::Pipeline) in flight, by slot.
    pipe: Box<[Option<Piped>]>,
    /// Slots whose call has ended, in the order they ended (an entry whose
    /// call has gone since is skipped).
    ended: VecDeque<usize>,
    /// Pipelined requests prepared and not yet posted
    /// ([`Lane::pipe_flush`]): slot, bytes and immediate, in order.
    staged: Vec<Staged>,
    done: [Completion; BATCH],
}

/// A pipelined request waiting for [`Lane::pipe_flush`].
#[derive(Debug, Clone, Copy)]
struct Staged {
    slot: usize,
    len: usize,
    imm: u32,
}

/// Staged requests posted per `write_batch` by [`Lane::pipe_flush`].
const FLUSH_CHUNK: usize = 16;

/// A pipelined call in its slot: see [`Pipeline`](crate::Pipeline).
///
/// Its request goes unsignaled: the answer proves it delivered (so its
/// input free), and only a failed send completes.
struct Piped {
    id: u32,
    /// Its answer, once it came.
    answer: Option<Result<usize>>,
    /// Kept registered (and flagged busy) until the call has ended.
    input: Arc<RegionShared>,
    output: Arc<RegionShared>,
    /// Nobody waits for it any more (its pipeline was dropped, or its
    /// timeout passed): it goes once answered.
    abandoned: bool,
}

impl Piped {
    fn ended(&self) -> bool {
        self.answer.is_some()
    }

    /// Frees its buffers' flags.
    fn release(&self) {
        self.input.header_busy.store(false, Ordering::Release);
        self.output.output_busy.store(false, Ordering::Release);
    }
}

/// What a response's status and length mean for its call. `crash_word`
/// reads the signal a `function_crashed` answer carries in the output.
fn answer_of(
    r: ResponseImm,
    byte_len: u32,
    crash_word: impl FnOnce() -> Option<i32>,
) -> Result<usize> {
    match r.status {
        InvocationStatus::Ok => Ok(byte_len as usize),
        InvocationStatus::FunctionCrashed => Err(Error::crashed_in_band(if byte_len == 4 {
            crash_word()
        } else {
            None
        })),
        status => Err(Error::FunctionFailed(status)),
    }
}

impl LaneInner {
    fn is_clean(&self) -> bool {
        self.owed == 0 && self.unreaped_sends == 0
    }

    /// Accounts for a pipelined call's answer; false when `r` is not one.
    fn absorb_piped(&mut self, r: ResponseImm, byte_len: u32) -> bool {
        let slot = (r.invocation_id as usize) & (self.pipe.len() - 1);
        let Some(p) = self.pipe.get_mut(slot).and_then(Option::as_mut) else {
            return false;
        };
        if p.id != r.invocation_id || p.answer.is_some() {
            return false;
        }
        let output = &p.output;
        p.answer = Some(answer_of(r, byte_len, || {
            // SAFETY: the worker wrote 4 bytes there, so the client
            // declared at least 4 bytes of output capacity; the completion
            // orders the write before this read.
            Some(unsafe { output.first_word() })
        }));
        self.on_piped_progress(slot);
        true
    }

    /// A pipelined call in `slot` got its answer: it is ready for its
    /// waiter, or goes if abandoned.
    fn on_piped_progress(&mut self, slot: usize) {
        let Some(p) = &self.pipe[slot] else { return };
        if !p.ended() {
            return;
        }
        if p.abandoned {
            p.release();
            self.pipe[slot] = None;
        } else {
            self.ended.push_back(slot);
        }
    }

    /// Accounts for a pipelined request's send completion: sent
    /// unsignaled, it completes only when it failed, which breaks the lane.
    fn absorb_piped_send(&mut self, status: Status) {
        if !status.is_ok() {
            self.fail(status);
        }
    }

    fn release_input(&mut self) {
        if let Some(r) = self.input_hold.take() {
            r.header_busy.store(false, Ordering::Release);
        }
    }

    /// The first 4 bytes of the held output buffer, little-endian: where a
    /// `function_crashed` response carries the signal.
    fn output_word(&self) -> Option<i32> {
        let r = self.output_hold.as_ref()?;
        // SAFETY: the worker wrote 4 bytes there, so the client declared at
        // least 4 bytes of output capacity, which the buffer holds; the
        // response's completion orders the write before this read.
        Some(unsafe { r.first_word() })
    }

    fn release_output(&mut self) {
        if let Some(r) = self.output_hold.take() {
            r.output_busy.store(false, Ordering::Release);
        }
    }

    fn fail(&mut self, status: Status) {
        if self.broken.is_none() {
            self.broken = Some(status);
            self.trouble_since = Some(Instant::now());
        }
        // A finished endpoint writes nothing more into either buffer.
        self.release_input();
        self.release_output();
    }

    /// Hot path: accounts for one completion.
    fn absorb(&mut self, c: Completion) {
        match c.opcode {
            Opcode::RecvWithImm => {
                self.posted_recvs = self.posted_recvs.saturating_sub(1);
                if !c.status.is_ok() {
                    self.fail(c.status);
                    return;
                }
                self.owed = self.owed.saturating_sub(1);
                let decoded = ResponseImm::decode(c.imm);
                if let Ok(r) = decoded {
                    if self.absorb_piped(r, c.byte_len) {
                        return;
                    }
                }
                let answer = decoded.map(|r| {
                    let a = answer_of(r, c.byte_len, || self.output_word());
                    (r.invocation_id, a)
                });
                self.release_output();
                match answer {
                    Ok((id, a)) if Some(id) == self.expected => self.response = Some(a),
                    // The answer to an abandoned invocation.
                    Ok(_) => {}
                    Err(e) => {
                        if self.expected.is_some() {
                            self.response = Some(Err(Error::Protocol(format!(
                                "the worker answered with a malformed immediate {:#010x}: {e}",
                                c.imm
                            ))));
                        }
                    }
                }
            }
            _ if c.wr_id == PIPE_SEND_WR => {
                self.absorb_piped_send(c.status);
            }
            _ => {
                self.unreaped_sends = self.unreaped_sends.saturating_sub(1);
                self.release_input();
                if !c.status.is_ok() {
                    self.fail(c.status);
                }
            }
        }
    }

    /// Moves completions in; returns how many. Hot path for `Poll`/`Spin`.
    fn pump(&mut self, block: Option<Duration>) -> Result<usize> {
        let n = match block {
            None => self.cq.poll(&mut self.done),
            Some(t) => self.cq.wait(&mut self.done, t)?,
        };
        for i in 0..n {
            let c = self.done[i];
            self.absorb(c);
        }
        Ok(n)
    }
}

/// One lane of an allocation.
pub(crate) struct Lane {
    pub(crate) index: usize,
    // Dropped first: no remote write lands once the lane is gone.
    endpoint: Endpoint,
    /// The lane's input buffer in the worker; `len` is one slot's.
    remote: Descriptor,
    /// Bytes from one slot's part of the input buffer to the next's.
    stride: u64,
    /// Slots minus one: invocation `id` goes to slot `id & slot_mask`.
    slot_mask: u32,
    busy: AtomicBool,
    inner: UnsafeCell<LaneInner>,
    pub(crate) fate: Arc<Fate>,
    pub(crate) slot: Mutex<AsyncSlot>,
    helper: OnceLock<SyncSender<()>>,
    _domain: Arc<Domain>,
}

// SAFETY: two fields are not `Sync`: `inner`, and `endpoint` (an
// `Endpoint` is `Send` but not `Sync`: shm's is not). Both are used only by
// the holder of `busy` (or the helper thread the holder handed the lane to,
// see the module docs), and taking or handing over the lane is an
// acquire/release pair, so neither is ever used from two threads at once;
// they only move between threads, which `Send` allows (checked below).
// Everything else in a lane is `Sync`.
unsafe impl Sync for Lane {}

const _: () = {
    const fn sendable<T: Send>() {}
    sendable::<Endpoint>();
    sendable::<LaneInner>();
};

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane")
            .field("index", &self.index)
            .field("remote", &self.remote)
            .field("busy", &self.busy.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// What [`Lane::try_take`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Take {
    /// The caller holds the lane now.
    Taken,
    /// Held by someone else, or still owed an abandoned response.
    Busy,
    /// Its endpoint failed: the worker is gone.
    Broken,
}

impl Lane {
    /// Assembles a lane around a connected endpoint, with `slots` (a
    /// power of two) `stride` bytes apart in the worker's input buffer.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        index: usize,
        endpoint: Endpoint,
        cq: CompletionQueue,
        header: MemoryRegion,
        remote: Descriptor,
        (slots, stride): (u16, u32),
        fate: Arc<Fate>,
        domain: Arc<Domain>,
    ) -> Lane {
        debug_assert!(slots.is_power_of_two());
        Lane {
            index,
            endpoint,
            remote,
            stride: u64::from(stride),
            slot_mask: u32::from(slots) - 1,
            busy: AtomicBool::new(false),
            inner: UnsafeCell::new(LaneInner {
                cq,
                header,
                next_id: 0,
                expected: None,
                response: None,
                unreaped_sends: 0,
                posted_recvs: 0,
                owed: 0,
                input_hold: None,
                output_hold: None,
                broken: None,
                trouble_since: None,
                pipe: (0..slots).map(|_| None).collect(),
                ended: VecDeque::with_capacity(2 * usize::from(slots)),
                staged: Vec::with_capacity(usize::from(slots)),
                done: [Completion::EMPTY; BATCH],
            }),
            fate,
            slot: Mutex::new(AsyncSlot::default()),
            helper: OnceLock::new(),
            _domain: domain,
        }
    }

    /// The lane's private state.
    ///
    /// # Safety
    ///
    /// The caller holds the lane (took `busy`, or was handed the lane by
    /// its holder) and makes no other reference to it meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn inner(&self) -> &mut LaneInner {
        // SAFETY: exclusive by the caller's contract.
        unsafe { &mut *self.inner.get() }
    }

    /// Takes the lane if it is idle and clean. Hot path: one CAS, and a
    /// non-blocking drain of a lane an abandoned invocation left unclean.
    pub(crate) fn try_take(&self) -> Take {
        if self
            .busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return Take::Busy;
        }
        // SAFETY: we just took busy.
        let inner = unsafe { self.inner() };
        if !inner.is_clean() && inner.broken.is_none() {
            let _ = inner.pump(None);
        }
        if inner.broken.is_some() {
            self.release();
            return Take::Broken;
        }
        if !inner.is_clean() {
            self.release();
            return Take::Busy;
        }
        Take::Taken
    }

    /// Gives the lane back. The caller held it.
    pub(crate) fn release(&self) {
        self.busy.store(false, Ordering::Release);
    }

    /// Drains a lane no one holds (to free a buffer an abandoned invocation
    /// still flags). Never waits.
    pub(crate) fn drain_if_idle(&self) {
        if self.try_take() == Take::Taken {
            self.release();
        }
    }

    /// Sends a request: writes the header (and an inline payload) with a
    /// receive for the response already posted (posting one first only if
    /// none is), then posts the next call's. Hot path. The caller holds the
    /// lane and has flagged `output` busy; on error the lane is as before
    /// and the caller releases both.
    pub(crate) fn start(
        &self,
        function_index: u16,
        input: &Arc<RegionShared>,
        in_bytes: u32,
        output: &Arc<RegionShared>,
        out_bytes: u32,
    ) -> Result<()> {
        // SAFETY: the caller holds the lane.
        let inner = unsafe { self.inner() };
        let id = next_invocation_id(inner.next_id);
        inner.next_id = id;
        let imm = RequestImm {
            invocation_id: id,
            function_index,
        }
        .encode()
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let slot_free = input
            .header_busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok();
        let (header, plan) = plan_request(
            (output.data_addr(), output.region.rkey(), out_bytes),
            (input.data_addr(), input.region.rkey()),
            in_bytes,
            self.remote.len,
            slot_free,
        );
        let (region, offset, len) = match plan {
            Plan::Inline => {
                input.write_header(&header);
                (
                    &input.region,
                    header_offset(),
                    InvocationHeader::LEN + in_bytes as usize,
                )
            }
            Plan::BulkFromSlot => {
                input.write_header(&header);
                (&input.region, header_offset(), InvocationHeader::LEN)
            }
            Plan::BulkFromLane => {
                // The lane's header region holds exactly one header.
                inner.header.write_from(0, &header.to_bytes());
                (&inner.header, 0, InvocationHeader::LEN)
            }
        };
        let unslot = || {
            if slot_free {
                input.header_busy.store(false, Ordering::Release);
            }
        };
        if inner.posted_recvs == 0 {
            if let Err(e) = self.endpoint.post_recv(RECV_WR) {
                unslot();
                return Err(e.into());
            }
            inner.posted_recvs += 1;
        }
        let remote = self.slot_addr(id);
        if let Err(e) = self
            .endpoint
            .write_with_imm(SEND_WR, region, offset, len, remote, imm)
        {
            unslot();
            return Err(e.into());
        }
        inner.expected = Some(id);
        inner.response = None;
        inner.trouble_since = None;
        inner.unreaped_sends += 1;
        inner.owed += 1;
        inner.input_hold = slot_free.then(|| Arc::clone(input));
        inner.output_hold = Some(Arc::clone(output));
        // The next call's receive, while this request travels. A failure
        // here is the next call's to report, when it finds none posted.
        while inner.posted_recvs < RECVS_POSTED && self.endpoint.post_recv(RECV_WR).is_ok() {
            inner.posted_recvs += 1;
        }
        Ok(())
    }

    /// Where in the worker's input buffer invocation `id` goes: its slot's
    /// part.
    #[inline]
    fn slot_addr(&self, id: u32) -> RemoteAddr {
        RemoteAddr {
            addr: self.remote.addr + u64::from(id & self.slot_mask) * self.stride,
            rkey: self.remote.rkey,
        }
    }

    /// Drives the invocation in flight towards its end; `None` when `how`
    /// is [`How::Poll`] and it has not ended. The caller holds the lane.
    ///
    /// A spinning wait on a thread that shares its CPU with another busy
    /// thread sleeps instead (see the `spin` module).
    pub(crate) fn complete(&self, how: How, deadline: Option<Deadline>) -> Option<Result<usize>> {
        let until = deadline.map(|d| d.at);
        let driven = self.spun(how, |how, probe| {
            self.drive(how, until, probe, |inner, how| {
                outcome(self.index, &self.fate, inner, how)
            })
        });
        match driven {
            Driven::Ready(r) => Some(r),
            Driven::Failed(e) => Some(Err(e)),
            Driven::Idle => match deadline.filter(|d| Instant::now() >= d.at) {
                Some(d) => {
                    // SAFETY: the caller holds the lane.
                    unsafe { self.inner() }.expected = None;
                    Some(Err(Error::Timeout {
                        what: INVOCATION,
                        after: d.after,
                    }))
                }
                None => None,
            },
        }
    }

    /// Runs a wait `f` as `how` says, but a spinning wait on a thread that
    /// shares its CPU with another busy thread sleeps instead (see the
    /// `spin` module).
    fn spun<T>(&self, how: How, f: impl FnOnce(How, &mut Probe) -> T) -> T {
        if how == How::Spin && spin_sleeps() {
            slept_once();
            return f(How::Block, &mut Probe::default());
        }
        let mut probe = Probe::default();
        let r = f(how, &mut probe);
        if how == How::Spin && !spin_sleeps() {
            probe.finish();
        }
        r
    }

    /// Moves completions in until `ready` finds what the waiter waits
    /// for; [`Driven::Idle`] when `how` is [`How::Poll`] and it is not
    /// there, or once `until` has passed. The caller holds the lane.
    fn drive<T>(
        &self,
        mut how: How,
        until: Option<Instant>,
        probe: &mut Probe,
        mut ready: impl FnMut(&mut LaneInner, How) -> Option<T>,
    ) -> Driven<T> {
        // SAFETY: the caller holds the lane (see the module docs).
        let inner = unsafe { self.inner() };
        let mut spins = 0u32;
        let mut spinning_since = None::<Instant>;
        loop {
            if let Some(r) = ready(inner, how) {
                return Driven::Ready(r);
            }
            let pumped = match how {
                How::Poll | How::Spin => inner.pump(None),
                How::Block => inner.pump(Some(WAIT_SLICE)),
            };
            let n = match pumped {
                Ok(n) => n,
                Err(e) => return Driven::Failed(e),
            };
            if n > 0 {
                continue;
            }
            if how == How::Spin {
                spins += 1;
                if spins < SPINS_PER_CHECK {
                    std::hint::spin_loop();
                    continue;
                }
                spins = 0;
                if probe.check() {
                    // Another busy thread has this CPU: sleep from now on.
                    how = How::Block;
                } else if spinning_since.get_or_insert_with(Instant::now).elapsed()
                    >= SPIN_BEFORE_YIELD
                {
                    std::thread::yield_now();
                }
            }
            // Nothing came: look at the allocation's fate and the clock.
            if self.fate.gone() && inner.broken.is_none() {
                let since = *inner.trouble_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= LOST_GRACE {
                    inner.fail(Status::PeerLost);
                }
            }
            if let Some(r) = ready(inner, how) {
                return Driven::Ready(r);
            }
            if how == How::Poll || until.is_some_and(|u| Instant::now() >= u) {
                return Driven::Idle;
            }
        }
    }

    /// The lane's slots.
    pub(crate) fn slots(&self) -> usize {
        self.slot_mask as usize + 1
    }

    /// Pipeline: whether no call holds `slot`, not even an abandoned one
    /// still owed its answer. The caller holds the lane.
    pub(crate) fn pipe_slot_free(&self, slot: usize) -> bool {
        // SAFETY: the caller holds the lane.
        let inner = unsafe { self.inner() };
        if let Some(Some(p)) = inner.pipe.get(slot) {
            if !p.abandoned {
                return false;
            }
            // An abandoned call goes once it has ended; look without waiting.
            let _ = inner.pump(None);
        }
        matches!(inner.pipe.get(slot), Some(None))
    }

    /// Pipeline: sends a request in `slot` as invocation `id` (whose
    /// slot it is), the header in the input buffer's header slot. Claims
    /// the input's header slot and the output (both held until the call
    /// has ended). Hot path. The caller holds the lane and found the slot
    /// free; on error nothing has changed.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pipe_start(
        &self,
        slot: usize,
        id: u32,
        function_index: u16,
        input: &Arc<RegionShared>,
        in_bytes: u32,
        output: &Arc<RegionShared>,
        out_bytes: u32,
        defer: bool,
    ) -> Result<()> {
        debug_assert_eq!(id & self.slot_mask, slot as u32);
        // SAFETY: the caller holds the lane.
        let inner = unsafe { self.inner() };
        if let Some(status) = inner.broken {
            return Err(Error::Transport {
                lane: self.index,
                status,
            });
        }
        let imm = RequestImm {
            invocation_id: id,
            function_index,
        }
        .encode()
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let claim = |flag: &AtomicBool| {
            flag.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        };
        if !claim(&output.output_busy) {
            return Err(Error::BufferBusy);
        }
        if !claim(&input.header_busy) {
            output.output_busy.store(false, Ordering::Release);
            return Err(Error::BufferBusy);
        }
        let unclaim = || {
            input.header_busy.store(false, Ordering::Release);
            output.output_busy.store(false, Ordering::Release);
        };
        let (header, plan) = plan_request(
            (output.data_addr(), output.region.rkey(), out_bytes),
            (input.data_addr(), input.region.rkey()),
            in_bytes,
            self.remote.len,
            true,
        );
        input.write_header(&header);
        let len = match plan {
            Plan::Inline => InvocationHeader::LEN + in_bytes as usize,
            _ => InvocationHeader::LEN,
        };
        // A receive for every answer owed, this one's included.
        while inner.posted_recvs <= inner.owed {
            if let Err(e) = self.endpoint.post_recv(RECV_WR) {
                unclaim();
                return Err(e.into());
            }
            inner.posted_recvs += 1;
        }
        if defer {
            inner.staged.push(Staged { slot, len, imm });
        } else if let Err(e) = self
            .endpoint
            .write_batch(&[self.pipe_request(input, id, len, imm)])
        {
            unclaim();
            return Err(e.into());
        }
        inner.owed += 1;
        inner.trouble_since = None;
        inner.pipe[slot] = Some(Piped {
            id,
            answer: None,
            input: Arc::clone(input),
            output: Arc::clone(output),
            abandoned: false,
        });
        Ok(())
    }

    /// The write of pipelined call `id`'s request: `len` bytes of `input`
    /// from its header on, to the call's slot, unsignaled. Hot path.
    #[inline]
    fn pipe_request<'a>(
        &self,
        input: &'a RegionShared,
        id: u32,
        len: usize,
        imm: u32,
    ) -> WriteRequest<'a> {
        WriteRequest {
            wr_id: PIPE_SEND_WR,
            local: &input.region,
            offset: header_offset(),
            len,
            remote: self.slot_addr(id),
            imm: Some(imm),
            unsignaled: true,
        }
    }

    /// Pipeline: posts the requests [`pipe_start`](Self::pipe_start)
    /// staged, in order, [`FLUSH_CHUNK`] per `write_batch`. On an error
    /// the requests not posted stay staged, for the next flush. Hot path.
    /// The caller holds the lane.
    pub(crate) fn pipe_flush(&self) -> Result<()> {
        // SAFETY: the caller holds the lane.
        let inner = unsafe { self.inner() };
        if inner.staged.is_empty() {
            return Ok(());
        }
        let mut posted = 0;
        let mut failed = None;
        while posted < inner.staged.len() {
            let chunk = &inner.staged[posted..inner.staged.len().min(posted + FLUSH_CHUNK)];
            let write = |st: &Staged| {
                let p = inner.pipe[st.slot]
                    .as_ref()
                    .expect("a staged call holds its slot");
                self.pipe_request(&p.input, p.id, st.len, st.imm)
            };
            let first = write(&chunk[0]);
            let mut batch = [first; FLUSH_CHUNK];
            for (w, st) in batch.iter_mut().zip(chunk).skip(1) {
                *w = write(st);
            }
            let result = self.endpoint.write_batch(&batch[..chunk.len()]);
            match result {
                Ok(()) => posted += chunk.len(),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        inner.staged.drain(..posted);
        match failed {
            None => Ok(()),
            Some(e) => Err(e.into()),
        }
    }

    /// Pipeline: the next call that has ended, as its slot and result;
    /// `None` when `how` is [`How::Poll`] and none has, or once `until`
    /// has passed. The caller holds the lane.
    pub(crate) fn pipe_next(
        &self,
        how: How,
        until: Option<Instant>,
    ) -> Option<(usize, Result<usize>)> {
        let driven = self.spun(how, |how, probe| {
            self.drive(how, until, probe, |inner, how| {
                piped_outcome(self.index, &self.fate, inner, how)
            })
        });
        match driven {
            Driven::Ready(r) => Some(r),
            Driven::Idle => None,
            Driven::Failed(e) => {
                // The queue itself failed: the first call in flight says so.
                // SAFETY: the caller holds the lane.
                let inner = unsafe { self.inner() };
                let slot = inner
                    .pipe
                    .iter()
                    .position(|p| p.as_ref().is_some_and(|p| !p.abandoned))?;
                abandon(inner, slot);
                Some((slot, Err(e)))
            }
        }
    }

    /// Pipeline: gives up waiting for the call in `slot`; its buffers stay
    /// registered until its answer has come. The caller holds the lane.
    pub(crate) fn pipe_abandon(&self, slot: usize) {
        // SAFETY: the caller holds the lane.
        abandon(unsafe { self.inner() }, slot);
    }

    /// Hands the lane to its helper thread, which waits for the invocation
    /// and wakes the slot's waker. The caller held the lane and has set
    /// `in_helper`.
    pub(crate) fn hand_to_helper(self: &Arc<Lane>) -> Result<()> {
        let tx = match self.helper.get() {
            Some(tx) => tx,
            None => {
                let (tx, rx) = mpsc::sync_channel::<()>(1);
                let weak = Arc::downgrade(self);
                std::thread::Builder::new()
                    .name(format!("rfaas-lane-{}", self.index))
                    .spawn(move || helper_loop(&weak, &rx))
                    .map_err(|e| {
                        Error::InvalidArgument(format!("cannot start a lane's helper thread: {e}"))
                    })?;
                // Only the lane's holder gets here, so no one raced us.
                let _ = self.helper.set(tx);
                self.helper.get().expect("just set")
            }
        };
        tx.send(())
            .map_err(|_| Error::InvalidArgument("the lane's helper thread ended".into()))
    }
}

/// The invocation's result, if it has one.
fn outcome(index: usize, fate: &Fate, inner: &mut LaneInner, how: How) -> Option<Result<usize>> {
    if inner.unreaped_sends == 0 || inner.broken.is_some() {
        if let Some(r) = inner.response.take() {
            inner.expected = None;
            note_fate(fate, &r);
            return Some(r);
        }
    }
    let e = broken_outcome(index, fate, inner, how)?;
    inner.expected = None;
    Some(Err(e))
}

/// An answer in band that the worker is ending (or will serve nothing
/// more): every other call of the allocation fails at once from here on,
/// with the same error.
fn note_fate(fate: &Fate, r: &Result<usize>) {
    match r {
        Err(Error::WorkerCrashed { signal, .. }) => {
            fate.set(FateState::Crashed { signal: *signal });
        }
        Err(Error::FunctionFailed(status)) if status.ends_worker() => {
            fate.set(FateState::Refusing(*status));
        }
        _ => {}
    }
}

/// What a call on a broken lane ends with; `None` when the lane is not
/// broken, or when it lost its peer and `how` is [`How::Poll`] while the
/// executor may still say why.
fn broken_outcome(index: usize, fate: &Fate, inner: &LaneInner, how: How) -> Option<Error> {
    let status = inner.broken?;
    if !matches!(status, Status::PeerLost | Status::Flushed) {
        return Some(Error::Transport {
            lane: index,
            status,
        });
    }
    if fate.ended() {
        return Some(fate.error(Duration::ZERO));
    }
    let since = inner.trouble_since.unwrap_or_else(Instant::now);
    let left = LOST_GRACE.saturating_sub(since.elapsed());
    if how == How::Poll && !left.is_zero() {
        return None;
    }
    Some(fate.error(left))
}

/// The next pipelined call that has ended (answered, or its lane
/// broken), taken out of its slot; its buffers are free.
fn piped_outcome(
    index: usize,
    fate: &Fate,
    inner: &mut LaneInner,
    how: How,
) -> Option<(usize, Result<usize>)> {
    while let Some(slot) = inner.ended.pop_front() {
        let ready = inner.pipe[slot]
            .as_ref()
            .is_some_and(|p| p.ended() && !p.abandoned);
        if ready {
            return Some((slot, take_piped(fate, inner, slot)));
        }
    }
    inner.broken?;
    // A broken lane: every answered call was in `ended`; the others end
    // with the lane's error, staged ones too.
    let slot = inner
        .pipe
        .iter()
        .position(|p| p.as_ref().is_some_and(|p| !p.abandoned))?;
    let e = broken_outcome(index, fate, inner, how)?;
    remove_piped(inner, slot);
    Some((slot, Err(e)))
}

/// Takes the answered call out of `slot`, freeing its buffers.
fn take_piped(fate: &Fate, inner: &mut LaneInner, slot: usize) -> Result<usize> {
    let call = remove_piped(inner, slot);
    let r = call.answer.expect("answered");
    note_fate(fate, &r);
    r
}

/// Takes the call out of `slot` and frees its buffers' flags; a request
/// of it still staged is forgotten, never sent.
fn remove_piped(inner: &mut LaneInner, slot: usize) -> Piped {
    unstage(inner, slot);
    let call = inner.pipe[slot].take().expect("a call in the slot");
    call.release();
    call
}

/// Marks the call in `slot` abandoned; it goes now if it has ended. A
/// call still staged goes at once: it was never sent.
fn abandon(inner: &mut LaneInner, slot: usize) {
    let staged = unstage(inner, slot);
    let Some(p) = inner.pipe.get_mut(slot).and_then(Option::as_mut) else {
        return;
    };
    p.abandoned = true;
    if staged {
        // Owed no answer: its request never left.
        inner.owed = inner.owed.saturating_sub(1);
    }
    if staged || p.ended() || inner.broken.is_some() {
        remove_piped(inner, slot);
    }
}

/// Forgets the staged request of `slot`, if there is one; whether there was.
fn unstage(inner: &mut LaneInner, slot: usize) -> bool {
    if inner.staged.is_empty() {
        return false;
    }
    let before = inner.staged.len();
    inner.staged.retain(|st| st.slot != slot);
    inner.staged.len() != before
}

/// What a wait found.
enum Driven<T> {
    /// What it waited for.
    Ready(T),
    /// The completion queue failed.
    Failed(Error),
    /// Nothing yet (a poll), or the time is up.
    Idle,
}

/// A lane's helper: waits for the invocation of every hand-over.
fn helper_loop(lane: &Weak<Lane>, rx: &mpsc::Receiver<()>) {
    while rx.recv().is_ok() {
        let Some(lane) = lane.upgrade() else { return };
        let deadline = lock(&lane.slot).deadline;
        let result = lane
            .complete(How::Block, deadline)
            .unwrap_or(Err(Error::WorkerLost));
        let mut slot = lock(&lane.slot);
        slot.in_helper = false;
        if slot.abandoned {
            slot.abandoned = false;
            drop(slot);
            lane.release();
        } else {
            slot.result = Some(result);
            let waker = slot.waker.take();
            drop(slot);
            if let Some(w) = waker {
                w.wake();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfaas_fabric::{Access, Fabric};
    use rfaas_proto::control::client::{ExitCause, WorkerExited};

    /// A lane's state with one request in flight (id 5), as `start` leaves it.
    fn in_flight() -> LaneInner {
        let fabric = Fabric::open("tcp").unwrap();
        let domain = fabric.domain().unwrap();
        LaneInner {
            cq: fabric.completion_queue(cq_depth(1)).unwrap(),
            header: domain.register(32, Access::LOCAL).unwrap(),
            next_id: 5,
            expected: Some(5),
            response: None,
            unreaped_sends: 1,
            posted_recvs: RECVS_POSTED,
            owed: 1,
            input_hold: None,
            output_hold: None,
            broken: None,
            trouble_since: None,
            pipe: (0..4).map(|_| None).collect(),
            ended: VecDeque::new(),
            staged: Vec::new(),
            done: [Completion::EMPTY; BATCH],
        }
    }

    fn sent(status: Status) -> Completion {
        Completion {
            wr_id: SEND_WR,
            opcode: Opcode::WriteWithImm,
            status,
            imm: 0,
            byte_len: 32,
        }
    }

    fn answer(id: u32, st: InvocationStatus, byte_len: u32) -> Completion {
        Completion {
            wr_id: RECV_WR,
            opcode: Opcode::RecvWithImm,
            status: Status::Success,
            imm: ResponseImm {
                invocation_id: id,
                status: st,
            }
            .encode()
            .unwrap(),
            byte_len,
        }
    }

    fn fate() -> Fate {
        Fate::new("127.0.0.1:9".into())
    }

    #[test]
    fn a_response_ends_the_invocation_once_the_send_is_reaped() {
        let f = fate();
        let mut l = in_flight();
        l.absorb(answer(5, InvocationStatus::Ok, 100));
        // The request's send completion is still owed.
        assert!(outcome(0, &f, &mut l, How::Poll).is_none());
        l.absorb(sent(Status::Success));
        assert!(matches!(outcome(0, &f, &mut l, How::Poll), Some(Ok(100))));
        assert!(l.is_clean());
        // The receive posted ahead is left for the next call.
        assert_eq!((l.posted_recvs, l.expected), (RECVS_POSTED - 1, None));
    }

    /// A pipelined request goes unsignaled: its answer alone ends the
    /// call and frees its buffers; only a failed send completes, and it
    /// breaks the lane.
    #[test]
    fn a_pipelined_call_ends_with_its_answer_alone() {
        let domain = Fabric::open("tcp").unwrap().domain().unwrap();
        let input = crate::buffer::Buffer::<u8>::new(&domain, 8).unwrap();
        let output = crate::buffer::Buffer::<u8>::new(&domain, 8).unwrap();
        let mut l = in_flight();
        (l.expected, l.unreaped_sends) = (None, 0);
        for (id, abandoned) in [(5, false), (6, true)] {
            input.shared.header_busy.store(true, Ordering::Relaxed);
            output.shared.output_busy.store(true, Ordering::Relaxed);
            l.owed = 1;
            // Slot 5 & 3 = 1, then 6 & 3 = 2.
            l.pipe[id as usize & 3] = Some(Piped {
                id,
                answer: None,
                input: input.shared.clone(),
                output: output.shared.clone(),
                abandoned,
            });
            l.absorb(answer(id, InvocationStatus::Ok, 8));
            assert!(l.is_clean(), "call {id}");
        }
        assert_eq!(l.ended, [1], "the call waited for is ready");
        assert!(l.pipe[2].is_none(), "the abandoned call went");
        assert!(!input.shared.header_busy.load(Ordering::Relaxed));
        assert!(!output.shared.output_busy.load(Ordering::Relaxed));
        assert_eq!(l.broken, None);
        l.absorb(Completion {
            wr_id: PIPE_SEND_WR,
            status: Status::RemoteAccess,
            ..sent(Status::RemoteAccess)
        });
        assert_eq!(l.broken, Some(Status::RemoteAccess));
    }

    /// A call still staged when its lane breaks ends with the lane's
    /// error, and its request is forgotten: no later flush looks for it.
    #[test]
    fn a_broken_lane_ends_a_staged_call_and_forgets_its_request() {
        let domain = Fabric::open("tcp").unwrap().domain().unwrap();
        let input = crate::buffer::Buffer::<u8>::new(&domain, 8).unwrap();
        let output = crate::buffer::Buffer::<u8>::new(&domain, 8).unwrap();
        input.shared.header_busy.store(true, Ordering::Relaxed);
        output.shared.output_busy.store(true, Ordering::Relaxed);
        let f = fate();
        let mut l = in_flight();
        (l.expected, l.unreaped_sends) = (None, 0);
        l.pipe[1] = Some(Piped {
            id: 5,
            answer: None,
            input: input.shared.clone(),
            output: output.shared.clone(),
            abandoned: false,
        });
        l.staged.push(Staged {
            slot: 1,
            len: 32,
            imm: 0,
        });
        l.fail(Status::RemoteAccess);
        let (slot, r) = piped_outcome(3, &f, &mut l, How::Poll).expect("the lane's error");
        assert_eq!(slot, 1);
        assert!(
            matches!(
                r,
                Err(Error::Transport {
                    lane: 3,
                    status: Status::RemoteAccess
                })
            ),
            "{r:?}"
        );
        assert!(l.pipe[1].is_none());
        assert!(
            l.staged.is_empty(),
            "a flush would look for a call that is gone"
        );
        assert!(!input.shared.header_busy.load(Ordering::Relaxed));
        assert!(!output.shared.output_busy.load(Ordering::Relaxed));
    }

    #[test]
    fn statuses_become_function_failures() {
        let f = fate();
        let mut l = in_flight();
        l.absorb(sent(Status::Success));
        l.absorb(answer(5, InvocationStatus::OutputTooLarge, 0));
        assert!(matches!(
            outcome(0, &f, &mut l, How::Poll),
            Some(Err(Error::FunctionFailed(InvocationStatus::OutputTooLarge)))
        ));
        assert!(!f.ended(), "the worker serves on after output_too_large");
    }

    #[test]
    fn an_answer_after_which_the_worker_serves_nothing_ends_the_allocation() {
        for status in [
            InvocationStatus::DeadlineExceeded,
            InvocationStatus::LeaseExpired,
            InvocationStatus::ExecutorDraining,
        ] {
            let f = fate();
            let mut l = in_flight();
            l.absorb(sent(Status::Success));
            l.absorb(answer(5, status, 0));
            assert!(matches!(
                outcome(0, &f, &mut l, How::Poll),
                Some(Err(Error::FunctionFailed(s))) if s == status
            ));
            // The next call fails at once, with the same cause, without
            // waiting for the worker's end or the executor's report.
            assert!(f.ended(), "{status:?}");
            assert!(
                matches!(f.error(Duration::ZERO), Error::FunctionFailed(s) if s == status),
                "{status:?}"
            );
        }
    }

    #[test]
    fn a_crash_answer_is_a_worker_crash_with_its_signal() {
        let f = fate();
        let mut l = in_flight();
        let domain = Fabric::open("tcp").unwrap().domain().unwrap();
        let mut output = crate::buffer::Buffer::<i32>::new(&domain, 1).unwrap();
        output.write_from(0, &[7]);
        let shared = output.shared.clone();
        shared.output_busy.store(true, Ordering::Relaxed);
        l.output_hold = Some(shared.clone());
        l.absorb(sent(Status::Success));
        l.absorb(answer(5, InvocationStatus::FunctionCrashed, 4));
        let e = outcome(0, &f, &mut l, How::Poll);
        assert!(
            matches!(
                e,
                Some(Err(Error::WorkerCrashed {
                    signal: Some(7),
                    cause: ExitCause::Crashed,
                    ..
                }))
            ),
            "{e:?}"
        );
        assert!(!shared.output_busy.load(Ordering::Relaxed));
        assert!(f.ended(), "the allocation is known to be ending");
        assert!(matches!(
            f.error(Duration::ZERO),
            Error::WorkerCrashed {
                signal: Some(7),
                ..
            }
        ));

        // A client output buffer under 4 bytes: no signal.
        let mut l = in_flight();
        l.absorb(sent(Status::Success));
        l.absorb(answer(5, InvocationStatus::FunctionCrashed, 0));
        assert!(matches!(
            outcome(0, &f, &mut l, How::Poll),
            Some(Err(Error::WorkerCrashed { signal: None, .. }))
        ));
    }

    #[test]
    fn a_stale_answer_is_drained_not_returned() {
        let f = fate();
        let mut l = in_flight();
        l.expected = None; // abandoned
        l.absorb(sent(Status::Success));
        l.absorb(answer(5, InvocationStatus::Ok, 8));
        assert!(l.is_clean());
        assert!(l.response.is_none());
        assert!(outcome(0, &f, &mut l, How::Poll).is_none());
    }

    #[test]
    fn a_malformed_immediate_is_a_protocol_error() {
        let f = fate();
        let mut l = in_flight();
        l.absorb(sent(Status::Success));
        let mut c = answer(5, InvocationStatus::Ok, 0);
        c.imm = (5 << 12) | 0xfff;
        l.absorb(c);
        assert!(matches!(
            outcome(0, &f, &mut l, How::Poll),
            Some(Err(Error::Protocol(_)))
        ));
    }

    #[test]
    fn a_refused_send_is_a_transport_error() {
        let f = fate();
        let mut l = in_flight();
        l.absorb(sent(Status::RemoteAccess));
        assert!(matches!(
            outcome(3, &f, &mut l, How::Poll),
            Some(Err(Error::Transport {
                lane: 3,
                status: Status::RemoteAccess
            }))
        ));
    }

    #[test]
    fn peer_loss_asks_the_fate() {
        let mut l = in_flight();
        let mut lost = answer(0, InvocationStatus::Ok, 0);
        lost.status = Status::PeerLost;
        l.absorb(lost);
        assert_eq!(l.broken, Some(Status::PeerLost));

        // No news yet: polling keeps waiting for the executor's word.
        let f = fate();
        assert!(outcome(0, &f, &mut l, How::Poll).is_none());
        f.set(FateState::Exited(WorkerExited {
            allocation_id: 1,
            cause: ExitCause::Crashed,
            signal: Some(11),
            exit_code: None,
            message: "worker 2 killed by SIGSEGV".into(),
        }));
        assert!(matches!(
            outcome(0, &f, &mut l, How::Poll),
            Some(Err(Error::WorkerCrashed {
                signal: Some(11),
                ..
            }))
        ));

        let f = fate();
        f.set(FateState::ExecutorLost);
        assert!(matches!(
            outcome(0, &f, &mut l, How::Block),
            Some(Err(Error::ExecutorLost { .. }))
        ));

        // Nothing from the executor within the grace period.
        let f = fate();
        l.trouble_since = Some(Instant::now() - LOST_GRACE);
        assert!(matches!(
            outcome(0, &f, &mut l, How::Poll),
            Some(Err(Error::WorkerLost))
        ));
    }

    const OUT: (u64, u32, u32) = (0x7f00_0000_1000, 0x11, 4096);
    const IN: (u64, u32) = (0x7f00_0000_9000, 0x22);

    #[test]
    fn inline_up_to_the_lane_capacity() {
        // 32 + 4064 = 4096: fits exactly.
        let (h, plan) = plan_request(OUT, IN, 4064, 4096, true);
        assert_eq!(plan, Plan::Inline);
        assert_eq!(
            h,
            InvocationHeader {
                output_addr: OUT.0,
                output_rkey: OUT.1,
                output_capacity: OUT.2,
                input_addr: 0,
                input_rkey: 0,
                input_len: 4064,
            }
        );
        assert!(h.is_inline());
        let (h, plan) = plan_request(OUT, IN, 0, 32, true);
        assert_eq!(plan, Plan::Inline);
        assert_eq!(h.input_len, 0);
    }

    #[test]
    fn bulk_past_the_lane_capacity() {
        let (h, plan) = plan_request(OUT, IN, 4065, 4096, true);
        assert_eq!(plan, Plan::BulkFromSlot);
        assert_eq!(
            (h.input_addr, h.input_rkey, h.input_len),
            (IN.0, IN.1, 4065)
        );
        assert!(!h.is_inline());
        assert_eq!(h.validate(), Ok(()));
        let (_, plan) = plan_request(OUT, IN, u32::MAX, u32::MAX, true);
        assert_eq!(plan, Plan::BulkFromSlot);
    }

    #[test]
    fn bulk_from_the_lane_when_the_slot_is_taken() {
        let (h, plan) = plan_request(OUT, IN, 10, 4096, false);
        assert_eq!(plan, Plan::BulkFromLane);
        assert_eq!((h.input_addr, h.input_rkey, h.input_len), (IN.0, IN.1, 10));
        assert_eq!((h.output_addr, h.output_rkey), (OUT.0, OUT.1));
    }
}
