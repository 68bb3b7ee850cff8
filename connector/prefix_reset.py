"""Following the prefix-cache resets vLLM performs.

RL frameworks call `LLM.reset_prefix_cache()` (or `POST /reset_prefix_cache`) with
its defaults after loading new weights in place; vLLM 0.32 then resets its own
prefix cache but calls the connector's `reset_cache` only with `reset_connector=True`
(`?reset_external=true`) or a pause that clears caches. Every one of these paths goes
through the scheduler's KV cache manager, which vLLM hands the connector in
`bind_kv_cache_manager`: wrapping that one instance's `reset_prefix_cache` lets the
scheduler half follow every reset, whatever the caller asked of the connector."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tiercache.connector")


def follow_prefix_cache_resets(kv_cache_manager: Any, on_reset: Callable[[bool], None]) -> bool:
    """Call `on_reset(cleared)` after each `reset_prefix_cache()` of this KV cache
    manager, with whether vLLM cleared its prefix cache (it refuses while requests
    hold blocks). False, logged, where the manager has no such method to follow."""
    reset = getattr(kv_cache_manager, "reset_prefix_cache", None)
    if not callable(reset):
        log.warning(
            "tiercache: vLLM's KV cache manager has no reset_prefix_cache to follow; call "
            "reset_prefix_cache(reset_connector=True) after new weights so tiercache resets too"
        )
        return False

    @functools.wraps(reset)
    def reset_and_follow(*args: Any, **kwargs: Any) -> bool:
        cleared = reset(*args, **kwargs)
        on_reset(bool(cleared))
        return cleared

    # On the instance, not the class: another engine in this process keeps its own.
    kv_cache_manager.reset_prefix_cache = reset_and_follow
    return True
