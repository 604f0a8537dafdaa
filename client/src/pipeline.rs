//! [`Pipeline`]: many invocations in flight on one lane, from one thread.
//!
//! A lane of an allocation made with [`AllocationSpec::slots`] holds
//! several invocations at once, each in a slot of its own: its part of the
//! worker's input buffer and its own output buffer in the worker. The
//! client puts invocation `id` in slot `id mod slots`, so the worker finds
//! it by the id its request carries; the answer names the id again, and
//! frees the slot. A slot is a credit: the pipeline sends into a free slot
//! or not at all ([`Error::SlotsFull`]), so the worker never finds a slot
//! taken. Answers come in the order the worker finishes the calls.
//!
//! The pipeline owns the buffers of each call while it is in flight and
//! hands them back with its result ([`Done`]), so no buffer can be read,
//! written or reused under a call: the same ownership a completion-based
//! I/O interface gives.
//!
//! [`AllocationSpec::slots`]: crate::spec::AllocationSpec::slots

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfaas_proto::MAX_INVOCATION_ID;

use crate::allocation::{Allocation, FunctionId};
use crate::buffer::{Buffer, Pod};
use crate::error::{Error, Result, INVOCATION};
use crate::lane::{How, Lane};

/// Names a call of a [`Pipeline`]: numbered from 0 in submission order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CallId(pub u64);

/// A call that has ended, with its buffers back.
#[derive(Debug)]
pub struct Done<I: Pod, O: Pod> {
    /// Which call.
    pub id: CallId,
    /// The output length in bytes, or why the call failed.
    pub result: Result<usize>,
    /// The call's input buffer.
    pub input: Buffer<I>,
    /// The call's output buffer, holding the output.
    pub output: Buffer<O>,
}

/// A submission the pipeline did not take, with its buffers back.
#[derive(Debug)]
pub struct Rejected<I: Pod, O: Pod> {
    /// Why: [`Error::SlotsFull`] when every slot has a call in flight.
    pub error: Error,
    /// The input buffer given.
    pub input: Buffer<I>,
    /// The output buffer given.
    pub output: Buffer<O>,
}

impl<I: Pod, O: Pod> From<Rejected<I, O>> for Error {
    fn from(r: Rejected<I, O>) -> Error {
        r.error
    }
}

/// A call in flight: its buffers and when it times out.
#[derive(Debug)]
struct Pending<I: Pod, O: Pod> {
    id: CallId,
    input: Buffer<I>,
    output: Buffer<O>,
    /// Set at the first look at the clock after the call was sent (see
    /// [`Pipeline::next`]).
    deadline: Option<Instant>,
}

/// Many invocations in flight on one lane of an [`Allocation`], submitted
/// and collected by one thread: as many as the lane has slots
/// ([`slots`](Self::slots)). Made by [`Allocation::pipeline`], which takes
/// an idle lane for the pipeline's life.
///
/// [`submit`](Self::submit) sends a call and returns at once; a full
/// pipeline refuses with [`Error::SlotsFull`] and never blocks.
/// [`stage`](Self::stage) takes a call the same way but sends it with the
/// next [`flush`](Self::flush) (or collection), in one batch with the
/// other staged calls.
/// [`test_any`](Self::test_any) returns a call that has ended, if one has,
/// [`wait_any`](Self::wait_any) waits for one (sleeping in the kernel), and
/// [`spin_any`](Self::spin_any) busy-polls for one; calls end in the order
/// the worker finishes them. Each call honours the client's invocation
/// timeout ([`ClientOptions`](crate::client::ClientOptions)): one that
/// passes it ends with [`Error::Timeout`], and its slot stays taken until
/// the late answer comes.
///
/// Dropping a pipeline with calls in flight drops their buffers; their
/// memory stays registered until the answers have come, and the lane is
/// not used for other calls until then.
#[derive(Debug)]
pub struct Pipeline<'a, I: Pod, O: Pod> {
    alloc: &'a Allocation,
    lane: &'a Arc<Lane>,
    calls: Box<[Option<Pending<I, O>>]>,
    in_flight: usize,
    /// Calls submitted so far.
    submitted: u64,
    timeout: Option<Duration>,
    /// The earliest deadline of a call in flight.
    earliest: Option<Instant>,
    /// A call was sent since deadlines were last given.
    unstamped: bool,
    _not_sync: PhantomData<*const ()>,
}

// SAFETY: a pipeline holds its lane (its `busy` flag), like an
// [`Invocation`](crate::Invocation), which is `Send`; it may move to another
// thread with everything it holds. `PhantomData<*const ()>` only keeps it
// from being `Sync`: its methods take `&mut self` anyway.
unsafe impl<I: Pod, O: Pod> Send for Pipeline<'_, I, O> {}

impl<'a, I: Pod, O: Pod> Pipeline<'a, I, O> {
    pub(crate) fn new(
        alloc: &'a Allocation,
        lane: &'a Arc<Lane>,
        timeout: Option<Duration>,
    ) -> Self {
        Pipeline {
            alloc,
            lane,
            calls: (0..lane.slots()).map(|_| None).collect(),
            in_flight: 0,
            submitted: 0,
            timeout,
            earliest: None,
            unstamped: false,
            _not_sync: PhantomData,
        }
    }

    /// The calls the pipeline holds in flight at most: the lane's slots.
    pub fn slots(&self) -> usize {
        self.calls.len()
    }

    /// The calls in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The allocation it runs on.
    pub fn allocation(&self) -> &'a Allocation {
        self.alloc
    }

    /// The lane it runs on.
    pub fn lane(&self) -> usize {
        self.lane.index
    }

    /// Starts `function` on the first `in_len` elements of `input`; its
    /// output goes to `output`. Returns at once with the call's id. Both
    /// buffers come back with the call's result, or at once in
    /// [`Rejected`] when the call is not sent: [`Error::SlotsFull`] when
    /// every slot is taken, or the error of any other submission. Hot
    /// path: no lock, no allocation.
    pub fn submit(
        &mut self,
        function: FunctionId,
        input: Buffer<I>,
        in_len: usize,
        output: Buffer<O>,
    ) -> std::result::Result<CallId, Rejected<I, O>> {
        self.start(function, input, in_len, output, false)
    }

    /// [`submit`](Self::submit), but the request leaves with the next
    /// [`flush`](Self::flush), together with every other staged one: on
    /// tcp in one system call, on shm behind one doorbell, on verbs as one
    /// chain of work requests. `test_any`, `wait_any` and `spin_any` flush
    /// first, so a staged call is never forgotten; nothing leaves by
    /// itself in between. Hot path: no lock, no allocation.
    pub fn stage(
        &mut self,
        function: FunctionId,
        input: Buffer<I>,
        in_len: usize,
        output: Buffer<O>,
    ) -> std::result::Result<CallId, Rejected<I, O>> {
        self.start(function, input, in_len, output, true)
    }

    /// Sends the staged calls, in the order they were staged. On an error
    /// (the lane broke, or its send queue is full) the calls not sent stay
    /// staged for the next flush; a broken lane ends them with its error.
    pub fn flush(&mut self) -> Result<()> {
        self.lane.pipe_flush()
    }

    fn start(
        &mut self,
        function: FunctionId,
        input: Buffer<I>,
        in_len: usize,
        output: Buffer<O>,
        defer: bool,
    ) -> std::result::Result<CallId, Rejected<I, O>> {
        let reject = |error, input, output| {
            Err(Rejected {
                error,
                input,
                output,
            })
        };
        let (in_bytes, out_bytes) = match self.alloc.check(function, &input, in_len, &output) {
            Ok(sizes) => sizes,
            Err(e) => return reject(e, input, output),
        };
        let Some(slot) = self.free_slot() else {
            let error = Error::SlotsFull {
                slots: self.slots(),
            };
            return reject(error, input, output);
        };
        let id = self.invocation_id(slot);
        if let Err(e) = self.lane.pipe_start(
            slot,
            id,
            function.index(),
            &input.shared,
            in_bytes,
            &output.shared,
            out_bytes,
            defer,
        ) {
            return reject(e, input, output);
        }
        let call = CallId(self.submitted);
        self.submitted += 1;
        self.in_flight += 1;
        self.calls[slot] = Some(Pending {
            id: call,
            input,
            output,
            deadline: None,
        });
        self.unstamped = true;
        Ok(call)
    }

    /// A call that has ended, if one has. Never waits.
    pub fn test_any(&mut self) -> Option<Done<I, O>> {
        self.next(How::Poll)
    }

    /// Waits for a call to end, sleeping in the kernel between
    /// completions. [`Error::InvalidArgument`] when none is in flight.
    pub fn wait_any(&mut self) -> Result<Done<I, O>> {
        self.wait(How::Block)
    }

    /// Waits for a call to end by busy-polling: the lowest latency, and a
    /// whole core while it waits (see [`Invocation::spin`](crate::Invocation::spin)).
    /// [`Error::InvalidArgument`] when none is in flight.
    pub fn spin_any(&mut self) -> Result<Done<I, O>> {
        self.wait(How::Spin)
    }

    fn wait(&mut self, how: How) -> Result<Done<I, O>> {
        if self.in_flight == 0 {
            return Err(Error::InvalidArgument(
                "the pipeline has no call in flight; submit one first".into(),
            ));
        }
        loop {
            if let Some(done) = self.next(how) {
                return Ok(done);
            }
        }
    }

    /// The next call that ended or timed out, waiting as `how` says until
    /// the earliest deadline at most.
    ///
    /// The clock is read only when nothing has ended: a call's deadline
    /// runs from the first such look after it was sent, which a busy
    /// pipeline makes often (each wait returns to look), so the hot path
    /// reads no clock.
    fn next(&mut self, how: How) -> Option<Done<I, O>> {
        if self.in_flight == 0 {
            return None;
        }
        // What cannot leave now stays staged; a broken lane ends it below.
        let _ = self.lane.pipe_flush();
        if how != How::Poll && self.unstamped {
            // A wait must know when to give up before it starts.
            self.stamp(Instant::now());
        }
        if let Some((slot, result)) = self.lane.pipe_next(how, self.earliest) {
            return Some(self.finish(slot, result));
        }
        let timeout = self.timeout?;
        // Nothing ended: a call past its deadline ends with a timeout.
        let slot = self.stamp(Instant::now())?;
        self.lane.pipe_abandon(slot);
        Some(self.finish(
            slot,
            Err(Error::Timeout {
                what: INVOCATION,
                after: timeout,
            }),
        ))
    }

    /// Gives every call sent since the last look its deadline, keeps the
    /// earliest, and returns a call past its deadline at `now`, if any.
    fn stamp(&mut self, now: Instant) -> Option<usize> {
        let timeout = self.timeout?;
        self.unstamped = false;
        let mut expired = None;
        let mut earliest = None::<Instant>;
        for (slot, p) in self.calls.iter_mut().enumerate() {
            let Some(p) = p else { continue };
            let deadline = *p.deadline.get_or_insert(now + timeout);
            if now >= deadline {
                expired.get_or_insert(slot);
            }
            earliest = Some(earliest.map_or(deadline, |e| e.min(deadline)));
        }
        self.earliest = earliest;
        expired
    }

    fn finish(&mut self, slot: usize, result: Result<usize>) -> Done<I, O> {
        let p = self.calls[slot]
            .take()
            .expect("the lane ends only calls the pipeline sent");
        self.in_flight -= 1;
        if self.in_flight == 0 {
            self.earliest = None;
        }
        Done {
            id: p.id,
            result,
            input: p.input,
            output: p.output,
        }
    }

    /// A slot neither this pipeline nor an abandoned call holds.
    fn free_slot(&self) -> Option<usize> {
        if self.in_flight == self.calls.len() {
            return None;
        }
        (0..self.calls.len()).find(|&s| self.calls[s].is_none() && self.lane.pipe_slot_free(s))
    }

    /// The id of the next call, sent in `slot`: `calls × slots + slot`, so
    /// the worker finds the slot as the id modulo the slots (a power of two
    /// dividing the id space, so this holds across the ids' wrap).
    fn invocation_id(&self, slot: usize) -> u32 {
        let slots = self.calls.len() as u32;
        ((self.submitted as u32).wrapping_mul(slots) | slot as u32) & MAX_INVOCATION_ID
    }
}

impl<I: Pod, O: Pod> Drop for Pipeline<'_, I, O> {
    fn drop(&mut self) {
        for slot in 0..self.calls.len() {
            if self.calls[slot].take().is_some() {
                self.lane.pipe_abandon(slot);
            }
        }
        self.lane.release();
    }
}
