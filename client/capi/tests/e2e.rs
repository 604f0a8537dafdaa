//! The C API against a real `rfaas-executord` and its workers (tcp): round
//! trips through submit/wait/spin/test and invoke, and the failures that
//! need an allocation: unknown function names and indices, refusals,
//! argument checks on buffers, a crashing function, a deadline, the
//! executor's shutdown, deallocating with an invocation alive, and
//! `rfaas_invoke_retrying`. Needs the daemon built: `cargo build -p
//! rfaas-executor` first.

use std::ffi::{CStr, CString};
use std::ptr::{null, null_mut};
use std::time::Duration;

use rfaas::*;
use rfaas_proto::control::local::LocalReply;
use rfaas_testkit::executord::{daemon_binary, Executord, ExecutordOptions};
use rfaas_testkit::functions::{c_library, wait_in_sleep_ms};
use rfaas_testkit::process::wait_gone;

const FUNCTIONS: &[&str] = &["echo", "noop", "fault_segfault", "sleep_ms"];

fn last_error() -> String {
    // SAFETY: this thread's NUL-terminated message.
    unsafe { CStr::from_ptr(rfaas_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[track_caller]
fn ok(status: rfaas_status) {
    assert_eq!(status, rfaas_status::RFAAS_OK, "{}", last_error());
}

#[track_caller]
fn assert_failed(status: rfaas_status, expected: rfaas_status, needle: &str) {
    let msg = last_error();
    assert_eq!(status, expected, "message: {msg}");
    assert!(msg.contains(needle), "{needle:?} not in {msg:?}");
}

/// A daemon, a client and one allocation of FUNCTIONS; everything freed on
/// drop (the daemon last).
struct Fixture {
    client: *mut rfaas_client,
    alloc: *mut rfaas_allocation,
    daemon: Executord,
}

impl Fixture {
    fn new(cores: u32) -> Fixture {
        let mut opts = warm();
        opts.cores = cores;
        Fixture::with(ExecutordOptions::default(), opts)
    }

    /// A daemon with `daemon`, and an allocation with `opts`.
    fn with(daemon: ExecutordOptions, opts: rfaas_alloc_options) -> Fixture {
        let daemon = Executord::start(&daemon_binary(), daemon);
        let mut client = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { rfaas_client_new(null(), &mut client) });
        let mut f = Fixture {
            client,
            alloc: null_mut(),
            daemon,
        };
        let st = f.allocate(&opts, FUNCTIONS);
        assert_eq!(
            st,
            rfaas_status::RFAAS_OK,
            "{}\ndaemon log:\n{}",
            last_error(),
            f.daemon.log()
        );
        f
    }

    fn token(&self) -> CString {
        CString::new(
            self.daemon
                .token("nobody", 4, 2048, Duration::from_secs(600)),
        )
        .unwrap()
    }

    /// Allocates into self.alloc with rfaas_allocate_file.
    fn allocate(&mut self, opts: &rfaas_alloc_options, functions: &[&str]) -> rfaas_status {
        let exec = CString::new(self.daemon.control_addr().to_string()).unwrap();
        let token = self.token();
        let lib = CString::new(c_library().to_str().unwrap()).unwrap();
        let names: Vec<CString> = functions
            .iter()
            .map(|f| CString::new(*f).unwrap())
            .collect();
        let ptrs: Vec<_> = names.iter().map(|n| n.as_ptr()).collect();
        // SAFETY: every pointer is valid for the call.
        unsafe {
            rfaas_allocate_file(
                self.client,
                exec.as_ptr(),
                token.as_ptr(),
                opts,
                lib.as_ptr(),
                ptrs.as_ptr(),
                ptrs.len(),
                &mut self.alloc,
            )
        }
    }

    /// The pid of the daemon's only allocation's worker.
    fn worker_pid(&self) -> u32 {
        match self.daemon.status() {
            LocalReply::Status { allocations, .. } if allocations.len() == 1 => allocations[0].pid,
            other => panic!("not one allocation: {other:?}"),
        }
    }

    /// Calls `function` on the 4 bytes of `value`.
    fn invoke_u32(&self, function: &str, value: u32) -> rfaas_status {
        let (st, f) = self.index(function);
        ok(st);
        let input = self.buffer(4);
        let output = self.buffer(4);
        input.bytes().copy_from_slice(&value.to_ne_bytes());
        let mut len = 0usize;
        // SAFETY: live handles.
        unsafe { rfaas_invoke(self.alloc, f, input.0, 4, output.0, &mut len) }
    }

    fn index(&self, name: &str) -> (rfaas_status, u32) {
        let name = CString::new(name).unwrap();
        let mut i = u32::MAX;
        // SAFETY: a live allocation and valid pointers.
        let st = unsafe { rfaas_function_index(self.alloc, name.as_ptr(), &mut i) };
        (st, i)
    }

    fn buffer(&self, bytes: usize) -> Buf {
        let mut b = null_mut();
        // SAFETY: a live allocation, a valid out-pointer.
        ok(unsafe { rfaas_buffer_new(self.alloc, bytes, &mut b) });
        Buf(b)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        // SAFETY: handles made by the fixture, freed once; the allocation
        // before the daemon goes.
        unsafe {
            if !self.alloc.is_null() {
                let _ = rfaas_deallocate(self.alloc);
            }
            rfaas_client_free(self.client);
        }
    }
}

/// The tests' allocation options: warm lanes, 4 KiB of output.
fn warm() -> rfaas_alloc_options {
    let mut opts = rfaas_alloc_options_default();
    opts.mode = rfaas_mode::RFAAS_MODE_WARM;
    opts.output_capacity = 4096;
    opts
}

/// Sends `signal` to `pid`, a process this test started (the daemon, or a
/// worker through it).
fn kill(pid: u32, signal: i32) {
    // SAFETY: kill has no memory preconditions.
    assert_eq!(unsafe { libc::kill(pid as i32, signal) }, 0, "kill {pid}");
}

/// A buffer, freed on drop.
struct Buf(*mut rfaas_buffer);

impl Buf {
    #[allow(clippy::mut_from_ref)] // the C buffer's bytes, not self's
    fn bytes(&self) -> &mut [u8] {
        // SAFETY: a live buffer: its data is rfaas_buffer_size bytes, and
        // the tests never hold two of these slices at once.
        unsafe {
            std::slice::from_raw_parts_mut(
                rfaas_buffer_data(self.0).cast::<u8>(),
                rfaas_buffer_size(self.0),
            )
        }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: from rfaas_buffer_new, freed once.
        unsafe { rfaas_buffer_free(self.0) };
    }
}

#[test]
fn echo_through_every_way_of_waiting() {
    let f = Fixture::new(1);
    let (st, echo) = f.index("echo");
    ok(st);
    assert_eq!(echo, 0);
    assert_eq!(f.index("sleep_ms"), (rfaas_status::RFAAS_OK, 3));

    let input = f.buffer(1000);
    let output = f.buffer(1000);
    // SAFETY: a live buffer.
    let data = unsafe { rfaas_buffer_data(input.0) };
    assert_eq!(data as usize % 4096, 0, "page-aligned data");
    for (i, b) in input.bytes().iter_mut().enumerate() {
        *b = (i * 7 % 251) as u8;
    }
    let expected = input.bytes().to_vec();

    for how in ["wait", "spin", "test"] {
        output.bytes().fill(0);
        let mut inv = null_mut();
        // SAFETY: live handles; the buffers outlive the invocation.
        ok(unsafe { rfaas_submit(f.alloc, echo, input.0, 1000, output.0, &mut inv) });
        let mut len = 0usize;
        // SAFETY: a live invocation, a valid out-pointer.
        let st = unsafe {
            match how {
                "wait" => rfaas_wait(inv, &mut len),
                "spin" => rfaas_spin(inv, &mut len),
                _ => loop {
                    match rfaas_test(inv, &mut len) {
                        rfaas_status::RFAAS_PENDING => std::thread::yield_now(),
                        st => break st,
                    }
                },
            }
        };
        ok(st);
        assert_eq!(len, 1000, "{how}");
        assert_eq!(output.bytes(), &expected[..], "{how}");
        // The result is kept.
        let mut again = 0usize;
        // SAFETY: as above.
        ok(unsafe { rfaas_wait(inv, &mut again) });
        assert_eq!(again, 1000);
        // SAFETY: freed once.
        unsafe { rfaas_invocation_free(inv) };
    }

    output.bytes().fill(0);
    let mut len = 0usize;
    // SAFETY: live handles.
    ok(unsafe { rfaas_invoke(f.alloc, echo, input.0, 10, output.0, &mut len) });
    assert_eq!(len, 10);
    assert_eq!(&output.bytes()[..10], &expected[..10]);
}

/// A pipeline from C: four calls in flight on one lane of four slots, a
/// fifth refused at once, each reported once by its id with its own
/// output; bad option values refused before connecting.
#[test]
fn a_pipeline_keeps_calls_in_flight_and_reports_each_once() {
    let mut opts = warm();
    opts.lanes = 1;
    opts.slots = 4;
    let f = Fixture::with(ExecutordOptions::default(), opts);
    let (st, sleep) = f.index("sleep_ms");
    ok(st);
    let mut pipe = null_mut();
    // SAFETY: a live allocation, a valid out-pointer.
    ok(unsafe { rfaas_pipeline_new(f.alloc, &mut pipe) });
    // SAFETY: a live pipeline.
    assert_eq!(unsafe { rfaas_pipeline_slots(pipe) }, 4);
    // The allocation's one lane is the pipeline's.
    let (plain_in, plain_out) = (f.buffer(4), f.buffer(4));
    let mut inv = null_mut();
    // SAFETY: live handles, a valid out-pointer.
    let st = unsafe { rfaas_submit(f.alloc, sleep, plain_in.0, 4, plain_out.0, &mut inv) };
    assert_failed(st, rfaas_status::RFAAS_ERR_ALL_LANES_BUSY, "busy");
    let bufs: Vec<(Buf, Buf)> = (0..5).map(|_| (f.buffer(4), f.buffer(4))).collect();
    let mut sent = std::collections::BTreeMap::new();
    for (i, (input, output)) in bufs.iter().enumerate() {
        input
            .bytes()
            .copy_from_slice(&(10 + i as u32).to_ne_bytes());
        let mut id = u64::MAX;
        // SAFETY: live handles; the buffers outlive the calls.
        let st = unsafe { rfaas_pipeline_submit(pipe, sleep, input.0, 4, output.0, &mut id) };
        if i < 4 {
            ok(st);
            assert_eq!(id, i as u64, "ids count submissions");
            sent.insert(id, i);
        } else {
            assert_failed(st, rfaas_status::RFAAS_ERR_SLOTS_FULL, "slots");
            assert!(rfaas_status_is_retryable(st as u32));
        }
    }
    // SAFETY: a live pipeline.
    assert_eq!(unsafe { rfaas_pipeline_in_flight(pipe) }, 4);
    let (mut id, mut len) = (0u64, 0usize);
    while !sent.is_empty() {
        // SAFETY: a live pipeline, valid out-pointers.
        match unsafe { rfaas_pipeline_test_any(pipe, &mut id, &mut len) } {
            rfaas_status::RFAAS_PENDING => {
                assert_eq!(id, RFAAS_NO_CALL);
                std::thread::yield_now();
            }
            st => {
                ok(st);
                let i = sent.remove(&id).expect("each call reported once");
                assert_eq!(len, 4);
                assert_eq!(bufs[i].1.bytes(), (10 + i as u32).to_ne_bytes(), "call {i}");
            }
        }
    }
    // Nothing in flight: waiting is a bad argument, and says no call.
    // SAFETY: as above.
    let st = unsafe { rfaas_pipeline_wait_any(pipe, &mut id, &mut len) };
    assert_failed(st, rfaas_status::RFAAS_ERR_INVALID_ARGUMENT, "in flight");
    assert_eq!(id, RFAAS_NO_CALL);
    // SAFETY: freed once; the lane goes back to the allocation.
    unsafe { rfaas_pipeline_free(pipe) };
    ok(f.invoke_u32("echo", 2));
    // A failing call is reported with its id and its own status.
    // SAFETY: a live allocation, a valid out-pointer.
    ok(unsafe { rfaas_pipeline_new(f.alloc, &mut pipe) });
    // Staged calls leave together at the flush, each reported once.
    let (st, echo) = f.index("echo");
    ok(st);
    let mut staged = std::collections::BTreeMap::new();
    for (i, (input, output)) in bufs.iter().enumerate().take(3).skip(1) {
        input
            .bytes()
            .copy_from_slice(&(20 + i as u32).to_ne_bytes());
        // SAFETY: live handles; the buffers outlive the calls.
        ok(unsafe { rfaas_pipeline_stage(pipe, echo, input.0, 4, output.0, &mut id) });
        staged.insert(id, i);
    }
    // SAFETY: a live pipeline.
    assert_eq!(unsafe { rfaas_pipeline_in_flight(pipe) }, 2);
    // SAFETY: a live pipeline.
    ok(unsafe { rfaas_pipeline_flush(pipe) });
    // SAFETY: NULL is refused.
    let st = unsafe { rfaas_pipeline_flush(null_mut()) };
    assert_failed(st, rfaas_status::RFAAS_ERR_INVALID_ARGUMENT, "pipe");
    while !staged.is_empty() {
        // SAFETY: a live pipeline, valid out-pointers.
        ok(unsafe { rfaas_pipeline_wait_any(pipe, &mut id, &mut len) });
        let i = staged.remove(&id).expect("each staged call reported once");
        assert_eq!(
            bufs[i].1.bytes(),
            (20 + i as u32).to_ne_bytes(),
            "staged call {i}"
        );
    }
    let (st, crash) = f.index("fault_segfault");
    ok(st);
    let (input, output) = &bufs[0];
    // SAFETY: live handles.
    ok(unsafe { rfaas_pipeline_submit(pipe, crash, input.0, 0, output.0, &mut id) });
    let submitted = id;
    // SAFETY: as above.
    let st = unsafe { rfaas_pipeline_spin_any(pipe, &mut id, &mut len) };
    assert_failed(st, rfaas_status::RFAAS_ERR_WORKER_CRASHED, "");
    assert_eq!(id, submitted);
    // SAFETY: freed once.
    unsafe { rfaas_pipeline_free(pipe) };

    let mut bad = warm();
    bad.slots = 3;
    let mut g = Fixture::new(1);
    // SAFETY: the fixture's allocation, replaced by the attempt below.
    ok(unsafe { rfaas_deallocate(g.alloc) });
    g.alloc = null_mut();
    assert_failed(
        g.allocate(&bad, FUNCTIONS),
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "options.slots is 3",
    );
}

#[test]
fn unknown_functions_by_name_and_index() {
    let f = Fixture::new(1);
    let (st, i) = f.index("matmul_not_here");
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_UNKNOWN_FUNCTION,
        "\"matmul_not_here\"",
    );
    assert_eq!(i, u32::MAX, "untouched on failure");

    let input = f.buffer(8);
    let output = f.buffer(8);
    let mut inv = null_mut();
    // SAFETY: live handles.
    let st = unsafe { rfaas_submit(f.alloc, 4, input.0, 8, output.0, &mut inv) };
    assert_failed(st, rfaas_status::RFAAS_ERR_UNKNOWN_FUNCTION, "#4");
    assert!(inv.is_null());
    // SAFETY: live handles.
    let st = unsafe { rfaas_submit(f.alloc, 70_000, input.0, 8, output.0, &mut inv) };
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "function index 70000 is out of range",
    );
}

#[test]
fn buffer_arguments_are_checked() {
    let f = Fixture::new(1);
    let input = f.buffer(16);
    let output = f.buffer(16);
    let mut len = 0usize;
    // SAFETY: live handles; the misuse tested is in the arguments.
    unsafe {
        let st = rfaas_invoke(f.alloc, 0, input.0, 17, output.0, &mut len);
        assert_failed(st, rfaas_status::RFAAS_ERR_INVALID_ARGUMENT, "in_bytes 17");
        let st = rfaas_invoke(f.alloc, 0, input.0, 16, input.0, &mut len);
        assert_failed(
            st,
            rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
            "the same buffer",
        );
        let st = rfaas_invoke(f.alloc, 0, null(), 16, output.0, &mut len);
        assert_failed(st, rfaas_status::RFAAS_ERR_INVALID_ARGUMENT, "`in` is NULL");
        let st = rfaas_invoke(f.alloc, 0, input.0, 16, null_mut(), &mut len);
        assert_failed(
            st,
            rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
            "`out` is NULL",
        );
        // out_len may be NULL.
        ok(rfaas_invoke(f.alloc, 0, input.0, 16, output.0, null_mut()));
    }
}

#[test]
fn the_executor_refuses_with_its_own_codes() {
    let mut f = Fixture::new(1);
    let first = f.alloc;
    let opts = rfaas_alloc_options_default();
    let st = f.allocate(&opts, &["echo", "no_such_symbol"]);
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_REFUSED_UNKNOWN_FUNCTION,
        "no_such_symbol",
    );
    assert!(!rfaas_status_is_retryable(st as u32));
    assert_eq!(f.alloc, first, "the out-pointer is untouched on failure");

    let exec = CString::new(f.daemon.control_addr().to_string()).unwrap();
    let token = CString::new("not-a-token").unwrap();
    let lib = CString::new(c_library().to_str().unwrap()).unwrap();
    let echo = CString::new("echo").unwrap();
    let names = [echo.as_ptr()];
    let mut alloc = null_mut();
    // SAFETY: valid pointers.
    let st = unsafe {
        rfaas_allocate_file(
            f.client,
            exec.as_ptr(),
            token.as_ptr(),
            null(),
            lib.as_ptr(),
            names.as_ptr(),
            1,
            &mut alloc,
        )
    };
    assert_failed(st, rfaas_status::RFAAS_ERR_REFUSED_TOKEN_MALFORMED, "token");
    assert!(alloc.is_null());
}

/// The figures of a memory_mib too small (1, 4 and 8 MiB with a 32 MiB
/// input, 16 to 32 MiB): the client's own check says
/// RFAAS_ERR_INVALID_ARGUMENT, the executor
/// RFAAS_ERR_REFUSED_MEMORY_TOO_SMALL; each message gives the figure
/// needed, and neither is retryable.
#[test]
fn too_little_memory_is_one_clear_status_with_the_figure() {
    let mut f = Fixture::new(1);
    let first = f.alloc;
    let mut opts = rfaas_alloc_options_default();
    opts.mode = rfaas_mode::RFAAS_MODE_WARM;

    opts.memory_mib = 1;
    let st = f.allocate(&opts, FUNCTIONS);
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "memory_mib 1 cannot hold",
    );
    assert!(!rfaas_status_is_retryable(st as u32));
    for mib in [4, 8, 16] {
        opts.memory_mib = mib;
        let st = f.allocate(&opts, FUNCTIONS);
        assert_failed(
            st,
            rfaas_status::RFAAS_ERR_REFUSED_MEMORY_TOO_SMALL,
            "ask for memory_mib ",
        );
        assert!(last_error().contains(&format!("asks for {mib} MiB")));
        assert!(!rfaas_status_is_retryable(st as u32));
    }
    assert_eq!(f.alloc, first, "the out-pointer is untouched on failure");

    // 24 MiB is enough for the worker, not for a 32 MiB input.
    opts.memory_mib = 24;
    ok(f.allocate(&opts, FUNCTIONS));
    // SAFETY: the first allocation, no longer used.
    ok(unsafe { rfaas_deallocate(first) });
    let (st, noop) = f.index("noop");
    ok(st);
    let input = f.buffer(32 << 20);
    let output = f.buffer(4096);
    // SAFETY: a live allocation and its buffers.
    let st = unsafe { rfaas_invoke(f.alloc, noop, input.0, 32 << 20, output.0, null_mut()) };
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "allocate with memory_mib ",
    );
    assert!(!rfaas_status_is_retryable(st as u32));
}

#[test]
fn a_crashing_function_is_reported_as_such() {
    let f = Fixture::new(1);
    let (st, segv) = f.index("fault_segfault");
    ok(st);
    let input = f.buffer(8);
    let output = f.buffer(8);
    let mut len = 0usize;
    // SAFETY: live handles.
    let st = unsafe { rfaas_invoke(f.alloc, segv, input.0, 8, output.0, &mut len) };
    assert_failed(st, rfaas_status::RFAAS_ERR_WORKER_CRASHED, "signal 11");
    assert!(rfaas_status_is_retryable(st as u32));
    // The cause as numbers: no text to parse.
    let info = rfaas_last_error_info();
    assert_eq!(info.status, rfaas_status::RFAAS_ERR_WORKER_CRASHED);
    assert_eq!(info.signal, libc::SIGSEGV);
    assert!(!info.allocation_usable);
    assert_eq!(info.next, rfaas_next::RFAAS_NEXT_REALLOCATE);
    // The allocation has ended: the next call fails at once, the same way.
    let st = f.invoke_u32("echo", 1);
    assert_failed(st, rfaas_status::RFAAS_ERR_WORKER_CRASHED, "allocate again");
    assert_eq!(rfaas_last_error_info().signal, libc::SIGSEGV);
}

#[test]
fn a_deadline_is_its_own_code_and_ends_the_allocation() {
    let mut opts = warm();
    opts.deadline_ms = 200;
    let f = Fixture::with(ExecutordOptions::default(), opts);
    let st = f.invoke_u32("sleep_ms", 5000);
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_DEADLINE_EXCEEDED,
        "ran past the allocation's deadline",
    );
    let info = rfaas_last_error_info();
    assert!(!info.allocation_usable);
    assert_eq!(info.next, rfaas_next::RFAAS_NEXT_FIX);
    assert_eq!(info.signal, 0);
    let st = f.invoke_u32("echo", 1);
    assert_failed(st, rfaas_status::RFAAS_ERR_DEADLINE_EXCEEDED, "deadline");
}

#[test]
fn stopping_the_executor_is_executor_stopped() {
    let f = Fixture::new(1);
    let (st, sleep) = f.index("sleep_ms");
    ok(st);
    let input = f.buffer(4);
    let output = f.buffer(4);
    input.bytes().copy_from_slice(&10_000u32.to_ne_bytes());
    let mut inv = null_mut();
    // SAFETY: live handles.
    ok(unsafe { rfaas_submit(f.alloc, sleep, input.0, 4, output.0, &mut inv) });
    wait_in_sleep_ms(f.worker_pid());
    kill(f.daemon.pid(), libc::SIGTERM);
    let mut len = 0usize;
    // SAFETY: a live invocation.
    let st = unsafe { rfaas_wait(inv, &mut len) };
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_EXECUTOR_STOPPED,
        "is shutting down and ended the allocation; allocate again, on another executor if it does not come back",
    );
    assert!(!last_error().contains("retrieved"), "{}", last_error());
    let info = rfaas_last_error_info();
    assert_eq!(info.next, rfaas_next::RFAAS_NEXT_ELSEWHERE);
    assert!(!info.allocation_usable);
    assert!(rfaas_status_is_retryable(st as u32));
    // SAFETY: freed once.
    unsafe { rfaas_invocation_free(inv) };
}

#[test]
fn messages_name_c_things() {
    let f = Fixture::new(1);
    let other = Fixture::new(1);
    let input = f.buffer(16);
    let output = f.buffer(16);
    let foreign = other.buffer(16);
    let one = f.buffer(1);
    let mut len = 0usize;
    // SAFETY: live handles; the misuse tested is in the arguments.
    unsafe {
        let st = rfaas_invoke(f.alloc, 0, one.0, 2, output.0, &mut len);
        assert_failed(
            st,
            rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
            "rfaas_invoke: in_bytes 2 is more than the input buffer holds (1 byte); pass at most rfaas_buffer_size(in)",
        );
        let st = rfaas_invoke(f.alloc, 0, foreign.0, 16, output.0, &mut len);
        assert_failed(
            st,
            rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
            "make buffers with rfaas_buffer_new on this one",
        );
        // Every lane busy: the advice is a C call.
        let (st, sleep) = f.index("sleep_ms");
        ok(st);
        input.bytes()[..4].copy_from_slice(&300u32.to_ne_bytes());
        let mut inv = null_mut();
        ok(rfaas_submit(f.alloc, sleep, input.0, 4, output.0, &mut inv));
        let spare = f.buffer(4);
        let mut second = null_mut();
        let st = rfaas_submit(f.alloc, sleep, input.0, 4, spare.0, &mut second);
        assert_failed(st, rfaas_status::RFAAS_ERR_ALL_LANES_BUSY, "rfaas_invoke");
        assert!(!last_error().contains("submit_wait"), "{}", last_error());
        let info = rfaas_last_error_info();
        assert!(info.allocation_usable);
        assert_eq!(info.next, rfaas_next::RFAAS_NEXT_RETRY);
        ok(rfaas_wait(inv, &mut len));
        rfaas_invocation_free(inv);
    }
    let (st, _) = f.index("matmul_not_here");
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_UNKNOWN_FUNCTION,
        "list it in the functions given to rfaas_allocate",
    );
}

#[test]
fn invoke_retrying_allocates_again_after_a_crash() {
    let f = Fixture::new(1);
    let (st, echo) = f.index("echo");
    ok(st);
    let input = f.buffer(4);
    let output = f.buffer(4);
    input.bytes().copy_from_slice(&0xabcdu32.to_ne_bytes());
    let first = f.worker_pid();
    kill(first, libc::SIGKILL);
    let mut len = 0usize;
    // SAFETY: live handles, no invocation unfreed.
    ok(unsafe { rfaas_invoke_retrying(f.alloc, echo, input.0, 4, output.0, &mut len, 3) });
    assert_eq!(len, 4);
    assert_eq!(output.bytes(), &0xabcdu32.to_ne_bytes());
    // A new worker, the same buffers.
    f.daemon.wait_status(Duration::from_secs(10), |s| {
        matches!(s, LocalReply::Status { allocations, .. } if allocations.len() == 1 && allocations[0].pid != first)
    });

    // A function that crashes crashes again: the retries run out.
    let (st, segv) = f.index("fault_segfault");
    ok(st);
    // SAFETY: live handles.
    let st = unsafe { rfaas_invoke_retrying(f.alloc, segv, input.0, 0, output.0, &mut len, 1) };
    assert_failed(st, rfaas_status::RFAAS_ERR_WORKER_CRASHED, "signal 11");

    // The crash ended the allocation: one retry allocates again.
    // SAFETY: live handles.
    ok(unsafe { rfaas_invoke_retrying(f.alloc, echo, input.0, 4, output.0, &mut len, 1) });
    // Not while an invocation of the allocation is unfreed.
    let mut inv = null_mut();
    // SAFETY: live handles.
    ok(unsafe { rfaas_submit(f.alloc, echo, input.0, 4, output.0, &mut inv) });
    let other = f.buffer(4);
    // SAFETY: live handles; the refusal is what is tested.
    let st = unsafe { rfaas_invoke_retrying(f.alloc, echo, input.0, 4, other.0, &mut len, 1) };
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "1 invocation of this allocation is not freed; call rfaas_invocation_free on it first",
    );
    // SAFETY: a live invocation, freed once.
    unsafe {
        ok(rfaas_wait(inv, &mut len));
        rfaas_invocation_free(inv);
    }
}

/// `accessor`'s string through a caller's array of `size` bytes: its
/// status, the text, and the bytes it said it needs.
fn c_string(
    size: usize,
    accessor: impl FnOnce(*mut std::ffi::c_char, usize, *mut usize) -> rfaas_status,
) -> (rfaas_status, String, usize) {
    // One byte more than the call is told, a NUL, so untouched text reads.
    let mut array = vec![b'?'; size];
    array.push(0);
    let mut needed = 0usize;
    let st = accessor(array.as_mut_ptr().cast(), size, &mut needed);
    let text = CStr::from_bytes_until_nul(&array)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    (st, text, needed)
}

/// The node and the executor an allocation runs on, as C sees them.
fn whereabouts(alloc: *const rfaas_allocation) -> (String, String) {
    // SAFETY: a live allocation; the arrays are `size` bytes.
    let (st, node, _) = c_string(256, |p, n, need| unsafe {
        rfaas_allocation_node(alloc, p, n, need)
    });
    ok(st);
    // SAFETY: as above.
    let (st, executor, _) = c_string(256, |p, n, need| unsafe {
        rfaas_allocation_executor(alloc, p, n, need)
    });
    ok(st);
    (node, executor)
}

#[test]
fn an_allocation_says_its_node_executor_and_moves() {
    let f = Fixture::new(1);
    let executor = f.daemon.control_addr().to_string();
    assert_eq!(
        whereabouts(f.alloc),
        (f.daemon.node_name().to_owned(), executor.clone())
    );
    // SAFETY: a live allocation.
    assert_eq!(unsafe { rfaas_allocation_moves(f.alloc) }, 0);
    let node = f.daemon.node_name();

    // Too small: nothing written, the size needed told.
    // SAFETY: a live allocation; the array is `size` bytes.
    let (st, text, needed) = c_string(4, |p, n, need| unsafe {
        rfaas_allocation_node(f.alloc, p, n, need)
    });
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_TOO_SMALL,
        "pass one of at least",
    );
    assert_eq!(needed, node.len() + 1);
    assert_eq!(text, "????", "the array was written to");
    assert!(!rfaas_status_is_retryable(st as u32));
    assert!(rfaas_last_error_info().allocation_usable);
    // Exactly the size needed fits.
    // SAFETY: as above.
    let (st, text, _) = c_string(needed, |p, n, need| unsafe {
        rfaas_allocation_node(f.alloc, p, n, need)
    });
    ok(st);
    assert_eq!(text, node);
    // NULL and 0 ask for the size.
    let mut needed = 0usize;
    // SAFETY: a live allocation; NULL with size 0 writes nothing.
    let st = unsafe { rfaas_allocation_executor(f.alloc, null_mut(), 0, &mut needed) };
    assert_failed(st, rfaas_status::RFAAS_ERR_TOO_SMALL, &executor);
    assert_eq!(needed, executor.len() + 1);
    // NULL with a size, and a NULL allocation, are refused.
    // SAFETY: the refusals are what is tested.
    let st = unsafe { rfaas_allocation_node(f.alloc, null_mut(), 8, null_mut()) };
    assert_failed(st, rfaas_status::RFAAS_ERR_INVALID_ARGUMENT, "NULL");
    // SAFETY: as above.
    let (st, _, _) = c_string(256, |p, n, need| unsafe {
        rfaas_allocation_node(null(), p, n, need)
    });
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "`alloc` is NULL",
    );
    // SAFETY: NULL is allowed.
    assert_eq!(unsafe { rfaas_allocation_moves(null()) }, 0);
}

#[test]
fn invoke_retrying_moves_to_a_fallback_executor() {
    let f = Fixture::new(1);
    let second = Executord::start(
        &daemon_binary(),
        ExecutordOptions {
            node_name: "node-b".into(),
            ..ExecutordOptions::default()
        },
    );
    let addr = CString::new(second.control_addr().to_string()).unwrap();
    let token = CString::new(second.token("nobody", 4, 2048, Duration::from_secs(600))).unwrap();
    // SAFETY: a live allocation no other thread uses; C strings.
    ok(unsafe { rfaas_add_fallback_executor(f.alloc, addr.as_ptr(), token.as_ptr()) });
    let (st, echo) = f.index("echo");
    ok(st);
    let input = f.buffer(4);
    let output = f.buffer(4);
    input.bytes().copy_from_slice(&99u32.to_ne_bytes());
    let worker = f.worker_pid();
    kill(f.daemon.pid(), libc::SIGKILL);
    // Its worker dies with it (a parent-death signal); until then it could
    // still answer.
    wait_gone(worker);
    let mut len = 0usize;
    // SAFETY: live handles.
    let st = unsafe { rfaas_invoke_retrying(f.alloc, echo, input.0, 4, output.0, &mut len, 2) };
    assert_eq!(
        st,
        rfaas_status::RFAAS_OK,
        "{}\n{}",
        last_error(),
        second.log()
    );
    assert_eq!(output.bytes(), &99u32.to_ne_bytes());
    // The allocation now lives on the second executor, and says so.
    second.wait_status(
        Duration::from_secs(10),
        |s| matches!(s, LocalReply::Status { allocations, .. } if allocations.len() == 1),
    );
    assert_eq!(
        whereabouts(f.alloc),
        ("node-b".to_owned(), second.control_addr().to_string())
    );
    // SAFETY: a live allocation.
    assert_eq!(unsafe { rfaas_allocation_moves(f.alloc) }, 1);
}

#[test]
fn deallocate_waits_for_invocations_to_be_freed() {
    let mut f = Fixture::new(1);
    let (st, sleep) = f.index("sleep_ms");
    ok(st);
    let input = f.buffer(4);
    let output = f.buffer(4);
    input.bytes().copy_from_slice(&50u32.to_ne_bytes());
    let mut inv = null_mut();
    // SAFETY: live handles.
    ok(unsafe { rfaas_submit(f.alloc, sleep, input.0, 4, output.0, &mut inv) });

    // One lane, in use: a second submission fails at once.
    let other_out = f.buffer(4);
    let mut second = null_mut();
    // SAFETY: live handles.
    let st = unsafe { rfaas_submit(f.alloc, sleep, input.0, 4, other_out.0, &mut second) };
    assert_failed(st, rfaas_status::RFAAS_ERR_ALL_LANES_BUSY, "busy");
    assert!(second.is_null());

    // SAFETY: the allocation is live; the refusal is what is tested.
    let st = unsafe { rfaas_deallocate(f.alloc) };
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "1 invocation of this allocation is not freed",
    );

    let mut len = 0usize;
    // SAFETY: a live invocation.
    ok(unsafe { rfaas_wait(inv, &mut len) });
    assert_eq!(len, 4);
    // SAFETY: freed once.
    unsafe { rfaas_invocation_free(inv) };
    // SAFETY: the allocation is live and has no invocation left.
    ok(unsafe { rfaas_deallocate(f.alloc) });
    f.alloc = null_mut();
}

/// A thread whose `rfaas_spin` shares its CPU with its hot worker: the
/// library notices and sleeps instead.
#[test]
fn spinning_on_the_workers_cpu_turns_to_sleeping() {
    let cpu = rfaas_testkit::cpus::allowed()[0];
    std::thread::spawn(move || {
        rfaas_testkit::cpus::pin_this_thread(cpu);
        assert!(!rfaas_spin_sleeps());
        let daemon = ExecutordOptions {
            cpus: cpu.to_string(),
            pin: true,
            ..ExecutordOptions::default()
        };
        let mut opts = warm();
        opts.mode = rfaas_mode::RFAAS_MODE_HOT;
        let f = Fixture::with(daemon, opts);
        let (st, echo) = f.index("echo");
        ok(st);
        let input = f.buffer(4);
        let output = f.buffer(4);
        input.bytes().copy_from_slice(&7u32.to_ne_bytes());
        let mut calls = 0;
        while !rfaas_spin_sleeps() && calls < 500 {
            let mut inv = null_mut();
            let mut len = 0usize;
            // SAFETY: live handles; the invocation is freed once.
            unsafe {
                ok(rfaas_submit(f.alloc, echo, input.0, 4, output.0, &mut inv));
                ok(rfaas_spin(inv, &mut len));
                rfaas_invocation_free(inv);
            }
            assert_eq!(len, 4);
            calls += 1;
        }
        assert!(
            rfaas_spin_sleeps(),
            "{calls} spins on the worker's CPU went unnoticed"
        );
    })
    .join()
    .unwrap();
}

/// `rfaas_allocation_renew`: a token of the allocation's lease ending later
/// is taken; one of another lease is refused with its own status, and the
/// allocation goes on either way.
#[test]
fn renewing_takes_the_leases_new_token_and_refuses_another_lease() {
    let f = Fixture::new(1);
    let lease_id = match f.daemon.status() {
        LocalReply::Status { allocations, .. } if allocations.len() == 1 => allocations[0].lease_id,
        other => panic!("not one allocation: {other:?}"),
    };
    let mint = |lease: u64, ttl: u64| {
        let mut c = f.daemon.claims("nobody", 4, 2048, Duration::from_secs(ttl));
        c.lease_id = lease;
        CString::new(f.daemon.mint(&c)).unwrap()
    };

    let other = mint(lease_id + 1, 1200);
    // SAFETY: a live allocation and a C string.
    let st = unsafe { rfaas_allocation_renew(f.alloc, other.as_ptr()) };
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_REFUSED_LEASE_MISMATCH,
        &format!("lease {}", lease_id + 1),
    );
    assert!(rfaas_last_error_info().allocation_usable);
    ok(f.invoke_u32("echo", 5));

    // SAFETY: a live allocation; NULL is checked.
    let st = unsafe { rfaas_allocation_renew(f.alloc, null()) };
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "`token` is NULL",
    );

    let renewed = mint(lease_id, 1200);
    // SAFETY: a live allocation and a C string.
    ok(unsafe { rfaas_allocation_renew(f.alloc, renewed.as_ptr()) });
    ok(f.invoke_u32("echo", 6));
    assert!(
        f.daemon.log().contains("lease renewed"),
        "{}",
        f.daemon.log()
    );
}
