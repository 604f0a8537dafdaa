//! Checked wrappers over the system calls of the shm provider: shared
//! mappings, sealed memfds, unix sockets with descriptor passing, and the
//! small wake-up channels (futexes, or sockets on the fallback path).
//! Nothing here is on the hot path except [`Mapping::as_ptr`]; [`kick`] and
//! [`futex_wake`] run only when the target announced it sleeps.

use std::ffi::CString;
use std::io;
use std::mem::{size_of, zeroed};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::memory::map_shared;

/// A shared mapping of a memfd, unmapped when dropped.
///
/// The bytes may change under us at any time (a peer process maps the same
/// pages), so the mapping is only ever touched through atomics or raw copies,
/// never through references to plain data.
pub(super) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; the pointer
// is only an address, and every access through it is an atomic or a raw copy.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` (shared), read-write or read-only.
    pub(super) fn new(fd: RawFd, len: usize, writable: bool) -> Result<Mapping> {
        let ptr = map_shared(fd, len, writable)?;
        Ok(Mapping { ptr, len })
    }

    /// The first byte. Hot path.
    #[inline]
    pub(super) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Mapped length in bytes.
    pub(super) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe a mapping we created and nothing else uses
        // once its owner is dropped.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

/// A memfd of our own, sealed to its size, and our read-write mapping of it.
#[derive(Debug)]
pub(super) struct Segment {
    fd: OwnedFd,
    map: Mapping,
}

impl Segment {
    /// Creates a zeroed segment of `len` bytes (rounded up to whole pages).
    pub(super) fn new(name: &std::ffi::CStr, len: usize) -> Result<Segment> {
        let page = crate::memory::page_size();
        let len = len.max(1).div_ceil(page) * page;
        // SAFETY: name is NUL-terminated; the flags are valid.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(Error::last_os("memfd_create"));
        }
        // SAFETY: raw is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: fd is a valid memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(Error::last_os("ftruncate"));
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fd is a valid memfd created with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(Error::last_os("fcntl(F_ADD_SEALS)"));
        }
        let map = Mapping::new(fd.as_raw_fd(), len, true)?;
        Ok(Segment { fd, map })
    }

    /// The first byte.
    pub(super) fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    /// The memfd.
    pub(super) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Checks that a memfd received from a peer is safe to map `len` bytes of:
/// sealed against shrinking (so the peer cannot make our accesses SIGBUS)
/// and at least `len` bytes long.
pub(super) fn check_peer_memfd(fd: RawFd, len: usize) -> std::result::Result<(), String> {
    // SAFETY: F_GET_SEALS only reads the descriptor's seals.
    let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err("the shared-memory descriptor is not sealed against shrinking".into());
    }
    let size =
        file_size(fd).map_err(|e| format!("fstat of a shared-memory descriptor failed: {e}"))?;
    if size < len as u64 {
        return Err(format!(
            "the shared-memory descriptor holds {size} bytes, {len} are needed"
        ));
    }
    Ok(())
}

/// Checks that a regular file received from a peer (a region it keeps in
/// a file) holds at least `len` bytes. Nothing stops the peer from
/// shrinking it later: only peers trusted not to are asked for such
/// regions (`EndpointOptions::map_file_regions`).
pub(super) fn check_peer_file(fd: RawFd, len: usize) -> std::result::Result<(), String> {
    let size = file_size(fd).map_err(|e| format!("fstat of a region's file failed: {e}"))?;
    if size < len as u64 {
        return Err(format!(
            "the region's file holds {size} bytes, {len} are needed"
        ));
    }
    Ok(())
}

/// Whether `fd` is a regular file (a memfd is one too).
pub(super) fn is_regular_file(fd: RawFd) -> bool {
    fstat(fd).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFREG)
}

fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    // SAFETY: an all-zero stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { zeroed() };
    // SAFETY: st is a valid, writable stat.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// Size of the file behind `fd`.
pub(super) fn file_size(fd: RawFd) -> io::Result<u64> {
    Ok(fstat(fd)?.st_size as u64)
}

/// Whether `fd` is a socket.
pub(super) fn is_socket(fd: RawFd) -> bool {
    fstat(fd).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFSOCK)
}

/// A new, read-only open file description of the same file (so a peer that
/// receives it cannot write, and the kernel enforces it).
pub(super) fn reopen_read_only(fd: RawFd) -> io::Result<OwnedFd> {
    let path = CString::new(format!("/proc/self/fd/{fd}")).map_err(io::Error::other)?;
    // SAFETY: path is NUL-terminated; the flags are valid.
    let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: raw is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// A connected pair of non-blocking unix stream sockets.
pub(super) fn socketpair() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    let kind = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    // SAFETY: fds has room for the two descriptors.
    if unsafe { libc::socketpair(libc::AF_UNIX, kind, 0, fds.as_mut_ptr()) } != 0 {
        return Err(Error::last_os("socketpair"));
    }
    // SAFETY: both descriptors are fresh and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Sends one wake-up byte. Never blocks (MSG_DONTWAIT whatever the peer did
/// to the file's flags); a full or closed channel is ignored, since a full
/// one already holds a wake-up.
#[inline]
pub(super) fn kick(fd: RawFd) {
    let byte = 1u8;
    // SAFETY: sends one byte from a live local.
    unsafe {
        libc::send(
            fd,
            (&byte as *const u8).cast(),
            1,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
}

/// Empties a wake-up channel. Returns `false` once the other end is closed.
pub(super) fn drain_socket(fd: RawFd) -> bool {
    let mut buf = [0u8; 256];
    // Bounded, so a peer that floods its channel cannot keep us here.
    for _ in 0..64 {
        // SAFETY: receives into a live local buffer of the given length.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n == 0 {
            return false;
        }
        if n < 0 {
            let err = io::Error::last_os_error();
            return match err.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => true,
                _ => false,
            };
        }
        if (n as usize) < buf.len() {
            return true;
        }
    }
    true
}

/// Most words one `futex_waitv` watches (`FUTEX_WAITV_MAX`).
pub(super) const FUTEX_WAITV_MAX: usize = 128;

/// `FUTEX2_SIZE_U32`: the word is 32 bits.
const FUTEX2_SIZE_U32: u32 = 2;
/// `FUTEX2_PRIVATE` (= `FUTEX_PRIVATE_FLAG`): the word is not shared with
/// another process.
const FUTEX2_PRIVATE: u32 = 128;

/// One word of a `futex_waitv` call (`struct futex_waitv` of the kernel uapi).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct FutexWaitv {
    val: u64,
    uaddr: u64,
    flags: u32,
    reserved: u32,
}

impl FutexWaitv {
    /// Sleep while `word` holds `expected`. `private`: the word lives in
    /// memory no other process maps (cheaper kernel lookup); a word in a
    /// shared memfd must not be private, or the other process's wake misses.
    ///
    /// The caller keeps `word` alive until the `futex_waitv` call returns.
    pub(super) fn new(word: &AtomicU32, expected: u32, private: bool) -> FutexWaitv {
        FutexWaitv {
            val: u64::from(expected),
            uaddr: word.as_ptr() as u64,
            flags: FUTEX2_SIZE_U32 | if private { FUTEX2_PRIVATE } else { 0 },
            reserved: 0,
        }
    }
}

/// Whether `futex_waitv` works here: unknown, yes, no (ENOSYS or refused).
static FUTEX_WAITV: AtomicU8 = AtomicU8::new(UNKNOWN);
const UNKNOWN: u8 = 0;
const AVAILABLE: u8 = 1;
const MISSING: u8 = 2;

/// Whether `futex_waitv` may be used (true until a call proved otherwise).
pub(super) fn futex_waitv_usable() -> bool {
    FUTEX_WAITV.load(Ordering::Relaxed) != MISSING
}

/// How a `futex_waitv` ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Waited {
    /// Woken, interrupted, or a word no longer held its expected value.
    Woken,
    /// The deadline passed.
    TimedOut,
    /// The kernel has no `futex_waitv` (before 5.16) or a seccomp filter
    /// refuses it; from now on [`futex_waitv_usable`] says no.
    Unsupported,
}

/// Sleeps until one of `waiters` is woken or no longer holds its expected
/// value, or until `deadline` (absolute, `CLOCK_MONOTONIC`) passes.
pub(super) fn futex_waitv(
    waiters: &[FutexWaitv],
    deadline: Option<&libc::timespec>,
) -> io::Result<Waited> {
    assert!(!waiters.is_empty() && waiters.len() <= FUTEX_WAITV_MAX);
    let timeout = deadline.map_or(std::ptr::null(), std::ptr::from_ref);
    // SAFETY: waiters is a live array of `len` entries laid out as the
    // kernel's struct futex_waitv, and timeout is null or points to a live
    // timespec; the kernel only reads them (flags must be 0). It only reads
    // the words at the entries' addresses too: a stale address (the caller
    // keeps its words alive, see FutexWaitv::new) would mean EFAULT or an
    // early return, never a write to our memory.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex_waitv,
            waiters.as_ptr(),
            waiters.len() as libc::c_uint,
            0 as libc::c_uint,
            timeout,
            libc::CLOCK_MONOTONIC,
        )
    };
    if rc >= 0 {
        FUTEX_WAITV.store(AVAILABLE, Ordering::Relaxed);
        return Ok(Waited::Woken);
    }
    let err = io::Error::last_os_error();
    let waited = match err.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EINTR) => Waited::Woken,
        Some(libc::ETIMEDOUT) => Waited::TimedOut,
        // Only the first call can tell "missing" from a bug of ours.
        Some(libc::ENOSYS) | Some(libc::EPERM)
            if FUTEX_WAITV.load(Ordering::Relaxed) != AVAILABLE =>
        {
            FUTEX_WAITV.store(MISSING, Ordering::Relaxed);
            return Ok(Waited::Unsupported);
        }
        _ => return Err(err),
    };
    FUTEX_WAITV.store(AVAILABLE, Ordering::Relaxed);
    Ok(waited)
}

/// Wakes one thread sleeping on `word` (`private`: as in [`FutexWaitv::new`]).
pub(super) fn futex_wake(word: &AtomicU32, private: bool) {
    let op = if private {
        libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG
    } else {
        libc::FUTEX_WAKE
    };
    // SAFETY: word is a live, aligned 32-bit word; FUTEX_WAKE only uses its
    // address as a key. A failure (nobody sleeps, or a hostile peer's page)
    // needs no handling.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), op, 1 as libc::c_int) };
}

/// The `CLOCK_MONOTONIC` time `after` from now, as `futex_waitv` takes it
/// (`None` if it does not fit).
pub(super) fn monotonic_after(after: Duration) -> Option<libc::timespec> {
    // SAFETY: an all-zero timespec is valid.
    let mut now: libc::timespec = unsafe { zeroed() };
    // SAFETY: now is a valid out-parameter; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    let total = Duration::new(now.tv_sec as u64, now.tv_nsec as u32).checked_add(after)?;
    Some(libc::timespec {
        tv_sec: libc::time_t::try_from(total.as_secs()).ok()?,
        tv_nsec: libc::c_long::from(total.subsec_nanos()),
    })
}

/// A `sockaddr_un` for a filesystem path. Abstract names (`@name`) are
/// refused: any process of the network namespace may connect to them.
pub(super) struct UnixAddr {
    addr: libc::sockaddr_un,
    len: libc::socklen_t,
}

impl UnixAddr {
    pub(super) fn parse(name: &str) -> Result<UnixAddr> {
        // SAFETY: an all-zero sockaddr_un is valid.
        let mut addr: libc::sockaddr_un = unsafe { zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        if name.starts_with('@') {
            return Err(Error::InvalidArgument(format!(
                "{name:?} is an abstract socket name, which every process of the network namespace can connect to: give the path of a socket in a directory only this service's user (and root) can enter"
            )));
        }
        let (bytes, start) = (name.as_bytes(), 0);
        if bytes.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{name:?} is not a shm address: use a socket path"
            )));
        }
        // A path needs its NUL terminator.
        if bytes.len() + 1 > addr.sun_path.len() || bytes.contains(&0) {
            return Err(Error::InvalidArgument(format!(
                "shm address {name:?} must be at most {} bytes without NUL bytes",
                addr.sun_path.len() - 1
            )));
        }
        for (i, b) in bytes.iter().enumerate() {
            addr.sun_path[start + i] = *b as libc::c_char;
        }
        let base = std::mem::offset_of!(libc::sockaddr_un, sun_path);
        let len = base + start + bytes.len() + (1 - start);
        Ok(UnixAddr {
            addr,
            len: len as libc::socklen_t,
        })
    }

    fn as_ptr(&self) -> *const libc::sockaddr {
        (&self.addr as *const libc::sockaddr_un).cast()
    }
}

/// A non-blocking unix stream socket.
pub(super) fn stream_socket() -> Result<OwnedFd> {
    let kind = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    // SAFETY: no pointers; the arguments are valid.
    let raw = unsafe { libc::socket(libc::AF_UNIX, kind, 0) };
    if raw < 0 {
        return Err(Error::last_os("socket"));
    }
    // SAFETY: raw is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

pub(super) fn bind_listen(fd: RawFd, addr: &UnixAddr) -> io::Result<()> {
    // SAFETY: addr points to a valid sockaddr_un of addr.len bytes.
    if unsafe { libc::bind(fd, addr.as_ptr(), addr.len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a bound socket.
    if unsafe { libc::listen(fd, 128) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// One connect attempt on a non-blocking socket.
pub(super) fn connect(fd: RawFd, addr: &UnixAddr) -> io::Result<()> {
    // SAFETY: addr points to a valid sockaddr_un of addr.len bytes.
    if unsafe { libc::connect(fd, addr.as_ptr(), addr.len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// One non-blocking accept.
pub(super) fn accept(fd: RawFd) -> io::Result<OwnedFd> {
    let flags = libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    // SAFETY: null address pointers are allowed.
    let raw = unsafe { libc::accept4(fd, std::ptr::null_mut(), std::ptr::null_mut(), flags) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: raw is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// The peer's process id and user id, as the kernel saw them at connect.
pub(super) fn peer_cred(fd: RawFd) -> Option<(i32, u32)> {
    // SAFETY: an all-zero ucred is valid.
    let mut cred: libc::ucred = unsafe { zeroed() };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred and len are valid out-parameters of the right size.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0).then_some((cred.pid, cred.uid))
}

pub(super) fn shutdown(fd: RawFd) {
    // SAFETY: no pointers; a failure (already shut down) is harmless.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
}

/// Waits until `fd` reports one of `events` (or an error/hang-up); `false`
/// when `deadline` passed first.
pub(super) fn wait_fd(fd: RawFd, events: i16, deadline: Option<Instant>) -> io::Result<bool> {
    loop {
        let ms = match deadline {
            None => -1,
            Some(d) => {
                let now = Instant::now();
                if now >= d {
                    return Ok(false);
                }
                crate::os::ceil_ms(d - now)
            }
        };
        let mut p = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        // SAFETY: p is one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if r > 0 {
            return Ok(true);
        }
    }
}

/// Room for the descriptors of one message (we never pass more than 3).
const MAX_FDS: usize = 4;

#[repr(C)]
union CmsgBuf {
    _align: libc::cmsghdr,
    bytes: [u8; 64],
}

/// One `sendmsg` of `bytes` with `fds` attached. Returns the bytes sent.
pub(super) fn send_msg(fd: RawFd, bytes: &[u8], fds: &[RawFd], flags: i32) -> io::Result<usize> {
    assert!(fds.len() <= MAX_FDS);
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: an all-zero msghdr is valid (no name, no control).
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    let mut cbuf = CmsgBuf { bytes: [0; 64] };
    if !fds.is_empty() {
        let data_len = std::mem::size_of_val(fds) as u32;
        // SAFETY: CMSG_SPACE is pure arithmetic.
        let space = unsafe { libc::CMSG_SPACE(data_len) } as usize;
        // SAFETY: taking the address of a union field does not read it.
        msg.msg_control = unsafe { cbuf.bytes.as_mut_ptr() }.cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points to 64 zeroed, cmsghdr-aligned bytes and
        // space <= 64 (MAX_FDS descriptors), so the first header and its data
        // fit; CMSG_FIRSTHDR/CMSG_DATA stay inside that buffer.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(data_len) as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                data_len as usize,
            );
        }
    }
    // SAFETY: msg points to live iovec and control buffers.
    let n = unsafe { libc::sendmsg(fd, &msg, flags | libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// One non-blocking `recvmsg`; received descriptors are appended to `fds`.
/// Returns the bytes received (0 at end of stream).
pub(super) fn recv_msg(fd: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    let mut cbuf = CmsgBuf { bytes: [0; 64] };
    // SAFETY: taking the address of a union field does not read it.
    msg.msg_control = unsafe { cbuf.bytes.as_mut_ptr() }.cast();
    msg.msg_controllen = 64;
    let flags = libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC;
    // SAFETY: msg points to live, writable iovec and control buffers.
    let n = unsafe { libc::recvmsg(fd, &mut msg, flags) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel filled msg_control with msg_controllen bytes of
    // well-formed cmsg headers; CMSG_FIRSTHDR/NXTHDR walk only those, and the
    // descriptors in an SCM_RIGHTS payload are ours from now on.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let payload = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..payload / size_of::<RawFd>() {
                    let raw = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the peer passed more descriptors than the protocol allows",
        ));
    }
    Ok(n as usize)
}

/// Sends all of `bytes` (with `fds` on the first piece) before `deadline`.
pub(super) fn send_all(
    fd: RawFd,
    bytes: &[u8],
    fds: &[RawFd],
    deadline: Instant,
) -> io::Result<()> {
    let mut sent = 0;
    while sent < bytes.len() {
        let attach = if sent == 0 { fds } else { &[] };
        match send_msg(fd, &bytes[sent..], attach, libc::MSG_DONTWAIT) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if !wait_fd(fd, libc::POLLOUT, Some(deadline))? {
                    return Err(io::ErrorKind::TimedOut.into());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Receives exactly `buf.len()` bytes before `deadline`, collecting descriptors.
pub(super) fn recv_exact(
    fd: RawFd,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    deadline: Instant,
) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match recv_msg(fd, &mut buf[got..], fds) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if !wait_fd(fd, libc::POLLIN, Some(deadline))? {
                    return Err(io::ErrorKind::TimedOut.into());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Unlinks a filesystem socket path (best effort).
pub(super) fn unlink(path: &str) {
    if let Ok(c) = CString::new(path) {
        // SAFETY: c is NUL-terminated.
        unsafe { libc::unlink(c.as_ptr()) };
    }
}

/// The io error as an [`Error::Connect`] sentence.
pub(super) fn connect_error(addr: &str, what: &str, err: &io::Error) -> Error {
    Error::Connect {
        addr: addr.to_owned(),
        reason: format!("{what}: {err}"),
    }
}
