//! Who is calling: the admin, a node, or a user, from the request's
//! `Authorization: Bearer <token>`.
//!
//! - The admin token is one line in a file only root may read
//!   ([`read_admin_token`]).
//! - Node and user credentials are `rfaasc.<id>.<secret>`, minted by an
//!   admin (`POST /v1/credentials`). The database keeps the secret's
//!   SHA-256, never the secret. A replica caches a verified credential,
//!   and each background round reads the credentials revoked since the
//!   last one, by any replica ([`Auth::follow_revocations`], one indexed
//!   query), and forgets them: a revocation takes effect everywhere within
//!   a round (`refresh_ms`). So a node's credential is read from the
//!   database once per [`VERIFIED_TTL`], not at every heartbeat. While the
//!   rounds cannot read the revocations, a verified credential is trusted
//!   for [`CACHE_TTL`] only, as before.
//! - A credential's id is 8 random bytes and a tag: the first 8 bytes of
//!   their HMAC-SHA256 under a key the replicas share (stored in the
//!   database, `manager_keys`, made by the first replica to start), all in
//!   hex. An id whose tag does not match was never minted here and is
//!   refused without a database query; so is an untagged id (16 hex
//!   digits, minted before ids were tagged) that was not in the database
//!   when this replica started. The tag only spares the database: the
//!   secret is what proves a credential.
//! - Strangers cost little: a malformed or made-up credential is refused
//!   without a database query; an id that passes the tag but is not (yet)
//!   in the database is remembered as unknown for [`UNKNOWN_TTL`] (so a
//!   credential minted on another replica works here within it), and at
//!   most a few lookups of uncached ids reach the database at once, so
//!   those leave the pool's connections to the requests of callers already
//!   known.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher as _;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use rfaas_proto::manager::Role;
use rfaas_service::credentials::{
    check_private_file, constant_time_eq, hash_secret, random_bytes, CredentialRow, CACHE_TTL,
    CREDENTIAL_PREFIX,
};

use hmac::{Hmac, Mac as _};
use sha2::Sha256;

use crate::error::ApiError;
use crate::store::Store;

/// A caller, authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The admin token.
    Admin,
    /// A node credential, for the node named.
    Node {
        /// The node.
        node: String,
        /// The credential's id (for the node's accounting tickets).
        credential_id: String,
    },
    /// A user credential.
    User {
        /// The user.
        user: String,
        /// The account charged.
        account: String,
        /// The Slurm job, for a job credential.
        job_id: Option<u64>,
        /// When the credential expires, Unix seconds (0: never).
        expires_at: u64,
    },
}

impl Caller {
    /// Who, for logs and lease ownership.
    pub fn subject(&self) -> String {
        match self {
            Caller::Admin => "admin".into(),
            Caller::Node { node, .. } => format!("node:{node}"),
            Caller::User { user, .. } => format!("user:{user}"),
        }
    }
}

/// How long a replica remembers that the database holds no credential
/// of an id: a credential minted on another replica is accepted here at
/// most this long after a request named it before it existed.
pub const UNKNOWN_TTL: Duration = Duration::from_secs(2);

/// Most ids remembered as unknown; beyond, the oldest half is forgotten.
const UNKNOWN_MAX: usize = 16_384;

/// How long a verified credential is trusted while the rounds follow
/// the revocations; read again after that anyway.
pub const VERIFIED_TTL: Duration = Duration::from_secs(600);

/// How far back each round's read of revocations reaches before the
/// previous round's start: a revocation committed after that read, with
/// an earlier `revoked_ms`, is still seen.
const REVOKED_OVERLAP_MS: u64 = 10_000;

/// Most credentials remembered as verified; beyond, all are forgotten.
const KNOWN_MAX: usize = 100_000;

/// Checks bearer tokens.
#[derive(Debug)]
pub struct Auth {
    admin_token: String,
    cache: Mutex<HashMap<String, (CredentialRow, Instant)>>,
    unknown: Mutex<HashMap<String, Instant>>,
    /// Lookups of ids never verified here take one of these, chosen by
    /// the id: as many such lookups as there are locks reach the database
    /// at once, and those of one id one after the other (the first fills
    /// the cache for the rest).
    lookups: Vec<tokio::sync::Mutex<()>>,
    lookup_hasher: RandomState,
    /// The key of ids' tags.
    id_key: Vec<u8>,
    /// Untagged ids the database held at start.
    untagged: HashSet<String>,
    /// Revocations read up to (ms), and when last read.
    revocations: Mutex<(u64, Option<Instant>)>,
}

/// Hex digits of a credential id's random part, and of its tag.
const ID_RANDOM_HEX: usize = 16;
const ID_TAG_HEX: usize = 16;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unauthorized(message: &str) -> ApiError {
    ApiError::Unauthorized(message.to_owned())
}

/// Reads the admin token: one line of at least 16 characters, in a file
/// that group and others cannot access, owned by root when read by root.
/// The manager and `rfaasctl` both read it so.
pub fn read_admin_token(path: &Path) -> Result<String, String> {
    check_private_file(path, "the admin token file")?;
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the admin token file {}: {e}", path.display()))?;
    let token = text.trim().to_owned();
    if token.len() < 16 || token.contains(char::is_whitespace) {
        return Err(format!(
            "the admin token in {} must be one word of at least 16 characters (make one with `head -c 32 /dev/urandom | base64 > {}`)",
            path.display(),
            path.display()
        ));
    }
    Ok(token)
}

impl Auth {
    /// Checks tokens against `admin_token` and the stored credentials,
    /// read through a pool of `connections`: a quarter of them (at least
    /// one) may be looking up uncached credentials at once.
    /// Ids are tagged with `id_key`; `untagged` are the ids minted before
    /// tags that the database holds.
    pub fn new(
        admin_token: String,
        connections: u32,
        id_key: Vec<u8>,
        untagged: HashSet<String>,
    ) -> Auth {
        Auth {
            admin_token,
            cache: Mutex::new(HashMap::new()),
            revocations: Mutex::new((rfaas_service::now_ms(), None)),
            unknown: Mutex::new(HashMap::new()),
            lookups: (0..(connections as usize / 4).max(1))
                .map(|_| tokio::sync::Mutex::new(()))
                .collect(),
            lookup_hasher: RandomState::new(),
            id_key,
            untagged,
        }
    }

    /// As [`new`](Self::new), with the tag key and untagged ids `store`
    /// holds (storing a new key on a database that has none).
    ///
    /// # Errors
    ///
    /// The database's, or no randomness.
    pub async fn open(
        store: &Store,
        admin_token: String,
        connections: u32,
    ) -> anyhow::Result<Auth> {
        let fresh = hex(&random_bytes(32)?);
        let key = store.credential_id_key(&fresh).await?;
        let untagged = store.untagged_credential_ids().await?.into_iter().collect();
        Ok(Auth::new(
            admin_token,
            connections,
            key.into_bytes(),
            untagged,
        ))
    }

    /// The tag of an id's random part.
    fn tag(&self, random: &str) -> String {
        // A key of any length is accepted by HMAC.
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(&self.id_key) else {
            return String::new();
        };
        mac.update(random.as_bytes());
        hex(&mac.finalize().into_bytes()[..ID_TAG_HEX / 2])
    }

    /// Whether `id` may name a stored credential: tagged by this
    /// manager's key, or untagged and held at start.
    fn may_be_stored(&self, id: &str) -> bool {
        if !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return false;
        }
        match id.len() {
            ID_RANDOM_HEX => self.untagged.contains(id),
            n if n == ID_RANDOM_HEX + ID_TAG_HEX => {
                let (random, tag) = id.split_at(ID_RANDOM_HEX);
                constant_time_eq(self.tag(random).as_bytes(), tag.as_bytes())
            }
            _ => false,
        }
    }

    /// A new credential: its stored row and its bearer token.
    ///
    /// # Errors
    ///
    /// No randomness.
    pub fn mint(
        &self,
        role: Role,
        subject: &str,
        account: &str,
        expires_at: u64,
        job_id: Option<u64>,
    ) -> std::io::Result<(CredentialRow, String)> {
        let random = hex(&random_bytes(ID_RANDOM_HEX / 2)?);
        let id = format!("{random}{}", self.tag(&random));
        let secret = URL_SAFE_NO_PAD.encode(random_bytes(32)?);
        let row = CredentialRow {
            id: id.clone(),
            secret_hash: hash_secret(&secret),
            role,
            subject: subject.to_owned(),
            account: account.to_owned(),
            expires_at,
            revoked: false,
            job_id,
        };
        Ok((row, format!("{CREDENTIAL_PREFIX}.{id}.{secret}")))
    }

    /// Who sent `authorization` (the header's value, if any).
    pub async fn caller(
        &self,
        store: &Store,
        authorization: Option<&str>,
        now_s: u64,
    ) -> Result<Caller, ApiError> {
        let Some(header) = authorization else {
            return Err(unauthorized(
                "send a credential: Authorization: Bearer <token>",
            ));
        };
        let Some(token) = header.strip_prefix("Bearer ").map(str::trim) else {
            return Err(unauthorized(
                "the Authorization header must be `Bearer <token>`",
            ));
        };
        if let Some(rest) = token
            .strip_prefix(CREDENTIAL_PREFIX)
            .and_then(|r| r.strip_prefix('.'))
        {
            let (id, secret) = rest.split_once('.').unwrap_or((rest, ""));
            // Without a secret it cannot be good: no lookup.
            let row = if secret.is_empty() {
                None
            } else {
                self.lookup(store, id).await?
            };
            let Some(row) = row else {
                return Err(unauthorized(
                    "the credential is not known to this manager; ask an admin for one (`rfaasctl credential`)",
                ));
            };
            if !constant_time_eq(hash_secret(secret).as_bytes(), row.secret_hash.as_bytes()) {
                return Err(unauthorized(
                    "the credential's secret does not match: it was altered or forged; use the token exactly as it was issued",
                ));
            }
            if row.revoked {
                return Err(ApiError::CredentialRevoked { id: row.id });
            }
            if row.expires_at != 0 && now_s >= row.expires_at {
                return Err(ApiError::CredentialExpired {
                    id: row.id,
                    expires_at: row.expires_at,
                });
            }
            return Ok(match row.role {
                Role::Node => Caller::Node {
                    node: row.subject,
                    credential_id: row.id,
                },
                Role::User => Caller::User {
                    user: row.subject,
                    account: row.account,
                    job_id: row.job_id,
                    expires_at: row.expires_at,
                },
            });
        }
        if constant_time_eq(token.as_bytes(), self.admin_token.as_bytes()) {
            return Ok(Caller::Admin);
        }
        Err(unauthorized(
            "the bearer token is neither a credential of this manager nor its admin token",
        ))
    }

    /// The stored credential `id`, from the caches when they know it;
    /// `None` for an id that is malformed or not in the database.
    async fn lookup(&self, store: &Store, id: &str) -> Result<Option<CredentialRow>, ApiError> {
        if !self.may_be_stored(id) {
            return Ok(None);
        }
        let (known, verified_before) = self.cached(id);
        if let Some(known) = known {
            return Ok(known);
        }
        // Ids never verified here queue for their lock, not for the pool's
        // connections. A credential verified before is looked up again
        // without waiting behind strangers.
        let _turn = if verified_before {
            None
        } else {
            let lock = self.lookup_hasher.hash_one(id) as usize % self.lookups.len();
            Some(self.lookups[lock].lock().await)
        };
        if let (Some(known), _) = self.cached(id) {
            return Ok(known);
        }
        let row = store.credential(id).await.map_err(ApiError::from)?;
        match &row {
            Some(row) => {
                let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
                if cache.len() >= KNOWN_MAX {
                    cache.clear();
                }
                cache.insert(id.to_owned(), (row.clone(), Instant::now()));
            }
            None => {
                let mut unknown = self.unknown.lock().unwrap_or_else(|p| p.into_inner());
                if unknown.len() >= UNKNOWN_MAX {
                    forget_oldest_half(&mut unknown);
                }
                unknown.insert(id.to_owned(), Instant::now());
            }
        }
        Ok(row)
    }

    /// What the caches say of `id`: `Some(Some(row))` verified,
    /// `Some(None)` unknown, `None` not cached (or no longer); and whether
    /// it was verified here before (even if that is too old to trust).
    fn cached(&self, id: &str) -> (Option<Option<CredentialRow>>, bool) {
        {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((row, at)) = cache.get(id) {
                if at.elapsed() < self.trust() {
                    return (Some(Some(row.clone())), true);
                }
                return (None, true);
            }
        }
        let unknown = self.unknown.lock().unwrap_or_else(|p| p.into_inner());
        match unknown.get(id) {
            Some(at) if at.elapsed() < UNKNOWN_TTL => (Some(None), false),
            _ => (None, false),
        }
    }

    /// Reads the credentials revoked since the last read (by any replica)
    /// and forgets them; a background round does it. Returns how many.
    pub async fn follow_revocations(&self, store: &Store) -> Result<usize, crate::db::DbError> {
        let now = rfaas_service::now_ms();
        let since = self.revocations.lock().unwrap_or_else(|p| p.into_inner()).0;
        let revoked = store
            .revoked_since(since.saturating_sub(REVOKED_OVERLAP_MS))
            .await?;
        for id in &revoked {
            self.forget(id);
        }
        *self.revocations.lock().unwrap_or_else(|p| p.into_inner()) = (now, Some(Instant::now()));
        Ok(revoked.len())
    }

    /// How long a verified credential is trusted now: [`VERIFIED_TTL`]
    /// while the revocations were read within [`CACHE_TTL`], else
    /// [`CACHE_TTL`].
    fn trust(&self) -> Duration {
        let read = self.revocations.lock().unwrap_or_else(|p| p.into_inner()).1;
        match read {
            Some(at) if at.elapsed() < CACHE_TTL => VERIFIED_TTL,
            _ => CACHE_TTL,
        }
    }

    /// Forgets a credential at once on this replica (after a revocation,
    /// or when one is minted here).
    pub fn forget(&self, id: &str) {
        self.unknown
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }
}

/// Drops the older half of `unknown`, by when each id was found unknown.
fn forget_oldest_half(unknown: &mut HashMap<String, Instant>) {
    let mut ages: Vec<Instant> = unknown.values().copied().collect();
    let mid = ages.len() / 2;
    let (_, cut, _) = ages.select_nth_unstable(mid);
    let cut = *cut;
    unknown.retain(|_, at| *at > cut);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfaas_service::credentials::{verify_node_credential, NodeRefusal};
    use std::os::unix::fs::PermissionsExt;

    fn auth(key: &str, untagged: &[&str]) -> Auth {
        let untagged = untagged.iter().map(|s| (*s).to_owned()).collect();
        Auth::new("admin-token-0123456789".into(), 4, key.into(), untagged)
    }

    #[test]
    fn credentials_hold_their_id_and_a_secret_stored_only_hashed() {
        let (row, token) = auth("k", &[])
            .mint(Role::User, "alice", "physics", 0, None)
            .unwrap();
        let parts: Vec<&str> = token.split('.').collect();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[0], CREDENTIAL_PREFIX);
        assert_eq!(parts[1], row.id);
        assert_eq!(row.secret_hash, hash_secret(parts[2]));
        assert!(!row.secret_hash.contains(parts[2]));
    }

    #[tokio::test]
    async fn node_credentials_are_verified_against_the_database() {
        let dir = std::env::temp_dir().join(format!("rfaas-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("sqlite://{}", dir.join("m.db").display());
        let pool = rfaas_service::db::open_and_migrate(&url, 2).await.unwrap();
        let store = Store::new(pool, rfaas_service::db::Backend::Sqlite);
        let auth = auth("k", &[]);
        let mint = |role, expires_at| auth.mint(role, "n1", "", expires_at, None).unwrap();
        let (node, node_token) = mint(Role::Node, 0);
        let (user, user_token) = mint(Role::User, 0);
        let (old, old_token) = mint(Role::Node, 100);
        for row in [&node, &user, &old] {
            store.add_credential(row, 0).await.unwrap();
        }
        let check = |t: String| {
            let store = store.clone();
            async move { verify_node_credential(store.pool(), &t, 200).await.unwrap() }
        };
        assert_eq!(check(node_token.clone()).await, Ok("n1".to_owned()));
        assert_eq!(check(user_token).await, Err(NodeRefusal::NotANode));
        assert_eq!(check(old_token).await, Err(NodeRefusal::Expired));
        let forged = format!("{}x", node_token);
        assert_eq!(check(forged).await, Err(NodeRefusal::WrongSecret));
        let unknown = format!("{CREDENTIAL_PREFIX}.00ff.secret");
        assert_eq!(check(unknown).await, Err(NodeRefusal::Unknown));
        assert_eq!(check("bearer".into()).await, Err(NodeRefusal::Malformed));
        assert!(store.revoke_credential(&node.id).await.unwrap());
        assert_eq!(check(node_token).await, Err(NodeRefusal::Revoked));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Only ids this manager's key tagged, and untagged ones it held at
    /// start, may reach the database.
    #[test]
    fn made_up_ids_fail_their_tag() {
        let ours = auth("one key", &["00112233aabbccdd"]);
        let (row, _) = ours.mint(Role::Node, "n1", "", 0, None).unwrap();
        assert_eq!(row.id.len(), 32, "{}", row.id);
        assert!(ours.may_be_stored(&row.id));
        assert!(ours.may_be_stored("00112233aabbccdd"));
        // Another key's ids, any bit of the tag or the random part
        // changed, an untagged id not held at start, and non-hex: refused.
        let (theirs, _) = auth("other key", &[])
            .mint(Role::Node, "n1", "", 0, None)
            .unwrap();
        assert!(!ours.may_be_stored(&theirs.id));
        for at in [0, 15, 16, 31] {
            let mut id = row.id.clone().into_bytes();
            id[at] = if id[at] == b'0' { b'1' } else { b'0' };
            let id = String::from_utf8(id).unwrap();
            assert!(!ours.may_be_stored(&id), "{id}");
        }
        for id in [
            "00112233aabbccde",
            "",
            "zz",
            &row.id[..31],
            &format!("{}0", row.id),
        ] {
            assert!(!ours.may_be_stored(id), "{id}");
        }
    }

    #[test]
    fn a_full_unknown_cache_forgets_its_older_half() {
        let start = Instant::now();
        let mut unknown: HashMap<String, Instant> = (0..10u64)
            .map(|k| (k.to_string(), start + Duration::from_millis(k)))
            .collect();
        forget_oldest_half(&mut unknown);
        let mut kept: Vec<u64> = unknown.keys().map(|k| k.parse().unwrap()).collect();
        kept.sort_unstable();
        assert_eq!(kept, vec![6, 7, 8, 9]);
    }

    #[test]
    fn the_admin_token_file_must_be_private() {
        let dir = std::env::temp_dir().join(format!("rfaas-admin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("admin.token");
        std::fs::write(&path, "0123456789abcdef0123\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = read_admin_token(&path).unwrap_err();
        assert!(err.contains("chmod 600"), "{err}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_admin_token(&path).unwrap(), "0123456789abcdef0123");
        std::fs::write(&path, "short\n").unwrap();
        assert!(read_admin_token(&path)
            .unwrap_err()
            .contains("16 characters"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
