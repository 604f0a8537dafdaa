-- Nodes count the changes to their leased counters
ALTER TABLE nodes ADD COLUMN lease_seq BIGINT NOT NULL DEFAULT 0;
