"""The S3 tier: the tier itself (tier), run objects (runs, run_packer), reading and
writing them (reader, writer), and the passes over the bucket and its index (passes,
gc, reindex, legacy, cost)."""
