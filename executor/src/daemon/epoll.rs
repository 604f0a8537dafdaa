//! The few epoll and eventfd calls the connection loop needs: an
//! [`Epoll`] set of descriptors, level-triggered, each named by a `u64`
//! token, and a [`Waker`] other threads use to interrupt its wait.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// Readable.
pub(crate) const IN: u32 = libc::EPOLLIN as u32;
/// Writable.
pub(crate) const OUT: u32 = libc::EPOLLOUT as u32;
/// Hung up or failed: reported whatever the interest.
pub(crate) const HUP_OR_ERR: u32 = (libc::EPOLLHUP | libc::EPOLLERR) as u32;

/// An epoll set.
#[derive(Debug)]
pub(crate) struct Epoll {
    fd: OwnedFd,
}

impl Epoll {
    pub(crate) fn new() -> io::Result<Epoll> {
        // SAFETY: plain syscall.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is fresh and ours.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Epoll { fd })
    }

    fn ctl(&self, op: i32, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        let mut event = libc::epoll_event { events, u64: token };
        // SAFETY: event is valid for the call.
        if unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut event) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Watches `fd` for `events`, reported with `token`.
    pub(crate) fn add(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, events, token)
    }

    /// Changes what `fd` is watched for.
    pub(crate) fn modify(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, events, token)
    }

    /// Stops watching `fd` (closing it does too; this is for one kept open).
    pub(crate) fn delete(&self, fd: RawFd) {
        let _ = self.ctl(libc::EPOLL_CTL_DEL, fd, 0, 0);
    }

    /// Waits up to `timeout` (`None`: no limit) for ready descriptors,
    /// whose tokens and events land in `events`; returns how many, 0 on
    /// timeout or a signal.
    pub(crate) fn wait(
        &self,
        events: &mut [libc::epoll_event],
        timeout: Option<Duration>,
    ) -> io::Result<usize> {
        // Rounded up: a wait never ends before its deadline.
        let ms = timeout.map_or(-1, |d| {
            d.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as i32
        });
        // SAFETY: events is a valid, writable array of the given length.
        let rc = unsafe {
            libc::epoll_wait(
                self.fd.as_raw_fd(),
                events.as_mut_ptr(),
                events.len() as i32,
                ms,
            )
        };
        if rc < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                return Ok(0);
            }
            return Err(err);
        }
        Ok(rc as usize)
    }
}

/// Wakes an [`Epoll`] wait from another thread (an eventfd).
#[derive(Debug)]
pub(crate) struct Waker {
    fd: OwnedFd,
}

impl Waker {
    pub(crate) fn new() -> io::Result<Waker> {
        // SAFETY: plain syscall.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is fresh and ours.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Waker { fd })
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Makes the eventfd readable.
    pub(crate) fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64. A full counter (EAGAIN)
        // already means "woken".
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Resets it, after a wake was seen.
    pub(crate) fn reset(&self) {
        let mut value: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64; EAGAIN means already reset.
        unsafe { libc::read(self.fd.as_raw_fd(), (&mut value as *mut u64).cast(), 8) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[test]
    fn readiness_and_wakes_carry_their_tokens() {
        let ep = Epoll::new().unwrap();
        let waker = Waker::new().unwrap();
        ep.add(waker.raw_fd(), IN, 1).unwrap();
        let (mut a, b) = UnixStream::pair().unwrap();
        ep.add(b.as_raw_fd(), IN, 7).unwrap();
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 4];
        assert_eq!(ep.wait(&mut events, Some(Duration::ZERO)).unwrap(), 0);

        a.write_all(b"x").unwrap();
        assert_eq!(ep.wait(&mut events, None).unwrap(), 1);
        assert_eq!({ events[0].u64 }, 7);

        ep.modify(b.as_raw_fd(), 0, 7).unwrap();
        waker.wake();
        assert_eq!(ep.wait(&mut events, None).unwrap(), 1);
        assert_eq!({ events[0].u64 }, 1);
        waker.reset();
        assert_eq!(ep.wait(&mut events, Some(Duration::ZERO)).unwrap(), 0);

        // A closed peer is reported whatever the interest.
        drop(a);
        assert_eq!(ep.wait(&mut events, None).unwrap(), 1);
        assert_ne!({ events[0].events } & HUP_OR_ERR, 0);
        ep.delete(b.as_raw_fd());
        assert_eq!(ep.wait(&mut events, Some(Duration::ZERO)).unwrap(), 0);
    }
}
