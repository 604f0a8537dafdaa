//! Two-process orchestration: the bench re-executes itself (its own binary,
//! `rfaas-bench` or `rfaas-fabric-bench`) as `--serve <what> <args>...` to run
//! the peer side of a row in its own process.
//!
//! The protocol is one line: the peer prints `ready <addr>` on its stdout once
//! it can be reached (a socket address, or anything the row understands). The
//! parent holds the peer in a [`Peer`] guard that kills (SIGKILL) and reaps it
//! by PID when dropped, on success and on every error path. Should the parent
//! itself die, `PR_SET_PDEATHSIG` takes the peer down with it.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::{Context, Error, Result};

/// How long a peer may take from exec to `ready`.
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// A peer-side entry point, selected by `--serve <name>`.
#[derive(Debug, Clone, Copy)]
pub struct PeerSpec {
    pub name: &'static str,
    /// Runs in the peer process. Must call [`Ready::announce`] once it can be
    /// reached, then serve until the parent kills it (or return when done).
    pub serve: fn(args: &[String], ready: Ready) -> Result<()>,
}

/// Proof that the peer has not announced itself yet; consumed by `announce`.
#[derive(Debug)]
pub struct Ready(());

impl Ready {
    /// Tells the parent that the peer can be reached at `addr`.
    pub fn announce(self, addr: &str) -> Result<()> {
        let mut out = io::stdout().lock();
        writeln!(out, "ready {addr}")
            .and_then(|()| out.flush())
            .context(|| "the peer could not tell the bench that it is ready".to_owned())
    }
}

/// Child side of `--serve <what> <args>...`.
pub fn serve(peers: &[PeerSpec], what: &str, args: &[String]) -> Result<()> {
    let peer = peers.iter().find(|p| p.name == what).ok_or_else(|| {
        Error::new(format!(
            "there is no peer called `{what}`; --serve is internal to the bench and knows {}",
            peers.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
        ))
    })?;
    (peer.serve)(args, Ready(()))
}

/// Argument `i` of a peer's `args`, parsed; `what` names it in the error.
pub fn peer_arg<T: std::str::FromStr>(args: &[String], i: usize, what: &str) -> Result<T> {
    let raw = args
        .get(i)
        .ok_or_else(|| Error::new(format!("the peer was started without its {what}")))?;
    raw.parse()
        .map_err(|_| Error::new(format!("the peer's {what} `{raw}` is not valid")))
}

/// A running peer process. Dropping it kills and reaps the process.
#[derive(Debug)]
pub struct Peer {
    child: Child,
    what: String,
    addr: String,
    /// What was read from its stdout past the last whole line.
    pending: Vec<u8>,
}

impl Peer {
    /// Starts `--serve <what> <args>...` and waits for its `ready` line.
    ///
    /// `cpu` pins the peer; `inherit` are file descriptors the peer keeps
    /// across exec (their `FD_CLOEXEC` is cleared in the child only, so no
    /// other process started meanwhile sees them).
    pub fn spawn(
        what: &str,
        args: &[String],
        cpu: Option<usize>,
        inherit: &[BorrowedFd<'_>],
    ) -> Result<Peer> {
        Peer::start(what, args, cpu, inherit, false)
    }

    /// [`Peer::spawn`] with the peer's stdin kept open for
    /// [`Peer::request`]: a peer told what to do while it runs. It ends
    /// when its stdin closes, or is killed on drop.
    pub fn spawn_talking(what: &str, args: &[String]) -> Result<Peer> {
        Peer::start(what, args, None, &[], true)
    }

    fn start(
        what: &str,
        args: &[String],
        cpu: Option<usize>,
        inherit: &[BorrowedFd<'_>],
        talking: bool,
    ) -> Result<Peer> {
        let exe = std::env::current_exe()
            .context(|| "could not find the bench's own executable to start a peer".to_owned())?;
        let mut cmd = Command::new(&exe);
        cmd.arg("--serve")
            .arg(what)
            .args(args)
            .stdin(if talking {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let inherit: Vec<RawFd> = inherit.iter().map(|fd| fd.as_raw_fd()).collect();
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs between fork and exec. It only makes
        // async-signal-safe system calls (prctl, getppid, fcntl,
        // sched_setaffinity) and reads memory allocated before the fork; it
        // neither allocates nor takes locks.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // The parent died before the prctl: nobody will kill us.
                if libc::getppid() != parent {
                    return Err(io::Error::from_raw_os_error(libc::ESRCH));
                }
                for &fd in &inherit {
                    let flags = libc::fcntl(fd, libc::F_GETFD);
                    if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                if let Some(cpu) = cpu {
                    pin_current_thread(cpu)?;
                }
                Ok(())
            });
        }
        let child = cmd.spawn().context(|| {
            format!(
                "could not start the {what} peer process ({} --serve {what})",
                exe.display()
            )
        })?;
        let mut peer = Peer {
            child,
            what: what.to_owned(),
            addr: String::new(),
            pending: Vec::new(),
        };
        // On error `peer` is dropped here, which kills and reaps it.
        peer.addr = peer.wait_ready()?;
        Ok(peer)
    }

    /// What the peer announced after `ready `.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Whether the peer process is still running, without reaping it: its
    /// stdout pipe hangs up when it dies. Cheap enough for a wait loop to
    /// call now and then, not on every turn.
    pub fn is_alive(&self) -> bool {
        let Some(stdout) = self.child.stdout.as_ref() else {
            return true;
        };
        let mut pfd = libc::pollfd {
            fd: stdout.as_raw_fd(),
            events: 0,
            revents: 0,
        };
        // SAFETY: `pfd` is a valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, 0) };
        n <= 0 || pfd.revents & (libc::POLLHUP | libc::POLLERR) == 0
    }

    /// Ends the peer; fails if it had already exited with an error.
    pub fn finish(mut self) -> Result<()> {
        match self.child.try_wait() {
            Ok(Some(status)) if !status.success() => Err(Error::new(format!(
                "the {} peer process failed ({status}); its own error is printed above",
                self.what
            ))),
            _ => Ok(()),
        }
        // Drop kills and reaps.
    }

    /// Sends `line` to a peer started with [`Peer::spawn_talking`] and
    /// returns the line it answers, waiting `within` at most.
    pub fn request(&mut self, line: &str, within: Duration) -> Result<String> {
        let what = self.what.clone();
        let stdin = self.child.stdin.as_mut().ok_or_else(|| {
            Error::new(format!("the {what} peer was not started to be talked to"))
        })?;
        writeln!(stdin, "{line}")
            .and_then(|()| stdin.flush())
            .context(|| format!("could not tell the {what} peer `{line}`"))?;
        self.read_line(within)
            .map_err(|e| Error::new(format!("the {what} peer did not answer `{line}`: {e}")))
    }

    fn wait_ready(&mut self) -> Result<String> {
        let first = self.read_line(READY_TIMEOUT)?;
        first
            .strip_prefix("ready ")
            .map(str::to_owned)
            .ok_or_else(|| {
                Error::new(format!(
                    "the {} peer process printed {first:?} instead of `ready <address>`",
                    self.what
                ))
            })
    }

    /// The next line of the peer's stdout, within `within`.
    fn read_line(&mut self, within: Duration) -> Result<String> {
        let what = self.what.clone();
        let stdout = self
            .child
            .stdout
            .as_mut()
            .ok_or_else(|| Error::new("the peer's stdout was not captured"))?;
        let deadline = Instant::now() + within;
        while !self.pending.contains(&b'\n') {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !poll_readable(stdout.as_raw_fd(), left)? {
                return Err(Error::new(format!(
                    "the {what} peer process printed no line within {} s",
                    within.as_secs()
                )));
            }
            let mut chunk = [0u8; 256];
            let n = match stdout.read(&mut chunk) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(e).context(|| format!("could not read from the {what} peer"));
                }
            };
            if n == 0 {
                let status = self
                    .child
                    .wait()
                    .context(|| format!("could not reap the {what} peer process"))?;
                return Err(Error::new(format!(
                    "the {what} peer process exited ({status}); \
                     its own error is printed above"
                )));
            }
            self.pending.extend_from_slice(&chunk[..n]);
        }
        let end = self
            .pending
            .iter()
            .position(|&b| b == b'\n')
            .unwrap_or(self.pending.len());
        let line: Vec<u8> = self
            .pending
            .drain(..=end.min(self.pending.len() - 1))
            .collect();
        Ok(String::from_utf8_lossy(&line).trim_end().to_owned())
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Kill by PID, then reap so no zombie outlives the row. Both fail only
        // if the child is already gone, which is what we want anyway.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until `fd` is readable (or at EOF). `false` on timeout.
fn poll_readable(fd: RawFd, timeout: Duration) -> Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
    loop {
        // SAFETY: `pfd` is a valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n >= 0 {
            return Ok(n > 0);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err).context(|| "could not wait for the peer to be ready".to_owned());
        }
    }
}

/// The CPUs this process may run on, in ascending order.
pub fn allowed_cpus() -> Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    if rc != 0 {
        return Err(io::Error::last_os_error())
            .context(|| "could not read which CPUs the bench may use".to_owned());
    }
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: `cpu` < CPU_SETSIZE, so CPU_ISSET stays inside `set`.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

/// Pins the calling thread to `cpu`. Async-signal-safe (used after fork).
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    // SAFETY: cpu_set_t is plain data; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: `cpu` < CPU_SETSIZE was checked above.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
