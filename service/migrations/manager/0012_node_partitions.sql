-- The Slurm partitions each node registered: a row per (node, partition),
-- replaced at each registration, so listing the nodes of a partition reads
-- the index on (partition, node) in name order. `nodes.partitions` keeps
-- the same names as a JSON array, read with the rest of the node.
CREATE TABLE node_partitions (
    node TEXT NOT NULL,
    partition TEXT NOT NULL,
    PRIMARY KEY (node, partition)
);
CREATE INDEX node_partitions_by_partition ON node_partitions (partition, node);
ALTER TABLE nodes ADD COLUMN partitions TEXT NOT NULL DEFAULT '[]';
