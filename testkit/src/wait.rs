//! Waiting for an event instead of sleeping for a guessed time.
//!
//! A test that must see something happen (a row written, a process gone,
//! a thread asleep, a metric moved) polls the condition with [`wait_for`]
//! or [`wait_until`], which fail the test naming what was awaited and for
//! how long. [`poll_for`] is the loop under both, for a caller that turns
//! a timeout into its own error (with the last state it saw).
//!
//! The loop looks often at first (an event is usually quick) and backs
//! off to every 20 ms, so a slow machine costs polls, not failures: the
//! timeout is only the bound after which the event is taken as never
//! coming.

use std::time::{Duration, Instant};

/// How long a test waits for an event before it fails, unless it has a
/// reason to say otherwise.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// The first pause between two looks, doubled up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_micros(100);
/// The longest pause between two looks.
const MAX_PAUSE: Duration = Duration::from_millis(20);

/// Calls `f` until it gives `Some`, for at most `within`; `None` when
/// `within` passed first. `f` is called at least once, and once more at
/// the deadline.
pub fn poll_for<T>(within: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + within;
    let mut pause = FIRST_PAUSE;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        std::thread::sleep(pause.min(left));
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

/// Calls `f` until it gives `Some` and returns that; fails the test,
/// naming `what` and `within`, when it has not after `within`.
pub fn wait_for<T>(what: &str, within: Duration, f: impl FnMut() -> Option<T>) -> T {
    poll_for(within, f)
        .unwrap_or_else(|| panic!("waited {within:?} for {what}, and it did not happen"))
}

/// Waits until `done()` holds; fails the test, naming `what` and
/// `within`, when it has not after `within`.
pub fn wait_until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    wait_for(what, within, || done().then_some(()))
}

/// The state letter of a `/proc/.../stat` text (`R` running, `S` asleep,
/// ...): it follows the `)` that ends the command name, which may itself
/// hold spaces and parentheses.
fn stat_state(stat: &str) -> Option<char> {
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

/// The state letter of every thread of process `pid` (empty when it is
/// gone).
pub fn thread_states(pid: u32) -> Vec<char> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("stat")).ok())
        .filter_map(|stat| stat_state(&stat))
        .collect()
}

/// Waits until thread `tid` of process `pid` sleeps in the kernel (state
/// `S` in `/proc`): a test that must act while another thread, or another
/// process, sleeps in a blocking wait waits for that instead of guessing
/// how long it takes to fall asleep.
pub fn wait_until_asleep(pid: u32, tid: i32) {
    let path = format!("/proc/{pid}/task/{tid}/stat");
    wait_until(
        &format!("thread {tid} of process {pid} to sleep in the kernel"),
        TIMEOUT,
        || {
            let stat = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
            stat_state(&stat) == Some('S')
        },
    );
}

/// Waits until no thread of process `pid` runs or is runnable (none in
/// state `R`).
pub fn wait_until_all_asleep(pid: u32) {
    let mut last = Vec::new();
    poll_for(TIMEOUT, || {
        last = thread_states(pid);
        (!last.is_empty() && !last.contains(&'R')).then_some(())
    })
    .unwrap_or_else(|| {
        panic!("waited {TIMEOUT:?} for every thread of process {pid} to sleep; states: {last:?}")
    });
}

/// The calling thread's kernel thread id, for [`wait_until_asleep`].
pub fn thread_id() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_condition_that_comes_true_is_seen() {
        let mut looks = 0;
        let got = wait_for("the third look", TIMEOUT, || {
            looks += 1;
            (looks == 3).then_some(looks)
        });
        assert_eq!(got, 3);
    }

    #[test]
    fn a_condition_that_never_holds_fails_naming_it_and_the_wait() {
        let err = std::panic::catch_unwind(|| {
            wait_until("a flag that stays down", Duration::from_millis(30), || {
                false
            })
        })
        .expect_err("the wait must fail");
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert_eq!(
            msg,
            "waited 30ms for a flag that stays down, and it did not happen"
        );
    }

    #[test]
    fn a_thread_asleep_in_the_kernel_is_seen() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            tid_tx.send(thread_id()).unwrap();
            let _ = rx.recv();
        });
        wait_until_asleep(std::process::id(), tid_rx.recv().unwrap());
        assert!(thread_states(std::process::id()).contains(&'S'));
        drop(tx);
        t.join().unwrap();
    }

    #[test]
    fn a_command_name_with_parentheses_keeps_its_state() {
        assert_eq!(stat_state("12 (a) b) R 1 2"), Some('R'));
        assert_eq!(stat_state("no state"), None);
    }

    #[test]
    fn a_timeout_is_none_after_a_last_look() {
        let mut looks = 0;
        let got: Option<()> = poll_for(Duration::ZERO, || {
            looks += 1;
            None
        });
        assert_eq!((got, looks), (None, 1));
    }
}
