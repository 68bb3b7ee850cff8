"""The peer tier as operators and routers see it: which live instances of a deployment
serve their CPU tier to the others over NIXL. An instance does while each of its
workers (one per TP rank) keeps its peer record alive in Redis (tiers/peer/registry.py
writes and refreshes them); the record expires when the worker stops refreshing it.

Read here without importing tiers/peer, which needs torch: the service and the CLI
stay light. tests/test_service.py checks that the key format agrees with the registry's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiercache.config import PEER_PORT_SPAN
from tiercache.index.presence import live_instances
from tiercache.index.redis_conn import GuardedRedis
from tiercache.index.redis_index import Deployment

if TYPE_CHECKING:
    from rich.console import Console

    from tiercache.config import TierCacheConfig

# PTTL's answer for a key that does not exist (or has just expired).
NO_KEY = -2


def peer_record_key(model_digest: str, rank_digest: str, instance: str) -> str:
    """Where the worker of `instance` for one rank keeps its peer record (the same
    name as tiers/peer/registry.py's `record_key`)."""
    return f"tc:{{{model_digest}}}:peer:{rank_digest}:{instance}"


def record_keys(deployment: Deployment, instance: str) -> list[str]:
    """The peer records of every TP rank of `instance`, in rank order."""
    return [peer_record_key(deployment.model_digest, rank, instance) for rank in deployment.rank_digests]


def serves_peers(ttls: list[int]) -> bool:
    """Whether an instance whose records have these PTTLs serves its CPU tier: every
    rank's record is live (rank r reads only from rank r, so one missing rank is a
    miss for every block)."""
    return bool(ttls) and all(ttl != NO_KEY for ttl in ttls)


@dataclass(frozen=True)
class PeerWorker:
    """One live worker's peer record."""

    instance: str
    rank: int  # its index in the deployment's rank digests: the TP rank
    rank_digest: str
    agent: str  # its NIXL agent's name
    address: str | None  # host:first-last port (host alone: any port), where the record says
    ttl_seconds: float | None  # until the record expires unless refreshed; None: no expiry


def live_peers(redis: GuardedRedis, deployment: Deployment) -> list[PeerWorker]:
    """The live peer records of a deployment's live instances, by instance then rank.
    Two round trips. Raises RedisUnavailable."""
    instances = live_instances(redis, deployment.model_digest)
    asked = [(name, rank) for name in instances for rank in range(len(deployment.rank_digests))]
    if not asked:
        return []

    def read() -> list:
        pipe = redis.client.pipeline(transaction=False)
        for name, rank in asked:
            key = peer_record_key(deployment.model_digest, deployment.rank_digests[rank], name)
            pipe.pttl(key)
            pipe.hmget(key, ["agent", "host", "port"])
        return pipe.execute()

    answers = redis.call("peer_records", read)
    workers = []
    for (name, rank), ttl, (agent, host, port) in zip(asked, answers[::2], answers[1::2], strict=True):
        if ttl == NO_KEY or agent is None:
            continue
        address = _address(_text(host), int(_text(port) or 0)) if host else None
        workers.append(
            PeerWorker(
                instance=name,
                rank=rank,
                rank_digest=deployment.rank_digests[rank],
                agent=_text(agent),
                address=address,
                ttl_seconds=ttl / 1000 if ttl >= 0 else None,
            )
        )
    return workers


def _address(host: str, port: int) -> str:
    """Where a worker's NIXL agent listens: its host, and its port range when fixed."""
    return f"{host}:{port}-{port + PEER_PORT_SPAN - 1}" if port else host


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def inspect_peers(config: TierCacheConfig, console: Console) -> int:
    """`tiercache inspect --peers`: the live peers of each deployment of the config's
    namespace. Exit 0 when there are some, 1 when none (the peer tier is off, or none
    of the instances runs), 2 without redis_url, 3 when Redis does not answer."""
    from rich.table import Table

    from tiercache.index.redis_conn import RedisUnavailable
    from tiercache.tiers.s3.passes import registered_deployments

    if config.redis_url is None:
        console.print("[red]peers are found through Redis: configure redis_url[/red]")
        return 2
    table = Table(title=f"live peers in namespace {config.namespace}")
    for column in ("deployment", "model", "instance", "rank", "NIXL agent", "address", "record expires in"):
        table.add_column(column)
    redis = GuardedRedis(config.redis_url, config.redis)
    try:
        found = 0
        for dep in sorted(registered_deployments(redis), key=lambda d: d.model_digest):
            if dep.namespace != config.namespace:
                continue
            for worker in live_peers(redis, dep):
                expires = "never" if worker.ttl_seconds is None else f"{worker.ttl_seconds:.1f}s"
                table.add_row(
                    dep.model_digest,
                    dep.model,
                    worker.instance,
                    f"{worker.rank} ({worker.rank_digest})",
                    worker.agent,
                    worker.address or "-",
                    expires,
                )
                found += 1
    except RedisUnavailable as error:
        console.print(f"[red]redis unavailable: {error}[/red]")
        return 3
    finally:
        redis.close()
    if not found:
        console.print(
            f"no live peers in namespace {config.namespace}: no running instance has the "
            "peer tier on (peer.enabled)"
        )
        return 1
    console.print(table)
    return 0
