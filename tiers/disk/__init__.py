"""The node's disk tier: the tier and its on-disk layout (tier), and the index of a
root's blocks by last use (index)."""
