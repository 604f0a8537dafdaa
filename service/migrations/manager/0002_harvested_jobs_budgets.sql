-- Harvested nodes and leases, leases' jobs, budgets
ALTER TABLE nodes ADD COLUMN harvested BIGINT NOT NULL DEFAULT 0;
ALTER TABLE leases ADD COLUMN job_id BIGINT;
ALTER TABLE leases ADD COLUMN harvested BIGINT NOT NULL DEFAULT 0;
CREATE TABLE budgets (
    account TEXT PRIMARY KEY,
    budget DOUBLE PRECISION NOT NULL,
    updated_ms BIGINT NOT NULL
);
