-- Slurm: job credentials, leases by job, cores withheld by nodes
ALTER TABLE credentials ADD COLUMN job_id BIGINT;
ALTER TABLE nodes ADD COLUMN withheld_cores BIGINT NOT NULL DEFAULT 0;
CREATE INDEX credentials_by_job ON credentials (job_id);
CREATE INDEX leases_by_job ON leases (job_id, state);
