//! Test support shared by the rfaas crates' integration tests and benches.
