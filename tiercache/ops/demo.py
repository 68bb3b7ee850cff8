"""`tiercache demo`: vLLM with the connector on a small model written on the fly,
showing time to first token cold and on a hit from each tier.

Every phase is a fresh engine process, so the disk and S3 hits are what a restarted
or a different vLLM instance gets. On the CPU backend an engine pays a one-off cost the
first time it meets a new shape, so each phase first runs an unrelated prompt of the
same length twice (a full prefill, then a hit), and only then the measured requests."""

from __future__ import annotations

import random
import shutil
from contextlib import ExitStack
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tiercache.ops.tiny_model import write_tiny_llama
from tiercache.ops.vllm_runner import connector_config, loading_every_hit, run_engine

BLOCK = 32


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 4000) for _ in range(length)]


def run_demo(
    *,
    stack: str,
    redis_url: str | None,
    s3_endpoint: str | None,
    bucket: str,
    prompt_tokens: int,
    workdir: Path,
    console: Console,
) -> int:
    workdir = workdir.resolve()
    console.print(f"[bold]tiercache demo[/bold]: writing a small random Llama under {workdir}")
    model = str(
        write_tiny_llama(
            workdir / "model", num_layers=6, hidden_size=512, num_heads=8, num_kv_heads=4, vocab_size=4096
        )
    )
    disk = workdir / "disk"
    shutil.rmtree(disk, ignore_errors=True)
    prompt = _prompt(7, prompt_tokens)
    loadable = (prompt_tokens - 1) // BLOCK * BLOCK

    with ExitStack() as stack_guard:
        shared: dict = {}
        if stack == "local" and not redis_url:
            from tiercache.ops.local_stack import local_stack

            console.print("starting redis-server and SeaweedFS's S3 gateway on loopback ...")
            # SeaweedFS checks every request's signature, as a production store does:
            # its credentials are in this process's environment, and so in each engine's.
            redis_server, s3 = stack_guard.enter_context(local_stack(bucket, s3_server="seaweedfs"))
            redis_url, s3_endpoint = redis_server.url, s3.url
        if redis_url:
            from tiercache.ops.local_stack import create_bucket

            create_bucket(s3_endpoint, bucket)
            shared = {
                "redis_url": redis_url,
                "s3": {"bucket": bucket, "endpoint_url": s3_endpoint, "prefix": "demo/"},
            }

        def phase(title: str, extra: dict, items: list[tuple[str, list[int]]], seed: int):
            console.print(f"[cyan]{title}[/cyan]: starting a fresh vLLM engine ...")
            warm_up = _prompt(seed, prompt_tokens)
            runs = [{"name": "warm-up", "ids": warm_up, "repeat": 2}] + [
                {"name": n, "ids": i} for n, i in items
            ]
            out = run_engine(
                {
                    "model": model,
                    # Shows each tier's hit, whatever it costs against recomputing.
                    "kv_transfer_config": connector_config(loading_every_hit(extra)),
                    "prompts": runs,
                    "max_model_len": max(4096, prompt_tokens + 64),
                },
                workdir / "runs",
            )
            return out["results"][2:]

        base = {"namespace": "demo", "cpu": {"capacity": "1GiB"}}
        local = {**base, "disk": {"path": str(disk), "capacity": "4GiB"}}
        cold, cpu_hit = phase(
            "cold, then CPU tier", {**local, **shared}, [("cold", prompt), ("cpu", prompt)], 1
        )
        rows = [("cold (no cache)", cold), ("CPU tier hit", cpu_hit)]
        (disk_hit,) = phase("disk tier, after a restart", local, [("disk", prompt)], 2)
        rows.append(("disk tier hit (fresh process)", disk_hit))
        if shared:
            fresh = {**base, **shared, "disk": {"path": str(workdir / "disk-empty"), "capacity": "4GiB"}}
            shutil.rmtree(workdir / "disk-empty", ignore_errors=True)
            (s3_hit,) = phase("S3 tier, fresh process and empty disk", fresh, [("s3", prompt)], 3)
            rows.append(("S3 tier hit (fresh process, empty disk)", s3_hit))

    table = Table(title=f"Time to first token, {prompt_tokens}-token prompt ({loadable} loadable)")
    table.add_column("run")
    table.add_column("TTFT", justify="right")
    table.add_column("tokens loaded", justify="right")
    table.add_column("speed-up", justify="right")
    table.add_column("same output", justify="center")
    cold_time = cold["seconds"]
    for name, result in rows:
        same = result["token_ids"][:1] == cold["token_ids"][:1]
        table.add_row(
            name,
            f"{result['seconds'] * 1000:.0f} ms",
            str(result["num_cached_tokens"]),
            f"{cold_time / result['seconds']:.1f}x faster" if result is not cold else "1.0x",
            "yes" if same else "NO",
        )
    console.print(table)
    if not shared:
        console.print("S3 tier: run [bold]tiercache demo --stack local[/bold] to add Redis and S3.")
    ok = all(r["token_ids"][:1] == cold["token_ids"][:1] for _, r in rows)
    return 0 if ok else 1
