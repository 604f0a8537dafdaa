//! Accounting tickets: what an executor daemon shows an accounting service
//! in its hello instead of its node credential. The manager signs one for
//! the node in every registration and heartbeat reply, with the key that
//! signs lease tokens; the accounting service checks it with the manager's
//! public keys (the `lease_keys` executors hold), so the node's bearer
//! secret never crosses the fabric, and what does cross it is worth
//! nothing after [`DEFAULT_LIFETIME_S`] (the manager's
//! `accounting_ticket_s`).
//!
//! # Layout
//!
//! A ticket is at most [`MAX_TICKET_LEN`] bytes, so that it fits an
//! [`AccountingHello`](crate::accounting::AccountingHello); integers are
//! little-endian, strings ASCII without a terminator:
//!
//! ```text
//!  0      4           12          20      21      22      23  24
//!  +------+-----------+-----------+-------+-------+-------+---+--------+---------------+------+---------------+
//!  | RFT1 | issued_at | expires_at| kid_n | cid_n | node_n| 0 | key_id | credential_id | node | signature (64)|
//!  +------+-----------+-----------+-------+-------+-------+---+--------+---------------+------+---------------+
//! ```
//!
//! - `issued_at`, `expires_at`: Unix seconds.
//! - `key_id`: the manager's signing key ([`crate::lease`] key ids),
//!   `kid_n` bytes.
//! - `credential_id`: the id (never the secret) of the node credential the
//!   node asked with, `cid_n` hex digits; the accounting service watches
//!   it and drops the node's connections once it is revoked.
//! - `node`: the node's name ([`crate::node_name`]), `node_n` bytes.
//! - `signature`: Ed25519 of [`TICKET_DOMAIN`] followed by every byte
//!   before the signature. Lease tokens sign text that begins `rfaas2.`,
//!   tickets bytes that begin with [`TICKET_DOMAIN`], so neither signature
//!   is ever valid for the other.
//!
//! The three strings together take at most [`MAX_TICKET_LEN`] − 88 = 144
//! bytes (a 16-digit credential id and a short key id leave well over 100
//! for the node's name). In JSON a ticket travels as base64url without
//! padding ([`AccountingTicket::to_text`]).

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;

use crate::lease::{check_key_id, LeaseKeys, LeaseSigner};

/// The first four bytes of a ticket (they name its layout, version 1).
pub const TICKET_MAGIC: [u8; 4] = *b"RFT1";

/// What a ticket's signature covers before its bytes.
pub const TICKET_DOMAIN: &[u8] = b"rfaas-accounting-ticket-v1\0";

/// The longest ticket, in bytes: what a hello has room for.
pub const MAX_TICKET_LEN: usize = crate::accounting::AccountingHello::LEN - 24;

/// Bytes before the strings.
const HEAD_LEN: usize = 24;

/// Bytes of the signature.
const SIG_LEN: usize = 64;

/// The most bytes the key id, credential id and node name take together.
pub const MAX_STRINGS_LEN: usize = MAX_TICKET_LEN - HEAD_LEN - SIG_LEN;

/// The manager's default ticket lifetime, seconds.
pub const DEFAULT_LIFETIME_S: u64 = 600;

/// How far the verifier's clock may be behind or ahead of the manager's,
/// seconds.
pub const CLOCK_SKEW_S: u64 = 30;

/// What a ticket says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TicketClaims {
    /// The key that signed it ([`AccountingTicket::sign`] sets it).
    pub key_id: String,
    /// The node it was issued to.
    pub node: String,
    /// The id of the node credential the node asked with.
    pub credential_id: String,
    /// When it was signed, Unix seconds.
    pub issued_at: u64,
    /// When it ends, Unix seconds.
    pub expires_at: u64,
}

/// Why a ticket cannot be made or was refused. Every message says what to
/// do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TicketError {
    /// The bytes are not a ticket, or the claims do not fit one.
    #[error("the accounting ticket is malformed ({0}); executord passes the ticket exactly as the manager's last reply gave it")]
    Malformed(String),
    /// Signed by no accepted key, or the signature does not verify.
    #[error("{}", if *unknown_key {
        format!("the accounting ticket is signed with key {key_id:?}, which is not among the accounting service's lease_keys: add the manager's public key {key_id:?} to them and restart the service")
    } else {
        format!("the accounting ticket's signature does not verify under key {key_id:?}: it was forged or altered; check that the accounting service's lease_keys hold the manager's current public key {key_id:?}")
    })]
    Forged {
        /// The key id the ticket names.
        key_id: String,
        /// No accepted key has that id.
        unknown_key: bool,
    },
    /// Past its end (with [`CLOCK_SKEW_S`] of grace).
    #[error("the accounting ticket expired at {expires_at} (Unix seconds), it is now {now}; executord gets a fresh one with every heartbeat: check that it reaches a manager, and that the clocks agree")]
    Expired {
        /// The ticket's end.
        expires_at: u64,
        /// The verifier's clock.
        now: u64,
    },
    /// Issued later than the verifier's clock allows.
    #[error("the accounting ticket was issued at {issued_at} (Unix seconds), after now ({now}) by more than {CLOCK_SKEW_S} s; synchronise the clocks of the managers and the accounting services")]
    NotYetValid {
        /// The ticket's start.
        issued_at: u64,
        /// The verifier's clock.
        now: u64,
    },
}

fn malformed(why: impl Into<String>) -> TicketError {
    TicketError::Malformed(why.into())
}

/// A signed ticket's bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct AccountingTicket {
    bytes: Vec<u8>,
}

impl std::fmt::Debug for AccountingTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Whoever sees a ticket may show it until it ends: not in logs.
        f.debug_struct("AccountingTicket")
            .field("len", &self.bytes.len())
            .finish_non_exhaustive()
    }
}

fn check_claims(c: &TicketClaims) -> Result<(), TicketError> {
    check_key_id(&c.key_id).map_err(|e| malformed(e.to_string()))?;
    crate::node_name::check(&c.node).map_err(|e| malformed(e.to_string()))?;
    let id = &c.credential_id;
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(malformed(format!(
            "the credential id {id:?} is not 1 to 64 hex digits"
        )));
    }
    let strings = c.key_id.len() + c.credential_id.len() + c.node.len();
    if strings > MAX_STRINGS_LEN {
        return Err(malformed(format!(
            "key id, credential id and node name take {strings} bytes; at most {MAX_STRINGS_LEN} fit a ticket (use a shorter key id)"
        )));
    }
    if c.expires_at <= c.issued_at {
        return Err(malformed(format!(
            "it ends ({}) no later than it starts ({})",
            c.expires_at, c.issued_at
        )));
    }
    Ok(())
}

fn signed_message(body: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(TICKET_DOMAIN.len() + body.len());
    m.extend_from_slice(TICKET_DOMAIN);
    m.extend_from_slice(body);
    m
}

impl AccountingTicket {
    /// Signs `claims` with `signer`; the ticket's key id is the signer's,
    /// whatever `claims.key_id` says.
    ///
    /// # Errors
    ///
    /// `Malformed` when a claim breaks its rule or they do not fit
    /// [`MAX_TICKET_LEN`].
    pub fn sign(
        signer: &LeaseSigner,
        claims: &TicketClaims,
    ) -> Result<AccountingTicket, TicketError> {
        let mut c = claims.clone();
        signer.key_id().clone_into(&mut c.key_id);
        check_claims(&c)?;
        let mut b = Vec::with_capacity(MAX_TICKET_LEN);
        b.extend_from_slice(&TICKET_MAGIC);
        b.extend_from_slice(&c.issued_at.to_le_bytes());
        b.extend_from_slice(&c.expires_at.to_le_bytes());
        // check_claims bounds each length by MAX_STRINGS_LEN (< 256).
        b.push(c.key_id.len() as u8);
        b.push(c.credential_id.len() as u8);
        b.push(c.node.len() as u8);
        b.push(0);
        b.extend_from_slice(c.key_id.as_bytes());
        b.extend_from_slice(c.credential_id.as_bytes());
        b.extend_from_slice(c.node.as_bytes());
        let sig = signer.sign_raw(&signed_message(&b));
        b.extend_from_slice(&sig);
        Ok(AccountingTicket { bytes: b })
    }

    /// A ticket from its bytes; nothing but the length is checked here
    /// ([`verify`](Self::verify) checks the rest).
    ///
    /// # Errors
    ///
    /// `Malformed` for more than [`MAX_TICKET_LEN`] bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<AccountingTicket, TicketError> {
        if bytes.len() > MAX_TICKET_LEN {
            return Err(malformed(format!(
                "{} bytes; a ticket has at most {MAX_TICKET_LEN}",
                bytes.len()
            )));
        }
        Ok(AccountingTicket {
            bytes: bytes.to_vec(),
        })
    }

    /// The ticket's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The ticket as JSON carries it: base64url without padding.
    pub fn to_text(&self) -> String {
        URL_SAFE_NO_PAD.encode(&self.bytes)
    }

    /// A ticket from [`to_text`](Self::to_text)'s form.
    ///
    /// # Errors
    ///
    /// `Malformed` for text that is not base64url, or too long.
    pub fn from_text(text: &str) -> Result<AccountingTicket, TicketError> {
        if text.len() > 2 * MAX_TICKET_LEN {
            return Err(malformed("the text is too long for a ticket"));
        }
        let bytes = URL_SAFE_NO_PAD
            .decode(text.trim())
            .map_err(|e| malformed(format!("not base64url without padding: {e}")))?;
        AccountingTicket::from_bytes(&bytes)
    }

    /// The claims, read without checking the signature: for the node that
    /// holds the ticket (when it ends). Nothing read this way is to be
    /// trusted.
    ///
    /// # Errors
    ///
    /// `Malformed`.
    pub fn claims_unverified(&self) -> Result<TicketClaims, TicketError> {
        self.parse().map(|(c, _, _)| c)
    }

    /// The claims, the signed bytes and the signature.
    fn parse(&self) -> Result<(TicketClaims, &[u8], [u8; SIG_LEN]), TicketError> {
        let b = &self.bytes;
        if b.len() < HEAD_LEN + SIG_LEN {
            return Err(malformed(format!(
                "{} bytes; a ticket has at least {}",
                b.len(),
                HEAD_LEN + SIG_LEN
            )));
        }
        if b[..4] != TICKET_MAGIC {
            return Err(malformed("it does not begin with RFT1"));
        }
        if b[23] != 0 {
            return Err(malformed("its reserved byte is not 0"));
        }
        let (kid_n, cid_n, node_n) = (b[20] as usize, b[21] as usize, b[22] as usize);
        let end = HEAD_LEN + kid_n + cid_n + node_n;
        if end + SIG_LEN != b.len() {
            return Err(malformed(format!(
                "its strings take {} bytes, but {} lie between its head and its signature",
                kid_n + cid_n + node_n,
                b.len().saturating_sub(HEAD_LEN + SIG_LEN)
            )));
        }
        let text = |from: usize, n: usize, what: &str| {
            std::str::from_utf8(&b[from..from + n])
                .map(str::to_owned)
                .map_err(|_| malformed(format!("its {what} is not ASCII")))
        };
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let claims = TicketClaims {
            issued_at: u64_at(4),
            expires_at: u64_at(12),
            key_id: text(HEAD_LEN, kid_n, "key id")?,
            credential_id: text(HEAD_LEN + kid_n, cid_n, "credential id")?,
            node: text(HEAD_LEN + kid_n + cid_n, node_n, "node name")?,
        };
        check_claims(&claims)?;
        let sig: [u8; SIG_LEN] = b[end..].try_into().expect("64 bytes");
        Ok((claims, &b[..end], sig))
    }

    /// Checks the layout, then the signature under `keys`, then that the
    /// ticket is valid at `now` (Unix seconds, with [`CLOCK_SKEW_S`] either
    /// way), and returns its claims.
    ///
    /// # Errors
    ///
    /// The first check that failed.
    pub fn verify(&self, keys: &LeaseKeys, now: u64) -> Result<TicketClaims, TicketError> {
        let (claims, body, sig) = self.parse()?;
        keys.verify_raw(&claims.key_id, &signed_message(body), &sig)
            .map_err(|unknown_key| TicketError::Forged {
                key_id: claims.key_id.clone(),
                unknown_key,
            })?;
        if now >= claims.expires_at.saturating_add(CLOCK_SKEW_S) {
            return Err(TicketError::Expired {
                expires_at: claims.expires_at,
                now,
            });
        }
        if claims.issued_at > now.saturating_add(CLOCK_SKEW_S) {
            return Err(TicketError::NotYetValid {
                issued_at: claims.issued_at,
                now,
            });
        }
        Ok(claims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::LeaseClaims;

    fn signer(id: &str, seed: u8) -> LeaseSigner {
        LeaseSigner::from_seed(id, [seed; 32]).unwrap()
    }

    fn keys(s: &LeaseSigner) -> LeaseKeys {
        let mut k = LeaseKeys::new();
        k.add(s.public_key()).unwrap();
        k
    }

    fn claims() -> TicketClaims {
        TicketClaims {
            key_id: String::new(),
            node: "n1".into(),
            credential_id: "0a1b".into(),
            issued_at: 1_000,
            expires_at: 1_600,
        }
    }

    #[test]
    fn ticket_bytes() {
        let s = signer("k1", 7);
        let t = AccountingTicket::sign(&s, &claims()).unwrap();
        let b = t.as_bytes();
        assert_eq!(b.len(), 24 + 2 + 4 + 2 + 64);
        assert_eq!(&b[..4], b"RFT1");
        assert_eq!(&b[4..12], &1_000u64.to_le_bytes());
        assert_eq!(&b[12..20], &1_600u64.to_le_bytes());
        assert_eq!(&b[20..24], &[2, 4, 2, 0]);
        assert_eq!(&b[24..32], b"k10a1bn1");
        let mut signed = b"rfaas-accounting-ticket-v1\0".to_vec();
        signed.extend_from_slice(&b[..32]);
        let sig = ed25519_dalek::Signature::from_bytes(&b[32..].try_into().unwrap());
        let vk = ed25519_dalek::SigningKey::from_bytes(&[7; 32]).verifying_key();
        vk.verify_strict(&signed, &sig).unwrap();

        let want = TicketClaims {
            key_id: "k1".into(),
            ..claims()
        };
        assert_eq!(t.verify(&keys(&s), 1_000).unwrap(), want);
        assert_eq!(t.claims_unverified().unwrap(), want);
        let text = t.to_text();
        assert_eq!(AccountingTicket::from_text(&text).unwrap(), t);
        assert!(!format!("{t:?}").contains("n1"));
    }

    #[test]
    fn the_longest_claims_fit_a_hello_and_longer_ones_are_refused() {
        let s = signer(&"k".repeat(64), 1);
        let fits = TicketClaims {
            credential_id: "a".repeat(16),
            node: "n".repeat(MAX_STRINGS_LEN - 64 - 16),
            ..claims()
        };
        let t = AccountingTicket::sign(&s, &fits).unwrap();
        assert_eq!(t.as_bytes().len(), MAX_TICKET_LEN);
        t.verify(&keys(&s), 1_000).unwrap();
        let over = TicketClaims {
            node: "n".repeat(MAX_STRINGS_LEN - 64 - 16 + 1),
            ..fits
        };
        assert!(matches!(
            AccountingTicket::sign(&s, &over),
            Err(TicketError::Malformed(_))
        ));
        assert!(AccountingTicket::from_bytes(&[0; MAX_TICKET_LEN + 1]).is_err());
        for bad in [
            TicketClaims {
                node: "../x".into(),
                ..claims()
            },
            TicketClaims {
                credential_id: "xyz".into(),
                ..claims()
            },
            TicketClaims {
                credential_id: String::new(),
                ..claims()
            },
            TicketClaims {
                expires_at: 1_000,
                ..claims()
            },
        ] {
            assert!(AccountingTicket::sign(&s, &bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn every_refusal_says_which() {
        let s = signer("k1", 7);
        let k = keys(&s);
        let t = AccountingTicket::sign(&s, &claims()).unwrap();
        let with = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = t.as_bytes().to_vec();
            f(&mut b);
            AccountingTicket::from_bytes(&b).unwrap().verify(&k, 1_000)
        };
        let is_malformed =
            |r: Result<TicketClaims, TicketError>| matches!(r, Err(TicketError::Malformed(_)));
        assert!(is_malformed(with(&|b| b[0] = b'X')), "magic");
        assert!(is_malformed(with(&|b| b[3] = b'2')), "layout version");
        assert!(is_malformed(with(&|b| b[23] = 1)), "reserved byte");
        assert!(is_malformed(with(&|b| b[22] = 3)), "node length");
        assert!(is_malformed(with(&|b| b[20] = 200)), "key id length");
        assert!(is_malformed(with(&|b| b.truncate(80))), "short");
        assert!(is_malformed(with(&|b| b.push(0))), "trailing byte");
        assert!(is_malformed(with(&|b| b[30] = 0xff)), "node not ASCII");
        // Any change of a signed byte or the signature is a forgery.
        assert_eq!(
            with(&|b| b[12] ^= 1),
            Err(TicketError::Forged {
                key_id: "k1".into(),
                unknown_key: false
            })
        );
        assert_eq!(
            with(&|b| b[31] = b'2'),
            Err(TicketError::Forged {
                key_id: "k1".into(),
                unknown_key: false
            }),
            "another node"
        );
        assert_eq!(
            with(&|b| {
                let n = b.len();
                b[n - 1] ^= 1
            }),
            Err(TicketError::Forged {
                key_id: "k1".into(),
                unknown_key: false
            })
        );
        // Another key with the same id, and a key id nobody accepts.
        let other = AccountingTicket::sign(&signer("k1", 8), &claims()).unwrap();
        assert!(matches!(
            other.verify(&k, 1_000),
            Err(TicketError::Forged {
                unknown_key: false,
                ..
            })
        ));
        let unknown = AccountingTicket::sign(&signer("k9", 7), &claims()).unwrap();
        assert_eq!(
            unknown.verify(&k, 1_000),
            Err(TicketError::Forged {
                key_id: "k9".into(),
                unknown_key: true
            })
        );
        // Expiry and start, with the clock skew allowed.
        assert!(t.verify(&k, 1_600 + CLOCK_SKEW_S - 1).is_ok());
        assert_eq!(
            t.verify(&k, 1_600 + CLOCK_SKEW_S),
            Err(TicketError::Expired {
                expires_at: 1_600,
                now: 1_630
            })
        );
        assert!(t.verify(&k, 1_000 - CLOCK_SKEW_S).is_ok());
        assert_eq!(
            t.verify(&k, 1_000 - CLOCK_SKEW_S - 1),
            Err(TicketError::NotYetValid {
                issued_at: 1_000,
                now: 969
            })
        );
        assert!(AccountingTicket::from_text("not base64!").is_err());
    }

    #[test]
    fn rotation_accepts_both_keys() {
        let (old, new) = (signer("old", 1), signer("new", 2));
        let mut k = LeaseKeys::new();
        k.add(old.public_key()).unwrap();
        k.add(new.public_key()).unwrap();
        for s in [&old, &new] {
            let t = AccountingTicket::sign(s, &claims()).unwrap();
            assert_eq!(t.verify(&k, 1_000).unwrap().key_id, s.key_id());
        }
    }

    /// A lease token's signature never passes for a ticket's, nor a
    /// ticket's for a lease token's: each signs its own domain.
    #[test]
    fn lease_token_signatures_are_not_tickets_and_back() {
        let s = signer("k1", 7);
        let k = keys(&s);
        let lease = LeaseClaims {
            key_id: "k1".into(),
            lease_id: 1,
            node: "n1".into(),
            user: "alice".into(),
            account: "physics".into(),
            job_id: None,
            cores: 1,
            memory_mib: 64,
            issued_at: 1_000,
            expires_at: 1_600,
            billing: None,
        };
        let token = s.sign(&lease);
        let (signed, sig) = token.rsplit_once('.').unwrap();
        let sig = URL_SAFE_NO_PAD.decode(sig).unwrap();
        // The lease token's signature under a ticket of the same claims.
        let t = AccountingTicket::sign(&s, &claims()).unwrap();
        let mut b = t.as_bytes().to_vec();
        let n = b.len();
        b[n - 64..].copy_from_slice(&sig);
        assert!(matches!(
            AccountingTicket::from_bytes(&b).unwrap().verify(&k, 1_000),
            Err(TicketError::Forged {
                unknown_key: false,
                ..
            })
        ));
        // The signed text of the token presented as a ticket body.
        let mut forged = signed.as_bytes().to_vec();
        forged.extend_from_slice(&sig);
        let r = AccountingTicket::from_bytes(&forged).and_then(|t| t.verify(&k, 1_000));
        assert!(matches!(r, Err(TicketError::Malformed(_))), "{r:?}");
        // A ticket's signature under a lease token's text.
        let tsig = &t.as_bytes()[n - 64..];
        let swapped = format!("{signed}.{}", URL_SAFE_NO_PAD.encode(tsig));
        assert!(k.verify(&swapped, 1_000, "n1").is_err());
    }
}
