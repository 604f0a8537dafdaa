//! The C API's error paths without an executor: NULL pointers, bad
//! strings, bad options, unreachable executors, a manager's refusal of a
//! request no node can hold (from a loopback server giving the manager's
//! reply). Each must return the documented status and leave a sentence in
//! `rfaas_last_error`, never crash.

use std::ffi::{c_char, CStr, CString};
use std::ptr::{null, null_mut};

use rfaas::*;
use rfaas_testkit::functions::c_library;
use rfaas_testkit::manager::{Manager, ManagerOptions};

fn last_error() -> String {
    // SAFETY: rfaas_last_error returns this thread's NUL-terminated
    // message, valid until its next failing call.
    unsafe { CStr::from_ptr(rfaas_last_error()) }
        .to_str()
        .expect("the message is UTF-8")
        .to_owned()
}

/// Asserts `status` is `expected` and the last error says `needle`.
#[track_caller]
fn assert_failed(status: rfaas_status, expected: rfaas_status, needle: &str) {
    let msg = last_error();
    assert_eq!(status, expected, "message: {msg}");
    assert!(msg.contains(needle), "{needle:?} not in {msg:?}");
}

fn client() -> *mut rfaas_client {
    let mut c = null_mut();
    let provider = CString::new("tcp").unwrap();
    // SAFETY: a valid C string and out-pointer.
    let st = unsafe { rfaas_client_new(provider.as_ptr(), &mut c) };
    assert_eq!(st, rfaas_status::RFAAS_OK, "{}", last_error());
    assert!(!c.is_null());
    c
}

/// A port on 127.0.0.1 nothing listens on.
fn closed_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    addr
}

/// Calls rfaas_allocate with these arguments and one function, "echo".
fn allocate(
    client: *const rfaas_client,
    executor: *const c_char,
    token: *const c_char,
    library: &[u8],
    out: *mut *mut rfaas_allocation,
) -> rfaas_status {
    let echo = CString::new("echo").unwrap();
    let names = [echo.as_ptr()];
    // SAFETY: every pointer is NULL or valid for the call.
    unsafe {
        rfaas_allocate(
            client,
            executor,
            token,
            null(),
            library.as_ptr().cast(),
            library.len(),
            names.as_ptr(),
            names.len(),
            out,
        )
    }
}

#[test]
fn client_new_checks_its_arguments() {
    // SAFETY: NULL out is what is tested.
    let st = unsafe { rfaas_client_new(null(), null_mut()) };
    assert_failed(st, rfaas_status::RFAAS_ERR_INVALID_ARGUMENT, "`out`");

    let mut c = null_mut();
    let empty = CString::new("").unwrap();
    // SAFETY: valid pointers.
    let st = unsafe { rfaas_client_new(empty.as_ptr(), &mut c) };
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "`provider` is empty",
    );
    assert!(c.is_null());

    // A provider no fabric has: refused here, not at the first allocation.
    for bad in ["infiniband", "verbs:", "TCP"] {
        let name = CString::new(bad).unwrap();
        // SAFETY: valid pointers.
        let st = unsafe { rfaas_client_new(name.as_ptr(), &mut c) };
        assert_failed(
            st,
            rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
            &format!("`provider` is {bad:?}, which is no fabric provider; pass \"tcp\""),
        );
        assert!(c.is_null());
        let info = rfaas_last_error_info();
        assert_eq!(info.next, rfaas_next::RFAAS_NEXT_FIX);
        assert!(!info.allocation_usable, "no client, no allocation");
    }

    let bad = b"tc\xffp\0";
    // SAFETY: a NUL-terminated byte string.
    let st = unsafe { rfaas_client_new(bad.as_ptr().cast(), &mut c) };
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "not valid UTF-8",
    );

    // NULL provider: the environment's or tcp.
    // SAFETY: valid out-pointer.
    let st = unsafe { rfaas_client_new(null(), &mut c) };
    assert_eq!(st, rfaas_status::RFAAS_OK);
    // SAFETY: a client from rfaas_client_new, freed once.
    unsafe { rfaas_client_free(c) };
}

#[test]
fn null_handles_are_refused_or_ignored() {
    let mut index = 0u32;
    let mut alloc = null_mut();
    let mut buf = null_mut();
    let mut inv = null_mut();
    let mut len = 0usize;
    let name = CString::new("echo").unwrap();
    // SAFETY: NULL handles are what is tested; the other pointers are
    // valid.
    unsafe {
        let st = rfaas_function_index(null(), name.as_ptr(), &mut index);
        assert_failed(
            st,
            rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
            "`alloc` is NULL",
        );
        let st = rfaas_buffer_new(null(), 64, &mut buf);
        assert_failed(
            st,
            rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
            "rfaas_buffer_new: `alloc` is NULL",
        );
        assert!(buf.is_null());
        let st = rfaas_submit(null(), 0, null(), 0, null_mut(), &mut inv);
        assert_failed(
            st,
            rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
            "rfaas_submit: `alloc` is NULL",
        );
        let st = rfaas_submit(null(), 0, null(), 0, null_mut(), null_mut());
        assert_failed(
            st,
            rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
            "`inv` (the result pointer) is NULL",
        );
        let st = rfaas_invoke(null(), 0, null(), 0, null_mut(), &mut len);
        assert_failed(
            st,
            rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
            "rfaas_invoke: `alloc` is NULL",
        );
        type WaitFn = unsafe extern "C" fn(*mut rfaas_invocation, *mut usize) -> rfaas_status;
        let waits: [(WaitFn, &str); 3] = [
            (rfaas_wait, "rfaas_wait"),
            (rfaas_spin, "rfaas_spin"),
            (rfaas_test, "rfaas_test"),
        ];
        for (wait, call) in waits {
            let st = wait(null_mut(), &mut len);
            assert_failed(
                st,
                rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
                &format!("{call}: `inv` is NULL"),
            );
        }
        let st = rfaas_deallocate(null_mut());
        assert_failed(
            st,
            rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
            "rfaas_deallocate: `alloc` is NULL",
        );
        let st = rfaas_allocate(
            null(),
            null(),
            null(),
            null(),
            null(),
            0,
            null(),
            0,
            &mut alloc,
        );
        assert_failed(
            st,
            rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
            "rfaas_allocate: `client` is NULL",
        );

        assert!(rfaas_buffer_data(null_mut()).is_null());
        assert_eq!(rfaas_buffer_size(null()), 0);
        rfaas_buffer_free(null_mut());
        rfaas_invocation_free(null_mut());
        rfaas_client_free(null_mut());
    }
}

#[test]
fn allocate_names_each_missing_argument() {
    let c = client();
    let exec = CString::new(closed_port()).unwrap();
    let token = CString::new("token").unwrap();
    let lib = b"\x7fELF not really";
    let mut alloc = null_mut();

    let st = allocate(c, null(), token.as_ptr(), lib, &mut alloc);
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "`executor` is NULL",
    );
    let st = allocate(c, exec.as_ptr(), null(), lib, &mut alloc);
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "`token` is NULL",
    );
    let st = allocate(c, exec.as_ptr(), token.as_ptr(), &[], &mut alloc);
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "`library` is NULL or `library_len` is 0",
    );
    let st = allocate(c, exec.as_ptr(), token.as_ptr(), lib, null_mut());
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "`out` (the result pointer) is NULL",
    );

    // SAFETY: valid pointers but for what is tested.
    let st = unsafe {
        rfaas_allocate(
            c,
            exec.as_ptr(),
            token.as_ptr(),
            null(),
            lib.as_ptr().cast(),
            lib.len(),
            null(),
            0,
            &mut alloc,
        )
    };
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "no functions named",
    );
    // SAFETY: valid pointers but for what is tested.
    let st = unsafe {
        rfaas_allocate(
            c,
            exec.as_ptr(),
            token.as_ptr(),
            null(),
            lib.as_ptr().cast(),
            lib.len(),
            null(),
            2,
            &mut alloc,
        )
    };
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "`functions` is NULL",
    );
    let echo = CString::new("echo").unwrap();
    let names = [echo.as_ptr(), null()];
    // SAFETY: valid pointers but for what is tested.
    let st = unsafe {
        rfaas_allocate(
            c,
            exec.as_ptr(),
            token.as_ptr(),
            null(),
            lib.as_ptr().cast(),
            lib.len(),
            names.as_ptr(),
            2,
            &mut alloc,
        )
    };
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
        "`functions[1]` is NULL",
    );

    let path = CString::new("/nonexistent/libfunctions.so").unwrap();
    // SAFETY: valid pointers but for what is tested.
    let st = unsafe {
        rfaas_allocate_file(
            c,
            exec.as_ptr(),
            token.as_ptr(),
            null(),
            path.as_ptr(),
            names.as_ptr(),
            1,
            &mut alloc,
        )
    };
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_IO,
        "cannot read the function library /nonexistent/libfunctions.so",
    );
    assert!(alloc.is_null(), "no allocation on failure");
    // SAFETY: from client(), freed once.
    unsafe { rfaas_client_free(c) };
}

#[test]
fn bad_options_are_refused_before_connecting() {
    let c = client();
    let exec = CString::new(closed_port()).unwrap();
    let token = CString::new("token").unwrap();
    let lib = b"\x7fELF";
    let echo = CString::new("echo").unwrap();
    let names = [echo.as_ptr()];
    let refused = |opts: *const rfaas_alloc_options, message: &str| {
        let mut alloc = null_mut();
        // SAFETY: valid pointers; the options are only read as integers.
        let st = unsafe {
            rfaas_allocate(
                c,
                exec.as_ptr(),
                token.as_ptr(),
                opts,
                lib.as_ptr().cast(),
                lib.len(),
                names.as_ptr(),
                1,
                &mut alloc,
            )
        };
        assert_failed(st, rfaas_status::RFAAS_ERR_INVALID_ARGUMENT, message);
        assert!(alloc.is_null());
    };

    let mut opts = rfaas_alloc_options_default();
    opts.cores = 0;
    refused(&opts, "options.cores is 0");

    // C may store any integer in `mode`: write one that is no rfaas_mode
    // through the C layout.
    let mut opts = rfaas_alloc_options_default();
    let mode_field = std::ptr::addr_of_mut!(opts.mode).cast::<u32>();
    // SAFETY: rfaas_mode is repr(u32): the field is 4 writable bytes.
    unsafe { mode_field.write(7) };
    refused(&opts, "options.mode is 7");

    let mut opts = rfaas_alloc_options_default();
    opts.read_only_input = 2;
    refused(&opts, "options.read_only_input is 2");

    // Capacities no worker could use: refused here, not by the executor.
    let mut opts = rfaas_alloc_options_default();
    opts.input_capacity = 31;
    refused(
        &opts,
        "options.input_capacity is 31; it holds the 32-byte request header, so give it at least 32",
    );
    let mut opts = rfaas_alloc_options_default();
    opts.output_capacity = 0;
    refused(&opts, "options.output_capacity is 0");
    let info = rfaas_last_error_info();
    assert_eq!(info.status, rfaas_status::RFAAS_ERR_INVALID_ARGUMENT);
    assert!(!info.allocation_usable, "a failed allocation leaves none");

    // The smallest that fit go on to connect (and fail there).
    let mut opts = rfaas_alloc_options_default();
    opts.input_capacity = 32;
    opts.output_capacity = 1;
    let mut alloc = null_mut();
    // SAFETY: valid pointers.
    let st = unsafe {
        rfaas_allocate(
            c,
            exec.as_ptr(),
            token.as_ptr(),
            &opts,
            lib.as_ptr().cast(),
            lib.len(),
            names.as_ptr(),
            1,
            &mut alloc,
        )
    };
    assert_failed(st, rfaas_status::RFAAS_ERR_CONNECT, "cannot connect");
    // SAFETY: from client(), freed once.
    unsafe { rfaas_client_free(c) };
}

#[test]
fn an_unreachable_executor_is_a_retryable_connect_error() {
    let c = client();
    let port = closed_port();
    let exec = CString::new(port.clone()).unwrap();
    let token = CString::new("token").unwrap();
    let mut alloc = null_mut();
    let st = allocate(c, exec.as_ptr(), token.as_ptr(), b"\x7fELF", &mut alloc);
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_CONNECT,
        &format!("cannot connect to the executor at {port}"),
    );
    assert!(rfaas_status_is_retryable(st as u32));
    assert!(alloc.is_null());

    let garbage = CString::new("not an address").unwrap();
    let st = allocate(c, garbage.as_ptr(), token.as_ptr(), b"\x7fELF", &mut alloc);
    let msg = last_error();
    assert_ne!(st, rfaas_status::RFAAS_OK);
    assert!(msg.contains("not an address"), "{msg}");
    assert!(alloc.is_null());
    // SAFETY: from client(), freed once.
    unsafe { rfaas_client_free(c) };
}

#[test]
fn the_last_error_is_per_thread() {
    // SAFETY: NULL out is what is tested.
    let st = unsafe { rfaas_client_new(null(), null_mut()) };
    assert_eq!(st, rfaas_status::RFAAS_ERR_INVALID_ARGUMENT);
    let mine = last_error();
    std::thread::spawn(|| {
        assert_eq!(last_error(), "", "a new thread has no error yet");
        // SAFETY: NULL handle is what is tested.
        let st = unsafe { rfaas_deallocate(null_mut()) };
        assert_eq!(st, rfaas_status::RFAAS_ERR_INVALID_ARGUMENT);
        assert!(last_error().starts_with("rfaas_deallocate"));
    })
    .join()
    .unwrap();
    assert_eq!(last_error(), mine);
}

#[test]
fn status_names_and_retryability() {
    let name = |s: u32| {
        // SAFETY: rfaas_status_name returns a static C string.
        unsafe { CStr::from_ptr(rfaas_status_name(s)) }
            .to_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(name(0), "RFAAS_OK");
    assert_eq!(
        name(rfaas_status::RFAAS_ERR_REFUSED_NO_CAPACITY as u32),
        "RFAAS_ERR_REFUSED_NO_CAPACITY"
    );
    assert_eq!(name(9999), "RFAAS_UNKNOWN_STATUS");
    assert!(!rfaas_status_is_retryable(0));
    assert!(!rfaas_status_is_retryable(9999));
    assert!(rfaas_status_is_retryable(
        rfaas_status::RFAAS_ERR_REFUSED_NO_CAPACITY as u32
    ));
    assert!(!rfaas_status_is_retryable(
        rfaas_status::RFAAS_ERR_REFUSED_TOKEN_FORGED as u32
    ));
    // One code per cause of a worker's end; the crash code is 12 alone.
    assert_eq!(name(101), "RFAAS_UNKNOWN_STATUS", "101 is retired");
    for (status, expected) in [
        (
            rfaas_status::RFAAS_ERR_WORKER_CRASHED,
            "RFAAS_ERR_WORKER_CRASHED",
        ),
        (
            rfaas_status::RFAAS_ERR_OUT_OF_MEMORY,
            "RFAAS_ERR_OUT_OF_MEMORY",
        ),
        (
            rfaas_status::RFAAS_ERR_EXECUTOR_STOPPED,
            "RFAAS_ERR_EXECUTOR_STOPPED",
        ),
    ] {
        assert_eq!(name(status as u32), expected);
        assert!(rfaas_status_is_retryable(status as u32), "{expected}");
    }
}

#[test]
fn a_request_beyond_the_cluster_is_its_own_status_at_once() {
    let manager = Manager::start(ManagerOptions {
        extra_config: "lost_after_ms = 600000\n".into(),
        ..ManagerOptions::default()
    });
    for name in ["a", "b", "c"] {
        manager.register_node(name, 2, 2048);
    }
    let url = CString::new(manager.url()).unwrap();
    let credential = CString::new(manager.credential("user", "alice", None)).unwrap();
    let mut managers = null_mut();
    let mut lease = null_mut();
    // SAFETY: C strings and writable out-pointers; an hour's deadline,
    // which a retry would wait out.
    let st = unsafe {
        assert_eq!(
            rfaas_managers_new(url.as_ptr(), credential.as_ptr(), &mut managers),
            rfaas_status::RFAAS_OK
        );
        rfaas_lease_request(managers, 64, 0, 1024, 600, 3_600_000, &mut lease)
    };
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_REQUEST_EXCEEDS_CLUSTER,
        "the largest node offers 2 cores and 2048 MiB, and the cluster has 6 cores on 3 nodes",
    );
    assert!(lease.is_null());
    assert!(!rfaas_status_is_retryable(st as u32));
    assert_eq!(rfaas_last_error_info().next, rfaas_next::RFAAS_NEXT_FIX);
    // At once: one request, refused, no retry.
    assert_eq!(manager.denials("request_exceeds_cluster"), 1);
    // SAFETY: rfaas_status_name returns a static C string.
    let name = unsafe { CStr::from_ptr(rfaas_status_name(st as u32)) };
    assert_eq!(name.to_str().unwrap(), "RFAAS_ERR_REQUEST_EXCEEDS_CLUSTER");

    // An allocation that leases for itself is refused the same way.
    let client = client();
    let library = CString::new(c_library().to_str().unwrap()).unwrap();
    let echo = CString::new("echo").unwrap();
    let names = [echo.as_ptr()];
    let mut opts = rfaas_alloc_options_default();
    opts.cores = 64;
    let mut alloc = null_mut();
    // SAFETY: live handles, C strings, writable out-pointer.
    let st = unsafe {
        rfaas_leased_allocate(
            managers,
            client,
            600,
            3_600_000,
            true,
            &opts,
            library.as_ptr(),
            names.as_ptr(),
            1,
            &mut alloc,
        )
    };
    assert_failed(
        st,
        rfaas_status::RFAAS_ERR_REQUEST_EXCEEDS_CLUSTER,
        "ask for at most that",
    );
    assert!(alloc.is_null());
    // SAFETY: handles made above, freed once.
    unsafe {
        rfaas_client_free(client);
        rfaas_managers_free(managers);
    }
}
