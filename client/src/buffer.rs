//! [`Buffer`]: typed, registered memory for inputs and outputs.
//!
//! ```text
//! region  0                      page - 32      page                   page + len * size_of::<T>()
//!         +----------------------+--------------+--------------------------+
//!         | unused               | header (32 B) | data (page-aligned)      |
//!         +----------------------+--------------+--------------------------+
//! ```
//!
//! The data starts at a page boundary, so any `T` is aligned and a function
//! sees its input as the caller laid it out. The 32 bytes in front of it
//! hold the [`InvocationHeader`](rfaas_proto::InvocationHeader) when the
//! buffer is an input: header and payload then leave in one write.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rfaas_fabric::{Access, Domain, MemoryRegion};
use rfaas_proto::InvocationHeader;

use crate::error::{elements, Error, Result};

/// Plain data: any bit pattern is a valid value, there is no padding and
/// no pointer, so bytes written by a remote function can be read as `Self`.
///
/// # Safety
///
/// Implement it only for types for which every byte pattern of
/// `size_of::<Self>()` bytes is a valid value and which hold no padding,
/// references or pointers.
pub unsafe trait Pod: Copy + Send + Sync + 'static {}

macro_rules! pod {
    ($($t:ty),*) => {
        // SAFETY: primitive numbers: every bit pattern is a value, no padding.
        $(unsafe impl Pod for $t {})*
    };
}
pod!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize, f32, f64);

// SAFETY: an array of plain data has no padding between its elements.
unsafe impl<T: Pod, const N: usize> Pod for [T; N] {}

/// Where the data of a buffer starts: one page into its region.
pub(crate) fn data_offset() -> usize {
    rfaas_fabric::page_size()
}

/// Where the header slot starts: just before the data.
pub(crate) fn header_offset() -> usize {
    data_offset() - InvocationHeader::LEN
}

/// The region behind a [`Buffer`], shared with the lane that uses it while
/// an invocation is in flight (so a dropped invocation cannot leave a lane
/// pointing at freed memory).
#[derive(Debug)]
pub(crate) struct RegionShared {
    pub(crate) region: MemoryRegion,
    /// The domain it is registered in.
    pub(crate) domain_id: u64,
    /// The header slot is being sent by a lane.
    pub(crate) header_busy: AtomicBool,
    /// The data is the output of an unfinished invocation.
    pub(crate) output_busy: AtomicBool,
}

impl RegionShared {
    /// Address of the data's first byte, as a peer names it.
    pub(crate) fn data_addr(&self) -> u64 {
        self.region.descriptor().addr + data_offset() as u64
    }

    /// The data's first 4 bytes, little-endian.
    ///
    /// # Safety
    ///
    /// The data holds at least 4 bytes, and no write to them is in flight.
    pub(crate) unsafe fn first_word(&self) -> i32 {
        // SAFETY: data_offset() is inside the region, and the caller
        // promises 4 data bytes at rest.
        let bytes = unsafe {
            std::ptr::read_unaligned(self.region.as_ptr().add(data_offset()).cast::<[u8; 4]>())
        };
        i32::from_le_bytes(bytes)
    }

    /// Writes the request header into the header slot.
    ///
    /// The caller holds `header_busy`, so nobody else writes the slot, and
    /// the slot is never handed out as a slice.
    pub(crate) fn write_header(&self, header: &InvocationHeader) {
        let bytes = header.to_bytes();
        // SAFETY: the region is at least one page long, so the 32 bytes at
        // header_offset() are inside the mapping; they are never exposed as
        // a Rust reference, and header_busy makes this the only writer.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.region.as_ptr().add(header_offset()),
                InvocationHeader::LEN,
            );
        }
    }
}

/// A typed, page-aligned buffer of `len` elements registered in an
/// allocation's protection domain; made by
/// [`Allocation::buffer`](crate::Allocation::buffer).
///
/// It stays valid across [`Allocation::invoke_retrying`]'s re-allocations:
/// they keep the allocation's domain.
///
/// # Reading and writing
///
/// The buffer is registered for remote writes, and the workers of its
/// allocation keep its remote key: a function may write it at any time, and
/// on tcp the client's own progress thread lands those writes. So the safe
/// accessors copy ([`read_into`](Self::read_into), [`to_vec`](Self::to_vec),
/// [`write_from`](Self::write_from), [`fill`](Self::fill)) and never hold a
/// reference to the data; in-place slices ([`as_slice`](Self::as_slice),
/// [`as_mut_slice`](Self::as_mut_slice), [`as_bytes`](Self::as_bytes)) are
/// `unsafe`: the caller promises that nothing writes the data while the
/// slice lives.
///
/// ```
/// # use std::time::Duration;
/// # use rfaas_testkit::executord::{daemon_binary, Executord, ExecutordOptions};
/// # use rfaas_testkit::functions::c_library_bytes;
/// use rfaas_client::{AllocationSpec, Client, ClientOptions};
/// # fn main() -> rfaas_client::Result<()> {
/// # let daemon = Executord::start(&daemon_binary(), ExecutordOptions::default());
/// # let executor = daemon.control_addr().to_string();
/// # let token = daemon.token("nobody", 1, 256, Duration::from_secs(600));
/// # let library = c_library_bytes();
/// let client = Client::new(ClientOptions::with_provider("tcp"));
/// let spec = AllocationSpec::new(library, &["echo"]).memory_mib(256);
/// let alloc = client.allocate(&executor, &token, &spec)?;
/// let echo = alloc.function("echo")?;
/// let mut input = alloc.buffer::<u32>(4)?;
/// let mut output = alloc.buffer::<u32>(4)?;
/// input.write_from(0, &[1, 2, 3, 4]);
/// let bytes = alloc.invoke(echo, &input, 4, &mut output)?;
/// assert_eq!(bytes, 16);
/// assert_eq!(output.to_vec(), [1, 2, 3, 4]);
/// let mut tail = [0; 2];
/// output.read_into(2, &mut tail);
/// assert_eq!(tail, [3, 4]);
/// alloc.deallocate()?;
/// # Ok(()) }
/// ```
///
/// Not even a copy can be taken while a call that writes the buffer is in
/// flight: the call borrows its output until it ends.
///
/// ```compile_fail,E0502
/// # use rfaas_client::{Allocation, Buffer, FunctionId, Result};
/// fn early(alloc: &Allocation, f: FunctionId, input: &Buffer<u32>, output: &mut Buffer<u32>) -> Result<Vec<u32>> {
///     let call = alloc.submit(f, input, 4, output)?;
///     let seen = output.to_vec(); // the worker may be writing it
///     call.get()?;
///     Ok(seen)
/// }
/// ```
#[derive(Debug)]
pub struct Buffer<T: Pod> {
    pub(crate) shared: Arc<RegionShared>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Pod> Buffer<T> {
    /// Registers `len` zeroed elements (plus the header page) in `domain`.
    pub(crate) fn new(domain: &Domain, len: usize) -> Result<Buffer<T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .and_then(|b| b.checked_add(data_offset()))
            .filter(|&b| b <= u32::MAX as usize)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "a buffer of {} does not fit in a registered region (at most 4 GiB, a page of it for the request header); make it smaller",
                    elements(len, std::mem::size_of::<T>())
                ))
            })?;
        let region = domain.register(
            bytes,
            Access::LOCAL | Access::REMOTE_READ | Access::REMOTE_WRITE,
        )?;
        Ok(Buffer {
            shared: Arc::new(RegionShared {
                region,
                domain_id: domain.id(),
                header_busy: AtomicBool::new(false),
                output_busy: AtomicBool::new(false),
            }),
            len,
            _t: PhantomData,
        })
    }

    /// Another handle on the same registered memory, for bindings whose
    /// callers hand a buffer to a [`Pipeline`](crate::Pipeline) by
    /// reference (the C library). Not for Rust programs: move the buffer
    /// itself.
    ///
    /// # Safety
    ///
    /// While the alias is in a pipeline call, the caller neither reads nor
    /// writes the buffer through another handle, nor uses it in another
    /// call.
    #[doc(hidden)]
    pub unsafe fn alias(&self) -> Buffer<T> {
        Buffer {
            shared: Arc::clone(&self.shared),
            len: self.len,
            _t: PhantomData,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of data (`len * size_of::<T>()`): what a function may write
    /// when this is the output.
    pub fn capacity_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// Whether the buffer is the output of a dropped, unfinished
    /// invocation: its late answer may still land in it, so it cannot be
    /// read or written until [`Allocation::reclaim`](crate::Allocation::reclaim)
    /// (or a submission that drains the lane) has seen that answer.
    pub fn is_busy(&self) -> bool {
        self.shared.output_busy.load(Ordering::Acquire)
    }

    /// Panics when a late answer may still land in the buffer.
    #[track_caller]
    fn check_at_rest(&self) {
        if self.is_busy() {
            panic!(
                "this buffer is the output of a dropped, unfinished invocation, whose answer may \
                 land in it at any moment; call Allocation::reclaim(&buffer) before reading or \
                 writing it (or keep an invocation until it ends)"
            );
        }
    }

    /// Panics unless elements `offset..offset + count` lie in the buffer.
    #[track_caller]
    fn check_range(&self, offset: usize, count: usize) {
        if !matches!(offset.checked_add(count), Some(end) if end <= self.len) {
            panic!(
                "elements {offset}..{} are outside this buffer of {} elements; make the \
                 buffer larger or the copy shorter",
                offset.saturating_add(count),
                self.len
            );
        }
    }

    /// Copies elements `offset..offset + dst.len()` into `dst`. Safe
    /// whatever the worker does meanwhile: it copies with volatile reads
    /// and holds no reference to the buffer, so an element written during
    /// the copy shows its old or its new bytes.
    ///
    /// # Panics
    ///
    /// When the range is outside the buffer, or the buffer
    /// [`is_busy`](Self::is_busy).
    #[track_caller]
    pub fn read_into(&self, offset: usize, dst: &mut [T]) {
        self.check_at_rest();
        self.check_range(offset, dst.len());
        let size = std::mem::size_of::<T>();
        // SAFETY: T is Pod: no padding, and any bytes written into dst are
        // a valid T; the byte view covers exactly dst, which it borrows.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                dst.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(dst),
            )
        };
        self.shared
            .region
            .read_into(data_offset() + offset * size, bytes);
    }

    /// A copy of every element, made like [`read_into`](Self::read_into).
    ///
    /// # Panics
    ///
    /// When the buffer [`is_busy`](Self::is_busy).
    #[track_caller]
    pub fn to_vec(&self) -> Vec<T> {
        let mut out = Vec::with_capacity(self.len);
        // SAFETY: the capacity holds len elements; zero bytes are a valid T
        // (Pod), so all len elements are initialised before set_len.
        unsafe {
            std::ptr::write_bytes(out.as_mut_ptr(), 0, self.len);
            out.set_len(self.len);
        }
        self.read_into(0, &mut out);
        out
    }

    /// Copies `src` into elements `offset..offset + src.len()`, with
    /// volatile writes and no reference to the buffer, like
    /// [`read_into`](Self::read_into).
    ///
    /// # Panics
    ///
    /// When the range is outside the buffer, or the buffer
    /// [`is_busy`](Self::is_busy).
    #[track_caller]
    pub fn write_from(&mut self, offset: usize, src: &[T]) {
        self.check_at_rest();
        self.check_range(offset, src.len());
        let base = self.data_ptr();
        for (i, &v) in src.iter().enumerate() {
            // SAFETY: offset + i < len (checked above), inside the mapped
            // data; the data is page-aligned, so aligned for T.
            unsafe { std::ptr::write_volatile(base.add(offset + i), v) };
        }
    }

    /// Sets every element to `value`, like [`write_from`](Self::write_from).
    ///
    /// # Panics
    ///
    /// When the buffer [`is_busy`](Self::is_busy).
    #[track_caller]
    pub fn fill(&mut self, value: T) {
        self.check_at_rest();
        let base = self.data_ptr();
        for i in 0..self.len {
            // SAFETY: i < len, inside the mapped, page-aligned data.
            unsafe { std::ptr::write_volatile(base.add(i), value) };
        }
    }

    /// The data, read in place, without a copy.
    ///
    /// # Safety
    ///
    /// Nothing may write the data while the returned slice lives:
    ///
    /// - no invocation that has this buffer as its output may be in flight:
    ///   the invocation that wrote it has returned its result (a call
    ///   borrows its output mutably until then, and one dropped before it
    ///   ended leaves the buffer [busy](Self::is_busy), which panics here);
    /// - the functions of the allocation write it only when asked: every
    ///   worker that was sent the buffer's descriptor (an invocation that
    ///   used it as its output, or pulled it as a large input) keeps its
    ///   remote key while the allocation lives, and a function that writes
    ///   through it outside its own invocation breaks this promise. Load
    ///   only functions you trust to do so;
    /// - no other thread writes it through [`data_ptr`](Self::data_ptr).
    ///
    /// Where that cannot be known, copy with [`read_into`](Self::read_into)
    /// or [`to_vec`](Self::to_vec) instead.
    ///
    /// Safe code cannot take the slice:
    ///
    /// ```compile_fail,E0133
    /// fn peek(output: &rfaas_client::Buffer<u32>) -> &[u32] {
    ///     output.as_slice()
    /// }
    /// ```
    ///
    /// # Panics
    ///
    /// When the buffer [`is_busy`](Self::is_busy): the late answer of a
    /// dropped invocation may still be written into it.
    #[track_caller]
    pub unsafe fn as_slice(&self) -> &[T] {
        self.check_at_rest();
        // SAFETY: the region holds data_offset() + len * size_of::<T>()
        // bytes, mapped while self.shared lives; the data starts at a page
        // boundary, which satisfies T's alignment; T is Pod, so any bytes
        // (zeroed at registration, or written by a function) are valid.
        // The caller promises that nothing writes them while the slice
        // lives; a dropped invocation's late answer is excluded by the
        // busy check above (its Acquire load orders that answer before).
        unsafe {
            std::slice::from_raw_parts(
                self.shared.region.as_ptr().add(data_offset()).cast::<T>(),
                self.len,
            )
        }
    }

    /// The data, written in place, without a copy: to fill an input or
    /// reuse an output.
    ///
    /// # Safety
    ///
    /// As for [`as_slice`](Self::as_slice), and nothing may read the data
    /// either while the returned slice lives: no invocation that has this
    /// buffer as its input may be in flight, including one dropped before
    /// it ended (its worker may still be pulling a large input). Where
    /// that cannot be known, copy with [`write_from`](Self::write_from)
    /// or [`fill`](Self::fill) instead.
    ///
    /// # Panics
    ///
    /// When the buffer [`is_busy`](Self::is_busy), as
    /// [`as_slice`](Self::as_slice).
    #[track_caller]
    pub unsafe fn as_mut_slice(&mut self) -> &mut [T] {
        self.check_at_rest();
        // SAFETY: as in as_slice; &mut self makes this the only reference
        // handed out, and the caller promises nothing else touches the data.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.shared.region.as_ptr().add(data_offset()).cast::<T>(),
                self.len,
            )
        }
    }

    /// The data's first byte, for the C API, which hands it out as a
    /// pointer; `rfaas.h` says when its caller may touch the bytes.
    #[doc(hidden)]
    pub fn data_ptr(&self) -> *mut T {
        // SAFETY: data_offset() is inside the region (one page of it).
        unsafe { self.shared.region.as_ptr().add(data_offset()).cast::<T>() }
    }

    /// The data as bytes, read in place.
    ///
    /// # Safety
    ///
    /// As for [`as_slice`](Self::as_slice).
    ///
    /// # Panics
    ///
    /// As [`as_slice`](Self::as_slice).
    #[track_caller]
    pub unsafe fn as_bytes(&self) -> &[u8] {
        // SAFETY: the caller's promise, passed on.
        let s = unsafe { self.as_slice() };
        // SAFETY: T is Pod: no padding, so every byte is initialised.
        unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), self.capacity_bytes()) }
    }

    /// The id of the protection domain it is registered in.
    pub(crate) fn domain_id(&self) -> u64 {
        self.shared.domain_id
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfaas_fabric::Fabric;

    fn domain() -> Domain {
        Fabric::open("tcp").unwrap().domain().unwrap()
    }

    #[test]
    fn data_is_page_aligned_after_the_header_slot() {
        let d = domain();
        let page = rfaas_fabric::page_size();
        for len in [0usize, 1, 3, 1000, 5000] {
            let b = Buffer::<u64>::new(&d, len).unwrap();
            let base = b.shared.region.as_ptr() as usize;
            let data = b.data_ptr() as usize;
            assert_eq!(data - base, page, "len {len}");
            assert_eq!(data % page, 0, "len {len}");
            assert_eq!(b.shared.data_addr(), data as u64);
            assert_eq!(b.len(), len);
            assert_eq!(b.capacity_bytes(), len * 8);
            assert_eq!(b.shared.region.len(), page + len * 8);
            assert_eq!(b.domain_id(), d.id());
            assert_eq!(header_offset(), page - 32);
        }
    }

    #[test]
    fn the_header_lands_right_before_the_data() {
        let d = domain();
        let mut b = Buffer::<u8>::new(&d, 16).unwrap();
        b.write_from(0, &[7; 16]);
        let header = InvocationHeader {
            output_addr: 0x1122_3344_5566_7788,
            output_rkey: 9,
            output_capacity: 100,
            input_addr: 0,
            input_rkey: 0,
            input_len: 16,
        };
        b.shared.write_header(&header);
        let region = b.shared.region.read_to_vec(..);
        let at = header_offset();
        assert_eq!(&region[at..at + 32], &header.to_bytes());
        // The request is header and payload, contiguous.
        assert_eq!(InvocationHeader::decode(&region[at..]).unwrap(), header);
        assert_eq!(&region[at + 32..at + 48], &[7; 16]);
        assert!(region[..at].iter().all(|&x| x == 0));
        assert_eq!(b.to_vec(), [7; 16]);
    }

    #[test]
    fn typed_views_and_pod_arrays() {
        let d = domain();
        let mut b = Buffer::<[f32; 3]>::new(&d, 4).unwrap();
        b.write_from(2, &[[1.0, 2.0, 3.0]]);
        assert_eq!(b.capacity_bytes(), 48);
        // SAFETY: the buffer was never sent to a worker; nothing else
        // writes it.
        assert_eq!(unsafe { &b.as_bytes()[24..28] }, &1.0f32.to_ne_bytes());
        let mut two = [[0.0; 3]; 2];
        b.read_into(1, &mut two);
        assert_eq!(two, [[0.0; 3], [1.0, 2.0, 3.0]]);
        assert!(!b.is_empty());
        assert!(Buffer::<u8>::new(&d, 0).unwrap().is_empty());
    }

    #[test]
    fn copies_fill_and_stay_inside_the_data() {
        let d = domain();
        let mut b = Buffer::<u16>::new(&d, 5).unwrap();
        b.fill(0x0102);
        b.write_from(3, &[7, 8]);
        assert_eq!(b.to_vec(), [0x0102, 0x0102, 0x0102, 7, 8]);
        b.write_from(0, &[]);
        let region = b.shared.region.read_to_vec(..);
        let at = data_offset();
        assert!(region[..at].iter().all(|&x| x == 0), "before the data");
        assert_eq!(&region[at + 6..at + 10], &[7, 0, 8, 0]);
        let message = |e: Box<dyn std::any::Any + Send>| {
            e.downcast_ref::<String>().cloned().unwrap_or_default()
        };
        let read =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| b.read_into(4, &mut [0; 2])));
        let msg = message(read.unwrap_err());
        assert!(
            msg.contains("elements 4..6 are outside this buffer of 5"),
            "{msg}"
        );
        let write = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            b.write_from(usize::MAX, &[1])
        }));
        let msg = message(write.unwrap_err());
        assert!(msg.contains("outside this buffer of 5 elements"), "{msg}");
        assert_eq!(
            b.to_vec(),
            [0x0102, 0x0102, 0x0102, 7, 8],
            "nothing written"
        );
    }

    #[test]
    fn oversized_buffers_are_refused() {
        let d = domain();
        let err = Buffer::<u64>::new(&d, usize::MAX / 4).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
        let err = Buffer::<u8>::new(&d, u32::MAX as usize).unwrap_err();
        assert!(err.to_string().contains("4 GiB"), "{err}");
    }
}
