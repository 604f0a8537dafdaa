//! A value one thread at a time works on, taken without waiting.
//!
//! [`Claimable::try_claim`] either hands out the value or says that another
//! thread has it; nobody ever waits or spins for it. A tcp endpoint keeps
//! its connection state in one: whoever claims it (the application posting,
//! a poller, the progress thread) drives the connection, and the others
//! hand their work to it or skip the endpoint (see `super::endpoint`).

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

/// A value behind an atomic claim.
pub(super) struct Claimable<T> {
    claimed: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a `Claim`, and the
// compare-exchange in `try_claim` lets at most one exist at a time, so the
// value is never touched from two threads at once; `T: Send` lets it be
// touched from whichever thread holds the claim.
unsafe impl<T: Send> Sync for Claimable<T> {}

impl<T> Claimable<T> {
    pub(super) fn new(value: T) -> Claimable<T> {
        Claimable {
            claimed: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// The value, unless another thread holds it. Never waits. Hot path.
    #[inline]
    pub(super) fn try_claim(&self) -> Option<Claim<'_, T>> {
        // Acquire: see everything the previous holder did before letting go.
        self.claimed
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        Some(Claim { owner: self })
    }
}

/// Exclusive access to a [`Claimable`]'s value; dropping it lets go.
pub(super) struct Claim<'a, T> {
    owner: &'a Claimable<T>,
}

impl<T> Deref for Claim<'_, T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this claim is the only one (see the Sync impl), and it
        // lives no longer than the value.
        unsafe { &*self.owner.value.get() }
    }
}

impl<T> DerefMut for Claim<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in deref; &mut self makes this the only reference.
        unsafe { &mut *self.owner.value.get() }
    }
}

impl<T> Drop for Claim<'_, T> {
    #[inline]
    fn drop(&mut self) {
        // Release: the next holder sees what this one did.
        self.owner.claimed.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_claim_refuses_a_second_until_dropped() {
        let cell = Claimable::new(1);
        let mut first = cell.try_claim().expect("free at first");
        assert!(cell.try_claim().is_none(), "claimed twice");
        *first += 1;
        drop(first);
        assert_eq!(*cell.try_claim().expect("free again"), 2);
    }

    #[test]
    fn claims_exclude_each_other_across_threads() {
        // Each successful claim does a non-atomic read-modify-write; if two
        // claims overlapped, increments would be lost.
        const THREADS: usize = 4;
        const CLAIMS: u64 = 20_000;
        let cell = Claimable::new(0u64);
        std::thread::scope(|s| {
            for _ in 0..THREADS {
                s.spawn(|| {
                    let mut done = 0;
                    while done < CLAIMS {
                        if let Some(mut v) = cell.try_claim() {
                            let seen = *v;
                            std::hint::black_box(&seen);
                            *v = seen + 1;
                            done += 1;
                        }
                    }
                });
            }
        });
        assert_eq!(*cell.try_claim().unwrap(), THREADS as u64 * CLAIMS);
    }
}
