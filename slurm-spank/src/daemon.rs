//! One exchange with the node's executor daemon on its local socket, in
//! bounded time.
//!
//! The exchange runs on a thread of its own and the caller waits for it at
//! most the bound: a daemon that accepts but never answers, or a socket
//! whose backlog is full (where even `connect` blocks), costs the hook the
//! bound and nothing more. The socket's own timeouts end that thread soon
//! after.

use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use rfaas_proto::control::local::{LocalReply, LocalRequest};
use rfaas_proto::control::{ControlError, ErrorCode, ErrorReply, Frame, FrameLimits, Kind};

/// Why the daemon did not do what the hook asked. Every variant is a
/// reason to let the job run regardless (fail open).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TalkError {
    /// Nothing at the socket's path.
    #[error(
        "no executor daemon socket at {path}: start rfaas-executord on this node \
         (its local_socket must be this path, or give the path as socket=)"
    )]
    NoSocket {
        /// The socket's path.
        path: PathBuf,
    },
    /// The path exists, but nothing accepts there.
    #[error(
        "cannot connect to the executor daemon at {path}: {source}; is rfaas-executord running?"
    )]
    Connect {
        /// The socket's path.
        path: PathBuf,
        /// What connect said.
        #[source]
        source: io::Error,
    },
    /// No answer within the bound.
    #[error(
        "the executor daemon at {path} did not answer within {limit:?}; \
         raise timeout_ms= (or grace=) if it is only slow"
    )]
    Timeout {
        /// The socket's path.
        path: PathBuf,
        /// The bound.
        limit: Duration,
    },
    /// The exchange broke.
    #[error("talking to the executor daemon at {path}: {source}")]
    Protocol {
        /// The socket's path.
        path: PathBuf,
        /// What broke.
        #[source]
        source: ControlError,
    },
    /// The daemon refused the request.
    #[error("the executor daemon refused the request ({code:?}): {message}")]
    Refused {
        /// Its code.
        code: ErrorCode,
        /// Its sentence.
        message: String,
    },
    /// The daemon answered something a hook does not expect.
    #[error("the executor daemon answered {reply:?}, not what was asked")]
    Unexpected {
        /// The answer.
        reply: Box<LocalReply>,
    },
    /// The hook could not start the thread the exchange runs on.
    #[error("cannot start a thread to talk to the executor daemon: {0}")]
    Thread(#[source] io::Error),
}

/// Sends `req` to the daemon at `socket` and waits at most `limit` for
/// its answer. `Ok` is the daemon's sentence about what it did.
pub fn ask(socket: &Path, req: LocalRequest, limit: Duration) -> Result<String, TalkError> {
    match ask_reply(socket, req, limit)? {
        LocalReply::Done { message } => Ok(message),
        other => Err(TalkError::Unexpected {
            reply: Box::new(other),
        }),
    }
}

/// As [`ask`], returning the daemon's answer whatever it is.
pub fn ask_reply(
    socket: &Path,
    req: LocalRequest,
    limit: Duration,
) -> Result<LocalReply, TalkError> {
    if !socket.exists() {
        return Err(TalkError::NoSocket {
            path: socket.to_path_buf(),
        });
    }
    let (tx, rx) = mpsc::sync_channel(1);
    let path = socket.to_path_buf();
    std::thread::Builder::new()
        .name("rfaas-slurm-talk".into())
        .spawn(move || {
            let _ = tx.send(exchange(&path, &req, limit));
        })
        .map_err(TalkError::Thread)?;
    match rx.recv_timeout(limit) {
        Ok(result) => result,
        // Disconnected: the thread died without an answer, so it panicked.
        Err(_) => Err(TalkError::Timeout {
            path: socket.to_path_buf(),
            limit,
        }),
    }
}

fn exchange(path: &Path, req: &LocalRequest, limit: Duration) -> Result<LocalReply, TalkError> {
    // A socket timeout is the bound running out on this side of the
    // exchange: the same answer the waiting caller gives.
    let protocol = |source: ControlError| match &source {
        ControlError::Io(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            TalkError::Timeout {
                path: path.to_path_buf(),
                limit,
            }
        }
        _ => TalkError::Protocol {
            path: path.to_path_buf(),
            source,
        },
    };
    let mut sock = UnixStream::connect(path).map_err(|source| TalkError::Connect {
        path: path.to_path_buf(),
        source,
    })?;
    let bound = limit.max(Duration::from_millis(1));
    sock.set_read_timeout(Some(bound))
        .and_then(|()| sock.set_write_timeout(Some(bound)))
        .map_err(|e| protocol(e.into()))?;
    Frame::new(req, Vec::new())
        .write_to(&mut sock)
        .map_err(|e| protocol(e.into()))?;
    let frame = Frame::read_from(&mut sock, FrameLimits::default()).map_err(protocol)?;
    if frame.kind == Kind::Error {
        let e: ErrorReply = frame.parse().map_err(protocol)?;
        return Err(TalkError::Refused {
            code: e.code,
            message: e.message,
        });
    }
    frame.parse::<LocalReply>().map_err(protocol)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    fn temp_socket(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("rfaas-slurm-talk-{}-{name}", std::process::id()))
    }

    #[test]
    fn a_missing_socket_says_so() {
        let path = temp_socket("missing");
        let e = ask(
            &path,
            LocalRequest::SlurmOffer { job_id: 1 },
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert!(matches!(e, TalkError::NoSocket { .. }), "{e}");
        assert!(e.to_string().contains("rfaas-executord"), "{e}");
    }

    #[test]
    fn a_silent_daemon_costs_the_bound() {
        let path = temp_socket("silent");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let e = ask(
            &path,
            LocalRequest::SlurmOffer { job_id: 1 },
            Duration::from_millis(200),
        )
        .unwrap_err();
        assert!(matches!(e, TalkError::Timeout { .. }), "{e}");
        drop(listener);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn refusals_and_answers() {
        let path = temp_socket("answers");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            for reply in [
                Frame::new(
                    &ErrorReply {
                        request_id: 0,
                        code: ErrorCode::MalformedRequest,
                        message: "unknown command".into(),
                    },
                    vec![],
                ),
                Frame::new(
                    &LocalReply::Done {
                        message: "offered 4 CPUs".into(),
                    },
                    vec![],
                ),
            ] {
                let (mut s, _) = listener.accept().unwrap();
                let req = Frame::read_from(&mut s, FrameLimits::default()).unwrap();
                assert_eq!(
                    req.parse::<LocalRequest>().unwrap(),
                    LocalRequest::SlurmOffer { job_id: 3 }
                );
                reply.write_to(&mut s).unwrap();
            }
        });
        let limit = Duration::from_secs(10);
        let e = ask(&path, LocalRequest::SlurmOffer { job_id: 3 }, limit).unwrap_err();
        assert!(
            matches!(&e, TalkError::Refused { code: ErrorCode::MalformedRequest, message } if message == "unknown command"),
            "{e}"
        );
        let ok = ask(&path, LocalRequest::SlurmOffer { job_id: 3 }, limit).unwrap();
        assert_eq!(ok, "offered 4 CPUs");
        server.join().unwrap();
        let _ = std::fs::remove_file(&path);
    }
}
