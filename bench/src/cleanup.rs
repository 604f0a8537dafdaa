//! Stops the daemons the bench started when the bench itself is stopped.
//!
//! Peers die with the bench through `PR_SET_PDEATHSIG` (see `child.rs`),
//! and an `Executord` is stopped by its `Drop` on every return and panic.
//! A signal skips both, so the daemon's pid is also kept in [`Registered`]
//! while it runs, and [`install`]'s handler sends it SIGTERM (the daemon
//! then stops its workers) before the bench dies of the same signal.

use std::io;
use std::sync::atomic::{AtomicI32, Ordering};

/// Pids to stop; 0 is a free slot.
static PIDS: [AtomicI32; 8] = [const { AtomicI32::new(0) }; 8];

/// A pid in the table; removed on drop.
#[derive(Debug)]
pub struct Registered {
    slot: Option<usize>,
}

/// Adds `pid` to the processes stopped on SIGINT, SIGTERM and SIGHUP. With
/// the table full the pid is not added (its `Drop` guard still stops it on
/// a normal exit).
pub fn register(pid: u32) -> Registered {
    let pid = pid as i32;
    let slot = PIDS.iter().position(|p| {
        p.compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    });
    Registered { slot }
}

impl Drop for Registered {
    fn drop(&mut self) {
        if let Some(slot) = self.slot {
            PIDS[slot].store(0, Ordering::Release);
        }
    }
}

/// Installs the handler for SIGINT, SIGTERM and SIGHUP.
pub fn install() -> io::Result<()> {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: sigaction is plain data; all zeroes is an empty mask and
        // no flags.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        action.sa_flags = libc::SA_RESETHAND;
        // SAFETY: `action` is initialised and the handler only makes
        // async-signal-safe calls (atomics, kill, raise).
        if unsafe { libc::sigaction(sig, &action, std::ptr::null_mut()) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

extern "C" fn on_signal(sig: libc::c_int) {
    for pid in &PIDS {
        let pid = pid.load(Ordering::Acquire);
        if pid > 0 {
            // SAFETY: kill is async-signal-safe and has no memory
            // preconditions.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
    }
    // SA_RESETHAND restored the default action: die of the same signal.
    // SAFETY: raise is async-signal-safe.
    unsafe { libc::raise(sig) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_taken_and_freed() {
        let a = register(4_000_001);
        let b = register(4_000_002);
        assert_ne!(a.slot, b.slot);
        let slot = a.slot.unwrap();
        assert_eq!(PIDS[slot].load(Ordering::Acquire), 4_000_001);
        drop(a);
        assert_eq!(PIDS[slot].load(Ordering::Acquire), 0);
    }
}
