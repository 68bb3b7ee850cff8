"""`tiercache inspect`: what a stored object is, and where a key lives.

A file: its safetensors header (opened with `safetensors`, nothing unpickled) and the
tiercache metadata, with the payload checked against the header's checksum (and its
MAC, when the config sets an integrity key).
Exit 0 when intact, 1 when corrupt, truncated or not a tiercache object.

A key ('<16 hex rank digest>/<block hash hex>'), with a config: whether this node's
disk tier holds it (and intact), whether the Redis index names it (and when it was
last used), and whether its S3 object exists. Exit 0 when some tier holds it, 1 when
none does, 2 for a bad argument, 3 when a tier could not be asked."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tiercache.config import TierCacheConfig
from tiercache.index.keys import HEX_KEY, split_key
from tiercache.tiers.format import (
    TENSOR_NAME,
    CorruptObject,
    ObjectHeader,
    check_mac,
    decode_header,
    header_length,
    object_mac,
)

EXIT_OK = 0
EXIT_CORRUPT = 1
EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
_READ_CHUNK = 8 * 2**20


def inspect_target(target: str, config: TierCacheConfig | None, console: Console) -> int:
    path = Path(target)
    if path.is_file():
        return inspect_file(path, console, config.integrity_key_bytes() if config else None)
    if HEX_KEY.match(target):
        if config is None:
            console.print(
                f"[red]{target} is an object key: pass --config (or TIERCACHE_CONFIG) so "
                "inspect knows where the tiers are[/red]"
            )
            return EXIT_USAGE
        return inspect_key(target, config, console)
    if path.exists():
        console.print(f"[red]{target} is not a file[/red]")
    else:
        console.print(
            f"[red]{target!r} is neither an existing file nor an object key "
            "('<16 hex digits>/<block hash in hex>')[/red]"
        )
    return EXIT_USAGE


def read_object_header(path: Path) -> tuple[ObjectHeader, int]:
    """The tiercache header of an object file and the offset of its payload."""
    with open(path, "rb") as f:
        length = header_length(f.read(8))
        raw = f.read(length)
    if len(raw) != length:
        raise CorruptObject(f"header truncated: {len(raw)} of {length} bytes")
    return decode_header(raw), 8 + length


def verify_file(path: Path, header: ObjectHeader, offset: int, integrity_key: bytes | None = None) -> str:
    """Checksum the payload (and check the MAC, given the integrity key); raises
    CorruptObject when it is short, long, altered, or not signed with that key."""
    size = path.stat().st_size
    if size != offset + header.nbytes:
        raise CorruptObject(f"file holds {size - offset} payload bytes, its header says {header.nbytes}")
    import xxhash

    digest = xxhash.xxh3_64()
    mac = object_mac(integrity_key, header) if integrity_key is not None else None
    with open(path, "rb") as f:
        f.seek(offset)
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
            if mac is not None:
                mac.update(chunk)
    actual = digest.hexdigest()
    if actual != header.checksum:
        raise CorruptObject(f"checksum mismatch: payload {actual}, header {header.checksum}")
    if mac is not None:
        check_mac(header, mac.hexdigest())
    return actual


def inspect_file(path: Path, console: Console, integrity_key: bytes | None = None) -> int:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as error:
        console.print(f"[red]{path}: not a readable safetensors file: {error}[/red]")
        return EXIT_CORRUPT
    try:
        header, offset = read_object_header(path)
    except (CorruptObject, OSError) as error:
        console.print(f"[red]{path}: not a tiercache object: {error}[/red]")
        return EXIT_CORRUPT

    table = Table(title=str(path), show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("key", header.key)
    table.add_row("namespace digest", header.namespace_digest)
    table.add_row("format version", metadata.get("format_version", "?"))
    table.add_row("payload bytes", str(header.nbytes))
    table.add_row("payload offset", str(offset))
    table.add_row("layout", header.layout or "-")
    table.add_row("dtype", header.dtype or "-")
    table.add_row("shapes", header.shapes or "-")
    table.add_row("tensors", ", ".join(f"{name} {shape}" for name, shape in tensors.items()))
    table.add_row("checksum (xxh3-64)", header.checksum)
    table.add_row("MAC (HMAC-SHA256)", header.mac or "-")
    console.print(table)
    if TENSOR_NAME not in tensors:
        console.print(f"[red]corrupt: no {TENSOR_NAME!r} tensor[/red]")
        return EXIT_CORRUPT
    try:
        verify_file(path, header, offset, integrity_key)
    except CorruptObject as error:
        console.print(f"[red]corrupt: {error}[/red]")
        return EXIT_CORRUPT
    console.print("[green]checksum ok[/green]" + (", [green]MAC ok[/green]" if integrity_key else ""))
    return EXIT_OK


def _disk_report(config: TierCacheConfig, key: str) -> tuple[str, bool]:
    from tiercache.tiers.disk.layout import DiskLayout

    assert config.disk is not None  # called only with a disk tier
    path = Path(DiskLayout(config.disk.path).path(key))
    if not path.is_file():
        return f"absent ({path})", False
    try:
        header, offset = read_object_header(path)
        if header.key != key:
            raise CorruptObject(f"holds key {header.key}")
        verify_file(path, header, offset, config.integrity_key_bytes())
    except (CorruptObject, OSError) as error:
        return f"[red]present but corrupt: {error}[/red] ({path})", False
    return f"[green]present[/green], {os.path.getsize(path)} bytes, checksum ok ({path})", True


def inspect_key(key: str, config: TierCacheConfig, console: Console) -> int:
    from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable
    from tiercache.index.redis_index import RedisIndex, runs_key
    from tiercache.tiers.s3.passes import registered_deployments

    rank, block = split_key(key)
    table = Table(title=key, show_header=False)
    table.add_column("tier", style="bold")
    table.add_column("state")
    found = False
    unavailable = False
    runs: list[tuple[str, int]] = []  # (run hex, position) of the block in S3, per the index

    if config.disk is not None:
        state, held = _disk_report(config, key)
        table.add_row("disk (this node)", state)
        found |= held
    else:
        table.add_row("disk (this node)", "not configured")

    if config.redis_url is not None:
        redis = GuardedRedis(config.redis_url, config.redis)
        try:
            owners = [d for d in registered_deployments(redis) if rank in d.rank_digests]
            if not owners:
                table.add_row("s3 index", "no registered deployment has this rank digest")
            index = RedisIndex(redis)
            for dep in owners:
                where = index.locate(dep.model_digest, rank, bytes.fromhex(block))
                if where is None:
                    table.add_row("s3 index", f"absent (deployment {dep.model_digest}, {dep.model})")
                    continue
                run_id, position = where
                zkey = runs_key(dep.model_digest, rank)
                score = redis.call("zscore", lambda z=zkey, r=run_id: redis.client.zscore(z, r))
                when = (
                    datetime.fromtimestamp(score, timezone.utc).isoformat(timespec="seconds")
                    if score is not None
                    else "unknown"
                )
                runs.append((run_id.hex(), position))
                table.add_row(
                    "s3 index",
                    f"[green]present[/green] (deployment {dep.model_digest}, {dep.model}; "
                    f"namespace {dep.namespace}; run {run_id.hex()}, block {position}; "
                    f"run's last access {when})",
                )
        except RedisUnavailable:
            table.add_row("s3 index", "[red]redis unavailable[/red]")
            unavailable = True
        finally:
            redis.close()
    else:
        table.add_row("s3 index", "not configured")

    if config.s3 is not None:
        from botocore.exceptions import BotoCoreError, ClientError

        from tiercache.tiers.s3.tier import S3Tier

        s3 = S3Tier(config.s3)
        try:
            if not runs:
                table.add_row("s3 object", "no run object named by the index")
            for run, position in runs:
                name = f"s3://{s3.bucket}/{s3.run_name(rank, run)}"
                try:
                    toc = s3.read_run_header(rank, run)
                except CorruptObject as error:
                    table.add_row("s3 object", f"[red]run present but corrupt: {error}[/red] ({name})")
                    continue
                except ClientError as error:
                    if error.response.get("Error", {}).get("Code") not in ("NoSuchKey", "404"):
                        raise
                    table.add_row("s3 object", f"absent ({name})")
                    continue
                if position < len(toc.block_hashes) and toc.block_hashes[position] == bytes.fromhex(block):
                    count = len(toc.block_hashes)
                    state = f"[green]present[/green], block {position} of a run of {count} ({name})"
                    table.add_row("s3 object", state)
                    found = True
                else:
                    state = f"[red]the run holds another block at {position}[/red] ({name})"
                    table.add_row("s3 object", state)
        except (BotoCoreError, ClientError) as error:
            table.add_row("s3 object", f"[red]could not ask: {type(error).__name__}[/red]")
            unavailable = True
        finally:
            s3.close()
    else:
        table.add_row("s3 object", "not configured")

    console.print(table)
    if found:
        return EXIT_OK
    return EXIT_UNAVAILABLE if unavailable else EXIT_NOT_FOUND


def prompt_block_hashes(token_ids: list[int], block_size: int, hash_name: str = "sha256") -> list[bytes]:
    """vLLM's own chained block hashes of a prompt's full blocks (vLLM computes the
    same for `request.block_hashes`), so the answer agrees with what the connector
    looks up. Needs vLLM installed."""
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
    except ImportError as error:
        raise RuntimeError(f"hashing a prompt needs vLLM installed ({error})") from None
    hash_fn = get_hash_fn_by_name(hash_name)
    kv_cache_utils.init_none_hash(hash_fn)
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, token_ids[start : start + block_size])
        hashes.append(bytes(parent))
    return hashes


def _leading_on_disk(layout, rank_digests, hashes: list[bytes]) -> int:
    count = 0
    for block_hash in hashes:
        keys = [f"{digest}/{block_hash.hex()}" for digest in rank_digests]
        if not all(layout.holds(key) for key in keys):
            break
        count += 1
    return count


def inspect_prompt(token_ids: list[int], config: TierCacheConfig, block_size: int, console: Console) -> int:
    """Where the longest cached prefix of a prompt lives, per deployment and tier."""
    from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable
    from tiercache.index.redis_index import RedisIndex
    from tiercache.tiers.disk.layout import DiskLayout
    from tiercache.tiers.s3.passes import registered_deployments

    try:
        hashes = prompt_block_hashes(token_ids, block_size)
    except RuntimeError as error:
        console.print(f"[red]{error}[/red]")
        return EXIT_USAGE
    table = Table(title=f"{len(token_ids)} tokens, {len(hashes)} full blocks of {block_size}")
    for column in ("deployment", "model", "tier", "leading blocks cached"):
        table.add_column(column)
    rows = 0
    if config.redis_url is not None:
        redis = GuardedRedis(config.redis_url, config.redis)
        try:
            index = RedisIndex(redis)
            for dep in registered_deployments(redis):
                if dep.namespace != config.namespace:
                    continue
                found = index.longest_prefix(dep.model_digest, dep.rank_digests, hashes, touch=False)
                table.add_row(dep.model_digest, dep.model, "s3", f"{found} of {len(hashes)}")
                rows += 1
                if config.disk is not None:
                    on_disk = _leading_on_disk(DiskLayout(config.disk.path), dep.rank_digests, hashes)
                    table.add_row(
                        dep.model_digest, dep.model, "disk (this node)", f"{on_disk} of {len(hashes)}"
                    )
        except RedisUnavailable as error:
            console.print(f"[yellow]redis unavailable: {error}[/yellow]")
        finally:
            redis.close()
    elif config.disk is not None and config.disk.path.is_dir():
        # No registry without Redis: every rank digest on this disk is a candidate.
        layout = DiskLayout(config.disk.path)
        for digest in layout.digests():
            on_disk = _leading_on_disk(layout, [digest], hashes)
            table.add_row(f"rank {digest}", "", "disk (this node)", f"{on_disk} of {len(hashes)}")
            rows += 1
    if not rows:
        console.print("[yellow]nothing to look in: configure redis_url or disk.path[/yellow]")
        return EXIT_USAGE
    console.print(table)
    return 0
