//! `rfaas-service`: what the manager and the accounting service share.
//! Both keep their state in one database (PostgreSQL, or SQLite for a
//! single host), read TOML configuration the same way, check the same
//! credentials and print tables for people alike; this crate is that
//! common ground, so neither server crate depends on the other. It holds
//! no HTTP server and no fabric.
//!
//! # Layout
//!
//! - [`db`]: the pool on either database through sqlx's `Any` driver
//!   ([`db::open_and_migrate`] for the manager, [`db::open`], which only
//!   checks the schema, for everyone else), failures classified by what a
//!   caller can do ([`db::DbError`]), conflict retries, SQLite
//!   checkpoints, column helpers, the database password file and keeping
//!   passwords off command lines and out of messages.
//! - [`schema`]: the migrations (`migrations/<owner>/NNNN_*.sql`), one
//!   owner per table, their runner and check, and the PostgreSQL roles
//!   of each component with their grants ([`schema::roles_sql`]).
//! - [`budgets`]: the one write path of the `budgets` table.
//! - [`config`]: loading a program's TOML file, its errors, logging, and
//!   the database URL as `--check-config` shows it (no password).
//! - [`credentials`]: credential hashing and the node-credential check the
//!   accounting service makes against the manager's `credentials` table;
//!   private files.
//! - [`limits`]: the descriptor limit daemons raise at start.
//! - [`table`]: the plain-text tables `rfaasctl` and `rfaas-billing` print.
//! - [`usage`]: usage per lease over a period, which reports price: read
//!   by `rfaas-billing` and by the manager's `GET /v1/usage`.
//! - [`now_ms`], [`now_s`]: the clocks stored times are in.

pub mod budgets;
pub mod config;
pub mod credentials;
pub mod db;
pub mod limits;
pub mod schema;
pub mod table;
pub mod usage;

use std::time::{SystemTime, UNIX_EPOCH};

/// Unix time, ms.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Unix time, seconds.
pub fn now_s() -> u64 {
    now_ms() / 1000
}
