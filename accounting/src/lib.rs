//! `rfaas-accounting`: what rfaas leases use and what it costs.
//!
//! Layout:
//! - [`rates`]: `billing.toml`, the rates of the cost model and the
//!   budgets; the cost of a lease's usage.

pub mod rates;
