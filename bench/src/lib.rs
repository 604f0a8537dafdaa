//! `rfaas-bench`: the harness and rows of the two benchmark binaries.
//!
//! - `rfaas-bench` measures invocations through `rfaas-client` against a
//!   real `rfaas-executord` on loopback (hot and warm no-op round trips,
//!   transfer and echo bandwidth, cold starts), a gRPC echo, and in the same run the fabric
//!   rows and raw baselines they are judged against, with the differences
//!   and ratios as derived rows.
//! - `rfaas-bench --manager` measures the resource manager: lease grants
//!   through real `rfaas-manager` replicas next to the same transactions
//!   straight on the database, and how soon a registration reaches every
//!   replica.
//! - `rfaas-fabric-bench` measures the fabric providers against the raw
//!   baselines only.
//! - `rfaas-control-bench` and `rfaas-rest-bench` measure a good client
//!   next to misbehaving connections: on an executor's control port, and
//!   on a manager's REST port (`rest_quiet`, `rest_abuse`).
//! - `rfaas-harvest` replays a seeded Slurm job stream on a loopback
//!   cluster without rfaas and with it, and reports the idle capacity
//!   offered, how soon job ends are lent again, the plugin's cost to job
//!   starts and the calls served meanwhile.
//! - `rfaas-fleet` runs thousands of simulated node agents against real
//!   manager replicas on PostgreSQL and reports what each node costs the
//!   replicas and the database, grant and registration latencies, how
//!   soon a silent node is lost, and the nodes a rolling restart loses.
//!
//! # Layout
//!
//! - [`rows`]: what a row is ([`rows::RowSpec`]), what it is given
//!   ([`rows::Ctx`]), and the loop that runs the selected ones;
//! - [`cli`]: what both binaries share around their flags: pinning, the
//!   `--serve` dispatch, the rounds;
//! - [`fabric_rows`]: `pingpong`, `pingpong_bandwidth` and `bandwidth`
//!   through rfaas-fabric;
//! - [`baselines`]: the raw baselines (plain sockets, shared memory, memcpy);
//! - [`invoke`]: `hot_noop`, `warm_noop`, `transfer`, the `echo` rows and
//!   `cold_start` through rfaas-client and a real executor daemon;
//! - [`grpc`]: `grpc_echo`, a tonic unary call on loopback;
//! - [`billing_adds`]: `billing_adds` and `raw_fetch_add`, fetch-and-adds
//!   per second into a real accounting service's region and into a plain
//!   fabric target;
//! - [`billing_flush`]: `billing_flush` and `raw_db_upsert`, usage rows per
//!   second through the accounting flusher and a plain sqlx loop, on
//!   throwaway PostgreSQL servers;
//! - [`services`]: the manager and accounting service the billing rows run
//!   against;
//! - [`meter`]: what metering costs a lane: clock reads and one
//!   invocation's bookkeeping, in process;
//! - [`manager`]: the `--manager` mode: `lease_grant`, `lease_grant_paced`,
//!   `raw_db_grant`, `node_visible` and their ratio rows;
//! - [`derived`]: overheads and ratios computed from the best rounds;
//! - [`child`]: the peer process a two-sided row runs against, started by
//!   re-executing the binary with the hidden `--serve <what>`;
//! - [`cleanup`]: stops the daemons the bench started on SIGINT/SIGTERM;
//! - [`fleet`]: `rfaas-fleet`: the simulated node agents, what is
//!   measured around them, the `fleet` row;
//! - [`harvest`]: `rfaas-harvest`: the job stream, the site it runs on,
//!   the samplers and the figures;
//! - [`stats`]: latency samples -> median, p99, min, mean;
//! - [`report`]: the table on stdout, or JSON lines with `--json`;
//! - [`error`]: the error type; every error is a sentence.
//!
//! Adding rows: write a module that exports a [`rows::Suite`] and list it
//! in the binary's `SUITES`. A row is a `fn(&Ctx, &Provider, &mut Report) ->
//! Result<()>` (or `fn(&Ctx, &mut Report)` for provider-less rows) that
//! pushes one [`report::Row`] per size; its peer side is a `fn(&[String],
//! Ready) -> Result<()>` listed in the suite's `peers`, started with
//! `ctx.spawn_peer(name, args, fds)`. `baselines.rs` is the example.

pub mod baselines;
pub mod billing_adds;
pub mod billing_flush;
pub mod child;
pub mod cleanup;
pub mod cli;
pub mod derived;
pub mod error;
pub mod fabric_rows;
pub mod fleet;
pub mod grpc;
pub mod harvest;
pub mod invoke;
pub mod manager;
pub mod meter;
pub mod report;
pub mod rows;
pub mod services;
pub mod stats;
