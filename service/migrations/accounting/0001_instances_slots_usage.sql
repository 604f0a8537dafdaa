-- Accounting instances, billing slots, usage, snapshots, spend
CREATE TABLE accounting_instances (
    name TEXT PRIMARY KEY,
    provider TEXT NOT NULL,
    fabric_addr TEXT NOT NULL,
    metrics_addr TEXT NOT NULL,
    slots BIGINT NOT NULL,
    region_id BIGINT NOT NULL,
    started_ms BIGINT NOT NULL,
    last_heartbeat_ms BIGINT NOT NULL
);
CREATE TABLE billing_slots (
    instance TEXT NOT NULL,
    slot BIGINT NOT NULL,
    lease_id BIGINT NOT NULL,
    assigned_ms BIGINT NOT NULL,
    PRIMARY KEY (instance, slot)
);
CREATE INDEX billing_slots_by_lease ON billing_slots (lease_id);
CREATE TABLE usage (
    lease_id BIGINT PRIMARY KEY,
    instance TEXT NOT NULL,
    slot BIGINT NOT NULL,
    alloc_mib_ms BIGINT NOT NULL,
    compute_ns BIGINT NOT NULL,
    hot_ns BIGINT NOT NULL,
    warm_ns BIGINT NOT NULL,
    invocations BIGINT NOT NULL,
    bytes_in BIGINT NOT NULL,
    bytes_out BIGINT NOT NULL,
    finalized BIGINT NOT NULL,
    first_ms BIGINT NOT NULL,
    updated_ms BIGINT NOT NULL
);
CREATE TABLE usage_snapshots (
    lease_id BIGINT NOT NULL,
    at_ms BIGINT NOT NULL,
    alloc_mib_ms BIGINT NOT NULL,
    compute_ns BIGINT NOT NULL,
    hot_ns BIGINT NOT NULL,
    warm_ns BIGINT NOT NULL,
    invocations BIGINT NOT NULL,
    bytes_in BIGINT NOT NULL,
    bytes_out BIGINT NOT NULL,
    PRIMARY KEY (lease_id, at_ms)
);
CREATE INDEX usage_snapshots_by_time ON usage_snapshots (at_ms);
CREATE TABLE account_spend (
    account TEXT PRIMARY KEY,
    spend DOUBLE PRECISION NOT NULL,
    updated_ms BIGINT NOT NULL
);
