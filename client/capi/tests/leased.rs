//! `rfaas_leased_allocate` against a real `rfaas-manager` and real
//! `rfaas-executord`s that accept the manager's tokens: an allocation that
//! holds its own lease, whose `rfaas_deallocate` releases it; one that
//! waits for a full node up to its deadline; one that moves when its
//! node is taken back, and says where it went; and one whose function
//! crashed, which `rfaas_invoke_retrying` brings back on the same lease.

use std::ffi::{CStr, CString};
use std::ptr::null_mut;

use rfaas::*;
use rfaas_proto::control::local::{LocalReply, LocalRequest};
use rfaas_testkit::executord::{daemon_binary, Executord, ExecutordOptions};
use rfaas_testkit::functions::{c_library, CrashOnce};
use rfaas_testkit::manager::{Api, Manager, ManagerOptions};
use rfaas_testkit::wait::{wait_until, TIMEOUT};
use serde_json::json;

#[track_caller]
fn ok(status: rfaas_status) {
    assert_eq!(status, rfaas_status::RFAAS_OK, "{}", last_error());
}

fn last_error() -> String {
    let why = rfaas_last_error();
    if why.is_null() {
        return String::new();
    }
    // SAFETY: non-null, NUL-terminated, valid until the next call.
    unsafe { CStr::from_ptr(why) }
        .to_string_lossy()
        .into_owned()
}

/// A manager that never loses the test's silent nodes.
fn manager() -> Manager {
    Manager::start(ManagerOptions {
        extra_config: "lost_after_ms = 600000\n".into(),
        ..ManagerOptions::default()
    })
}

/// An executor called `name` that accepts `m`'s tokens, registered with
/// `m` with 4 cores.
fn executor(m: &Manager, name: &str) -> Executord {
    let d = Executord::start(
        &daemon_binary(),
        ExecutordOptions {
            node_name: name.into(),
            accept_keys: vec![m.public_key_line()],
            ..ExecutordOptions::default()
        },
    );
    let node = Api::new(m.url(), &m.credential("node", name, None));
    let body = json!({"control_addr": d.control_addr().to_string(),
        "providers": [{"name": "tcp", "host": "127.0.0.1"}], "cores": 4, "memory_mib": 4096});
    let (s, r) = node.call("PUT", &format!("/v1/nodes/{name}"), Some(&body));
    assert_eq!(s, 200, "{r}");
    d
}

/// The job's C handles: the managers (as user "nobody") and a client.
struct Job {
    managers: *mut rfaas_managers,
    client: *mut rfaas_client,
}

impl Job {
    fn new(m: &Manager) -> Job {
        let urls = CString::new(m.url()).unwrap();
        let cred = CString::new(m.credential("user", "nobody", None)).unwrap();
        let tcp = CString::new("tcp").unwrap();
        let mut job = Job {
            managers: null_mut(),
            client: null_mut(),
        };
        // SAFETY: C strings and writable out-pointers.
        unsafe {
            ok(rfaas_managers_new(
                urls.as_ptr(),
                cred.as_ptr(),
                &mut job.managers,
            ));
            ok(rfaas_client_new(tcp.as_ptr(), &mut job.client));
        }
        job
    }

    /// `rfaas_leased_allocate` of one warm core serving "echo", for 60 s,
    /// waiting up to `deadline_ms` for a lease.
    fn allocate(&self, deadline_ms: u64, retry_elsewhere: bool) -> *mut rfaas_allocation {
        let mut opts = rfaas_alloc_options_default();
        opts.mode = rfaas_mode::RFAAS_MODE_WARM;
        opts.output_capacity = 4096;
        self.allocate_with(deadline_ms, retry_elsewhere, &opts, &["echo"])
    }

    /// `rfaas_leased_allocate` of `functions` of the C library with
    /// `opts`, for 60 s, waiting up to `deadline_ms` for a lease.
    fn allocate_with(
        &self,
        deadline_ms: u64,
        retry_elsewhere: bool,
        opts: &rfaas_alloc_options,
        functions: &[&str],
    ) -> *mut rfaas_allocation {
        let library = CString::new(c_library().to_str().unwrap()).unwrap();
        let names: Vec<CString> = functions
            .iter()
            .map(|f| CString::new(*f).unwrap())
            .collect();
        let ptrs: Vec<_> = names.iter().map(|n| n.as_ptr()).collect();
        let mut alloc = null_mut();
        // SAFETY: live handles, C strings, a writable out-pointer.
        ok(unsafe {
            rfaas_leased_allocate(
                self.managers,
                self.client,
                60,
                deadline_ms,
                retry_elsewhere,
                opts,
                library.as_ptr(),
                ptrs.as_ptr(),
                ptrs.len(),
                &mut alloc,
            )
        });
        alloc
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // SAFETY: handles made by Job::new, freed once.
        unsafe {
            rfaas_client_free(self.client);
            rfaas_managers_free(self.managers);
        }
    }
}

/// Echoes `value` through `alloc` with `rfaas_invoke_retrying` (3 tries).
fn echo(alloc: *mut rfaas_allocation, value: u32) {
    let name = CString::new("echo").unwrap();
    let mut index = 0u32;
    let mut input = null_mut();
    let mut output = null_mut();
    let mut len = 0usize;
    // SAFETY: a live allocation; the buffers hold 4 bytes and are freed
    // once.
    unsafe {
        ok(rfaas_function_index(alloc, name.as_ptr(), &mut index));
        ok(rfaas_buffer_new(alloc, 4, &mut input));
        ok(rfaas_buffer_new(alloc, 4, &mut output));
        rfaas_buffer_data(input)
            .cast::<u32>()
            .write_unaligned(value);
        ok(rfaas_invoke_retrying(
            alloc, index, input, 4, output, &mut len, 3,
        ));
        assert_eq!(len, 4);
        assert_eq!(
            rfaas_buffer_data(output).cast::<u32>().read_unaligned(),
            value
        );
        rfaas_buffer_free(input);
        rfaas_buffer_free(output);
    }
}

/// The allocation's node and executor, and its moves, as C sees them.
fn whereabouts(alloc: *const rfaas_allocation) -> (String, String, u64) {
    let mut node = [0u8; 256];
    let mut executor = [0u8; 256];
    let mut needed = 0usize;
    // SAFETY: a live allocation; the arrays are 256 bytes.
    let moves = unsafe {
        ok(rfaas_allocation_node(
            alloc,
            node.as_mut_ptr().cast(),
            node.len(),
            &mut needed,
        ));
        ok(rfaas_allocation_executor(
            alloc,
            executor.as_mut_ptr().cast(),
            executor.len(),
            null_mut(),
        ));
        rfaas_allocation_moves(alloc)
    };
    let text = |b: &[u8]| {
        CStr::from_bytes_until_nul(b)
            .unwrap()
            .to_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(needed, text(&node).len() + 1);
    (text(&node), text(&executor), moves)
}

#[test]
fn a_leased_allocation_serves_and_deallocation_releases_its_lease() {
    let m = manager();
    let d = executor(&m, "node-a");
    let user = Api::new(m.url(), &m.credential("user", "nobody", None));
    let job = Job::new(&m);
    let alloc = job.allocate(10_000, true);
    let (_, leases) = user.call("GET", "/v1/leases", None);
    let leases = leases.as_array().expect("a list").clone();
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(leases[0]["state"], "active");
    let grant = leases[0]["grant_id"].as_u64().unwrap();
    assert_eq!(
        whereabouts(alloc),
        ("node-a".into(), d.control_addr().to_string(), 0)
    );

    echo(alloc, 42);
    // SAFETY: a live allocation, freed once.
    ok(unsafe { rfaas_deallocate(alloc) });
    let (_, rows) = user.call("GET", &format!("/v1/leases/{grant}"), None);
    assert_eq!(rows[0]["state"], "released", "{rows}");
}

/// A request that fits, on a node that is full when it comes, waits up to
/// its deadline, though the manager's Retry-After (the soonest expiry:
/// 60 s) lies beyond it, and gets the cores released meanwhile.
#[test]
fn a_full_node_is_waited_for_until_the_deadline() {
    let m = manager();
    let _d = executor(&m, "node-a");
    let bob = Api::new(m.url(), &m.credential("user", "bob", None));
    let (s, grant) = bob.call(
        "POST",
        "/v1/leases",
        Some(&json!({"cores": 4, "memory_mib": 256, "duration_s": 600})),
    );
    assert_eq!(s, 201, "{grant}");
    let job = Job::new(&m);
    let alloc = std::thread::scope(|scope| {
        // Bob lets go once the manager has told the job there is no room.
        scope.spawn(|| {
            wait_until("the job to be denied for lack of room", TIMEOUT, || {
                m.denials("no_capacity") > 0
            });
            let (s, r) = bob.call("DELETE", &format!("/v1/leases/{}", grant["id"]), None);
            assert_eq!(s, 204, "{r}");
        });
        job.allocate(8_000, false)
    });
    echo(alloc, 7);
    // SAFETY: a live allocation, freed once.
    ok(unsafe { rfaas_deallocate(alloc) });
}

/// An allocation whose node is taken back (drained) moves to another node
/// in `rfaas_invoke_retrying`, and says where it runs now.
#[test]
fn a_drained_node_is_left_and_the_allocation_says_where_it_went() {
    let m = manager();
    let a = executor(&m, "node-a");
    let job = Job::new(&m);
    let alloc = job.allocate(10_000, true);
    echo(alloc, 1);
    assert_eq!(
        whereabouts(alloc),
        ("node-a".into(), a.control_addr().to_string(), 0)
    );
    let b = executor(&m, "node-b");

    std::thread::scope(|scope| {
        let drain = scope.spawn(|| a.local(LocalRequest::Drain { grace_ms: 5000 }));
        a.wait_status(TIMEOUT, |s| {
            matches!(s, LocalReply::Status { draining: true, .. })
        });
        // The worker refuses once its SIGUSR1 has run, a moment after the
        // daemon says it drains: every call succeeds, and one soon lands on
        // node-b.
        let mut n = 1;
        wait_until("the allocation to leave the drained node", TIMEOUT, || {
            n += 1;
            echo(alloc, n);
            whereabouts(alloc).0 == "node-b"
        });
        drain.join().unwrap();
    });
    assert_eq!(
        whereabouts(alloc),
        ("node-b".into(), b.control_addr().to_string(), 1)
    );
    // SAFETY: a live allocation, freed once.
    ok(unsafe { rfaas_deallocate(alloc) });
}

/// On a lease exactly the allocation's size, `rfaas_invoke_retrying` of a
/// function that crashes once succeeds on a fresh worker under the same
/// lease, and the crash stays readable: one retry, and the last error is
/// the crash with its signal. The function touches 256 MiB before it
/// crashes, so its worker takes a while to end, as a big one does.
fn after_a_crash_invoke_retrying_succeeds(lanes: u32) {
    let m = manager();
    let d = executor(&m, "node-a");
    let job = Job::new(&m);
    let mut opts = rfaas_alloc_options_default();
    opts.mode = rfaas_mode::RFAAS_MODE_WARM;
    opts.cores = lanes;
    opts.memory_mib = 512;
    opts.output_capacity = 4096;
    let alloc = job.allocate_with(10_000, true, &opts, &["echo", "fault_segfault_once"]);
    let marker = CrashOnce::new();
    let bytes = marker.input(256);
    let name = CString::new("fault_segfault_once").unwrap();
    let (mut index, mut input, mut output, mut len) = (0u32, null_mut(), null_mut(), 0usize);
    // SAFETY: live handles; the buffers hold the input's bytes.
    unsafe {
        ok(rfaas_function_index(alloc, name.as_ptr(), &mut index));
        ok(rfaas_buffer_new(alloc, bytes.len(), &mut input));
        ok(rfaas_buffer_new(alloc, bytes.len(), &mut output));
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            rfaas_buffer_data(input).cast::<u8>(),
            bytes.len(),
        );
        let st = rfaas_invoke_retrying(alloc, index, input, bytes.len(), output, &mut len, 1);
        assert_eq!(st, rfaas_status::RFAAS_OK, "{}\n{}", last_error(), d.log());
        assert_eq!(len, bytes.len());
        assert_eq!(
            std::slice::from_raw_parts(rfaas_buffer_data(output).cast::<u8>(), len),
            &bytes[..]
        );
    }
    assert!(marker.crashed(), "the first call crashed");
    assert_eq!(rfaas_last_retries(), 1);
    let info = rfaas_last_error_info();
    assert_eq!(
        info.status,
        rfaas_status::RFAAS_ERR_WORKER_CRASHED,
        "{}",
        last_error()
    );
    assert_eq!(info.signal, 11);
    assert!(last_error().contains("crashed"), "{}", last_error());
    // SAFETY: live handles, freed once.
    unsafe {
        ok(rfaas_deallocate(alloc));
        rfaas_buffer_free(input);
        rfaas_buffer_free(output);
    }
}

#[test]
fn after_a_crash_invoke_retrying_succeeds_with_one_lane() {
    after_a_crash_invoke_retrying_succeeds(1);
}

#[test]
fn after_a_crash_invoke_retrying_succeeds_with_two_lanes() {
    after_a_crash_invoke_retrying_succeeds(2);
}
