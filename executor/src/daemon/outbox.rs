//! The connection loop's inbox: what other threads tell it
//! ([`super::server`]), and the guard that reports a request answered.

use std::sync::mpsc;
use std::sync::Arc;

use super::epoll::Waker;

/// What other threads tell the connection loop ([`super::server`]).
#[derive(Debug)]
pub(crate) enum LoopMsg {
    /// Write these bytes (whole frames) to connection `conn`.
    Send { conn: u64, bytes: Vec<u8> },
    /// The request of connection `conn` is answered: read its next one.
    /// `granted`: it was an allocation that succeeded; `release`: library
    /// bytes of the shared budget it no longer holds.
    Done {
        conn: u64,
        granted: bool,
        release: u64,
    },
    /// The daemon is stopping: answer what is in flight, write what is
    /// queued, and end.
    Stop,
}

/// The loop's inbox: messages, and a wake-up for its epoll wait.
#[derive(Debug)]
pub(crate) struct Outbox {
    tx: mpsc::Sender<LoopMsg>,
    waker: Arc<Waker>,
}

impl Outbox {
    pub(crate) fn new(tx: mpsc::Sender<LoopMsg>, waker: Arc<Waker>) -> Outbox {
        Outbox { tx, waker }
    }

    /// Queues `msg` for the loop. Never blocks.
    pub(crate) fn post(&self, msg: LoopMsg) {
        // Only fails once the loop has ended, when nobody is left to tell.
        if self.tx.send(msg).is_ok() {
            self.waker.wake();
        }
    }
}

/// Reports a request as answered when dropped, so a request thread that
/// panics still lets its connection go on.
#[derive(Debug)]
pub(crate) struct DoneGuard<'a> {
    outbox: &'a Outbox,
    conn: u64,
    pub granted: bool,
    release: u64,
}

impl<'a> DoneGuard<'a> {
    pub(crate) fn new(outbox: &'a Outbox, conn: u64, release: u64) -> DoneGuard<'a> {
        DoneGuard {
            outbox,
            conn,
            granted: false,
            release,
        }
    }
}

impl Drop for DoneGuard<'_> {
    fn drop(&mut self) {
        self.outbox.post(LoopMsg::Done {
            conn: self.conn,
            granted: self.granted,
            release: self.release,
        });
    }
}
