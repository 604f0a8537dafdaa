//! `rfaas_leased_allocate` against a real `rfaas-manager` and a real
//! `rfaas-executord` that accepts the manager's tokens: an allocation that
//! holds its own lease, whose `rfaas_deallocate` releases it.

use std::ffi::{CStr, CString};
use std::ptr::null_mut;

use rfaas::*;
use rfaas_testkit::executord::{daemon_binary, Executord, ExecutordOptions};
use rfaas_testkit::functions::{c_library, CrashOnce};
use rfaas_testkit::manager::{Api, Manager, ManagerOptions};
use serde_json::json;

#[track_caller]
fn ok(status: rfaas_status) {
    assert_eq!(status, rfaas_status::RFAAS_OK, "{}", last_error());
}

/// A manager, an executor that accepts its tokens registered with it as
/// node-a (4 cores, 4096 MiB), and a user credential ("nobody").
struct Site {
    m: Manager,
    d: Executord,
    credential: String,
}

impl Site {
    fn new() -> Site {
        let m = Manager::start(ManagerOptions {
            extra_config: "lost_after_ms = 600000\n".into(),
            ..ManagerOptions::default()
        });
        let d = Executord::start(
            &daemon_binary(),
            ExecutordOptions {
                node_name: "node-a".into(),
                accept_keys: vec![m.public_key_line()],
                ..ExecutordOptions::default()
            },
        );
        let node = Api::new(m.url(), &m.credential("node", "node-a", None));
        let body = json!({"control_addr": d.control_addr().to_string(),
            "providers": [{"name": "tcp", "host": "127.0.0.1"}], "cores": 4, "memory_mib": 4096});
        let (s, r) = node.call("PUT", "/v1/nodes/node-a", Some(&body));
        assert_eq!(s, 200, "{r}");
        let credential = m.credential("user", "nobody", None);
        Site { m, d, credential }
    }

    /// `rfaas_leased_allocate` of `functions` of the C library with
    /// `opts`, for 60 s, retrying elsewhere or not; the managers, the
    /// client and the allocation, for the caller to free.
    fn allocate(
        &self,
        opts: &rfaas_alloc_options,
        functions: &[&str],
    ) -> (
        *mut rfaas_managers,
        *mut rfaas_client,
        *mut rfaas_allocation,
    ) {
        let urls = CString::new(self.m.url()).unwrap();
        let cred = CString::new(self.credential.clone()).unwrap();
        let tcp = CString::new("tcp").unwrap();
        let library = CString::new(c_library().to_str().unwrap()).unwrap();
        let names: Vec<CString> = functions
            .iter()
            .map(|f| CString::new(*f).unwrap())
            .collect();
        let ptrs: Vec<_> = names.iter().map(|n| n.as_ptr()).collect();
        let (mut managers, mut client, mut alloc) = (null_mut(), null_mut(), null_mut());
        // SAFETY: C strings, writable out-pointers, live handles.
        unsafe {
            ok(rfaas_managers_new(
                urls.as_ptr(),
                cred.as_ptr(),
                &mut managers,
            ));
            ok(rfaas_client_new(tcp.as_ptr(), &mut client));
            let st = rfaas_leased_allocate(
                managers,
                client,
                60,
                10_000,
                true,
                opts,
                library.as_ptr(),
                ptrs.as_ptr(),
                ptrs.len(),
                &mut alloc,
            );
            assert_eq!(
                st,
                rfaas_status::RFAAS_OK,
                "{}\n{}",
                last_error(),
                self.d.log()
            );
        }
        (managers, client, alloc)
    }
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

#[test]
fn a_leased_allocation_serves_and_deallocation_releases_its_lease() {
    let site = Site::new();
    let user = Api::new(site.m.url(), &site.credential);
    let echo_name = CString::new("echo").unwrap();
    let mut opts = rfaas_alloc_options_default();
    opts.mode = rfaas_mode::RFAAS_MODE_WARM;
    opts.output_capacity = 4096;
    let (managers, client, alloc) = site.allocate(&opts, &["echo"]);
    let (_, leases) = user.call("GET", "/v1/leases", None);
    let leases = leases.as_array().expect("a list").clone();
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(leases[0]["state"], "active");
    let grant = leases[0]["grant_id"].as_u64().unwrap();

    let mut index = 0u32;
    let mut input = null_mut();
    let mut output = null_mut();
    let mut len = 0usize;
    // SAFETY: live handles; the buffers hold 4 bytes.
    unsafe {
        ok(rfaas_function_index(alloc, echo_name.as_ptr(), &mut index));
        ok(rfaas_buffer_new(alloc, 4, &mut input));
        ok(rfaas_buffer_new(alloc, 4, &mut output));
        rfaas_buffer_data(input).cast::<u32>().write_unaligned(42);
        ok(rfaas_invoke_retrying(
            alloc, index, input, 4, output, &mut len, 2,
        ));
        assert_eq!(len, 4);
        assert_eq!(rfaas_buffer_data(output).cast::<u32>().read_unaligned(), 42);
        ok(rfaas_deallocate(alloc));
        rfaas_buffer_free(input);
        rfaas_buffer_free(output);
        rfaas_client_free(client);
        rfaas_managers_free(managers);
    }
    let (_, rows) = user.call("GET", &format!("/v1/leases/{grant}"), None);
    assert_eq!(rows[0]["state"], "released", "{rows}");
}

/// On a lease exactly the allocation's size, `rfaas_invoke_retrying` of a
/// function that crashes once succeeds on a fresh worker under the same
/// lease, and the crash stays readable: one retry, and the last error is
/// the crash with its signal. The function touches 256 MiB before it
/// crashes, so its worker takes a while to end, as a big one does.
fn after_a_crash_invoke_retrying_succeeds(lanes: u32) {
    let site = Site::new();
    let mut opts = rfaas_alloc_options_default();
    opts.mode = rfaas_mode::RFAAS_MODE_WARM;
    opts.cores = lanes;
    opts.memory_mib = 512;
    opts.output_capacity = 4096;
    let (managers, client, alloc) = site.allocate(&opts, &["echo", "fault_segfault_once"]);
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
        assert_eq!(
            st,
            rfaas_status::RFAAS_OK,
            "{}\n{}",
            last_error(),
            site.d.log()
        );
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
        rfaas_client_free(client);
        rfaas_managers_free(managers);
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
