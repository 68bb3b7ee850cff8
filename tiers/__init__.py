"""The storage tiers, fastest first: the CPU tier (host memory slots), the node's disk
tier and the shared S3 tier. Their names are written here once, for metrics labels,
reports and plans alike."""

CPU, DISK, S3 = "cpu", "disk", "s3"
TIERS = (CPU, DISK, S3)
