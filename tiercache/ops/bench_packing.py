"""`tiercache bench`'s S3 request figures: the same prompts stored and
loaded twice in one run, one object per block (`s3.pack_blocks: 1`, what tiercache
wrote before runs) and packed into runs, counting every request the S3 client sends
(`tiercache_s3_requests_total`) and timing the S3 hits.

Per setting: PUTs per 1k tokens stored, GETs per 1k tokens loaded, dollars per
million tokens stored and loaded at public list prices (tiers/s3/cost.py), the median time
to load one prompt's blocks from S3, and the Redis bytes per indexed block (MEMORY
USAGE over the index's keys). Each hit loads a prefix that ends inside a run (all
but the prompt's last block), as a request whose prompt shares all but its tail
with an earlier one would."""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import numpy as np

from tiercache.tiers.s3.cost import RequestFigures, requests_sent

# The issue's target: packed runs need at most this share of per-block objects' PUTs.
MAX_PUT_RATIO = 1 / 8


def _hashes(prompt: int, blocks: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed * 100_003 + prompt)
    return [rng.bytes(32) for _ in range(blocks)]


def _measure(
    redis_url: str,
    s3_endpoint: str,
    bucket: str,
    block_bytes: int,
    tokens_per_block: int,
    prompts: int,
    blocks_per_prompt: int,
    pack_blocks: int,
    seed: int,
) -> dict[str, Any]:
    from tiercache.config import build_config
    from tiercache.engine import S3, ObjectShape, TierEngine
    from tiercache.tiers.cpu import CpuBuffer

    config = build_config(
        {
            "redis_url": redis_url,
            "cpu": {"capacity": blocks_per_prompt * block_bytes},
            # Every slot may wait for S3: a prompt's blocks are all in flight at once.
            "movers": {"queue_depth": 4 * blocks_per_prompt, "upload_slot_share": 1.0},
            "s3": {
                "bucket": bucket,
                "prefix": "bench-requests/",
                "endpoint_url": s3_endpoint,
                "region": "us-east-1",
                # pack_bytes as shipped (16 MiB of pages): larger objects would
                # flatter the PUT count and cost every ranged GET more on moto, which
                # reads the whole object for each one.
                "pack_blocks": pack_blocks,
            },
        },
        environ={},
    )
    shape = ObjectShape(uuid.uuid4().hex[:16], uuid.uuid4().hex[:16], block_bytes)
    buffer = CpuBuffer(blocks_per_prompt, block_bytes, pin_memory=False)
    engine = TierEngine(config, shape, buffer)
    payload = np.random.default_rng(seed).integers(0, 256, (blocks_per_prompt, block_bytes), dtype=np.uint8)
    outs = [memoryview(bytearray(block_bytes)) for _ in range(blocks_per_prompt)]
    try:
        puts = requests_sent("put")
        written: list[Any] = []
        for prompt in range(prompts):
            hashes = _hashes(prompt, blocks_per_prompt, seed)
            for i, block_hash in enumerate(hashes):
                buffer.view(i)[:] = payload[i].tobytes()
                engine.write_down(block_hash, i, written.append, tiers=(S3,), group=prompt)
            engine.end_group(prompt)
            if not engine.flush(120):
                raise RuntimeError("S3 uploads did not finish")
        if (
            not all(result.stored.get(S3) for result in written)
            or len(written) != prompts * blocks_per_prompt
        ):
            raise RuntimeError("an S3 store was dropped")
        puts = requests_sent("put") - puts
        loaded = blocks_per_prompt - 1
        gets = requests_sent("get")
        times = []
        for prompt in range(prompts):
            hashes = _hashes(prompt, blocks_per_prompt, seed)
            start = time.perf_counter()
            ok = engine.read_s3(list(zip(hashes[:loaded], outs, strict=False)))
            times.append(time.perf_counter() - start)
            if not all(ok):
                raise RuntimeError("an S3 hit was lost")
        gets = requests_sent("get") - gets
        index = engine.index
        if index is None:
            raise RuntimeError("the S3 tier needs redis_url")
        model, rank = shape.model_digest, shape.rank_digest
        redis_bytes = index.memory_usage(model, rank) / max(1, index.count(model, rank))
        figures = RequestFigures(
            puts, gets, prompts * blocks_per_prompt * tokens_per_block, prompts * loaded * tokens_per_block
        )
        assert config.s3 is not None  # set above
        return {
            "pack_blocks": pack_blocks,
            "run_blocks": config.s3.run_blocks(block_bytes),
            **figures.as_dict(),
            "s3_hit_seconds_median": round(statistics.median(times), 5),
            "redis_bytes_per_block": round(redis_bytes, 1),
        }
    finally:
        engine.close()


def bench_requests(
    redis_url: str,
    s3_endpoint: str,
    bucket: str,
    block_bytes: int,
    *,
    tokens_per_block: int = 16,
    prompts: int = 8,
    blocks_per_prompt: int = 32,
    pack_blocks: int = 16,
) -> dict[str, Any]:
    """Per-block objects against runs of `pack_blocks`, same prompts, same machine."""
    args = (redis_url, s3_endpoint, bucket, block_bytes, tokens_per_block, prompts, blocks_per_prompt)
    # A warm-up of each, then the measured pair (per-block first, as before runs).
    _measure(*args, 1, seed=1)
    _measure(*args, pack_blocks, seed=2)
    per_block = _measure(*args, 1, seed=3)
    packed = _measure(*args, pack_blocks, seed=4)
    return {
        "per_block": per_block,
        "packed": packed,
        "put_ratio": round(packed["puts"] / per_block["puts"], 4),
        "get_ratio": round(packed["gets"] / per_block["gets"], 4),
        "s3_hit_time_ratio": round(packed["s3_hit_seconds_median"] / per_block["s3_hit_seconds_median"], 3),
        "settings": {
            "block_bytes": block_bytes,
            "tokens_per_block": tokens_per_block,
            "prompts": prompts,
            "blocks_per_prompt": blocks_per_prompt,
            "blocks_loaded_per_hit": blocks_per_prompt - 1,
        },
    }


def print_requests(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    from tiercache.tiers.s3.cost import GET_USD_PER_1000, PUT_USD_PER_1000

    table = Table(title="S3 requests: one object per block vs runs (same prompts, this run)")
    for column in (
        "objects",
        "PUTs / 1k tok stored",
        "GETs / 1k tok loaded",
        "$ / M tok stored",
        "S3 hit (median s)",
        "Redis B / block",
    ):
        table.add_column(column, justify="right" if column != "objects" else "left")
    for name in ("per_block", "packed"):
        f = result[name]
        label = "per block" if name == "per_block" else f"runs of {f.get('run_blocks', f['pack_blocks'])}"
        table.add_row(
            label,
            f"{f['puts_per_1k_tokens_stored']:.2f}",
            f"{f['gets_per_1k_tokens_loaded']:.2f}",
            f"{f['usd_per_million_tokens_stored']:.4f}",
            f"{f['s3_hit_seconds_median']:.4f}",
            f"{f['redis_bytes_per_block']:.0f}",
        )
    console.print(table)
    console.print(
        f"PUT ratio packed/per-block {result['put_ratio']:.3f} (target <= {MAX_PUT_RATIO:.3f}); "
        f"GET ratio {result['get_ratio']:.3f}; S3-hit time ratio {result['s3_hit_time_ratio']:.2f} "
        f"(prices: S3 Standard PUT ${PUT_USD_PER_1000} and GET ${GET_USD_PER_1000} per 1,000 requests)"
    )
