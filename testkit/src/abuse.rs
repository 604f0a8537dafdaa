//! Clients that misbehave on an executor's control port, without a valid
//! token, for tests and the control bench: connections that send nothing,
//! ones that send a request a byte a second, and ones that send an
//! allocation request with a bogus token and a 64 MiB library, all but its
//! last byte. Each connects from a chosen loopback address (127.0.0.0/8), so
//! the daemon's per-address limits tell them apart from a good client on
//! 127.0.0.1. [`Usage`] reads what the daemon holds from `/proc`.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use rfaas_proto::control::client::AllocateRequest;
use rfaas_proto::control::{Frame, FrameHeader, Kind};

/// Size of the library a stalled connection announces.
pub const STALLED_LIBRARY: u32 = 64 << 20;

/// Connects to `to` from `from` (a loopback address other than 127.0.0.1
/// needs no set-up on Linux).
pub fn connect_from(from: Ipv4Addr, to: SocketAddr) -> io::Result<TcpStream> {
    let SocketAddr::V4(to) = to else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "an IPv4 address is needed",
        ));
    };
    let sockaddr = |a: SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: plain syscall.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is fresh and ours; the stream closes it on every return.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    let local = sockaddr(SocketAddrV4::new(from, 0));
    // SAFETY: `local` is a valid sockaddr_in of `len` bytes.
    if unsafe { libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let remote = sockaddr(to);
    // SAFETY: as above.
    if unsafe { libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stream)
}

/// An allocation request frame (without its library) with a token no
/// executor accepts, announcing `library_len` bytes of library.
pub fn bogus_request(library_len: u32) -> Vec<u8> {
    request_without_library(
        &crate::executord::request("rfaas2.bogus.token".into(), 1, &["echo"]),
        library_len,
    )
}

/// The frame of `req` announcing `library_len` bytes of library, without
/// them.
pub fn request_without_library(req: &AllocateRequest, library_len: u32) -> Vec<u8> {
    let json = Frame::new(req, Vec::new()).json;
    let mut bytes = FrameHeader {
        kind: Kind::AllocateRequest,
        json_len: json.len() as u32,
        blob_len: library_len,
    }
    .encode()
    .to_vec();
    bytes.extend_from_slice(&json);
    bytes
}

/// How many of each to open, from each address.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Source addresses, one set of connections from each.
    pub from: Vec<Ipv4Addr>,
    /// Connections that send nothing.
    pub idle: usize,
    /// Connections that send a request a byte a second.
    pub slow: usize,
    /// Connections that send a bogus request and its library but the
    /// last byte.
    pub stalled: usize,
}

/// Open misbehaving connections; closed (and the slow sender stopped) on
/// drop.
#[derive(Debug)]
pub struct Attack {
    /// Every connection the daemon accepted, idle ones first.
    pub idle: Vec<TcpStream>,
    /// The slow ones (shared with their sender thread).
    slow: Arc<Vec<TcpStream>>,
    /// The stalled ones.
    pub stalled: Vec<TcpStream>,
    /// Connections that could not be opened or written (the daemon closed
    /// them, as its caps allow).
    pub failed: usize,
    stop: Arc<AtomicBool>,
    sender: Option<JoinHandle<()>>,
}

impl Attack {
    /// Opens the connections of `plan` to `to`: idle ones, then slow ones,
    /// then stalled ones, and returns once every stalled one has sent its
    /// library but the last byte (the daemon read or dropped the rest) or
    /// failed.
    pub fn start(to: SocketAddr, plan: &Plan) -> Attack {
        let mut failed = 0;
        let mut open = |n: usize| {
            let mut v = Vec::new();
            for from in &plan.from {
                for _ in 0..n {
                    match connect_from(*from, to) {
                        Ok(s) => v.push(s),
                        Err(_) => failed += 1,
                    }
                }
            }
            v
        };
        let idle = open(plan.idle);
        let slow = Arc::new(open(plan.slow));
        let stalled = open(plan.stalled);
        let stop = Arc::new(AtomicBool::new(false));
        let sender = {
            let (slow, stop) = (Arc::clone(&slow), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("slow-attack".into())
                .spawn(move || {
                    let request = bogus_request(0);
                    let mut at = 0;
                    // One byte a second is the attack itself, not a wait.
                    while !stop.load(Ordering::Relaxed) && at < request.len() {
                        for mut s in slow.iter() {
                            let _ = s.write(&request[at..at + 1]);
                        }
                        at += 1;
                        std::thread::park_timeout(Duration::from_secs(1));
                    }
                })
                .expect("start the slow sender")
        };
        let senders: Vec<_> = stalled
            .iter()
            .map(|s| {
                let s = s.try_clone().expect("clone a stalled connection");
                std::thread::spawn(move || send_all_but_one(s))
            })
            .collect();
        for h in senders {
            if !h.join().expect("a stalled sender") {
                failed += 1;
            }
        }
        Attack {
            idle,
            slow,
            stalled,
            failed,
            stop,
            sender: Some(sender),
        }
    }

    /// Connections open from this side.
    pub fn open(&self) -> usize {
        self.idle.len() + self.slow.len() + self.stalled.len()
    }
}

impl Drop for Attack {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.sender.take() {
            h.thread().unpark();
            let _ = h.join();
        }
    }
}

/// Sends a bogus request and all of its library but the last byte; false
/// when the daemon closed the connection first.
fn send_all_but_one(mut s: TcpStream) -> bool {
    let _ = s.set_write_timeout(Some(Duration::from_secs(60)));
    if s.write_all(&bogus_request(STALLED_LIBRARY)).is_err() {
        return false;
    }
    let chunk = vec![0u8; 1 << 20];
    let mut left = STALLED_LIBRARY as usize - 1;
    while left > 0 {
        let n = left.min(chunk.len());
        if s.write_all(&chunk[..n]).is_err() {
            return false;
        }
        left -= n;
    }
    true
}

/// Whether the peer closed `s` (EOF or a reset), waiting up to `timeout`.
pub fn closed_by_peer(s: &TcpStream, timeout: Duration) -> bool {
    let _ = s.set_read_timeout(Some(timeout));
    let mut buf = [0u8; 4096];
    loop {
        match (&*s).read(&mut buf) {
            Ok(0) => return true,
            // Replies (a refusal) before the close.
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// What a process holds, from `/proc/<pid>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Resident memory, KiB (`VmRSS`).
    pub rss_kib: u64,
    /// Open descriptors.
    pub fds: usize,
    /// Threads.
    pub threads: u64,
}

impl Usage {
    /// Reads `pid`'s usage; panics when the process is gone.
    pub fn of(pid: u32) -> Usage {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_else(|e| panic!("read /proc/{pid}/status: {e}"));
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
        };
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap_or_else(|e| panic!("list /proc/{pid}/fd: {e}"))
            .count();
        Usage {
            rss_kib: field("VmRSS:"),
            fds,
            threads: field("Threads:"),
        }
    }
}

/// Raises this process's soft descriptor limit to at least `n` (up to the
/// hard limit); returns the limit now in force.
pub fn raise_descriptor_limit(n: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read or write the struct we pass.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        if lim.rlim_cur < n {
            lim.rlim_cur = n.min(lim.rlim_max);
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        }
    }
    lim.rlim_cur
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfaas_proto::control::FrameLimits;

    #[test]
    fn connections_come_from_the_chosen_address() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let from = Ipv4Addr::new(127, 0, 0, 7);
        let _c = connect_from(from, l.local_addr().unwrap()).unwrap();
        let (_s, peer) = l.accept().unwrap();
        assert_eq!(peer.ip(), std::net::IpAddr::V4(from));
    }

    #[test]
    fn the_bogus_request_is_a_well_formed_frame() {
        let bytes = bogus_request(0);
        let frame = Frame::read_from(&mut &bytes[..], FrameLimits::default()).unwrap();
        let req: AllocateRequest = frame.parse().unwrap();
        assert!(req.token.contains("bogus"));
        let big = bogus_request(STALLED_LIBRARY);
        let h = FrameHeader::decode(big[..16].try_into().unwrap(), FrameLimits::default()).unwrap();
        assert_eq!(h.blob_len, STALLED_LIBRARY);
    }
}
