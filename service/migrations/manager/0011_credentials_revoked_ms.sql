-- When each credential was revoked, so every replica reads the revocations
-- since its last round in one indexed query instead of reading each cached
-- credential again every few seconds.
ALTER TABLE credentials ADD COLUMN revoked_ms BIGINT NOT NULL DEFAULT 0;
CREATE INDEX credentials_revoked ON credentials (revoked_ms) WHERE revoked = 1;
