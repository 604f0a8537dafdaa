//! [`rfaas_alloc_options`] and [`rfaas_mode`]: the shape of an allocation,
//! as C fills it in, turned into an [`AllocationSpec`].

use std::time::Duration;

use ::rfaas_client::{AllocationSpec, Mode};

use crate::ffi::Failure;

/// How the worker's threads wait for requests.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum rfaas_mode {
    /// Busy-poll: the lowest latency, one whole core per lane.
    RFAAS_MODE_HOT = 0,
    /// Sleep in the kernel until a request comes.
    RFAAS_MODE_WARM = 1,
    /// Busy-poll for `hot_timeout_us` after each invocation, then sleep.
    RFAAS_MODE_HOT_THEN_WARM = 2,
}

/// The shape of an allocation. Start from `rfaas_alloc_options_default()`
/// and change the fields you need. `rfaas_allocate*` refuses a value out of
/// range (`RFAAS_ERR_INVALID_ARGUMENT`) before connecting; the executor
/// refuses what the lease or its own limits do not allow.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct rfaas_alloc_options {
    /// Worker threads, one core each: how many functions run at once. 1 to
    /// 65535. Default 1.
    pub cores: u32,
    /// The worker's memory limit, MiB. Default 256.
    pub memory_mib: u32,
    /// How the worker's threads wait. Default `RFAAS_MODE_HOT_THEN_WARM`.
    pub mode: rfaas_mode,
    /// For `RFAAS_MODE_HOT_THEN_WARM`: how long a thread polls after an
    /// invocation, microseconds. Default 5000.
    pub hot_timeout_us: u64,
    /// Bytes of each lane's input buffer at the worker, a 32-byte header
    /// included (so at least 32); bigger inputs are pulled by the worker in
    /// chunks. Default 65536.
    pub input_capacity: u32,
    /// Bytes a function may write per invocation, at least 1. Default 1 MiB.
    pub output_capacity: u32,
    /// Longest a function may run, milliseconds; 0 takes the executor's
    /// default. Default 0.
    pub deadline_ms: u64,
    /// 1: the functions never write to their input. On the shm provider,
    /// inputs bigger than the input capacity are then read in place from
    /// the caller's buffer (read-only: a function that writes to it crashes
    /// the worker) instead of copied. 0 or 1. Default 0.
    pub read_only_input: u32,
    /// Lanes: connections to the worker, each taken by one `rfaas_submit`
    /// or one `rfaas_pipeline`; the `cores` threads serve them all. 0 to
    /// 65535; 0 means one per core. Default 0.
    pub lanes: u32,
    /// Slots per lane: the calls one `rfaas_pipeline` keeps in flight. A
    /// power of two up to 64; 0 means one. Each slot holds an input and an
    /// output buffer in the worker's memory. Default 0.
    pub slots: u32,
}

/// The same layout with `mode` as a plain integer: C may store any value
/// there, and reading an out-of-range value as `rfaas_mode` would be
/// undefined behaviour.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawOptions {
    cores: u32,
    memory_mib: u32,
    mode: u32,
    hot_timeout_us: u64,
    input_capacity: u32,
    output_capacity: u32,
    deadline_ms: u64,
    read_only_input: u32,
    lanes: u32,
    slots: u32,
}

const _: () = {
    assert!(std::mem::size_of::<RawOptions>() == std::mem::size_of::<rfaas_alloc_options>());
    assert!(std::mem::align_of::<RawOptions>() == std::mem::align_of::<rfaas_alloc_options>());
};

/// The defaults: 1 core, a lane per core, one slot per lane, 256 MiB,
/// hot-then-warm with 5 ms of polling, 64 KiB input capacity, 1 MiB output
/// capacity, the executor's deadline.
#[no_mangle]
pub extern "C" fn rfaas_alloc_options_default() -> rfaas_alloc_options {
    rfaas_alloc_options {
        cores: 1,
        memory_mib: 256,
        mode: rfaas_mode::RFAAS_MODE_HOT_THEN_WARM,
        hot_timeout_us: 5_000,
        input_capacity: 64 << 10,
        output_capacity: 1 << 20,
        deadline_ms: 0,
        read_only_input: 0,
        lanes: 0,
        slots: 0,
    }
}

/// Reads C's options (NULL: the defaults) and applies them to `spec`.
///
/// # Safety
///
/// `opts` is NULL or points to a readable `rfaas_alloc_options`.
pub(crate) unsafe fn apply(
    call: &str,
    opts: *const rfaas_alloc_options,
    spec: AllocationSpec,
) -> Result<AllocationSpec, Failure> {
    let raw = if opts.is_null() {
        let d = rfaas_alloc_options_default();
        RawOptions {
            cores: d.cores,
            memory_mib: d.memory_mib,
            mode: d.mode as u32,
            hot_timeout_us: d.hot_timeout_us,
            input_capacity: d.input_capacity,
            output_capacity: d.output_capacity,
            deadline_ms: d.deadline_ms,
            read_only_input: d.read_only_input,
            lanes: d.lanes,
            slots: d.slots,
        }
    } else {
        // SAFETY: the caller promises a readable rfaas_alloc_options, which
        // has RawOptions' layout (checked above); every bit pattern is a
        // valid RawOptions.
        unsafe { opts.cast::<RawOptions>().read_unaligned() }
    };
    let mode = match raw.mode {
        0 => Mode::Hot,
        1 => Mode::Warm,
        2 => Mode::HotThenWarm,
        m => {
            return Err(Failure::invalid(
                call,
                format!("options.mode is {m}; use RFAAS_MODE_HOT, RFAAS_MODE_WARM or RFAAS_MODE_HOT_THEN_WARM"),
            ))
        }
    };
    let cores = u16::try_from(raw.cores)
        .ok()
        .filter(|&c| c > 0)
        .ok_or_else(|| {
            Failure::invalid(
                call,
                format!("options.cores is {}; ask for 1 to 65535", raw.cores),
            )
        })?;
    let header = rfaas_proto::InvocationHeader::LEN as u32;
    if raw.input_capacity < header {
        return Err(Failure::invalid(
            call,
            format!(
                "options.input_capacity is {}; it holds the {header}-byte request header, so give it at least {header}",
                raw.input_capacity
            ),
        ));
    }
    if raw.output_capacity == 0 {
        return Err(Failure::invalid(
            call,
            "options.output_capacity is 0, so no function could answer; give it the most bytes a function writes",
        ));
    }
    let read_only_input = match raw.read_only_input {
        0 => false,
        1 => true,
        v => {
            return Err(Failure::invalid(
                call,
                format!("options.read_only_input is {v}; use 0 or 1"),
            ))
        }
    };
    let lanes = u16::try_from(raw.lanes).map_err(|_| {
        Failure::invalid(
            call,
            format!(
                "options.lanes is {}; ask for 0 (one per core) to 65535",
                raw.lanes
            ),
        )
    })?;
    let slots = u16::try_from(raw.slots)
        .ok()
        .filter(|&s| rfaas_proto::control::client::slots_refusal(s).is_none())
        .ok_or_else(|| {
            Failure::invalid(
                call,
                format!(
                    "options.slots is {}; use 0 or a power of two up to {}",
                    raw.slots,
                    rfaas_proto::control::client::MAX_SLOTS
                ),
            )
        })?;
    Ok(spec
        .lanes(lanes)
        .slots(slots)
        .read_only_input(read_only_input)
        .cores(cores)
        .memory_mib(raw.memory_mib)
        .mode(mode)
        .hot_timeout(Duration::from_micros(raw.hot_timeout_us))
        .input_capacity(raw.input_capacity)
        .output_capacity(raw.output_capacity)
        .deadline(Duration::from_millis(raw.deadline_ms)))
}
