-- Nodes registered below their leases drain the difference
ALTER TABLE nodes ADD COLUMN draining_cores BIGINT NOT NULL DEFAULT 0;
ALTER TABLE nodes ADD COLUMN draining_memory_mib BIGINT NOT NULL DEFAULT 0;
UPDATE nodes SET draining_cores = leased_cores - cores, cores = leased_cores WHERE leased_cores > cores;
UPDATE nodes SET draining_memory_mib = leased_memory_mib - memory_mib, memory_mib = leased_memory_mib
    WHERE leased_memory_mib > memory_mib;
