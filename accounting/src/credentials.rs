//! Who may add: executor daemons, which say hello with their node
//! credential. Credentials are checked against the manager's
//! `credentials` table with the manager's rules
//! ([`rfaas_service::credentials::verify_node_credential`]); verdicts are
//! kept for [`CACHE_TTL`], so daemons reconnecting together cost one
//! query each, and a revocation takes effect within it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rfaas_service::credentials::{hash_secret, verify_node_credential, NodeRefusal};
use sqlx::AnyPool;

/// How long a verdict is trusted (the manager's own credential cache's).
pub const CACHE_TTL: Duration = rfaas_service::credentials::CACHE_TTL;

/// What a hello's credential is worth.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// A node credential, for the node named.
    Node(String),
    /// Refused, and why.
    Refused(NodeRefusal),
    /// The database cannot answer now.
    Unavailable(String),
}

/// Checks credentials, with a short cache.
#[derive(Debug)]
pub struct Verifier {
    pool: AnyPool,
    /// By the credential's SHA-256, never the credential itself.
    cache: Mutex<HashMap<String, (Verdict, Instant)>>,
}

impl Verifier {
    /// Checks against the credentials in `pool`'s database.
    pub fn new(pool: AnyPool) -> Verifier {
        Verifier {
            pool,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The verdict on `credential` at `now_s` (Unix seconds).
    pub async fn check(&self, credential: &str, now_s: u64) -> Verdict {
        let key = hash_secret(credential);
        {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((v, at)) = cache.get(&key) {
                if at.elapsed() < CACHE_TTL {
                    return v.clone();
                }
            }
        }
        let verdict = match verify_node_credential(&self.pool, credential, now_s).await {
            Ok(Ok(node)) => Verdict::Node(node),
            Ok(Err(why)) => Verdict::Refused(why),
            // Not kept: the next hello asks again.
            Err(e) => return Verdict::Unavailable(e.to_string()),
        };
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() > 10_000 {
            cache.retain(|_, (_, at)| at.elapsed() < CACHE_TTL);
            if cache.len() > 10_000 {
                cache.clear();
            }
        }
        cache.insert(key, (verdict.clone(), Instant::now()));
        verdict
    }
}
