//! `rfaas-client`: allocate on executors, register buffers, invoke
//! functions. See `docs/invocation.md`.
