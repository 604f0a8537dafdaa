//! What a client and an allocation are asked to be: [`ClientOptions`] and
//! [`AllocationSpec`].

use std::sync::Arc;
use std::time::Duration;

pub use rfaas_proto::control::client::Mode;

/// How a [`Client`](crate::Client) connects and waits.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Longest a TCP connect to an executor, or a fabric connect to a
    /// worker, may take.
    pub connect_timeout: Duration,
    /// Longest an executor may take to answer an allocation (it starts or
    /// takes a worker and loads the library meanwhile).
    pub allocation_timeout: Duration,
    /// Longest a blocking wait for an invocation may take; `None` waits as
    /// long as the worker lives (the executor's deadline bounds a function).
    pub invocation_timeout: Option<Duration>,
    /// The fabric provider: `tcp`, `shm` or `verbs:<device>`.
    pub provider: String,
    /// How long the client tries to reach an executor again after its
    /// control connection ended, to take its allocations up on a new one
    /// (the executor restarted and adopted their workers); invocations go
    /// on meanwhile. After it the allocations are lost
    /// (`Error::ExecutorLost`).
    pub reattach_grace: Duration,
}

impl Default for ClientOptions {
    /// 10 s to connect, 60 s to allocate, no invocation timeout, 30 s to
    /// reattach, and the provider named by `RFAAS_PROVIDER` (or `tcp`).
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_secs(10),
            allocation_timeout: Duration::from_secs(60),
            invocation_timeout: None,
            reattach_grace: Duration::from_secs(30),
            provider: std::env::var("RFAAS_PROVIDER")
                .ok()
                .filter(|p| !p.is_empty())
                .unwrap_or_else(|| "tcp".into()),
        }
    }
}

impl ClientOptions {
    /// The defaults with `provider`.
    pub fn with_provider(provider: &str) -> ClientOptions {
        ClientOptions {
            provider: provider.to_owned(),
            ..ClientOptions::default()
        }
    }
}

/// What to allocate: a library, the functions to call, and the worker's
/// shape. Built with [`AllocationSpec::new`] and the builder methods.
#[derive(Debug, Clone)]
pub struct AllocationSpec {
    pub(crate) library: Arc<[u8]>,
    pub(crate) library_name: String,
    pub(crate) functions: Vec<String>,
    pub(crate) cores: u16,
    pub(crate) lanes: u16,
    pub(crate) slots: u16,
    pub(crate) memory_mib: u32,
    pub(crate) mode: Mode,
    pub(crate) hot_timeout: Duration,
    pub(crate) input_capacity: u32,
    pub(crate) output_capacity: u32,
    pub(crate) deadline: Duration,
    pub(crate) read_only_input: bool,
    pub(crate) fallback_executors: Vec<(String, String)>,
}

impl AllocationSpec {
    /// The library's bytes (an ELF shared object) and the functions to
    /// call, by symbol name; their order is the function table.
    ///
    /// Defaults: 1 core, a lane per core, 256 MiB, [`Mode::HotThenWarm`] with a 5 ms
    /// hot period, 64 KiB input capacity per lane (bigger payloads are
    /// pulled by the worker), 1 MiB output capacity, the executor's default
    /// deadline.
    pub fn new(library: impl Into<Arc<[u8]>>, functions: &[&str]) -> AllocationSpec {
        AllocationSpec {
            library: library.into(),
            library_name: "library.so".into(),
            functions: functions.iter().map(|f| (*f).to_owned()).collect(),
            cores: 1,
            lanes: 0,
            slots: 0,
            memory_mib: 256,
            mode: Mode::HotThenWarm,
            hot_timeout: Duration::from_millis(5),
            input_capacity: 64 << 10,
            output_capacity: 1 << 20,
            deadline: Duration::ZERO,
            read_only_input: false,
            fallback_executors: Vec::new(),
        }
    }

    /// Worker threads, one core each (of the lease's): how many functions
    /// run at once.
    pub fn cores(mut self, cores: u16) -> Self {
        self.cores = cores;
        self
    }

    /// Lanes: connections to the worker, one invocation in flight on each,
    /// so how many calls this allocation keeps in flight at once. The
    /// worker's [`cores`](Self::cores) threads serve them all (lane `i` on
    /// thread `i mod cores`); many lanes on few cores keep every core busy
    /// with short functions. 0 (the default) means one lane per core. Each
    /// lane holds an input and an output buffer in the worker's memory.
    /// An executor older than lanes gives one per core: see
    /// [`Allocation::lanes`](crate::Allocation::lanes).
    pub fn lanes(mut self, lanes: u16) -> Self {
        self.lanes = lanes;
        self
    }

    /// Slots per lane: invocations one lane holds in flight at once, sent
    /// and collected by one thread through a
    /// [`Pipeline`](crate::Pipeline). A power of two, at most 64; 0 (the
    /// default) means one. Each slot holds an input and an output buffer in
    /// the worker's memory (counted like a lane's). An executor older than
    /// slots gives one: see [`Allocation::slots`](crate::Allocation::slots).
    pub fn slots(mut self, slots: u16) -> Self {
        self.slots = slots;
        self
    }

    /// The lanes asked for: [`lanes`](Self::lanes), or one per core.
    pub(crate) fn lane_count(&self) -> u16 {
        if self.lanes == 0 {
            self.cores
        } else {
            self.lanes
        }
    }

    /// The worker's memory limit, MiB.
    pub fn memory_mib(mut self, mib: u32) -> Self {
        self.memory_mib = mib;
        self
    }

    /// How the worker's lanes wait for requests.
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// How long a [`Mode::HotThenWarm`] lane polls after an invocation.
    pub fn hot_timeout(mut self, hot: Duration) -> Self {
        self.hot_timeout = hot;
        self
    }

    /// Bytes of each lane's input buffer at the worker, the 32-byte header
    /// included: payloads up to this minus 32 travel with the request.
    pub fn input_capacity(mut self, bytes: u32) -> Self {
        self.input_capacity = bytes;
        self
    }

    /// Bytes a function may write per invocation.
    pub fn output_capacity(mut self, bytes: u32) -> Self {
        self.output_capacity = bytes;
        self
    }

    /// Longest a function may run (millisecond resolution); zero means the
    /// executor's default.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// Promises that the functions never write to their input. On the shm
    /// provider a payload bigger than the input capacity is then read by
    /// the function in place, from this client's buffer, instead of being
    /// copied to the worker first; the mapping is read-only, so a function
    /// that writes to its input faults (a worker crash). Other providers
    /// copy as before. Off by default: rFaaS functions may write to their
    /// input.
    pub fn read_only_input(mut self, read_only: bool) -> Self {
        self.read_only_input = read_only;
        self
    }

    /// A name for the library in the executor's logs.
    pub fn library_name(mut self, name: &str) -> Self {
        self.library_name = name.to_owned();
        self
    }

    /// Another executor (control address) and a lease token for its node,
    /// for [`Allocation::invoke_retrying`](crate::Allocation::invoke_retrying)
    /// to move to when the current one is lost or full. Tried in the order
    /// added.
    pub fn fallback_executor(mut self, executor: &str, token: &str) -> Self {
        self.fallback_executors
            .push((executor.to_owned(), token.to_owned()));
        self
    }

    /// A lease request that fits this spec: its cores on one node and its
    /// memory, for `duration_s` seconds.
    pub fn lease_request(&self, duration_s: u64) -> crate::lease::LeaseRequest {
        crate::lease::LeaseRequest {
            cores: u32::from(self.cores),
            memory_mib: u64::from(self.memory_mib),
            duration_s,
            min_cores: None,
            nodes: Vec::new(),
        }
    }

    /// The function names, in table order.
    pub fn functions(&self) -> &[String] {
        &self.functions
    }

    /// Refuses a `memory_mib` that cannot hold even what the client knows
    /// the worker will: every lane's input and output buffers, and the
    /// library. (The executor adds the worker's own needs and refuses
    /// `memory_too_small` with the whole figure; docs/executor.md.)
    pub(crate) fn check_memory(&self) -> crate::Result<()> {
        const MIB: u64 = 1 << 20;
        let lanes = u64::from(self.lane_count().max(1)) * u64::from(self.slots.max(1));
        let buffers = lanes * (u64::from(self.input_capacity) + u64::from(self.output_capacity));
        let known = buffers + self.library.len() as u64;
        if u64::from(self.memory_mib) * MIB >= known {
            return Ok(());
        }
        Err(crate::Error::InvalidArgument(format!(
            "memory_mib {} cannot hold even this allocation's buffers and library: {} lane{} × \
             ({} B input + {} B output) + {} B of library = {} MiB, before the worker's own \
             memory; ask for more (docs/executor.md, \"Memory\", says how the executor counts)",
            self.memory_mib,
            lanes,
            if lanes == 1 { "" } else { "s" },
            self.input_capacity,
            self.output_capacity,
            self.library.len(),
            known.div_ceil(MIB),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_below_the_buffers_and_library_is_refused_with_the_figure() {
        let spec = AllocationSpec::new(vec![0u8; 100 << 10], &["f"]).cores(2);
        // 2 × (64 KiB + 1 MiB) + 100 KiB: just over 2 MiB.
        let err = spec.clone().memory_mib(2).check_memory().unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, crate::Error::InvalidArgument(_)), "{err:?}");
        assert!(text.contains("memory_mib 2 "), "{text}");
        assert!(
            text.contains("2 lanes × (65536 B input + 1048576 B output)"),
            "{text}"
        );
        assert!(text.contains("= 3 MiB"), "{text}");
        assert!(spec.memory_mib(3).check_memory().is_ok());
    }
}
