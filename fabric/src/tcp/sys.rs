//! Socket options std does not offer.

use std::net::TcpStream;
use std::os::fd::AsRawFd;

use crate::error::{Error, Result};

/// Keepalive and user timeout, so a peer whose machine vanished without a
/// FIN turns into an error completion within about ten seconds.
pub(super) fn tune_socket(stream: &TcpStream) -> Result<()> {
    let fd = stream.as_raw_fd();
    let set = |level: i32, name: i32, value: i32| -> Result<()> {
        // SAFETY: value lives across the call; its size is passed.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const i32).cast(),
                std::mem::size_of::<i32>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(Error::last_os("setsockopt"));
        }
        Ok(())
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 5)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 1)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3)?;
    set(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, 10_000)
}
