//! One lane: a connected endpoint, its completion queue, its buffers, and
//! the loop that serves its invocations one at a time.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfaas_fabric::{Access, Completion, Domain, MemoryRegion, Opcode, RemoteAddr, Status};
use rfaas_proto::control::client::Mode;
use rfaas_proto::meter::LaneState;
use rfaas_proto::{InvocationHeader, InvocationStatus, RequestImm, ResponseImm};

use super::library::Function;
use super::meter::LaneMeter;
use super::watchdog::{LaneEndpoint, Running};
use super::{DRAINING, EXPIRES_AT};

/// Receives kept posted per lane. One invocation is in flight per lane; the
/// spares let the next request land at once while the lane is still
/// sending the previous response, before it posts the consumed receive
/// again.
pub const RECV_DEPTH: usize = 4;

/// How long a warm lane sleeps in `wait` before it looks again.
const WARM_WAIT: Duration = Duration::from_millis(100);

/// Bytes per read of a bulk payload.
const PULL_CHUNK: usize = 1 << 20;

/// Reads of a bulk payload in flight at once.
const PULL_IN_FLIGHT: usize = 4;

/// Empty polls between two looks at the clock in hot-then-warm mode.
const POLLS_PER_CLOCK_CHECK: u32 = 1024;

/// Completions a lane holds back while it pulls a payload (requests that a
/// misbehaving client sent before the previous answer).
const DEFERRED: usize = 8;

/// Bits of a wr_id below the connection tag ([`conn_tag`]).
const TAG_SHIFT: u32 = 48;

/// The tag of the connection made by accept attempt `attempt`, carried in
/// the top bits of every wr_id posted on it (never 0). The lane's
/// completion queue outlives the connections dropped while the lane was
/// being connected, whose receives may complete (flushed) after the lane
/// took it over: the tag tells them apart.
pub fn conn_tag(attempt: u64) -> u64 {
    ((attempt % 0xffff) + 1) << TAG_SHIFT
}

/// The connection tag of `wr_id`.
pub fn tag_of(wr_id: u64) -> u64 {
    wr_id & !((1 << TAG_SHIFT) - 1)
}

/// wr_id (below the tag) of a response write; receives are `0..RECV_DEPTH`.
const RESPONSE_WR: u64 = 1 << 32;

/// wr_id (below the tag) of a pull's first read; chunk `i` is `PULL_WR + i`.
const PULL_WR: u64 = 2 << 32;

/// What a lane was given.
#[derive(Debug)]
pub struct LaneConfig {
    /// Lane number (connection order).
    pub index: usize,
    /// CPU to pin the lane's thread to.
    pub cpu: Option<u32>,
    /// How the lane waits.
    pub mode: Mode,
    /// Hot period of [`Mode::HotThenWarm`].
    pub hot_timeout: Duration,
    /// The allocation's output capacity, bytes.
    pub output_capacity: usize,
    /// Largest bulk payload the lane pulls.
    pub pull_limit: usize,
    /// The client promised read-only input: read bulk payloads in place
    /// where the provider maps the client's memory (shm).
    pub read_only_input: bool,
    /// The lane's connection's tag ([`conn_tag`]).
    pub tag: u64,
}

/// A lane's fabric resources and state.
#[derive(Debug)]
pub struct Lane {
    cfg: LaneConfig,
    functions: Arc<[Function]>,
    domain: Arc<Domain>,
    endpoint: Arc<LaneEndpoint>,
    input: MemoryRegion,
    output: Arc<MemoryRegion>,
    /// Offset of the function's output pointer in `output`: the output ends
    /// at the region's end, where the guard page starts.
    out_offset: usize,
    pull: Option<MemoryRegion>,
    running: Arc<Running>,
    meter: LaneMeter,
    /// What the lane does after a function: polls (hot modes) or handles
    /// what it was woken for (warm).
    after_function: LaneState,
    deferred: [Completion; DEFERRED],
    n_deferred: usize,
}

/// Whether the lane goes on.
enum Flow {
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

impl Lane {
    /// Assembles a lane from its resources.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: LaneConfig,
        functions: Arc<[Function]>,
        domain: Arc<Domain>,
        endpoint: Arc<LaneEndpoint>,
        input: MemoryRegion,
        output: Arc<MemoryRegion>,
        running: Arc<Running>,
        meter: LaneMeter,
    ) -> Lane {
        let out_offset = output.len() - cfg.output_capacity.div_ceil(64) * 64;
        let after_function = match cfg.mode {
            Mode::Warm => LaneState::Handling,
            _ => LaneState::Hot,
        };
        Lane {
            cfg,
            functions,
            domain,
            endpoint,
            input,
            output,
            out_offset,
            pull: None,
            running,
            meter,
            after_function,
            deferred: [Completion::EMPTY; DEFERRED],
            n_deferred: 0,
        }
    }

    /// Serves invocations until the client goes away.
    pub fn run(mut self) {
        self.serve_all();
        self.meter.enter(LaneState::Off);
    }

    fn serve_all(&mut self) {
        self.running.bind_thread();
        if let Err(e) = super::crash::arm_thread() {
            tracing::warn!(lane = self.cfg.index, error = %e, "cannot give the lane thread its signal stack; a crash may go unanswered");
        }
        if let Some(cpu) = self.cfg.cpu {
            if let Err(e) = super::privileges::pin_to(&[cpu]) {
                tracing::warn!(lane = self.cfg.index, error = %e, "cannot pin the lane thread");
            }
        }
        let mut done = [Completion::EMPTY; 16];
        let mut hot = self.cfg.mode != Mode::Warm;
        self.meter.enter(if hot {
            LaneState::Hot
        } else {
            LaneState::Handling
        });
        // When the lane last served, read lazily at the first clock check
        // after it (a clock read can cost microseconds; see watchdog.rs).
        let mut last = Some(Instant::now());
        let mut idle_polls = 0u32;
        loop {
            let n = if self.n_deferred > 0 {
                self.n_deferred -= 1;
                done[0] = self.deferred[self.n_deferred];
                1
            } else if hot {
                let n = self.endpoint.poll(&mut done);
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
                self.meter.enter(LaneState::Warm);
                match self.endpoint.wait(&mut done, WARM_WAIT) {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::error!(lane = self.cfg.index, error = %e, "waiting for completions failed; ending the lane");
                        return;
                    }
                }
            };
            let mut served = false;
            for c in &done[..n] {
                match self.on_completion(*c, &mut served) {
                    Flow::Continue => {}
                    Flow::End => return,
                }
            }
            if served && self.cfg.mode == Mode::HotThenWarm {
                hot = true;
                idle_polls = 0;
                last = None;
            }
        }
    }

    fn on_completion(&mut self, c: Completion, served: &mut bool) -> Flow {
        if tag_of(c.wr_id) != self.cfg.tag {
            tracing::debug!(lane = self.cfg.index, wr_id = c.wr_id, status = %c.status, "a completion of a connection dropped while the lane was connected; ignored");
            return Flow::Continue;
        }
        if matches!(c.status, Status::PeerLost | Status::Flushed) {
            tracing::info!(lane = self.cfg.index, status = %c.status, "the client went away; ending the lane");
            return Flow::End;
        }
        match c.opcode {
            Opcode::RecvWithImm if c.status.is_ok() => {
                *served = true;
                self.serve(c)
            }
            Opcode::RecvWithImm => {
                tracing::error!(lane = self.cfg.index, status = %c.status, "a receive failed; ending the lane");
                Flow::End
            }
            _ => {
                if !c.status.is_ok() {
                    tracing::warn!(lane = self.cfg.index, opcode = ?c.opcode, status = %c.status, "an operation to the client failed (bad output descriptor?)");
                }
                Flow::Continue
            }
        }
    }

    /// Serves one request, then posts its receive again. Hot path (but for
    /// bulk pulls and failures).
    fn serve(&mut self, c: Completion) -> Flow {
        // Read now, used once the request proved inline: see meter.rs.
        let arrived = self.meter.now();
        if let Flow::End = self.answer(c, arrived) {
            return Flow::End;
        }
        // After the response, off the invocation's path: a spare receive
        // (RECV_DEPTH) takes the next request if it comes first.
        if let Err(e) = self.endpoint.get().post_recv(c.wr_id) {
            tracing::error!(lane = self.cfg.index, error = %e, "cannot re-post a receive; ending the lane");
            return Flow::End;
        }
        Flow::Continue
    }

    /// Runs the function a request names and sends its response;
    /// `arrived` is the clock read when its completion was taken.
    fn answer(&mut self, c: Completion, arrived: u64) -> Flow {
        let req = RequestImm::decode(c.imm);
        // SAFETY: the input region is at least InvocationHeader::LEN bytes
        // (checked at assignment), page-aligned, and the client wrote it
        // before the completion we hold.
        let head = unsafe { &*self.input.as_ptr().cast::<[u8; InvocationHeader::LEN]>() };
        // Even a header that does not decode names where to answer.
        let reply = InvocationHeader::peek_reply_to(head);
        let reply_to = RemoteAddr {
            addr: reply.addr,
            rkey: reply.rkey,
        };
        let header = match InvocationHeader::decode(head) {
            Ok(h) if c.byte_len as usize >= InvocationHeader::LEN => h,
            _ => {
                return self.respond(
                    req.invocation_id,
                    reply_to,
                    InvocationStatus::MalformedRequest,
                    0,
                )
            }
        };
        let input = self.input_of(&req, &header, c.byte_len);
        let (in_ptr, in_len) = match input {
            Input::Ready(p, l) => (p, l),
            Input::Refused(status) => return self.respond(req.invocation_id, reply_to, status, 0),
            Input::End => return Flow::End,
        };
        let f = self.functions[usize::from(req.function_index)];
        // SAFETY: out_offset + the rounded output capacity is the region's
        // end, so the pointer is in the region (or at its end, for capacity 0).
        let out_ptr = unsafe { self.output.as_ptr().add(self.out_offset) };
        let limit = self
            .cfg
            .output_capacity
            .min(header.output_capacity as usize);
        let stamp = self
            .running
            .start(req.invocation_id, reply_to, limit as u32);
        let started = if header.is_inline() {
            arrived
        } else {
            self.meter.now()
        };
        self.meter.enter_function_at(started, in_len);
        // SAFETY: `in_ptr` holds `in_len` readable bytes (read-only ones
        // when read in place, as the client promised the function only
        // reads); `out_ptr` holds the output capacity, followed by the guard
        // page. The function is the user's, called with the rFaaS contract.
        let returned = unsafe { f(in_ptr.cast(), in_len, out_ptr.cast()) };
        if !self.running.finish(stamp) {
            // The watchdog answered and owns the endpoint; the process ends.
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
        self.meter.count_output(len);
        let flow = self.respond(req.invocation_id, reply_to, status, len);
        // After the answer is on its way: the clock read is off the
        // client's path.
        self.meter.leave_function(self.after_function);
        flow
    }

    /// Checks a request in order and finds its input. Hot path for inline
    /// payloads.
    fn input_of(&mut self, req: &RequestImm, header: &InvocationHeader, byte_len: u32) -> Input {
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
            // the header, inside the input region.
            let p = unsafe { self.input.as_ptr().add(InvocationHeader::LEN) };
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
            // until the lane's next operation on the endpoint, which comes
            // after the function returned.
            match self.endpoint.get().peer_view(remote, len) {
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
        match self.pull(header) {
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
                tracing::warn!(lane = self.cfg.index, bytes = size, error = %e, "cannot allocate the pull buffer for a bulk payload");
                false
            }
        }
    }

    /// Reads a bulk payload into the pull region: chunks of [`PULL_CHUNK`],
    /// [`PULL_IN_FLIGHT`] at a time.
    fn pull(&mut self, header: &InvocationHeader) -> Pull {
        let len = header.input_len as usize;
        let chunks = len.div_ceil(PULL_CHUNK);
        // Taken out while the loop defers completions into `self`.
        let region = self.pull.take().expect("grow_pull made the pull region");
        let (mut posted, mut completed) = (0usize, 0usize);
        let mut failure: Option<Pull> = None;
        let mut done = [Completion::EMPTY; 16];
        loop {
            while failure.is_none() && posted < chunks && posted - completed < PULL_IN_FLIGHT {
                let off = posted * PULL_CHUNK;
                let n = PULL_CHUNK.min(len - off);
                let remote = RemoteAddr {
                    addr: header.input_addr.wrapping_add(off as u64),
                    rkey: header.input_rkey,
                };
                if let Err(e) = self.endpoint.get().read(
                    self.cfg.tag | PULL_WR | posted as u64,
                    &region,
                    off,
                    n,
                    remote,
                ) {
                    tracing::error!(lane = self.cfg.index, error = %e, "cannot post a read of a bulk payload");
                    failure = Some(Pull::Failed(InvocationStatus::InternalError));
                    break;
                }
                posted += 1;
            }
            if completed == posted {
                break;
            }
            let n = self.endpoint.poll(&mut done);
            let tag = self.cfg.tag;
            for c in done[..n].iter().filter(|c| tag_of(c.wr_id) == tag) {
                match c.opcode {
                    Opcode::Read => {
                        completed += 1;
                        match c.status {
                            Status::Success => {}
                            Status::PeerLost | Status::Flushed => failure = Some(Pull::PeerLost),
                            Status::RemoteAccess => {
                                failure.get_or_insert(Pull::Failed(
                                    InvocationStatus::MalformedRequest,
                                ));
                            }
                            _ => {
                                failure
                                    .get_or_insert(Pull::Failed(InvocationStatus::InternalError));
                            }
                        }
                    }
                    Opcode::RecvWithImm => self.defer(*c),
                    _ => {
                        if !c.status.is_ok() {
                            tracing::warn!(lane = self.cfg.index, opcode = ?c.opcode, status = %c.status, "an operation to the client failed");
                        }
                    }
                }
            }
            if n == 0 {
                std::hint::spin_loop();
            }
        }
        self.pull = Some(region);
        failure.unwrap_or(Pull::Done)
    }

    fn defer(&mut self, c: Completion) {
        if self.n_deferred < DEFERRED {
            // Served last-in first-out; the client broke the one-in-flight
            // rule anyway.
            self.deferred[self.n_deferred] = c;
            self.n_deferred += 1;
        } else {
            tracing::warn!(
                lane = self.cfg.index,
                "the client sent more requests than a lane takes at once; dropping one"
            );
        }
    }

    /// Writes `out[..len]` with the response immediate. Hot path.
    fn respond(&mut self, id: u32, to: RemoteAddr, status: InvocationStatus, len: usize) -> Flow {
        let imm = ResponseImm {
            invocation_id: id,
            status,
        }
        .encode()
        .unwrap_or(u32::from(status.code()));
        match self.endpoint.get().write_with_imm(
            self.cfg.tag | RESPONSE_WR,
            &self.output,
            self.out_offset,
            len,
            to,
            imm,
        ) {
            Ok(()) => Flow::Continue,
            Err(rfaas_fabric::Error::QueueFull { .. }) => {
                // Reap send completions and try once more.
                let mut done = [Completion::EMPTY; 16];
                let n = self.endpoint.poll(&mut done);
                for c in &done[..n] {
                    if c.opcode == Opcode::RecvWithImm {
                        self.defer(*c);
                    }
                }
                match self.endpoint.get().write_with_imm(
                    self.cfg.tag | RESPONSE_WR,
                    &self.output,
                    self.out_offset,
                    len,
                    to,
                    imm,
                ) {
                    Ok(()) => Flow::Continue,
                    Err(e) => self.send_failed(e),
                }
            }
            Err(e) => self.send_failed(e),
        }
    }

    fn send_failed(&self, e: rfaas_fabric::Error) -> Flow {
        tracing::error!(lane = self.cfg.index, error = %e, "cannot send a response; ending the lane");
        Flow::End
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_tags_tell_connections_apart() {
        let tags: Vec<u64> = (0..5).map(conn_tag).collect();
        for (i, &t) in tags.iter().enumerate() {
            assert_ne!(t, 0, "attempt {i}: a tag is never 0");
            for &u in &tags[i + 1..] {
                assert_ne!(t, u);
            }
            // Every wr_id the lane posts keeps its connection's tag...
            for low in [
                0,
                RECV_DEPTH as u64 - 1,
                RESPONSE_WR,
                PULL_WR,
                PULL_WR + 4095,
            ] {
                assert_eq!(tag_of(t | low), t, "{low:#x}");
            }
        }
        // ...and the ids of one connection never carry another's.
        assert_ne!(tag_of(conn_tag(0) | PULL_WR), conn_tag(1));
        assert_eq!(conn_tag(0xffff), conn_tag(0), "wraps after 65535 attempts");
    }
}
