//! Small helpers around the C APIs: errors that name the device, socket
//! addresses, waiting on file descriptors.

use std::ffi::CStr;
use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// An OS error plus the RDMA device it happened on; the `source` of
/// [`Error::Io`] in this provider, so the message names the device.
#[derive(Debug)]
pub(crate) struct OnDevice {
    pub(crate) device: String,
    pub(crate) detail: Option<String>,
    pub(crate) source: io::Error,
}

impl fmt::Display for OnDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.detail {
            Some(detail) => write!(
                f,
                "{detail} on RDMA device {}: {}",
                self.device, self.source
            ),
            None => write!(f, "{} (RDMA device {})", self.source, self.device),
        }
    }
}

impl std::error::Error for OnDevice {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// [`Error::Io`] naming `call` and `device`.
pub(crate) fn verb_error(call: &'static str, device: &str, source: io::Error) -> Error {
    verb_error_detail(call, device, None, source)
}

/// [`Error::Io`] naming `call`, `device` and what was being done.
pub(crate) fn verb_error_detail(
    call: &'static str,
    device: &str,
    detail: Option<String>,
    source: io::Error,
) -> Error {
    let kind = source.kind();
    Error::Io {
        call,
        source: io::Error::new(
            kind,
            OnDevice {
                device: device.to_owned(),
                detail,
                source,
            },
        ),
    }
}

/// The error of a verb that returns an errno value (0 on success); some
/// providers return `-errno` or `-1` with errno set.
pub(crate) fn errno_of(rc: i32) -> io::Error {
    if rc == -1 {
        io::Error::last_os_error()
    } else {
        io::Error::from_raw_os_error(rc.abs())
    }
}

/// The current errno, or `fallback` when a library failed without setting it.
pub(crate) fn last_errno_or(fallback: i32) -> io::Error {
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(0) | None => io::Error::from_raw_os_error(fallback),
        _ => err,
    }
}

/// A C string from a library, or `"?"`.
///
/// # Safety
///
/// `ptr` is null or points to a NUL-terminated string that outlives the call.
pub(crate) unsafe fn c_str(ptr: *const libc::c_char) -> String {
    if ptr.is_null() {
        return "?".into();
    }
    // SAFETY: non-null and NUL-terminated per the contract above.
    unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}

/// Resolves `host:port` (IPv4, `[IPv6]:port`, or a name) to one address.
pub(crate) fn resolve(addr: &str) -> Result<SocketAddr> {
    if let Ok(parsed) = addr.parse::<SocketAddr>() {
        return Ok(parsed);
    }
    let mut found = addr.to_socket_addrs().map_err(|e| {
        Error::InvalidArgument(format!(
            "{addr:?} is not an address: expected ip:port (e.g. 192.0.2.1:7000) or host:port ({e})"
        ))
    })?;
    found
        .next()
        .ok_or_else(|| Error::InvalidArgument(format!("{addr:?} resolves to no address")))
}

/// `addr` as the C socket address librdmacm takes.
pub(crate) fn to_sockaddr(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
        }
    }
    storage
}

/// Reads back a C socket address (IPv4 or IPv6).
///
/// # Safety
///
/// `sa` points to a socket address whose storage is at least as large as
/// its family's structure.
pub(crate) unsafe fn from_sockaddr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: sa is valid per the contract; sa_family is its first field.
    let family = i32::from(unsafe { (*sa).sa_family });
    match family {
        libc::AF_INET => {
            // SAFETY: the family says this is a sockaddr_in.
            let sin = unsafe { std::ptr::read_unaligned(sa.cast::<libc::sockaddr_in>()) };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(sin.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says this is a sockaddr_in6.
            let sin6 = unsafe { std::ptr::read_unaligned(sa.cast::<libc::sockaddr_in6>()) };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::new(
                IpAddr::V6(ip),
                u16::from_be(sin6.sin6_port),
            ))
        }
        _ => None,
    }
}

/// Makes `fd` non-blocking, so that reads of an empty event channel return
/// `EAGAIN` instead of sleeping.
pub(crate) fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own; F_GETFL/F_SETFL take no pointers.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Milliseconds until `deadline` for poll(2): rounded up, so a sub-millisecond
/// rest is not a busy loop; -1 (forever) without a deadline.
pub(crate) fn poll_timeout_ms(deadline: Option<Instant>, now: Instant) -> i32 {
    match deadline {
        None => -1,
        Some(deadline) => {
            let rest = deadline.saturating_duration_since(now);
            let ms = rest.as_micros().div_ceil(1000);
            i32::try_from(ms).unwrap_or(i32::MAX)
        }
    }
}

/// Sleeps until `fd` is readable or `deadline` passes; Ok(false) on timeout.
pub(crate) fn wait_readable(fd: RawFd, deadline: Option<Instant>) -> io::Result<bool> {
    loop {
        let now = Instant::now();
        let timeout = poll_timeout_ms(deadline, now);
        if timeout == 0 {
            return Ok(false);
        }
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, timeout) };
        if rc > 0 {
            return Ok(true);
        }
        if rc == 0 {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
            continue;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Sleeps until one of `fds` is readable or `deadline` passes; returns a
/// readiness flag per descriptor (all false on timeout).
pub(crate) fn wait_any_readable<const N: usize>(
    fds: [RawFd; N],
    deadline: Option<Instant>,
) -> io::Result<[bool; N]> {
    let mut pfds = fds.map(|fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    });
    loop {
        let timeout = poll_timeout_ms(deadline, Instant::now());
        if timeout == 0 {
            return Ok([false; N]);
        }
        // SAFETY: N valid pollfds for the duration of the call.
        let rc = unsafe { libc::poll(pfds.as_mut_ptr(), N as libc::nfds_t, timeout) };
        if rc > 0 {
            return Ok(pfds.map(|p| p.revents != 0));
        }
        if rc < 0 {
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
    }
}

/// `now + timeout`, or None (forever) when that overflows.
pub(crate) fn deadline_after(timeout: Duration) -> Option<Instant> {
    Instant::now().checked_add(timeout)
}

/// Milliseconds left before `deadline`, for the timeout arguments of
/// `rdma_resolve_addr` / `rdma_resolve_route` (at least 1).
pub(crate) fn remaining_ms(deadline: Option<Instant>) -> i32 {
    match deadline {
        None => i32::MAX,
        Some(_) => poll_timeout_ms(deadline, Instant::now()).max(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockaddr_round_trips() {
        for text in ["192.0.2.1:7000", "[fe80::1]:4791", "0.0.0.0:0"] {
            let addr: SocketAddr = text.parse().unwrap();
            let storage = to_sockaddr(addr);
            // SAFETY: storage holds a sockaddr of the right family.
            let back = unsafe { from_sockaddr((&storage as *const libc::sockaddr_storage).cast()) };
            assert_eq!(back, Some(addr), "{text}");
        }
    }

    #[test]
    fn port_is_network_order() {
        let storage = to_sockaddr("10.0.0.1:258".parse().unwrap());
        // SAFETY: an AF_INET address was written.
        let sin =
            unsafe { *(&storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
        assert_eq!(sin.sin_port.to_ne_bytes(), [1, 2]);
        assert_eq!(sin.sin_addr.s_addr.to_ne_bytes(), [10, 0, 0, 1]);
    }

    #[test]
    fn bad_addresses_say_what_is_expected() {
        let err = resolve("not an address").unwrap_err().to_string();
        assert!(err.contains("ip:port"), "{err}");
    }

    #[test]
    fn poll_timeouts_round_up() {
        let now = Instant::now();
        assert_eq!(poll_timeout_ms(None, now), -1);
        assert_eq!(
            poll_timeout_ms(Some(now + Duration::from_micros(10)), now),
            1
        );
        assert_eq!(poll_timeout_ms(Some(now), now), 0);
        assert_eq!(
            poll_timeout_ms(Some(now + Duration::from_millis(1500)), now),
            1500
        );
    }

    #[test]
    fn device_errors_name_the_device_and_keep_the_errno() {
        let err = verb_error_detail(
            "ibv_modify_qp",
            "rxe0",
            Some("moving the queue pair from INIT to RTR".into()),
            io::Error::from_raw_os_error(libc::EINVAL),
        );
        let Error::Io { call, source } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(*call, "ibv_modify_qp");
        let text = source.to_string();
        assert!(
            text.contains("rxe0") && text.contains("INIT to RTR"),
            "{text}"
        );
        let inner = source
            .get_ref()
            .and_then(|e| e.downcast_ref::<OnDevice>())
            .unwrap();
        assert_eq!(inner.source.raw_os_error(), Some(libc::EINVAL));
    }

    #[test]
    fn errno_of_accepts_both_sign_conventions() {
        assert_eq!(errno_of(libc::ENOMEM).raw_os_error(), Some(libc::ENOMEM));
        assert_eq!(errno_of(-libc::ENOMEM).raw_os_error(), Some(libc::ENOMEM));
    }
}
