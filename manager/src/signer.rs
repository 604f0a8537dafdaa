//! The key that signs lease tokens and accounting tickets: an Ed25519
//! secret key file, as `rfaas-token keygen` writes it. Executors and
//! accounting services hold only its public half.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

use rfaas_proto::lease::{LeaseClaims, LeaseSigner};
use rfaas_proto::ticket::{AccountingTicket, TicketClaims, TicketError};

/// Signs lease claims into tokens executors check.
#[derive(Debug)]
pub struct Signer {
    key: LeaseSigner,
    /// Each node's newest accounting ticket: (credential id, issued at,
    /// lifetime, text).
    tickets: Mutex<HashMap<String, (String, u64, u64, String)>>,
}

impl Signer {
    /// Loads the secret key in `path`, which must be private to its owner
    /// (and owned by root when the manager runs as root).
    pub fn load(path: &Path) -> Result<Signer, String> {
        let key = rfaas_tls::keys::read_secret_key(path).map_err(|e| {
            format!("the lease key file cannot be used (make one with `rfaas-token keygen`): {e}")
        })?;
        Ok(Signer {
            key,
            tickets: Mutex::default(),
        })
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

    /// As [`Signer::ticket`], but the node's last ticket again while more
    /// than half its lifetime remains: a heartbeat (one a second per node)
    /// costs no signature, and the node still always holds a ticket valid
    /// for at least half a lifetime.
    pub fn node_ticket(
        &self,
        node: &str,
        credential_id: &str,
        now_s: u64,
        lifetime_s: u64,
    ) -> Result<String, TicketError> {
        let mut tickets = self.tickets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((cred, issued, life, text)) = tickets.get(node) {
            if cred == credential_id && *life == lifetime_s && now_s < issued + lifetime_s / 2 {
                return Ok(text.clone());
            }
        }
        let text = self.ticket(node, credential_id, now_s, lifetime_s)?;
        tickets.insert(
            node.to_owned(),
            (credential_id.to_owned(), now_s, lifetime_s, text.clone()),
        );
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signer() -> Signer {
        Signer {
            key: LeaseSigner::from_seed("k1", [7; rfaas_proto::lease::SEED_LEN]).unwrap(),
            tickets: Mutex::default(),
        }
    }

    #[test]
    fn a_node_ticket_is_reused_for_half_its_lifetime_only() {
        let s = signer();
        let first = s.node_ticket("n1", "c1", 1000, 600).unwrap();
        assert_eq!(s.node_ticket("n1", "c1", 1299, 600).unwrap(), first);
        let later = s.node_ticket("n1", "c1", 1300, 600).unwrap();
        assert_ne!(later, first, "half its lifetime gone: a new one");
        assert_ne!(
            s.node_ticket("n1", "c2", 1301, 600).unwrap(),
            later,
            "another credential"
        );
        assert_ne!(
            s.node_ticket("n2", "c2", 1301, 600).unwrap(),
            later,
            "another node"
        );
        assert_ne!(
            s.node_ticket("n1", "c2", 1302, 60).unwrap(),
            later,
            "another lifetime"
        );
    }
}
