"""The `tiercache` command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console

from tiercache.config import ConfigError, TierCacheConfig, build_config, load_config, unbounded_warnings

app = typer.Typer(
    help="tiercache: a tiered KV-cache for vLLM (CPU, local NVMe and S3 tiers, Redis index).",
    no_args_is_help=True,
    add_completion=False,
    # Markdown reflows the docstrings' wrapped lines; a blank line starts a paragraph.
    rich_markup_mode="markdown",
)
config_app = typer.Typer(
    help="Check a configuration file, or print the configuration reference.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
app.add_typer(config_app, name="config")
console = Console()
err = Console(stderr=True)

CONFIG_HELP = "YAML config (the same schema as the connector's); absent: defaults and TIERCACHE_* variables."
EXIT_BAD_CONFIG = 2
EXIT_UNAVAILABLE = 3


def _load(path: Path | None) -> TierCacheConfig:
    try:
        return load_config(path) if path else build_config({}, source="environment")
    except ConfigError as error:
        err.print(f"[red]{error}[/red]")
        raise typer.Exit(EXIT_BAD_CONFIG) from None


@config_app.command("check")
def config_check(
    file: Path = typer.Argument(..., help="YAML file with the tiercache settings."),
    as_json: bool = typer.Option(False, "--json", help="Print the resolved config as JSON."),
) -> None:
    """Validate FILE (with TIERCACHE_* environment overrides) and print the resolved
    config, or each problem with the field it concerns. Exit 0 if valid, 2 if not."""
    config = _load(file)
    resolved = config.redacted()
    for warning in unbounded_warnings(config):
        err.print(f"[yellow]warning: {warning}[/yellow]")
    if as_json:
        print(json.dumps(resolved, indent=2))
    else:
        import yaml

        console.print(f"[green]{file}: valid[/green]")
        print(yaml.safe_dump(resolved, sort_keys=False), end="")


@config_app.command("docs")
def config_docs() -> None:
    """Print the configuration reference (docs/configuration.md) as Markdown, generated
    from the schema: every key with its type, default and description."""
    from tiercache.ops.config_docs import render_reference

    print(render_reference(), end="")


@app.command()
def demo(
    stack: str = typer.Option(
        "embedded",
        help="embedded: CPU and disk tiers, no servers. local: also start redis-server and an "
        "S3 server here, for all three tiers.",
    ),
    redis: str = typer.Option(None, "--redis", help="Use this Redis (with --s3-endpoint)."),
    s3_endpoint: str = typer.Option(None, "--s3-endpoint", help="Use this S3 endpoint."),
    bucket: str = typer.Option("tiercache-demo", help="S3 bucket for --s3-endpoint."),
    prompt_tokens: int = typer.Option(1024, min=64, help="Prompt length in tokens."),
    workdir: Path = typer.Option(Path(".tiercache-demo"), help="Where the model and disk tier go."),
) -> None:
    """Start vLLM with the tiercache connector on a small model written on the fly, and
    print cold time to first token against the hit time from each tier."""
    from tiercache.ops.demo import run_demo

    if stack not in ("embedded", "local") and not redis:
        err.print(f"[red]--stack must be 'embedded' or 'local', got {stack!r}[/red]")
        raise typer.Exit(EXIT_BAD_CONFIG)
    if bool(redis) != bool(s3_endpoint):
        err.print("[red]--redis and --s3-endpoint go together[/red]")
        raise typer.Exit(EXIT_BAD_CONFIG)
    sys.exit(
        run_demo(
            stack=stack,
            redis_url=redis,
            s3_endpoint=s3_endpoint,
            bucket=bucket,
            prompt_tokens=prompt_tokens,
            workdir=workdir,
            console=console,
        )
    )


@app.command()
def bench(
    stack: str = typer.Option("local", help="local: start redis-server and an S3 server here."),
    redis: str = typer.Option(None, "--redis", help="Use this Redis instead."),
    s3_endpoint: str = typer.Option(None, "--s3-endpoint", help="Use this S3 endpoint instead."),
    bucket: str = typer.Option("tiercache-bench", help="S3 bucket to use."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    block_mib: float = typer.Option(1.0, help="Size of one block in MiB."),
    blocks: int = typer.Option(64, help="Blocks per tier measurement."),
) -> None:
    """Measure each tier's put/get throughput against its raw baseline (memcpy, plain
    file I/O, plain boto3) in the same run, and the Redis prefix lookup."""
    from tiercache.ops.bench import run_bench

    result = run_bench(
        stack=stack,
        redis_url=redis,
        s3_endpoint=s3_endpoint,
        bucket=bucket,
        block_bytes=int(block_mib * 2**20),
        blocks=blocks,
        progress=not as_json,
    )
    if as_json:
        print(json.dumps(result))
    else:
        from tiercache.ops.bench import print_table

        print_table(result, console)


@app.command()
def serve(
    config: Path = typer.Option(
        None,
        "--config",
        "-c",
        envvar="TIERCACHE_CONFIG",
        help=CONFIG_HELP,
    ),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8080, help="Port to listen on."),
    gc_interval: float = typer.Option(60.0, help="Seconds between S3 GC passes (0: off)."),
) -> None:
    """Run the tiercache service: health, readiness, metrics, stats, lookup for routers,
    admin (namespace flush, GC) and the S3 garbage collector."""
    from tiercache.ops.service import serve as run_service

    run_service(_load(config), host=host, port=port, gc_interval=gc_interval)


@app.command()
def stats(
    config: Path = typer.Option(None, "--config", "-c", envvar="TIERCACHE_CONFIG", help=CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Objects and bytes per namespace and tier, from Redis and the disk tier.
    Exit 3 if Redis or S3 could not be read."""
    from tiercache.ops.service import collect_stats

    data = collect_stats(_load(config))
    if as_json:
        print(json.dumps(data, indent=2))
        if data.get("errors"):
            raise typer.Exit(EXIT_UNAVAILABLE)
        return
    from rich.table import Table

    table = Table("namespace", "model", "tier", "objects", "bytes")
    for row in data["rows"]:
        table.add_row(row["namespace"], row["model"], row["tier"], str(row["objects"]), str(row["bytes"]))
    console.print(table)
    for problem in data.get("errors", ()):
        err.print(f"[yellow]{problem}[/yellow]")
    if data.get("errors"):
        raise typer.Exit(EXIT_UNAVAILABLE)


@app.command()
def gc(
    config: Path = typer.Option(None, "--config", "-c", envvar="TIERCACHE_CONFIG", help=CONFIG_HELP),
    sweep_orphans: bool = typer.Option(True, help="Also delete S3 objects with no index entry."),
    force_sweep: bool = typer.Option(
        False,
        "--force-sweep",
        help="Sweep even when most objects have no index entry (the sweep refuses then: "
        "the index looks lost).",
    ),
    reindex: bool = typer.Option(
        False,
        "--reindex",
        help="Instead of a pass, rebuild the index from the objects' headers (after Redis lost its "
        "data): registered deployments' whole objects get their entries back.",
    ),
) -> None:
    """One pass of the S3 garbage collector: keep each namespace under s3.capacity by
    last access, never touching an object under a live read lease, then sweep objects
    no index entry names (refused when that is most of the bucket). With --reindex,
    rebuild the index from the objects instead. Exit 3 if Redis or S3 could not be
    reached."""
    from tiercache.tiers.s3.gc import run_gc
    from tiercache.tiers.s3.reindex import reindex as rebuild_index

    if reindex:
        report = rebuild_index(_load(config))
    else:
        report = run_gc(_load(config), sweep_orphans=sweep_orphans, force_sweep=force_sweep)
    console.print_json(data=report)
    if report.get("errors"):
        raise typer.Exit(EXIT_UNAVAILABLE)


@app.command()
def inspect(
    target: str = typer.Argument(
        None,
        help="A .safetensors object file, or an object key `DIGEST/BLOCKHASH` (hex) to look up.",
    ),
    prompt: str = typer.Option(
        None,
        "--prompt",
        help="Token ids (comma-separated, or @FILE holding a JSON list): show where its cached prefix lives.",
    ),
    block_size: int = typer.Option(32, "--block-size", min=1, help="vLLM's block size, with --prompt."),
    peers: bool = typer.Option(
        False,
        "--peers",
        help="List the live peers of each deployment of the namespace: instances whose workers "
        "serve their CPU tier to the others over NIXL (peer.enabled).",
    ),
    config: Path = typer.Option(None, "--config", "-c", envvar="TIERCACHE_CONFIG", help=CONFIG_HELP),
) -> None:
    """Show what an object is (header, checksum check), where a key lives, how much
    of a prompt's prefix is cached in which tier, or which instances serve the peer tier."""
    from tiercache.ops.object_info import inspect_prompt, inspect_target

    if peers:
        from tiercache.ops.peers import inspect_peers

        raise typer.Exit(inspect_peers(_load(config), console))
    if prompt is not None:
        try:
            raw = Path(prompt[1:]).read_text() if prompt.startswith("@") else f"[{prompt}]"
            token_ids = [int(t) for t in json.loads(raw)]
        except (OSError, ValueError, TypeError) as error:
            err.print(f"[red]--prompt: expected token ids like 1,2,3 or @tokens.json ({error})[/red]")
            raise typer.Exit(EXIT_BAD_CONFIG) from None
        raise typer.Exit(inspect_prompt(token_ids, _load(config), block_size, console))
    if target is None:
        err.print("[red]give an object file, an object key, or --prompt[/red]")
        raise typer.Exit(EXIT_BAD_CONFIG)
    code = inspect_target(target, _load(config) if config else None, console)
    raise typer.Exit(code)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
