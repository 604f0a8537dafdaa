//! [`Client`]: the fabric, the cached control connections, and allocation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rfaas_fabric::{
    Access, Completion, CompletionQueue, Domain, Endpoint, EndpointOptions, Fabric, MemoryRegion,
    Opcode, ProviderKind, RemoteAddr,
};
use rfaas_proto::control::client::{AllocateRequest, Descriptor};
use rfaas_proto::control::{ErrorCode, Frame};
use rfaas_proto::hello::{LaneHello, LaneKey, LANE_HELLO_IMM};
use rfaas_proto::{InvocationHeader, MAX_FUNCTIONS};

use crate::allocation::{Allocation, ColdStart, Parts};
use crate::control::{lock, ControlConn, Fate, Reply};
use crate::error::{Error, Result};
use crate::lane::{cq_depth, endpoint_depth, Lane};
use crate::spec::{AllocationSpec, ClientOptions};
use rfaas_proto::text::count;

/// The first pause before asking again when an ending allocation of the
/// same lease still holds its cores (`allocation_ending`); it doubles up
/// to [`ENDING_MAX_PAUSE`], within `allocation_timeout` in all.
const ENDING_FIRST_PAUSE: Duration = Duration::from_millis(5);

/// The longest pause between such requests.
const ENDING_MAX_PAUSE: Duration = Duration::from_millis(100);

/// The entry point: opens the fabric on first use and keeps one control
/// connection per executor, shared by every allocation on it. Cheap to
/// clone; clones share connections.
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<ClientInner>,
}

#[derive(Debug)]
struct ClientInner {
    opts: ClientOptions,
    conns: Mutex<HashMap<String, Arc<ControlConn>>>,
    fabric: Mutex<Option<Arc<Fabric>>>,
}

impl Client {
    /// A client with `opts`. Connects nothing yet.
    pub fn new(opts: ClientOptions) -> Client {
        Client {
            inner: Arc::new(ClientInner {
                opts,
                conns: Mutex::new(HashMap::new()),
                fabric: Mutex::new(None),
            }),
        }
    }

    /// The options it was made with.
    pub fn options(&self) -> &ClientOptions {
        &self.inner.opts
    }

    /// Allocates a worker on the executor at `executor` (its control
    /// address, `host:port`, or `tls://host:port` for a control port that
    /// speaks TLS, as [`NodeLease::executor`](rfaas_proto::manager::NodeLease::executor)
    /// gives it) under the lease `token`, loads `spec`'s library
    /// there and connects its lanes. While an ending allocation of the same
    /// lease still holds its cores there (`allocation_ending`: a crashed
    /// worker the executor has not reaped yet), it asks again after a short
    /// pause, up to [`ClientOptions::allocation_timeout`](crate::ClientOptions::allocation_timeout).
    pub fn allocate(
        &self,
        executor: &str,
        token: &str,
        spec: &AllocationSpec,
    ) -> Result<Allocation> {
        let executors: Vec<(String, String)> =
            std::iter::once((executor.to_owned(), token.to_owned()))
                .chain(spec.fallback_executors.iter().cloned())
                .collect();
        self.allocate_in(executors.into(), 0, spec, None)
    }

    /// Allocates on `executors[target]`; with `domain`, the lanes join it
    /// (a re-allocation keeps its buffers).
    pub(crate) fn allocate_in(
        &self,
        executors: Arc<[(String, String)]>,
        target: usize,
        spec: &AllocationSpec,
        domain: Option<Arc<Domain>>,
    ) -> Result<Allocation> {
        let started = Instant::now();
        let (executor, token) = &executors[target];
        self.check(spec)?;
        spec.check_memory()?;
        let fabric = self.fabric()?;
        let (conn, connect_control) = self.conn(executor)?;
        let mut req = AllocateRequest {
            request_id: 0,
            token: token.clone(),
            cores: spec.cores,
            memory_mib: spec.memory_mib,
            mode: spec.mode,
            hot_timeout_us: u64::try_from(spec.hot_timeout.as_micros()).unwrap_or(u64::MAX),
            input_capacity: spec.input_capacity,
            output_capacity: spec.output_capacity,
            deadline_ms: deadline_ms(spec.deadline),
            functions: spec.functions.clone(),
            library_name: spec.library_name.clone(),
            provider: self.inner.opts.provider.clone(),
            read_only_input: spec.read_only_input,
            lanes: spec.lanes,
            slots: spec.slots,
        };
        let timeout = self.inner.opts.allocation_timeout;
        let mut pause = ENDING_FIRST_PAUSE;
        let (ok, fate, round_trip) = loop {
            req.request_id = conn.next_request_id();
            let frame = Frame::new(&req, spec.library.to_vec());
            let sent = Instant::now();
            match conn.request(&frame, req.request_id, timeout)? {
                Reply::Allocated(ok, fate) => break (*ok, fate, sent.elapsed()),
                // The lease's cores are still held by an allocation of it
                // that is ending (a crashed worker not yet reaped): they
                // are free in a moment.
                Reply::Refused(e)
                    if e.code == ErrorCode::AllocationEnding
                        && started.elapsed() + pause < timeout =>
                {
                    tracing::debug!(executor = %executor, message = %e.message, ?pause, "the lease's cores are still held by an ending allocation; allocating again shortly");
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(ENDING_MAX_PAUSE);
                }
                Reply::Refused(e) => {
                    return Err(Error::Refused {
                        code: e.code,
                        message: e.message,
                    })
                }
                Reply::Deallocated | Reply::Renewed(_) => {
                    return Err(Error::Protocol(
                        "the executor answered an AllocateRequest with another request's reply"
                            .into(),
                    ))
                }
            }
        };
        if ok.lanes.is_empty() || ok.functions != spec.functions {
            conn.deallocate_nowait(ok.allocation_id);
            return Err(Error::Protocol(format!(
                "AllocateOk has {} lanes and the function table {:?}; expected at least one lane and {:?}",
                ok.lanes.len(),
                ok.functions,
                spec.functions
            )));
        }
        let connecting = Instant::now();
        let domain = match domain {
            Some(d) => d,
            None => Arc::new(fabric.domain()?),
        };
        let lanes = match self.connect_lanes(&fabric, &domain, &ok, &fate) {
            Ok(lanes) => lanes,
            Err(e) => {
                conn.deallocate_nowait(ok.allocation_id);
                return Err(e);
            }
        };
        let connect_lanes = connecting.elapsed();
        let ns = Duration::from_nanos;
        let cold_start = ColdStart {
            connect_control,
            round_trip,
            validate: ns(ok.phases.validate_ns),
            worker: ns(ok.phases.worker_ns),
            load: ns(ok.phases.load_ns),
            listen: ns(ok.phases.listen_ns),
            connect_lanes,
            total: started.elapsed(),
            pooled: ok.pooled,
        };
        tracing::debug!(executor = %executor, allocation = ok.allocation_id, lanes = lanes.len(), ?cold_start, "allocated");
        Ok(Allocation::from_parts(Parts {
            client: self.clone(),
            executors,
            target,
            spec: spec.clone(),
            conn,
            ok,
            fate,
            lanes,
            domain,
            cold_start,
        }))
    }

    /// Refuses, before connecting anything, what no executor would take.
    fn check(&self, spec: &AllocationSpec) -> Result<()> {
        let invalid = |m: String| Err(Error::InvalidArgument(m));
        if spec.functions.is_empty() || spec.functions.len() > usize::from(MAX_FUNCTIONS) {
            return invalid(format!(
                "an allocation names 1 to {MAX_FUNCTIONS} functions; this one names {}",
                spec.functions.len()
            ));
        }
        if (spec.input_capacity as usize) < InvocationHeader::LEN {
            return invalid(format!(
                "the input capacity is {}, less than the {}-byte request header it holds; give AllocationSpec::input_capacity at least {}",
                count(spec.input_capacity, "byte"),
                InvocationHeader::LEN,
                InvocationHeader::LEN
            ));
        }
        if spec.output_capacity == 0 {
            return invalid(
                "the output capacity is 0 bytes, so no function could answer; give AllocationSpec::output_capacity the most a function writes".into(),
            );
        }
        if let Some(why) = rfaas_proto::control::client::slots_refusal(spec.slots) {
            return invalid(format!("AllocationSpec::slots: {why}"));
        }
        if let Err(e) = self.inner.opts.provider.parse::<ProviderKind>() {
            return invalid(format!("ClientOptions::provider: {e}"));
        }
        Ok(())
    }

    /// One endpoint per lane, in lane order.
    fn connect_lanes(
        &self,
        fabric: &Fabric,
        domain: &Arc<Domain>,
        ok: &rfaas_proto::control::client::AllocateOk,
        fate: &Arc<Fate>,
    ) -> Result<Box<[Arc<Lane>]>> {
        // An older executor says nothing of slots: one.
        let slots = ok.slots.max(1);
        if !slots.is_power_of_two() || (slots > 1 && ok.slot_stride < ok.lanes[0].len) {
            return Err(Error::Protocol(format!(
                "the executor's AllocateOk gives {slots} slots {} bytes apart for {}-byte requests",
                ok.slot_stride, ok.lanes[0].len
            )));
        }
        let opts = EndpointOptions {
            send_depth: endpoint_depth(slots),
            recv_depth: endpoint_depth(slots),
            connect_timeout: self.inner.opts.connect_timeout,
            ..EndpointOptions::default()
        };
        let key = LaneKey::from_hex(&ok.lane_key)
            .map_err(|e| Error::Protocol(format!("the executor's AllocateOk: {e}")))?;
        let mut lanes = Vec::with_capacity(ok.lanes.len());
        for (i, remote) in ok.lanes.iter().enumerate() {
            if (remote.len as usize) < InvocationHeader::LEN {
                return Err(Error::Protocol(format!(
                    "lane {i}'s input buffer is {}, less than a request header",
                    count(remote.len, "byte")
                )));
            }
            let mut cq = fabric.completion_queue(cq_depth(slots))?;
            let endpoint = domain.connect(&ok.fabric_addr, &mut cq, &opts)?;
            let mut header = domain.register(InvocationHeader::LEN, Access::LOCAL)?;
            let hello = LaneHello {
                lane: i as u32,
                key,
            };
            self.say_hello(&endpoint, &mut cq, &mut header, remote, hello)?;
            lanes.push(Arc::new(Lane::new(
                i,
                endpoint,
                cq,
                header,
                *remote,
                (slots, ok.slot_stride),
                Arc::clone(fate),
                Arc::clone(domain),
            )));
        }
        Ok(lanes.into_boxed_slice())
    }

    /// The first write on a lane: the hello that proves to the worker
    /// this connection is the allocation's (`rfaas_proto::hello`). Waits for
    /// the worker's answer, so the first request cannot overwrite the hello
    /// before it is read, and the lane starts with nothing in flight.
    fn say_hello(
        &self,
        endpoint: &Endpoint,
        cq: &mut CompletionQueue,
        staging: &mut MemoryRegion,
        remote: &Descriptor,
        hello: LaneHello,
    ) -> Result<()> {
        const HELLO_WR: u64 = u64::MAX - 1;
        let mut bytes = [0; LaneHello::LEN];
        hello
            .encode(&mut bytes)
            .map_err(|e| Error::Protocol(e.to_string()))?;
        staging.write_from(0, &bytes);
        let to = RemoteAddr {
            addr: remote.addr,
            rkey: remote.rkey,
        };
        endpoint.post_recv(HELLO_WR)?;
        endpoint.write_with_imm(HELLO_WR, staging, 0, LaneHello::LEN, to, LANE_HELLO_IMM)?;
        let timeout = self.inner.opts.connect_timeout;
        let deadline = Instant::now() + timeout;
        let mut done = [Completion::EMPTY; 2];
        let (mut sent, mut answered) = (false, false);
        while !(sent && answered) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Protocol(format!(
                    "the worker did not answer lane {}'s hello within {timeout:?}",
                    hello.lane
                )));
            }
            let n = cq.wait(&mut done, left)?;
            for c in &done[..n] {
                if !c.status.is_ok() {
                    return Err(Error::Protocol(format!(
                        "lane {}'s hello failed: {} (the worker refused the connection)",
                        hello.lane, c.status
                    )));
                }
                match c.opcode {
                    Opcode::RecvWithImm if c.imm == LANE_HELLO_IMM => answered = true,
                    Opcode::RecvWithImm => {
                        return Err(Error::Protocol(format!(
                            "the worker answered lane {}'s hello with immediate {:#x}",
                            hello.lane, c.imm
                        )))
                    }
                    _ => sent = true,
                }
            }
        }
        Ok(())
    }

    /// The fabric, opened on first use.
    fn fabric(&self) -> Result<Arc<Fabric>> {
        let mut f = lock(&self.inner.fabric);
        if let Some(f) = &*f {
            return Ok(Arc::clone(f));
        }
        let fabric = Arc::new(Fabric::open(&self.inner.opts.provider)?);
        *f = Some(Arc::clone(&fabric));
        Ok(fabric)
    }

    /// The cached control connection to `executor`, or a new one (and how
    /// long connecting took).
    fn conn(&self, executor: &str) -> Result<(Arc<ControlConn>, Duration)> {
        if let Some(c) = lock(&self.inner.conns).get(executor) {
            if !c.is_lost() {
                return Ok((Arc::clone(c), Duration::ZERO));
            }
        }
        let started = Instant::now();
        let conn = Arc::new(ControlConn::connect(
            executor,
            self.inner.opts.connect_timeout,
            self.inner.opts.reattach_grace,
        )?);
        let took = started.elapsed();
        let mut conns = lock(&self.inner.conns);
        match conns.get(executor) {
            // Another thread connected meanwhile: share its connection.
            Some(c) if !c.is_lost() => Ok((Arc::clone(c), took)),
            _ => {
                conns.insert(executor.to_owned(), Arc::clone(&conn));
                Ok((conn, took))
            }
        }
    }
}

/// A deadline in whole milliseconds, rounded up (zero stays zero: the
/// executor's default).
fn deadline_ms(d: Duration) -> u64 {
    let ms = d.as_nanos().div_ceil(1_000_000);
    u64::try_from(ms).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_round_up_to_milliseconds() {
        assert_eq!(deadline_ms(Duration::ZERO), 0);
        assert_eq!(deadline_ms(Duration::from_micros(1)), 1);
        assert_eq!(deadline_ms(Duration::from_millis(250)), 250);
        assert_eq!(deadline_ms(Duration::from_micros(250_001)), 251);
    }

    #[test]
    fn connecting_to_nothing_is_a_retryable_connect_error() {
        // A port nobody listens on: bind one, note it, close it.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let client = Client::new(ClientOptions::with_provider("tcp"));
        let spec = AllocationSpec::new(b"\x7fELF".to_vec(), &["echo"]);
        let err = client
            .allocate(&format!("127.0.0.1:{port}"), "token", &spec)
            .unwrap_err();
        assert!(matches!(err, Error::Connect { .. }), "{err:?}");
        assert!(err.is_retryable());
        assert!(err.to_string().contains(&port.to_string()), "{err}");
    }

    #[test]
    fn specs_no_executor_takes_are_refused_before_connecting() {
        // Port 1: connecting would fail with Connect, not InvalidArgument.
        let refused = |provider: &str, spec: AllocationSpec, needle: &str| {
            let client = Client::new(ClientOptions::with_provider(provider));
            let err = client.allocate("127.0.0.1:1", "t", &spec).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
            assert!(err.to_string().contains(needle), "{needle:?} not in {err}");
            assert_eq!(err.next(), crate::Next::Fix);
        };
        let lib = || AllocationSpec::new(b"\x7fELF".to_vec(), &["echo"]);
        refused(
            "tcp",
            AllocationSpec::new(b"\x7fELF".to_vec(), &[]),
            "this one names 0",
        );
        refused(
            "tcp",
            lib().input_capacity(31),
            "the input capacity is 31 bytes, less than the 32-byte request header",
        );
        refused(
            "tcp",
            lib().output_capacity(0),
            "the output capacity is 0 bytes",
        );
        refused(
            "infiniband",
            lib(),
            "unknown fabric provider \"infiniband\"",
        );
        // The smallest input capacity that holds the header is fine: the
        // connection is what fails.
        let client = Client::new(ClientOptions::with_provider("tcp"));
        let err = client
            .allocate(
                "127.0.0.1:1",
                "t",
                &lib().input_capacity(32).output_capacity(1),
            )
            .unwrap_err();
        assert!(matches!(err, Error::Connect { .. }), "{err:?}");
    }
}
