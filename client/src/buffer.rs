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

    /// The data.
    ///
    /// # Panics
    ///
    /// When the buffer [`is_busy`](Self::is_busy): the late answer of a
    /// dropped invocation may still be written into it.
    #[track_caller]
    pub fn as_slice(&self) -> &[T] {
        self.check_at_rest();
        // SAFETY: the region holds data_offset() + len * size_of::<T>()
        // bytes, mapped while self.shared lives; the data starts at a page
        // boundary, which satisfies T's alignment; T is Pod, so any bytes
        // (zeroed at registration, or written by a function) are valid.
        // Nothing writes them meanwhile: an invocation in flight borrows
        // its output mutably, and one dropped unfinished leaves the buffer
        // busy (checked above; the Acquire load orders its answer before).
        unsafe {
            std::slice::from_raw_parts(
                self.shared.region.as_ptr().add(data_offset()).cast::<T>(),
                self.len,
            )
        }
    }

    /// The data, to fill an input or reuse an output.
    ///
    /// # Panics
    ///
    /// When the buffer [`is_busy`](Self::is_busy), as
    /// [`as_slice`](Self::as_slice).
    #[track_caller]
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        self.check_at_rest();
        // SAFETY: as in as_slice; &mut self makes this the only reference
        // handed out.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.shared.region.as_ptr().add(data_offset()).cast::<T>(),
                self.len,
            )
        }
    }

    /// The data's first byte, for the C API, which hands it out as a
    /// pointer and leaves the rules to its caller.
    #[doc(hidden)]
    pub fn data_ptr(&self) -> *mut T {
        // SAFETY: data_offset() is inside the region (one page of it).
        unsafe { self.shared.region.as_ptr().add(data_offset()).cast::<T>() }
    }

    /// The data as bytes.
    ///
    /// # Panics
    ///
    /// As [`as_slice`](Self::as_slice).
    #[track_caller]
    pub fn as_bytes(&self) -> &[u8] {
        let s = self.as_slice();
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
            let data = b.as_slice().as_ptr() as usize;
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
        b.as_mut_slice().copy_from_slice(&[7; 16]);
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
        assert_eq!(b.as_slice(), &[7; 16]);
    }

    #[test]
    fn typed_views_and_pod_arrays() {
        let d = domain();
        let mut b = Buffer::<[f32; 3]>::new(&d, 4).unwrap();
        b.as_mut_slice()[2] = [1.0, 2.0, 3.0];
        assert_eq!(b.capacity_bytes(), 48);
        assert_eq!(&b.as_bytes()[24..28], &1.0f32.to_ne_bytes());
        assert!(!b.is_empty());
        assert!(Buffer::<u8>::new(&d, 0).unwrap().is_empty());
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
