//! `rfaas_leased_allocate` against a real `rfaas-manager` and a real
//! `rfaas-executord` that accepts the manager's tokens: an allocation that
//! holds its own lease, whose `rfaas_deallocate` releases it.

use std::ffi::{CStr, CString};
use std::ptr::null_mut;

use rfaas::*;
use rfaas_testkit::executord::{daemon_binary, Executord, ExecutordOptions};
use rfaas_testkit::functions::c_library;
use rfaas_testkit::manager::{Api, Manager, ManagerOptions};
use serde_json::json;

fn ok(status: rfaas_status) {
    let why = rfaas_last_error();
    let why = if why.is_null() {
        String::new()
    } else {
        // SAFETY: non-null, NUL-terminated, valid until the next call.
        unsafe { CStr::from_ptr(why) }
            .to_string_lossy()
            .into_owned()
    };
    assert_eq!(status, rfaas_status::RFAAS_OK, "{why}");
}

#[test]
fn a_leased_allocation_serves_and_deallocation_releases_its_lease() {
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
    let user = Api::new(m.url(), &credential);

    let urls = CString::new(m.url()).unwrap();
    let cred = CString::new(credential).unwrap();
    let tcp = CString::new("tcp").unwrap();
    let library = CString::new(c_library().to_str().unwrap()).unwrap();
    let echo_name = CString::new("echo").unwrap();
    let names = [echo_name.as_ptr()];
    let mut managers = null_mut();
    let mut client = null_mut();
    let mut alloc = null_mut();
    let mut opts = rfaas_alloc_options_default();
    opts.mode = rfaas_mode::RFAAS_MODE_WARM;
    opts.output_capacity = 4096;
    // SAFETY: C strings, writable out-pointers, live handles.
    unsafe {
        ok(rfaas_managers_new(
            urls.as_ptr(),
            cred.as_ptr(),
            &mut managers,
        ));
        ok(rfaas_client_new(tcp.as_ptr(), &mut client));
        ok(rfaas_leased_allocate(
            managers,
            client,
            60,
            10_000,
            true,
            &opts,
            library.as_ptr(),
            names.as_ptr(),
            1,
            &mut alloc,
        ));
    }
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
