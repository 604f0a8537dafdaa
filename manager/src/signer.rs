//! The key that signs lease tokens and accounting tickets: an Ed25519
//! secret key file, as `rfaas-token keygen` writes it. Executors and
//! accounting services hold only its public half.

use std::path::Path;

use rfaas_proto::lease::{LeaseClaims, LeaseSigner};
use rfaas_proto::ticket::{AccountingTicket, TicketClaims, TicketError};

/// Signs lease claims into tokens executors check.
#[derive(Debug)]
pub struct Signer {
    key: LeaseSigner,
}

impl Signer {
    /// Loads the secret key in `path`, which must be private to its owner
    /// (and owned by root when the manager runs as root).
    pub fn load(path: &Path) -> Result<Signer, String> {
        let key = rfaas_tls::keys::read_secret_key(path).map_err(|e| {
            format!("the lease key file cannot be used (make one with `rfaas-token keygen`): {e}")
        })?;
        Ok(Signer { key })
    }

    /// The id of the signing key, as tokens name it.
    pub fn key_id(&self) -> &str {
        self.key.key_id()
    }

    /// The token for `claims` (their `key_id` is set to this key's).
    pub fn sign(&self, claims: &LeaseClaims) -> String {
        self.key.sign(claims)
    }

    /// An accounting ticket for `node`, asking with the credential
    /// `credential_id`, valid `lifetime_s` from `now_s`, as JSON carries it.
    ///
    /// # Errors
    ///
    /// The names do not fit a ticket.
    pub fn ticket(
        &self,
        node: &str,
        credential_id: &str,
        now_s: u64,
        lifetime_s: u64,
    ) -> Result<String, TicketError> {
        let claims = TicketClaims {
            key_id: String::new(),
            node: node.to_owned(),
            credential_id: credential_id.to_owned(),
            issued_at: now_s,
            expires_at: now_s.saturating_add(lifetime_s),
        };
        AccountingTicket::sign(&self.key, &claims).map(|t| t.to_text())
    }
}
