-- Per-day usage totals of purged leases, and an index that finds ended leases by their end
CREATE TABLE usage_daily (
    day_ms BIGINT NOT NULL,
    user_name TEXT NOT NULL,
    account TEXT NOT NULL,
    job_id BIGINT NOT NULL,
    node TEXT NOT NULL,
    harvested BIGINT NOT NULL,
    alloc_mib_ms BIGINT NOT NULL,
    compute_ns BIGINT NOT NULL,
    hot_ns BIGINT NOT NULL,
    warm_ns BIGINT NOT NULL,
    invocations BIGINT NOT NULL,
    bytes_in BIGINT NOT NULL,
    bytes_out BIGINT NOT NULL,
    PRIMARY KEY (day_ms, user_name, account, job_id, node, harvested)
);
CREATE INDEX leases_ended ON leases (ended_ms) WHERE state <> 'active';
