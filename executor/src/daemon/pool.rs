//! A fixed set of threads taking jobs from one queue: the loop hands them
//! the requests that block (an allocation waits for its worker, a
//! deallocation for the worker's end).

use std::sync::mpsc;
use std::sync::{Arc, Mutex};

/// A job for a pool thread.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

/// The threads and their queue. Dropping it lets the threads end once the
/// queue is empty.
#[derive(Debug)]
pub(crate) struct Pool {
    name: &'static str,
    jobs: mpsc::Sender<Job>,
}

impl Pool {
    /// Starts `threads` threads named `name`.
    pub(crate) fn new(name: &'static str, threads: usize) -> std::io::Result<Pool> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let queue = Arc::new(Mutex::new(queue));
        for _ in 0..threads.max(1) {
            let queue = Arc::clone(&queue);
            std::thread::Builder::new()
                .name(name.to_owned())
                .spawn(move || loop {
                    let job = queue.lock().unwrap_or_else(|e| e.into_inner()).recv();
                    let Ok(job) = job else { return };
                    // A panicking job must not take the thread with it; its
                    // own guards report the request as done.
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                        tracing::error!(pool = name, "a request panicked");
                    }
                })?;
        }
        Ok(Pool { name, jobs })
    }

    /// Queues `job`.
    pub(crate) fn run(&self, job: Job) {
        if self.jobs.send(job).is_err() {
            tracing::error!(pool = self.name, "the request threads are gone");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_run_on_the_pool_and_a_panic_spares_the_thread() {
        let pool = Pool::new("test-pool", 1).unwrap();
        let (tx, rx) = mpsc::channel();
        pool.run(Box::new(|| panic!("a bad request")));
        pool.run(Box::new(move || {
            tx.send(std::thread::current().name().map(str::to_owned))
                .unwrap()
        }));
        assert_eq!(rx.recv().unwrap().as_deref(), Some("test-pool"));
    }
}
