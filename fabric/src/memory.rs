//! Registered memory: page-aligned buffers, access rights and the remote
//! descriptors peers use to name them.

use std::fmt;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result};

/// Remote access rights of a registered region. Local access is always allowed.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// No remote access: the region is only a local source or sink.
    pub const LOCAL: Access = Access(0);
    /// Peers may write into the region.
    pub const REMOTE_WRITE: Access = Access(1);
    /// Peers may read from the region.
    pub const REMOTE_READ: Access = Access(2);
    /// Peers may run fetch-and-add and compare-and-swap on the region.
    pub const REMOTE_ATOMIC: Access = Access(4);
    /// All remote rights.
    pub const ALL: Access = Access(7);

    /// Whether every right in `other` is in `self`.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// The raw bits (stable: they cross process boundaries in the shm provider).
    pub fn bits(self) -> u32 {
        self.0
    }

    /// Rebuilds from [`Access::bits`], dropping unknown bits.
    pub fn from_bits_truncate(bits: u32) -> Access {
        Access(bits & Access::ALL.0)
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if self.contains(Access::REMOTE_WRITE) {
            parts.push("REMOTE_WRITE");
        }
        if self.contains(Access::REMOTE_READ) {
            parts.push("REMOTE_READ");
        }
        if self.contains(Access::REMOTE_ATOMIC) {
            parts.push("REMOTE_ATOMIC");
        }
        if parts.is_empty() {
            parts.push("LOCAL");
        }
        f.write_str(&parts.join("|"))
    }
}

/// What a peer needs to name a registered region: where it is, its key, its size.
///
/// This is the `{addr: u64, rkey: u32, len: u32}` triple that travels in
/// invocation headers and allocation replies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RemoteDescriptor {
    /// Address of the first byte, in the owner's address space.
    pub addr: u64,
    /// Remote key, valid only on endpoints of the owner's protection domain.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u32,
}

impl RemoteDescriptor {
    /// The remote address `offset` bytes into the region (not bounds-checked:
    /// the target checks every access).
    pub fn at(&self, offset: u64) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr.wrapping_add(offset),
            rkey: self.rkey,
        }
    }
}

/// A remote address plus the key that grants access to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RemoteAddr {
    /// Address in the target's address space.
    pub addr: u64,
    /// Remote key of the region holding `addr`.
    pub rkey: u32,
}

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size <= 0 {
        4096
    } else {
        size as usize
    }
}

/// Page-aligned memory backed by a memfd, so it can be shared with another
/// process (the shm provider) or pinned by a NIC (verbs).
pub struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
    map_len: usize,
    /// Bytes reserved after the mapping with no access (0 or one page).
    guard_len: usize,
    fd: OwnedFd,
}

// SAFETY: Buffer owns its mapping; the raw pointer is only an address, and
// every access through it goes through methods whose callers uphold the
// region's aliasing contract (see `MemoryRegion`).
unsafe impl Send for Buffer {}
// SAFETY: as above; shared references only hand out the pointer.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// Allocates `len` bytes (at least one page), zeroed and page-aligned.
    pub fn new(len: usize) -> Result<Buffer> {
        Buffer::create(len, false)
    }

    /// Allocates `len` rounded up to whole pages (at least one), followed by
    /// one page mapped `PROT_NONE`, so a write past the end faults. The
    /// usable length is the rounded length.
    pub fn guarded(len: usize) -> Result<Buffer> {
        let page = page_size();
        Buffer::create(len.max(1).div_ceil(page) * page, true)
    }

    fn create(len: usize, guard: bool) -> Result<Buffer> {
        if len > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "a region holds at most {} bytes, {len} were asked for",
                u32::MAX
            )));
        }
        let page = page_size();
        let map_len = len.max(1).div_ceil(page) * page;
        // SAFETY: the name is a valid NUL-terminated string; flags are valid.
        let raw = unsafe {
            libc::memfd_create(
                c"rfaas-region".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(Error::last_os("memfd_create"));
        }
        // SAFETY: raw is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: fd is a valid memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), map_len as libc::off_t) } != 0 {
            return Err(Error::last_os("ftruncate"));
        }
        // Fix the size for good: the shm provider hands this descriptor to
        // peers, and a peer that shrank it would make our accesses SIGBUS.
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fd is a valid memfd created with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(Error::last_os("fcntl(F_ADD_SEALS)"));
        }
        let guard_len = if guard { page } else { 0 };
        let ptr = if guard {
            map_with_guard(fd.as_raw_fd(), map_len, guard_len)?
        } else {
            map_shared(fd.as_raw_fd(), map_len, true)?
        };
        Ok(Buffer {
            ptr,
            len,
            map_len,
            guard_len,
            fd,
        })
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Usable length in bytes (what was asked for).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the usable length is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Length of the mapping (a whole number of pages).
    pub fn mapped_len(&self) -> usize {
        self.map_len
    }

    /// The memfd holding the pages.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: ptr/map_len describe our own mapping, which nothing
        // references any more (the Buffer is shared through Arc only).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.map_len + self.guard_len) };
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

/// Reserves `len + guard` bytes with no access, then maps `len` bytes of
/// `fd` read-write over the start: the `guard` bytes after stay inaccessible.
fn map_with_guard(fd: RawFd, len: usize, guard: usize) -> Result<NonNull<u8>> {
    // SAFETY: a fresh anonymous reservation at a kernel-chosen address.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len + guard,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(Error::last_os("mmap (guard reservation)"));
    }
    // SAFETY: MAP_FIXED replaces the first `len` bytes of our own fresh
    // reservation, which nothing else references.
    let ptr = unsafe {
        libc::mmap(
            base,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        let err = Error::last_os("mmap (over the guard reservation)");
        // SAFETY: releasing the reservation made above.
        unsafe { libc::munmap(base, len + guard) };
        return Err(err);
    }
    NonNull::new(ptr.cast()).ok_or_else(|| Error::InvalidArgument("mmap returned null".into()))
}

/// Maps `len` bytes of `fd` shared, read-write or read-only.
pub(crate) fn map_shared(fd: RawFd, len: usize, writable: bool) -> Result<NonNull<u8>> {
    let prot = if writable {
        libc::PROT_READ | libc::PROT_WRITE
    } else {
        libc::PROT_READ
    };
    // SAFETY: a fresh mapping at a kernel-chosen address aliases nothing.
    let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
    if ptr == libc::MAP_FAILED {
        return Err(Error::last_os("mmap"));
    }
    NonNull::new(ptr.cast()).ok_or_else(|| Error::InvalidArgument("mmap returned null".into()))
}

/// A registered memory region: a [`Buffer`] plus its keys and rights in one
/// protection domain. Deregistered when dropped; operations already posted
/// keep the memory alive until they complete.
///
/// Remote peers with the right access may change the bytes at any time, as a
/// NIC would. Read the region after the completion that tells you a peer has
/// written it, and do not hand out slices across such writes.
pub struct MemoryRegion {
    pub(crate) buf: Arc<Buffer>,
    pub(crate) rkey: u32,
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) lkey: u32,
    pub(crate) access: Access,
    pub(crate) domain_id: u64,
    pub(crate) _registration: Registration,
}

/// Provider-specific registration state; dropping it deregisters.
pub(crate) enum Registration {
    /// tcp and shm: a slot in the domain's region table.
    Soft(#[allow(dead_code)] crate::registry::SlotGuard),
    /// verbs: a memory region of the NIC.
    #[cfg(feature = "verbs")]
    Verbs(crate::verbs::MrHandle),
}

impl MemoryRegion {
    /// Pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.buf.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The descriptor a peer needs to access this region.
    pub fn descriptor(&self) -> RemoteDescriptor {
        RemoteDescriptor {
            addr: self.buf.as_ptr() as u64,
            rkey: self.rkey,
            len: self.buf.len() as u32,
        }
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The remote access rights the region was registered with.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The bytes, for reading. See the type's note on remote writers.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the buffer is valid for len bytes while self lives.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr(), self.buf.len()) }
    }

    /// The bytes, for writing. See the type's note on remote writers.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the buffer is valid for len bytes and &mut self excludes
        // other local references.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_ptr(), self.buf.len()) }
    }

    /// Reads the 8-byte word at `offset` (for results of atomics).
    pub fn read_u64(&self, offset: usize) -> u64 {
        assert!(
            offset + 8 <= self.len(),
            "offset {offset} is outside the region"
        );
        // SAFETY: in bounds (checked above); the array read has alignment 1;
        // a remote writer racing with this read is the caller's documented concern.
        let bytes =
            unsafe { std::ptr::read_volatile(self.buf.as_ptr().add(offset).cast::<[u8; 8]>()) };
        u64::from_ne_bytes(bytes)
    }

    /// Writes the 8-byte word at `offset` (native endianness).
    pub fn write_u64(&mut self, offset: usize, value: u64) {
        self.as_mut_slice()[offset..offset + 8].copy_from_slice(&value.to_ne_bytes());
    }

    /// Checks that `offset..offset+len` lies inside the region.
    pub(crate) fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "local range {offset}..{} is outside the {}-byte region",
                offset.saturating_add(len),
                self.len()
            ))),
        }
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("descriptor", &self.descriptor())
            .field("access", &self.access)
            .field("domain", &self.domain_id)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` in a forked child and returns the signal that ended it, if any.
    fn child_signal(f: impl FnOnce()) -> Option<i32> {
        // SAFETY: the child only runs `f` (plain memory accesses) and _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            f();
            // SAFETY: leaving the child without running the parent's atexit.
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status))
    }

    #[test]
    fn guarded_buffer_faults_just_past_its_end() {
        let page = page_size();
        let buf = Buffer::guarded(100).unwrap();
        assert_eq!(buf.len(), page, "rounded up to a page");
        let p = buf.as_ptr();
        // The last usable byte is fine.
        let last = || {
            // SAFETY: inside the mapping.
            unsafe { p.add(page - 1).write_volatile(1) }
        };
        assert_eq!(child_signal(last), None);
        // The first byte after it hits the guard page.
        let past = || {
            // SAFETY: the write faults in the child by design; nothing else runs there.
            unsafe { p.add(page).write_volatile(1) }
        };
        assert_eq!(child_signal(past), Some(libc::SIGSEGV));
        // A plain buffer has no such guarantee, but a guarded one unmaps
        // cleanly with its guard.
        drop(buf);
    }
}

/// Bytes of a peer's memory mapped into this process, read in place: what
/// [`Endpoint::peer_view`](crate::Endpoint::peer_view) gives on a provider
/// that shares memory with the peer.
#[derive(Debug, Clone, Copy)]
pub struct PeerView {
    ptr: *const u8,
    len: usize,
}

impl PeerView {
    pub(crate) fn new(ptr: *const u8, len: usize) -> PeerView {
        PeerView { ptr, len }
    }

    /// The first byte (dangling, never read, for an empty view).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Bytes in view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
