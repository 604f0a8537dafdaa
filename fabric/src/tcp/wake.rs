//! The progress thread's doorbell: an eventfd any thread may ring to make
//! the thread look at its endpoints again. The thread makes it when it
//! starts (`progress`), before any endpoint exists that could ring it.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::OnceLock;

use crate::os;

static DOORBELL: OnceLock<OwnedFd> = OnceLock::new();

/// Keeps `fd` as the doorbell; the first one set stays.
pub(super) fn set(fd: OwnedFd) -> std::os::fd::RawFd {
    DOORBELL.get_or_init(|| fd).as_raw_fd()
}

/// Wakes the progress thread, if it runs. Lock-free.
pub(super) fn ring() {
    if let Some(fd) = DOORBELL.get() {
        os::eventfd_signal(fd.as_raw_fd());
    }
}
