//! `rfaas-accounting`: what rfaas leases use and what it costs.
//!
//! Layout:
//! - [`rates`]: `billing.toml`, the rates of the cost model and the
//!   budgets; the cost of a lease's usage.
//! - [`report`]: `rfaas-billing`'s reports and budgets, from the database
//!   the manager and the accounting services share.

pub mod rates;
pub mod report;
