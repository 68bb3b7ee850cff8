"""An instance (the connector's two halves, `ConnectorDriver`) with the peer tier on,
in a process of its own: it computes and stores blocks, says so in Redis, prints
READY and waits to be killed. tests/test_peer_connector.py reads from it.

    python peer_instance.py <redis_url> <model> <instance> <seed>"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import numpy as np

from tiercache.config import TierCacheConfig, build_config

if TYPE_CHECKING:
    from connector.driver import ConnectorDriver

BLOCK = 16 * 1024
BLOCKS = 6


def config(
    redis_url: str, name: str, *, peer: bool = True, namespace: str = "default", disk: str | None = None
) -> TierCacheConfig:
    """`disk`: the folder of a disk tier (none by default)."""
    return build_config(
        {
            "cpu": {"capacity": 16 * BLOCK},
            **({"disk": {"path": disk}} if disk else {}),
            "redis_url": redis_url,
            "namespace": namespace,
            "instance_id": name,
            "peer": {"enabled": peer, "skip_seconds": 0},
            "movers": {"load_deadline_seconds": 10},
        },
        environ={},
    )


def instance(redis_url: str, name: str, model: str, **kwargs) -> ConnectorDriver:
    from connector.driver import ConnectorDriver

    return ConnectorDriver(config(redis_url, name, **kwargs), BLOCK, model=model, num_blocks=2 * BLOCKS + 2)


def blocks(seed: int, count: int = BLOCKS) -> tuple[list[bytes], list[bytes]]:
    """`count` block hashes and their pages, the same for one seed in every process."""
    rng = np.random.default_rng(seed)
    hashes = [rng.bytes(32) for _ in range(count)]
    return hashes, [rng.bytes(BLOCK) for _ in range(count)]


def computed(driver: ConnectorDriver, hashes: list[bytes], pages: list[bytes]) -> None:
    """`driver` computes and stores the blocks, and says so in Redis (presence)."""
    served = driver.serve(hashes, pages)
    assert served.hits == 0
    driver.deliver_reports()
    assert all(h in driver.policy.ready for h in hashes)
    presence = driver.scheduler.tier_events.presence
    assert presence.flush()


def main(argv: list[str]) -> None:
    """The holder: the worker half alone (it runs without vLLM, connector/vllm_compat.py,
    and starts in a few seconds rather than the many importing vLLM takes), handed the
    step a scheduler would plan to store the blocks, and the presence that scheduler
    would publish."""
    redis_url, model, name, seed = argv[0], argv[1], argv[2], int(argv[3])
    sys.modules["vllm"] = None  # type: ignore[assignment]
    import torch

    from connector.driver import LAYER, byte_block_spec
    from connector.metadata import BlockOp, TierCacheMetadata
    from connector.worker import TierCacheWorker
    from tiercache.index.presence import PresencePublisher
    from tiercache.index.redis_conn import GuardedRedis
    from tiercache.tiers import CPU

    settings = config(redis_url, name)
    # The spec ConnectorDriver gives its worker: the same deployment and rank digests.
    spec = byte_block_spec(model, BLOCK, settings.namespace)
    worker = TierCacheWorker(settings, spec, spec.model_digest(), BLOCKS, 0, True, 0, [[LAYER]])
    kv = torch.zeros((BLOCKS, BLOCK), dtype=torch.uint8)
    worker.register_kv_caches({LAYER: kv}, BLOCK)
    hashes, pages = blocks(seed)
    for i, page in enumerate(pages):
        kv[i] = torch.frombuffer(bytearray(page), dtype=torch.uint8)
    step = TierCacheMetadata(
        stores=[BlockOp(h, i, i, CPU, req_id="r") for i, h in enumerate(hashes)], instance=name
    )
    worker.track(step)
    worker.start_load_kv(step)
    worker.wait_for_save(step)
    worker.get_finished()
    assert worker.peer is not None, "the peer tier did not start"
    presence = PresencePublisher(GuardedRedis(redis_url, settings.redis), spec.model_digest(), name)
    for block_hash in hashes:
        presence.update(block_hash, CPU, True)
    assert presence.flush()
    print("READY", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1:])
