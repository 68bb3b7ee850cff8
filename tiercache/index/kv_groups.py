"""What each KV cache group of a hybrid model needs for a prefix hit, and how its
blocks are named (no vLLM here: the service's lookup API uses it too; the connector
reads the rules off vLLM's specs in connector/groups.py).

vLLM's hybrid KV cache manager gives each group (full attention, sliding window,
Mamba / linear attention state) its own block table; the groups share one block pool,
and their layers overlay one another in memory. tiercache stores one block of one
group as one object, named by vLLM's block hash and the group (`group_key`), so each
group's blocks are cached, evicted and looked up on their own, under one rank digest.

A hit that ends at block `end` (its last `end * block_size` tokens computed) is
served only if every group holds what vLLM's own managers
(`vllm/v1/core/single_type_kv_cache_manager.py`) keep for a request computed that far:
- full attention: every block before `end`;
- sliding window: the blocks the next token's window reaches (vLLM puts the null
  block in place of the earlier ones);
- Mamba state in `align` mode: the state after the last token, which vLLM keeps in
  block `end - 1`; a state exists only at the boundaries where a step ended, so such a
  group cuts a hit down to the last boundary it holds.
A group of any other kind (or Mamba without prefix caching, whose one state block
is overwritten every step) can serve nothing: such a deployment never hits."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

FULL = "full"
WINDOW = "window"
STATE = "state"
NONE = "none"

NULL_BLOCK = 0  # vLLM's block pool hands out block 0 as the null block, never to a request


@dataclass(frozen=True)
class GroupRule:
    kind: str
    sliding_window: int = 0  # tokens, for WINDOW
    extra_retained_tokens: int = 0  # WINDOW: vLLM keeps these below the window too

    def encode(self) -> str:
        """The rule as the deployment registry keeps it: "full", "window:64:0", ..."""
        if self.kind == WINDOW:
            return f"{WINDOW}:{self.sliding_window}:{self.extra_retained_tokens}"
        return self.kind

    @classmethod
    def decode(cls, text: str) -> GroupRule:
        kind, *numbers = text.split(":")
        if kind == WINDOW and len(numbers) == 2:
            return cls(WINDOW, sliding_window=int(numbers[0]), extra_retained_tokens=int(numbers[1]))
        return cls(kind if kind in (FULL, STATE) else NONE)

    def needs(self, first: int, end: int, block_size: int) -> range:
        """Block indexes past `first` (those vLLM already holds) that a hit ending at
        block `end` must load into this group."""
        if self.kind == FULL:
            return range(first, end)
        if self.kind == WINDOW:
            # vLLM's SlidingWindowManager.get_num_skipped_tokens at end * block_size.
            skipped = max(0, end * block_size - self.sliding_window + 1 - self.extra_retained_tokens)
            return range(max(first, skipped // block_size), end)
        if self.kind == STATE:
            return range(end - 1, end)
        return range(0)

    def stores(self, index: int, done_tokens: int, block_size: int) -> bool:
        """Whether block `index` holds what a later hit may need, in the step that
        computes up to `done_tokens`: every full-attention and sliding-window block
        (any may end a later prompt's prefix or lie in its window); a Mamba state only
        where the step ended, on a block boundary."""
        if self.kind in (FULL, WINDOW):
            return True
        if self.kind == STATE:
            return done_tokens % block_size == 0 and index == done_tokens // block_size - 1
        return False


def group_key(block_key: bytes, group: int) -> bytes:
    """The name of group `group`'s block under `block_key` (vLLM's hash, or its
    re-keyed form after a reset). Group 0 keeps the hash itself, so a model with one
    group names its blocks as before; the others get a keyed hash of the same width."""
    if group == 0:
        return block_key
    width = min(64, max(16, len(block_key)))
    return hashlib.blake2b(block_key, key=b"tiercache-kv-group-%d" % group, digest_size=width).digest()


def best_end(rules: list[GroupRule], first: int, last: int, block_size: int, holds) -> int:
    """The longest hit in (first, last] that every group can serve: the largest end
    for which `holds(group, index)` is true of every block each group needs; `first`
    when none."""
    full_end = last
    for group, rule in enumerate(rules):
        if rule.kind == NONE:
            return first
        if rule.kind == FULL:
            end = first
            while end < full_end and holds(group, end):
                end += 1
            full_end = end
    for end in range(full_end, first, -1):
        if all(
            all(holds(group, index) for index in rule.needs(first, end, block_size))
            for group, rule in enumerate(rules)
            if rule.kind != FULL
        ):
            return end
    return first
