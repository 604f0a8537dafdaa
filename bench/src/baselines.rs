//! Raw baselines: the fastest a plain program can do on this machine, with
//! the peer in its own process (see `child.rs`), all on 127.0.0.1.
//!
//! | row | what one sample is |
//! |---|---|
//! | `raw_tcp_pingpong` | TCP_NODELAY round trip, both ends spinning on non-blocking reads |
//! | `raw_tcp_pingpong_blocking` | the same with blocking reads |
//! | `raw_shm_pingpong` | round trip through a shared memfd, both ends spinning on a sequence word |
//! | `raw_shm_pingpong_blocking` | the same, both ends sleeping on a futex |
//! | `raw_socket_bandwidth` | one-way TCP stream until the receiver's one-byte ack |
//! | `memcpy_bandwidth` | in-process copy between two page-aligned buffers |
//!
//! The blocking shm baseline never spins before it sleeps: it is the pure
//! cost of a cross-process futex wake-up, the floor for a warm path that
//! sleeps. A spin-then-sleep hybrid would measure the spin whenever the reply
//! is quick, and is what `raw_shm_pingpong` already bounds.

use std::hint::{black_box, spin_loop};
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::{self, NonNull};
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::child::{peer_arg, Peer, PeerSpec, Ready};
use crate::error::{Context, Error, Result};
use crate::report::{Report, Row};
use crate::rows::{Ctx, Kind, Provider, RowSpec, Runner, Suite};
use crate::stats::time_round_trips;

// Row names, as `--rows` and the report spell them.
const TCP_PINGPONG: &str = "raw_tcp_pingpong";
const TCP_PINGPONG_BLOCKING: &str = "raw_tcp_pingpong_blocking";
const SHM_PINGPONG: &str = "raw_shm_pingpong";
const SHM_PINGPONG_BLOCKING: &str = "raw_shm_pingpong_blocking";
const SOCKET_BANDWIDTH: &str = "raw_socket_bandwidth";
const MEMCPY_BANDWIDTH: &str = "memcpy_bandwidth";

// Peer names, as `--serve` spells them.
const TCP_ECHO: &str = "raw_tcp_echo";
const SHM_ECHO: &str = "raw_shm_echo";
const TCP_SINK: &str = "raw_tcp_sink";

pub const SUITE: Suite = Suite {
    rows: &[
        RowSpec {
            name: TCP_PINGPONG,
            help: "the same round trip by a plain program: TCP with TCP_NODELAY, both ends spinning on non-blocking reads",
            runner: Runner::PerProvider {
                kind: Some(Kind::Tcp),
                run: |ctx, _, out| tcp_pingpong(ctx, TCP_PINGPONG, Wait::Spin, out),
            },
        },
        RowSpec {
            name: TCP_PINGPONG_BLOCKING,
            help: "raw_tcp_pingpong with both ends asleep in read(): the bar for warm invocations on tcp",
            runner: Runner::PerProvider {
                kind: Some(Kind::Tcp),
                run: |ctx, _, out| tcp_pingpong(ctx, TCP_PINGPONG_BLOCKING, Wait::Block, out),
            },
        },
        RowSpec {
            name: SHM_PINGPONG,
            help: "two processes spinning on a shared cache line, the payload copied",
            runner: Runner::PerProvider {
                kind: Some(Kind::Shm),
                run: |ctx, _, out| shm_pingpong(ctx, SHM_PINGPONG, Wait::Spin, out),
            },
        },
        RowSpec {
            name: SHM_PINGPONG_BLOCKING,
            help: "raw_shm_pingpong with both ends asleep on a futex: the bar for warm invocations on shm",
            runner: Runner::PerProvider {
                kind: Some(Kind::Shm),
                run: |ctx, _, out| shm_pingpong(ctx, SHM_PINGPONG_BLOCKING, Wait::Block, out),
            },
        },
        RowSpec {
            name: SOCKET_BANDWIDTH,
            help: "one blocking TCP stream over loopback",
            runner: Runner::PerProvider {
                kind: Some(Kind::Tcp),
                run: socket_bandwidth,
            },
        },
        RowSpec {
            name: MEMCPY_BANDWIDTH,
            help: "one process copying between two buffers (provider `mem`)",
            runner: Runner::Once(memcpy_bandwidth),
        },
    ],
    peers: &[
        PeerSpec {
            name: TCP_ECHO,
            serve: serve_tcp_echo,
        },
        PeerSpec {
            name: SHM_ECHO,
            serve: serve_shm_echo,
        },
        PeerSpec {
            name: TCP_SINK,
            serve: serve_tcp_sink,
        },
    ],
};

/// How a side waits for the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Busy-poll: never leave the CPU.
    Spin,
    /// Sleep in the kernel until woken.
    Block,
}

impl Wait {
    fn arg(self) -> String {
        match self {
            Wait::Spin => "spin".to_owned(),
            Wait::Block => "block".to_owned(),
        }
    }
}

impl FromStr for Wait {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "spin" => Ok(Wait::Spin),
            "block" => Ok(Wait::Block),
            _ => Err(Error::new(format!(
                "wait mode `{s}` is neither spin nor block"
            ))),
        }
    }
}

// ---------------------------------------------------------------- TCP ----

fn tcp_pingpong(ctx: &Ctx, name: &str, wait: Wait, out: &mut Report) -> Result<()> {
    for &size in &ctx.sizes {
        let peer = ctx.spawn_peer(TCP_ECHO, &[wait.arg(), size.to_string()], &[])?;
        let addr = peer.addr().to_owned();
        let mut stream = TcpStream::connect(&addr)
            .context(|| format!("could not connect to the {TCP_ECHO} peer at {addr}"))?;
        configure_stream(&stream, wait)
            .context(|| format!("could not configure the connection to {addr}"))?;
        let msg = vec![0xa5u8; size];
        let mut reply = vec![0u8; size];
        let summary = time_round_trips(ctx.warmup, ctx.iters, || {
            write_all(&mut stream, &msg)
                .and_then(|()| read_exact(&mut stream, &mut reply))
                .and_then(|open| match open {
                    true => Ok(()),
                    false => Err(io::ErrorKind::UnexpectedEof.into()),
                })
                .context(|| format!("{name}: the {size}-byte round trip with {addr} failed"))
        })?;
        drop(stream);
        peer.finish()?;
        out.push(&Row::latency(name, "tcp", size, summary))?;
    }
    Ok(())
}

fn configure_stream(stream: &TcpStream, wait: Wait) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_nonblocking(wait == Wait::Spin)
}

/// `--serve raw_tcp_echo <spin|block> <size>`: echoes `size`-byte messages.
fn serve_tcp_echo(args: &[String], ready: Ready) -> Result<()> {
    let wait: Wait = peer_arg(args, 0, "wait mode")?;
    let size: usize = peer_arg(args, 1, "message size")?;
    let listener = TcpListener::bind("127.0.0.1:0")
        .context(|| "the echo peer could not listen on 127.0.0.1".to_owned())?;
    let addr = listener
        .local_addr()
        .context(|| "the echo peer could not read its own address".to_owned())?;
    ready.announce(&addr.to_string())?;
    let (mut stream, _) = listener
        .accept()
        .context(|| format!("the echo peer could not accept on {addr}"))?;
    configure_stream(&stream, wait)
        .context(|| "the echo peer could not configure its connection".to_owned())?;
    let mut buf = vec![0u8; size];
    while read_exact(&mut stream, &mut buf).context(|| "the echo peer could not read".to_owned())? {
        write_all(&mut stream, &buf).context(|| "the echo peer could not reply".to_owned())?;
    }
    Ok(())
}

/// Writes all of `buf`, spinning while a non-blocking socket is full.
///
/// Hot path.
#[inline]
fn write_all(stream: &mut TcpStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        match stream.write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => spin_loop(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Fills `buf`, spinning on EAGAIN if the socket is non-blocking. `false` if
/// the other end closed before the first byte.
///
/// Hot path.
#[inline]
fn read_exact(stream: &mut TcpStream, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match stream.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => spin_loop(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Socket buffer for the bandwidth row; the kernel caps it at
/// `net.core.{w,r}mem_max`.
const SOCKET_BUFFER: usize = 4 << 20;

fn socket_bandwidth(ctx: &Ctx, _: &Provider, out: &mut Report) -> Result<()> {
    for &size in &ctx.bw_sizes {
        let count = ctx.bw_messages(size);
        let total = count * size as u64;
        let peer = ctx.spawn_peer(TCP_SINK, &[total.to_string(), size.to_string()], &[])?;
        let addr = peer.addr().to_owned();
        let mut stream = TcpStream::connect(&addr)
            .context(|| format!("could not connect to the {TCP_SINK} peer at {addr}"))?;
        set_socket_buffer(stream.as_fd(), libc::SO_SNDBUF)
            .context(|| format!("could not enlarge the send buffer towards {addr}"))?;
        let msg = vec![0xa5u8; size];
        let mut ack = [0u8; 1];
        let start = Instant::now();
        for _ in 0..count {
            stream
                .write_all(&msg)
                .context(|| format!("{SOCKET_BANDWIDTH}: sending to {addr} failed"))?;
        }
        stream
            .read_exact(&mut ack)
            .context(|| format!("{SOCKET_BANDWIDTH}: {addr} sent no acknowledgement"))?;
        let elapsed = start.elapsed();
        drop(stream);
        peer.finish()?;
        out.push(&Row::bandwidth(
            SOCKET_BANDWIDTH,
            "tcp",
            size,
            total,
            elapsed,
        ))?;
    }
    Ok(())
}

/// `--serve raw_tcp_sink <total bytes> <message size>`: reads `total` bytes,
/// then writes one ack byte.
fn serve_tcp_sink(args: &[String], ready: Ready) -> Result<()> {
    let total: u64 = peer_arg(args, 0, "byte count")?;
    let size: usize = peer_arg(args, 1, "message size")?;
    let listener = TcpListener::bind("127.0.0.1:0")
        .context(|| "the sink peer could not listen on 127.0.0.1".to_owned())?;
    // Set on the listener so the window scale of the accepted socket fits it.
    set_socket_buffer(listener.as_fd(), libc::SO_RCVBUF)
        .context(|| "the sink peer could not enlarge its receive buffer".to_owned())?;
    let addr = listener
        .local_addr()
        .context(|| "the sink peer could not read its own address".to_owned())?;
    ready.announce(&addr.to_string())?;
    let (mut stream, _) = listener
        .accept()
        .context(|| format!("the sink peer could not accept on {addr}"))?;
    let mut buf = vec![0u8; size.max(256 << 10)];
    let mut left = total;
    while left > 0 {
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        match stream.read(&mut buf[..want]) {
            Ok(0) => {
                return Err(Error::new(format!(
                    "the sink peer's connection closed with {left} of {total} bytes outstanding"
                )))
            }
            Ok(n) => left -= n as u64,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e).context(|| "the sink peer could not read".to_owned()),
        }
    }
    stream
        .write_all(&[1])
        .context(|| "the sink peer could not acknowledge".to_owned())?;
    Ok(())
}

fn set_socket_buffer(fd: BorrowedFd<'_>, option: libc::c_int) -> io::Result<()> {
    let bytes = SOCKET_BUFFER as libc::c_int;
    // SAFETY: `bytes` is a c_int that outlives the call and its size is passed.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            ptr::from_ref(&bytes).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

// ------------------------------------------------------------- memory ----

/// A private or shared mapping, unmapped on drop.
#[derive(Debug)]
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mapping {
    /// Page-aligned private memory, every page touched.
    fn anonymous(len: usize, fill: u8) -> io::Result<Mapping> {
        let map = Self::map(len, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1)?;
        // SAFETY: the mapping is `len` writable bytes owned by `map`.
        unsafe { ptr::write_bytes(map.ptr.as_ptr(), fill, len) };
        Ok(map)
    }

    /// `len` bytes of `fd`, shared with every process that maps it.
    fn shared(fd: BorrowedFd<'_>, len: usize) -> io::Result<Mapping> {
        Self::map(len, libc::MAP_SHARED, fd.as_raw_fd())
    }

    fn map(len: usize, flags: libc::c_int, fd: RawFd) -> io::Result<Mapping> {
        // SAFETY: a fresh mapping at an address of the kernel's choosing
        // aliases nothing in this process.
        let ptr = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Mapping { ptr, len })
    }

    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is the mapping this value owns; no reference
        // into it outlives `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

fn memcpy_bandwidth(ctx: &Ctx, out: &mut Report) -> Result<()> {
    for &size in &ctx.bw_sizes {
        let src = Mapping::anonymous(size, 0xa5)
            .context(|| format!("could not map a {size}-byte source buffer"))?;
        let dst = Mapping::anonymous(size, 0)
            .context(|| format!("could not map a {size}-byte destination buffer"))?;
        let count = ctx.bw_messages(size);
        let copy = || {
            // SAFETY: both mappings are `size` bytes, distinct, and alive.
            unsafe {
                ptr::copy_nonoverlapping(black_box(src.as_ptr()), black_box(dst.as_ptr()), size)
            };
            // The destination escapes, so the copy cannot be elided.
            black_box(dst.as_ptr());
        };
        copy();
        let start = Instant::now();
        for _ in 0..count {
            copy();
        }
        let elapsed = start.elapsed();
        out.push(&Row::bandwidth(
            MEMCPY_BANDWIDTH,
            "mem",
            size,
            count * size as u64,
            elapsed,
        ))?;
    }
    Ok(())
}

// ---------------------------------------------------------------- shm ----

/// One direction's control line: its own 128-byte block, so the two
/// directions never share a cache line nor an adjacent-line prefetch pair.
#[repr(C, align(128))]
struct Line {
    /// Spinning mode: the number of the last message written.
    seq: AtomicU64,
    /// Blocking mode: the same, as the 32-bit futex word.
    futex: AtomicU32,
}

/// Start of the shared mapping; payload areas follow at page boundaries.
#[repr(C)]
struct Header {
    to_peer: Line,
    to_initiator: Line,
}

const PAGE: usize = 4096;

/// Where things are in the shared mapping for `size`-byte messages.
#[derive(Debug, Clone, Copy)]
struct ShmLayout {
    size: usize,
}

impl ShmLayout {
    fn area(self) -> usize {
        self.size.div_ceil(PAGE).max(1) * PAGE
    }

    fn to_peer_payload(self) -> usize {
        PAGE
    }

    fn to_initiator_payload(self) -> usize {
        PAGE + self.area()
    }

    fn len(self) -> usize {
        PAGE + 2 * self.area()
    }
}

/// The two ends of the mapping as one side sees them.
struct ShmEnd<'a> {
    tx: &'a Line,
    tx_payload: *mut u8,
    rx: &'a Line,
    rx_payload: *mut u8,
    size: usize,
}

fn shm_ends(map: &Mapping, layout: ShmLayout, initiator: bool) -> ShmEnd<'_> {
    const _: () = assert!(std::mem::size_of::<Header>() <= PAGE);
    // SAFETY: the mapping is page-aligned, at least one page long and starts
    // zeroed (a valid Header: all atomics 0); it outlives the borrow.
    let header = unsafe { &*map.as_ptr().cast::<Header>() };
    // SAFETY: both offsets plus `size` lie within `layout.len()` bytes.
    let (to_peer, to_initiator) = unsafe {
        (
            map.as_ptr().add(layout.to_peer_payload()),
            map.as_ptr().add(layout.to_initiator_payload()),
        )
    };
    let size = layout.size;
    if initiator {
        ShmEnd {
            tx: &header.to_peer,
            tx_payload: to_peer,
            rx: &header.to_initiator,
            rx_payload: to_initiator,
            size,
        }
    } else {
        ShmEnd {
            tx: &header.to_initiator,
            tx_payload: to_initiator,
            rx: &header.to_peer,
            rx_payload: to_peer,
            size,
        }
    }
}

impl ShmEnd<'_> {
    /// Copies `msg` out and publishes it as message `n`.
    ///
    /// Hot path.
    #[inline]
    fn send(&self, msg: &[u8], n: u64, wait: Wait) -> io::Result<()> {
        debug_assert_eq!(msg.len(), self.size);
        // SAFETY: the payload area holds `size` bytes; the other side reads it
        // only after seeing `n`, which is published below with Release.
        unsafe { ptr::copy_nonoverlapping(msg.as_ptr(), self.tx_payload, self.size) };
        match wait {
            Wait::Spin => {
                self.tx.seq.store(n, Ordering::Release);
                Ok(())
            }
            Wait::Block => {
                self.tx.futex.store(n as u32, Ordering::Release);
                futex_wake(&self.tx.futex)
            }
        }
    }

    /// Waits for message `n` and copies it into `buf`. With `peer`, fails
    /// instead of waiting forever once that process has died.
    ///
    /// Hot path.
    #[inline]
    fn recv(&self, buf: &mut [u8], n: u64, wait: Wait, peer: Option<&Peer>) -> io::Result<()> {
        let gone = || peer.is_some_and(|p| !p.is_alive());
        match wait {
            Wait::Spin => {
                let mut spins = 0u32;
                while self.rx.seq.load(Ordering::Acquire) != n {
                    spin_loop();
                    spins = spins.wrapping_add(1);
                    if spins % LIVENESS_SPINS == 0 && gone() {
                        return Err(peer_gone());
                    }
                }
            }
            Wait::Block => loop {
                // No spinning first: see the module comment.
                let seen = self.rx.futex.load(Ordering::Acquire);
                if seen == n as u32 {
                    break;
                }
                let timeout = peer.map(|_| LIVENESS_SLEEP);
                if futex_wait(&self.rx.futex, seen, timeout)? == Woke::TimedOut && gone() {
                    return Err(peer_gone());
                }
            },
        }
        // SAFETY: message `n` was fully written before its Release store,
        // which the Acquire load above observed; the writer does not touch
        // the area again until we answer.
        unsafe { ptr::copy_nonoverlapping(self.rx_payload, buf.as_mut_ptr(), self.size) };
        black_box(buf);
        Ok(())
    }
}

/// Spins between two checks that the peer still lives (tens of ms).
const LIVENESS_SPINS: u32 = 1 << 20;
/// Longest futex sleep between two such checks. Far beyond any wake-up, so
/// the timer never fires in a healthy run.
const LIVENESS_SLEEP: Duration = Duration::from_secs(1);

fn peer_gone() -> io::Error {
    io::Error::other("the peer process died; its own error, if any, is printed above")
}

#[derive(Debug, PartialEq, Eq)]
enum Woke {
    /// Woken, interrupted, or the word had already changed.
    Maybe,
    TimedOut,
}

/// Sleeps while `word` still holds `seen` (or returns at once if not), for
/// at most `timeout`.
fn futex_wait(word: &AtomicU32, seen: u32, timeout: Option<Duration>) -> io::Result<Woke> {
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs() as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts.as_ref().map_or(ptr::null(), ptr::from_ref);
    // SAFETY: `word` is a live, aligned u32 and `ts_ptr` is null or points to
    // `ts`, alive until the call returns. Not FUTEX_PRIVATE_FLAG: the waker
    // is another process sharing the mapping.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            ts_ptr,
        )
    };
    if rc == 0 {
        return Ok(Woke::Maybe);
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(Woke::Maybe),
        Some(libc::ETIMEDOUT) => Ok(Woke::TimedOut),
        _ => Err(err),
    }
}

/// Wakes the one waiter on `word`, if any.
fn futex_wake(word: &AtomicU32) -> io::Result<()> {
    // SAFETY: as in `futex_wait`.
    let rc = unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, 1) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn shm_pingpong(ctx: &Ctx, name: &str, wait: Wait, out: &mut Report) -> Result<()> {
    for &size in &ctx.sizes {
        let layout = ShmLayout { size };
        // SAFETY: the name is a valid C string; MFD_CLOEXEC keeps the fd from
        // leaking into any process but the peer (see `Peer::spawn`).
        let raw = unsafe { libc::memfd_create(c"rfaas-bench-shm".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error())
                .context(|| format!("{name}: could not create a memfd"));
        }
        // SAFETY: memfd_create just returned this fd; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on an fd we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), layout.len() as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error())
                .context(|| format!("{name}: could not size the memfd to {} bytes", layout.len()));
        }
        let map = Mapping::shared(fd.as_fd(), layout.len())
            .context(|| format!("{name}: could not map the memfd"))?;
        let args = [wait.arg(), fd.as_raw_fd().to_string(), size.to_string()];
        let peer = ctx.spawn_peer(SHM_ECHO, &args, &[fd.as_fd()])?;
        drop(fd);
        let end = shm_ends(&map, layout, true);
        let msg = vec![0xa5u8; size];
        let mut reply = vec![0u8; size];
        let mut n = 0u64;
        let summary = time_round_trips(ctx.warmup, ctx.iters, || {
            n += 1;
            end.send(&msg, n, wait)
                .and_then(|()| end.recv(&mut reply, n, wait, Some(&peer)))
                .context(|| format!("{name}: the {size}-byte round trip failed"))
        })?;
        peer.finish()?;
        out.push(&Row::latency(name, "shm", size, summary))?;
    }
    Ok(())
}

/// `--serve raw_shm_echo <spin|block> <fd> <size>`: echoes through the
/// inherited memfd until killed.
fn serve_shm_echo(args: &[String], ready: Ready) -> Result<()> {
    let wait: Wait = peer_arg(args, 0, "wait mode")?;
    let raw: RawFd = peer_arg(args, 1, "memfd number")?;
    let size: usize = peer_arg(args, 2, "message size")?;
    let layout = ShmLayout { size };
    // SAFETY: F_GETFD only inspects the descriptor table.
    if unsafe { libc::fcntl(raw, libc::F_GETFD) } < 0 {
        return Err(io::Error::last_os_error())
            .context(|| format!("the shm peer did not inherit fd {raw}"));
    }
    // SAFETY: the parent passed this fd across exec for us alone; it is open
    // (checked above) and nothing else in this process owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // Mapping past the end of the file would SIGBUS on first touch.
    // SAFETY: `st` is a plain-data out-parameter that fstat fills.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open and `st` is valid for writes.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error())
            .context(|| format!("the shm peer could not stat fd {raw}"));
    }
    if (st.st_size as u64) < layout.len() as u64 {
        return Err(Error::new(format!(
            "fd {raw} holds {} bytes but {size}-byte messages need {}",
            st.st_size,
            layout.len()
        )));
    }
    let map = Mapping::shared(fd.as_fd(), layout.len())
        .context(|| format!("the shm peer could not map fd {raw}"))?;
    drop(fd);
    let end = shm_ends(&map, layout, false);
    let mut buf = vec![0u8; size];
    ready.announce("shm")?;
    for n in 1.. {
        // No liveness check: PR_SET_PDEATHSIG ends this process with the parent.
        end.recv(&mut buf, n, wait, None)
            .and_then(|()| end.send(&buf, n, wait))
            .context(|| "the shm peer's futex call failed".to_owned())?;
    }
    Ok(())
}
