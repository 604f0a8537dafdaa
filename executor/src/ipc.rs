//! The daemon ↔ worker channel: control frames
//! ([`rfaas_proto::control::Frame`]) over a unix stream socket (a socket
//! pair), each carrying up to [`MAX_FDS`] file descriptors (SCM_RIGHTS), and
//! sealed memfds to pass function libraries in.
//!
//! A frame's descriptors ride on its first bytes: [`send_frame`] attaches
//! them to the first `sendmsg`, [`recv_frame`] collects them, in order,
//! while reading the frame header. Received descriptors are close-on-exec.

use std::io::{self, Read, Write};
use std::mem;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rfaas_proto::control::{ControlError, Frame, FrameHeader, FrameLimits, FRAME_HEADER_LEN};

/// Most descriptors one frame carries.
pub const MAX_FDS: usize = 4;

/// Sends `frame` on `sock`, with `fds` attached (SCM_RIGHTS, at most
/// [`MAX_FDS`]).
///
/// The descriptors are duplicated into the receiver; the caller keeps its
/// own.
pub fn send_frame(sock: &UnixStream, frame: &Frame, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a control frame carries at most {MAX_FDS} descriptors, not {}",
                fds.len()
            ),
        ));
    }
    let bytes = frame.to_bytes();
    let mut sent = 0;
    if !fds.is_empty() {
        sent = send_with_fds(sock, &bytes, fds)?;
    }
    let mut w = sock;
    w.write_all(&bytes[sent..])?;
    w.flush()
}

/// One `sendmsg` of (a prefix of) `bytes` with `fds` (1 to [`MAX_FDS`])
/// attached; returns the bytes sent (at least one).
fn send_with_fds(sock: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    let fds_len = (mem::size_of::<libc::c_int>() * fds.len()) as u32;
    let mut cmsg = CmsgBuf::new();
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.0.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is a pure size computation.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(fds_len) } as _;
    // SAFETY: msg_control points at a buffer of msg_controllen bytes (at
    // most 32 for MAX_FDS ints, within CmsgBuf's 64), big enough for one
    // cmsghdr with fds.len() ints, so CMSG_FIRSTHDR is non-null and the
    // ints after CMSG_DATA lie inside it.
    unsafe {
        let hdr = libc::CMSG_FIRSTHDR(&msg);
        (*hdr).cmsg_level = libc::SOL_SOCKET;
        (*hdr).cmsg_type = libc::SCM_RIGHTS;
        (*hdr).cmsg_len = libc::CMSG_LEN(fds_len) as _;
        let data = libc::CMSG_DATA(hdr).cast::<libc::c_int>();
        for (i, fd) in fds.iter().enumerate() {
            std::ptr::write_unaligned(data.add(i), fd.as_raw_fd());
        }
    }
    loop {
        // SAFETY: msg and everything it points to live across the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Ancillary-data buffer, aligned for `cmsghdr`, room for a few descriptors.
#[repr(C, align(8))]
struct CmsgBuf([u8; 64]);

impl CmsgBuf {
    fn new() -> CmsgBuf {
        CmsgBuf([0; 64])
    }
}

/// Receives one frame from `sock`, refusing it before its body when it
/// breaks `limits`, with the descriptors that came with it, in the order
/// they were sent.
///
/// A frame refused for its size leaves the stream mid-frame: close the
/// connection after an error.
pub fn recv_frame(
    sock: &UnixStream,
    limits: FrameLimits,
) -> Result<(Frame, Vec<OwnedFd>), ControlError> {
    let mut head = [0u8; FRAME_HEADER_LEN];
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut got = 0;
    while got < FRAME_HEADER_LEN {
        let n = recv_with_fds(sock, &mut head[got..], &mut fds)?;
        if n == 0 {
            return Err(ControlError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer closed the control socket",
            )));
        }
        got += n;
    }
    let header = FrameHeader::decode(&head, limits)?;
    let mut json = vec![0u8; header.json_len as usize];
    let mut r = sock;
    r.read_exact(&mut json)?;
    let mut blob = vec![0u8; header.blob_len as usize];
    r.read_exact(&mut blob)?;
    Ok((
        Frame {
            kind: header.kind,
            json,
            blob,
        },
        fds,
    ))
}

/// One `recvmsg` into `buf`; passed descriptors are appended to `fds`
/// (those beyond [`MAX_FDS`] are closed).
fn recv_with_fds(sock: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut cmsg = CmsgBuf::new();
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.0.as_mut_ptr().cast();
    msg.msg_controllen = cmsg.0.len() as _;
    let n = loop {
        // SAFETY: msg points at live buffers of the lengths it states.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    };
    // SAFETY: the kernel filled msg_control with msg_controllen bytes of
    // well-formed cmsg headers; the CMSG_* macros walk within them.
    unsafe {
        let mut hdr = libc::CMSG_FIRSTHDR(&msg);
        while !hdr.is_null() {
            if (*hdr).cmsg_level == libc::SOL_SOCKET && (*hdr).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(hdr);
                let payload = (*hdr).cmsg_len as usize - (data as usize - hdr as usize);
                let count = payload / mem::size_of::<libc::c_int>();
                for i in 0..count {
                    let raw = std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i));
                    // The kernel installed `raw` in this process for us; we
                    // own it (and close it at once past the limit).
                    let fd = OwnedFd::from_raw_fd(raw);
                    if fds.len() < MAX_FDS {
                        fds.push(fd);
                    }
                }
            }
            hdr = libc::CMSG_NXTHDR(&msg, hdr);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the peer passed more descriptors than a control frame carries",
        ));
    }
    Ok(n)
}

/// A memfd holding `bytes`, sealed so nobody can change, shrink or grow it
/// (`F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`), positioned
/// at offset 0 and close-on-exec. `name` shows in `/proc/<pid>/fd`.
pub fn sealed_memfd(name: &str, bytes: &[u8]) -> io::Result<OwnedFd> {
    let cname = std::ffi::CString::new(name.replace('\0', "_"))
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: cname is a valid C string for the call.
    let raw =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create just returned this descriptor to us.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut file = std::fs::File::from(fd);
    file.write_all(bytes)?;
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor we own.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    io::Seek::seek(&mut file, io::SeekFrom::Start(0))?;
    Ok(OwnedFd::from(file))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfaas_proto::control::client::Deallocate;
    use std::os::fd::AsFd;

    fn frame(blob: Vec<u8>) -> Frame {
        Frame::new(
            &Deallocate {
                request_id: 7,
                allocation_id: 9,
            },
            blob,
        )
    }

    #[test]
    fn round_trip_with_a_sealed_memfd() {
        let (a, b) = UnixStream::pair().unwrap();
        let bytes: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let memfd = sealed_memfd("rfaas-test", &bytes).unwrap();
        let other = sealed_memfd("rfaas-test-2", b"second").unwrap();
        let sent = frame(vec![1, 2, 3]);
        send_frame(&a, &sent, &[memfd.as_fd(), other.as_fd()]).unwrap();
        send_frame(&a, &frame(vec![]), &[]).unwrap();

        let (got, fds) = recv_frame(&b, FrameLimits::default()).unwrap();
        assert_eq!(got, sent);
        assert_eq!(fds.len(), 2, "both descriptors arrive with the frame");
        let mut fds = fds.into_iter();
        let mut back = Vec::new();
        // The received descriptor shares the file offset (0) with ours.
        std::fs::File::from(fds.next().unwrap())
            .read_to_end(&mut back)
            .unwrap();
        assert_eq!(back, bytes);
        let mut second = Vec::new();
        std::fs::File::from(fds.next().unwrap())
            .read_to_end(&mut second)
            .unwrap();
        assert_eq!(second, b"second", "in the order they were sent");

        let (second, fds) = recv_frame(&b, FrameLimits::default()).unwrap();
        assert_eq!(second, frame(vec![]));
        assert!(fds.is_empty());
    }

    #[test]
    fn too_many_descriptors_are_refused_before_sending() {
        let (a, _b) = UnixStream::pair().unwrap();
        let fd = sealed_memfd("rfaas-test", b"x").unwrap();
        let many = vec![fd.as_fd(); MAX_FDS + 1];
        let err = send_frame(&a, &frame(vec![]), &many).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn sealed_memfd_refuses_writes_and_resizes() {
        let fd = sealed_memfd("rfaas-test", b"hello").unwrap();
        let mut file = std::fs::File::from(fd);
        assert!(file.write_all(b"x").is_err());
        assert!(file.set_len(1).is_err());
        assert!(file.set_len(100).is_err());
        // SAFETY: fcntl on a descriptor we own.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        assert_eq!(
            seals,
            libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL
        );
    }

    #[test]
    fn oversized_frame_is_refused_before_its_body() {
        let (a, b) = UnixStream::pair().unwrap();
        send_frame(&a, &frame(vec![0; 4096]), &[]).unwrap();
        let limits = FrameLimits {
            max_json: 1 << 10,
            max_blob: 1024,
        };
        let err = recv_frame(&b, limits).unwrap_err();
        assert!(
            matches!(
                err,
                ControlError::TooLarge {
                    what: "blob",
                    len: 4096,
                    limit: 1024
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn closed_peer_is_an_io_error() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        let err = recv_frame(&b, FrameLimits::default()).unwrap_err();
        assert!(matches!(err, ControlError::Io(ref e) if e.kind() == io::ErrorKind::UnexpectedEof));
    }
}
