//! systemd's readiness protocol (`sd_notify(3)`): one datagram of
//! `KEY=value` lines to the unix socket `$NOTIFY_SOCKET` names. The
//! daemons' units are `Type=notify`, so `systemctl start` returns, and
//! units ordered after them start, only once the daemon says `READY=1`:
//! after it listens and can serve. Without `$NOTIFY_SOCKET` (not started
//! by systemd) every call does nothing.
//!
//! A name starting with `@` is a socket in the abstract namespace, as
//! systemd documents. Errors are returned, never fatal: a daemon that
//! cannot tell systemd it is ready is one systemd times out and restarts,
//! which the log line the caller writes explains.

use std::io;
use std::os::unix::net::UnixDatagram;

/// The environment variable systemd sets for `Type=notify` services.
pub const SOCKET_ENV: &str = "NOTIFY_SOCKET";

/// Tells systemd the daemon serves (`READY=1`) with a one-line status
/// `systemctl status` shows.
pub fn ready(status: &str) -> io::Result<bool> {
    notify(&format!("READY=1\nSTATUS={}", one_line(status)))
}

/// Tells systemd the daemon is stopping (`STOPPING=1`).
pub fn stopping() -> io::Result<bool> {
    notify("STOPPING=1")
}

/// Sends `state` to `$NOTIFY_SOCKET`; `Ok(false)` when it is unset.
pub fn notify(state: &str) -> io::Result<bool> {
    match std::env::var_os(SOCKET_ENV) {
        Some(path) if !path.is_empty() => {
            send_to(&path.to_string_lossy(), state)?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// Sends `state` to the socket `path` (`@name`: abstract namespace).
pub fn send_to(path: &str, state: &str) -> io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    let sent = match path.strip_prefix('@') {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
            sock.send_to_addr(state.as_bytes(), &addr)?
        }
        None => sock.send_to(state.as_bytes(), path)?,
    };
    if sent != state.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!("{SOCKET_ENV} {path} took {sent} of {} bytes", state.len()),
        ));
    }
    Ok(())
}

/// A status is one line: newlines would start new assignments.
fn one_line(status: &str) -> String {
    status.replace(['\n', '\r'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn receive(sock: &UnixDatagram) -> String {
        let mut buf = [0u8; 256];
        let n = sock.recv(&mut buf).expect("a datagram");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn ready_reaches_a_path_socket_with_a_one_line_status() {
        let dir = std::env::temp_dir().join(format!("rfaas-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let sock = UnixDatagram::bind(&path).unwrap();
        send_to(
            path.to_str().unwrap(),
            &format!("READY=1\nSTATUS={}", one_line("serving\non 7100")),
        )
        .unwrap();
        assert_eq!(receive(&sock), "READY=1\nSTATUS=serving on 7100");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_abstract_name_is_reached_by_its_at_sign() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("rfaas-notify-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let sock = UnixDatagram::bind_addr(&addr).unwrap();
        send_to(&format!("@{name}"), "STOPPING=1").unwrap();
        assert_eq!(receive(&sock), "STOPPING=1");
    }

    #[test]
    fn a_missing_socket_is_an_error_not_a_panic() {
        let err = send_to("/nonexistent/rfaas/notify.sock", "READY=1").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }
}
