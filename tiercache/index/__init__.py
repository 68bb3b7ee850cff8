"""The Redis side: the shared prefix index of S3 runs (redis_index), leases, each
instance's presence, the connection guard (redis_conn), and the names of blocks
(keys, block_hashing, kv_groups)."""
