//! The few epoll, eventfd and poll calls the software providers share.
//!
//! None of these is on a hot path: they serve `wait`, set-up and the
//! progress threads.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use crate::error::{Error, Result};

/// Waits until `fd` is readable; `false` on timeout.
pub(crate) fn wait_readable(fd: RawFd, timeout: Option<Duration>) -> Result<bool> {
    let ms = timeout_ms(timeout);
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: pfd is a valid pollfd for the duration of the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc >= 0 {
            return Ok(rc > 0);
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::io("poll", err));
        }
    }
}

/// A duration as epoll/poll milliseconds, rounded up (a sleep never ends early).
pub(crate) fn ceil_ms(d: Duration) -> i32 {
    d.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as i32
}

/// A timeout as epoll/poll milliseconds, rounded up; -1 for none.
pub(crate) fn timeout_ms(timeout: Option<Duration>) -> i32 {
    timeout.map_or(-1, ceil_ms)
}

pub(crate) fn epoll_create() -> Result<OwnedFd> {
    // SAFETY: plain syscall.
    let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if fd < 0 {
        return Err(Error::last_os("epoll_create1"));
    }
    // SAFETY: fd is fresh and ours.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub(crate) fn eventfd() -> Result<OwnedFd> {
    // SAFETY: plain syscall.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(Error::last_os("eventfd"));
    }
    // SAFETY: fd is fresh and ours.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds 1 to an eventfd (wakes whoever sleeps on it).
pub(crate) fn eventfd_signal(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64. A full counter (EAGAIN)
    // already means "signalled", so the result is irrelevant.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// Resets an eventfd.
pub(crate) fn eventfd_drain(fd: RawFd) {
    let mut value: u64 = 0;
    // SAFETY: reads 8 bytes into a live u64; EAGAIN means already drained.
    unsafe { libc::read(fd, (&mut value as *mut u64).cast(), 8) };
}

/// `epoll_ctl`; `ENOENT` on delete and `EEXIST` on add are not errors.
pub(crate) fn epoll_ctl(epfd: RawFd, op: i32, fd: RawFd, events: u32, data: u64) -> Result<()> {
    let mut event = libc::epoll_event { events, u64: data };
    // SAFETY: event is valid for the call.
    let rc = unsafe { libc::epoll_ctl(epfd, op, fd, &mut event) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::ENOENT) if op == libc::EPOLL_CTL_DEL => {}
            Some(libc::EEXIST) if op == libc::EPOLL_CTL_ADD => {}
            _ => return Err(Error::io("epoll_ctl", err)),
        }
    }
    Ok(())
}

/// `epoll_wait` into `events`; returns how many are ready (0 on timeout or EINTR).
pub(crate) fn epoll_wait(epfd: RawFd, events: &mut [libc::epoll_event], ms: i32) -> Result<usize> {
    // SAFETY: events is a valid, writable array of the given length.
    let rc = unsafe { libc::epoll_wait(epfd, events.as_mut_ptr(), events.len() as i32, ms) };
    if rc < 0 {
        let err = std::io::Error::last_os_error();
        if err.kind() == std::io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(Error::io("epoll_wait", err));
    }
    Ok(rc as usize)
}

/// Adds `fd` to an epoll set.
pub(crate) fn epoll_add(epfd: RawFd, fd: RawFd, events: u32, token: u64) -> Result<()> {
    epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, events, token)
}

/// Removes `fd` from an epoll set (best effort: it may be gone already).
pub(crate) fn epoll_del(epfd: RawFd, fd: RawFd) {
    let _ = epoll_ctl(epfd, libc::EPOLL_CTL_DEL, fd, 0, 0);
}
