//! A lane's meter: its running counters, kept in the lane thread, and
//! published to the lane's record in the meter area ([`rfaas_proto::meter`])
//! at every change of what the lane does.
//!
//! The lane is the record's only writer. It never reads the record back:
//! its own values live here, so whatever the function writes into the area
//! is overwritten at the lane's next change, and the lane's figures stay
//! its own (the daemon trusts neither; see `daemon::usage`).
//!
//! Per invocation the lane reads the clock twice, when the request
//! arrives and once it has answered ([`LaneMeter::enter_function_at`],
//! [`LaneMeter::leave_function`]), and makes three short series of plain
//! stores into one cache line pair, under the record's sequence number
//! (the third, [`LaneMeter::count_output`], before the answer: the output
//! bytes, so a worker stopped right after answering has counted them).
//! Nothing else: no system call, no read-modify-write, no lock. Both reads
//! stay off the client's path as far as they can: the first is taken
//! before the lane re-posts its receive and decodes the request, so it has
//! completed when the stores that need it are made (a store waiting for
//! it would hold up the answer's stores behind it); the second after the
//! answer is posted. So the phase [`LaneState::Function`] runs from the
//! request's arrival to its answer: the lane's own handling of an inline
//! request, well under a microsecond, is counted with the function, and
//! hot-polling is exactly the time spent spinning between requests. A
//! bulk input's pull (the lane polling for its reads) counts as polling:
//! the clock is read again after it.

use std::sync::atomic::Ordering::Relaxed;

use rfaas_proto::meter::{Clock, LaneRecord, LaneState, LaneValues};

use crate::meter::ticks;

/// One lane's counters and its record.
#[derive(Debug)]
pub struct LaneMeter {
    record: &'static LaneRecord,
    clock: Clock,
    /// The record's sequence number: even between changes.
    seq: u64,
    v: LaneValues,
    state: LaneState,
}

impl LaneMeter {
    /// A meter publishing to `record`, with ticks of `clock`; the lane is
    /// [`LaneState::Off`] until its first [`enter`](Self::enter).
    pub fn new(record: &'static LaneRecord, clock: Clock) -> LaneMeter {
        let mut m = LaneMeter {
            record,
            clock,
            seq: 0,
            v: LaneValues {
                state: LaneState::Off.code(),
                since: ticks(clock),
                ..LaneValues::default()
            },
            state: LaneState::Off,
        };
        m.seq = record.publish(0, &m.v);
        m
    }

    /// A meter whose record nobody reads: for a worker started without a
    /// meter area (by hand, or by tests of the worker alone).
    pub fn unread() -> LaneMeter {
        LaneMeter::new(Box::leak(Box::default()), Clock::Monotonic)
    }

    /// The lane's counters as last published.
    pub fn values(&self) -> LaneValues {
        self.v
    }

    /// Ends the phase under way at `now`, adding its ticks to its counter.
    #[inline]
    fn close_phase(&mut self, now: u64) {
        let d = now.saturating_sub(self.v.since);
        match self.state {
            LaneState::Hot => self.v.hot = self.v.hot.wrapping_add(d),
            LaneState::Function => self.v.compute = self.v.compute.wrapping_add(d),
            LaneState::Warm => self.v.warm = self.v.warm.wrapping_add(d),
            LaneState::Off | LaneState::Handling => {}
        }
        self.v.since = now;
    }

    /// The lane now does `state` (not [`LaneState::Function`]: see
    /// [`enter_function`](Self::enter_function)). Publishes every field.
    pub fn enter(&mut self, state: LaneState) {
        self.enter_at(state, ticks(self.clock));
    }

    /// [`enter`](Self::enter) with the clock read earlier, at `now`: a
    /// worker thread that serves another lane's request moves its own lane's
    /// record out of polling at the request's arrival, and back at its
    /// answer, with the clock reads the served lane's record took.
    pub fn enter_at(&mut self, state: LaneState, now: u64) {
        self.close_phase(now);
        self.state = state;
        self.v.state = state.code();
        self.seq = self.record.publish(self.seq, &self.v);
    }

    /// The clock now, for [`enter_function_at`](Self::enter_function_at).
    /// Hot path.
    #[inline]
    pub fn now(&self) -> u64 {
        ticks(self.clock)
    }

    /// The lane calls the function now, with `in_len` input bytes. Hot
    /// path: one clock read, seven stores.
    #[inline]
    pub fn enter_function(&mut self, in_len: u32) {
        self.enter_function_at(ticks(self.clock), in_len);
    }

    /// [`enter_function`](Self::enter_function) with the clock read
    /// earlier, at `now` ([`now`](Self::now)): the read can then complete
    /// while the lane does other work, instead of holding up the stores
    /// after it (and, in order behind them, the answer's). Hot path: seven
    /// stores.
    #[inline]
    pub fn enter_function_at(&mut self, now: u64, in_len: u32) {
        self.close_phase(now);
        self.state = LaneState::Function;
        self.v.state = LaneState::Function.code();
        self.v.invocations = self.v.invocations.wrapping_add(1);
        self.v.bytes_in = self.v.bytes_in.wrapping_add(u64::from(in_len));
        let r = self.record;
        r.begin(self.seq);
        r.state.store(self.v.state, Relaxed);
        r.since.store(self.v.since, Relaxed);
        r.invocations.store(self.v.invocations, Relaxed);
        r.bytes_in.store(self.v.bytes_in, Relaxed);
        r.hot.store(self.v.hot, Relaxed);
        r.warm.store(self.v.warm, Relaxed);
        self.seq = r.end(self.seq);
    }

    /// The function returned `out_len` output bytes (0 when its output was
    /// refused); counted before the lane answers, so a worker stopped right
    /// after the answer (a client that deallocates at once) has them in its
    /// final usage. Hot path: three stores, no clock read.
    #[inline]
    pub fn count_output(&mut self, out_len: usize) {
        self.v.bytes_out = self.v.bytes_out.wrapping_add(out_len as u64);
        let r = self.record;
        r.begin(self.seq);
        r.bytes_out.store(self.v.bytes_out, Relaxed);
        self.seq = r.end(self.seq);
    }

    /// The lane has answered and goes on in `next` ([`LaneState::Hot`] or
    /// [`LaneState::Handling`]); returns the clock read. Hot path: one
    /// clock read, four stores.
    #[inline]
    pub fn leave_function(&mut self, next: LaneState) -> u64 {
        let now = ticks(self.clock);
        self.close_phase(now);
        self.state = next;
        self.v.state = next.code();
        let r = self.record;
        r.begin(self.seq);
        r.state.store(self.v.state, Relaxed);
        r.since.store(self.v.since, Relaxed);
        r.compute.store(self.v.compute, Relaxed);
        self.seq = r.end(self.seq);
        now
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> &'static LaneRecord {
        Box::leak(Box::default())
    }

    #[test]
    fn every_tick_lands_in_the_phase_it_belongs_to() {
        let r = record();
        let mut m = LaneMeter::new(r, Clock::Monotonic);
        m.enter(LaneState::Hot);
        let start = m.values().since;
        for i in 0..3u32 {
            m.enter_function(10 + i);
            std::hint::black_box(vec![0u8; 1000]);
            m.count_output(4);
            m.leave_function(LaneState::Hot);
        }
        m.enter(LaneState::Warm);
        m.enter(LaneState::Handling);
        m.enter(LaneState::Off);
        let v = m.values();
        assert_eq!(v.invocations, 3);
        assert_eq!(v.bytes_in, 10 + 11 + 12);
        assert_eq!(v.bytes_out, 12);
        // Off, Handling: no bucket; everything else from the first Hot to
        // the last change is in exactly one bucket or in Handling.
        assert!(v.compute + v.hot + v.warm <= v.since - start);
        assert!(v.compute > 0 && v.hot > 0);
        assert_eq!(v.state, LaneState::Off.code());
        // The record says the same, consistently.
        assert_eq!(r.read(1), (v, true));
    }

    #[test]
    fn what_the_function_writes_into_the_record_is_overwritten() {
        let r = record();
        let mut m = LaneMeter::new(r, Clock::Monotonic);
        m.enter(LaneState::Hot);
        m.enter_function(1);
        // The function scribbles on its own lane's record.
        r.compute.store(u64::MAX, Relaxed);
        r.invocations.store(0, Relaxed);
        m.count_output(0);
        m.leave_function(LaneState::Hot);
        m.enter(LaneState::Hot);
        let (seen, consistent) = r.read(1);
        assert!(consistent);
        assert_eq!(seen.invocations, 1);
        assert!(seen.compute < u64::MAX / 2);
    }
}
