//! The C API against a real `rfaas-executord` and its workers (tcp): round
//! trips through submit/wait/spin/test and invoke, and the failures that
//! need an allocation: unknown function names and indices, refusals,
//! argument checks on buffers, a crashing function, deallocating with an
//! invocation alive. Needs the daemon built: `cargo build -p
//! rfaas-executor` first.

use std::ffi::{CStr, CString};
use std::ptr::{null, null_mut};
use std::time::Duration;

use rfaas::*;
use rfaas_testkit::executord::{daemon_binary, Executord, ExecutordOptions};
use rfaas_testkit::functions::c_library;

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
        let daemon = Executord::start(&daemon_binary(), ExecutordOptions::default());
        let mut client = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { rfaas_client_new(null(), &mut client) });
        let mut f = Fixture {
            client,
            alloc: null_mut(),
            daemon,
        };
        let mut opts = rfaas_alloc_options_default();
        opts.cores = cores;
        opts.mode = rfaas_mode::RFAAS_MODE_WARM;
        opts.output_capacity = 4096;
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
        assert_failed(st, rfaas_status::RFAAS_ERR_INVALID_ARGUMENT, "in_len 17");
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
        "1 invocation(s)",
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
