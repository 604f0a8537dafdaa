//! The resource manager's REST bodies: what executor daemons, clients and
//! admin tools send to `rfaas-manager` and read back, as JSON.
//!
//! The manager serves them under `/v1` (see `docs/manager.md`); this module
//! is their one definition, shared by the manager, `rfaas-executord` and
//! the client library, so the three cannot drift apart. Field names are the
//! JSON keys. Unknown keys are refused in requests (a misspelt option is an
//! error, not a silent default) and ignored in replies (a newer manager may
//! add fields).
//!
//! Every error reply, whatever the route, is an [`ApiError`]:
//! `{"error": "<kind>", "message": "<what to do>", ...}`.

use serde::{Deserialize, Serialize};

/// A fabric provider a node serves, and where its workers listen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NodeProvider {
    /// `tcp`, `shm` or `verbs:<device>`.
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = r"^(tcp|shm|verbs:[^\x00-\x1f\x7f]+)$", max_length = 64)
    )]
    pub name: String,
    /// The host workers listen on for this provider (tcp and verbs); absent
    /// for shm, which only serves clients on the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = r"^[^\x00-\x1f\x7f]*$", max_length = 255)
    )]
    pub host: Option<String>,
}

/// `PUT /v1/nodes/{name}`: a daemon registers its node. Registering again
/// with the same body changes nothing; with another body it updates the
/// node's record (a restart with a new configuration).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RegisterNode {
    /// The daemon's control address clients allocate on, `host:port`.
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = r"^[^\x00-\x1f\x7f]+:[0-9]{1,5}$", max_length = 300)
    )]
    pub control_addr: String,
    /// The control port speaks TLS (`control_tls_cert` in executord.toml):
    /// clients connect to it with TLS and check its certificate.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub control_tls: bool,
    /// The providers served.
    #[cfg_attr(feature = "openapi", schema(min_items = 1, max_items = 16))]
    pub providers: Vec<NodeProvider>,
    /// Cores the daemon lends (its configured CPUs).
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 65535))]
    pub cores: u32,
    /// Memory it lends, MiB.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 4294967295_u64))]
    pub memory_mib: u64,
    /// The daemon's version, for admins.
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = r"^[^\x00-\x1f\x7f]*$", max_length = 64)
    )]
    #[serde(default)]
    pub version: String,
    /// The node lends capacity a batch system left idle (a Slurm node
    /// between jobs): its leases are priced at the harvested discount.
    #[serde(default)]
    pub harvested: bool,
    /// The Slurm partitions the node is in (`partitions` in executord.toml,
    /// or what `scontrol` says at start); none outside Slurm. At most
    /// [`MAX_PARTITIONS`], each a [`partition_name`].
    #[cfg_attr(
        feature = "openapi",
        schema(max_items = 64, value_type = Vec<PartitionName>)
    )]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<String>,
}

/// Most partitions a node registers.
pub const MAX_PARTITIONS: usize = 64;

/// Longest partition name, bytes.
pub const MAX_PARTITION_NAME: usize = 64;

/// The pattern of a partition name, as the OpenAPI document gives it
/// ([`partition_name`] checks it).
pub const PARTITION_PATTERN: &str = r"^[A-Za-z0-9_.-]{1,64}$";

/// A Slurm partition name, as `partitions` carries it (for the OpenAPI
/// document).
#[cfg(feature = "openapi")]
#[derive(Debug)]
pub struct PartitionName;

#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for PartitionName {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .pattern(Some(PARTITION_PATTERN))
            .min_length(Some(1))
            .max_length(Some(MAX_PARTITION_NAME))
            .into()
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for PartitionName {}

/// Checks a partition name: 1 to 64 letters, digits, `_`, `.` or `-` (a
/// Slurm partition name, never a control character, space, comma or `=`).
/// The error is a sentence naming the input.
pub fn partition_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_PARTITION_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "partition {name:?} is not a Slurm partition name: use 1 to 64 letters, digits, '_', '.' or '-'"
        ))
    }
}

/// Checks a node's partitions: at most [`MAX_PARTITIONS`], each a
/// [`partition_name`], none twice.
pub fn partitions(names: &[String]) -> Result<(), String> {
    if names.len() > MAX_PARTITIONS {
        return Err(format!(
            "partitions lists {} names; a node is in at most {MAX_PARTITIONS}",
            names.len()
        ));
    }
    for (k, n) in names.iter().enumerate() {
        partition_name(n)?;
        if names[..k].contains(n) {
            return Err(format!("partition {n:?} is listed twice"));
        }
    }
    Ok(())
}

/// The manager's answer to a registration: how often to heartbeat, and
/// after how long without one the node is marked lost.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Registered {
    /// The node as the manager now sees it.
    pub node: NodeView,
    /// Send a heartbeat this often, ms.
    pub heartbeat_interval_ms: u64,
    /// The manager marks the node lost after this long without one, ms.
    pub lost_after_ms: u64,
    /// A fresh accounting ticket for the node, base64url without padding
    /// (see `rfaas_proto::ticket`): executord shows the newest it holds in
    /// its hello to accounting services, instead of its credential.
    /// Absent when the admin token spoke for the node. Older daemons
    /// ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accounting_ticket: Option<String>,
}

/// One allocation a daemon holds, as its heartbeat reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct HeldLease {
    /// The lease the allocation runs under.
    pub lease_id: u64,
    /// Cores (lanes) in use under it.
    pub cores: u32,
    /// Memory in use under it, MiB.
    pub memory_mib: u64,
}

/// `POST /v1/nodes/{name}/heartbeat`: the daemon's free capacity and what
/// it holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    /// Cores not allocated now.
    pub free_cores: u32,
    /// Memory not allocated now, MiB.
    pub free_memory_mib: u64,
    /// Whether the node was drained locally (`rfaas-executord` tools).
    #[serde(default)]
    pub draining: bool,
    /// Cores the node does not lend now: Slurm took them back for its
    /// jobs, or the node drains (then every core). The manager leases
    /// none of them.
    #[serde(default)]
    pub withheld_cores: u32,
    /// The allocations it holds, one entry per lease.
    pub allocations: Vec<HeldLease>,
}

/// The answer to a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HeartbeatReply {
    /// Leases the manager has ended (released, expired, revoked): the daemon
    /// stops their workers.
    #[serde(default)]
    pub ended_leases: Vec<u64>,
    /// The interval to heartbeat at from now on, ms: it grows with the
    /// fleet (the manager's `heartbeats_per_s`). Absent from managers of
    /// older releases: keep the one registration gave.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_interval_ms: Option<u64>,
    /// A fresh accounting ticket for the node, base64url without padding
    /// (see `rfaas_proto::ticket`): executord shows the newest it holds in
    /// its hello to accounting services, instead of its credential.
    /// Absent when the admin token spoke for the node. Older daemons
    /// ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accounting_ticket: Option<String>,
}

/// A node's state in the manager.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    /// Heartbeating and offered.
    Up,
    /// Drained by an admin: not offered, its leases run to their end.
    Drained,
    /// Missed heartbeats for `lost_after`: not offered, its leases ended.
    Lost,
}

/// A node as the manager reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeView {
    /// The node's name, as lease tokens name it.
    pub name: String,
    /// Its state.
    pub state: NodeState,
    /// The daemon's control address.
    pub control_addr: String,
    /// Its control port speaks TLS.
    #[serde(default)]
    pub control_tls: bool,
    /// The providers it serves.
    pub providers: Vec<NodeProvider>,
    /// Cores it lends now: what it registered, or what is leased on it if
    /// that is more (see `draining_cores`). Never less than
    /// `leased_cores`.
    pub cores: u32,
    /// Memory it lends now, MiB: what it registered, or what is leased on
    /// it if that is more. Never less than `leased_memory_mib`.
    pub memory_mib: u64,
    /// Cores under live leases.
    pub leased_cores: u32,
    /// Memory under live leases, MiB.
    pub leased_memory_mib: u64,
    /// The last heartbeat, Unix milliseconds (0: none yet).
    pub last_heartbeat_ms: u64,
    /// It lends harvested (batch-idle) capacity.
    #[serde(default)]
    pub harvested: bool,
    /// Cores the node withholds now (Slurm took them back, or it
    /// drains): not leased until it lends them again.
    #[serde(default)]
    pub withheld_cores: u32,
    /// Cores leased beyond what the node last registered (it registered
    /// with fewer than it had leased): they leave `cores` as their leases
    /// end, and the node takes no new lease meanwhile. `cores -
    /// draining_cores` is what it registered.
    #[serde(default)]
    pub draining_cores: u32,
    /// Memory leased beyond what the node last registered, MiB, as
    /// `draining_cores`.
    #[serde(default)]
    pub draining_memory_mib: u64,
    /// The Slurm partitions it registered (none outside Slurm).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<String>,
}

/// `POST /v1/leases`: a job asks for cores.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct LeaseRequest {
    /// Cores wanted, across nodes.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 1048576))]
    pub cores: u32,
    /// Memory per node lease, MiB.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 4294967295_u64))]
    pub memory_mib: u64,
    /// How long the lease lasts, seconds.
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub duration_s: u64,
    /// The fewest cores worth having: the grant is all or nothing up to
    /// this many (default: `cores`).
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 1048576))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_cores: Option<u32>,
    /// Nodes to try first, in order.
    #[cfg_attr(feature = "openapi", schema(max_items = 1024))]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<String>,
}

/// One node's part of a grant, with its own token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeLease {
    /// The node lease's id (the token's `lease_id`).
    pub lease_id: u64,
    /// The node.
    pub node: String,
    /// Its daemon's control address: allocate there.
    pub control_addr: String,
    /// Connect to `control_addr` with TLS, checking the executor's
    /// certificate against the site CA (or the system's roots) and the
    /// host of `control_addr` ([`NodeLease::executor`] says both).
    #[serde(default)]
    pub control_tls: bool,
    /// The providers it serves.
    pub providers: Vec<NodeProvider>,
    /// Cores granted on it.
    pub cores: u32,
    /// Memory granted on it, MiB.
    pub memory_mib: u64,
    /// The signed lease token the daemon checks.
    pub token: String,
    /// Where its usage is counted (also inside the token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub billing: Option<crate::accounting::BillingSlot>,
}

/// The scheme of an executor address whose control port speaks TLS, as
/// the client library takes it: `tls://host:port`.
pub const CONTROL_TLS_SCHEME: &str = "tls://";

impl NodeLease {
    /// The executor's address as the client library takes it:
    /// `tls://host:port` when its control port speaks TLS, else
    /// `host:port`.
    pub fn executor(&self) -> String {
        if self.control_tls {
            format!("{CONTROL_TLS_SCHEME}{}", self.control_addr)
        } else {
            self.control_addr.clone()
        }
    }
}

/// A grant: one or more node leases under one id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LeaseGrant {
    /// The grant's id: renew and release it with this.
    pub id: u64,
    /// When every node lease ends, Unix seconds.
    pub expires_at: u64,
    /// The node leases.
    pub leases: Vec<NodeLease>,
}

/// `POST /v1/leases/{id}/renew`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    /// The new duration, seconds from now.
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub duration_s: u64,
}

/// Who a credential speaks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// An executor daemon: registers and heartbeats the node it names.
    Node,
    /// A user's jobs: asks for, renews and releases leases.
    User,
}

/// `POST /v1/credentials` (admin): a credential for a node or a user.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CredentialRequest {
    /// What the credential may do.
    pub role: Role,
    /// The node's name (role `node`) or the user's login name (role
    /// `user`; workers run as this user).
    #[cfg_attr(feature = "openapi", schema(pattern = r"^[A-Za-z0-9._@-]{1,253}$"))]
    pub subject: String,
    /// The account a user's leases are charged to (default: the user's
    /// name). Not used for nodes.
    #[cfg_attr(feature = "openapi", schema(pattern = r"^[A-Za-z0-9._@-]{1,253}$"))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    /// Seconds until the credential expires (default: never).
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 3153600000_u64))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_s: Option<u64>,
}

/// A credential as the manager lists it. The secret `token` appears only
/// in the answer to its creation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Credential {
    /// The credential's id (not secret): revoke it with this.
    pub id: String,
    /// What it may do.
    pub role: Role,
    /// The node or user it speaks for.
    pub subject: String,
    /// The account charged (users only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    /// When it expires, Unix seconds (absent: never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<u64>,
    /// The bearer token, shown once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// The Slurm job a job credential belongs to (users only): leases
    /// asked for with it name the job, and the job's end revokes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<u64>,
}

/// The account a Slurm job's credential is charged to, from what `squeue`
/// prints for it (`%a`) and its user: Slurm's account, or the user's name
/// when Slurm keeps none (`(null)` or nothing). The executor daemon asks
/// for it and the manager checks it with this one rule.
pub fn slurm_job_account(squeue_account: &str, user: &str) -> String {
    match squeue_account {
        "" | "(null)" => user.to_owned(),
        a => a.to_owned(),
    }
}

/// `POST /v1/jobs/{job_id}/credential` (node): a user credential for one
/// Slurm job running on the calling node, asked for by its executor daemon
/// when the job starts with `--rfaas`. It expires with the job's time
/// limit (capped by the manager's `max_job_credential_s`) and is revoked
/// when the job ends (`POST /v1/jobs/{job_id}/end`).
///
/// The node says only what slurmstepd told it (the job's uid, and the
/// login name the node's users database has for it): the account and the
/// time limit are Slurm's, which the manager asks anyway, so no node asks
/// Slurm as a job step starts. Each field given is checked against
/// Slurm's word; a manager that does not ask Slurm (`[slurm] unchecked`)
/// takes the user's name as the account and `max_job_credential_s` as the
/// limit when they are not given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct JobCredentialRequest {
    /// The job's user (login name).
    #[cfg_attr(feature = "openapi", schema(pattern = r"^[A-Za-z0-9._@-]{1,253}$"))]
    pub user: String,
    /// The job's user's uid, as slurmstepd gives it to the plugin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// The account its leases are charged to; absent: Slurm's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(pattern = r"^[A-Za-z0-9._@-]{1,253}$"))]
    pub account: Option<String>,
    /// When the job's time limit ends, Unix seconds; absent: Slurm's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub expires_at: Option<u64>,
}

/// `POST /v1/jobs/{job_id}/end` (node or admin): what the job's end did.
/// Repeating it (every node of the job says it) changes nothing more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobEnded {
    /// Job credentials revoked now.
    pub revoked: u64,
    /// Node leases of the job released now.
    pub released: u64,
}

/// A node lease's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum LeaseState {
    /// Granted and not yet ended.
    Active,
    /// Released by its holder.
    Released,
    /// Ran to its end without renewal.
    Expired,
    /// Its node was lost.
    Lost,
}

/// A node lease as `GET /v1/leases` lists it (no token).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LeaseView {
    /// The node lease's id.
    pub lease_id: u64,
    /// The grant it belongs to.
    pub grant_id: u64,
    /// The node.
    pub node: String,
    /// The user holding it.
    pub user: String,
    /// The account charged.
    pub account: String,
    /// Cores.
    pub cores: u32,
    /// Memory, MiB.
    pub memory_mib: u64,
    /// Granted at, Unix seconds.
    pub issued_at: u64,
    /// Ends at, Unix seconds.
    pub expires_at: u64,
    /// Its state.
    pub state: LeaseState,
    /// The Slurm job it was asked for in (with a job credential).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<u64>,
}

/// `PUT /v1/budgets/{account}` (admin): what the account may spend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SetBudget {
    /// The budget, in the currency of the accounting service's rates; 0
    /// refuses every new lease.
    #[cfg_attr(feature = "openapi", schema(minimum = 0.0, maximum = 1e15))]
    pub budget: f64,
}

/// An account's budget and what it has spent, as `GET /v1/budgets` lists
/// it. Once `spend >= budget` the manager refuses the account new leases
/// (`403 budget_exhausted`); leases already granted run on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BudgetView {
    /// The account.
    pub account: String,
    /// What it may spend.
    pub budget: f64,
    /// What it has spent so far, as the accounting services have priced
    /// it (0 before their first flush).
    pub spend: f64,
    /// When the budget was last set, Unix milliseconds.
    pub updated_ms: u64,
}

/// One lease's usage over a period, as `GET /v1/usage` lists it: who held
/// it, where, and what it used; `rfaas-billing` prices and sums these.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LeaseUsage {
    /// The lease; 0 for the per-day totals of leases the manager's
    /// retention has purged (one row per day's user, account, job, node).
    pub lease: u64,
    /// Its user.
    pub user: String,
    /// The account it was charged to.
    pub account: String,
    /// Its Slurm job, if any.
    pub job: Option<u64>,
    /// Its node.
    pub node: String,
    /// Whether the node was harvested (idle) capacity.
    pub harvested: bool,
    /// What it used in the period.
    pub usage: crate::accounting::UsageFigures,
}

/// The query of `GET /v1/usage`: the period and the filters of
/// `rfaas-billing` (`-u`, `-A`, `-j`, each a comma list; none lets any
/// through).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[serde(deny_unknown_fields)]
pub struct UsageQuery {
    /// The period's start, Unix ms (included).
    pub start_ms: u64,
    /// The period's end, Unix ms (excluded); absent: now, with the
    /// latest totals flushed.
    pub end_ms: Option<u64>,
    /// Only these users (comma list).
    pub users: Option<String>,
    /// Only these accounts (comma list).
    pub accounts: Option<String>,
    /// Only these Slurm jobs (comma list of ids).
    pub jobs: Option<String>,
}

/// Every error reply: a stable kind, a sentence for people, and the figures
/// the kind names (quota cap and use, budget and spend, retry delay),
/// flattened into the same object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ApiError {
    /// Stable, `snake_case`: `no_capacity`, `request_exceeds_cluster`,
    /// `quota_exceeded`, `budget_exhausted`, `accounting_unavailable`,
    /// `lease_ended`, `unauthorized`, `forbidden`, `malformed_request`,
    /// `not_found`, ...
    pub error: String,
    /// What happened and what to do.
    pub message: String,
    /// Figures of this kind of error.
    #[serde(flatten)]
    #[cfg_attr(feature = "openapi", schema(ignore))]
    pub details: serde_json::Map<String, serde_json::Value>,
}

/// The kind of [`ApiError`] a request no node could ever hold is refused
/// with (`422`): waiting does not help.
pub const REQUEST_EXCEEDS_CLUSTER: &str = "request_exceeds_cluster";

/// The figures of a [`REQUEST_EXCEEDS_CLUSTER`] refusal, flattened into its
/// [`ApiError`]: the largest request the cluster could ever hold, counting
/// every node that ever registered at the capacity it registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClusterOffer {
    /// Cores of the node with the most.
    pub largest_node_cores: u64,
    /// MiB of the node with the most memory.
    pub largest_node_memory_mib: u64,
    /// Cores of every node together.
    pub cluster_cores: u64,
    /// Nodes that ever registered.
    pub nodes: u64,
    /// Cores of the nodes that lend at least the request's memory per node
    /// lease: the most one grant for it could ever span.
    pub cores_with_memory: u64,
}

impl ClusterOffer {
    /// The figures as [`ApiError::details`] holds them.
    pub fn to_details(&self) -> serde_json::Map<String, serde_json::Value> {
        match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(map)) => map,
            _ => serde_json::Map::new(),
        }
    }

    /// The figures of an [`ApiError`]'s details, when it carries all of
    /// them (other figures, such as `retry_after_s`, are left alone).
    pub fn from_details(details: &serde_json::Map<String, serde_json::Value>) -> Option<Self> {
        serde_json::from_value(serde_json::Value::Object(details.clone())).ok()
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_body_is_the_documented_json() {
        let mut body = RegisterNode {
            control_addr: "10.0.0.1:7100".into(),
            control_tls: false,
            providers: vec![
                NodeProvider {
                    name: "tcp".into(),
                    host: Some("10.0.0.1".into()),
                },
                NodeProvider {
                    name: "shm".into(),
                    host: None,
                },
            ],
            cores: 2,
            memory_mib: 4096,
            version: "0.1.0".into(),
            harvested: true,
            partitions: Vec::new(),
        };
        assert_eq!(
            serde_json::to_string(&body).unwrap(),
            r#"{"control_addr":"10.0.0.1:7100","providers":[{"name":"tcp","host":"10.0.0.1"},{"name":"shm"}],"cores":2,"memory_mib":4096,"version":"0.1.0","harvested":true}"#
        );
        // A daemon that does not say lends capacity of its own.
        let older: RegisterNode = serde_json::from_str(
            r#"{"control_addr":"10.0.0.1:7100","providers":[{"name":"shm"}],"cores":2,"memory_mib":4096}"#,
        )
        .unwrap();
        assert!(!older.harvested);
        assert!(!older.control_tls);
        // TLS on the control port is said only when it is on, so a daemon
        // without it speaks to managers that predate the key.
        body.control_tls = true;
        let json = serde_json::to_string(&body).unwrap();
        assert!(
            json.starts_with(r#"{"control_addr":"10.0.0.1:7100","control_tls":true,"#),
            "{json}"
        );
        // Partitions are said only when the node is in some.
        assert!(older.partitions.is_empty());
        body.partitions = vec!["batch".into(), "gpu-a100".into()];
        let json = serde_json::to_string(&body).unwrap();
        assert!(
            json.ends_with(r#""harvested":true,"partitions":["batch","gpu-a100"]}"#),
            "{json}"
        );
        let back: RegisterNode = serde_json::from_str(&json).unwrap();
        assert_eq!(back, body);
    }

    #[test]
    fn partitions_are_slurm_partition_names() {
        assert_eq!(partitions(&["batch".into(), "gpu_a.1-2".into()]), Ok(()));
        assert_eq!(partitions(&[]), Ok(()));
        for bad in ["", "a b", "a,b", "a=b", "tab\t", "\u{7f}", "é"] {
            let err = partition_name(bad).unwrap_err();
            assert!(
                err.contains("is not a Slurm partition name"),
                "{bad:?}: {err}"
            );
        }
        assert!(partition_name(&"p".repeat(64)).is_ok());
        assert!(partition_name(&"p".repeat(65)).is_err());
        let many: Vec<String> = (0..=MAX_PARTITIONS).map(|k| format!("p{k}")).collect();
        assert!(partitions(&many).unwrap_err().contains("at most 64"));
        assert!(partitions(&many[..MAX_PARTITIONS]).is_ok());
        let twice = partitions(&["a".into(), "b".into(), "a".into()]).unwrap_err();
        assert!(twice.contains("listed twice"), "{twice}");
    }

    #[test]
    fn a_lease_on_a_tls_executor_names_it_with_the_tls_scheme() {
        let lease: NodeLease = serde_json::from_str(
            r#"{"lease_id":1,"node":"n1","control_addr":"n1:7100","providers":[],"cores":1,"memory_mib":1,"token":"t"}"#,
        )
        .unwrap();
        assert_eq!(
            lease.executor(),
            "n1:7100",
            "a manager that predates the flag"
        );
        let lease = NodeLease {
            control_tls: true,
            ..lease
        };
        assert_eq!(lease.executor(), "tls://n1:7100");
    }

    #[test]
    fn requests_refuse_unknown_keys_and_replies_ignore_them() {
        let typo = r#"{"cores":1,"memory_mib":64,"duration_s":60,"min_core":1}"#;
        let err = serde_json::from_str::<LeaseRequest>(typo).unwrap_err();
        assert!(err.to_string().contains("min_core"), "{err}");
        let newer = r#"{"ended_leases":[3,4],"added_later":true}"#;
        let reply: HeartbeatReply = serde_json::from_str(newer).unwrap();
        assert_eq!(reply.ended_leases, vec![3, 4]);
        assert_eq!(
            reply.heartbeat_interval_ms, None,
            "older managers send none"
        );
    }

    #[test]
    fn a_heartbeat_reply_carries_the_interval_only_when_set() {
        let mut reply = HeartbeatReply {
            ended_leases: vec![7],
            heartbeat_interval_ms: None,
            accounting_ticket: None,
        };
        assert_eq!(
            serde_json::to_string(&reply).unwrap(),
            r#"{"ended_leases":[7]}"#
        );
        reply.heartbeat_interval_ms = Some(5000);
        assert_eq!(
            serde_json::to_string(&reply).unwrap(),
            r#"{"ended_leases":[7],"heartbeat_interval_ms":5000}"#
        );
    }

    #[test]
    fn lease_request_defaults() {
        let req: LeaseRequest =
            serde_json::from_str(r#"{"cores":4,"memory_mib":512,"duration_s":600}"#).unwrap();
        assert_eq!(req.min_cores, None);
        assert!(req.nodes.is_empty());
        assert_eq!(
            serde_json::to_string(&req).unwrap(),
            r#"{"cores":4,"memory_mib":512,"duration_s":600}"#
        );
    }

    #[test]
    fn api_error_flattens_its_figures() {
        let text = r#"{"error":"quota_exceeded","message":"over","cap":8,"in_use":6}"#;
        let err: ApiError = serde_json::from_str(text).unwrap();
        assert_eq!(err.error, "quota_exceeded");
        assert_eq!(err.details["cap"], 8);
        assert_eq!(serde_json::to_string(&err).unwrap(), text);
    }

    #[test]
    fn credential_request_is_the_documented_json() {
        let req: CredentialRequest =
            serde_json::from_str(r#"{"role":"user","subject":"alice","account":"physics"}"#)
                .unwrap();
        assert_eq!(req.role, Role::User);
        assert_eq!(req.account.as_deref(), Some("physics"));
        assert_eq!(req.ttl_s, None);
        let shown = Credential {
            id: "c1".into(),
            role: Role::Node,
            subject: "n1".into(),
            account: None,
            expires_at: None,
            token: None,
            job_id: None,
        };
        assert_eq!(
            serde_json::to_string(&shown).unwrap(),
            r#"{"id":"c1","role":"node","subject":"n1"}"#
        );
    }

    #[test]
    fn node_state_is_snake_case() {
        assert_eq!(
            serde_json::to_string(&NodeState::Lost).unwrap(),
            r#""lost""#
        );
        let up: NodeState = serde_json::from_str(r#""up""#).unwrap();
        assert_eq!(up, NodeState::Up);
    }

    #[test]
    fn a_refusal_beyond_the_cluster_is_the_documented_json() {
        let offer = ClusterOffer {
            largest_node_cores: 2,
            largest_node_memory_mib: 2048,
            cluster_cores: 6,
            nodes: 3,
            cores_with_memory: 4,
        };
        let e = ApiError {
            error: REQUEST_EXCEEDS_CLUSTER.into(),
            message: "m".into(),
            details: offer.to_details(),
        };
        let json = serde_json::to_string(&e).unwrap();
        assert_eq!(
            json,
            r#"{"error":"request_exceeds_cluster","message":"m","cluster_cores":6,"cores_with_memory":4,"largest_node_cores":2,"largest_node_memory_mib":2048,"nodes":3}"#
        );
        let back: ApiError = serde_json::from_str(&json).unwrap();
        assert_eq!(ClusterOffer::from_details(&back.details), Some(offer));
        let mut partial = back.details.clone();
        partial.remove("nodes");
        assert_eq!(ClusterOffer::from_details(&partial), None);
    }
}
