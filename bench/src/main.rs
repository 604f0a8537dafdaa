//! `rfaas-bench`: invocation benchmarks.
fn main() {}
