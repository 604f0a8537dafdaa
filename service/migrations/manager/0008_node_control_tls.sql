-- Whether a node's control port speaks TLS, so lease grants tell clients
ALTER TABLE nodes ADD COLUMN control_tls BIGINT NOT NULL DEFAULT 0;
