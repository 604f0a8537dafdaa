//! One lane: a connection's tag, its buffers and its meter. A worker
//! thread ([`thread`](super::thread)) serves several.

use std::sync::Arc;

use rfaas_fabric::MemoryRegion;
use rfaas_proto::meter::LaneState;

use super::meter::LaneMeter;

/// Receives kept posted per lane besides one per slot but the first: the
/// spares let the next request land at once while the thread is still
/// sending the previous response, before it posts the consumed receive
/// again. A lane of `slots` slots keeps `slots - 1 + RECV_DEPTH`.
pub const RECV_DEPTH: usize = 4;

/// Bits of a wr_id below the connection tag ([`conn_tag`]).
const TAG_SHIFT: u32 = 48;

/// The tag of the connection made by accept attempt `attempt` (counted
/// over the whole worker), carried in the top bits of every wr_id posted on
/// it (never 0). A thread's completion queue holds every connection
/// accepted onto it, its lanes' and those dropped while they were
/// connected, whose receives may complete (flushed) later: the tag tells
/// them apart, and names the lane.
pub fn conn_tag(attempt: u64) -> u64 {
    ((attempt % 0xffff) + 1) << TAG_SHIFT
}

/// The connection tag of `wr_id`.
pub fn tag_of(wr_id: u64) -> u64 {
    wr_id & !((1 << TAG_SHIFT) - 1)
}

/// The accept attempt a tag was made for, modulo 0xffff: a small number,
/// to index a table by.
pub fn tag_index(tag: u64) -> usize {
    ((tag >> TAG_SHIFT) as usize).saturating_sub(1)
}

/// wr_id (below the tag) of a response write; receives are numbered from 0
/// (fewer than [`MAX_SLOTS`](rfaas_proto::control::client::MAX_SLOTS) +
/// [`RECV_DEPTH`]).
pub const RESPONSE_WR: u64 = 1 << 32;

/// wr_id (below the tag) of a pull's first read; chunk `i` is `PULL_WR + i`.
pub const PULL_WR: u64 = 2 << 32;

/// A lane's buffers, registered before its client connects.
#[derive(Debug)]
pub struct LaneBuffers {
    /// The input buffer: `outputs.len()` parts, `stride` bytes apart.
    pub input: MemoryRegion,
    /// Bytes from one slot's part to the next's (the part's length with
    /// one slot).
    pub stride: usize,
    /// The bytes one slot's request may take.
    pub slot_capacity: usize,
    /// One output buffer per slot, each followed by a guard page.
    pub outputs: Vec<Arc<MemoryRegion>>,
}

/// A lane's own resources, held by the thread that serves it.
#[derive(Debug)]
pub struct Lane {
    /// The lane's number in the allocation (connection order).
    pub index: usize,
    /// Its connection's tag ([`conn_tag`]).
    pub tag: u64,
    /// The input buffer the client writes requests into: one part per
    /// slot, `stride` bytes apart.
    pub input: MemoryRegion,
    /// Bytes from one slot's part of `input` to the next's.
    pub stride: usize,
    /// The bytes one slot's request may take (the input capacity).
    pub slot_capacity: usize,
    /// Slots minus one: an invocation's slot is its id masked with it.
    pub slot_mask: u32,
    /// Each slot's output buffer (a guard page follows each).
    pub outputs: Box<[Arc<MemoryRegion>]>,
    /// Offset of the function's output pointer in an output buffer: the
    /// output ends at the region's end, where the guard page starts.
    pub out_offset: usize,
    /// The lane's record in the meter area.
    pub meter: LaneMeter,
    /// Whether its client is still there.
    pub live: bool,
}

impl Lane {
    /// A connected lane; its record says [`LaneState::Handling`] until it
    /// first serves (the thread's own lane says what the thread does).
    pub fn new(
        index: usize,
        tag: u64,
        buffers: LaneBuffers,
        output_capacity: usize,
        meter: LaneMeter,
    ) -> Lane {
        let LaneBuffers {
            input,
            stride,
            slot_capacity,
            outputs,
        } = buffers;
        assert!(
            outputs.len().is_power_of_two() && stride * outputs.len() <= input.len(),
            "a lane's slots are a power of two, each with its part of the input"
        );
        let out_offset = outputs[0].len() - output_capacity.div_ceil(64) * 64;
        Lane {
            index,
            tag,
            input,
            stride,
            slot_capacity,
            slot_mask: outputs.len() as u32 - 1,
            outputs: outputs.into(),
            out_offset,
            meter,
            live: true,
        }
    }

    /// The slot of invocation `id`.
    #[inline]
    pub fn slot_of(&self, id: u32) -> usize {
        (id & self.slot_mask) as usize
    }

    /// The client went away: the lane's record goes off.
    pub fn end(&mut self) {
        self.live = false;
        self.meter.enter(LaneState::Off);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_tags_tell_connections_apart() {
        let tags: Vec<u64> = (0..5).map(conn_tag).collect();
        for (i, &t) in tags.iter().enumerate() {
            assert_ne!(t, 0, "attempt {i}: a tag is never 0");
            assert_eq!(tag_index(t), i, "attempt {i}: the tag names it");
            for &u in &tags[i + 1..] {
                assert_ne!(t, u);
            }
            // Every wr_id the thread posts keeps its connection's tag...
            for low in [
                0,
                RECV_DEPTH as u64 - 1,
                RESPONSE_WR,
                PULL_WR,
                PULL_WR + 4095,
            ] {
                assert_eq!(tag_of(t | low), t, "{low:#x}");
            }
        }
        // ...and the ids of one connection never carry another's.
        assert_ne!(tag_of(conn_tag(0) | PULL_WR), conn_tag(1));
        assert_eq!(conn_tag(0xffff), conn_tag(0), "wraps after 65535 attempts");
        assert_eq!(tag_index(conn_tag(0xfffe)), 0xfffe);
    }
}
