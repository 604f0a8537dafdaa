//! Looking up the lease's user in the node's user database.

use std::ffi::{CStr, CString};
use std::io;

/// A user workers can run as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Login name.
    pub name: String,
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
}

/// Looks `name` up with `getpwnam_r` (NSS, so LDAP and SSSD users count).
/// `Ok(None)` when there is no such user.
pub fn lookup(name: &str) -> io::Result<Option<User>> {
    let cname = CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "user name contains NUL"))?;
    // SAFETY: every pointer is valid for the call, buf's length is passed
    // with it (`passwd_entry`'s contract).
    passwd_entry(|pwd, buf, len, result| unsafe {
        libc::getpwnam_r(cname.as_ptr(), pwd, buf, len, result)
    })
}

/// Looks `uid` up with `getpwuid_r` (NSS, as [`lookup`]). `Ok(None)` when
/// no user has it.
pub fn by_uid(uid: u32) -> io::Result<Option<User>> {
    // SAFETY: as in `lookup`.
    passwd_entry(|pwd, buf, len, result| unsafe { libc::getpwuid_r(uid, pwd, buf, len, result) })
}

/// The entry `get` (`getpwnam_r` or `getpwuid_r`, called with the entry to
/// fill, a buffer and its length, and where to say whether one was found)
/// finds, with a buffer grown as it asks.
fn passwd_entry(
    mut get: impl FnMut(
        &mut libc::passwd,
        *mut libc::c_char,
        usize,
        &mut *mut libc::passwd,
    ) -> libc::c_int,
) -> io::Result<Option<User>> {
    let mut buf = vec![0u8; 1024];
    loop {
        // SAFETY: passwd is plain data; all-zero is a valid value to be
        // filled in.
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        // The strings in pwd point into buf, which outlives their use
        // below.
        let rc = get(&mut pwd, buf.as_mut_ptr().cast(), buf.len(), &mut result);
        if rc == libc::ERANGE && buf.len() < (1 << 20) {
            let bigger = buf.len() * 4;
            buf.resize(bigger, 0);
            continue;
        }
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        if result.is_null() {
            return Ok(None);
        }
        // SAFETY: pw_name is a NUL-terminated string inside buf.
        let name = unsafe { CStr::from_ptr(pwd.pw_name) }
            .to_string_lossy()
            .into_owned();
        return Ok(Some(User {
            name,
            uid: pwd.pw_uid,
            gid: pwd.pw_gid,
        }));
    }
}

/// This process's effective uid.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_and_nobody_and_nonexistent() {
        let root = lookup("root").unwrap().unwrap();
        assert_eq!((root.uid, root.gid), (0, 0));
        let nobody = lookup("nobody").unwrap().unwrap();
        assert_eq!(nobody.uid, 65534);
        assert_eq!(lookup("rfaas-no-such-user-x").unwrap(), None);
        assert_eq!(by_uid(0).unwrap(), Some(root));
        assert_eq!(by_uid(65534).unwrap(), Some(nobody));
        assert_eq!(by_uid(4_000_000_000).unwrap(), None);
    }
}
