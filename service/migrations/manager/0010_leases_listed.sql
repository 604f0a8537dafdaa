-- Lease listings come newest first in pages; each reads an index in that
-- order, whatever number of ended leases the table holds.
CREATE INDEX leases_listed ON leases (state, issued_at, id);
CREATE INDEX leases_listed_all ON leases (issued_at, id);
