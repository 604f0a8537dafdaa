-- Leases are found by grant and state in one index
DROP INDEX leases_by_grant;
CREATE INDEX leases_by_grant_state ON leases (grant_id, state);
