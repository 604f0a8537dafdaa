-- A key, shared by the replicas, that tags credential ids so made-up ones are refused without a lookup
CREATE TABLE manager_keys (
    name TEXT NOT NULL PRIMARY KEY,
    value TEXT NOT NULL
);
