//! Example rfaas functions written in Rust, exported with C linkage.
