"""What the scheduler tells the outside world about its tiers: vLLM KV events (through
the connector's `take_events`, which vLLM's own publisher sends on, e.g. over ZMQ with
`--kv-events-config`) and this instance's presence in Redis for routers.

Both come from one place, the scheduler's BlockPolicy, through its watcher: a block is
stored to a tier when it becomes readable there (CPU: every rank filled its slot;
disk: every rank's disk holds it) and removed when it stops being so (evicted, a
failed fill, gone from disk, a cache reset).

Events name blocks by vLLM's own hash, the one vLLM publishes for its GPU blocks, so a
subscriber can join a block's GPU and tier events. Until `/reset_prefix_cache` the
scheduler's block key is that hash; after it, keys are derived under a weights epoch
(scheduler._block_key), and the scheduler tells this class each key's vLLM hash as it
plans a store or a load (`name`). A block whose hash is not known is not published.

The S3 tier is not published here: it is shared by every instance and kept by the
service's GC, so no one scheduler sees its changes; the lookup API answers for it."""

from __future__ import annotations

from typing import Any

from tiercache.index.presence import PresencePublisher
from tiercache.tiers import CPU, DISK

# vLLM's names for offloaded media (vllm/distributed/kv_events.py MEDIUM_CPU and
# MEDIUM_STORAGE, as its OffloadingConnector publishes them: CPU for host memory,
# STORAGE for its file-system tier, with the locality saying whose storage it is).
MEDIUM = {CPU: "CPU", DISK: "STORAGE"}
LOCALITY = "LOCAL"
# Names the producer of the event among offloading tiers (vLLM's `ownership` field).
OWNERSHIP = "tiercache"
# Fields every event carries; `group_idx` (the KV cache group) is set per event.
_EXTRA: dict[str, Any] = {"locality": LOCALITY, "ownership": OWNERSHIP}


class TierEvents:
    """The policy's watcher: records each change for vLLM's KV events (when the
    engine publishes them) and for the presence publisher (when there is one)."""

    def __init__(
        self,
        policy,
        block_size: int,
        *,
        publish: bool,
        presence: PresencePublisher | None,
        hybrid: bool = False,
        presence_group: int = 0,
    ):
        """`hybrid`: several KV cache groups, whose blocks past the first group's are
        keyed apart from vLLM's hash (connector/groups.py); `presence_group`: the
        group whose blocks presence lists (a hybrid model's first full-attention one)."""
        self.policy = policy
        self.block_size = block_size
        self.publish = publish
        self.presence = presence
        # (stored, tier, vLLM hash, KV cache group), in order
        self._changes: list[tuple[bool, str, bytes, int]] = []
        # Tiercache key -> (vLLM hash, group): after a reset, and for a hybrid model's
        # blocks (before either, a key is its vLLM hash, in group 0).
        self._keyed = hybrid
        self._presence_group = presence_group
        self._names: dict[bytes, tuple[bytes, int]] = {}

    # -- naming -------------------------------------------------------------------------
    def name(self, key: bytes, vllm_hash: bytes, group: int = 0) -> None:
        """`key` is the block vLLM calls `vllm_hash` in KV cache group `group` (the
        scheduler plans a store or a load of it). Only kept while keys and hashes differ."""
        if self._keyed:
            self._names[key] = (vllm_hash, group)
            # A name outlives its block only when the block never became readable
            # (a failed fill): drop such names once they outnumber the blocks held.
            if len(self._names) > 2 * (len(self.policy.slots) + len(self.policy.on_disk)) + 1024:
                self._prune()

    def _vllm_hash(self, key: bytes) -> tuple[bytes, int] | None:
        return self._names.get(key) if self._keyed else (key, 0)

    def _prune(self) -> None:
        held = self.policy.slots
        self._names = {k: h for k, h in self._names.items() if k in held or k in self.policy.on_disk}

    def reset(self) -> None:
        """From now on keys are derived under a weights epoch (the policy was just
        cleared, and its removals are already recorded under the old names)."""
        self._keyed = True
        self._names.clear()

    # -- the policy's watcher ------------------------------------------------------------
    def added(self, tier: str, block: bytes) -> None:
        self._record(True, tier, block)

    def removed(self, tier: str, block: bytes) -> None:
        self._record(False, tier, block)
        if self._keyed and self.policy.local_tier(block) is None and block not in self.policy.slots:
            self._names.pop(block, None)

    def _record(self, stored: bool, tier: str, key: bytes) -> None:
        named = self._vllm_hash(key)
        if named is None:
            return
        vllm_hash, group = named
        if self.presence is not None and group == self._presence_group:
            # Presence lists one group's blocks: for a hybrid model, its first
            # full-attention group's, a router's upper bound of the hit (the
            # service's lookup API, docs/design.md).
            self.presence.update(vllm_hash, tier, stored)
        if self.publish:
            self._changes.append((stored, tier, vllm_hash, group))

    # -- vLLM's KV events ------------------------------------------------------------------
    def take(self) -> list[Any]:
        """This step's changes as vLLM KV events, in the order they happened: one
        BlockStored per block (with no parent or token ids, which the GPU event for
        the same hash carries), one BlockRemoved per run of removals from one tier."""
        changes, self._changes = self._changes, []
        if not changes:
            return []
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

        # Fields older vLLM builds' events lack are left out rather than refused.
        fields = BlockStored.__struct_fields__

        def extra(group: int) -> dict[str, Any]:
            return {k: v for k, v in {**_EXTRA, "group_idx": group}.items() if k in fields}

        events: list[Any] = []
        removed: list = []
        removed_tier, removed_group = "", 0  # the tier and group of the blocks in `removed`
        for stored, tier, vllm_hash, group in changes:
            if removed and (stored or tier != removed_tier or group != removed_group):
                events.append(
                    BlockRemoved(block_hashes=removed, medium=MEDIUM[removed_tier], **extra(removed_group))
                )
                removed = []
            # bytes, or int if vLLM is asked for ints
            external = maybe_convert_block_hash(BlockHash(vllm_hash))
            if stored:
                events.append(
                    BlockStored(
                        block_hashes=[external],
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=self.block_size,
                        lora_id=None,
                        medium=MEDIUM[tier],
                        lora_name=None,
                        **extra(group),
                    )
                )
            else:
                removed.append(external)
                removed_tier, removed_group = tier, group
        if removed:
            events.append(
                BlockRemoved(block_hashes=removed, medium=MEDIUM[removed_tier], **extra(removed_group))
            )
        return events
