//! Lease tokens: a lease's claims signed with Ed25519 by the manager, so an
//! executor checks a lease without asking the manager, and holds only
//! public keys: root on one compute node can check leases, never mint them.
//!
//! # Format
//!
//! ```text
//! rfaas2.<claims>.<signature>
//! ```
//!
//! - `rfaas2` names the format (version 2 of the token; version 1, signed
//!   with a secret every node shared, is gone).
//! - `<claims>` is the base64url (no padding) encoding of the claims as one
//!   JSON object, see [`LeaseClaims`]. Its `key_id` names the key that
//!   signed it.
//! - `<signature>` is the base64url (no padding) encoding of the 64-byte
//!   Ed25519 signature (RFC 8032) of the ASCII bytes `"rfaas2." + <claims>`:
//!   it covers the exact characters of the prefix and the encoded claims, so
//!   nothing is re-serialised before checking.
//!
//! A token is text, fit for an environment variable or an HTTP header.
//! [`LeaseSigner::sign`] makes one and [`LeaseKeys::verify`] checks the
//! signature, the expiry and the node, in that order, and says which
//! failed. Several keys may be accepted at once, by `key_id`, so a manager
//! can move to a new key while tokens signed with the old one still run.
//!
//! # Key files
//!
//! One key per line, text:
//!
//! ```text
//! rfaas-ed25519-secret <key_id> <base64url 32-byte seed>
//! rfaas-ed25519-public <key_id> <base64url 32-byte public key>
//! ```
//!
//! A secret file holds one secret line; a public file holds one or more
//! public lines. Both may hold blank lines and `#` comments. A key id is 1
//! to [`MAX_KEY_ID_LEN`] ASCII letters, digits, `.`, `_` or `-`.

use std::collections::BTreeMap;
use std::fmt;
use std::io::Read as _;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};

/// The token's format prefix, the part before the first dot.
pub const TOKEN_PREFIX: &str = "rfaas2";

/// The first word of a secret key line.
pub const SECRET_KEY_TAG: &str = "rfaas-ed25519-secret";

/// The first word of a public key line.
pub const PUBLIC_KEY_TAG: &str = "rfaas-ed25519-public";

/// The longest key id, in bytes.
pub const MAX_KEY_ID_LEN: usize = 64;

/// The longest token accepted, in bytes: far above any real lease's, and
/// a bound on what an unauthenticated peer makes the verifier decode.
pub const MAX_TOKEN_LEN: usize = 8192;

/// Bytes of an Ed25519 seed (the secret key).
pub const SEED_LEN: usize = 32;

/// What a lease grants: `cores` and `memory_mib` on `node`, for `user`
/// (charged to `account`, optionally inside Slurm job `job_id`), until
/// `expires_at`; signed with the key `key_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseClaims {
    /// The id of the key that signs the token; an executor verifies it with
    /// the public key of that id in its `lease_keys`. [`LeaseSigner::sign`]
    /// sets it to its own.
    pub key_id: String,
    /// The lease's id, unique in the cluster.
    pub lease_id: u64,
    /// Host name of the node the lease is for; other executors refuse it.
    pub node: String,
    /// The user whose job holds the lease; workers run as this user.
    pub user: String,
    /// The account charged.
    pub account: String,
    /// The Slurm job the lease serves, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<u64>,
    /// Cores granted.
    pub cores: u16,
    /// Memory granted, in MiB.
    pub memory_mib: u32,
    /// When the lease was granted, Unix seconds.
    pub issued_at: u64,
    /// When the lease ends, Unix seconds; the token is refused from then on.
    pub expires_at: u64,
    /// Where the executor adds the lease's usage; none for a lease nobody
    /// bills (minted by hand, or no accounting service was up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub billing: Option<crate::accounting::BillingSlot>,
}

/// Why a token was refused. Every variant's message says what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// The text is not `rfaas2.<claims>.<signature>` with valid base64url
    /// and JSON.
    #[error("the lease token is malformed ({0}); pass the token exactly as the manager or rfaas-token printed it")]
    Malformed(String),
    /// The signature does not verify, or no accepted key has the token's
    /// key id: the token was forged, altered, or signed by a manager this
    /// verifier does not trust.
    #[error("{}", forged_message(key_id, *unknown_key))]
    Forged {
        /// The key id the token names.
        key_id: String,
        /// No accepted key has that id (rather than: the key's signature
        /// does not match).
        unknown_key: bool,
    },
    /// The lease has ended.
    #[error("the lease token expired at {expires_at} (Unix seconds), it is now {now}; request a new lease")]
    Expired {
        /// The claims' `expires_at`.
        expires_at: u64,
        /// The verifier's clock.
        now: u64,
    },
    /// The lease is for another node.
    #[error("the lease token is for node {token_node:?}, but this is node {this_node:?}; allocate on the node the lease names")]
    WrongNode {
        /// The claims' `node`.
        token_node: String,
        /// The verifier's node name.
        this_node: String,
    },
}

fn forged_message(key_id: &str, unknown_key: bool) -> String {
    if unknown_key {
        format!(
            "the lease token is signed with key {key_id:?}, which is not among this executor's accepted keys: \
             add the manager's public key {key_id:?} to the executor's lease_keys files and restart it, \
             or get the token from a manager this node trusts"
        )
    } else {
        format!(
            "the lease token's signature does not verify under key {key_id:?}: it was forged or altered, \
             or signed by another key with the same id; check that the executor's lease_keys hold the \
             manager's current public key {key_id:?}, and get a new token from the manager"
        )
    }
}

impl TokenError {
    /// A short stable name for logs, metrics and error codes.
    pub fn kind(&self) -> &'static str {
        match self {
            TokenError::Malformed(_) => "token_malformed",
            TokenError::Forged { .. } => "token_forged",
            TokenError::Expired { .. } => "token_expired",
            TokenError::WrongNode { .. } => "token_wrong_node",
        }
    }
}

/// Why a key, or a key file's text, cannot be used. Every variant's message
/// says what to do; the caller adds which file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// A line is not a key line of the expected kind.
    #[error("line {line}: {why}; a key line reads `{tag} <key_id> <base64url key>` (make keys with `rfaas-token keygen`)")]
    Malformed {
        /// 1-based line number.
        line: usize,
        /// The expected first word.
        tag: &'static str,
        /// What is wrong.
        why: String,
    },
    /// A key id with characters or a length the formats do not allow.
    #[error("the key id {0:?} is not allowed; use 1 to {MAX_KEY_ID_LEN} ASCII letters, digits, '.', '_' or '-'")]
    BadKeyId(String),
    /// The text holds no key.
    #[error("it holds no {0} line; make keys with `rfaas-token keygen`")]
    Empty(&'static str),
    /// A secret key file with more than one key.
    #[error("line {line}: a second secret key; a secret key file holds exactly one")]
    SecondSecret {
        /// 1-based line number.
        line: usize,
    },
    /// Two different public keys with one id.
    #[error("key id {0:?} is given twice with different public keys; remove the stale one (rotate with a new key id)")]
    DuplicateKeyId(String),
    /// The kernel's random source failed.
    #[error("cannot read random bytes from /dev/urandom: {0}")]
    Random(#[source] std::io::Error),
}

pub(crate) fn check_key_id(key_id: &str) -> Result<(), KeyError> {
    let ok = !key_id.is_empty()
        && key_id.len() <= MAX_KEY_ID_LEN
        && key_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(KeyError::BadKeyId(key_id.to_owned()))
    }
}

/// The key lines of `text` with their 1-based numbers: blank lines and
/// `#` comments skipped.
fn key_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
}

/// Splits `<tag> <key_id> <b64>` and decodes the 32 key bytes.
fn parse_key_line<'a>(
    line_no: usize,
    line: &'a str,
    tag: &'static str,
) -> Result<(&'a str, [u8; 32]), KeyError> {
    let bad = |why: String| KeyError::Malformed {
        line: line_no,
        tag,
        why,
    };
    let words: Vec<&str> = line.split_whitespace().collect();
    let [first, key_id, b64] = words[..] else {
        return Err(bad(format!("it has {} words, not 3", words.len())));
    };
    if first != tag {
        return Err(bad(format!("it starts with {first:?}, not {tag:?}")));
    }
    check_key_id(key_id)?;
    let bytes = URL_SAFE_NO_PAD
        .decode(b64)
        .map_err(|e| bad(format!("the key is not base64url without padding: {e}")))?;
    let key: [u8; 32] = bytes
        .try_into()
        .map_err(|b: Vec<u8>| bad(format!("the key is {} bytes, not 32", b.len())))?;
    Ok((key_id, key))
}

/// A manager's signing key: an Ed25519 key and its id. Its `Debug` shows
/// the id and the public key, never the secret.
#[derive(Clone)]
pub struct LeaseSigner {
    key_id: String,
    signing_key: SigningKey,
}

impl fmt::Debug for LeaseSigner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseSigner")
            .field("key_id", &self.key_id)
            .field("public", &self.public_key().to_line().trim_end())
            .finish_non_exhaustive()
    }
}

impl LeaseSigner {
    /// The signer with key id `key_id` and the Ed25519 secret `seed`.
    pub fn from_seed(key_id: &str, seed: [u8; SEED_LEN]) -> Result<LeaseSigner, KeyError> {
        check_key_id(key_id)?;
        Ok(LeaseSigner {
            key_id: key_id.to_owned(),
            signing_key: SigningKey::from_bytes(&seed),
        })
    }

    /// A new signer with key id `key_id` and a seed from the kernel's
    /// random source (`/dev/urandom`).
    pub fn generate(key_id: &str) -> Result<LeaseSigner, KeyError> {
        check_key_id(key_id)?;
        let mut seed = [0u8; SEED_LEN];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut seed))
            .map_err(KeyError::Random)?;
        let signer = LeaseSigner::from_seed(key_id, seed);
        seed.fill(0);
        signer
    }

    /// Parses a secret key file's text: exactly one
    /// `rfaas-ed25519-secret <key_id> <seed>` line, blank lines and `#`
    /// comments aside.
    pub fn from_text(text: &str) -> Result<LeaseSigner, KeyError> {
        let mut found = None;
        for (line_no, line) in key_lines(text) {
            if found.is_some() {
                return Err(KeyError::SecondSecret { line: line_no });
            }
            let (key_id, seed) = parse_key_line(line_no, line, SECRET_KEY_TAG)?;
            found = Some(LeaseSigner::from_seed(key_id, seed)?);
        }
        found.ok_or(KeyError::Empty(SECRET_KEY_TAG))
    }

    /// The secret key file's line (with its newline). Whoever holds it can
    /// mint leases for every node that accepts the key: keep it private.
    pub fn to_secret_line(&self) -> String {
        format!(
            "{SECRET_KEY_TAG} {} {}\n",
            self.key_id,
            URL_SAFE_NO_PAD.encode(self.signing_key.to_bytes())
        )
    }

    /// The key's id.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The public half, for the executors' `lease_keys`.
    pub fn public_key(&self) -> PublicKey {
        PublicKey {
            key_id: self.key_id.clone(),
            key: self.signing_key.verifying_key(),
        }
    }

    /// Signs `claims` and returns the token text. The token's `key_id` is
    /// this signer's, whatever `claims.key_id` says.
    pub fn sign(&self, claims: &LeaseClaims) -> String {
        let mut claims = claims.clone();
        claims.key_id.clone_from(&self.key_id);
        let json = serde_json::to_vec(&claims).expect("claims always serialise");
        let signed = format!("{TOKEN_PREFIX}.{}", URL_SAFE_NO_PAD.encode(json));
        let signature = self.signing_key.sign(signed.as_bytes());
        format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature.to_bytes()))
    }

    /// The signature of `message` as it is: for the other signed formats
    /// of this crate, which put their own domain prefix in front so that
    /// no signature is ever valid for two formats.
    pub(crate) fn sign_raw(&self, message: &[u8]) -> [u8; 64] {
        self.signing_key.sign(message).to_bytes()
    }
}

/// One accepted public key and its id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicKey {
    key_id: String,
    key: VerifyingKey,
}

impl PublicKey {
    /// The key with id `key_id` and the 32 bytes of an Ed25519 public key.
    pub fn from_bytes(key_id: &str, bytes: [u8; 32]) -> Result<PublicKey, KeyError> {
        check_key_id(key_id)?;
        let key = VerifyingKey::from_bytes(&bytes).map_err(|_| KeyError::Malformed {
            line: 1,
            tag: PUBLIC_KEY_TAG,
            why: "the 32 bytes are not an Ed25519 public key".into(),
        })?;
        Ok(PublicKey {
            key_id: key_id.to_owned(),
            key,
        })
    }

    /// The key's id.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The public key file's line (with its newline).
    pub fn to_line(&self) -> String {
        format!(
            "{PUBLIC_KEY_TAG} {} {}\n",
            self.key_id,
            URL_SAFE_NO_PAD.encode(self.key.to_bytes())
        )
    }

    /// Parses a public key file's text: one or more
    /// `rfaas-ed25519-public <key_id> <key>` lines, blank lines and `#`
    /// comments aside.
    pub fn parse_all(text: &str) -> Result<Vec<PublicKey>, KeyError> {
        let mut keys = Vec::new();
        for (line_no, line) in key_lines(text) {
            let (key_id, bytes) = parse_key_line(line_no, line, PUBLIC_KEY_TAG)?;
            let key = PublicKey::from_bytes(key_id, bytes).map_err(|e| match e {
                KeyError::Malformed { tag, why, .. } => KeyError::Malformed {
                    line: line_no,
                    tag,
                    why,
                },
                other => other,
            })?;
            keys.push(key);
        }
        if keys.is_empty() {
            return Err(KeyError::Empty(PUBLIC_KEY_TAG));
        }
        Ok(keys)
    }
}

/// The public keys a verifier accepts, by key id: usually one, two while a
/// manager moves to a new key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaseKeys {
    keys: BTreeMap<String, VerifyingKey>,
}

impl LeaseKeys {
    /// No key: every token is refused as forged.
    pub fn new() -> LeaseKeys {
        LeaseKeys::default()
    }

    /// Accepts `key` too. The same key twice is one key; another key with
    /// an id already taken is refused.
    pub fn add(&mut self, key: PublicKey) -> Result<(), KeyError> {
        match self.keys.get(&key.key_id) {
            Some(known) if *known != key.key => Err(KeyError::DuplicateKeyId(key.key_id)),
            Some(_) => Ok(()),
            None => {
                self.keys.insert(key.key_id, key.key);
                Ok(())
            }
        }
    }

    /// Accepts every key of a public key file's text
    /// ([`PublicKey::parse_all`]).
    pub fn add_text(&mut self, text: &str) -> Result<(), KeyError> {
        for key in PublicKey::parse_all(text)? {
            self.add(key)?;
        }
        Ok(())
    }

    /// The accepted key ids, sorted.
    pub fn key_ids(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is accepted.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Checks `token`'s signature, then that it has not expired at `now`
    /// (Unix seconds), then that it names `node`, and returns its claims.
    pub fn verify(&self, token: &str, now: u64, node: &str) -> Result<LeaseClaims, TokenError> {
        let claims = self.verify_signature(token)?;
        if now >= claims.expires_at {
            return Err(TokenError::Expired {
                expires_at: claims.expires_at,
                now,
            });
        }
        if claims.node != node {
            return Err(TokenError::WrongNode {
                token_node: claims.node,
                this_node: node.to_owned(),
            });
        }
        Ok(claims)
    }

    /// Checks `signature` of `message` under the key `key_id`: `Err(true)`
    /// when no accepted key has that id, `Err(false)` when it does not
    /// verify. For the other signed formats of this crate (see
    /// [`LeaseSigner::sign_raw`]).
    pub(crate) fn verify_raw(
        &self,
        key_id: &str,
        message: &[u8],
        signature: &[u8; 64],
    ) -> Result<(), bool> {
        let key = self.keys.get(key_id).ok_or(true)?;
        key.verify_strict(message, &Signature::from_bytes(signature))
            .map_err(|_| false)
    }

    /// Checks only the format and the signature; the caller checks expiry
    /// and node (see [`verify`](Self::verify)).
    pub fn verify_signature(&self, token: &str) -> Result<LeaseClaims, TokenError> {
        let Parts { signed, sig, json } = split(token)?;
        // The key id comes from bytes not yet checked: nothing else is
        // believed before the signature verifies.
        #[derive(Deserialize)]
        struct KeyIdOnly {
            key_id: String,
        }
        let KeyIdOnly { key_id } = serde_json::from_slice(&json)
            .map_err(|e| malformed(&format!("the claims name no key_id: {e}")))?;
        let Some(key) = self.keys.get(&key_id) else {
            return Err(TokenError::Forged {
                key_id,
                unknown_key: true,
            });
        };
        key.verify_strict(signed.as_bytes(), &Signature::from_bytes(&sig))
            .map_err(|_| TokenError::Forged {
                key_id: key_id.clone(),
                unknown_key: false,
            })?;
        claims_of(&json)
    }
}

/// The claims of `token`, read without checking its signature: for a
/// client that wants to know what its own token says (the node it names,
/// its end). Nothing read this way is to be trusted; whoever decides on a
/// token checks it with [`LeaseKeys::verify`].
pub fn read_claims_unverified(token: &str) -> Result<LeaseClaims, TokenError> {
    claims_of(&split(token)?.json)
}

/// A token taken apart: the signed text, the signature and the claims'
/// JSON.
struct Parts<'a> {
    signed: &'a str,
    sig: [u8; 64],
    json: Vec<u8>,
}

fn malformed(why: &str) -> TokenError {
    TokenError::Malformed(why.to_owned())
}

/// Takes `token` apart, checking its format but not its signature.
fn split(token: &str) -> Result<Parts<'_>, TokenError> {
    let token = token.trim();
    if token.len() > MAX_TOKEN_LEN {
        return Err(malformed(&format!(
            "it is {} bytes, more than {MAX_TOKEN_LEN}",
            token.len()
        )));
    }
    let (signed, sig_b64) = token
        .rsplit_once('.')
        .ok_or_else(|| malformed("it has no '.'"))?;
    let (prefix, claims_b64) = signed
        .split_once('.')
        .ok_or_else(|| malformed("it has only two parts"))?;
    if prefix != TOKEN_PREFIX {
        return Err(malformed(&format!(
            "it starts with {prefix:?}, not {TOKEN_PREFIX:?}"
        )));
    }
    let sig = URL_SAFE_NO_PAD
        .decode(sig_b64)
        .map_err(|e| malformed(&format!("the signature is not base64url: {e}")))?;
    let sig: [u8; 64] = sig
        .try_into()
        .map_err(|s: Vec<u8>| malformed(&format!("the signature is {} bytes, not 64", s.len())))?;
    let json = URL_SAFE_NO_PAD
        .decode(claims_b64)
        .map_err(|e| malformed(&format!("the claims are not base64url: {e}")))?;
    Ok(Parts { signed, sig, json })
}

/// The claims in their JSON.
fn claims_of(json: &[u8]) -> Result<LeaseClaims, TokenError> {
    serde_json::from_slice(json).map_err(|e| malformed(&format!("the claims are not valid: {e}")))
}

impl fmt::Display for LeaseClaims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "lease {} on {} for {} ({}): {} cores, {} MiB, until {}",
            self.lease_id,
            self.node,
            self.user,
            self.account,
            self.cores,
            self.memory_mib,
            self.expires_at
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEED: [u8; 32] = [7; 32];

    fn signer() -> LeaseSigner {
        LeaseSigner::from_seed("m1", SEED).unwrap()
    }

    fn keys() -> LeaseKeys {
        let mut k = LeaseKeys::new();
        k.add(signer().public_key()).unwrap();
        k
    }

    fn claims() -> LeaseClaims {
        LeaseClaims {
            key_id: "m1".into(),
            lease_id: 7,
            node: "n1".into(),
            user: "alice".into(),
            account: "physics".into(),
            job_id: Some(42),
            cores: 2,
            memory_mib: 512,
            issued_at: 1_000,
            expires_at: 2_000,
            billing: None,
        }
    }

    /// RFC 8032, section 7.1, test 1: the library is used as Ed25519.
    #[test]
    fn rfc8032_test_vector() {
        let hex = |s: &str| -> Vec<u8> {
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect()
        };
        let seed: [u8; 32] =
            hex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
                .try_into()
                .unwrap();
        let s = LeaseSigner::from_seed("rfc", seed).unwrap();
        assert_eq!(
            s.public_key().key.to_bytes().to_vec(),
            hex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
        );
        assert_eq!(
            s.signing_key.sign(b"").to_bytes().to_vec(),
            hex(
                "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e06522490155\
                 5fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"
            )
        );
    }

    /// The exact text of a token, so a change of format cannot go unnoticed.
    #[test]
    fn exact_token_text() {
        let token = signer().sign(&claims());
        let json = r#"{"key_id":"m1","lease_id":7,"node":"n1","user":"alice","account":"physics","job_id":42,"cores":2,"memory_mib":512,"issued_at":1000,"expires_at":2000}"#;
        let (signed, sig) = token.rsplit_once('.').unwrap();
        assert_eq!(signed, format!("rfaas2.{}", URL_SAFE_NO_PAD.encode(json)));
        // Ed25519 signatures are 64 bytes: 86 base64url characters unpadded;
        // deterministic, so the whole token is fixed by seed and claims
        // (OpenSSL's `pkeyutl -sign -rawin` gives the same signature).
        assert_eq!(sig.len(), 86);
        assert_eq!(
            token,
            "rfaas2.eyJrZXlfaWQiOiJtMSIsImxlYXNlX2lkIjo3LCJub2RlIjoibjEiLCJ1c2VyIjoiYWxpY2UiLCJhY2NvdW50IjoicGh5c2ljcyIsImpvYl9pZCI6NDIsImNvcmVzIjoyLCJtZW1vcnlfbWliIjo1MTIsImlzc3VlZF9hdCI6MTAwMCwiZXhwaXJlc19hdCI6MjAwMH0.6cL6UGStbLkv2AcowwIVNF8aaty4UyATnoH_UnCBAYmFYpJMit5PVTqtIwy0tx9_JNfK-HZ0Ve1T4emsIPuyDw"
        );
    }

    #[test]
    fn round_trip() {
        let token = signer().sign(&claims());
        assert_eq!(keys().verify(&token, 1_500, "n1").unwrap(), claims());
        assert_eq!(keys().verify_signature(&token).unwrap(), claims());
    }

    #[test]
    fn the_signer_sets_the_key_id() {
        let mut c = claims();
        c.key_id = "whatever".into();
        let token = signer().sign(&c);
        assert_eq!(keys().verify(&token, 1_500, "n1").unwrap().key_id, "m1");
    }

    #[test]
    fn job_id_is_optional() {
        let mut c = claims();
        c.job_id = None;
        let token = signer().sign(&c);
        let back = keys().verify(&token, 1_500, "n1").unwrap();
        assert_eq!(back.job_id, None);
    }

    #[test]
    fn another_key_with_the_same_id_is_forged() {
        let other = LeaseSigner::from_seed("m1", [8; 32]).unwrap();
        let token = other.sign(&claims());
        let err = keys().verify(&token, 1_500, "n1").unwrap_err();
        assert_eq!(
            err,
            TokenError::Forged {
                key_id: "m1".into(),
                unknown_key: false
            }
        );
        assert_eq!(err.kind(), "token_forged");
        assert!(err.to_string().contains("lease_keys"), "{err}");
    }

    #[test]
    fn an_unknown_key_id_is_forged() {
        let other = LeaseSigner::from_seed("m9", SEED).unwrap();
        let err = keys()
            .verify(&other.sign(&claims()), 1_500, "n1")
            .unwrap_err();
        assert_eq!(
            err,
            TokenError::Forged {
                key_id: "m9".into(),
                unknown_key: true
            }
        );
        assert_eq!(err.kind(), "token_forged");
        let msg = err.to_string();
        assert!(
            msg.contains("\"m9\"") && msg.contains("lease_keys"),
            "{msg}"
        );
        // No key at all: the same.
        let err = LeaseKeys::new()
            .verify(&signer().sign(&claims()), 1_500, "n1")
            .unwrap_err();
        assert_eq!(err.kind(), "token_forged");
    }

    #[test]
    fn altered_tokens_are_forged() {
        let token = signer().sign(&claims());
        // Claims changed (more cores) while keeping the old signature.
        let (_, sig) = token.rsplit_once('.').unwrap();
        let mut more = claims();
        more.cores = 64;
        let resigned = LeaseSigner::from_seed("m1", [9; 32]).unwrap().sign(&more);
        let (more_signed, _) = resigned.rsplit_once('.').unwrap();
        let forged = format!("{more_signed}.{sig}");
        assert_eq!(
            keys().verify(&forged, 1_500, "n1").unwrap_err().kind(),
            "token_forged"
        );
        // One character of the signature changed.
        let mut bytes = token.clone().into_bytes();
        let at = bytes.len() - 10;
        bytes[at] = if bytes[at] == b'A' { b'B' } else { b'A' };
        let flipped = String::from_utf8(bytes).unwrap();
        assert_eq!(
            keys().verify(&flipped, 1_500, "n1").unwrap_err().kind(),
            "token_forged"
        );
    }

    #[test]
    fn two_keys_are_accepted_while_rotating() {
        let old = signer();
        let new = LeaseSigner::from_seed("m2", [3; 32]).unwrap();
        let mut both = LeaseKeys::new();
        both.add_text(&format!(
            "# the manager's keys\n{}\n{}",
            old.public_key().to_line(),
            new.public_key().to_line()
        ))
        .unwrap();
        assert_eq!(both.key_ids().collect::<Vec<_>>(), ["m1", "m2"]);
        for s in [&old, &new] {
            let back = both.verify(&s.sign(&claims()), 1_500, "n1").unwrap();
            assert_eq!(back.key_id, s.key_id());
        }
        // The old key retired: its tokens are refused, the new ones run.
        let mut only_new = LeaseKeys::new();
        only_new.add(new.public_key()).unwrap();
        assert_eq!(
            only_new
                .verify(&old.sign(&claims()), 1_500, "n1")
                .unwrap_err()
                .kind(),
            "token_forged"
        );
        assert!(only_new.verify(&new.sign(&claims()), 1_500, "n1").is_ok());
    }

    #[test]
    fn expired_and_other_node_are_refused_after_the_signature() {
        let token = signer().sign(&claims());
        assert_eq!(
            keys().verify(&token, 2_000, "n1"),
            Err(TokenError::Expired {
                expires_at: 2_000,
                now: 2_000
            })
        );
        let err = keys().verify(&token, 1_500, "n2").unwrap_err();
        assert_eq!(err.kind(), "token_wrong_node");
        assert!(err.to_string().contains("\"n1\""), "{err}");
        // A forged token is reported as forged even when also expired.
        let other = LeaseSigner::from_seed("m1", [8; 32]).unwrap();
        assert_eq!(
            keys()
                .verify(&other.sign(&claims()), 9_999, "n2")
                .unwrap_err()
                .kind(),
            "token_forged"
        );
    }

    #[test]
    fn malformed_tokens_say_why() {
        let sig = URL_SAFE_NO_PAD.encode([0u8; 64]);
        let no_key_id = URL_SAFE_NO_PAD.encode(b"{\"lease_id\":1}");
        let too_long = format!("rfaas2.{}.{sig}", "A".repeat(MAX_TOKEN_LEN));
        for bad in [
            "".to_owned(),
            "rfaas2".to_owned(),
            "rfaas2.abc".to_owned(),
            format!("rfaas1.e30.{sig}"),
            format!("jwt.abc.{sig}"),
            format!("rfaas2.!!!.{sig}"),
            "rfaas2.e30.***".to_owned(),
            // A signature of the wrong length.
            "rfaas2.e30.AAAA".to_owned(),
            // Claims without a key id.
            format!("rfaas2.{no_key_id}.{sig}"),
            too_long,
        ] {
            let err = keys().verify(&bad, 0, "n1").unwrap_err();
            assert_eq!(err.kind(), "token_malformed", "{bad:?}: {err}");
        }
        // Well signed, but the claims are not a lease.
        let s = signer();
        let signed = format!("rfaas2.{}", URL_SAFE_NO_PAD.encode(b"{\"key_id\":\"m1\"}"));
        let token = format!(
            "{signed}.{}",
            URL_SAFE_NO_PAD.encode(s.signing_key.sign(signed.as_bytes()).to_bytes())
        );
        let err = keys().verify(&token, 0, "n1").unwrap_err();
        assert!(err.to_string().contains("claims are not valid"), "{err}");
    }

    #[test]
    fn a_client_reads_its_own_tokens_claims() {
        // Signed by a key nobody here accepts: read all the same.
        let other = LeaseSigner::from_seed("m9", [9; 32]).unwrap();
        let token = other.sign(&claims());
        let read = read_claims_unverified(&token).unwrap();
        assert_eq!(read.node, claims().node);
        assert_eq!(read.key_id, "m9");
        let err = read_claims_unverified("rfaas2.abc").unwrap_err();
        assert_eq!(err.kind(), "token_malformed", "{err}");
    }

    #[test]
    fn key_lines_round_trip() {
        let s = signer();
        let line = s.to_secret_line();
        assert_eq!(
            line,
            format!("rfaas-ed25519-secret m1 {}\n", URL_SAFE_NO_PAD.encode(SEED))
        );
        let back = LeaseSigner::from_text(&format!("# made for tests\n\n{line}")).unwrap();
        assert_eq!(back.public_key(), s.public_key());
        let public = s.public_key().to_line();
        assert!(public.starts_with("rfaas-ed25519-public m1 "), "{public}");
        assert_eq!(
            public.trim_end().len(),
            "rfaas-ed25519-public m1 ".len() + 43
        );
        assert_eq!(PublicKey::parse_all(&public).unwrap(), vec![s.public_key()]);
        // The Debug form shows no secret.
        let debug = format!("{s:?}");
        assert!(!debug.contains(&URL_SAFE_NO_PAD.encode(SEED)), "{debug}");
    }

    #[test]
    fn bad_key_files_say_why() {
        let s = signer();
        let seed = URL_SAFE_NO_PAD.encode(SEED);
        let long = URL_SAFE_NO_PAD.encode([7u8; 34]);
        let secret_errs = [
            ("".to_owned(), "no rfaas-ed25519-secret line"),
            (
                "# only a comment\n".to_owned(),
                "no rfaas-ed25519-secret line",
            ),
            (s.public_key().to_line(), "not \"rfaas-ed25519-secret\""),
            ("rfaas-ed25519-secret m1\n".to_owned(), "2 words"),
            (format!("rfaas-ed25519-secret m1 {long}\n"), "34 bytes"),
            (format!("rfaas-ed25519-secret m1 {seed}=\n"), "base64url"),
            (
                format!("rfaas-ed25519-secret m/1 {seed}\n"),
                "key id \"m/1\"",
            ),
            (
                format!("{}{}", s.to_secret_line(), s.to_secret_line()),
                "line 2: a second secret key",
            ),
        ];
        for (text, want) in secret_errs {
            let err = LeaseSigner::from_text(&text).unwrap_err().to_string();
            assert!(err.contains(want), "{text:?}: {err}");
        }
        let mut k = LeaseKeys::new();
        let err = k.add_text("\n# nothing\n").unwrap_err().to_string();
        assert!(err.contains("no rfaas-ed25519-public line"), "{err}");
        let err = k.add_text(&s.to_secret_line()).unwrap_err().to_string();
        assert!(err.contains("line 1"), "{err}");
        // Same id, another key.
        k.add(s.public_key()).unwrap();
        k.add(s.public_key()).unwrap();
        let other = LeaseSigner::from_seed("m1", [8; 32]).unwrap();
        let err = k.add(other.public_key()).unwrap_err();
        assert!(
            matches!(err, KeyError::DuplicateKeyId(ref id) if id == "m1"),
            "{err}"
        );
        assert_eq!(k.len(), 1);
        assert!(LeaseSigner::from_seed(&"x".repeat(MAX_KEY_ID_LEN + 1), SEED).is_err());
        assert!(LeaseSigner::from_seed("", SEED).is_err());
    }

    #[test]
    fn generated_keys_differ() {
        let a = LeaseSigner::generate("g").unwrap();
        let b = LeaseSigner::generate("g").unwrap();
        assert_ne!(a.public_key(), b.public_key());
        let mut k = LeaseKeys::new();
        k.add(a.public_key()).unwrap();
        assert!(k.verify_signature(&a.sign(&claims())).is_ok());
        assert!(k.verify_signature(&b.sign(&claims())).is_err());
    }
}
