//! A worker thread: serves the invocations of several lanes, one at a
//! time, from the one completion queue all their endpoints complete into.
//!
//! The thread polls (hot) or waits on (warm) its queue; each completion's
//! connection tag ([`lane::tag_of`]) names the lane it belongs to. A request
//! is served as a lane served it alone (see the worker's module docs), then
//! its receive is posted again. A lane whose client went away ends alone;
//! the thread ends when the last of its lanes has. Completions the thread
//! cannot take now (requests that arrive while it pulls a bulk payload or
//! waits for room in a send queue) wait in a queue of their own and are
//! served first, in arrival order.
//!
//! # Batches
//!
//! The requests one poll returns are a batch: the thread holds their
//! answers ([`Running::hold`]) and sends them together after the batch's
//! last function, one [`write_batch`](rfaas_fabric::Endpoint::write_batch)
//! per lane (one `writev` on tcp, one doorbell on shm, one chain of work
//! requests on verbs). A lone request is answered at once, as before. An
//! answer never waits behind a function that may be long: the thread sends
//! what it holds before a function whose last run took longer than
//! [`BATCH_WINDOW`], before a bulk pull, and once the oldest held answer
//! is that old. If a function crashes or overruns meanwhile, the watchdog
//! sends the held answers before its own.
//!
//! # Meter
//!
//! Every lane publishes into its own record: its invocations, bytes and
//! compute time are its own. What the thread does between requests
//! (polling, waiting) is published in the record of its first lane, the
//! thread's own: so hot and warm time count once per thread, as the cores
//! spend it, however many lanes it serves. While the thread serves another
//! lane its own record says [`LaneState::Handling`] (counted nowhere), from
//! the clock read that starts the served lane's function phase to the one
//! that ends it; the other lanes' records say `Handling` between their
//! requests.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfaas_fabric::{
    Access, Completion, Domain, MemoryRegion, Opcode, RemoteAddr, Status, WriteRequest,
};
use rfaas_proto::control::client::Mode;
use rfaas_proto::meter::LaneState;
use rfaas_proto::{InvocationHeader, InvocationStatus, RequestImm, ResponseImm};

use super::lane::{self, Lane, PULL_WR, RECV_DEPTH, RESPONSE_WR};
use super::library::Function;
use super::watchdog::{Answer, Running, ThreadFabric, MAX_HELD};
use super::{DRAINING, EXPIRES_AT};

/// How long a warm thread sleeps in `wait` before it looks again.
const WARM_WAIT: Duration = Duration::from_millis(100);

/// Bytes per read of a bulk payload.
const PULL_CHUNK: usize = 1 << 20;

/// Reads of a bulk payload in flight at once.
const PULL_IN_FLIGHT: usize = 4;

/// Empty polls between two looks at the clock in hot-then-warm mode.
const POLLS_PER_CLOCK_CHECK: u32 = 1024;

/// Completions taken from the queue per poll.
const POLL_BATCH: usize = 32;

/// The longest a held answer waits for the rest of its batch, and the
/// longest a function may have run last time for answers to be held
/// across it.
pub const BATCH_WINDOW: Duration = Duration::from_micros(10);

/// No lane: an entry of the tag table.
const NO_LANE: u16 = u16::MAX;

/// What a worker thread was given.
#[derive(Debug)]
pub struct ThreadConfig {
    /// The thread's number.
    pub index: usize,
    /// CPU to pin the thread to.
    pub cpu: Option<u32>,
    /// How the thread waits.
    pub mode: Mode,
    /// Hot period of [`Mode::HotThenWarm`].
    pub hot_timeout: Duration,
    /// The allocation's output capacity, bytes.
    pub output_capacity: usize,
    /// Largest bulk payload the thread pulls.
    pub pull_limit: usize,
    /// The client promised read-only input: read bulk payloads in place
    /// where the provider maps the client's memory (shm).
    pub read_only_input: bool,
    /// [`BATCH_WINDOW`] in ticks of the lanes' meter clock.
    pub batch_window_ticks: u64,
}

/// A worker thread's lanes, fabric and state.
#[derive(Debug)]
pub struct WorkerThread {
    cfg: ThreadConfig,
    functions: Arc<[Function]>,
    domain: Arc<Domain>,
    fabric: Arc<ThreadFabric>,
    /// The lanes, in the thread's order (the endpoints' too); the first is
    /// the thread's own (see the module docs).
    lanes: Vec<Lane>,
    /// The lane of each connection tag, by [`lane::tag_index`].
    by_tag: Vec<u16>,
    /// Lanes whose client is still there.
    live: usize,
    pull: Option<MemoryRegion>,
    running: Arc<Running>,
    /// What the thread does after a function: polls (hot modes) or handles
    /// what it was woken for (warm).
    after_function: LaneState,
    deferred: VecDeque<Completion>,
    /// When the request served now arrived, in meter ticks (the clock
    /// read when its completion was taken).
    arrived: u64,
    /// When the request of the oldest held answer arrived, in meter ticks.
    held_since: u64,
    /// How long each function ran last time, in meter ticks (`u64::MAX`
    /// before its first run).
    last_run: Vec<u64>,
    /// Lanes whose answers could not be sent, to end at the next
    /// opportunity.
    broken: Vec<usize>,
}

/// Whether the thread goes on.
enum Flow {
    Continue,
    End,
}

/// Whether a lane goes on.
enum LaneFlow {
    Continue,
    End,
}

/// How a request's input was obtained.
enum Input {
    Ready(*mut u8, u32),
    Refused(InvocationStatus),
    End,
}

/// The first `n` reads of a pull all succeeded, or how it failed.
enum Pull {
    Done,
    Failed(InvocationStatus),
    PeerLost,
}

impl WorkerThread {
    /// Assembles a thread from its lanes (at least one), their endpoints
    /// (in `fabric`, in the same order), and the completions its queue gave
    /// while later lanes were being connected (`early`).
    pub fn new(
        cfg: ThreadConfig,
        functions: Arc<[Function]>,
        domain: Arc<Domain>,
        fabric: Arc<ThreadFabric>,
        lanes: Vec<Lane>,
        running: Arc<Running>,
        early: Vec<Completion>,
    ) -> WorkerThread {
        assert!(
            !lanes.is_empty(),
            "a worker thread serves at least one lane"
        );
        let most = lanes.iter().map(|l| lane::tag_index(l.tag)).max();
        let mut by_tag = vec![NO_LANE; most.map_or(0, |m| m + 1)];
        for (i, l) in lanes.iter().enumerate() {
            by_tag[lane::tag_index(l.tag)] = i as u16;
        }
        let after_function = match cfg.mode {
            Mode::Warm => LaneState::Handling,
            _ => LaneState::Hot,
        };
        let receives: usize = lanes.iter().map(|l| l.outputs.len() - 1 + RECV_DEPTH).sum();
        let mut deferred = VecDeque::with_capacity(receives + POLL_BATCH);
        deferred.extend(early);
        WorkerThread {
            cfg,
            last_run: vec![u64::MAX; functions.len()],
            functions,
            domain,
            fabric,
            live: lanes.len(),
            lanes,
            by_tag,
            pull: None,
            running,
            after_function,
            deferred,
            arrived: 0,
            held_since: 0,
            broken: Vec::new(),
        }
    }

    /// Serves invocations until every lane's client has gone away.
    pub fn run(mut self) {
        self.serve_all();
        for l in &mut self.lanes[1..] {
            if l.live {
                l.end();
            }
        }
        self.lanes[0].end();
    }

    /// The thread's own lane's meter.
    fn home(&mut self) -> &mut super::meter::LaneMeter {
        &mut self.lanes[0].meter
    }

    fn serve_all(&mut self) {
        let index = self.cfg.index;
        self.running.bind_thread();
        if let Err(e) = super::crash::arm_thread() {
            tracing::warn!(thread = index, error = %e, "cannot give the worker thread its signal stack; a crash may go unanswered");
        }
        if let Some(cpu) = self.cfg.cpu {
            if let Err(e) = super::privileges::pin_to(&[cpu]) {
                tracing::warn!(thread = index, error = %e, "cannot pin the worker thread");
            }
        }
        let mut done = [Completion::EMPTY; POLL_BATCH];
        let mut hot = self.cfg.mode != Mode::Warm;
        self.home().enter(if hot {
            LaneState::Hot
        } else {
            LaneState::Handling
        });
        for l in &mut self.lanes[1..] {
            l.meter.enter(LaneState::Handling);
        }
        // When the thread last served, read lazily at the first clock check
        // after it (a clock read can cost microseconds; see watchdog.rs).
        let mut last = Some(Instant::now());
        let mut idle_polls = 0u32;
        loop {
            let n = if let Some(c) = self.deferred.pop_front() {
                done[0] = c;
                1
            } else if hot {
                let n = self.fabric.poll(&mut done);
                if n == 0 {
                    if self.cfg.mode == Mode::HotThenWarm {
                        idle_polls += 1;
                        if idle_polls >= POLLS_PER_CLOCK_CHECK {
                            idle_polls = 0;
                            hot = last.get_or_insert_with(Instant::now).elapsed()
                                < self.cfg.hot_timeout;
                        }
                    }
                    std::hint::spin_loop();
                    continue;
                }
                n
            } else {
                // Warm until a request's arrival closes the phase (or the
                // next wait reopens it): nothing to publish on the way
                // from the wake-up to the request.
                self.home().enter(LaneState::Warm);
                match self.fabric.wait(&mut done, WARM_WAIT) {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::error!(thread = index, error = %e, "waiting for completions failed; ending the thread");
                        return;
                    }
                }
            };
            let mut served = false;
            for (i, c) in done[..n].iter().enumerate() {
                let more = i + 1 < n || !self.deferred.is_empty();
                if let Flow::End = self.on_completion(*c, more, &mut served) {
                    return;
                }
                if let Flow::End = self.end_broken() {
                    return;
                }
            }
            if self.running.held_len() > 0 {
                self.send_held();
                if let Flow::End = self.end_broken() {
                    return;
                }
            }
            if served && self.cfg.mode == Mode::HotThenWarm {
                hot = true;
                idle_polls = 0;
                last = None;
            }
        }
    }

    /// The thread's number for the lane a wr_id was posted on; `None` for
    /// a connection dropped while the lanes were being connected.
    #[inline]
    fn lane_of(&self, wr_id: u64) -> Option<usize> {
        let tag = lane::tag_of(wr_id);
        let j = *self.by_tag.get(lane::tag_index(tag))?;
        (j != NO_LANE && self.lanes[usize::from(j)].tag == tag).then_some(usize::from(j))
    }

    /// Takes completion `c`; `more` says whether another of the same poll
    /// follows it.
    fn on_completion(&mut self, c: Completion, more: bool, served: &mut bool) -> Flow {
        let Some(j) = self.lane_of(c.wr_id) else {
            tracing::debug!(thread = self.cfg.index, wr_id = c.wr_id, status = %c.status, "a completion of a connection dropped while the lanes were connected; ignored");
            return Flow::Continue;
        };
        if !self.lanes[j].live {
            return Flow::Continue;
        }
        let lane = self.lanes[j].index;
        if matches!(c.status, Status::PeerLost | Status::Flushed) {
            tracing::info!(lane, status = %c.status, "the client went away; ending the lane");
            return self.end_lane(j);
        }
        match c.opcode {
            Opcode::RecvWithImm if c.status.is_ok() => {
                *served = true;
                self.serve(j, c, more)
            }
            Opcode::RecvWithImm => {
                tracing::error!(lane, status = %c.status, "a receive failed; ending the lane");
                self.end_lane(j)
            }
            _ => {
                if !c.status.is_ok() {
                    tracing::warn!(lane, opcode = ?c.opcode, status = %c.status, "an operation to the client failed (bad output descriptor?)");
                }
                Flow::Continue
            }
        }
    }

    /// Ends the lanes whose answers could not be sent.
    fn end_broken(&mut self) -> Flow {
        while let Some(j) = self.broken.pop() {
            if self.lanes[j].live {
                if let Flow::End = self.end_lane(j) {
                    return Flow::End;
                }
            }
        }
        Flow::Continue
    }

    /// Ends lane `j`; the thread ends with its last lane.
    fn end_lane(&mut self, j: usize) -> Flow {
        if j != 0 {
            self.lanes[j].end();
        } else {
            // The thread's own record goes on saying what the thread does.
            self.lanes[0].live = false;
        }
        self.live -= 1;
        if self.live == 0 {
            Flow::End
        } else {
            Flow::Continue
        }
    }

    /// Serves one request of lane `j`, then posts its receive again. Hot
    /// path (but for bulk pulls and failures).
    fn serve(&mut self, j: usize, c: Completion, more: bool) -> Flow {
        // Read now, used once the request proved inline: see meter.rs.
        self.arrived = self.lanes[0].meter.now();
        if let LaneFlow::End = self.answer(j, c) {
            return self.end_lane(j);
        }
        // The batch's last answer leaves at once, with those held before it.
        if !more || self.running.held_len() == MAX_HELD {
            self.send_held();
            if !self.lanes[j].live || self.broken.contains(&j) {
                return Flow::Continue;
            }
        }
        // After the response, off the invocation's path: a spare receive
        // (RECV_DEPTH) takes the next request if it comes first.
        if let Err(e) = self.fabric.get(j).post_recv(c.wr_id) {
            tracing::error!(lane = self.lanes[j].index, error = %e, "cannot re-post a receive; ending the lane");
            return self.end_lane(j);
        }
        Flow::Continue
    }

    /// Runs the function a request of lane `j` names and holds its
    /// response; `self.arrived` is the clock read when its completion was
    /// taken.
    fn answer(&mut self, j: usize, c: Completion) -> LaneFlow {
        let arrived = self.arrived;
        let req = RequestImm::decode(c.imm);
        let slot = self.lanes[j].slot_of(req.invocation_id);
        // SAFETY: each slot's part of the input region is at least
        // InvocationHeader::LEN bytes (checked at assignment) and starts on
        // a cache line, and the client wrote it before the completion we
        // hold.
        let base = unsafe {
            self.lanes[j]
                .input
                .as_ptr()
                .add(slot * self.lanes[j].stride)
        };
        // SAFETY: as above.
        let head = unsafe { &*base.cast::<[u8; InvocationHeader::LEN]>() };
        // Even a header that does not decode names where to answer.
        let reply = InvocationHeader::peek_reply_to(head);
        let reply_to = RemoteAddr {
            addr: reply.addr,
            rkey: reply.rkey,
        };
        let fits = c.byte_len as usize <= self.lanes[j].slot_capacity;
        let header = match InvocationHeader::decode(head) {
            Ok(h) if c.byte_len as usize >= InvocationHeader::LEN && fits => h,
            _ => {
                self.respond(
                    j,
                    slot,
                    req.invocation_id,
                    reply_to,
                    InvocationStatus::MalformedRequest,
                    0,
                );
                return LaneFlow::Continue;
            }
        };
        let (in_ptr, in_len) = match self.input_of(j, base, &req, &header, c.byte_len) {
            Input::Ready(p, l) => (p, l),
            Input::Refused(status) => {
                self.respond(j, slot, req.invocation_id, reply_to, status, 0);
                return LaneFlow::Continue;
            }
            Input::End => return LaneFlow::End,
        };
        let fi = usize::from(req.function_index);
        let mut started = if header.is_inline() {
            arrived
        } else {
            self.lanes[0].meter.now()
        };
        // Held answers do not wait behind a function that may be long, nor
        // longer than the window; they leave before the function starts,
        // while the thread still owns its endpoints.
        if self.running.held_len() > 0
            && (self.last_run[fi] > self.cfg.batch_window_ticks
                || started.wrapping_sub(self.held_since) > self.cfg.batch_window_ticks)
        {
            self.send_held();
            started = self.lanes[0].meter.now();
        }
        let f = self.functions[fi];
        let lane = &self.lanes[j];
        // SAFETY: out_offset + the rounded output capacity is the region's
        // end, so the pointer is in the region (or at its end, for capacity 0).
        let out_ptr = unsafe { lane.outputs[slot].as_ptr().add(lane.out_offset) };
        let limit = self
            .cfg
            .output_capacity
            .min(header.output_capacity as usize);
        let stamp = self
            .running
            .start(j as u32, req.invocation_id, reply_to, limit as u32);
        if j != 0 {
            self.lanes[0].meter.enter_at(LaneState::Handling, started);
        }
        self.lanes[j].meter.enter_function_at(started, in_len);
        // SAFETY: `in_ptr` holds `in_len` readable bytes (read-only ones
        // when read in place, as the client promised the function only
        // reads); `out_ptr` holds the output capacity, followed by the guard
        // page. The function is the user's, called with the rFaaS contract.
        let returned = unsafe { f(in_ptr.cast(), in_len, out_ptr.cast()) };
        if !self.running.finish(stamp) {
            // The watchdog answered and owns the endpoints; the process ends.
            loop {
                std::thread::park();
            }
        }
        let (status, len) = if returned as usize > limit {
            (InvocationStatus::OutputTooLarge, 0)
        } else {
            (InvocationStatus::Ok, returned as usize)
        };
        // Before the answer: a worker stopped right after it (the client
        // deallocates at once) still counts these bytes.
        self.lanes[j].meter.count_output(len);
        self.respond(j, slot, req.invocation_id, reply_to, status, len);
        // After the answer is held (or on its way): the clock read is off
        // the client's path.
        let now = if j == 0 {
            self.lanes[0].meter.leave_function(self.after_function)
        } else {
            let now = self.lanes[j].meter.leave_function(LaneState::Handling);
            let after = self.after_function;
            self.lanes[0].meter.enter_at(after, now);
            now
        };
        self.last_run[fi] = now.wrapping_sub(started);
        LaneFlow::Continue
    }

    /// Checks a request of lane `j` in order and finds its input. Hot path
    /// for inline payloads.
    fn input_of(
        &mut self,
        j: usize,
        base: *mut u8,
        req: &RequestImm,
        header: &InvocationHeader,
        byte_len: u32,
    ) -> Input {
        let after = byte_len - InvocationHeader::LEN as u32;
        if header.validate_inline(after).is_err() {
            return Input::Refused(InvocationStatus::MalformedRequest);
        }
        if usize::from(req.function_index) >= self.functions.len() {
            return Input::Refused(InvocationStatus::UnknownFunction);
        }
        let expires_at = EXPIRES_AT.load(Ordering::Relaxed);
        if expires_at != 0 && super::watchdog::coarse_unix_secs() >= expires_at {
            return Input::Refused(InvocationStatus::LeaseExpired);
        }
        if DRAINING.load(Ordering::Relaxed) {
            return Input::Refused(InvocationStatus::ExecutorDraining);
        }
        if header.is_inline() {
            // SAFETY: validate_inline proved input_len bytes arrived after
            // the header, inside the slot's part of the input region.
            let p = unsafe { base.add(InvocationHeader::LEN) };
            return Input::Ready(p, header.input_len);
        }
        let len = header.input_len as usize;
        if self.cfg.read_only_input {
            let remote = RemoteAddr {
                addr: header.input_addr,
                rkey: header.input_rkey,
            };
            // In place, through the provider's read-only mapping of the
            // client's buffer: no copy and no memory of ours. The view lasts
            // until the thread's next operation on the endpoint, which comes
            // after the function returned.
            match self.fabric.get(j).peer_view(remote, len) {
                Some(Ok(view)) => return Input::Ready(view.as_ptr().cast_mut(), header.input_len),
                Some(Err(Status::PeerLost | Status::Flushed)) => return Input::End,
                Some(Err(Status::RemoteAccess)) => {
                    return Input::Refused(InvocationStatus::MalformedRequest)
                }
                Some(Err(_)) => return Input::Refused(InvocationStatus::InternalError),
                None => {}
            }
        }
        if len > self.cfg.pull_limit {
            return Input::Refused(InvocationStatus::PayloadTooLarge);
        }
        if !self.grow_pull(len) {
            return Input::Refused(InvocationStatus::PayloadTooLarge);
        }
        // A pull takes a while: what is held leaves first.
        self.send_held();
        match self.pull(j, header) {
            Pull::Done => {
                let region = self.pull.as_ref().expect("grow_pull made the pull region");
                Input::Ready(region.as_ptr(), header.input_len)
            }
            Pull::Failed(status) => Input::Refused(status),
            Pull::PeerLost => Input::End,
        }
    }

    /// Makes the pull region hold at least `len` bytes.
    fn grow_pull(&mut self, len: usize) -> bool {
        if self.pull.as_ref().is_some_and(|r| r.len() >= len) {
            return true;
        }
        // Free the old region first: under a memory limit both may not fit.
        self.pull = None;
        let size = len.max(1).div_ceil(PULL_CHUNK) * PULL_CHUNK;
        match self
            .domain
            .register(size.min(self.cfg.pull_limit.max(len)), Access::LOCAL)
        {
            Ok(region) => {
                self.pull = Some(region);
                true
            }
            Err(e) => {
                tracing::warn!(thread = self.cfg.index, bytes = size, error = %e, "cannot allocate the pull buffer for a bulk payload");
                false
            }
        }
    }

    /// Reads a bulk payload of lane `j` into the pull region: chunks of
    /// [`PULL_CHUNK`], [`PULL_IN_FLIGHT`] at a time. Other completions wait
    /// in the deferred queue.
    fn pull(&mut self, j: usize, header: &InvocationHeader) -> Pull {
        let len = header.input_len as usize;
        let chunks = len.div_ceil(PULL_CHUNK);
        let region = self.pull.take().expect("grow_pull made the pull region");
        let tag = self.lanes[j].tag;
        let (mut posted, mut completed) = (0usize, 0usize);
        let mut failure: Option<Pull> = None;
        let mut done = [Completion::EMPTY; POLL_BATCH];
        loop {
            while failure.is_none() && posted < chunks && posted - completed < PULL_IN_FLIGHT {
                let off = posted * PULL_CHUNK;
                let n = PULL_CHUNK.min(len - off);
                let remote = RemoteAddr {
                    addr: header.input_addr.wrapping_add(off as u64),
                    rkey: header.input_rkey,
                };
                if let Err(e) =
                    self.fabric
                        .get(j)
                        .read(tag | PULL_WR | posted as u64, &region, off, n, remote)
                {
                    tracing::error!(lane = self.lanes[j].index, error = %e, "cannot post a read of a bulk payload");
                    failure = Some(Pull::Failed(InvocationStatus::InternalError));
                    break;
                }
                posted += 1;
            }
            if completed == posted {
                break;
            }
            let n = self.fabric.poll(&mut done);
            for c in &done[..n] {
                if c.opcode == Opcode::Read && lane::tag_of(c.wr_id) == tag {
                    completed += 1;
                    match c.status {
                        Status::Success => {}
                        Status::PeerLost | Status::Flushed => failure = Some(Pull::PeerLost),
                        Status::RemoteAccess => {
                            failure.get_or_insert(Pull::Failed(InvocationStatus::MalformedRequest));
                        }
                        _ => {
                            failure.get_or_insert(Pull::Failed(InvocationStatus::InternalError));
                        }
                    }
                } else {
                    keep(&mut self.deferred, *c);
                }
            }
            if n == 0 {
                std::hint::spin_loop();
            }
        }
        self.pull = Some(region);
        failure.unwrap_or(Pull::Done)
    }

    /// Holds the answer `out[..len]` of lane `j`'s `slot`, with the
    /// response immediate, for [`send_held`](Self::send_held). Hot path.
    ///
    /// A slot's output buffer is written again only by the slot's next
    /// invocation, which the client sends after this response arrived, so
    /// after the fabric has read the buffer: no send completion is awaited.
    fn respond(
        &mut self,
        j: usize,
        slot: usize,
        id: u32,
        to: RemoteAddr,
        status: InvocationStatus,
        len: usize,
    ) {
        let imm = ResponseImm {
            invocation_id: id,
            status,
        }
        .encode()
        .unwrap_or(u32::from(status.code()));
        let held = self.running.hold(Answer {
            lane: j as u32,
            slot: slot as u32,
            offset: self.lanes[j].out_offset as u32,
            len: len as u32,
            imm,
            to,
        });
        if held == 1 {
            self.held_since = self.arrived;
        }
    }

    /// Sends the held answers: one write, or one batch per run of answers
    /// of the same lane. A lane whose answers cannot be sent goes to
    /// `broken`. Hot path.
    fn send_held(&mut self) {
        let (fabric, lanes, deferred, broken) = (
            &self.fabric,
            &self.lanes,
            &mut self.deferred,
            &mut self.broken,
        );
        self.running.drain_held(|held| {
            let mut rest = held;
            while let Some(first) = rest.first() {
                let j = first.lane as usize;
                let run = rest.iter().take_while(|a| a.lane == first.lane).count();
                let (mine, others) = rest.split_at(run);
                rest = others;
                let lane = &lanes[j];
                if !lane.live {
                    continue;
                }
                let write = |a: &Answer| WriteRequest {
                    wr_id: lane.tag | RESPONSE_WR,
                    local: &lane.outputs[a.slot as usize],
                    offset: a.offset as usize,
                    len: a.len as usize,
                    remote: a.to,
                    imm: Some(a.imm),
                    unsignaled: true,
                };
                let one = write(first);
                let result = if run == 1 {
                    // No array to fill for the lone answer of one in flight.
                    let one = std::slice::from_ref(&one);
                    post_reaping(fabric, deferred, |f| f.get(j).write_batch(one))
                } else {
                    let mut batch = [one; MAX_HELD];
                    for (w, a) in batch.iter_mut().zip(mine).skip(1) {
                        *w = write(a);
                    }
                    post_reaping(fabric, deferred, |f| f.get(j).write_batch(&batch[..run]))
                };
                if let Err(e) = result {
                    tracing::error!(lane = lane.index, error = %e, answers = run, "cannot send responses; ending the lane");
                    broken.push(j);
                }
            }
        });
    }
}

/// Posts with `post`; when the send queue is full, reaps its completions
/// (keeping in `deferred` what the thread must still take) and tries once
/// more. Hot path.
#[inline]
fn post_reaping(
    fabric: &ThreadFabric,
    deferred: &mut VecDeque<Completion>,
    post: impl Fn(&ThreadFabric) -> rfaas_fabric::Result<()>,
) -> rfaas_fabric::Result<()> {
    match post(fabric) {
        Err(rfaas_fabric::Error::QueueFull { .. }) => {
            let mut done = [Completion::EMPTY; POLL_BATCH];
            let n = fabric.poll(&mut done);
            let again = post(fabric);
            for c in &done[..n] {
                keep(deferred, *c);
            }
            again
        }
        other => other,
    }
}

/// Keeps in `deferred` a completion the thread cannot take now: requests,
/// and failures (a lost client); successful sends are done with.
fn keep(deferred: &mut VecDeque<Completion>, c: Completion) {
    if c.opcode == Opcode::RecvWithImm || !c.status.is_ok() {
        deferred.push_back(c);
    }
}
