//! [`rfaas_client`] and [`rfaas_allocation`]: creating a client,
//! allocating on an executor, looking up functions, deallocating.

use std::ffi::{c_char, c_void};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ::rfaas_client::{Allocation, AllocationSpec, Client, ClientOptions, Error, LeasedAllocation};
use rfaas_fabric::ProviderKind;
use rfaas_proto::text::count;

use crate::ffi::{call, call_infallible, mut_arg, out_arg, ref_arg, str_arg, CallResult, Failure};
use crate::options::{self, rfaas_alloc_options};
use crate::status::rfaas_next;
use crate::status::rfaas_status::{self, RFAAS_OK};

/// A client: the fabric provider and one control connection per executor,
/// shared by its allocations. Thread-safe. Allocations keep what they need
/// of it, so it may be freed before them.
#[derive(Debug)]
pub struct rfaas_client {
    pub(crate) client: Client,
}

/// A worker on an executor and this process's connections to it.
///
/// Thread-safe for `rfaas_function_index`, `rfaas_buffer_new`,
/// `rfaas_submit` and `rfaas_invoke` (each invocation takes an idle lane).
/// `rfaas_deallocate` must not run concurrently with any other call on it.
#[derive(Debug)]
pub struct rfaas_allocation {
    pub(crate) held: Held,
    /// Invocations not yet freed: they borrow the allocation's lanes.
    pub(crate) live: Arc<AtomicUsize>,
}

/// An allocation made on a given executor, or one holding its own lease
/// (`rfaas_leased_allocate`).
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one per handle, boxed in it already
pub(crate) enum Held {
    Plain(Allocation),
    Leased(LeasedAllocation),
}

impl rfaas_allocation {
    /// The allocation, for calls that do not replace it.
    pub(crate) fn alloc(&self) -> &Allocation {
        match &self.held {
            Held::Plain(a) => a,
            Held::Leased(l) => l,
        }
    }
}

/// Creates a client for the fabric `provider` ("tcp", "shm",
/// "verbs:<device>"); NULL takes `RFAAS_PROVIDER` from the environment, or
/// "tcp". Any other name is `RFAAS_ERR_INVALID_ARGUMENT` at once. Connects
/// nothing yet. Free it with `rfaas_client_free`.
///
/// # Safety
///
/// `provider` is NULL or a NUL-terminated string; `out` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn rfaas_client_new(
    provider: *const c_char,
    out: *mut *mut rfaas_client,
) -> rfaas_status {
    const CALL: &str = "rfaas_client_new";
    call(CALL, || {
        out_arg(CALL, "out", out).map_err(Failure::no_allocation)?;
        let opts = if provider.is_null() {
            let opts = ClientOptions::default();
            if opts.provider.parse::<ProviderKind>().is_err() {
                return Err(Failure::invalid(
                    CALL,
                    format!("the environment's RFAAS_PROVIDER is {:?}, which is no fabric provider; set it to tcp, shm or verbs:<device>, or pass the provider", opts.provider),
                )
                .no_allocation());
            }
            opts
        } else {
            // SAFETY: non-null; the caller promises a C string.
            let p =
                unsafe { str_arg(CALL, "provider", provider) }.map_err(Failure::no_allocation)?;
            if p.parse::<ProviderKind>().is_err() {
                let why = if p.is_empty() {
                    "`provider` is empty".to_owned()
                } else {
                    format!("`provider` is {p:?}, which is no fabric provider")
                };
                return Err(Failure::invalid(
                    CALL,
                    format!("{why}; pass \"tcp\", \"shm\", \"verbs:<device>\" or NULL"),
                )
                .no_allocation());
            }
            ClientOptions::with_provider(p)
        };
        let handle = Box::new(rfaas_client {
            client: Client::new(opts),
        });
        // SAFETY: out is non-null (checked) and writable (caller's promise).
        unsafe { out.write(Box::into_raw(handle)) };
        Ok(RFAAS_OK)
    })
}

/// Frees a client. NULL is ignored. Its allocations stay usable.
///
/// # Safety
///
/// `client` is NULL or a client from `rfaas_client_new`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn rfaas_client_free(client: *mut rfaas_client) {
    call_infallible((), || {
        if !client.is_null() {
            // SAFETY: the caller passes ownership of a Box made by
            // rfaas_client_new.
            drop(unsafe { Box::from_raw(client) });
        }
    });
}

/// Reads `n` function names.
///
/// # Safety
///
/// `names` is NULL or points to `n` readable pointers, each NULL or a C
/// string.
unsafe fn function_names<'a>(
    call: &str,
    names: *const *const c_char,
    n: usize,
) -> Result<Vec<&'a str>, Failure> {
    if n == 0 {
        return Err(Failure::invalid(
            call,
            "no functions named; list the functions you will call",
        ));
    }
    if names.is_null() {
        return Err(Failure::invalid(call, "`functions` is NULL"));
    }
    // SAFETY: non-null, and the caller promises n readable pointers.
    let ptrs = unsafe { std::slice::from_raw_parts(names, n) };
    ptrs.iter()
        .enumerate()
        // SAFETY: each is NULL or a C string (caller's promise).
        .map(|(i, &p)| unsafe { str_arg(call, &format!("functions[{i}]"), p) })
        .collect()
}

/// Shared by rfaas_allocate and rfaas_allocate_file; the arguments are
/// theirs.
///
/// # Safety
///
/// As for `rfaas_allocate`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn allocate(
    call: &str,
    client: *const rfaas_client,
    place: impl FnOnce(&Client, &AllocationSpec) -> Result<Held, Failure>,
    opts: *const rfaas_alloc_options,
    library: impl FnOnce() -> Result<(Vec<u8>, Option<String>), Failure>,
    functions: *const *const c_char,
    n_functions: usize,
    out: *mut *mut rfaas_allocation,
) -> CallResult {
    out_arg(call, "out", out)?;
    // SAFETY: NULL or a live client (caller's promise).
    let client = unsafe { ref_arg(call, "client", client) }?;
    // SAFETY: NULL or n_functions string pointers (caller's promise).
    let names = unsafe { function_names(call, functions, n_functions) }?;
    let (bytes, name) = library()?;
    let mut spec = AllocationSpec::new(bytes, &names);
    if let Some(name) = name {
        spec = spec.library_name(&name);
    }
    // SAFETY: opts is NULL or readable (caller's promise).
    let spec = unsafe { options::apply(call, opts, spec) }?;
    let held = place(&client.client, &spec)?;
    let handle = Box::new(rfaas_allocation {
        held,
        live: Arc::new(AtomicUsize::new(0)),
    });
    // SAFETY: out is non-null (checked) and writable (caller's promise).
    unsafe { out.write(Box::into_raw(handle)) };
    Ok(RFAAS_OK)
}

/// Allocates `spec` on the executor at `executor` under `token`.
///
/// # Safety
///
/// `executor` and `token` are NULL or C strings.
unsafe fn on_executor(
    call: &str,
    client: &Client,
    spec: &AllocationSpec,
    executor: *const c_char,
    token: *const c_char,
) -> Result<Held, Failure> {
    // SAFETY: NULL or a C string (caller's promise).
    let executor = unsafe { str_arg(call, "executor", executor) }?;
    // SAFETY: NULL or a C string (caller's promise).
    let token = unsafe { str_arg(call, "token", token) }?;
    client
        .allocate(executor, token, spec)
        .map(Held::Plain)
        .map_err(|e: Error| Failure::client(call, &e))
}

/// Allocates a worker on the executor at `executor` (its control address,
/// "host:port", or "tls://host:port" for a control port that speaks TLS,
/// as `rfaas_lease_node` gives it) under the lease `token`, ships the function library
/// (`library_len` bytes of an ELF shared object at `library`), resolves
/// `functions` there (`n_functions` names; their order is the function
/// table) and connects the worker's lanes. `opts` NULL takes the defaults.
///
/// On success `*out` is the allocation; end it with `rfaas_deallocate`.
/// The library bytes are copied: they may be freed after the call.
///
/// # Safety
///
/// Every pointer is NULL or valid as described: C strings, `library_len`
/// readable bytes, `n_functions` string pointers, a writable `out`.
#[no_mangle]
pub unsafe extern "C" fn rfaas_allocate(
    client: *const rfaas_client,
    executor: *const c_char,
    token: *const c_char,
    opts: *const rfaas_alloc_options,
    library: *const c_void,
    library_len: usize,
    functions: *const *const c_char,
    n_functions: usize,
    out: *mut *mut rfaas_allocation,
) -> rfaas_status {
    const CALL: &str = "rfaas_allocate";
    call(CALL, || {
        let library = || {
            if library.is_null() || library_len == 0 {
                return Err(Failure::invalid(
                    CALL,
                    "`library` is NULL or `library_len` is 0; pass the shared object's bytes",
                ));
            }
            // SAFETY: non-null, and the caller promises library_len readable
            // bytes.
            let bytes = unsafe { std::slice::from_raw_parts(library.cast::<u8>(), library_len) };
            Ok((bytes.to_vec(), None))
        };
        // SAFETY: the caller's promises, passed on.
        unsafe {
            allocate(
                CALL,
                client,
                |c, spec| on_executor(CALL, c, spec, executor, token),
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

/// `rfaas_allocate` with the library read from the file `library_path`.
///
/// # Safety
///
/// As for `rfaas_allocate`; `library_path` is NULL or a C string.
#[no_mangle]
pub unsafe extern "C" fn rfaas_allocate_file(
    client: *const rfaas_client,
    executor: *const c_char,
    token: *const c_char,
    opts: *const rfaas_alloc_options,
    library_path: *const c_char,
    functions: *const *const c_char,
    n_functions: usize,
    out: *mut *mut rfaas_allocation,
) -> rfaas_status {
    const CALL: &str = "rfaas_allocate_file";
    call(CALL, || {
        let library = || {
            // SAFETY: NULL or a C string (caller's promise).
            unsafe { read_library_file(CALL, library_path) }
        };
        // SAFETY: the caller's promises, passed on.
        unsafe {
            allocate(
                CALL,
                client,
                |c, spec| on_executor(CALL, c, spec, executor, token),
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

/// Reads the function library at `library_path`: its bytes and its file
/// name (which the executor shows in its logs).
///
/// # Safety
///
/// `library_path` is NULL or a C string.
pub(crate) unsafe fn read_library_file(
    call: &str,
    library_path: *const c_char,
) -> Result<(Vec<u8>, Option<String>), Failure> {
    // SAFETY: the caller's promise, passed on.
    let path = unsafe { str_arg(call, "library_path", library_path) }?;
    let bytes = std::fs::read(path).map_err(|e| Failure {
        status: rfaas_status::RFAAS_ERR_IO,
        message: format!("{call}: cannot read the function library {path}: {e}"),
        next: rfaas_next::RFAAS_NEXT_FIX,
        allocation_usable: false,
        signal: 0,
    })?;
    let name = Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned());
    Ok((bytes, name))
}

/// Sets `*index` to the function table index of `name`; fails with
/// `RFAAS_ERR_UNKNOWN_FUNCTION` when the allocation was not made with it.
///
/// # Safety
///
/// `alloc` is NULL or a live allocation; `name` NULL or a C string;
/// `index` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rfaas_function_index(
    alloc: *const rfaas_allocation,
    name: *const c_char,
    index: *mut u32,
) -> rfaas_status {
    const CALL: &str = "rfaas_function_index";
    call(CALL, || {
        out_arg(CALL, "index", index)?;
        // SAFETY: NULL or a live allocation (caller's promise).
        let alloc = unsafe { ref_arg(CALL, "alloc", alloc) }?;
        // SAFETY: NULL or a C string (caller's promise).
        let name = unsafe { str_arg(CALL, "name", name) }?;
        let f = alloc
            .alloc()
            .function(name)
            .map_err(|e| Failure::client(CALL, &e))?;
        // SAFETY: index is non-null (checked) and writable (caller's promise).
        unsafe { index.write(u32::from(f.index())) };
        Ok(RFAAS_OK)
    })
}

/// Writes the name of the node the allocation runs on, and a NUL, into
/// `name`, an array of `size` bytes; `*needed` (when `needed` is not NULL)
/// gets the bytes that takes, NUL included. The name is the one the
/// allocation's lease token names, which the executor checked is its own;
/// after `rfaas_invoke_retrying` moved the allocation, it is the new
/// node's.
///
/// An array too small for it is `RFAAS_ERR_TOO_SMALL`: nothing is written
/// to `name`, but `*needed` is set. Pass NULL and 0 to learn the size that
/// way. A node name the manager accepts has at most 253 bytes, so an
/// array of 256 holds any of them.
///
/// May run alongside `rfaas_submit` and `rfaas_invoke` on the allocation,
/// not alongside `rfaas_invoke_retrying` or `rfaas_deallocate`.
///
/// # Safety
///
/// `alloc` is NULL or a live allocation; `name` is NULL or `size`
/// writable bytes; `needed` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rfaas_allocation_node(
    alloc: *const rfaas_allocation,
    name: *mut c_char,
    size: usize,
    needed: *mut usize,
) -> rfaas_status {
    const CALL: &str = "rfaas_allocation_node";
    call(CALL, || {
        // SAFETY: NULL or a live allocation (caller's promise).
        let alloc = unsafe { ref_arg(CALL, "alloc", alloc) }?;
        // SAFETY: the caller's promises on name, size and needed.
        unsafe { copy_string(CALL, "node name", alloc.alloc().node(), name, size, needed) }
    })
}

/// Writes the control address ("host:port") of the executor the allocation
/// runs on, and a NUL, into `address`, an array of `size` bytes, as
/// `rfaas_allocation_node` writes the node's name (`RFAAS_ERR_TOO_SMALL`
/// and `*needed` alike). After `rfaas_invoke_retrying` moved the
/// allocation, it is the new executor's.
///
/// # Safety
///
/// `alloc` is NULL or a live allocation; `address` is NULL or `size`
/// writable bytes; `needed` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rfaas_allocation_executor(
    alloc: *const rfaas_allocation,
    address: *mut c_char,
    size: usize,
    needed: *mut usize,
) -> rfaas_status {
    const CALL: &str = "rfaas_allocation_executor";
    call(CALL, || {
        // SAFETY: NULL or a live allocation (caller's promise).
        let alloc = unsafe { ref_arg(CALL, "alloc", alloc) }?;
        let executor = alloc.alloc().executor();
        // SAFETY: the caller's promises on address, size and needed.
        unsafe { copy_string(CALL, "executor address", executor, address, size, needed) }
    })
}

/// How many times `rfaas_invoke_retrying` moved the allocation to another
/// node: an allocation of `rfaas_leased_allocate` (with `retry_elsewhere`)
/// when its node was taken back, drained, stopped or lost, a plain one
/// when it went on to a fallback executor (`rfaas_add_fallback_executor`).
/// A fresh worker on the same node is no move. 0 for NULL.
///
/// # Safety
///
/// `alloc` is NULL or a live allocation.
#[no_mangle]
pub unsafe extern "C" fn rfaas_allocation_moves(alloc: *const rfaas_allocation) -> u64 {
    call_infallible(0, || {
        // SAFETY: NULL or a live allocation (caller's promise).
        match unsafe { alloc.as_ref() }.map(|a| &a.held) {
            None => 0,
            Some(Held::Plain(a)) => a.moves(),
            Some(Held::Leased(l)) => l.moves(),
        }
    })
}

/// Copies `text` and a NUL into the caller's array `out` of `size` bytes,
/// and the bytes that takes into `*needed` (when not NULL), also when
/// they do not fit. `what` names the text in messages.
///
/// # Safety
///
/// `out` is NULL or `size` writable bytes; `needed` is NULL or writable.
unsafe fn copy_string(
    call: &str,
    what: &str,
    text: &str,
    out: *mut c_char,
    size: usize,
    needed: *mut usize,
) -> CallResult {
    let bytes = text.len() + 1;
    if !needed.is_null() {
        // SAFETY: non-null, and writable (caller's promise).
        unsafe { needed.write(bytes) };
    }
    if out.is_null() && size != 0 {
        return Err(Failure::invalid(
            call,
            format!("the array is NULL but `size` is {size}; pass an array of `size` bytes, or NULL and 0 to learn the size"),
        ));
    }
    if size < bytes {
        return Err(Failure {
            status: rfaas_status::RFAAS_ERR_TOO_SMALL,
            message: format!(
                "{call}: the {what} {text:?} takes {} with its NUL, but the array holds {}; pass one of at least {bytes} (`needed` says so)",
                count(bytes as u64, "byte"),
                count(size as u64, "byte"),
            ),
            next: rfaas_next::RFAAS_NEXT_FIX,
            allocation_usable: true,
            signal: 0,
        });
    }
    // SAFETY: out holds size >= bytes writable bytes (checked, and the
    // caller's promise); text is the library's own, so they do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), out.cast::<u8>(), text.len());
        out.add(text.len()).write(0);
    }
    Ok(RFAAS_OK)
}

/// Ends the allocation: the executor stops the worker and frees its cores;
/// waits for the executor's confirmation. An allocation made by
/// `rfaas_leased_allocate` also stops its lease's renewal and releases the
/// lease. The handle is freed whatever the
/// result, except when invocations of it are not freed yet: then it fails
/// with `RFAAS_ERR_INVALID_ARGUMENT` and the allocation stays valid. A
/// worker that already ended, or a lost executor, is not an error. Buffers
/// stay valid memory (free them with `rfaas_buffer_free`). NULL is
/// `RFAAS_ERR_INVALID_ARGUMENT`.
///
/// # Safety
///
/// `alloc` is NULL or a live allocation that no other thread is using.
#[no_mangle]
pub unsafe extern "C" fn rfaas_deallocate(alloc: *mut rfaas_allocation) -> rfaas_status {
    const CALL: &str = "rfaas_deallocate";
    call(CALL, || {
        // SAFETY: the caller's promise.
        let handle = unsafe { ref_arg(CALL, "alloc", alloc) }?;
        no_invocations(CALL, handle)?;
        // SAFETY: a Box from rfaas_allocate*, owned by the caller, with no
        // invocation borrowing it (checked above).
        let handle = unsafe { Box::from_raw(alloc) };
        match handle.held {
            Held::Plain(a) => a.deallocate(),
            Held::Leased(l) => l.deallocate(),
        }
        .map_err(|e| Failure::client(CALL, &e).no_allocation())?;
        Ok(RFAAS_OK)
    })
}

/// Refuses `call` while invocations of `handle` are not freed: they borrow
/// its lanes, which the call ends or replaces.
pub(crate) fn no_invocations(call: &str, handle: &rfaas_allocation) -> Result<(), Failure> {
    let live = handle.live.load(Ordering::Acquire);
    if live == 0 {
        return Ok(());
    }
    let (are, them) = if live == 1 {
        ("is", "it")
    } else {
        ("are", "each")
    };
    Err(Failure::invalid(
        call,
        format!(
            "{} of this allocation {are} not freed; call rfaas_invocation_free on {them} first",
            count(live as u64, "invocation")
        ),
    ))
}

/// Moves the allocation's end to that of `token`, a new lease token for
/// the same lease (the manager renewed it, e.g. with `rfaas_lease_renew`):
/// the allocation goes on serving past its old end, until the token's.
/// The executor checks the token as at allocation, and that it names the
/// allocation's lease and ends no earlier; otherwise it refuses
/// (`RFAAS_ERR_REFUSED_LEASE_MISMATCH`, `RFAAS_ERR_REFUSED_TOKEN_FORGED`,
/// ...) and the allocation is unchanged, ending at its old end. A later
/// re-allocation by `rfaas_invoke_retrying` on this executor uses `token`.
/// Renew before the old end: an ended allocation cannot be renewed.
///
/// Not thread-safe: no other call may use the allocation meanwhile.
///
/// # Safety
///
/// `alloc` is NULL or a live allocation no other thread uses; `token` is
/// NULL or a C string.
#[no_mangle]
pub unsafe extern "C" fn rfaas_allocation_renew(
    alloc: *mut rfaas_allocation,
    token: *const c_char,
) -> rfaas_status {
    const CALL: &str = "rfaas_allocation_renew";
    call(CALL, || {
        // SAFETY: NULL or a live allocation no one else uses (caller's
        // promise).
        let handle = unsafe { mut_arg(CALL, "alloc", alloc) }?;
        // SAFETY: NULL or a C string (caller's promise).
        let token = unsafe { str_arg(CALL, "token", token) }?;
        let renewed = match &mut handle.held {
            Held::Plain(a) => a.renew(token),
            Held::Leased(l) => l.renewer().renew(token),
        };
        renewed.map_err(|e| Failure {
            // A refused renewal leaves the allocation as it was.
            allocation_usable: handle.alloc().is_alive(),
            ..Failure::client(CALL, &e)
        })?;
        Ok(RFAAS_OK)
    })
}

/// Adds another executor (its control address, "host:port" or
/// "tls://host:port") and a lease
/// token for its node, for `rfaas_invoke_retrying` to move to when the
/// allocation's executor is lost, stopped, draining or full. Tried in the
/// order added, after the allocation's own executor.
///
/// Not thread-safe: no other call may use the allocation meanwhile.
///
/// # Safety
///
/// `alloc` is NULL or a live allocation no other thread uses; `executor`
/// and `token` are NULL or C strings.
#[no_mangle]
pub unsafe extern "C" fn rfaas_add_fallback_executor(
    alloc: *mut rfaas_allocation,
    executor: *const c_char,
    token: *const c_char,
) -> rfaas_status {
    const CALL: &str = "rfaas_add_fallback_executor";
    call(CALL, || {
        // SAFETY: NULL or a live allocation no one else uses (caller's
        // promise).
        let handle = unsafe { mut_arg(CALL, "alloc", alloc) }?;
        // SAFETY: NULL or a C string (caller's promise).
        let executor = unsafe { str_arg(CALL, "executor", executor) }?;
        // SAFETY: NULL or a C string (caller's promise).
        let token = unsafe { str_arg(CALL, "token", token) }?;
        match &mut handle.held {
            Held::Plain(a) => a.add_fallback_executor(executor, token),
            Held::Leased(_) => {
                return Err(Failure::invalid(
                    CALL,
                    "this allocation holds its own lease (rfaas_leased_allocate) and finds \
                     other nodes through the managers; it takes no fallback executor",
                ))
            }
        }
        Ok(RFAAS_OK)
    })
}
