//! The least memory an allocation's worker needs, what it is made of, and
//! what the rest leaves for the payloads a lane pulls.
//!
//! Under `RLIMIT_AS` the limit counts address space: every mapping, thread
//! stacks, the library's loaded segments, every registered buffer. Under a
//! cgroup it counts resident memory, which is at most that, so the same
//! figure is an upper bound there. The constants were measured on the
//! build machine (docs/executor.md, "Memory"): the smallest `RLIMIT_AS`
//! under which a worker loads, connects every lane and answers on each,
//! for 1 to 8 lanes and buffers of 4 KiB to 16 MiB, on tcp and shm, with
//! glibc kept to one malloc arena ([`MALLOC_ARENA_MAX`](super::super::memlimit)),
//! rounded up.

use rfaas_proto::control::client::AllocateRequest;
use rfaas_proto::control::ErrorCode;

use crate::daemon::refusal::Refused;

const MIB: u64 = 1 << 20;
const PAGE: u64 = 4096;

/// The worker process itself once assigned: its binary and shared
/// libraries (6 MiB idle for a debug build, 4 MiB for release), the
/// fabric, the watchdog's and the control thread's (small) stacks and the
/// allocator's heap. Measured: 10.8 MiB with the debug build; a debug
/// build with the verbs provider fits too.
pub(crate) const WORKER_BYTES: u64 = 12 * MIB;

/// Each worker thread: its stack (2 MiB, and a 256 KiB guard below it),
/// its signal stack and its completion queue. With [`LANE_BYTES`], what one
/// lane on its own thread was measured to take: 3.2 MiB with a 2 MiB stack
/// before the guard, so 3.45 MiB, rounded up to 4.
pub(crate) const THREAD_BYTES: u64 = 3 * MIB;

/// Each lane besides its buffers: its endpoint and the thread's record of
/// it.
pub(crate) const LANE_BYTES: u64 = MIB;

/// How many times the worker's address space holds each byte of a lane's
/// output, and of a bulk payload it pulls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Copies {
    output: u64,
    payload: u64,
}

/// On shm the worker maps the client's buffers it writes to or reads from,
/// and a region the client may both read and write is mapped twice (a
/// writable mapping and a read-only view): a lane's output counts its own
/// buffer and twice the client's (taken to be as large); a pulled payload
/// the pull buffer and twice the client's input (without the pull buffer
/// with `read_only_input`, which reads in place).
fn copies(provider: &str, read_only_input: bool) -> Copies {
    match provider {
        "shm" => Copies {
            output: 3,
            payload: if read_only_input { 2 } else { 3 },
        },
        _ => Copies {
            output: 1,
            payload: 1,
        },
    }
}

/// What an allocation's worker needs at least, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Need {
    threads: u64,
    lanes: u64,
    /// Slots per lane: each has its part of the input buffer and an output
    /// buffer of its own.
    slots: u64,
    input: u64,
    output: u64,
    library: u64,
    copies: Copies,
}

impl Need {
    /// The need of `req` with `library` (its bytes).
    pub(crate) fn of(req: &AllocateRequest, library: &[u8]) -> Need {
        Need {
            threads: req.thread_count().into(),
            lanes: req.lane_count().into(),
            slots: req.slot_count().into(),
            // One buffer of every slot's part, each part a whole number of
            // cache lines (the worker's slot stride).
            input: round_up(
                u64::from(req.input_capacity).div_ceil(64) * 64 * u64::from(req.slot_count()),
            ),
            // The output buffer is whole pages with a guard page after it.
            output: round_up(u64::from(req.output_capacity).div_ceil(64) * 64) + PAGE,
            library: loaded_size(library),
            copies: copies(&req.provider, req.read_only_input),
        }
    }

    fn per_lane(&self) -> u64 {
        LANE_BYTES + self.input + self.slots * self.output * self.copies.output
    }

    /// The whole, bytes.
    pub(crate) fn bytes(&self) -> u64 {
        WORKER_BYTES + self.library + self.threads * THREAD_BYTES + self.lanes * self.per_lane()
    }

    /// The whole, MiB, rounded up.
    pub(crate) fn mib(&self) -> u64 {
        self.bytes().div_ceil(MIB)
    }

    /// The largest payload one invocation may carry with `memory_mib`:
    /// what the need leaves, for the copies a pull makes (0 when nothing
    /// is left; capped at what a request header can say).
    pub(crate) fn max_input(&self, memory_mib: u32) -> u64 {
        let room = (u64::from(memory_mib) * MIB).saturating_sub(self.bytes());
        (room / self.copies.payload).min(u64::from(u32::MAX))
    }

    /// What the need is made of, for people.
    pub(crate) fn describe(&self) -> String {
        let shm = if self.copies.output > 1 {
            format!(
                " (on shm {} times: the worker's and, mapped twice, the client's output buffer, \
                 taken to be as large)",
                self.copies.output
            )
        } else {
            String::new()
        };
        format!(
            "{} for the worker process itself, {} for the library's loaded segments, {} thread{} \
             × {}, and {} lane{} × {} ({} for the lane's fabric resources, {} for its input \
             buffer, {} for its output buffer and guard page{shm}{})",
            size(WORKER_BYTES),
            size(self.library),
            self.threads,
            if self.threads == 1 { "" } else { "s" },
            size(THREAD_BYTES),
            self.lanes,
            if self.lanes == 1 { "" } else { "s" },
            size(self.per_lane()),
            size(LANE_BYTES),
            size(self.input),
            size(self.output * self.copies.output),
            if self.slots > 1 {
                format!(", times its {} slots", self.slots)
            } else {
                String::new()
            },
        )
    }
}

/// Refuses `req` when its `memory_mib` is below what its worker needs with
/// `library`; otherwise returns the largest payload an invocation may carry.
pub(crate) fn check(req: &AllocateRequest, library: &[u8]) -> Result<u64, Refused> {
    let need = Need::of(req, library);
    if u64::from(req.memory_mib) < need.mib() {
        return Err((
            ErrorCode::MemoryTooSmall,
            format!(
                "the allocation asks for {} MiB of memory, but its worker needs at least {} MiB: \
                 {}; ask for memory_mib {} or more (more still for payloads bigger than the \
                 input buffer, which the worker pulls into its memory)",
                req.memory_mib,
                need.mib(),
                need.describe(),
                need.mib()
            ),
        ));
    }
    Ok(need.max_input(req.memory_mib))
}

fn round_up(bytes: u64) -> u64 {
    bytes.div_ceil(PAGE) * PAGE
}

/// A size for a message: KiB below a MiB, MiB with up to one decimal above.
pub(crate) fn size(bytes: u64) -> String {
    if bytes < MIB {
        format!("{} KiB", bytes.div_ceil(1024))
    } else if bytes % MIB == 0 {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB as f64)
    }
}

/// The address space `dlopen` reserves for an ELF64 shared object: the
/// span of its loadable segments, `.bss` included. The file's size for
/// anything else (the ELF check refuses it later).
fn loaded_size(elf: &[u8]) -> u64 {
    load_span(elf).unwrap_or_else(|| round_up(elf.len() as u64))
}

fn load_span(elf: &[u8]) -> Option<u64> {
    // ELF64 (class 2), little-endian (data 1).
    if elf.len() < 64 || &elf[..4] != b"\x7fELF" || elf[4] != 2 || elf[5] != 1 {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(elf.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?));
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    if phentsize < 56 {
        return None;
    }
    let (mut lo, mut hi) = (u64::MAX, 0u64);
    for i in 0..phnum {
        let ph = phoff.checked_add(i.checked_mul(phentsize)?)?;
        const PT_LOAD: u32 = 1;
        if u32_at(ph)? != PT_LOAD {
            continue;
        }
        let vaddr = u64_at(ph + 16)?;
        let memsz = u64_at(ph + 40)?;
        lo = lo.min(vaddr / PAGE * PAGE);
        hi = hi.max(vaddr.checked_add(memsz)?);
    }
    (hi > lo).then(|| round_up(hi - lo))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfaas_proto::control::client::Mode;

    fn request(cores: u16, memory_mib: u32, provider: &str) -> AllocateRequest {
        AllocateRequest {
            request_id: 1,
            token: String::new(),
            cores,
            memory_mib,
            mode: Mode::Warm,
            hot_timeout_us: 0,
            input_capacity: 64 << 10,
            output_capacity: 1 << 20,
            deadline_ms: 0,
            functions: vec!["echo".into()],
            library_name: "lib.so".into(),
            provider: provider.into(),
            read_only_input: false,
            lanes: 0,
            slots: 0,
        }
    }

    /// An ELF64 header with one PT_LOAD of `memsz` bytes at 0 and one at
    /// 0x3000 of 0x100 bytes: the span is 0x3100 rounded up, or `memsz`.
    fn elf(memsz: u64) -> Vec<u8> {
        let mut b = vec![0u8; 64 + 2 * 56];
        b[..6].copy_from_slice(b"\x7fELF\x02\x01");
        b[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        b[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        b[0x38..0x3a].copy_from_slice(&2u16.to_le_bytes());
        for (i, (vaddr, size)) in [(0u64, memsz), (0x3000, 0x100)].into_iter().enumerate() {
            let ph = 64 + i * 56;
            b[ph..ph + 4].copy_from_slice(&1u32.to_le_bytes());
            b[ph + 16..ph + 24].copy_from_slice(&vaddr.to_le_bytes());
            b[ph + 40..ph + 48].copy_from_slice(&size.to_le_bytes());
        }
        b
    }

    #[test]
    fn the_library_counts_its_loaded_span_bss_included() {
        assert_eq!(loaded_size(&elf(0x10)), 0x4000);
        assert_eq!(loaded_size(&elf(16 << 20)), 16 << 20);
        // Not ELF64: the bytes themselves.
        assert_eq!(loaded_size(b"#!/bin/sh\n"), PAGE);
        let mut truncated = elf(0x10);
        truncated.truncate(100);
        assert_eq!(loaded_size(&truncated), PAGE);
    }

    #[test]
    fn the_need_adds_up_and_says_so() {
        let lib = elf(0x10);
        let need = Need::of(&request(2, 0, "tcp"), &lib);
        let lane = LANE_BYTES + (64 << 10) + (1 << 20) + PAGE;
        assert_eq!(
            need.bytes(),
            WORKER_BYTES + 0x4000 + 2 * THREAD_BYTES + 2 * lane
        );
        let text = need.describe();
        assert!(
            text.contains("12 MiB for the worker process itself"),
            "{text}"
        );
        assert!(text.contains("2 threads × 3 MiB"), "{text}");
        assert!(text.contains("2 lanes × 2.1 MiB"), "{text}");

        // More lanes than cores: a thread per core, the lanes' buffers each.
        let mut many = request(2, 0, "tcp");
        many.lanes = 64;
        let many = Need::of(&many, &lib);
        assert_eq!(
            many.bytes(),
            WORKER_BYTES + 0x4000 + 2 * THREAD_BYTES + 64 * lane
        );
        assert!(many.describe().contains("64 lanes"));
        assert!(text.contains("64 KiB for its input buffer"), "{text}");

        // Slots: the input buffer holds every slot's part, and each slot
        // has an output buffer and guard page.
        let mut slotted = request(2, 0, "tcp");
        slotted.slots = 4;
        let slotted = Need::of(&slotted, &lib);
        let lane4 = LANE_BYTES + 4 * (64 << 10) + 4 * ((1 << 20) + PAGE);
        assert_eq!(
            slotted.bytes(),
            WORKER_BYTES + 0x4000 + 2 * THREAD_BYTES + 2 * lane4
        );
        assert!(slotted.describe().contains("times its 4 slots"));

        // On shm the output counts three times.
        let shm = Need::of(&request(2, 0, "shm"), &lib);
        assert_eq!(shm.bytes() - need.bytes(), 2 * 2 * ((1 << 20) + PAGE));
        assert!(shm.describe().contains("on shm 3 times"));
    }

    #[test]
    fn too_little_memory_is_refused_with_the_figure() {
        let lib = elf(0x10);
        let need = Need::of(&request(1, 0, "tcp"), &lib).mib();
        for mib in [1, 4, 8, need as u32 - 1] {
            let (code, message) = check(&request(1, mib, "tcp"), &lib).unwrap_err();
            assert_eq!(code, ErrorCode::MemoryTooSmall);
            assert!(
                message.contains(&format!("asks for {mib} MiB")),
                "{message}"
            );
            assert!(
                message.contains(&format!("memory_mib {need} or more")),
                "{message}"
            );
        }
        // Exactly enough: nothing left to pull into.
        assert!(check(&request(1, need as u32, "tcp"), &lib).unwrap() < MIB);
        // 32 MiB more: a 32 MiB payload fits on tcp, a third of it on shm.
        let max = check(&request(1, need as u32 + 32, "tcp"), &lib).unwrap();
        assert!(max >= 32 * MIB, "{max}");
        let shm_need = Need::of(&request(1, 0, "shm"), &lib).mib() as u32;
        let max = check(&request(1, shm_need + 30, "shm"), &lib).unwrap();
        assert!((10 * MIB..=11 * MIB).contains(&max), "{max}");
    }
}
