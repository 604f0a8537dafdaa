//! What metering costs a lane, in process (provider `mem`): the clocks a
//! lane could read around each function, and the lane's own bookkeeping
//! per invocation with the clock the executor chose.
//!
//! A single read is far below what a timer resolves, so each sample times
//! a batch of [`BATCH`] operations and reports the time per operation;
//! `iters` samples per row.

use std::hint::black_box;
use std::time::Instant;

use rfaas_executor::meter::{self, TickClock};
use rfaas_executor::worker::meter::LaneMeter;
use rfaas_proto::meter::{Clock, LaneRecord, LaneState};

use crate::error::Result;
use crate::report::{Report, Row};
use crate::rows::{Ctx, RowSpec, Runner, Suite};
use crate::stats::Summary;

/// Operations timed together per sample.
pub const BATCH: u64 = 1000;

pub const CLOCK_INSTANT: &str = "clock_instant_now";
pub const CLOCK_COARSE: &str = "clock_monotonic_coarse";
pub const CLOCK_TSC: &str = "clock_tsc";
pub const METER_INVOCATION: &str = "meter_invocation";

pub const SUITE: Suite = Suite {
    rows: &[
        RowSpec {
            name: CLOCK_INSTANT,
            help: "one Instant::now() (CLOCK_MONOTONIC through the vDSO), per read (provider `mem`)",
            runner: Runner::Once(|ctx, out| clock(ctx, CLOCK_INSTANT, out)),
        },
        RowSpec {
            name: CLOCK_COARSE,
            help: "one CLOCK_MONOTONIC_COARSE read (the kernel's last tick), per read",
            runner: Runner::Once(|ctx, out| clock(ctx, CLOCK_COARSE, out)),
        },
        RowSpec {
            name: CLOCK_TSC,
            help: "one rdtsc, the lanes' clock where the kernel trusts the TSC, per read",
            runner: Runner::Once(|ctx, out| clock(ctx, CLOCK_TSC, out)),
        },
        RowSpec {
            name: METER_INVOCATION,
            help: "a lane's metering of one invocation (two clock reads and two record updates), with the clock the executor chooses here",
            runner: Runner::Once(meter_invocation),
        },
    ],
    peers: &[],
};

/// Times `op` in batches; pushes the row `name` with the time per call.
fn batches(ctx: &Ctx, name: &str, out: &mut Report, mut op: impl FnMut()) -> Result<()> {
    for _ in 0..BATCH * 10 {
        op();
    }
    let mut samples = Vec::with_capacity(ctx.iters);
    for _ in 0..ctx.iters {
        let start = Instant::now();
        for _ in 0..BATCH {
            op();
        }
        samples.push(start.elapsed().as_nanos() as u64 / BATCH);
    }
    if let Some(s) = Summary::of(&mut samples) {
        out.push(&Row::latency(name, "mem", 0, s))?;
    }
    Ok(())
}

fn clock(ctx: &Ctx, name: &str, out: &mut Report) -> Result<()> {
    match name {
        CLOCK_INSTANT => batches(ctx, name, out, || {
            black_box(Instant::now());
        }),
        CLOCK_COARSE => batches(ctx, name, out, || {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: ts is a valid out-pointer.
            unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
            black_box(ts);
        }),
        _ if meter::readable(Clock::Tsc) => batches(ctx, name, out, || {
            black_box(meter::ticks(Clock::Tsc));
        }),
        _ => Ok(()),
    }
}

fn meter_invocation(ctx: &Ctx, out: &mut Report) -> Result<()> {
    let clock = TickClock::detect().clock;
    let record: &'static LaneRecord = Box::leak(Box::default());
    let mut m = LaneMeter::new(record, clock);
    m.enter(LaneState::Hot);
    batches(ctx, METER_INVOCATION, out, || {
        m.enter_function(black_box(64));
        m.count_output(black_box(64));
        m.leave_function(LaneState::Hot);
    })
}
