//! `rfaas-executor`: the node agent (`rfaas-executord`) and the worker
//! process (`rfaas-worker`). See `docs/invocation.md`.
