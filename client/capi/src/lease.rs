//! [`rfaas_managers`] and [`rfaas_lease`]: leases from the resource
//! manager, with the Rust library's backoff and failover.

use std::ffi::{c_char, CString};
use std::time::Duration;

use ::rfaas_client::lease::{Lease, Managers};
use ::rfaas_client::LeaseOptions;
use rfaas_proto::manager::LeaseRequest;

use crate::client::{allocate, rfaas_allocation, rfaas_client, Held};
use crate::ffi::{call, call_infallible, mut_arg, out_arg, ref_arg, str_arg, Failure};
use crate::options::rfaas_alloc_options;
use crate::status::rfaas_status::{self, RFAAS_OK};

/// The resource manager replicas a job asks for leases, and its
/// credential. Thread-safe. Free it with `rfaas_managers_free`; leases
/// keep what they need of it.
#[derive(Debug)]
pub struct rfaas_managers {
    managers: Managers,
}

/// A granted lease: one node lease (an executor's address and a token) per
/// node. Release it with `rfaas_lease_release`.
#[derive(Debug)]
pub struct rfaas_lease {
    lease: Option<Lease>,
    /// Per node lease: executor address and token, as C strings the lease
    /// owns (replaced by a renewal).
    strings: Vec<(CString, CString)>,
}

impl rfaas_lease {
    fn refresh(&mut self) -> Result<(), Failure> {
        let lease = self.lease.as_ref().expect("a lease until released");
        self.strings = lease
            .nodes()
            .into_iter()
            .map(|n| {
                let c = |s: String| {
                    CString::new(s).map_err(|_| {
                        Failure::invalid("rfaas_lease", "the manager sent a string with a NUL byte")
                    })
                };
                Ok((c(n.executor())?, c(n.token)?))
            })
            .collect::<Result<_, Failure>>()?;
        Ok(())
    }
}

/// Connects nothing yet: names the manager replicas, `urls` as
/// `"https://host:port"` separated by commas (NULL: the environment's
/// `RFAAS_MANAGERS`; plain `http://` only to a loopback address), and the
/// job's `credential` (NULL: `RFAAS_CREDENTIAL`). The managers'
/// certificates are checked against the CA file `RFAAS_CA_FILE` names, else
/// the system's roots. A bad URL, an unreadable CA file or an empty
/// credential is `RFAAS_ERR_INVALID_ARGUMENT` at once.
///
/// # Safety
///
/// `urls` and `credential` are NULL or NUL-terminated strings; `out` is
/// NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rfaas_managers_new(
    urls: *const c_char,
    credential: *const c_char,
    out: *mut *mut rfaas_managers,
) -> rfaas_status {
    const CALL: &str = "rfaas_managers_new";
    call(CALL, || {
        out_arg(CALL, "out", out).map_err(Failure::no_allocation)?;
        let env = |name: &str, what: &str| {
            std::env::var(name).map_err(|_| {
                Failure::invalid(CALL, format!("`{what}` is NULL and {name} is not set"))
                    .no_allocation()
            })
        };
        let urls = if urls.is_null() {
            env(::rfaas_client::lease::MANAGERS_ENV, "urls")?
        } else {
            // SAFETY: non-null; the caller promises a C string.
            unsafe { str_arg(CALL, "urls", urls) }
                .map_err(Failure::no_allocation)?
                .to_owned()
        };
        let credential = if credential.is_null() {
            env(::rfaas_client::lease::CREDENTIAL_ENV, "credential")?
        } else {
            // SAFETY: non-null; the caller promises a C string.
            unsafe { str_arg(CALL, "credential", credential) }
                .map_err(Failure::no_allocation)?
                .to_owned()
        };
        let managers = Managers::new(urls.split(','), &credential)
            .map_err(|e| Failure::client(CALL, &e).no_allocation())?;
        // SAFETY: out is non-null (checked) and writable (caller's promise).
        unsafe { out.write(Box::into_raw(Box::new(rfaas_managers { managers }))) };
        Ok(RFAAS_OK)
    })
}

/// Frees the replicas' handle. NULL is ignored. Leases stay usable.
///
/// # Safety
///
/// `managers` is NULL or from `rfaas_managers_new`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn rfaas_managers_free(managers: *mut rfaas_managers) {
    call_infallible((), || {
        if !managers.is_null() {
            // SAFETY: the caller passes ownership of a Box made by
            // rfaas_managers_new.
            drop(unsafe { Box::from_raw(managers) });
        }
    });
}

/// Asks for `cores` cores (at least `min_cores` of them, all or nothing;
/// 0 means `cores`) with `memory_mib` MiB per node, for `duration_s`
/// seconds. While the managers answer that nothing fits, or do not answer,
/// it retries, failing over between the replicas, for up to `deadline_ms`
/// counted from the call; then it fails with
/// `RFAAS_ERR_MANAGER_NO_CAPACITY` or `RFAAS_ERR_MANAGER_UNREACHABLE`
/// (both retryable later).
///
/// The waits between tries grow exponentially (50 ms, 100 ms, ... up to
/// 10 s) with full jitter, and are never shorter than the manager's
/// `Retry-After`, but none ends past the deadline: a wait that would (a
/// `Retry-After` of 10 s with 4 s left) ends at the deadline instead,
/// for a last try there, since a release can free cores sooner than
/// `Retry-After` counts on. `deadline_ms` 0 tries once and never waits.
///
/// A request the cluster can never hold (more memory per node than the
/// largest node offers, or more cores than the nodes with that memory
/// hold together) fails at once
/// with `RFAAS_ERR_REQUEST_EXCEEDS_CLUSTER`, not retryable; the message
/// gives the largest offer. Other refusals waiting cannot change (a quota,
/// a credential) also come back at once.
///
/// # Safety
///
/// `managers` is NULL or from `rfaas_managers_new`; `out` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn rfaas_lease_request(
    managers: *const rfaas_managers,
    cores: u32,
    min_cores: u32,
    memory_mib: u64,
    duration_s: u64,
    deadline_ms: u64,
    out: *mut *mut rfaas_lease,
) -> rfaas_status {
    const CALL: &str = "rfaas_lease_request";
    call(CALL, || {
        out_arg(CALL, "out", out).map_err(Failure::no_allocation)?;
        // SAFETY: the caller promises a live handle or NULL.
        let m = unsafe { ref_arg(CALL, "managers", managers) }.map_err(Failure::no_allocation)?;
        if cores == 0 || min_cores > cores || duration_s == 0 || memory_mib == 0 {
            return Err(Failure::invalid(
                CALL,
                format!(
                    "ask for at least 1 core, 1 MiB and 1 s, with min_cores at most cores (got cores {cores}, min_cores {min_cores}, memory_mib {memory_mib}, duration_s {duration_s})"
                ),
            )
            .no_allocation());
        }
        let req = LeaseRequest {
            cores,
            memory_mib,
            duration_s,
            min_cores: (min_cores != 0).then_some(min_cores),
            nodes: Vec::new(),
        };
        let lease = m
            .managers
            .request(&req, Duration::from_millis(deadline_ms))
            .map_err(|e| Failure::client(CALL, &e).no_allocation())?;
        let mut handle = Box::new(rfaas_lease {
            lease: Some(lease),
            strings: Vec::new(),
        });
        handle.refresh().map_err(Failure::no_allocation)?;
        // SAFETY: out is non-null (checked) and writable (caller's promise).
        unsafe { out.write(Box::into_raw(handle)) };
        Ok(RFAAS_OK)
    })
}

/// How many node leases `lease` holds (0 for NULL).
///
/// # Safety
///
/// `lease` is NULL or a live lease.
#[no_mangle]
pub unsafe extern "C" fn rfaas_lease_nodes(lease: *const rfaas_lease) -> usize {
    call_infallible(0, || {
        // SAFETY: the caller promises NULL or a live lease.
        let l = unsafe { lease.as_ref() };
        l.map_or(0, |l| l.strings.len())
    })
}

/// Node lease `index`: its executor's control address and its token, to
/// pass to `rfaas_allocate`. The address is `tls://host:port` when the
/// executor's control port speaks TLS (its certificate is checked against
/// the CA file `RFAAS_CA_FILE` names, else the system's roots), else
/// `host:port`. The strings belong to the lease and stay valid until it is
/// renewed or released.
///
/// # Safety
///
/// `lease` is NULL or a live lease; `executor` and `token` are NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn rfaas_lease_node(
    lease: *const rfaas_lease,
    index: usize,
    executor: *mut *const c_char,
    token: *mut *const c_char,
) -> rfaas_status {
    const CALL: &str = "rfaas_lease_node";
    call(CALL, || {
        out_arg(CALL, "executor", executor)?;
        out_arg(CALL, "token", token)?;
        // SAFETY: the caller promises NULL or a live lease.
        let l = unsafe { ref_arg(CALL, "lease", lease) }?;
        let Some((e, t)) = l.strings.get(index) else {
            return Err(Failure::invalid(
                CALL,
                format!(
                    "`index` is {index}, but the lease has {} node leases",
                    l.strings.len()
                ),
            ));
        };
        // SAFETY: both out-pointers are non-null (checked) and writable.
        unsafe {
            executor.write(e.as_ptr());
            token.write(t.as_ptr());
        }
        Ok(RFAAS_OK)
    })
}

/// Extends the lease to `duration_s` seconds from now (retrying as
/// `rfaas_lease_request` does, on the same schedule, up to
/// `deadline_ms`). The node leases get new tokens: earlier strings from
/// `rfaas_lease_node` are freed.
///
/// # Safety
///
/// `lease` is NULL or a live lease, not used by another thread meanwhile.
#[no_mangle]
pub unsafe extern "C" fn rfaas_lease_renew(
    lease: *mut rfaas_lease,
    duration_s: u64,
    deadline_ms: u64,
) -> rfaas_status {
    const CALL: &str = "rfaas_lease_renew";
    call(CALL, || {
        // SAFETY: the caller promises NULL or a live, unshared lease.
        let l = unsafe { mut_arg(CALL, "lease", lease) }?;
        if duration_s == 0 {
            return Err(Failure::invalid(
                CALL,
                "`duration_s` is 0; renew for at least 1 s",
            ));
        }
        l.lease
            .as_ref()
            .expect("a lease until released")
            .renew(
                Duration::from_secs(duration_s),
                Duration::from_millis(deadline_ms),
            )
            .map_err(|e| Failure::client(CALL, &e))?;
        l.refresh()?;
        Ok(RFAAS_OK)
    })
}

/// Releases the lease (its executors stop the workers under it) and frees
/// it, also when the release fails: the lease then ends at its expiry, and
/// the status says why. NULL is ignored.
///
/// # Safety
///
/// `lease` is NULL or a live lease, not freed before.
#[no_mangle]
pub unsafe extern "C" fn rfaas_lease_release(lease: *mut rfaas_lease) -> rfaas_status {
    const CALL: &str = "rfaas_lease_release";
    call(CALL, || {
        if lease.is_null() {
            return Ok(RFAAS_OK);
        }
        // SAFETY: the caller passes ownership of a Box made by
        // rfaas_lease_request.
        let mut l = unsafe { Box::from_raw(lease) };
        l.lease
            .take()
            .expect("a lease until released")
            .release()
            .map_err(|e| Failure::client(CALL, &e))?;
        Ok(RFAAS_OK)
    })
}

/// Leases what `opts` asks for (its cores on one node and its memory) for
/// `duration_s` seconds (3 or more), waiting up to `deadline_ms` while no
/// node is free (as `rfaas_lease_request` waits, on the same schedule;
/// `RFAAS_ERR_REQUEST_EXCEEDS_CLUSTER` at once for a request no node can
/// ever hold), then allocates the library at `library_path` with
/// `functions` on the granted node, as `rfaas_allocate_file` does. The
/// allocation holds its lease: a background thread renews it at two
/// thirds of `duration_s` and hands the new token to the executor, and
/// `rfaas_deallocate` releases it.
///
/// With `retry_elsewhere`, `rfaas_invoke_retrying` on it moves to another
/// node when the executor refuses for want of room, drains, stops or dies:
/// it releases the lease, leases again preferring every other node, and
/// allocates there (buffers stay valid), waiting for a lease up to
/// `deadline_ms` again. Without it, it re-allocates on the same node only.
/// `rfaas_add_fallback_executor` does not apply. `rfaas_allocation_node`,
/// `rfaas_allocation_executor` and `rfaas_allocation_moves` say where it
/// runs and how often it moved.
///
/// # Safety
///
/// `managers` is NULL or from `rfaas_managers_new`; the rest as for
/// `rfaas_allocate_file`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn rfaas_leased_allocate(
    managers: *const rfaas_managers,
    client: *const rfaas_client,
    duration_s: u64,
    deadline_ms: u64,
    retry_elsewhere: bool,
    opts: *const rfaas_alloc_options,
    library_path: *const c_char,
    functions: *const *const c_char,
    n_functions: usize,
    out: *mut *mut rfaas_allocation,
) -> rfaas_status {
    const CALL: &str = "rfaas_leased_allocate";
    call(CALL, || {
        // SAFETY: the caller promises a live handle or NULL.
        let m = unsafe { ref_arg(CALL, "managers", managers) }.map_err(Failure::no_allocation)?;
        let library = || {
            // SAFETY: NULL or a C string (caller's promise).
            unsafe { crate::client::read_library_file(CALL, library_path) }
        };
        let options = LeaseOptions::default()
            .deadline(Duration::from_millis(deadline_ms))
            .retry_elsewhere(retry_elsewhere);
        let place = |c: &::rfaas_client::Client, spec: &::rfaas_client::AllocationSpec| {
            m.managers
                .allocate(c, &spec.lease_request(duration_s), spec, &options)
                .map(Held::Leased)
                .map_err(|e| Failure::client(CALL, &e))
        };
        // SAFETY: the caller's promises, passed on.
        unsafe {
            allocate(
                CALL,
                client,
                place,
                opts,
                library,
                functions,
                n_functions,
                out,
            )
        }
        // A failed allocation leaves none to use.
        .map_err(Failure::no_allocation)
    })
}
