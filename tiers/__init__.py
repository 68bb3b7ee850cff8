"""The storage tiers, fastest first: the CPU tier (host memory slots), the node's disk
tier and the shared S3 tier. Their names are written here once, for metrics labels,
reports and plans alike."""

CPU, DISK, S3 = "cpu", "disk", "s3"
TIERS = (CPU, DISK, S3)
# Another live instance's CPU tier, read over NIXL (tiers/peer): a tier to read from,
# never one this instance writes down to, so not among TIERS.
PEER = "peer"
