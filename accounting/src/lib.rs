//! `rfaas-accounting`: what rfaas leases use and what it costs.
//!
//! The accounting service (`rfaas-accounting`): executor daemons add each
//! lease's usage (allocation MiB·ms, compute, hot-poll and warm time,
//! invocations, bytes) into the lease's slot of a counter region with
//! remote fetch-and-add; the service spends no CPU on an add. A flusher
//! writes the slots' cumulative totals to the manager's database, prices
//! them into each account's spend, snapshots them for reports, and frees
//! the slots of leases that are over. `rfaas-billing` reports from what
//! it wrote. See `docs/accounting.md`.
//!
//! # Layout
//!
//! - [`rates`]: `billing.toml`, the rates of the cost model and the
//!   budgets; the cost of a lease's usage.
//! - [`report`]: `rfaas-billing`'s reports and budgets, from the database
//!   the manager and the accounting services share.
//!
//! The service:
//!
//! - [`config`]: `accounting.toml` (`accounting/accounting.example.toml`).
//! - [`region`]: the counter region, a file mapped shared and registered
//!   on the fabric for remote atomics and reads.
//! - [`ledger`]: the region and one window per node: a node's connection
//!   adds into its node's window only, and the flusher counts a slot's
//!   adds from the window of its lease's node alone.
//! - [`listener`]: the fabric listener: the hello, ticket checks, and
//!   the accepted daemons' connections, each in a protection domain of
//!   its own, closed once their credential is revoked.
//! - [`credentials`]: the hello's accounting ticket checked with the
//!   manager's public keys (`lease_keys`), the node credential it names
//!   checked live in the database, and the credentials of live
//!   connections looked up every second.
//! - [`flusher`]: slots to `usage`, `usage_snapshots` and `account_spend`,
//!   and the final flush that frees a slot.
//! - [`store`]: the service's SQL, for both databases: the instance's
//!   row, its slots, the flusher's writes, and readers of stored usage.
//! - [`metrics`]: Prometheus metrics, `/metrics` and `/healthz`.
//! - [`service`]: start-up in crash-safe order, and shutdown.
//!
//! The binaries (`src/bin/`) read their configuration and call in here.

pub mod config;
pub mod credentials;
pub mod flusher;
pub mod ledger;
pub mod listener;
pub mod metrics;
pub mod rates;
pub mod region;
pub mod report;
pub mod service;
pub mod store;
