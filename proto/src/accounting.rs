//! Accounting: the counter region an accounting service exposes, the slot
//! a lease's usage is added into, and the hello an executor daemon says
//! before it may add.
//!
//! # Who adds what
//!
//! The manager gives each node lease a [`BillingSlot`]: an accounting
//! instance, its fabric address, and a slot index. The slot travels in the
//! lease token, which the manager signs, so the executor trusts it. The
//! executor daemon (never the worker, which runs user code) adds the lease's
//! usage into the slot's words with remote fetch-and-add. Exactly one daemon
//! adds into a slot, so a slot's words are the sum of the adds that landed:
//! a daemon that lost an add's completion (the service died) reads the slot
//! back to learn whether it landed. When the lease's last allocation has
//! ended and its last adds completed, the daemon adds 1 to
//! [`Counter::Closed`]; the service's flusher then writes the final totals
//! and frees the slot.
//!
//! # Region
//!
//! A region is a [`RegionHeader`] ([`REGION_HEADER_LEN`] bytes), then
//! `slots` slots of [`SLOT_LEN`] bytes each. The service keeps it in a
//! memory-mapped file, so adds that landed survive the service's crash.
//!
//! ```text
//!  0                    64                  128                 64 + 64*slots
//!  +--------------------+-------------------+-- ... --+-------------------+
//!  | header (64 B)      | slot 0 (64 B)     |         | slot slots-1      |
//!  +--------------------+-------------------+-- ... --+-------------------+
//! ```
//!
//! Header, little-endian:
//!
//! ```text
//!  0        8        12         16       20       24          32         40
//!  +--------+--------+----------+--------+--------+-----------+----------+---
//!  |RFAACCT1|version | slot_len | slots  |  0     | region_id |created_ms| 0…
//!  +--------+--------+----------+--------+--------+-----------+----------+---
//! ```
//!
//! `region_id` is random, drawn when the file is made: a daemon that sees a
//! different id after reconnecting knows the region was replaced.
//!
//! A slot is eight 64-bit words in the service host's byte order (every
//! supported host is little-endian), each at an 8-byte aligned offset, in
//! the order of [`Counter`]:
//!
//! ```text
//!  0            8            16        24        32            40         48          56        64
//!  +------------+------------+---------+---------+-------------+----------+-----------+---------+
//!  |alloc_mib_ms| compute_ns | hot_ns  | warm_ns | invocations | bytes_in | bytes_out | closed  |
//!  +------------+------------+---------+---------+-------------+----------+-----------+---------+
//! ```
//!
//! # Hello
//!
//! An accounting service's fabric listener takes connections from anyone
//! who can reach it, and a daemon knows nothing of the service's memory
//! before the hello, so the hello travels in immediates: a daemon's first
//! [`HELLO_IMMS`] operations on a connection are zero-length
//! writes-with-immediate (to no address) whose immediates carry the
//! [`AccountingHello`]'s [`AccountingHello::LEN`] bytes, four at a time,
//! little-endian, in order ([`AccountingHello::to_imms`],
//! [`AccountingHello::from_imms`]). The first immediate is [`HELLO_IMM`]
//! (the magic). The hello carries the node's [`AccountingTicket`] (signed
//! by the manager, short-lived, naming the node and the id of its
//! credential, never the credential's secret: see [`crate::ticket`] for its
//! bytes) and where the answer goes. The service checks the ticket's
//! signature with the manager's public keys, its expiry, and that its
//! credential is still live, and binds the connection to the ticket's
//! node. The service
//! answers with a write-with-immediate of an [`AccountingReply`]
//! ([`AccountingReply::LEN`] bytes, immediate [`REPLY_IMM`]) to that
//! address; only an accepted reply names the region's address and rkey,
//! which the service gives to nobody else. The service drops a connection
//! whose hello is missing, late or refused.
//!
//! ```text
//! hello  0      4         8            16          20           24                 256
//!        +------+---------+------------+-----------+------------+------------------+
//!        | RFAH | version | reply_addr | reply_rkey| ticket_len | ticket bytes     |
//!        +------+---------+------------+-----------+------------+------------------+
//!
//! reply  0      4         8             16          20       24          32
//!        +------+---------+-------------+-----------+--------+-----------+
//!        | RFAR | status  | region_addr | region_rkey| slots  | region_id |
//!        +------+---------+-------------+-----------+--------+-----------+
//! ```
//!
//! `version` is [`ACCOUNTING_VERSION`] (2); a version 1 hello, which
//! carried the node's bearer credential, is answered `BadHello` and
//! counted. The bytes after the ticket are zero.

use serde::{Deserialize, Serialize};

use crate::ticket::AccountingTicket;

/// The version of the hello this crate speaks: 2, the hello with an
/// [`AccountingTicket`] (version 1 carried the node's bearer credential
/// and is refused).
pub const ACCOUNTING_VERSION: u32 = 2;

/// The version of the region file's layout (unchanged since version 1, so
/// region files survive an upgrade).
pub const REGION_VERSION: u32 = 1;

/// Bytes of the region header.
pub const REGION_HEADER_LEN: usize = 64;

/// Bytes of a slot.
pub const SLOT_LEN: usize = 64;

/// Words of a slot.
pub const SLOT_WORDS: usize = SLOT_LEN / 8;

/// The most slots a region may hold (16 Mi slots, 1 GiB).
pub const MAX_SLOTS: u32 = 1 << 24;

const REGION_MAGIC: [u8; 8] = *b"RFAACCT1";
const HELLO_MAGIC: [u8; 4] = *b"RFAH";
const REPLY_MAGIC: [u8; 4] = *b"RFAR";

/// The first immediate of an [`AccountingHello`] (its magic).
pub const HELLO_IMM: u32 = u32::from_le_bytes(HELLO_MAGIC);

/// The immediate of an [`AccountingReply`].
pub const REPLY_IMM: u32 = u32::from_le_bytes(REPLY_MAGIC);

/// Immediates that carry one [`AccountingHello`].
pub const HELLO_IMMS: usize = AccountingHello::LEN / 4;

/// The longest ticket a hello carries, in bytes.
pub const MAX_TICKET_LEN: usize = crate::ticket::MAX_TICKET_LEN;

/// What is wrong with accounting bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AccountingFormatError {
    /// The buffer is shorter than the message.
    #[error("the {what} is {needed} bytes, but the buffer given for it is only {len} bytes long")]
    BufferTooShort {
        /// Which message.
        what: &'static str,
        /// Bytes it needs.
        needed: usize,
        /// Bytes the buffer has.
        len: usize,
    },
    /// The magic bytes are not those of the message.
    #[error("these bytes are not an rfaas {0} (wrong magic)")]
    BadMagic(&'static str),
    /// The version is not the one this build speaks.
    #[error("the {what} has version {found}, this build speaks version {speaks}; run the same rfaas release on executors and accounting services")]
    Version {
        /// Which message.
        what: &'static str,
        /// The version found.
        found: u32,
        /// The version this build speaks.
        speaks: u32,
    },
    /// A field's value is out of range.
    #[error("the {what} is invalid: {why}")]
    Invalid {
        /// Which message.
        what: &'static str,
        /// What is wrong.
        why: String,
    },
}

fn short(what: &'static str, needed: usize, len: usize) -> AccountingFormatError {
    AccountingFormatError::BufferTooShort { what, needed, len }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// One word of a slot, in slot order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Counter {
    /// Allocation time times memory, MiB·ms (`t_a` of the cost model).
    AllocMibMs = 0,
    /// CPU time spent computing, ns (`t_c`).
    ComputeNs = 1,
    /// CPU time spent hot-polling for requests, ns (`t_h`).
    HotNs = 2,
    /// Time warm workers spent blocked waiting for requests, ns.
    WarmNs = 3,
    /// Invocations served.
    Invocations = 4,
    /// Request payload bytes received.
    BytesIn = 5,
    /// Response payload bytes sent.
    BytesOut = 6,
    /// Nonzero once the lease's daemon has made its last add.
    Closed = 7,
}

impl Counter {
    /// Every counter, in slot order.
    pub const ALL: [Counter; SLOT_WORDS] = [
        Counter::AllocMibMs,
        Counter::ComputeNs,
        Counter::HotNs,
        Counter::WarmNs,
        Counter::Invocations,
        Counter::BytesIn,
        Counter::BytesOut,
        Counter::Closed,
    ];

    /// The word's index in its slot.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Its name in reports, metrics and the database.
    pub fn name(self) -> &'static str {
        match self {
            Counter::AllocMibMs => "alloc_mib_ms",
            Counter::ComputeNs => "compute_ns",
            Counter::HotNs => "hot_ns",
            Counter::WarmNs => "warm_ns",
            Counter::Invocations => "invocations",
            Counter::BytesIn => "bytes_in",
            Counter::BytesOut => "bytes_out",
            Counter::Closed => "closed",
        }
    }
}

/// Where slot `slot`'s word `counter` lies, in bytes from the region's
/// start.
pub fn word_offset(slot: u32, counter: Counter) -> u64 {
    REGION_HEADER_LEN as u64 + u64::from(slot) * SLOT_LEN as u64 + 8 * counter.index() as u64
}

/// Where slot `slot` starts, in bytes from the region's start.
pub fn slot_offset(slot: u32) -> u64 {
    word_offset(slot, Counter::AllocMibMs)
}

/// Bytes of a region with `slots` slots.
pub fn region_len(slots: u32) -> u64 {
    REGION_HEADER_LEN as u64 + u64::from(slots) * SLOT_LEN as u64
}

/// What a lease used: the figures an executor daemon measures, adds into
/// the lease's slot and reports to the node's tools, and that accounting
/// stores, sums and prices. Each figure only grows while a lease runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UsageFigures {
    /// Allocation wall time times the allocation's memory, MiB·ms
    /// ([`Counter::AllocMibMs`]).
    pub alloc_mib_ms: u64,
    /// CPU time not spent hot-polling: the functions and everything else
    /// the workers did, ns ([`Counter::ComputeNs`]).
    pub compute_ns: u64,
    /// CPU time of hot lanes polling for requests, ns ([`Counter::HotNs`]).
    pub hot_ns: u64,
    /// Time warm lanes spent blocked waiting for requests, summed over
    /// lanes, ns ([`Counter::WarmNs`]).
    pub warm_ns: u64,
    /// Functions called ([`Counter::Invocations`]).
    pub invocations: u64,
    /// Input bytes handed to functions ([`Counter::BytesIn`]).
    pub bytes_in: u64,
    /// Output bytes functions returned ([`Counter::BytesOut`]).
    pub bytes_out: u64,
}

impl UsageFigures {
    /// Adds `other` in, each figure saturating at `u64::MAX`.
    pub fn add(&mut self, other: &UsageFigures) {
        self.alloc_mib_ms = self.alloc_mib_ms.saturating_add(other.alloc_mib_ms);
        self.compute_ns = self.compute_ns.saturating_add(other.compute_ns);
        self.hot_ns = self.hot_ns.saturating_add(other.hot_ns);
        self.warm_ns = self.warm_ns.saturating_add(other.warm_ns);
        self.invocations = self.invocations.saturating_add(other.invocations);
        self.bytes_in = self.bytes_in.saturating_add(other.bytes_in);
        self.bytes_out = self.bytes_out.saturating_add(other.bytes_out);
    }

    /// What grew from `start` to these figures, each never below zero
    /// (figures only grow; a smaller one counts as no growth).
    pub fn since(&self, start: &UsageFigures) -> UsageFigures {
        UsageFigures {
            alloc_mib_ms: self.alloc_mib_ms.saturating_sub(start.alloc_mib_ms),
            compute_ns: self.compute_ns.saturating_sub(start.compute_ns),
            hot_ns: self.hot_ns.saturating_sub(start.hot_ns),
            warm_ns: self.warm_ns.saturating_sub(start.warm_ns),
            invocations: self.invocations.saturating_sub(start.invocations),
            bytes_in: self.bytes_in.saturating_sub(start.bytes_in),
            bytes_out: self.bytes_out.saturating_sub(start.bytes_out),
        }
    }
}

/// A slot's words as numbers: a lease's usage and whether its daemon is
/// done adding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotTotals {
    /// The first seven words.
    #[serde(flatten)]
    pub usage: UsageFigures,
    /// [`Counter::Closed`].
    pub closed: u64,
}

impl SlotTotals {
    /// The words in slot order.
    pub fn to_words(&self) -> [u64; SLOT_WORDS] {
        let u = &self.usage;
        [
            u.alloc_mib_ms,
            u.compute_ns,
            u.hot_ns,
            u.warm_ns,
            u.invocations,
            u.bytes_in,
            u.bytes_out,
            self.closed,
        ]
    }

    /// From words in slot order.
    pub fn from_words(w: [u64; SLOT_WORDS]) -> SlotTotals {
        SlotTotals {
            usage: UsageFigures {
                alloc_mib_ms: w[0],
                compute_ns: w[1],
                hot_ns: w[2],
                warm_ns: w[3],
                invocations: w[4],
                bytes_in: w[5],
                bytes_out: w[6],
            },
            closed: w[7],
        }
    }

    /// The word of `counter`.
    pub fn get(&self, counter: Counter) -> u64 {
        self.to_words()[counter.index()]
    }

    /// Reads a slot's [`SLOT_LEN`] bytes.
    ///
    /// # Errors
    ///
    /// [`AccountingFormatError::BufferTooShort`].
    pub fn decode(buf: &[u8]) -> Result<SlotTotals, AccountingFormatError> {
        if buf.len() < SLOT_LEN {
            return Err(short("slot", SLOT_LEN, buf.len()));
        }
        let mut w = [0u64; SLOT_WORDS];
        for (i, word) in w.iter_mut().enumerate() {
            *word = u64_at(buf, 8 * i);
        }
        Ok(SlotTotals::from_words(w))
    }

    /// Writes the slot's [`SLOT_LEN`] bytes.
    ///
    /// # Errors
    ///
    /// [`AccountingFormatError::BufferTooShort`].
    pub fn encode(&self, buf: &mut [u8]) -> Result<(), AccountingFormatError> {
        if buf.len() < SLOT_LEN {
            return Err(short("slot", SLOT_LEN, buf.len()));
        }
        for (i, word) in self.to_words().iter().enumerate() {
            buf[8 * i..8 * i + 8].copy_from_slice(&word.to_le_bytes());
        }
        Ok(())
    }
}

/// The first [`REGION_HEADER_LEN`] bytes of a region file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionHeader {
    /// Slots that follow the header (1 to [`MAX_SLOTS`]).
    pub slots: u32,
    /// Drawn at random when the region was made.
    pub region_id: u64,
    /// When the region was made, Unix milliseconds.
    pub created_ms: u64,
}

impl RegionHeader {
    /// Writes the header into `buf[..REGION_HEADER_LEN]` (the reserved bytes
    /// as zeros).
    ///
    /// # Errors
    ///
    /// [`AccountingFormatError::BufferTooShort`], or `Invalid` for a slot
    /// count of 0 or above [`MAX_SLOTS`].
    pub fn encode(&self, buf: &mut [u8]) -> Result<(), AccountingFormatError> {
        if buf.len() < REGION_HEADER_LEN {
            return Err(short("region header", REGION_HEADER_LEN, buf.len()));
        }
        check_slots(self.slots)?;
        let b = &mut buf[..REGION_HEADER_LEN];
        b.fill(0);
        b[..8].copy_from_slice(&REGION_MAGIC);
        b[8..12].copy_from_slice(&REGION_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(SLOT_LEN as u32).to_le_bytes());
        b[16..20].copy_from_slice(&self.slots.to_le_bytes());
        b[24..32].copy_from_slice(&self.region_id.to_le_bytes());
        b[32..40].copy_from_slice(&self.created_ms.to_le_bytes());
        Ok(())
    }

    /// Reads a header.
    ///
    /// # Errors
    ///
    /// `BufferTooShort`, `BadMagic` (not a region file), `Version`, or
    /// `Invalid` for a slot length other than [`SLOT_LEN`] or a bad slot
    /// count.
    pub fn decode(buf: &[u8]) -> Result<RegionHeader, AccountingFormatError> {
        const WHAT: &str = "accounting region header";
        if buf.len() < REGION_HEADER_LEN {
            return Err(short(WHAT, REGION_HEADER_LEN, buf.len()));
        }
        if buf[..8] != REGION_MAGIC {
            return Err(AccountingFormatError::BadMagic(WHAT));
        }
        let version = u32_at(buf, 8);
        if version != REGION_VERSION {
            return Err(AccountingFormatError::Version {
                what: WHAT,
                found: version,
                speaks: REGION_VERSION,
            });
        }
        let slot_len = u32_at(buf, 12);
        if slot_len as usize != SLOT_LEN {
            return Err(AccountingFormatError::Invalid {
                what: WHAT,
                why: format!("slots of {slot_len} bytes, not {SLOT_LEN}"),
            });
        }
        let slots = u32_at(buf, 16);
        check_slots(slots)?;
        Ok(RegionHeader {
            slots,
            region_id: u64_at(buf, 24),
            created_ms: u64_at(buf, 32),
        })
    }
}

fn check_slots(slots: u32) -> Result<(), AccountingFormatError> {
    if slots == 0 || slots > MAX_SLOTS {
        return Err(AccountingFormatError::Invalid {
            what: "accounting region header",
            why: format!("{slots} slots; a region holds 1 to {MAX_SLOTS}"),
        });
    }
    Ok(())
}

/// A daemon's first write on a connection to an accounting service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountingHello {
    /// Where the service writes its [`AccountingReply`]: at least
    /// [`AccountingReply::LEN`] bytes the daemon registered for remote
    /// writes.
    pub reply_addr: u64,
    /// The rkey of that buffer.
    pub reply_rkey: u32,
    /// The node's ticket from the manager, at most [`MAX_TICKET_LEN`]
    /// bytes (its `Debug` hides it).
    pub ticket: AccountingTicket,
}

impl AccountingHello {
    /// Encoded size.
    pub const LEN: usize = 256;

    /// Writes the hello into `buf[..LEN]`.
    ///
    /// # Errors
    ///
    /// `BufferTooShort` (an [`AccountingTicket`] never exceeds
    /// [`MAX_TICKET_LEN`] bytes, so it always fits).
    pub fn encode(&self, buf: &mut [u8]) -> Result<(), AccountingFormatError> {
        if buf.len() < Self::LEN {
            return Err(short("accounting hello", Self::LEN, buf.len()));
        }
        let cred = self.ticket.as_bytes();
        let b = &mut buf[..Self::LEN];
        b.fill(0);
        b[..4].copy_from_slice(&HELLO_MAGIC);
        b[4..8].copy_from_slice(&ACCOUNTING_VERSION.to_le_bytes());
        b[8..16].copy_from_slice(&self.reply_addr.to_le_bytes());
        b[16..20].copy_from_slice(&self.reply_rkey.to_le_bytes());
        b[20..24].copy_from_slice(&(cred.len() as u32).to_le_bytes());
        b[24..24 + cred.len()].copy_from_slice(cred);
        Ok(())
    }

    /// The hello as the [`HELLO_IMMS`] immediates that carry it.
    ///
    /// # Errors
    ///
    /// As [`encode`](Self::encode).
    pub fn to_imms(&self) -> Result<[u32; HELLO_IMMS], AccountingFormatError> {
        let mut b = [0u8; Self::LEN];
        self.encode(&mut b)?;
        let mut imms = [0u32; HELLO_IMMS];
        for (imm, four) in imms.iter_mut().zip(b.chunks_exact(4)) {
            *imm = u32::from_le_bytes(four.try_into().expect("4 bytes"));
        }
        Ok(imms)
    }

    /// Reads a hello from the immediates that carried it.
    ///
    /// # Errors
    ///
    /// As [`decode`](Self::decode).
    pub fn from_imms(imms: &[u32; HELLO_IMMS]) -> Result<AccountingHello, AccountingFormatError> {
        let mut b = [0u8; Self::LEN];
        for (four, imm) in b.chunks_exact_mut(4).zip(imms) {
            four.copy_from_slice(&imm.to_le_bytes());
        }
        Self::decode(&b)
    }

    /// Reads a hello.
    ///
    /// # Errors
    ///
    /// `BufferTooShort`, `BadMagic`, `Version` (a version 1 hello, which
    /// carried a bearer credential, among others), or `Invalid` for a
    /// ticket length over [`MAX_TICKET_LEN`]. The ticket itself is checked
    /// by [`AccountingTicket::verify`].
    pub fn decode(buf: &[u8]) -> Result<AccountingHello, AccountingFormatError> {
        const WHAT: &str = "accounting hello";
        if buf.len() < Self::LEN {
            return Err(short(WHAT, Self::LEN, buf.len()));
        }
        if buf[..4] != HELLO_MAGIC {
            return Err(AccountingFormatError::BadMagic(WHAT));
        }
        let version = u32_at(buf, 4);
        if version != ACCOUNTING_VERSION {
            return Err(AccountingFormatError::Version {
                what: WHAT,
                found: version,
                speaks: ACCOUNTING_VERSION,
            });
        }
        let len = u32_at(buf, 20) as usize;
        if len > MAX_TICKET_LEN {
            return Err(AccountingFormatError::Invalid {
                what: WHAT,
                why: format!("a ticket length of {len}; at most {MAX_TICKET_LEN}"),
            });
        }
        let ticket = AccountingTicket::from_bytes(&buf[24..24 + len]).map_err(|e| {
            AccountingFormatError::Invalid {
                what: WHAT,
                why: e.to_string(),
            }
        })?;
        Ok(AccountingHello {
            reply_addr: u64_at(buf, 8),
            reply_rkey: u32_at(buf, 16),
            ticket,
        })
    }
}

/// How a service answered a hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
#[non_exhaustive]
pub enum ReplyStatus {
    /// Accepted: the reply names the region.
    Accepted = 0,
    /// The ticket is forged, expired, or signed by an unknown key, or
    /// the credential it names is unknown, revoked, expired, or not the
    /// node's.
    BadCredential = 1,
    /// The hello did not decode (wrong version, bad length).
    BadHello = 2,
    /// The service cannot check credentials now (its database is down):
    /// try again later.
    Unavailable = 3,
}

impl ReplyStatus {
    /// The status of code `code`.
    pub fn from_code(code: u32) -> Option<ReplyStatus> {
        match code {
            0 => Some(ReplyStatus::Accepted),
            1 => Some(ReplyStatus::BadCredential),
            2 => Some(ReplyStatus::BadHello),
            3 => Some(ReplyStatus::Unavailable),
            _ => None,
        }
    }

    /// What the daemon should do, in words for its log.
    pub fn describe(self) -> &'static str {
        match self {
            ReplyStatus::Accepted => "accepted",
            ReplyStatus::BadCredential => {
                "the accounting ticket was refused: it is forged, expired or signed by a key the service does not accept, or the node credential it names was revoked; check executord's [manager] credential_file (`rfaasctl credential node`) and the service's lease_keys"
            }
            ReplyStatus::BadHello => {
                "the hello was refused; run the same rfaas release on executors and accounting services"
            }
            ReplyStatus::Unavailable => {
                "the accounting service cannot check credentials now (its database is down); retrying"
            }
        }
    }
}

/// A service's answer to a hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccountingReply {
    /// Accepted or why not.
    pub status: ReplyStatus,
    /// The region's address (0 unless accepted).
    pub region_addr: u64,
    /// The region's rkey (0 unless accepted).
    pub region_rkey: u32,
    /// Slots in the region (0 unless accepted).
    pub slots: u32,
    /// The region's [`RegionHeader::region_id`] (0 unless accepted).
    pub region_id: u64,
}

impl AccountingReply {
    /// Encoded size.
    pub const LEN: usize = 32;

    /// A refusal: every region field 0.
    pub fn refused(status: ReplyStatus) -> AccountingReply {
        AccountingReply {
            status,
            region_addr: 0,
            region_rkey: 0,
            slots: 0,
            region_id: 0,
        }
    }

    /// Writes the reply into `buf[..LEN]`.
    ///
    /// # Errors
    ///
    /// `BufferTooShort`.
    pub fn encode(&self, buf: &mut [u8]) -> Result<(), AccountingFormatError> {
        if buf.len() < Self::LEN {
            return Err(short("accounting reply", Self::LEN, buf.len()));
        }
        let b = &mut buf[..Self::LEN];
        b[..4].copy_from_slice(&REPLY_MAGIC);
        b[4..8].copy_from_slice(&(self.status as u32).to_le_bytes());
        b[8..16].copy_from_slice(&self.region_addr.to_le_bytes());
        b[16..20].copy_from_slice(&self.region_rkey.to_le_bytes());
        b[20..24].copy_from_slice(&self.slots.to_le_bytes());
        b[24..32].copy_from_slice(&self.region_id.to_le_bytes());
        Ok(())
    }

    /// Reads a reply.
    ///
    /// # Errors
    ///
    /// `BufferTooShort`, `BadMagic`, or `Invalid` for an unknown status.
    pub fn decode(buf: &[u8]) -> Result<AccountingReply, AccountingFormatError> {
        const WHAT: &str = "accounting reply";
        if buf.len() < Self::LEN {
            return Err(short(WHAT, Self::LEN, buf.len()));
        }
        if buf[..4] != REPLY_MAGIC {
            return Err(AccountingFormatError::BadMagic(WHAT));
        }
        let code = u32_at(buf, 4);
        let status =
            ReplyStatus::from_code(code).ok_or_else(|| AccountingFormatError::Invalid {
                what: WHAT,
                why: format!("unknown status {code}"),
            })?;
        Ok(AccountingReply {
            status,
            region_addr: u64_at(buf, 8),
            region_rkey: u32_at(buf, 16),
            slots: u32_at(buf, 20),
            region_id: u64_at(buf, 24),
        })
    }
}

/// A lease's counter slot: which accounting instance, how to reach it, and
/// which slot. The manager signs it into the lease token.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct BillingSlot {
    /// The accounting instance's name.
    pub instance: String,
    /// The fabric provider it listens on: `tcp`, `shm` or `verbs:<device>`.
    pub provider: String,
    /// Its fabric listener's address, in the provider's syntax.
    pub addr: String,
    /// The slot's index in the instance's region.
    pub slot: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_words_lie_at_their_offsets() {
        assert_eq!(word_offset(0, Counter::AllocMibMs), 64);
        assert_eq!(word_offset(0, Counter::Closed), 64 + 56);
        assert_eq!(word_offset(2, Counter::HotNs), 64 + 128 + 16);
        assert_eq!(slot_offset(1), 128);
        assert_eq!(region_len(4), 64 + 256);
        for (i, c) in Counter::ALL.iter().enumerate() {
            assert_eq!(c.index(), i);
        }
    }

    #[test]
    fn usage_figures_add_saturating_and_grow_from_a_start() {
        let start = UsageFigures {
            alloc_mib_ms: u64::MAX - 1,
            compute_ns: 5,
            hot_ns: 1,
            warm_ns: 2,
            invocations: 3,
            bytes_in: 4,
            bytes_out: u64::MAX,
        };
        let mut sum = start;
        sum.add(&UsageFigures {
            alloc_mib_ms: 7,
            compute_ns: 10,
            hot_ns: 20,
            warm_ns: 30,
            invocations: 40,
            bytes_in: 50,
            bytes_out: 1,
        });
        let want = UsageFigures {
            alloc_mib_ms: u64::MAX,
            compute_ns: 15,
            hot_ns: 21,
            warm_ns: 32,
            invocations: 43,
            bytes_in: 54,
            bytes_out: u64::MAX,
        };
        assert_eq!(sum, want);
        let grew = UsageFigures {
            alloc_mib_ms: 1,
            compute_ns: 10,
            hot_ns: 20,
            warm_ns: 30,
            invocations: 40,
            bytes_in: 50,
            bytes_out: 0,
        };
        assert_eq!(sum.since(&start), grew);
        assert_eq!(start.since(&sum), UsageFigures::default(), "no growth");
    }

    #[test]
    fn slot_bytes_are_little_endian_words_in_counter_order() {
        let t = SlotTotals {
            usage: UsageFigures {
                alloc_mib_ms: 1,
                compute_ns: 0x0203,
                hot_ns: 3,
                warm_ns: 4,
                invocations: 5,
                bytes_in: 6,
                bytes_out: 7,
            },
            closed: 1,
        };
        let mut b = [0xffu8; SLOT_LEN];
        t.encode(&mut b).unwrap();
        let mut want = [0u8; SLOT_LEN];
        want[0] = 1;
        want[8] = 3;
        want[9] = 2;
        want[16] = 3;
        want[24] = 4;
        want[32] = 5;
        want[40] = 6;
        want[48] = 7;
        want[56] = 1;
        assert_eq!(b, want);
        assert_eq!(SlotTotals::decode(&b).unwrap(), t);
        assert_eq!(t.get(Counter::ComputeNs), 0x0203);
        assert!(matches!(
            SlotTotals::decode(&b[..63]),
            Err(AccountingFormatError::BufferTooShort {
                needed: 64,
                len: 63,
                ..
            })
        ));
    }

    #[test]
    fn region_header_bytes() {
        let h = RegionHeader {
            slots: 4096,
            region_id: 0x0102_0304_0506_0708,
            created_ms: 1_700_000_000_000,
        };
        let mut b = [0xaau8; REGION_HEADER_LEN];
        h.encode(&mut b).unwrap();
        assert_eq!(&b[..8], b"RFAACCT1");
        assert_eq!(&b[8..12], &[1, 0, 0, 0], "region layout version 1");
        assert_eq!(&b[12..16], &[64, 0, 0, 0]);
        assert_eq!(&b[16..20], &[0, 16, 0, 0]);
        assert_eq!(&b[20..24], &[0; 4]);
        assert_eq!(&b[24..32], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&b[32..40], &1_700_000_000_000u64.to_le_bytes());
        assert!(b[40..].iter().all(|&x| x == 0));
        assert_eq!(RegionHeader::decode(&b).unwrap(), h);

        let mut bad = b;
        bad[0] = b'X';
        assert_eq!(
            RegionHeader::decode(&bad),
            Err(AccountingFormatError::BadMagic("accounting region header"))
        );
        let mut bad = b;
        bad[8] = 2;
        assert!(matches!(
            RegionHeader::decode(&bad),
            Err(AccountingFormatError::Version {
                found: 2,
                speaks: 1,
                ..
            })
        ));
        let mut bad = b;
        bad[12] = 32;
        assert!(matches!(
            RegionHeader::decode(&bad),
            Err(AccountingFormatError::Invalid { .. })
        ));
        let mut bad = b;
        bad[16..20].copy_from_slice(&0u32.to_le_bytes());
        assert!(matches!(
            RegionHeader::decode(&bad),
            Err(AccountingFormatError::Invalid { .. })
        ));
        let zero = RegionHeader { slots: 0, ..h };
        assert!(zero.encode(&mut b).is_err());
    }

    fn ticket() -> AccountingTicket {
        let signer = crate::lease::LeaseSigner::from_seed("k1", [3; 32]).unwrap();
        let claims = crate::ticket::TicketClaims {
            key_id: String::new(),
            node: "n1".into(),
            credential_id: "ab".into(),
            issued_at: 1,
            expires_at: 2,
        };
        AccountingTicket::sign(&signer, &claims).unwrap()
    }

    #[test]
    fn hello_bytes() {
        let t = ticket();
        let n = t.as_bytes().len();
        let h = AccountingHello {
            reply_addr: 0x1122_3344_5566_7788,
            reply_rkey: 0xaabb_ccdd,
            ticket: t.clone(),
        };
        let mut b = [0xffu8; AccountingHello::LEN];
        h.encode(&mut b).unwrap();
        assert_eq!(&b[..4], b"RFAH");
        assert_eq!(&b[4..8], &[2, 0, 0, 0]);
        assert_eq!(&b[8..16], &[0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11]);
        assert_eq!(&b[16..20], &[0xdd, 0xcc, 0xbb, 0xaa]);
        assert_eq!(&b[20..24], &(n as u32).to_le_bytes());
        assert_eq!(&b[24..24 + n], t.as_bytes());
        assert_eq!(&b[24..28], b"RFT1");
        assert!(b[24 + n..].iter().all(|&x| x == 0));
        assert_eq!(AccountingHello::decode(&b).unwrap(), h);
        assert_eq!(HELLO_IMM, u32::from_le_bytes(*b"RFAH"));
        let imms = h.to_imms().unwrap();
        assert_eq!(imms.len(), 64);
        assert_eq!(imms[0], HELLO_IMM);
        assert_eq!(imms[1], 2);
        assert_eq!(imms[2], 0x5566_7788);
        assert_eq!(imms[6], u32::from_le_bytes(*b"RFT1"));
        assert_eq!(AccountingHello::from_imms(&imms).unwrap(), h);
        assert!(!format!("{h:?}").contains("n1"));

        let mut bad = b;
        bad[20..24].copy_from_slice(&(MAX_TICKET_LEN as u32 + 1).to_le_bytes());
        assert!(matches!(
            AccountingHello::decode(&bad),
            Err(AccountingFormatError::Invalid { .. })
        ));
        let mut bad = b;
        bad[1] = b'X';
        assert!(matches!(
            AccountingHello::decode(&bad),
            Err(AccountingFormatError::BadMagic(_))
        ));
        assert!(AccountingHello::decode(&b[..255]).is_err());

        let longest = AccountingTicket::from_bytes(&[7; MAX_TICKET_LEN]).unwrap();
        let h = AccountingHello {
            ticket: longest,
            ..h
        };
        h.encode(&mut b).unwrap();
        assert_eq!(AccountingHello::decode(&b).unwrap(), h);
    }

    /// The hello of the first release, a node's bearer credential in
    /// clear, is refused for its version whatever it carries.
    #[test]
    fn a_version_1_hello_with_a_credential_is_refused() {
        let mut b = [0u8; AccountingHello::LEN];
        b[..4].copy_from_slice(b"RFAH");
        b[4..8].copy_from_slice(&1u32.to_le_bytes());
        let cred = b"rfaasc.0a1b.s3cret";
        b[20..24].copy_from_slice(&(cred.len() as u32).to_le_bytes());
        b[24..24 + cred.len()].copy_from_slice(cred);
        let e = AccountingHello::decode(&b).unwrap_err();
        assert_eq!(
            e,
            AccountingFormatError::Version {
                what: "accounting hello",
                found: 1,
                speaks: 2
            }
        );
        assert!(e.to_string().contains("same rfaas release"));
    }

    #[test]
    fn reply_bytes() {
        let r = AccountingReply {
            status: ReplyStatus::Accepted,
            region_addr: 0x7f00_0000_1000,
            region_rkey: 7,
            slots: 4096,
            region_id: 9,
        };
        let mut b = [0u8; AccountingReply::LEN];
        r.encode(&mut b).unwrap();
        assert_eq!(&b[..4], b"RFAR");
        assert_eq!(&b[4..8], &[0; 4]);
        assert_eq!(&b[8..16], &0x7f00_0000_1000u64.to_le_bytes());
        assert_eq!(&b[16..20], &[7, 0, 0, 0]);
        assert_eq!(&b[20..24], &[0, 16, 0, 0]);
        assert_eq!(&b[24..32], &[9, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(AccountingReply::decode(&b).unwrap(), r);

        let no = AccountingReply::refused(ReplyStatus::BadCredential);
        no.encode(&mut b).unwrap();
        assert_eq!(&b[4..8], &[1, 0, 0, 0]);
        assert!(b[8..].iter().all(|&x| x == 0));
        assert_eq!(AccountingReply::decode(&b).unwrap(), no);
        b[4] = 9;
        assert!(matches!(
            AccountingReply::decode(&b),
            Err(AccountingFormatError::Invalid { .. })
        ));
        for code in 0..4 {
            assert_eq!(ReplyStatus::from_code(code).unwrap() as u32, code);
        }
    }

    #[test]
    fn billing_slot_json() {
        let s = BillingSlot {
            instance: "acct1".into(),
            provider: "tcp".into(),
            addr: "127.0.0.1:7400".into(),
            slot: 12,
        };
        let j = serde_json::to_string(&s).unwrap();
        assert_eq!(
            j,
            r#"{"instance":"acct1","provider":"tcp","addr":"127.0.0.1:7400","slot":12}"#
        );
        assert_eq!(serde_json::from_str::<BillingSlot>(&j).unwrap(), s);
        assert!(serde_json::from_str::<BillingSlot>(
            r#"{"instance":"a","provider":"tcp","addr":"x","slot":1,"extra":1}"#
        )
        .is_err());
    }
}
