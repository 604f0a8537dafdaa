-- Nodes, leases, accounts, credentials
CREATE TABLE nodes (
    name TEXT PRIMARY KEY,
    admin_state TEXT NOT NULL,
    lost BIGINT NOT NULL,
    control_addr TEXT NOT NULL,
    providers TEXT NOT NULL,
    cores BIGINT NOT NULL,
    memory_mib BIGINT NOT NULL,
    leased_cores BIGINT NOT NULL,
    leased_memory_mib BIGINT NOT NULL,
    free_cores BIGINT NOT NULL,
    free_memory_mib BIGINT NOT NULL,
    version TEXT NOT NULL,
    registered_ms BIGINT NOT NULL,
    last_heartbeat_ms BIGINT NOT NULL
);
CREATE TABLE leases (
    id BIGINT PRIMARY KEY,
    grant_id BIGINT NOT NULL,
    node TEXT NOT NULL,
    owner TEXT NOT NULL,
    user_name TEXT NOT NULL,
    account TEXT NOT NULL,
    cores BIGINT NOT NULL,
    memory_mib BIGINT NOT NULL,
    issued_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    state TEXT NOT NULL,
    ended_ms BIGINT NOT NULL
);
CREATE INDEX leases_by_grant ON leases (grant_id);
CREATE INDEX leases_by_state ON leases (state, expires_at);
CREATE INDEX leases_by_node ON leases (node, state);
CREATE TABLE accounts (
    name TEXT PRIMARY KEY,
    leased_cores BIGINT NOT NULL
);
CREATE TABLE credentials (
    id TEXT PRIMARY KEY,
    secret_hash TEXT NOT NULL,
    role TEXT NOT NULL,
    subject TEXT NOT NULL,
    account TEXT NOT NULL,
    created_ms BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    revoked BIGINT NOT NULL
);
