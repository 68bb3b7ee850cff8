"""An instance (the connector's two halves, `ConnectorDriver`) with the peer tier on,
in a process of its own: it computes and stores blocks, says so in Redis, prints
READY and waits to be killed. tests/test_peer_connector.py reads from it.

    python peer_instance.py <redis_url> <model> <instance> <seed>"""

from __future__ import annotations

import sys
import time

import numpy as np

from connector.driver import ConnectorDriver
from tiercache.config import TierCacheConfig, build_config

BLOCK = 16 * 1024
BLOCKS = 6


def config(redis_url: str, name: str, *, peer: bool = True, namespace: str = "default") -> TierCacheConfig:
    return build_config(
        {
            "cpu": {"capacity": 16 * BLOCK},
            "redis_url": redis_url,
            "namespace": namespace,
            "instance_id": name,
            "peer": {"enabled": peer, "skip_seconds": 0},
            "movers": {"load_deadline_seconds": 10},
        },
        environ={},
    )


def instance(redis_url: str, name: str, model: str, **kwargs) -> ConnectorDriver:
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
    redis_url, model, name, seed = argv[0], argv[1], argv[2], int(argv[3])
    driver = instance(redis_url, name, model)
    computed(driver, *blocks(seed))
    print("READY", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1:])
