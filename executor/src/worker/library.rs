//! Loading the user's library from its memfd and building the function table.

use std::ffi::{c_void, CStr, CString};
use std::os::fd::{AsRawFd, OwnedFd};

use rfaas_proto::control::ErrorCode;

use super::WorkerError;

/// The rFaaS function signature: reads `in_len` bytes at `in`, writes its
/// output at `out`, returns the output length.
pub type Function = unsafe extern "C" fn(input: *mut c_void, in_len: u32, out: *mut c_void) -> u32;

/// A loaded library and its function table. The library stays loaded for
/// the life of the process (its handle is never closed: lane threads hold
/// its function pointers).
#[derive(Debug)]
pub struct Library {
    _handle: *mut c_void,
    functions: Vec<Function>,
}

// SAFETY: the dlopen handle is only read (never closed), and function
// pointers may be called from any thread.
unsafe impl Send for Library {}
// SAFETY: as above.
unsafe impl Sync for Library {}

impl Library {
    /// `dlopen`s the library in `memfd` through `/proc/self/fd` and resolves
    /// `names` in order. Runs the library's constructors: call it only after
    /// dropping privileges.
    pub fn load(memfd: OwnedFd, names: &[String]) -> Result<Library, WorkerError> {
        let path = format!("/proc/self/fd/{}", memfd.as_raw_fd());
        let cpath = CString::new(path).expect("a path of digits has no NUL");
        // SAFETY: cpath is a valid C string; dlopen runs the library's
        // constructors, which is the point of loading user code.
        let handle = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(WorkerError::failed(
                ErrorCode::MalformedLibrary,
                format!(
                    "the function library could not be loaded: {}; send an ELF shared object built for this node (cc -shared -fPIC)",
                    dl_error()
                ),
            ));
        }
        // The mapping keeps the library; the descriptor is not needed.
        drop(memfd);
        let mut functions = Vec::with_capacity(names.len());
        for name in names {
            let Ok(cname) = CString::new(name.as_str()) else {
                return Err(unknown(name));
            };
            // SAFETY: clear any stale error so a null result can be told
            // apart from a symbol whose value is null.
            unsafe { libc::dlerror() };
            // SAFETY: handle is a live dlopen handle, cname a valid C string.
            let sym = unsafe { libc::dlsym(handle, cname.as_ptr()) };
            if sym.is_null() {
                return Err(unknown(name));
            }
            // SAFETY: the library exports `name` as an rFaaS function; the
            // signature is the contract of every rfaas function library.
            functions.push(unsafe { std::mem::transmute::<*mut c_void, Function>(sym) });
        }
        Ok(Library {
            _handle: handle,
            functions,
        })
    }

    /// The function table, in the order the assignment named them.
    pub fn functions(&self) -> &[Function] {
        &self.functions
    }
}

fn unknown(name: &str) -> WorkerError {
    WorkerError::failed(
        ErrorCode::UnknownFunction,
        format!("the function library has no function named {name:?}; check the name and that the library exports it (nm -D)"),
    )
}

fn dl_error() -> String {
    // SAFETY: dlerror returns null or a C string valid until the next dl call.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null and NUL-terminated, per dlerror's contract.
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    }
}
