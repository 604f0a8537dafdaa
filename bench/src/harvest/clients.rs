//! The offloading clients of the run with the plugin: threads of the
//! bench, each a user of the manager (a user credential minted by the
//! admin), that lease one core, allocate the `echo` function there in
//! warm mode and call it, a pause between calls, until stopped. When a
//! Slurm job takes their node back, the client library moves them
//! (`retry_elsewhere`); when no node lends a core, they wait and lease
//! again. Each counts the calls answered with the echo.
//!
//! Warm mode (the worker sleeps between calls) and the pause keep them
//! from taking a CPU of their own: the machine has two.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rfaas_client::lease::{LeaseRequest, Managers};
use rfaas_client::{AllocationSpec, Client, ClientOptions, LeaseOptions, Mode};

/// What the clients do.
#[derive(Debug, Clone)]
pub struct ClientSettings {
    pub count: usize,
    /// Between one answer and the next call.
    pub pause: Duration,
    /// Payload of each call.
    pub bytes: usize,
    /// The function library (exports `echo`).
    pub library: Arc<[u8]>,
}

/// What one client did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// Calls answered with the echo.
    pub calls: u64,
    /// Calls answered with something else.
    pub wrong: u64,
    /// Times the client found itself on another node after a call.
    pub moves: u64,
    /// Times no node lent a core within the lease deadline (Slurm's jobs
    /// held every one): the client asked again.
    pub waits: u64,
    /// Leases, allocations or calls that failed otherwise, and the last
    /// failure.
    pub errors: u64,
    pub last_error: Option<String>,
}

impl Tally {
    fn add(&mut self, other: &Tally) {
        self.calls += other.calls;
        self.wrong += other.wrong;
        self.moves += other.moves;
        self.waits += other.waits;
        self.errors += other.errors;
        if other.last_error.is_some() {
            self.last_error.clone_from(&other.last_error);
        }
    }
}

/// Running clients; stopped (and their allocations ended) by
/// [`Clients::finish`] or on drop.
#[derive(Debug)]
pub struct Clients {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Tally>>,
}

/// How long a client waits for a lease while no node lends a core, before
/// it counts an error and asks again: also how soon it notices a stop.
const LEASE_DEADLINE: Duration = Duration::from_secs(5);

impl Clients {
    /// Starts `settings.count` clients on the managers at `url`, with the
    /// user credential `credential`.
    pub fn start(
        settings: &ClientSettings,
        url: &str,
        credential: &str,
    ) -> Result<Clients, String> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut clients = Clients {
            stop,
            threads: Vec::new(),
        };
        for i in 0..settings.count {
            let managers = Managers::new([url], credential)
                .map_err(|e| format!("the manager's URL {url}: {e}"))?;
            let settings = settings.clone();
            let stop = Arc::clone(&clients.stop);
            let thread = std::thread::Builder::new()
                .name(format!("harvest-client-{i}"))
                .spawn(move || call_until_stopped(&managers, &settings, &stop))
                .map_err(|e| format!("could not start a client thread: {e}"))?;
            clients.threads.push(thread);
        }
        Ok(clients)
    }

    /// Stops every client and adds up what they did.
    pub fn finish(mut self) -> Tally {
        self.stop.store(true, Ordering::Release);
        let mut total = Tally::default();
        for t in self.threads.drain(..) {
            match t.join() {
                Ok(tally) => total.add(&tally),
                Err(_) => {
                    total.errors += 1;
                    total.last_error = Some("a client thread panicked".into());
                }
            }
        }
        total
    }
}

impl Drop for Clients {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn call_until_stopped(managers: &Managers, settings: &ClientSettings, stop: &AtomicBool) -> Tally {
    let client = Client::new(ClientOptions::with_provider("tcp"));
    let size = (settings.bytes as u32).next_multiple_of(4096);
    let spec = AllocationSpec::new(Arc::clone(&settings.library), &["echo"])
        .cores(1)
        .memory_mib(256)
        .mode(Mode::Warm)
        .input_capacity(size)
        .output_capacity(size);
    let request = LeaseRequest {
        cores: 1,
        memory_mib: 256,
        duration_s: 60,
        min_cores: None,
        nodes: Vec::new(),
    };
    let options = LeaseOptions::default()
        .retry_elsewhere(true)
        .deadline(LEASE_DEADLINE);
    let mut tally = Tally::default();
    let fail = |tally: &mut Tally, what: &str, e: rfaas_client::Error| {
        match &e {
            rfaas_client::Error::Manager { kind, .. } if kind == "no_capacity" => tally.waits += 1,
            _ => {
                tally.errors += 1;
                tally.last_error = Some(format!("{what}: {e}"));
            }
        }
        pause(stop, Duration::from_millis(200));
    };
    while !stop.load(Ordering::Acquire) {
        let mut alloc = match managers.allocate(&client, &request, &spec, &options) {
            Ok(a) => a,
            Err(e) => {
                fail(&mut tally, "lease and allocate", e);
                continue;
            }
        };
        let buffers = alloc.function("echo").and_then(|f| {
            Ok((
                f,
                alloc.buffer::<u8>(settings.bytes)?,
                alloc.buffer::<u8>(settings.bytes)?,
            ))
        });
        let (echo, mut input, mut output) = match buffers {
            Ok(b) => b,
            Err(e) => {
                fail(&mut tally, "set up the allocation", e);
                continue;
            }
        };
        let mut node = alloc.node();
        while !stop.load(Ordering::Acquire) {
            let stamp = tally.calls.to_le_bytes();
            // SAFETY: no call is in flight (invoke_retrying returns once its
            // call ended), and the worker runs the echo of the library the
            // bench was given, which writes only the output of its own
            // call. In place, so the load adds no copy of the payload.
            for (i, b) in unsafe { input.as_mut_slice() }.iter_mut().enumerate() {
                *b = stamp[i % 8] ^ (i as u8);
            }
            let answered = alloc.invoke_retrying(echo, &input, settings.bytes, &mut output, 5);
            // SAFETY: as above: the call ended, nothing writes either buffer.
            let echoed = || unsafe { output.as_slice() == input.as_slice() };
            match answered {
                Ok(n) if n == settings.bytes && echoed() => {
                    tally.calls += 1;
                    let now_on = alloc.node();
                    if now_on != node {
                        tally.moves += 1;
                        node = now_on;
                    }
                }
                Ok(_) => tally.wrong += 1,
                Err(e) => {
                    fail(&mut tally, &format!("call echo on {node}"), e);
                    break;
                }
            }
            pause(stop, settings.pause);
        }
        let _ = alloc.deallocate();
    }
    tally
}

/// Sleeps `d`, or less when stopped meanwhile.
fn pause(stop: &AtomicBool, d: Duration) {
    let until = Instant::now() + d;
    loop {
        let now = Instant::now();
        if now >= until || stop.load(Ordering::Acquire) {
            return;
        }
        std::thread::sleep((until - now).min(Duration::from_millis(50)));
    }
}
