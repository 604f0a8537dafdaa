//! One connection of the loop ([`super::server`]): a non-blocking socket
//! (a control connection's maybe inside TLS), a frame reader that stops at every point where the daemon must decide
//! something (the message is in: check it before its blob), and a bounded
//! outgoing buffer.

use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use rfaas_proto::control::{ControlError, FrameHeader, FrameLimits, Kind, FRAME_HEADER_LEN};

/// JSON a connection may make the daemon hold on its own; beyond it, a
/// message's bytes come from a shared allowance ([`Step`] waits for it).
pub(crate) const FREE_JSON: usize = 16 << 10;

/// Bytes read from one connection per turn of the loop, so one fast
/// sender does not hold up the others.
pub(crate) const READ_PER_TURN: usize = 256 << 10;

/// A control (TCP, maybe inside TLS) or local (unix) stream.
#[derive(Debug)]
pub(crate) enum Stream {
    /// A control connection; with a TLS session once the client started
    /// one, and then the loop's bytes are the plaintext inside it.
    Tcp(TcpStream, Option<Box<rustls::ServerConnection>>),
    Unix(UnixStream),
}

/// The first byte of every TLS connection (a handshake record).
pub(crate) const TLS_HANDSHAKE_BYTE: u8 = 0x16;

/// A non-blocking server-side TLS session over a TCP socket: rustls reads
/// and writes the socket (`read_tls`, `write_tls`) as far as it goes
/// without blocking; what it could not write yet waits in rustls, and the
/// loop watches the socket for writing until it is out
/// ([`Stream::wants_write`]).
struct Tls<'a> {
    tcp: &'a TcpStream,
    tls: &'a mut rustls::ServerConnection,
}

impl Tls<'_> {
    /// Reads plaintext; `Ok(0)` at the end (with or without the peer's
    /// close_notify: frames carry their own lengths, so a cut is seen as
    /// one mid-frame).
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.tls.reader().read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            // No plaintext buffered: take what the socket has (WouldBlock
            // when it has nothing).
            self.tls.read_tls(&mut self.tcp)?;
            if let Err(e) = self.tls.process_new_packets() {
                // The alert that says why, as far as the socket takes it.
                let _ = self.tls.write_tls(&mut self.tcp);
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
            // Handshake answers.
            self.send()?;
        }
    }

    /// Takes what rustls accepts of `buf` and writes what the socket takes.
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.send()?;
        let n = self.tls.writer().write(buf)?;
        self.send()?;
        if n == 0 && !buf.is_empty() {
            // rustls' buffer is full until the socket takes some of it.
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    }

    /// Writes what rustls holds for the socket, as far as it goes.
    fn send(&mut self) -> io::Result<()> {
        while self.tls.wants_write() {
            match self.tls.write_tls(&mut self.tcp) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Stream {
    pub(crate) fn raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s, _) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }

    fn tls(&mut self) -> Option<Tls<'_>> {
        match self {
            Stream::Tcp(tcp, Some(tls)) => Some(Tls { tcp, tls }),
            _ => None,
        }
    }

    pub(crate) fn shutdown_write(&mut self) {
        if let Some(mut t) = self.tls() {
            t.tls.send_close_notify();
            let _ = t.send();
        }
        let _ = match self {
            Stream::Tcp(s, _) => s.shutdown(std::net::Shutdown::Write),
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Write),
        };
    }

    /// The first byte a control connection sent, without taking it:
    /// `Ok(None)` when the peer closed without sending one.
    pub(crate) fn peek_first(&self) -> io::Result<Option<u8>> {
        let mut b = [0u8; 1];
        let n = match self {
            Stream::Tcp(s, None) => s.peek(&mut b)?,
            _ => return Ok(None),
        };
        Ok((n == 1).then_some(b[0]))
    }

    /// Starts TLS on a plain TCP stream, as the server of `config`.
    pub(crate) fn start_tls(
        &mut self,
        config: std::sync::Arc<rustls::ServerConfig>,
    ) -> Result<(), rustls::Error> {
        if let Stream::Tcp(_, tls @ None) = self {
            *tls = Some(Box::new(rustls::ServerConnection::new(config)?));
        }
        Ok(())
    }

    /// Whether a TLS handshake is under way.
    pub(crate) fn handshaking(&self) -> bool {
        matches!(self, Stream::Tcp(_, Some(tls)) if tls.is_handshaking())
    }

    /// Whether TLS bytes wait to be written (the socket must be watched
    /// for writing even with no reply queued).
    pub(crate) fn wants_write(&self) -> bool {
        matches!(self, Stream::Tcp(_, Some(tls)) if tls.wants_write())
    }

    /// Whether bytes already read from the socket wait to be handed out
    /// (decrypted, in rustls): level-triggered epoll does not report them.
    pub(crate) fn buffered(&mut self) -> bool {
        match self {
            Stream::Tcp(_, Some(tls)) => tls
                .process_new_packets()
                .map_or(true, |io| io.plaintext_bytes_to_read() > 0),
            _ => false,
        }
    }

    /// Writes what TLS holds for the socket.
    pub(crate) fn send_pending(&mut self) -> io::Result<()> {
        self.tls().map_or(Ok(()), |mut t| t.send())
    }
}

impl Read for &mut Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(mut t) = self.tls() {
            return t.read(buf);
        }
        match self {
            Stream::Tcp(s, _) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
        }
    }
}

impl Write for &mut Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Some(mut t) = self.tls() {
            return t.write(buf);
        }
        match self {
            Stream::Tcp(s, _) => (&*s).write(buf),
            Stream::Unix(s) => (&*s).write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Where a connection reads.
#[derive(Debug)]
enum ReadState {
    /// Between frames, or inside a header.
    Header {
        buf: [u8; FRAME_HEADER_LEN],
        got: usize,
    },
    /// Inside the JSON; `charged` bytes of it came from the shared allowance.
    Json {
        header: FrameHeader,
        json: Vec<u8>,
        charged: usize,
    },
    /// The message was handed out; the daemon has not yet said what to do
    /// with the blob (it waits for room, or the reader is paused).
    AtBlob { len: u32 },
    /// Reading a blob the daemon accepted.
    Blob { blob: Vec<u8>, len: usize },
    /// Dropping a blob the daemon refused (or that nobody needs).
    Skip { left: u64 },
    /// Dropping whatever comes, until the connection closes.
    Drain,
}

/// What the reader reached.
#[derive(Debug)]
pub(crate) enum Step {
    /// Nothing more now: the socket would block, this turn's share is
    /// used, or the reader waits for the daemon (paused, or for JSON room).
    Wait,
    /// The message's JSON is bigger than [`FREE_JSON`] and the shared
    /// allowance is used up: refuse it (the connection cannot go on
    /// mid-frame).
    NoRoom,
    /// A frame's header and JSON are in. Say what to do with its blob
    /// (`blob_len` bytes, maybe 0): [`FrameReader::take_blob`] or
    /// [`FrameReader::skip_blob`].
    Message {
        kind: Kind,
        json: Vec<u8>,
        blob_len: u32,
        /// JSON bytes charged to the shared allowance, now free again.
        charged: usize,
    },
    /// The blob taken with [`FrameReader::take_blob`] is in.
    Blob(Vec<u8>),
    /// The peer closed the connection (`mid_frame`: inside a frame).
    Eof { mid_frame: bool },
    /// The header is not an acceptable frame header.
    Broken(ControlError),
    /// Reading failed.
    Failed(io::Error),
}

/// Which part of a frame the reader is in, for deadlines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// No byte of a next frame yet.
    Between,
    /// Header or JSON.
    Head,
    /// Waiting for the daemon's word on a blob, reading or skipping one.
    Blob,
    /// Dropping everything.
    Drain,
}

/// Reads frames without blocking, one decision point at a time.
#[derive(Debug)]
pub(crate) struct FrameReader {
    state: ReadState,
    limits: FrameLimits,
}

impl FrameReader {
    pub(crate) fn new(limits: FrameLimits) -> FrameReader {
        FrameReader {
            state: ReadState::Header {
                buf: [0; FRAME_HEADER_LEN],
                got: 0,
            },
            limits,
        }
    }

    pub(crate) fn phase(&self) -> Phase {
        match self.state {
            ReadState::Header { got: 0, .. } => Phase::Between,
            ReadState::Header { .. } | ReadState::Json { .. } => Phase::Head,
            ReadState::AtBlob { .. } | ReadState::Blob { .. } | ReadState::Skip { .. } => {
                Phase::Blob
            }
            ReadState::Drain => Phase::Drain,
        }
    }

    /// Whether the reader waits for [`take_blob`](Self::take_blob) or
    /// [`skip_blob`](Self::skip_blob).
    pub(crate) fn at_blob(&self) -> bool {
        matches!(self.state, ReadState::AtBlob { .. })
    }

    /// Reads the blob after the last [`Step::Message`] into memory.
    pub(crate) fn take_blob(&mut self) {
        if let ReadState::AtBlob { len } = self.state {
            self.state = ReadState::Blob {
                blob: Vec::with_capacity(len as usize),
                len: len as usize,
            };
        }
    }

    /// Drops the blob after the last [`Step::Message`] as it arrives.
    pub(crate) fn skip_blob(&mut self) {
        if let ReadState::AtBlob { len } = self.state {
            self.state = skip(u64::from(len));
        }
    }

    /// Drops the rest of a blob being read into memory (or not yet begun).
    pub(crate) fn skip_rest(&mut self) {
        match &self.state {
            ReadState::Blob { blob, len } => self.state = skip((len - blob.len()) as u64),
            ReadState::AtBlob { len } => self.state = skip(u64::from(*len)),
            _ => {}
        }
    }

    /// From now on drops whatever comes.
    pub(crate) fn drain(&mut self) {
        self.state = ReadState::Drain;
    }

    /// JSON bytes of an unfinished message charged to the shared allowance
    /// (to give back when the connection ends).
    pub(crate) fn charged(&self) -> usize {
        match self.state {
            ReadState::Json { charged, .. } => charged,
            _ => 0,
        }
    }

    /// Reads from `r` until a decision point, the socket would block, or
    /// `READ_PER_TURN` bytes; `json_room` is the shared allowance for JSON
    /// beyond [`FREE_JSON`], and is charged for what it lends.
    pub(crate) fn step(
        &mut self,
        mut r: impl Read,
        scratch: &mut [u8],
        json_room: &mut usize,
    ) -> Step {
        let mut budget = READ_PER_TURN;
        loop {
            let mid_frame = self.phase() != Phase::Between;
            // Where the next bytes go, and how many are wanted.
            let want = match &mut self.state {
                ReadState::Header { got, .. } => FRAME_HEADER_LEN - *got,
                ReadState::Json {
                    header,
                    json,
                    charged,
                } => {
                    let total = header.json_len as usize;
                    if json.len() == total {
                        let blob_len = header.blob_len;
                        let kind = header.kind;
                        let json = std::mem::take(json);
                        let charged = *charged;
                        self.state = ReadState::AtBlob { len: blob_len };
                        return Step::Message {
                            kind,
                            json,
                            blob_len,
                            charged,
                        };
                    }
                    let free = FREE_JSON.saturating_sub(json.len() - *charged);
                    let lend = (total - json.len()).saturating_sub(free);
                    let room = (free + lend.min(*json_room)).min(total - json.len());
                    if room == 0 {
                        return Step::NoRoom;
                    }
                    room
                }
                ReadState::AtBlob { .. } => return Step::Wait,
                ReadState::Blob { blob, len } => {
                    if blob.len() == *len {
                        let blob = std::mem::take(blob);
                        self.state = header_state();
                        return Step::Blob(blob);
                    }
                    *len - blob.len()
                }
                ReadState::Skip { left } => {
                    if *left == 0 {
                        self.state = header_state();
                        continue;
                    }
                    usize::try_from(*left).unwrap_or(usize::MAX)
                }
                ReadState::Drain => usize::MAX,
            };
            // Only now: a part completed by the last read must be handed
            // out, or nothing would wake the loop for it again.
            if budget == 0 {
                return Step::Wait;
            }
            let n = want.min(scratch.len()).min(budget);
            let got = match r.read(&mut scratch[..n]) {
                Ok(0) => return Step::Eof { mid_frame },
                Ok(got) => got,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Wait,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Step::Failed(e),
            };
            budget -= got.min(budget);
            let bytes = &scratch[..got];
            match &mut self.state {
                ReadState::Header { buf, got: have } => {
                    buf[*have..*have + got].copy_from_slice(bytes);
                    *have += got;
                    if *have == FRAME_HEADER_LEN {
                        let header = match FrameHeader::decode(buf, self.limits) {
                            Ok(h) => h,
                            Err(e) => {
                                self.state = ReadState::Drain;
                                return Step::Broken(e);
                            }
                        };
                        let cap = (header.json_len as usize).min(FREE_JSON);
                        self.state = ReadState::Json {
                            header,
                            json: Vec::with_capacity(cap),
                            charged: 0,
                        };
                    }
                }
                ReadState::Json { json, charged, .. } => {
                    let free = FREE_JSON.saturating_sub(json.len() - *charged);
                    let lent = got.saturating_sub(free);
                    *json_room -= lent;
                    *charged += lent;
                    json.extend_from_slice(bytes);
                }
                ReadState::Blob { blob, .. } => blob.extend_from_slice(bytes),
                ReadState::Skip { left } => *left -= got as u64,
                ReadState::Drain | ReadState::AtBlob { .. } => {}
            }
        }
    }
}

fn header_state() -> ReadState {
    ReadState::Header {
        buf: [0; FRAME_HEADER_LEN],
        got: 0,
    }
}

fn skip(left: u64) -> ReadState {
    if left == 0 {
        header_state()
    } else {
        ReadState::Skip { left }
    }
}

/// Bytes queued for a connection, written as the socket takes them.
#[derive(Debug, Default)]
pub(crate) struct Outgoing {
    buf: Vec<u8>,
    at: usize,
}

impl Outgoing {
    pub(crate) fn push(&mut self, bytes: &[u8]) {
        if self.at == self.buf.len() {
            self.buf.clear();
            self.at = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes not yet written.
    pub(crate) fn pending(&self) -> usize {
        self.buf.len() - self.at
    }

    /// Writes what the socket takes; `Ok(true)` when nothing is left.
    pub(crate) fn flush(&mut self, mut w: impl Write) -> io::Result<bool> {
        while self.at < self.buf.len() {
            match w.write(&self.buf[self.at..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.at += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.buf = Vec::new();
        self.at = 0;
        Ok(true)
    }
}

/// Who is on the other end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Peer {
    /// A client of the control port, from this address.
    Control(IpAddr),
    /// A node tool on the local socket.
    Local,
}

/// One connection as the loop keeps it.
#[derive(Debug)]
pub(crate) struct Conn {
    pub id: u64,
    pub peer: Peer,
    pub stream: Stream,
    pub reader: FrameReader,
    pub out: Outgoing,
    /// The interest registered with epoll.
    pub interest: u32,
    /// The deadline registered in the loop's timers.
    pub deadline: Option<Instant>,
    /// When the reader entered its phase (the first frame's: the accept).
    pub phase_since: Instant,
    pub phase: Phase,
    /// A request of this connection is with a request thread; nothing more
    /// is read until it is answered.
    pub busy: bool,
    /// A request passed its token check: the connection is never evicted.
    pub trusted: bool,
    /// An allocation was granted on it: no idle timeout.
    pub granted: bool,
    /// Some frame was read whole (the first frame's deadline counts from
    /// the accept, later ones from their first byte).
    pub framed: bool,
    /// The checked request whose blob is awaited, with when its JSON came.
    pub pending: Option<Box<super::control::Pending>>,
    /// Library bytes this connection holds of the shared budget.
    pub held: u64,
    /// No more requests: flush, then close (by this deadline at the latest).
    pub closing: Option<Instant>,
    /// The peer hung up or the socket failed; close once not busy.
    pub gone: bool,
    /// The peer closed its side (read returned 0).
    pub eof: bool,
    /// The write side was shut down (after a refusal that closes).
    pub write_shut: bool,
    /// A control connection to a port with TLS whose first byte is not in
    /// yet: it says whether the client starts TLS.
    pub sniff: bool,
}

impl Conn {
    pub(crate) fn new(id: u64, peer: Peer, stream: Stream, limits: FrameLimits) -> Conn {
        let now = Instant::now();
        Conn {
            id,
            peer,
            stream,
            reader: FrameReader::new(limits),
            out: Outgoing::default(),
            interest: 0,
            deadline: None,
            phase_since: now,
            phase: Phase::Between,
            busy: false,
            trusted: false,
            granted: false,
            framed: false,
            pending: None,
            held: 0,
            closing: None,
            gone: false,
            eof: false,
            write_shut: false,
            sniff: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfaas_proto::control::client::Deallocate;
    use rfaas_proto::control::Frame;

    /// Feeds `chunks` one read at a time, then would block.
    struct Chunks(Vec<Vec<u8>>);

    impl Read for Chunks {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.0.is_empty() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let c = &mut self.0[0];
            let n = buf.len().min(c.len());
            buf[..n].copy_from_slice(&c[..n]);
            c.drain(..n);
            if c.is_empty() {
                self.0.remove(0);
            }
            Ok(n)
        }
    }

    fn frame(blob: Vec<u8>) -> Vec<u8> {
        Frame::new(
            &Deallocate {
                request_id: 1,
                allocation_id: 2,
            },
            blob,
        )
        .to_bytes()
    }

    #[test]
    fn stops_at_the_message_and_again_at_the_blob() {
        let bytes = frame(vec![7; 1000]);
        // A byte at a time: every state sees partial input.
        let mut src = Chunks(bytes.iter().map(|b| vec![*b]).collect());
        let mut r = FrameReader::new(FrameLimits::default());
        let mut scratch = [0u8; 64];
        let mut room = 0;
        let Step::Message { kind, blob_len, .. } = r.step(&mut src, &mut scratch, &mut room) else {
            panic!("the message first")
        };
        assert_eq!((kind, blob_len), (Kind::Deallocate, 1000));
        assert!(r.at_blob());
        assert!(matches!(
            r.step(&mut src, &mut scratch, &mut room),
            Step::Wait
        ));
        r.take_blob();
        let Step::Blob(blob) = r.step(&mut src, &mut scratch, &mut room) else {
            panic!("then the blob")
        };
        assert_eq!(blob, vec![7; 1000]);
        assert_eq!(r.phase(), Phase::Between);
        assert!(matches!(
            r.step(&mut src, &mut scratch, &mut room),
            Step::Wait
        ));
    }

    #[test]
    fn a_part_completed_by_a_turns_last_read_is_handed_out() {
        let bytes = frame(vec![3; READ_PER_TURN]);
        let head = bytes.len() - READ_PER_TURN;
        let mut src = Chunks(vec![bytes[..head].to_vec(), bytes[head..].to_vec()]);
        let mut r = FrameReader::new(FrameLimits::default());
        let mut scratch = vec![0u8; 64 << 10];
        let mut room = 0;
        assert!(matches!(
            r.step(&mut src, &mut scratch, &mut room),
            Step::Message { .. }
        ));
        r.take_blob();
        // This turn's share ends with the blob's last byte, and the socket
        // has nothing more: the blob must come out now.
        assert!(matches!(
            r.step(&mut src, &mut scratch, &mut room),
            Step::Blob(b) if b.len() == READ_PER_TURN
        ));
    }

    #[test]
    fn a_skipped_blob_is_never_held() {
        let mut bytes = frame(vec![1; 5000]);
        bytes.extend(frame(Vec::new()));
        let mut src = Chunks(vec![bytes]);
        let mut r = FrameReader::new(FrameLimits::default());
        let mut scratch = [0u8; 256];
        let mut room = 0;
        assert!(matches!(
            r.step(&mut src, &mut scratch, &mut room),
            Step::Message { blob_len: 5000, .. }
        ));
        r.skip_blob();
        assert_eq!(r.phase(), Phase::Blob);
        assert!(matches!(
            r.step(&mut src, &mut scratch, &mut room),
            Step::Message { blob_len: 0, .. }
        ));
        r.skip_blob();
        assert_eq!(r.phase(), Phase::Between);
        assert!(matches!(
            r.step(&mut src, &mut scratch, &mut room),
            Step::Wait
        ));
    }

    #[test]
    fn json_beyond_the_free_part_needs_the_shared_allowance() {
        let json = format!("{{\"pad\":\"{}\"}}", "x".repeat(FREE_JSON + 100));
        let mut bytes = FrameHeader {
            kind: Kind::Deallocate,
            json_len: json.len() as u32,
            blob_len: 0,
        }
        .encode()
        .to_vec();
        bytes.extend_from_slice(json.as_bytes());
        let mut scratch = vec![0u8; 64 << 10];

        let mut r = FrameReader::new(FrameLimits::default());
        let mut room = 50;
        let step = r.step(&mut Chunks(vec![bytes.clone()]), &mut scratch, &mut room);
        assert!(matches!(step, Step::NoRoom), "{step:?}");
        assert_eq!((room, r.charged()), (0, 50), "it took what there was");

        let mut r = FrameReader::new(FrameLimits::default());
        let mut room = 1000;
        let step = r.step(&mut Chunks(vec![bytes]), &mut scratch, &mut room);
        let Step::Message {
            json: got, charged, ..
        } = step
        else {
            panic!("the message, with room enough: {step:?}")
        };
        assert_eq!(got, json.as_bytes());
        assert_eq!(charged, json.len() - FREE_JSON);
        assert_eq!(room, 1000 - charged);
    }

    #[test]
    fn a_bad_header_breaks_and_eof_says_where() {
        let mut r = FrameReader::new(FrameLimits::default());
        let mut scratch = [0u8; 64];
        let mut room = 0;
        let mut src = Chunks(vec![b"GET / HTTP/1.1\r\n\r\n".to_vec()]);
        assert!(matches!(
            r.step(&mut src, &mut scratch, &mut room),
            Step::Broken(ControlError::BadMagic(_))
        ));
        assert_eq!(r.phase(), Phase::Drain);

        let mut r = FrameReader::new(FrameLimits::default());
        let mut half = &frame(Vec::new())[..10];
        assert!(matches!(
            r.step(&mut half, &mut scratch, &mut room),
            Step::Eof { mid_frame: true }
        ));
        let mut r = FrameReader::new(FrameLimits::default());
        assert!(matches!(
            r.step(&mut &b""[..], &mut scratch, &mut room),
            Step::Eof { mid_frame: false }
        ));
    }

    #[test]
    fn outgoing_keeps_what_the_socket_did_not_take() {
        struct Takes(usize, Vec<u8>);
        impl Write for Takes {
            fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
                if self.0 == 0 {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                let n = buf.len().min(self.0);
                self.0 -= n;
                self.1.extend_from_slice(&buf[..n]);
                Ok(n)
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let mut out = Outgoing::default();
        out.push(b"hello ");
        out.push(b"world");
        let mut w = Takes(4, Vec::new());
        assert!(!out.flush(&mut w).unwrap());
        assert_eq!(out.pending(), 7);
        w.0 = 100;
        assert!(out.flush(&mut w).unwrap());
        assert_eq!(w.1, b"hello world");
        assert_eq!(out.pending(), 0);
    }
}
