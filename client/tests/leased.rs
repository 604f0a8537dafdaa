//! [`LeasedAllocation`] against a real `rfaas-manager` and real
//! `rfaas-executord`s that accept the manager's tokens: background renewal
//! past the first lease's end, release on deallocation and drop, and a move
//! to another node when the executor dies. Needs the daemons built
//! (`cargo build -p rfaas-executor -p rfaas-manager`).
//!
//! Renewal runs on real time here: the executor ends a worker at its
//! token's expiry, and leases count in whole seconds.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rfaas_client::lease::{LeaseRequest, Managers};
use rfaas_client::{
    AllocationSpec, Client, ClientOptions, Error, LeaseOptions, LeasedAllocation, Mode,
};
use rfaas_proto::control::local::{LocalReply, LocalRequest};
use rfaas_testkit::executord::{daemon_binary, Executord, ExecutordOptions};
use rfaas_testkit::functions::{c_library_bytes, CrashOnce};
use rfaas_testkit::manager::{Api, Manager, ManagerOptions};
use rfaas_testkit::process::wait_gone;
use rfaas_testkit::wait::wait_until;
use rstest::rstest;
use serde_json::{json, Value};

/// The manager never loses the test's silent nodes while a test runs.
fn manager() -> Manager {
    Manager::start(ManagerOptions {
        extra_config: "lost_after_ms = 600000\n".into(),
        ..ManagerOptions::default()
    })
}

/// An executor called `name` that accepts `m`'s tokens, registered with
/// `m` under its control address, which requires TLS (the grants say so,
/// and the client library follows them).
fn executor(m: &Manager, name: &str) -> Executord {
    let d = Executord::start(
        &daemon_binary(),
        ExecutordOptions {
            node_name: name.into(),
            accept_keys: vec![m.public_key_line()],
            control_tls: Some(true),
            ..ExecutordOptions::default()
        },
    );
    let api = Api::new(m.url(), &m.credential("node", name, None));
    let body = json!({
        "control_addr": d.control_addr().to_string(),
        "control_tls": true,
        "providers": [{"name": "tcp", "host": "127.0.0.1"}],
        "cores": 4,
        "memory_mib": 4096,
    });
    let (s, r) = api.call("PUT", &format!("/v1/nodes/{name}"), Some(&body));
    assert_eq!(s, 200, "{r}");
    d
}

/// The job's side: managers with a user credential ("nobody": workers run
/// as the lease's user, never root).
fn managers(m: &Manager) -> (Managers, Api) {
    let credential = m.credential("user", "nobody", None);
    (
        Managers::new([m.url()], &credential).unwrap(),
        Api::new(m.url(), &credential),
    )
}

fn request(duration_s: u64, nodes: &[&str]) -> LeaseRequest {
    LeaseRequest {
        cores: 1,
        memory_mib: 256,
        duration_s,
        min_cores: None,
        nodes: nodes.iter().map(|n| n.to_string()).collect(),
    }
}

fn spec() -> AllocationSpec {
    AllocationSpec::new(c_library_bytes(), &["echo"])
        .library_name("libfunctions.so")
        .mode(Mode::Warm)
        .memory_mib(256)
        .cores(1)
}

fn client() -> Client {
    Client::new(ClientOptions::with_provider("tcp"))
}

/// A minute's lease and an allocation under it (with the default options),
/// or a panic with `d`'s log.
fn lease_on(managers: &Managers, d: &Executord) -> LeasedAllocation {
    managers
        .allocate(
            &client(),
            &request(60, &[]),
            &spec(),
            &LeaseOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()))
}

/// Echoes `value` through `la`, retrying as `la` was told to.
fn echo(la: &mut LeasedAllocation, value: u32) -> rfaas_client::Result<u32> {
    let f = la.function("echo")?;
    let mut input = la.buffer::<u32>(1)?;
    let mut output = la.buffer::<u32>(1)?;
    input.write_from(0, &[value]);
    let n = la.invoke_retrying(f, &input, 1, &mut output, 3)?;
    assert_eq!(n, 4);
    Ok(output.to_vec()[0])
}

/// The states of grant `id`'s node leases, as the manager shows them.
fn states(api: &Api, id: u64) -> Vec<String> {
    let (s, r) = api.call("GET", &format!("/v1/leases/{id}"), None);
    assert_eq!(s, 200, "{r}");
    r.as_array()
        .unwrap_or_else(|| panic!("not a list: {r}"))
        .iter()
        .map(|l| l["state"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// Kills the daemon `d` with SIGKILL and waits until it and its one
/// worker are gone (the worker dies of its parent's death, and could
/// answer until then).
fn kill_executor(d: &Executord) {
    let worker = match d.status() {
        LocalReply::Status { allocations, .. } => allocations[0].pid,
        other => panic!("unexpected status reply {other:?}"),
    };
    // SAFETY: kill has no memory preconditions; the pid is the daemon this
    // test started.
    assert_eq!(unsafe { libc::kill(d.pid() as i32, libc::SIGKILL) }, 0);
    wait_gone(d.pid());
    wait_gone(worker);
}

#[test]
fn a_node_that_registers_with_control_tls_is_reached_over_tls_by_its_grants() {
    let m = manager();
    let dir = rfaas_testkit::TempDir::new("tls-node");
    let d = Executord::start(&daemon_binary(), m.node_options(dir.path(), "node-t"));
    let (managers, api) = managers(&m);
    // The daemon registers by itself: its record says TLS.
    let node = rfaas_testkit::wait::wait_for("node-t to register", Duration::from_secs(30), || {
        let (s, r) = api.call("GET", "/v1/nodes/node-t", None);
        (s == 200).then_some(r)
    });
    assert_eq!(node["control_tls"], json!(true), "{node}");
    let mut la = lease_on(&managers, &d);
    assert_eq!(la.executor(), format!("tls://{}", d.control_addr()));
    assert_eq!(echo(&mut la, 9).unwrap(), 9);
    la.deallocate().unwrap();
}

#[test]
fn a_short_lease_is_kept_renewed_past_its_end() {
    let m = manager();
    let d = executor(&m, "node-a");
    let (managers, api) = managers(&m);
    // The manager counts a lease's end in whole seconds from the second it
    // grants it in: asked for late in a second, a 3 s lease lasts just
    // over 2 s, the shortest it can. Time is the subject: the sleep waits
    // for that point of the clock.
    let into = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_millis();
    std::thread::sleep(Duration::from_millis(u64::from((1_950 - into) % 1_000)));
    let la = managers
        .allocate(
            &client(),
            &request(3, &[]),
            &spec(),
            &LeaseOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    let first_end = la.expires_at();
    let id = la.lease_grant_id().unwrap();
    let started = Instant::now();
    let mut i = 0;
    // Past two full lease durations: without renewal the executor would
    // have ended the worker at about 3 s. The clock is the subject; the
    // sleep paces the calls as a job between calls would.
    while started.elapsed() < Duration::from_millis(6_500) {
        i += 1;
        let f = la.function("echo").unwrap();
        let mut input = la.buffer::<u32>(1).unwrap();
        let mut output = la.buffer::<u32>(1).unwrap();
        input.write_from(0, &[i]);
        la.invoke(f, &input, 1, &mut output)
            .unwrap_or_else(|e| panic!("call {i}: {e}\n{}", d.log()));
        assert_eq!(output.to_vec()[0], i);
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(la.renewals() >= 2, "renewals: {}", la.renewals());
    assert!(
        la.expires_at() > first_end,
        "the allocation's end did not move"
    );
    assert_eq!(la.lease_grant_id(), Some(id), "the lease was replaced");
    assert!(la.is_alive());
    assert_eq!(states(&api, id), ["active"]);
    la.deallocate().unwrap();
    assert_eq!(states(&api, id), ["released"]);
}

#[test]
fn deallocation_and_drop_release_the_lease() {
    let m = manager();
    let d = executor(&m, "node-a");
    let (managers, api) = managers(&m);
    let mut la = lease_on(&managers, &d);
    assert_eq!(echo(&mut la, 7).unwrap(), 7);
    let first = la.lease_grant_id().unwrap();
    assert_eq!(states(&api, first), ["active"]);
    la.deallocate().unwrap();
    assert_eq!(states(&api, first), ["released"]);

    let la = lease_on(&managers, &d);
    let second = la.lease_grant_id().unwrap();
    assert_ne!(second, first);
    drop(la);
    assert_eq!(states(&api, second), ["released"]);
    let (_, node) = api.call("GET", "/v1/nodes/node-a", None);
    assert_eq!(node["leased_cores"], Value::from(0), "{node}");
}

#[test]
fn a_dead_executor_is_left_for_another_node() {
    let m = manager();
    let a = executor(&m, "node-a");
    let b = executor(&m, "node-b");
    let (managers, api) = managers(&m);
    let options = LeaseOptions::default().retry_elsewhere(true);
    let mut la = managers
        .allocate(&client(), &request(60, &["node-a"]), &spec(), &options)
        .unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    assert_eq!(la.node(), "node-a");
    assert_eq!(echo(&mut la, 1).unwrap(), 1);
    let first = la.lease_grant_id().unwrap();
    assert_eq!(la.moves(), 0);

    kill_executor(&a);

    assert_eq!(
        echo(&mut la, 2).unwrap_or_else(|e| panic!("{e}\n{}", b.log())),
        2
    );
    assert_eq!(la.node(), "node-b");
    assert_eq!(la.allocation().node(), "node-b", "the token's node");
    assert_eq!(la.executor(), b.executor());
    assert_eq!(la.moves(), 1);
    let second = la.lease_grant_id().unwrap();
    assert_ne!(second, first);
    assert_eq!(states(&api, first), ["released"]);
    assert_eq!(states(&api, second), ["active"]);
    la.deallocate().unwrap();
    assert_eq!(states(&api, second), ["released"]);
}

/// A client whose node is taken back lets go of its allocation before it
/// looks for another node, so the take-back need not wait out its grace
/// even when no other node has room.
#[test]
fn a_moving_client_lets_go_of_its_allocation_first() {
    let m = manager();
    let a = executor(&m, "node-a");
    let (managers, _) = managers(&m);
    let options = LeaseOptions::default()
        .retry_elsewhere(true)
        .deadline(Duration::from_secs(4));
    let mut la = managers
        .allocate(&client(), &request(60, &[]), &spec(), &options)
        .unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    assert_eq!(echo(&mut la, 1).unwrap(), 1);

    let message = std::thread::scope(|scope| {
        let drain = scope.spawn(|| a.local(LocalRequest::Drain { grace_ms: 2000 }));
        wait_until("node-a to drain", Duration::from_secs(10), || {
            matches!(a.status(), LocalReply::Status { draining: true, .. })
        });
        // The drain reaches the worker as a signal, so a call sent at once
        // may still be served. Once the worker refuses, no node has room:
        // the client's search fails, but its allocation on node-a ends
        // before the drain's grace does.
        let mut value = 2;
        wait_until(
            "a call to be refused",
            Duration::from_secs(10),
            || match echo(&mut la, value) {
                Ok(v) => {
                    assert_eq!(v, value, "a call served while the drain began");
                    value += 1;
                    false
                }
                Err(_) => true,
            },
        );
        match drain.join().unwrap() {
            LocalReply::Done { message } => message,
            other => panic!("the drain answered {other:?}"),
        }
    });
    assert!(
        message.starts_with("drained in ")
            && message.ends_with(
                " ms: 1 allocation drained within the 2000 ms grace period, 0 stopped after it, 0 had finished already"
            ),
        "{message}\n{}",
        a.log()
    );
}

#[test]
fn without_retry_elsewhere_a_dead_executor_is_an_error() {
    let m = manager();
    let a = executor(&m, "node-a");
    let _b = executor(&m, "node-b");
    let (managers, _) = managers(&m);
    let mut la = managers
        .allocate(
            &client(),
            &request(60, &["node-a"]),
            &spec(),
            &LeaseOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    assert_eq!(echo(&mut la, 1).unwrap(), 1);
    kill_executor(&a);
    let err = echo(&mut la, 2).unwrap_err();
    assert!(err.is_retryable(), "{err}");
    assert_eq!(la.node(), "node-a");
}

#[test]
fn a_lease_too_short_to_renew_is_refused() {
    let m = manager();
    let (managers, _) = managers(&m);
    let err = managers
        .allocate(
            &client(),
            &request(2, &[]),
            &spec(),
            &LeaseOptions::default(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("duration_s of 3"), "{err}");
}

/// The heap a crashing function touches: its worker takes a while to end,
/// as a big one does.
const HEAP_MIB: u32 = 256;

/// On a lease exactly the allocation's size, a function that crashes once
/// is called again on a fresh worker under the same lease: the new
/// allocation waits until the crashed worker's cores are free rather than
/// failing for good (`exceeds_lease`), and the crash stays readable as the
/// cause of the retry.
#[rstest]
#[case::one_lane(1)]
#[case::two_lanes(2)]
fn after_a_crash_invoke_retrying_succeeds_on_the_same_lease(#[case] lanes: u16) {
    let m = manager();
    let d = executor(&m, "node-a");
    let (managers, _) = managers(&m);
    let spec = AllocationSpec::new(c_library_bytes(), &["echo", "fault_segfault_once"])
        .library_name("libfunctions.so")
        .mode(Mode::Warm)
        .memory_mib(HEAP_MIB + 256)
        .cores(lanes);
    let mut la = managers
        .allocate(
            &client(),
            &spec.lease_request(60),
            &spec,
            &LeaseOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    let (lease, first) = (la.lease_grant_id(), la.id());
    let f = la.function("fault_segfault_once").unwrap();
    let marker = CrashOnce::new();
    let bytes = marker.input(HEAP_MIB);
    let mut input = la.buffer::<u8>(bytes.len()).unwrap();
    input.write_from(0, &bytes);
    let mut output = la.buffer::<u8>(bytes.len()).unwrap();
    let n = la
        .invoke_retrying(f, &input, bytes.len(), &mut output, 1)
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    assert!(marker.crashed(), "the first call crashed");
    assert_eq!(&output.to_vec()[..n], &bytes[..]);
    assert_ne!(la.id(), first, "a new worker");
    assert_eq!(la.lease_grant_id(), lease, "the same lease");
    // The executor names the crash as its worker's end, though the client
    // let go of it at once.
    let log = d.log();
    assert!(
        log.lines().any(|l| l.contains("worker ended")
            && l.contains(&format!("allocation={first} "))
            && l.contains("cause=Crashed")),
        "{log}"
    );
    let causes = la.retry_causes();
    assert!(
        matches!(
            causes,
            [Error::WorkerCrashed {
                signal: Some(11),
                ..
            }]
        ),
        "{causes:?}"
    );
    la.deallocate().unwrap();
}
