//! [`Invocation`]: one call in flight, awaited by blocking, spinning,
//! polling, or as a future.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::Duration;

use crate::control::lock;
use crate::error::{Error, Result};
use crate::lane::{Deadline, How, Lane};

/// Who has the lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// This invocation.
    Held,
    /// The lane's helper thread, waiting for the response (async path).
    InHelper,
    /// Given back: the result was returned.
    Done,
}

/// An invocation in flight on one lane. It borrows the output buffer until
/// it ends; the result is the output length **in bytes** (the function's
/// return value).
///
/// Wait for it with [`get`](Self::get) (sleeps in the kernel),
/// [`spin`](Self::spin) (busy-polls: the lowest latency, a whole core),
/// [`try_get`](Self::try_get) (never waits), or `.await`. Awaiting hands the
/// lane to a helper thread of the lane, which sleeps in the completion
/// queue and wakes the task; the lane's queue is touched by one thread at a
/// time.
///
/// Dropping it before it ends is safe: the lane stays out of use until the
/// late response arrives (the next submission drains it without waiting),
/// and the output buffer is refused as an output ([`Error::BufferBusy`])
/// until then.
#[derive(Debug)]
#[must_use = "an invocation does nothing useful unless awaited: call get(), spin() or .await"]
pub struct Invocation<'a> {
    lane: &'a Arc<Lane>,
    deadline: Option<Deadline>,
    state: State,
    _output: PhantomData<&'a mut ()>,
}

impl<'a> Invocation<'a> {
    pub(crate) fn new(lane: &'a Arc<Lane>, timeout: Option<Duration>) -> Invocation<'a> {
        Invocation {
            lane,
            deadline: Deadline::after(timeout),
            state: State::Held,
            _output: PhantomData,
        }
    }

    /// The lane it runs on.
    pub fn lane(&self) -> usize {
        self.lane.index
    }

    /// Waits for the result, sleeping in the kernel between completions.
    /// Returns the output length in bytes.
    pub fn get(mut self) -> Result<usize> {
        self.wait(How::Block)
    }

    /// Waits for the result by busy-polling the lane's completion queue:
    /// the lowest latency, and a whole core while it waits. Returns the
    /// output length in bytes.
    ///
    /// Spinning pays only on a CPU of its own. A thread found sharing its
    /// CPU with another busy thread while it spins (a hot worker on this
    /// node, say) waits by sleeping from then on, like [`get`](Self::get),
    /// and the library warns once ([`spin_sleeps`](crate::spin_sleeps)).
    pub fn spin(mut self) -> Result<usize> {
        self.wait(How::Spin)
    }

    /// The result if the invocation has ended, `None` if not yet. Never
    /// waits. After it returned `Some`, the invocation is over.
    pub fn try_get(&mut self) -> Option<Result<usize>> {
        match self.state {
            State::Held => {
                let r = self.lane.complete(How::Poll, self.deadline)?;
                self.finish();
                Some(r)
            }
            State::InHelper => self.take_from_helper(),
            State::Done => Some(Err(done())),
        }
    }

    fn wait(&mut self, how: How) -> Result<usize> {
        match self.state {
            State::Held => {
                let r = self
                    .lane
                    .complete(how, self.deadline)
                    .unwrap_or(Err(Error::WorkerLost));
                self.finish();
                r
            }
            State::InHelper => {
                // Polled as a future before: wait for the helper.
                let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
                loop {
                    {
                        let mut slot = lock(&self.lane.slot);
                        if slot.in_helper {
                            slot.waker = Some(waker.clone());
                        }
                    }
                    if let Some(r) = self.take_from_helper() {
                        return r;
                    }
                    std::thread::park_timeout(Duration::from_millis(50));
                }
            }
            State::Done => Err(done()),
        }
    }

    /// The helper's result, once it has given the lane back.
    fn take_from_helper(&mut self) -> Option<Result<usize>> {
        let mut slot = lock(&self.lane.slot);
        if slot.in_helper {
            return None;
        }
        let r = slot.result.take().unwrap_or(Err(Error::WorkerLost));
        drop(slot);
        self.finish();
        Some(r)
    }

    /// Gives the lane back after the result was taken.
    fn finish(&mut self) {
        self.state = State::Done;
        self.lane.release();
    }
}

fn done() -> Error {
    Error::InvalidArgument("the invocation already returned its result".into())
}

/// Wakes a thread parked in [`Invocation::get`].
struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

impl Future for Invocation<'_> {
    type Output = Result<usize>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<usize>> {
        let this = self.get_mut();
        match this.state {
            State::Held => {
                if let Some(r) = this.lane.complete(How::Poll, this.deadline) {
                    this.finish();
                    return Poll::Ready(r);
                }
                {
                    let mut slot = lock(&this.lane.slot);
                    slot.in_helper = true;
                    slot.abandoned = false;
                    slot.result = None;
                    slot.deadline = this.deadline;
                    slot.waker = Some(cx.waker().clone());
                }
                this.state = State::InHelper;
                if let Err(e) = this.lane.hand_to_helper() {
                    lock(&this.lane.slot).in_helper = false;
                    this.state = State::Held;
                    return Poll::Ready(Err(e));
                }
                Poll::Pending
            }
            State::InHelper => {
                let mut slot = lock(&this.lane.slot);
                if slot.in_helper {
                    if !slot.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                        slot.waker = Some(cx.waker().clone());
                    }
                    return Poll::Pending;
                }
                drop(slot);
                Poll::Ready(this.take_from_helper().unwrap_or(Err(Error::WorkerLost)))
            }
            State::Done => Poll::Ready(Err(done())),
        }
    }
}

impl Drop for Invocation<'_> {
    fn drop(&mut self) {
        match self.state {
            State::Done => {}
            // Unfinished: the lane is left owing a response, which the next
            // submission drains (see the lane module).
            State::Held => self.lane.release(),
            State::InHelper => {
                let mut slot = lock(&self.lane.slot);
                if slot.in_helper {
                    // The helper gives the lane back when it is done.
                    slot.abandoned = true;
                    slot.waker = None;
                } else {
                    slot.result = None;
                    drop(slot);
                    self.lane.release();
                }
            }
        }
    }
}
