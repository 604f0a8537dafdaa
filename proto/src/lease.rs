//! Lease tokens: a lease's claims signed with HMAC-SHA256 under the cluster
//! secret, so an executor checks a lease without asking the manager.
//!
//! # Format
//!
//! ```text
//! rfaas1.<claims>.<mac>
//! ```
//!
//! - `rfaas1` names the format (version 1 of the token).
//! - `<claims>` is the base64url (no padding) encoding of the claims as one
//!   JSON object, see [`LeaseClaims`].
//! - `<mac>` is the base64url (no padding) encoding of
//!   HMAC-SHA256(secret, `"rfaas1." + <claims>`): the MAC covers the exact
//!   characters of the prefix and the encoded claims, so nothing is
//!   re-serialised before checking.
//!
//! A token is text, fit for an environment variable or an HTTP header.
//! [`LeaseClaims::sign`] makes one and [`verify`] checks the signature,
//! the expiry and the node, in that order, and says which failed.

use std::fmt;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// The token's format prefix, the part before the first dot.
pub const TOKEN_PREFIX: &str = "rfaas1";

/// The shortest cluster secret accepted, in bytes.
pub const MIN_SECRET_LEN: usize = 32;

/// What a lease grants: `cores` and `memory_mib` on `node`, for `user`
/// (charged to `account`, optionally inside Slurm job `job_id`), until
/// `expires_at`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseClaims {
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
}

/// Why a token was refused. Every variant's message says what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// The text is not `rfaas1.<claims>.<mac>` with valid base64url and JSON.
    #[error("the lease token is malformed ({0}); pass the token exactly as the manager or rfaas-token printed it")]
    Malformed(String),
    /// The MAC does not match: the token was forged, altered, or signed with
    /// another cluster's secret.
    #[error("the lease token's signature does not match this cluster's secret: it was forged, altered or issued by another cluster")]
    BadSignature,
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
    /// The secret is too short to be safe.
    #[error("the cluster secret is {len} bytes; it must be at least {MIN_SECRET_LEN} bytes")]
    WeakSecret {
        /// Length of the secret given.
        len: usize,
    },
}

impl TokenError {
    /// A short stable name for logs, metrics and error codes.
    pub fn kind(&self) -> &'static str {
        match self {
            TokenError::Malformed(_) => "token_malformed",
            TokenError::BadSignature => "token_forged",
            TokenError::Expired { .. } => "token_expired",
            TokenError::WrongNode { .. } => "token_wrong_node",
            TokenError::WeakSecret { .. } => "weak_secret",
        }
    }
}

type HmacSha256 = Hmac<Sha256>;

fn mac(secret: &[u8]) -> Result<HmacSha256, TokenError> {
    if secret.len() < MIN_SECRET_LEN {
        return Err(TokenError::WeakSecret { len: secret.len() });
    }
    // HMAC takes keys of any length; the length check above is ours.
    Ok(HmacSha256::new_from_slice(secret).expect("HMAC accepts every key length"))
}

impl LeaseClaims {
    /// Signs the claims with `secret` and returns the token text.
    pub fn sign(&self, secret: &[u8]) -> Result<String, TokenError> {
        let json = serde_json::to_vec(self).expect("claims always serialise");
        let signed = format!("{TOKEN_PREFIX}.{}", URL_SAFE_NO_PAD.encode(json));
        let mut m = mac(secret)?;
        m.update(signed.as_bytes());
        let tag = m.finalize().into_bytes();
        Ok(format!("{signed}.{}", URL_SAFE_NO_PAD.encode(tag)))
    }
}

/// Checks `token`'s signature under `secret`, then that it has not expired
/// at `now` (Unix seconds), then that it names `node`, and returns its claims.
///
/// The signature is compared in constant time.
pub fn verify(token: &str, secret: &[u8], now: u64, node: &str) -> Result<LeaseClaims, TokenError> {
    let claims = verify_signature(token, secret)?;
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

/// Checks only the signature and the format; the caller checks expiry and
/// node (see [`verify`]).
pub fn verify_signature(token: &str, secret: &[u8]) -> Result<LeaseClaims, TokenError> {
    let malformed = |why: &str| TokenError::Malformed(why.to_owned());
    let (signed, tag) = token
        .trim()
        .rsplit_once('.')
        .ok_or_else(|| malformed("it has no '.'"))?;
    let (prefix, claims_b64) = signed
        .split_once('.')
        .ok_or_else(|| malformed("it has only one part"))?;
    if prefix != TOKEN_PREFIX {
        return Err(malformed(&format!(
            "it starts with {prefix:?}, not {TOKEN_PREFIX:?}"
        )));
    }
    let tag = URL_SAFE_NO_PAD
        .decode(tag)
        .map_err(|e| malformed(&format!("the signature is not base64url: {e}")))?;
    let json = URL_SAFE_NO_PAD
        .decode(claims_b64)
        .map_err(|e| malformed(&format!("the claims are not base64url: {e}")))?;
    let mut m = mac(secret)?;
    m.update(signed.as_bytes());
    m.verify_slice(&tag).map_err(|_| TokenError::BadSignature)?;
    // Only signed bytes reach the JSON parser.
    serde_json::from_slice(&json).map_err(|e| malformed(&format!("the claims are not valid: {e}")))
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

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn claims() -> LeaseClaims {
        LeaseClaims {
            lease_id: 7,
            node: "n1".into(),
            user: "alice".into(),
            account: "physics".into(),
            job_id: Some(42),
            cores: 2,
            memory_mib: 512,
            issued_at: 1_000,
            expires_at: 2_000,
        }
    }

    /// The exact text of a token, so a change of format cannot go unnoticed.
    #[test]
    fn exact_token_text() {
        let token = claims().sign(SECRET).unwrap();
        let json = r#"{"lease_id":7,"node":"n1","user":"alice","account":"physics","job_id":42,"cores":2,"memory_mib":512,"issued_at":1000,"expires_at":2000}"#;
        let (signed, tag) = token.rsplit_once('.').unwrap();
        assert_eq!(signed, format!("rfaas1.{}", URL_SAFE_NO_PAD.encode(json)));
        // HMAC-SHA256 tags are 32 bytes: 43 base64url characters unpadded.
        assert_eq!(tag.len(), 43);
        let mut m = HmacSha256::new_from_slice(SECRET).unwrap();
        m.update(signed.as_bytes());
        assert_eq!(
            URL_SAFE_NO_PAD.decode(tag).unwrap(),
            m.finalize().into_bytes().to_vec()
        );
    }

    #[test]
    fn round_trip() {
        let token = claims().sign(SECRET).unwrap();
        assert_eq!(verify(&token, SECRET, 1_500, "n1").unwrap(), claims());
    }

    #[test]
    fn job_id_is_optional() {
        let mut c = claims();
        c.job_id = None;
        let token = c.sign(SECRET).unwrap();
        let back = verify(&token, SECRET, 1_500, "n1").unwrap();
        assert_eq!(back.job_id, None);
    }

    #[test]
    fn forged_tokens_are_refused() {
        let token = claims().sign(SECRET).unwrap();
        // Another secret.
        let other = b"fedcba9876543210fedcba9876543210";
        assert_eq!(
            verify(&token, other, 1_500, "n1"),
            Err(TokenError::BadSignature)
        );
        // Claims changed (more cores) while keeping the old MAC.
        let (_, tag) = token.rsplit_once('.').unwrap();
        let mut more = claims();
        more.cores = 64;
        let forged_claims = more.sign(SECRET).unwrap();
        let (forged_signed, _) = forged_claims.rsplit_once('.').unwrap();
        let forged = format!("{forged_signed}.{tag}");
        assert_eq!(
            verify(&forged, SECRET, 1_500, "n1"),
            Err(TokenError::BadSignature)
        );
        // One character of the MAC changed.
        let mut bytes = token.into_bytes();
        let last = bytes.len() - 2;
        bytes[last] = if bytes[last] == b'A' { b'B' } else { b'A' };
        let flipped = String::from_utf8(bytes).unwrap();
        assert_eq!(
            verify(&flipped, SECRET, 1_500, "n1"),
            Err(TokenError::BadSignature)
        );
    }

    #[test]
    fn expired_and_other_node_are_refused_after_the_signature() {
        let token = claims().sign(SECRET).unwrap();
        assert_eq!(
            verify(&token, SECRET, 2_000, "n1"),
            Err(TokenError::Expired {
                expires_at: 2_000,
                now: 2_000
            })
        );
        let err = verify(&token, SECRET, 1_500, "n2").unwrap_err();
        assert_eq!(err.kind(), "token_wrong_node");
        assert!(err.to_string().contains("\"n1\""), "{err}");
        // A forged token is reported as forged even when also expired.
        assert_eq!(
            verify(&token, b"fedcba9876543210fedcba9876543210", 9_999, "n2"),
            Err(TokenError::BadSignature)
        );
    }

    #[test]
    fn malformed_tokens_say_why() {
        for bad in [
            "",
            "rfaas1",
            "rfaas1.abc",
            "jwt.abc.def",
            "rfaas1.!!!.AAAA",
            "rfaas1.e30.***",
        ] {
            let err = verify(bad, SECRET, 0, "n1").unwrap_err();
            assert_eq!(err.kind(), "token_malformed", "{bad:?}: {err}");
        }
        // Well signed, but the claims are not a lease.
        let signed = format!("rfaas1.{}", URL_SAFE_NO_PAD.encode(b"{\"x\":1}"));
        let mut m = HmacSha256::new_from_slice(SECRET).unwrap();
        m.update(signed.as_bytes());
        let token = format!(
            "{signed}.{}",
            URL_SAFE_NO_PAD.encode(m.finalize().into_bytes())
        );
        let err = verify(&token, SECRET, 0, "n1").unwrap_err();
        assert!(err.to_string().contains("claims are not valid"), "{err}");
    }

    #[test]
    fn short_secrets_are_refused() {
        assert_eq!(
            claims().sign(b"short"),
            Err(TokenError::WeakSecret { len: 5 })
        );
    }
}
