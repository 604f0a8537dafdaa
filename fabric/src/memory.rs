//! Registered memory: page-aligned buffers, access rights and the remote
//! descriptors peers use to name them.

use std::any::Any;
use std::fmt;
use std::ops::{Bound, RangeBounds};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
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
    // Asked once: callers use it on hot paths (a buffer's header offset).
    static PAGE: AtomicUsize = AtomicUsize::new(0);
    match PAGE.load(Ordering::Relaxed) {
        0 => {
            // SAFETY: sysconf has no memory-safety preconditions.
            let size = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
                size if size > 0 => size as usize,
                _ => 4096,
            };
            PAGE.store(size, Ordering::Relaxed);
            size
        }
        size => size,
    }
}

/// Page-aligned memory backed by a memfd, so it can be shared with another
/// process (the shm provider) or pinned by a NIC (verbs); or, made by
/// [`Buffer::map_file`], a shared mapping of a file, whose bytes outlive
/// the process.
pub struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
    map_len: usize,
    /// Bytes reserved after the mapping with no access (0 or one page).
    guard_len: usize,
    fd: OwnedFd,
    /// A file's mapping rather than a sealed memfd's.
    file_backed: bool,
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
            file_backed: false,
        })
    }

    /// Maps the first `len` bytes of `file` shared and read-write: stores
    /// to the buffer, and peers' writes and atomics into it once it is
    /// registered, go to the file's pages, so they survive the process (a
    /// crash or `kill -9` of it loses none; the kernel writes them to the
    /// disk later, or at `msync`).
    ///
    /// The file must be open for reading and writing and hold at least
    /// `len` rounded up to whole pages (a shm peer maps whole pages, and
    /// an access past the file's end faults): size it first with
    /// `File::set_len`. Nothing seals the size, so whoever can truncate
    /// the file can make accesses to the buffer fault (SIGBUS): keep it
    /// private to the process's user.
    ///
    /// On shm, peers map the file itself, and only those connected with
    /// [`EndpointOptions::map_file_regions`](crate::EndpointOptions::map_file_regions)
    /// accept it (its owner could shrink it under them). On verbs, Linux
    /// 6.5 and later refuse to pin a writable file mapping of a file system
    /// that tracks dirty pages (ext4, xfs): registering it with remote
    /// write or atomic rights fails with `EFAULT` unless the file lives on
    /// tmpfs.
    pub fn map_file(file: std::fs::File, len: usize) -> Result<Buffer> {
        if len > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "a region holds at most {} bytes, {len} were asked for",
                u32::MAX
            )));
        }
        let map_len = len.max(1).div_ceil(page_size()) * page_size();
        let size = file
            .metadata()
            .map_err(|e| Error::io("fstat of the file to map", e))?
            .len();
        if size < map_len as u64 {
            return Err(Error::InvalidArgument(format!(
                "the file holds {size} bytes; mapping {len} bytes needs {map_len} \
                 (whole pages): extend it with set_len first"
            )));
        }
        let fd = OwnedFd::from(file);
        let ptr = map_shared(fd.as_raw_fd(), map_len, true)?;
        Ok(Buffer {
            ptr,
            len,
            map_len,
            guard_len: 0,
            fd,
            file_backed: true,
        })
    }

    /// Whether the buffer maps a file ([`Buffer::map_file`]) rather than
    /// a memfd of its own.
    pub fn is_file_backed(&self) -> bool {
        self.file_backed
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

    /// The memfd (or the file) holding the pages.
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
/// Peers with the right access may change the bytes at any time, as a NIC
/// would, and the fabric itself writes them when a read or an atomic posted
/// with the region completes. So the safe accessors copy
/// ([`read_into`](Self::read_into), [`read_to_vec`](Self::read_to_vec),
/// [`read_u64`](Self::read_u64), [`write_from`](Self::write_from),
/// [`fill`](Self::fill), [`write_u64`](Self::write_u64)) with volatile
/// accesses and never hold a reference to the bytes; a copy racing with a
/// peer's write may see any mix of old and new bytes. In-place slices
/// ([`as_slice`](Self::as_slice), [`as_mut_slice`](Self::as_mut_slice))
/// are `unsafe`: the caller promises that nothing else touches the bytes
/// while the slice lives.
pub struct MemoryRegion {
    pub(crate) buf: Arc<Buffer>,
    pub(crate) rkey: u32,
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) lkey: u32,
    pub(crate) access: Access,
    pub(crate) domain_id: u64,
    pub(crate) _registration: Box<dyn Registration>,
}

/// What a provider keeps for a region it registered; dropping it
/// deregisters the region (tcp and shm: its slot in the domain's region
/// table; verbs: the NIC's memory region). The providers implement it, so
/// this module names none of them. Made once per registration, never on
/// a post or poll path.
pub(crate) trait Registration: Send + Sync {
    /// The provider's own type, for its checks of a region it is handed
    /// (verbs: that the region is in the endpoint's protection domain).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    fn as_any(&self) -> &dyn Any;
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

    /// The bytes, read in place.
    ///
    /// # Safety
    ///
    /// Nothing may write the region's bytes while the returned slice lives:
    ///
    /// - no operation that lands data in this region may be outstanding: the
    ///   completion of every read or atomic posted with it as the local side
    ///   must have been polled;
    /// - no peer may write it: every peer given the region's descriptor with
    ///   [`Access::REMOTE_WRITE`] or [`Access::REMOTE_ATOMIC`] must be done
    ///   with it, as the application's protocol tells (for example: the
    ///   completion of the peer's write-with-immediate into it has been
    ///   polled, and the peer writes again only when asked);
    /// - no other thread writes it through this region ([`write_from`],
    ///   [`fill`], [`write_u64`], or [`as_ptr`](Self::as_ptr)).
    ///
    /// Where that cannot be known, copy with [`read_into`] instead.
    ///
    /// [`write_from`]: Self::write_from
    /// [`fill`]: Self::fill
    /// [`write_u64`]: Self::write_u64
    /// [`read_into`]: Self::read_into
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the buffer is valid for len bytes while self lives; the
        // caller promises no write to them while the slice lives.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr(), self.buf.len()) }
    }

    /// The bytes, written in place.
    ///
    /// # Safety
    ///
    /// As for [`as_slice`](Self::as_slice), and nothing may read the bytes
    /// either while the returned slice lives: no write posted with this
    /// region as its source may be outstanding (its completion must have
    /// been polled), and no peer given the descriptor with
    /// [`Access::REMOTE_READ`] may read it (on shm a peer may also hold a
    /// [`PeerView`] of it). Where that cannot be known, copy with
    /// [`write_from`](Self::write_from) instead.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the buffer is valid for len bytes; &mut self excludes other
        // references through this region, and the caller promises that no
        // operation or peer touches the bytes while the slice lives.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_ptr(), self.buf.len()) }
    }

    /// Copies the bytes at `offset..offset + dst.len()` into `dst`. Safe
    /// whatever peers do meanwhile: bytes written during the copy may show
    /// their old or new value. Panics when the range is outside the region.
    pub fn read_into(&self, offset: usize, dst: &mut [u8]) {
        self.assert_range(offset, dst.len());
        // SAFETY: the range lies in the region (checked above), which stays
        // mapped while self lives; dst is ours and does not overlap it.
        unsafe { copy_out(self.buf.as_ptr().add(offset), dst) }
    }

    /// The bytes of `range` (all of them with `..`), copied like
    /// [`read_into`](Self::read_into).
    pub fn read_to_vec(&self, range: impl RangeBounds<usize>) -> Vec<u8> {
        let (offset, len) = self.range(range);
        let mut out = vec![0; len];
        self.read_into(offset, &mut out);
        out
    }

    /// Copies `src` into the region at `offset`. Safe whatever peers do
    /// meanwhile (a peer reading during the copy may see old or new
    /// bytes). Panics when the range is outside the region.
    pub fn write_from(&mut self, offset: usize, src: &[u8]) {
        self.assert_range(offset, src.len());
        // SAFETY: the range lies in the region (checked above), which stays
        // mapped while self lives; src is ours and does not overlap it.
        unsafe { copy_in(src, self.buf.as_ptr().add(offset)) }
    }

    /// Sets every byte of `range` (all of them with `..`) to `byte`, like
    /// [`write_from`](Self::write_from).
    pub fn fill(&mut self, range: impl RangeBounds<usize>, byte: u8) {
        let (offset, len) = self.range(range);
        let base = self.buf.as_ptr();
        for i in offset..offset + len {
            // SAFETY: offset + len <= self.len() (checked by `range`).
            unsafe { std::ptr::write_volatile(base.add(i), byte) };
        }
    }

    /// Reads the 8-byte word at `offset` (for results of atomics), native
    /// endianness, like [`read_into`](Self::read_into).
    pub fn read_u64(&self, offset: usize) -> u64 {
        let mut bytes = [0; 8];
        self.read_into(offset, &mut bytes);
        u64::from_ne_bytes(bytes)
    }

    /// Writes the 8-byte word at `offset`, native endianness, like
    /// [`write_from`](Self::write_from).
    pub fn write_u64(&mut self, offset: usize, value: u64) {
        self.write_from(offset, &value.to_ne_bytes());
    }

    /// Panics unless `offset..offset+len` lies inside the region.
    fn assert_range(&self, offset: usize, len: usize) {
        if let Err(e) = self.check_range(offset, len) {
            panic!("{e}");
        }
    }

    /// `range` as `(offset, len)`, checked against the region (panics).
    fn range(&self, range: impl RangeBounds<usize>) -> (usize, usize) {
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.saturating_add(1),
            Bound::Excluded(&e) => e,
            Bound::Unbounded => self.len(),
        };
        let len = end.checked_sub(start).unwrap_or_else(|| {
            panic!(
                "range {start}..{end} of the {}-byte region ends before it starts",
                self.len()
            )
        });
        self.assert_range(start, len);
        (start, len)
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

/// Copies `dst.len()` bytes from `src` into `dst` with volatile reads, a
/// word at a time where `src` is aligned: `src` is registered memory that
/// peers, the NIC or the fabric may write meanwhile, so the compiler must
/// neither assume the bytes stay put nor read them twice.
///
/// # Safety
///
/// `src` must be valid for reads of `dst.len()` bytes and not overlap `dst`.
unsafe fn copy_out(src: *const u8, dst: &mut [u8]) {
    let len = dst.len();
    let mut i = 0;
    while i < len && (src as usize + i) % 8 != 0 {
        // SAFETY: i < len: inside the source range (caller's contract).
        dst[i] = unsafe { std::ptr::read_volatile(src.add(i)) };
        i += 1;
    }
    while i + 8 <= len {
        // SAFETY: 8 bytes inside the source range, at an 8-byte aligned address.
        let word = unsafe { std::ptr::read_volatile(src.add(i).cast::<u64>()) };
        dst[i..i + 8].copy_from_slice(&word.to_ne_bytes());
        i += 8;
    }
    while i < len {
        // SAFETY: i < len: inside the source range.
        dst[i] = unsafe { std::ptr::read_volatile(src.add(i)) };
        i += 1;
    }
}

/// Copies `src` to `dst` with volatile writes, a word at a time where `dst`
/// is aligned (see [`copy_out`] for why).
///
/// # Safety
///
/// `dst` must be valid for writes of `src.len()` bytes and not overlap `src`.
unsafe fn copy_in(src: &[u8], dst: *mut u8) {
    let len = src.len();
    let mut i = 0;
    while i < len && (dst as usize + i) % 8 != 0 {
        // SAFETY: i < len: inside the destination range (caller's contract).
        unsafe { std::ptr::write_volatile(dst.add(i), src[i]) };
        i += 1;
    }
    while i + 8 <= len {
        let mut word = [0; 8];
        word.copy_from_slice(&src[i..i + 8]);
        // SAFETY: 8 bytes inside the destination range, 8-byte aligned.
        unsafe { std::ptr::write_volatile(dst.add(i).cast::<u64>(), u64::from_ne_bytes(word)) };
        i += 8;
    }
    while i < len {
        // SAFETY: i < len: inside the destination range.
        unsafe { std::ptr::write_volatile(dst.add(i), src[i]) };
        i += 1;
    }
}

/// One write of a batch ([`Endpoint::write_batch`](crate::Endpoint::write_batch)): `local[offset..offset+len]`
/// to `remote`, completing with `wr_id`; with `imm`, a write-with-immediate.
///
/// An `unsignaled` write completes only when it fails: success leaves
/// nothing in the completion queue, as a verbs work request posted
/// without `IBV_SEND_SIGNALED`. For a poster that learns of delivery
/// otherwise, such as a request whose answer comes back. Its send-queue
/// entry is free once the provider knows the write is done: at once on
/// shm, at the peer's acknowledgement on tcp, on verbs when the batch's
/// last work request, which the provider always signals, completes.
#[derive(Clone, Copy, Debug)]
pub struct WriteRequest<'a> {
    /// Names the write's completion.
    pub wr_id: u64,
    /// The region the bytes come from.
    pub local: &'a MemoryRegion,
    /// Where the bytes start in `local`.
    pub offset: usize,
    /// How many bytes.
    pub len: usize,
    /// Where they go.
    pub remote: RemoteAddr,
    /// The immediate, consuming one receive posted at the peer; `None` for
    /// a plain write.
    pub imm: Option<u32>,
    /// No completion when it succeeds (a failure still completes).
    pub unsignaled: bool,
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

    fn region(len: usize) -> MemoryRegion {
        crate::Fabric::open("tcp")
            .unwrap()
            .domain()
            .unwrap()
            .register(len, Access::LOCAL)
            .unwrap()
    }

    #[test]
    fn copies_in_and_out_are_byte_exact_at_any_alignment() {
        let mut r = region(256);
        let data: Vec<u8> = (1..=100).collect();
        for offset in [0, 1, 7, 8, 13, 100] {
            for len in [0, 1, 7, 8, 9, 31, 100] {
                r.fill(.., 0);
                r.write_from(offset, &data[..len]);
                let back = r.read_to_vec(..);
                assert_eq!(&back[offset..offset + len], &data[..len], "{offset}+{len}");
                assert!(
                    back[..offset].iter().all(|&b| b == 0),
                    "{offset}+{len}: before"
                );
                assert!(
                    back[offset + len..].iter().all(|&b| b == 0),
                    "{offset}+{len}: after"
                );
                let mut out = vec![0xff; len];
                r.read_into(offset, &mut out);
                assert_eq!(out, &data[..len]);
            }
        }
        r.fill(10..20, 7);
        assert_eq!(r.read_to_vec(9..=20), [0, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 0]);
        r.write_u64(16, u64::MAX - 1);
        assert_eq!(r.read_u64(16), u64::MAX - 1);
    }

    #[test]
    fn a_file_mapping_writes_through_to_the_file_and_wants_whole_pages() {
        let page = page_size();
        let path = std::env::temp_dir().join(format!("rfaas-map-file-{}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.set_len(100).unwrap();
        let short = Buffer::map_file(file.try_clone().unwrap(), 100).unwrap_err();
        assert!(short.to_string().contains("whole pages"), "{short}");
        file.set_len(page as u64).unwrap();
        let buf = Buffer::map_file(file, 100).unwrap();
        assert_eq!((buf.len(), buf.mapped_len()), (100, page));
        assert!(buf.is_file_backed() && !Buffer::new(8).unwrap().is_file_backed());
        // SAFETY: inside the mapping, which nothing else uses.
        unsafe { buf.as_ptr().add(99).write_volatile(0x5a) };
        drop(buf);
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!((bytes.len(), bytes[99], bytes[98]), (page, 0x5a, 0));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    #[should_panic(expected = "local range 250..258 is outside the 256-byte region")]
    fn a_copy_past_the_end_panics_naming_the_range() {
        region(256).read_into(250, &mut [0; 8]);
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
