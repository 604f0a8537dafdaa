//! The per-fabric thread that watches connections for peer loss.
//!
//! Every established connection's rdma_cm event channel is registered in one
//! epoll set. When rdma_cm reports RDMA_CM_EVENT_DISCONNECTED (the peer closed,
//! or its process died and the kernel closed for it) or DEVICE_REMOVAL, the
//! thread records the connection's fate and moves its QP to ERR, so all its
//! outstanding requests and posted receives complete at once instead of
//! waiting for the transport timeout, and nobody polling a CQ has to look at
//! rdma_cm.
//!
//! Events are handled while holding the registry lock, and an endpoint
//! unregisters (under the same lock) before it destroys anything, so the
//! thread never touches a connection being torn down and never holds the last
//! reference to one.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use super::sys::verb_error;
use crate::error::Result;

/// What the monitor needs of a connection it watches (the connection's
/// module implements it, so the monitor names no connection type). Called
/// on the monitor thread only, never on a post or poll path.
pub(crate) trait Watched: Send + Sync {
    /// The connection's rdma_cm event channel.
    fn channel_fd(&self) -> RawFd;
    /// Handles every queued rdma_cm event of the connection.
    fn handle_cm_events(&self);
}

const WAKE: u64 = u64::MAX;
const EVENTS: usize = 16;

pub(crate) struct MonitorShared {
    epoll: OwnedFd,
    wake: OwnedFd,
    stop: AtomicBool,
    next_key: AtomicU64,
    conns: Mutex<HashMap<u64, Arc<dyn Watched>>>,
    device: String,
}

impl MonitorShared {
    fn conns(&self) -> MutexGuard<'_, HashMap<u64, Arc<dyn Watched>>> {
        self.conns
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The monitor thread and its registry.
pub(crate) struct Monitor {
    shared: Arc<MonitorShared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor")
            .field("device", &self.shared.device)
            .field("connections", &self.shared.conns().len())
            .finish()
    }
}

impl Monitor {
    pub(crate) fn start(device: &str) -> Result<Monitor> {
        // SAFETY: plain syscall; the descriptor is owned just below.
        let epfd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epfd < 0 {
            return Err(verb_error(
                "epoll_create1",
                device,
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: epfd is a fresh descriptor we own.
        let epoll = unsafe { OwnedFd::from_raw_fd(epfd) };
        // SAFETY: plain syscall; the descriptor is owned just below.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(verb_error(
                "eventfd",
                device,
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: efd is a fresh descriptor we own.
        let wake = unsafe { OwnedFd::from_raw_fd(efd) };
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: WAKE,
        };
        // SAFETY: both descriptors are open; ev is valid for the call.
        if unsafe {
            libc::epoll_ctl(
                epoll.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                wake.as_raw_fd(),
                &mut ev,
            )
        } != 0
        {
            return Err(verb_error(
                "epoll_ctl",
                device,
                std::io::Error::last_os_error(),
            ));
        }
        let shared = Arc::new(MonitorShared {
            epoll,
            wake,
            stop: AtomicBool::new(false),
            next_key: AtomicU64::new(1),
            conns: Mutex::new(HashMap::new()),
            device: device.to_owned(),
        });
        let for_thread = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("rfaas-verbs-cm-{device}"))
            .spawn(move || run(&for_thread))
            .map_err(|e| verb_error("spawning the rdma_cm monitor thread", device, e))?;
        Ok(Monitor {
            shared,
            thread: Some(thread),
        })
    }

    /// Watches `conn` until [`Monitor::unregister`]; returns its key.
    pub(crate) fn register(&self, conn: Arc<dyn Watched>) -> Result<u64> {
        let key = self.shared.next_key.fetch_add(1, Ordering::Relaxed);
        let fd = conn.channel_fd();
        let mut conns = self.shared.conns();
        conns.insert(key, conn);
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: key,
        };
        // SAFETY: the epoll and channel descriptors are open (the channel is
        // owned by the conn just inserted); ev is valid for the call.
        if unsafe {
            libc::epoll_ctl(
                self.shared.epoll.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                fd,
                &mut ev,
            )
        } != 0
        {
            let err = std::io::Error::last_os_error();
            conns.remove(&key);
            return Err(verb_error("epoll_ctl", &self.shared.device, err));
        }
        Ok(key)
    }

    /// Stops watching; afterwards the monitor holds no reference to the
    /// connection and runs none of its code.
    pub(crate) fn unregister(&self, key: u64) -> Option<Arc<dyn Watched>> {
        let mut conns = self.shared.conns();
        let conn = conns.remove(&key)?;
        // SAFETY: both descriptors are still open (conn owns the channel).
        unsafe {
            libc::epoll_ctl(
                self.shared.epoll.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                conn.channel_fd(),
                std::ptr::null_mut(),
            )
        };
        Some(conn)
    }

    /// Stops the thread and waits for it.
    pub(crate) fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd.
        unsafe { libc::write(self.shared.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if let Some(thread) = self.thread.take() {
            if thread.thread().id() == std::thread::current().id() {
                return;
            }
            let _ = thread.join();
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(shared: &MonitorShared) {
    // SAFETY: epoll_event is plain old data.
    let mut events: [libc::epoll_event; EVENTS] = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: the epoll descriptor is open while `shared` lives; events
        // has room for EVENTS entries.
        let n = unsafe {
            libc::epoll_wait(
                shared.epoll.as_raw_fd(),
                events.as_mut_ptr(),
                EVENTS as i32,
                -1,
            )
        };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!(device = %shared.device, error = %err, "rdma_cm monitor stopped: epoll_wait failed; peer loss is now noticed only by transport timeouts");
            return;
        }
        for ev in &events[..n as usize] {
            let key = ev.u64;
            if key == WAKE {
                let mut buf = 0u64;
                // SAFETY: reads 8 bytes into a valid u64 from our eventfd.
                unsafe { libc::read(shared.wake.as_raw_fd(), (&mut buf as *mut u64).cast(), 8) };
                if shared.stop.load(Ordering::SeqCst) {
                    return;
                }
                continue;
            }
            let conns = shared.conns();
            if let Some(conn) = conns.get(&key) {
                conn.handle_cm_events();
            }
        }
    }
}
